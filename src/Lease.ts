/**
 * What a grant gives you: the lock's name, its fencing token, and a way to learn that it is gone.
 *
 * @since 0.1.0
 */
import type * as Effect from "effect/Effect"
import type * as Option from "effect/Option"
import type { FencingToken } from "./FencingToken.js"
import type { LockLost } from "./LockError.js"

/**
 * `exclusive` excludes every other holder; `shared` admits any number of shared holders and
 * excludes exclusive ones.
 *
 * @since 0.1.0
 * @category models
 */
export type LockMode = "exclusive" | "shared"

/**
 * A held lock. It is released when the Scope it was acquired in closes.
 *
 * `lost` fails with `LockLost` the moment this process knows the lock is gone (session died,
 * renewal failed past the safety margin, stolen after expiry, revoked); it never completes
 * otherwise. `isHeld` is what this process knows — false once lost or released — and never
 * queries the store. To guard a body use `DistributedLock.withLock`, which interrupts the body on
 * loss and waits for it to stop before releasing.
 *
 * @since 0.1.0
 * @category models
 */
export interface Lease {
  readonly name: string
  readonly token: FencingToken
  readonly mode: LockMode
  readonly lost: Effect.Effect<never, LockLost>
  readonly isHeld: Effect.Effect<boolean>
}

/**
 * A snapshot of one lease this process holds, as `DistributedLock.inspect` reports it.
 *
 * @since 0.1.0
 * @category models
 */
export interface HeldLock {
  readonly name: string
  readonly token: FencingToken
  readonly mode: LockMode
  readonly backend: string
  /** Clock time (ms since epoch) when the grant was made. */
  readonly since: number
  /** For lease backends: the local deadline before which the lease is certainly still valid. */
  readonly validUntil: Option.Option<number>
}

/**
 * The backend interface (SPI) that every lock store implements and from which
 * `DistributedLock.make` builds the user-facing service. It is deliberately small: a backend
 * grants, renews and releases; timeouts, renewal scheduling, loss detection, interruption of
 * guarded bodies and name validation are written once, in `DistributedLock`.
 *
 * @since 0.1.0
 */
import type * as Duration from "effect/Duration"
import type * as Effect from "effect/Effect"
import type * as Option from "effect/Option"
import type { FencingToken } from "./FencingToken.js"
import type { Lease, LockMode } from "./Lease.js"
import type { LockBackendError, LostReason } from "./LockError.js"

/**
 * What `DistributedLock` asks a backend for.
 *
 * The backend's `acquire` runs **uninterruptibly**: only the steps it wraps in `interruptible`
 * (or `waitUntilDeadline`) can be interrupted, so a grant can never be dropped between the store
 * granting it and `DistributedLock` registering its release. Every such step must leave no grant
 * behind when it is interrupted.
 *
 * @since 0.1.0
 * @category models
 */
export interface AcquireRequest {
  readonly name: string
  readonly mode: LockMode
  /** `once`: a single attempt that never waits for the lock. `wait`: until granted or deadline. */
  readonly attempt: "once" | "wait"
  /** Lease length, already clamped to the backend's bounds. Session-bound backends ignore it. */
  readonly ttl: Duration.Duration
  /**
   * Time past which the caller no longer wants the lock, in milliseconds on the Clock's monotonic
   * timeline (`currentTimeNanos` / 1e6, as `internal/core/clock.ts` reads it); `None` waits forever.
   */
  readonly deadline: Option.Option<number>
  /** Runs a step interruptibly. The step must clean up after itself if interrupted. */
  readonly interruptible: <A, E, R>(step: Effect.Effect<A, E, R>) => Effect.Effect<A, E, R>
  /**
   * Runs a waiting step interruptibly (whatever the caller's region), cut off at the deadline or
   * when the service starts closing (`None` when either came first). The step's result may be
   * discarded when the cut comes as it completes, so use it for steps that grant nothing (a
   * wake-up signal, a sleep); a granting statement raced this way must recover its outcome when
   * cut off (PgAdvisory's wait slice cancels it at the server and undoes a grant that raced).
   */
  readonly waitUntilDeadline: <A, E, R>(step: Effect.Effect<A, E, R>) => Effect.Effect<Option.Option<A>, E, R>
  /** The backend calls this when it learns the grant is gone (session died, revoked). */
  readonly onLost: (reason: LostReason) => Effect.Effect<void>
}

/**
 * The outcome of one acquire: granted, busy (a `once` attempt found it held), or the deadline
 * passed before it was granted.
 *
 * @since 0.1.0
 * @category models
 */
export type AcquireResult<G> =
  | { readonly _tag: "Granted"; readonly grant: G }
  | { readonly _tag: "Busy" }
  | { readonly _tag: "TimedOut" }

/**
 * What the backend hands back for a grant.
 *
 * @since 0.1.0
 * @category models
 */
export interface Grant {
  readonly token: FencingToken
  /**
   * For lease backends: the monotonic Clock time (ms, same timeline as `deadline`) before which
   * the lease is certainly valid in the store (measured from *before* the granting statement was
   * sent). `None` for session-bound locks, which need no renewal.
   */
  readonly validUntil: Option.Option<number>
  /**
   * Gives the grant back. It must be owner-scoped (never release someone else's grant) and
   * bounded; where release cannot be proven, the backend destroys the session holding it.
   */
  readonly release: Effect.Effect<void, LockBackendError>
  /**
   * Optional: starts `release` as the backend's own work — driven by its driver's callbacks, on no
   * fiber of the caller's — and calls `done` once, when it has finished (with the failure, if any).
   * When present, the core waits for it with one callback and one timer (its bound) instead of
   * running `release` as a fiber of the layer: a caller that stops waiting never stops the give-back.
   */
  readonly releaseNow?: ((done: (failure: LockBackendError | undefined) => void) => void) | undefined
}

/**
 * The outcome of renewing one grant.
 *
 * @since 0.1.0
 * @category models
 */
export type RenewOutcome =
  | { readonly _tag: "Renewed"; readonly validUntil: number }
  | { readonly _tag: "Lost"; readonly reason: Extract<LostReason, "expired" | "stolen" | "revoked"> }

/**
 * A lock store.
 *
 * @since 0.1.0
 * @category models
 */
export interface LockBackend<G extends Grant = Grant> {
  /** Short name for spans, metrics and `inspect` (`memory`, `pg-advisory`, `pg-lease`). */
  readonly backend: string
  /** Longest lock name accepted, in UTF-8 bytes. */
  readonly maxNameBytes: number
  /** Lease length when the caller gives none. */
  readonly defaultTtl: Duration.Duration
  /** Shortest lease the store can keep safely; shorter requests are clamped up to it. */
  readonly minTtl: Duration.Duration
  /** Takes the lock, or reports busy or timed out. See `AcquireRequest` for interruption rules. */
  readonly acquire: (request: AcquireRequest) => Effect.Effect<AcquireResult<G>, LockBackendError>
  /**
   * Renews a batch of grants in as few store operations as the backend can (one statement for a
   * whole batch on PgLease). Returns one outcome per grant, in order. Only called for grants with
   * a `validUntil`.
   */
  readonly renew: (grants: ReadonlyArray<G>) => Effect.Effect<ReadonlyArray<RenewOutcome>, LockBackendError>
  /** Most grants `renew` is given at once; a positive integer (`DistributedLock.make` checks). */
  readonly renewBatchSize: number
  /**
   * `true` when `Grant.release` never waits on anything (an in-process store): the core then
   * skips the backstop timeout it otherwise puts around every release, a timer per release.
   * Absent means `false`.
   */
  readonly instantRelease?: boolean | undefined
  /**
   * The store's own wall clock, in milliseconds since the epoch (`select now()` on a database).
   * Optional: a backend that has one lets `DistributedLock.schedule` compute occurrence times on
   * the clock every replica shares, so replicas whose own clocks disagree still agree on when an
   * occurrence is due. Absent: each replica uses its own `Clock`.
   */
  readonly now?: Effect.Effect<number, LockBackendError> | undefined
}

/**
 * What `DistributedSemaphore` asks a backend for: an `AcquireRequest` (same interruption rules,
 * same deadline, same `onLost`) for `permits` of the `limit` permits of the semaphore `name`.
 *
 * @since 0.1.0
 * @category models
 */
export interface PermitRequest extends AcquireRequest {
  /** How many permits the semaphore has; every holder and waiter of one name must agree on it. */
  readonly limit: number
  /** How many permits this request takes at once, all or none: `1 <= permits <= limit`. */
  readonly permits: number
}

/**
 * The outcome of one permit request: as for a lock, or `LimitMismatch` when the name is in use
 * (held or waited for) with another `limit` — never a silent second semaphore.
 *
 * @since 0.1.0
 * @category models
 */
export type PermitResult<G> =
  | AcquireResult<G>
  | { readonly _tag: "LimitMismatch"; readonly current: number }

/**
 * A grant of permits: one `Grant` (renewed, released and lost as one) carrying a fencing token
 * per permit. `token` is the first of `tokens`.
 *
 * @since 0.1.0
 * @category models
 */
export interface PermitGrant extends Grant {
  /** One token per permit, strictly increasing per semaphore name across all grants. */
  readonly tokens: ReadonlyArray<FencingToken>
}

/**
 * A permit store: the same parameters and `renew` contract as `LockBackend`, with an `acquire`
 * that takes a `PermitRequest`. Renewal, loss detection, release and the guard of a body are the
 * core's, exactly as for locks. A grant is lost as a whole: `renew` reports `Lost` when any of
 * its permits is gone.
 *
 * @since 0.1.0
 * @category models
 */
export interface SemaphoreBackend<G extends PermitGrant = PermitGrant> extends Omit<LockBackend<G>, "acquire" | "now"> {
  /** Takes `permits` permits at once, or reports busy, timed out or a limit mismatch. */
  readonly acquire: (request: PermitRequest) => Effect.Effect<PermitResult<G>, LockBackendError>
}

/**
 * A lock store that is also a permit store: what `DistributedSemaphore.layerBackend` turns into
 * a layer providing both `DistributedLock` and `DistributedSemaphore`.
 *
 * @since 0.1.0
 * @category models
 */
export interface LockAndSemaphoreBackend<G extends Grant = Grant, P extends PermitGrant = PermitGrant>
  extends LockBackend<G>
{
  readonly semaphore: SemaphoreBackend<P>
}

/**
 * A lease as `DistributedLock` exposes it, for backends that want to hand it to user code.
 *
 * @since 0.1.0
 * @category models
 */
export type { Lease }

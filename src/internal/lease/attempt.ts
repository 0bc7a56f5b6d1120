/**
 * One grant attempt of a lease backend: the acquire statement, run in a fiber of its own so that the
 * caller can stop waiting for it (interruption, deadline) without its outcome being lost — an
 * abandoned attempt gives back whatever it took, its waiting place included.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Crypto from "node:crypto"
import * as FencingToken from "../../FencingToken.js"
import type { LockMode } from "../../Lease.js"
import type { AcquireRequest, Grant } from "../../LockBackend.js"
import type { LockBackendError } from "../../LockError.js"
import { monotonicMillis } from "../core/clock.js"
import { within } from "../runtime/stallSafe.js"
import type { GiveBack } from "./giveBack.js"
import type { Lane } from "./lane.js"
import type { Owner } from "../runtime/owner.js"

/**
 * A lease held by this process.
 */
export interface LeaseGrant extends Grant {
  readonly name: string
  /** The random owner token of this acquisition, as stored in its row. */
  readonly owner: string
  readonly mode: LockMode
  readonly ttlMillis: number
}

/**
 * What one attempt comes to: granted; not granted (`wakeAt`, monotonic ms: when something could
 * change without a notification — the holder's lease or a waiter's place ahead running out —
 * undefined when unknown; `tookMillis`: how long the statement took, a measure of how long a
 * concurrent one takes); past the deadline; or an outcome `X` of the store's own that ends the
 * request (a semaphore's `LimitMismatch`).
 */
export type Outcome<G, X = never> =
  | { readonly _tag: "Granted"; readonly grant: G }
  | Busy
  | { readonly _tag: "TimedOut" }
  | X

/** Not granted; see `Outcome`. */
export interface Busy {
  readonly _tag: "Busy"
  readonly wakeAt: number | undefined
  readonly tookMillis: number
}

export type Attempt = Outcome<LeaseGrant>

/** How long a waiting place lasts unless its waiter keeps it (by retrying): a dead waiter loses it after this. */
export const PLACE_TTL = Duration.seconds(5)

export interface AttemptSettings {
  readonly application: string
  readonly host: string
  readonly statementTimeout: Duration.Duration
}

export interface AttemptDeps {
  readonly lane: Lane
  readonly giveBack: GiveBack
  /** Creates the tables on first use (a no-op afterwards). */
  readonly ready: Effect.Effect<void, LockBackendError>
  /** Runs the statement fibers as the layer's work, never as the caller's. */
  readonly owner: Owner
  /** The dialect's acquire statement. */
  readonly text: string
}

/**
 * One attempt of `request` for its waiting place `waiter`. `first`: a zero timeout still gets its
 * one attempt, bounded by the statement bound; later attempts past the deadline are not sent.
 */
export type AttemptFn<Q extends AcquireRequest = AcquireRequest, G = LeaseGrant, X = never> = (
  request: Q,
  waiter: string,
  first: boolean
) => Effect.Effect<Outcome<G, X>, LockBackendError>

/**
 * The granting statement of one attempt: sends it for the grant's `owner` and the request's place
 * `waiter`, and says what its answer means. It runs in a fiber of its own (see `attempting`).
 */
export type Statement<Q extends AcquireRequest, G, X> = (
  request: Q,
  owner: string,
  waiter: string,
  ttlMillis: number
) => Effect.Effect<Exclude<Outcome<G, X>, { readonly _tag: "TimedOut" }>, LockBackendError>

/** A not-granted answer: `wait` (ms, from the store) until something could change unannounced. */
export const busy = (wait: number | null, sentAt: number): Effect.Effect<Busy> =>
  Effect.map(monotonicMillis, (receivedAt) => ({
    _tag: "Busy",
    wakeAt: wait === null ? undefined : receivedAt + Math.ceil(wait) + 1,
    tookMillis: receivedAt - sentAt
  }))

/** The lock's attempts: the dialect's acquire statement (see `leaseEngine` for its parameters). */
export const make = (settings: AttemptSettings, deps: AttemptDeps): AttemptFn => {
  const text = deps.text
  const placeMillis = Duration.toMillis(PLACE_TTL)

  const statement: Statement<AcquireRequest, LeaseGrant, never> = (request, owner, waiter, ttlMillis) =>
    Effect.gen(function*() {
      yield* deps.ready
      const { rows, sentAt } = yield* deps.lane.run<{ token: string | null; wait: number | null }>(
        "acquire",
        request.name,
        text,
        [
          request.name,
          owner,
          waiter,
          request.mode,
          ttlMillis,
          placeMillis,
          settings.application,
          settings.host,
          process.pid,
          // Only a request that waits takes a place in the queue.
          request.attempt === "wait"
        ],
        settings.statementTimeout
      )
      const row = rows[0]
      if (row !== undefined && row.token !== null) {
        const grant: LeaseGrant = {
          name: request.name,
          owner,
          mode: request.mode,
          ttlMillis,
          token: FencingToken.make(BigInt(row.token)),
          // Monotonic time before sending: the server's expiry is at least this plus the ttl, also
          // when the answer comes late. The core compares it with the arrival to drop a late grant.
          validUntil: Option.some(sentAt + ttlMillis),
          release: deps.giveBack.release(request.name, owner)
        }
        yield* deps.lane.prepareRenewals
        return { _tag: "Granted", grant } as const
      }
      return yield* busy(row?.wait ?? null, sentAt)
    })

  return attempting(settings, deps, statement)
}

/**
 * Attempts with `statement`, each in a fiber of the layer's own (`Owner`): the caller may
 * stop waiting for it (interrupted, past its deadline) without its outcome being lost — whatever
 * an attempt nobody reads may have taken (a grant, a waiting place) is given back by `giveBack`.
 */
export const attempting = <Q extends AcquireRequest, G, X>(
  settings: AttemptSettings,
  deps: Pick<AttemptDeps, "giveBack" | "owner">,
  statement: Statement<Q, G, X>
): AttemptFn<Q, G, X> => {
  const statementMillis = Duration.toMillis(settings.statementTimeout)
  return (request, waiter, first) =>
    Effect.gen(function*() {
      // The deadline is on the monotonic timeline (the SPI's contract).
      const now = yield* monotonicMillis
      const remaining = Option.map(request.deadline, (deadline) => deadline - now)
      if (Option.isSome(remaining) && remaining.value <= 0 && !first) return { _tag: "TimedOut" } as const
      const byDeadline = Option.isSome(remaining) && remaining.value > 0 && remaining.value < statementMillis
      const owner = Crypto.randomUUID()
      const ttlMillis = Duration.toMillis(request.ttl)
      // The layer's work, not the caller's: it outlives a caller that stops waiting, never joins
      // its transaction, and no stall watch of a body the caller runs in can cut it short.
      const fiber = yield* deps.owner.fork(statement(request, owner, waiter, ttlMillis))
      const abandon = deps.giveBack.abandon(fiber, request.name, owner, waiter, ttlMillis)
      // Awaiting never interrupts the attempt. Its statement is bounded by the lane; only a
      // deadline nearer than that bound needs a timer of its own (stall-safe: an answer already
      // received when it fires is still read).
      const settled = yield* request.interruptible(
        byDeadline ? within(Fiber.await(fiber), Duration.millis(Option.getOrThrow(remaining))) : Effect.asSome(Fiber.await(fiber))
      ).pipe(Effect.onInterrupt(() => abandon))
      if (Option.isNone(settled)) {
        yield* abandon
        return { _tag: "TimedOut" } as const
      }
      const exit = settled.value
      if (Exit.isFailure(exit)) yield* abandon
      return yield* exit
    })
}

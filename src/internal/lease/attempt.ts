/**
 * One grant attempt of a lease backend: the dialect's acquire statement, run in a fiber of its
 * own so that the caller can stop waiting for it (interruption, deadline) without its outcome
 * being lost — an abandoned attempt gives back whatever it took, its waiting place included.
 * Locks and semaphores attempt alike (`attempts`); each says what its request adds to the
 * statement's input and what the answer means (`lockAttempts` here, `Permits.attempts`).
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import type * as Clock from "effect/Clock"
import * as Option from "effect/Option"
import * as Crypto from "node:crypto"
import * as FencingToken from "../../FencingToken.js"
import type { LockMode } from "../../Lease.js"
import type { AcquireRequest, Grant } from "../../LockBackend.js"
import type { LockBackendError } from "../../LockError.js"
import * as Place from "./place.js"
import { clockMillis, monotonicMillis } from "../core/clock.js"
import { Cell } from "../runtime/cell.js"
import { uninterruptibleMaskClock } from "../runtime/mask.js"
import { within } from "../runtime/stallSafe.js"
import type { AttemptInput, LockAcquireAnswer, LockAcquireInput, Statement } from "./dialect.js"
import type { GiveBack } from "./giveBack.js"
import * as Lane from "./lane.js"
import type { Owner } from "../runtime/owner.js"

/** What every lease grant of this process has, a lock's and a semaphore's alike; the token is the store's. */
export interface Held extends Omit<Grant, "token"> {
  readonly name: string
  /** The random owner token of this acquisition, as stored in its row (or holder entry). */
  readonly owner: string
  readonly ttlMillis: number
}

/**
 * A lease held by this process.
 */
export interface LeaseGrant extends Held, Grant {
  readonly mode: LockMode
}

/**
 * What one attempt comes to: granted; not granted (`wakeAt`, monotonic ms: when something could
 * change without a notification — the holder's lease or a waiter's place ahead running out —
 * undefined when unknown; `tookMillis`: how long the statement took, a measure of how long a
 * concurrent one takes); past the deadline; or an outcome `X` of the store's own that ends the
 * request (a semaphore's `LimitMismatch`).
 */
export type Outcome<G, X = never> =
  | Granted<G>
  | Busy
  | { readonly _tag: "TimedOut" }
  | X

export interface Granted<G> {
  readonly _tag: "Granted"
  readonly grant: G
}

/** Not granted; see `Outcome`. */
export interface Busy {
  readonly _tag: "Busy"
  readonly wakeAt: number | undefined
  readonly tookMillis: number
  /** A live waiter's place was ahead of this request's when the store answered. */
  readonly behind: boolean
  /**
   * The store's clock when it answered (epoch ms) less the monotonic time before sending: the
   * store's clock was at most this far ahead of the monotonic one (`lease/handover`). Undefined
   * where the store does not say.
   */
  readonly storeAhead: number | undefined
  /** Monotonic ms before the statement was sent. */
  readonly sentAt: number
}

/** What an answer says, before it is timed: granted, not granted (`wait`: ms from the store, null when unknown), or `X`. */
export type Verdict<G, X> = Granted<G> | NotGranted | X

interface NotGranted {
  readonly _tag: "NotGranted"
  readonly wait: number | null
  readonly behind: boolean
  /** The store's clock when it answered (epoch ms), where it says. */
  readonly now?: number | null | undefined
}

export type Attempt = Outcome<LeaseGrant>

/** How long a waiting place lasts unless its waiter keeps it (by retrying): a dead waiter loses it after this. */
export const PLACE_TTL = Duration.millis(Place.PLACE_TTL_MILLIS)

export interface AttemptSettings {
  readonly application: string
  readonly host: string
  readonly statementTimeout: Duration.Duration
}

export interface AttemptDeps {
  readonly lane: Lane.Lane
  readonly giveBack: GiveBack
  /** Creates the tables on first use (a no-op afterwards). */
  readonly ready: Effect.Effect<void, LockBackendError>
  /** Runs the statement fibers as the layer's work, never as the caller's. */
  readonly owner: Owner
  /** True once `ready` has nothing left to do (the tables exist). */
  readonly isReady: () => boolean
}

/** How one kind of request attempts: its acquire statement, what the request adds to its input, what its answer means. */
export interface AttemptSpec<Q extends AcquireRequest, I, A, G, X> {
  readonly statement: Statement<AttemptInput & I, A>
  readonly input: (request: Q) => I
  /** The grant of `token` from its common part: for kinds of requests a release may hand a lease to. */
  readonly grantOf?: ((request: Q, token: bigint, held: Held) => G) | undefined
  /**
   * `held`: the grant's common part, should the answer be a grant; `handedTo(left)`: the same
   * for a lease a release handed to the request's place, `left` ms of it left at the answer.
   */
  readonly verdict: (answer: A, request: Q, held: Held, handedTo: (leftMillis: number) => Held) => Verdict<G, X>
}

/**
 * One attempt of `request` for its waiting place `waiter`. `first`: a zero timeout still gets its
 * one attempt, bounded by the statement bound; later attempts past the deadline are not sent.
 */
export type AttemptFn<Q extends AcquireRequest = AcquireRequest, G = LeaseGrant, X = never> = ((
  request: Q,
  waiter: string,
  first: boolean
) => Effect.Effect<Outcome<G, X>, LockBackendError>) & {
  /**
   * The grant of a lease a release handed to the place `waiter` (as its notification says), valid
   * until `validUntil` (monotonic ms); undefined for kinds of requests never handed a lease.
   */
  readonly handed?: ((request: Q, waiter: string, token: bigint, validUntil: number) => Granted<G>) | undefined
}

/** The lock's attempts: the dialect's lock acquire statement. */
export const lockAttempts = (
  settings: AttemptSettings,
  deps: AttemptDeps,
  statement: Statement<LockAcquireInput, LockAcquireAnswer>
): AttemptFn =>
  attempts<AcquireRequest, { readonly mode: LockMode }, LockAcquireAnswer, LeaseGrant, never>(settings, deps, {
    statement,
    input: (request) => ({ mode: request.mode }),
    grantOf: lockGrant,
    verdict: (answer, request, held, handedTo) =>
      answer.token === null
        ? { _tag: "NotGranted", wait: answer.wait, behind: answer.behind, now: answer.now }
        : {
          _tag: "Granted",
          grant: lockGrant(
            request,
            answer.token,
            answer.handedLeft === null || answer.handedLeft === undefined ? held : handedTo(answer.handedLeft)
          )
        }
  })

/** A lock's grant of `token`. Spread last: V8 builds `{ ...x, a, b }` (x non-empty) microseconds slower than `{ a, b, ...x }` (bench/README.md). */
const lockGrant = (request: AcquireRequest, token: bigint, held: Held): LeaseGrant => ({
  mode: request.mode,
  token: FencingToken.make(token),
  ...held
})

/**
 * Attempts by `spec`, each run as the layer's work, never as the caller's: the caller may stop
 * waiting for it (interrupted, past its deadline) without its outcome being lost — whatever an
 * attempt nobody reads may have taken (a grant, a waiting place) is given back by `giveBack`. On a
 * lane of the backend's own connections (`Lane.runNow`) the statement and what its answer means
 * run in the driver's callbacks, with no fiber; elsewhere in a fiber of the layer's (`Owner`).
 */
export const attempts = <Q extends AcquireRequest, I, A, G, X extends { readonly _tag: string }>(
  settings: AttemptSettings,
  deps: AttemptDeps,
  spec: AttemptSpec<Q, I, A, G, X>
): AttemptFn<Q, G, X> => {
  const statementMillis = Duration.toMillis(settings.statementTimeout)
  const placeMillis = Duration.toMillis(PLACE_TTL)

  // The request's own part spread last: first, it made V8 build this object ~10 µs slower (bench/README.md).
  const inputOf = (request: Q, owner: string, waiter: string, ttlMillis: number): AttemptInput & I => ({
    name: request.name,
    owner,
    waiter,
    ttlMillis,
    placeMillis,
    application: settings.application,
    host: settings.host,
    pid: process.pid,
    // Only a request that waits takes a place in the queue.
    takePlace: request.attempt === "wait",
    ...spec.input(request)
  })

  /** What an answer means, timed: `sentAt` and `receivedAt` are monotonic ms. */
  const outcomeOf = (request: Q, owner: string, waiter: string, ttlMillis: number, value: A, sentAt: number, receivedAt: number) => {
    const verdict = spec.verdict(
      value,
      request,
      // Monotonic time before sending: the store's expiry is at least this plus the ttl, also
      // when the answer comes late. The core compares it with the arrival to drop a late grant.
      heldBy(request, owner, ttlMillis, sentAt + ttlMillis),
      // Handed to the place: its expiry is at least `left` after the store's now(), which came after sending.
      (left) => heldBy(request, waiter, ttlMillis, sentAt + Math.min(ttlMillis, left))
    )
    if (verdict._tag === "Granted") deps.lane.prepareRenewals()
    if (verdict._tag !== "NotGranted") return verdict as Granted<G> | X
    const { behind, now, wait } = verdict as NotGranted
    return {
      _tag: "Busy",
      wakeAt: wait === null ? undefined : receivedAt + Math.ceil(wait) + 1,
      tookMillis: receivedAt - sentAt,
      behind,
      storeAhead: now === null || now === undefined ? undefined : now - sentAt,
      sentAt
    } satisfies Busy
  }

  /** A grant's common part: `owner`'s lease (an attempt's, or a place's that was handed it). */
  const heldBy = (request: Q, owner: string, ttlMillis: number, validUntil: number): Held => ({
    name: request.name,
    owner,
    ttlMillis,
    validUntil: Option.some(validUntil),
    // With the ttl: a release told failed is repeated in the background until the store answers.
    release: deps.giveBack.release(request.name, owner, ttlMillis),
    releaseNow: deps.giveBack.releaseNow?.(request.name, owner, ttlMillis)
  })

  /** The statement, and what its answer means; run in a fiber of its own. */
  const attempt = (request: Q, owner: string, waiter: string, ttlMillis: number) =>
    Effect.gen(function*() {
      yield* deps.ready
      const { sentAt, value } = yield* Lane.send(deps.lane, request.name, spec.statement, inputOf(request, owner, waiter, ttlMillis), settings.statementTimeout)
      return outcomeOf(request, owner, waiter, ttlMillis, value, sentAt, yield* monotonicMillis)
    })

  /**
   * Starts the attempt as the layer's work; its outcome arrives in the cell. On the lane's
   * callback path (tables ready) no fiber is involved: the answer's callback fills the cell.
   */
  const start = (request: Q, owner: string, waiter: string, ttlMillis: number, clock: Clock.Clock) => {
    const cell = new Cell<Exit.Exit<Outcome<G, X>, LockBackendError>>()
    const runNow = deps.lane.runNow
    if (runNow !== undefined && deps.isReady()) {
      const sentAt = clockMillis(clock)
      Lane.sendNow(runNow, request.name, spec.statement, inputOf(request, owner, waiter, ttlMillis), settings.statementTimeout, (error, value) => {
        if (error !== undefined) return cell.set(Exit.fail(error))
        try {
          cell.set(Exit.succeed(outcomeOf(request, owner, waiter, ttlMillis, value!, sentAt, clockMillis(clock))))
        } catch (defect) {
          cell.set(Exit.die(defect))
        }
      })
      return cell
    }
    deps.owner.unsafeFork(attempt(request, owner, waiter, ttlMillis)).addObserver(cell.set)
    return cell
  }

  const grantOf = spec.grantOf
  const handed = grantOf === undefined ? undefined : (request: Q, waiter: string, token: bigint, validUntil: number): Granted<G> => {
    deps.lane.prepareRenewals()
    return { _tag: "Granted", grant: grantOf(request, token, heldBy(request, waiter, Duration.toMillis(request.ttl), validUntil)) }
  }

  // Uninterruptible but for the wait, whoever calls (the core already is: then it costs nothing,
  // `uninterruptibleMaskClock`): nothing between starting the attempt and the match below can be interrupted, and an
  // interrupted wait reaches the abandon, which an interruptible region would skip.
  const attemptFn = (request: Q, waiter: string, first: boolean): Effect.Effect<Outcome<G, X>, LockBackendError> =>
    // One step for the mask and the clock; no mask at all where the caller is uninterruptible already.
    uninterruptibleMaskClock((restore, clock) => {
      // The deadline is on the monotonic timeline (the SPI's contract).
      const now = clockMillis(clock)
      const remaining = Option.isSome(request.deadline) ? request.deadline.value - now : undefined
      if (remaining !== undefined && remaining <= 0 && !first) return Effect.succeed({ _tag: "TimedOut" } as const)
      const byDeadline = remaining !== undefined && remaining > 0 && remaining < statementMillis
      const owner = Crypto.randomUUID()
      const ttlMillis = Duration.toMillis(request.ttl)
      // The layer's work, not the caller's: it outlives a caller that stops waiting, never joins
      // its transaction, and no stall watch of a body the caller runs in can cut it short.
      const cell = start(request, owner, waiter, ttlMillis, clock)
      // Built only when nobody reads the outcome: nothing on the path of an answered attempt.
      const abandon = (awaited: boolean) => deps.giveBack.abandon(cell.await, request.name, owner, waiter, ttlMillis, awaited)
      // Awaiting never stops the attempt. Its statement is bounded by the lane; only a deadline
      // nearer than that bound needs a timer of its own (stall-safe: an answer already received
      // when it fires is still read).
      const settled: Effect.Effect<Exit.Exit<Outcome<G, X>, LockBackendError> | undefined> = byDeadline
        ? Effect.map(within(cell.await, Duration.millis(remaining)), Option.getOrUndefined)
        : cell.await
      return Effect.matchCauseEffect(restore(request.interruptible(settled)), {
        // Interrupted: the interrupt returns only once the attempt has let go (Effect's contract,
        // as `acquireRelease`): awaited, at most the attempt's statement bound plus the give-back's.
        onFailure: (cause) => Effect.zipRight(abandon(true), Effect.failCause(cause)),
        onSuccess: (exit): Effect.Effect<Outcome<G, X>, LockBackendError> => {
          // Past the deadline: the timeout is reported on time, the give-back follows it (bounded).
          if (exit === undefined) return Effect.as(abandon(false), { _tag: "TimedOut" } as const)
          // Failed: settled already, so its give-back is one statement; in the background as before.
          return Exit.isFailure(exit) ? Effect.zipRight(abandon(false), exit) : exit
        }
      })
    })
  return Object.assign(attemptFn, { handed })
}

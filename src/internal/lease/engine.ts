/**
 * The lease engine: lease rows in a SQL database, whatever the database. It is PgLease's and
 * SqliteLease's backend, assembled from its pieces — the lane its statements travel on, first-use
 * table creation, grant attempts and give-backs, renewal, and wake-ups for waiters — over a
 * `Dialect` (`lease/dialect`): each operation's typed statement (one statement per operation),
 * what a failed table creation means, and which of this process's waiters a give-back's answer
 * names. Expiry is the database's clock only; a statement never runs inside the caller's
 * transaction.
 */
import * as Cause from "effect/Cause"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Random from "effect/Random"
import type * as Scope from "effect/Scope"
import * as Crypto from "node:crypto"
import type { AcquireRequest, AcquireResult, LockAndSemaphoreBackend } from "../../LockBackend.js"
import type { LockBackendError } from "../../LockError.js"
import { monotonicMillis } from "../core/clock.js"
import * as Attempt from "./attempt.js"
import * as GiveBack from "./giveBack.js"
import * as Handover from "./handover.js"
import type { Dialect } from "./dialect.js"
import * as Lane from "./lane.js"
import { uninterruptibleMask } from "../runtime/mask.js"
import type { Owner } from "../runtime/owner.js"
import * as Permits from "./permits.js"
import * as Place from "./place.js"
import * as Renew from "./renew.js"
import * as Sweep from "./sweep.js"
import type { Subscription, WakeHub } from "./waiters.js"
import { CREATE_ATTEMPTS } from "../sql/tables.js"

/** Longest lock name, in UTF-8 bytes; a btree entry could take ~2700, this leaves room. */
export const MAX_NAME_BYTES = 1024
export const MIN_TTL = Duration.seconds(1)
/**
 * While notifications are proven to arrive, a waiter still re-reads the row at least every
 * this many check intervals, in case a wake-up was lost on a healthy-looking listener. A dead
 * listener is caught sooner, by its next check, which wakes every waiter.
 */
const TRUSTED_POLL_FACTOR = 6
/** The look again after taking a place: this many times the taking statement's duration, plus a floor. */
const FOLLOW_UP_FACTOR = 3
const FOLLOW_UP_MIN_MILLIS = 5

export interface Settings extends Attempt.AttemptSettings {
  readonly defaultTtl: Duration.Duration
  readonly pollInterval: Duration.Duration
  readonly checkInterval: Duration.Duration
  /** Create the table on first use. */
  readonly createTable: boolean
  /** How often idle names' rows are swept (zero: never). */
  readonly sweepInterval: Duration.Duration
  /**
   * Whether every give-back sees every place committed before it (one atomic script at a time, as
   * on Redis): then a waiter needs no look again after taking its place. Default false: a SQL
   * release's snapshot can predate a place committed while it runs.
   */
  readonly placesSeenByEveryRelease?: boolean | undefined
}

/**
 * Builds the backend on `lane`, locks and semaphores (sharing the lane, the tables' creation and
 * the wake-ups). The tables are created on the first acquire, not here, so an application can
 * start while the database is down. `hub`: where waiters are woken from (undefined: they only poll).
 */
export const make = (
  lane: Lane.Lane,
  settings: Settings,
  dialect: Dialect,
  hub: WakeHub | undefined,
  owner: Owner
): Effect.Effect<LockAndSemaphoreBackend<Attempt.LeaseGrant, Permits.PermitLeaseGrant>, never, Scope.Scope> =>
  Effect.gen(function*() {
    const { locks, permits } = dialect
    const giveBack = yield* GiveBack.make(lane, settings.statementTimeout, locks.release, hub, owner, locks.wakeSharedHeads)
    const { ready, isReady } = yield* tableReadiness(lane, settings, locks.ensureTable, dialect.retryCreate)
    const attempt = Attempt.lockAttempts(settings, { lane, giveBack, ready, isReady, owner }, locks.acquire)
    // A lock handed to the place of a request that ended (its leave failed or is on its way):
    // given back as the layer's work, owner-scoped (a no-op once the leave freed it).
    hub?.onHandedToEnded?.((name, waiter) => owner.unsafeFork(Effect.ignore(giveBack.release(name, waiter))))
    const acquire = acquirer(settings, hub, attempt, giveBack, lockKey)

    const permitGiveBack = yield* GiveBack.make(lane, settings.statementTimeout, permits.release, hub, owner)
    // Created apart from the lock tables: locks never wait for (or need the privilege to create) it.
    const permitReady = yield* tableReadiness(lane, settings, permits.ensureTable, dialect.retryCreate)
    const permitAttempt = Permits.attempts(settings, { lane, giveBack: permitGiveBack, ...permitReady, owner }, permits.acquire)

    // Idle names' rows, of the tables this layer has made sure of.
    yield* Sweep.start(lane, [
      { statement: locks.sweep, ready: isReady },
      { statement: permits.sweep, ready: permitReady.isReady }
    ], settings.sweepInterval, settings.statementTimeout, owner)

    // The clock every replica shares: schedules compare occurrence times on it.
    const now = Effect.map(owner.run(Lane.send(lane, undefined, dialect.now, undefined, settings.statementTimeout)), ({ value }) => value)
    return {
      backend: dialect.backend,
      maxNameBytes: MAX_NAME_BYTES,
      defaultTtl: settings.defaultTtl,
      minTtl: MIN_TTL,
      renewBatchSize: Renew.RENEW_BATCH_SIZE,
      acquire,
      renew: Renew.make(lane, locks.renew, settings.statementTimeout),
      now,
      semaphore: {
        backend: dialect.backend,
        maxNameBytes: MAX_NAME_BYTES,
        defaultTtl: settings.defaultTtl,
        minTtl: MIN_TTL,
        renewBatchSize: Renew.RENEW_BATCH_SIZE,
        acquire: acquirer(settings, hub, permitAttempt, permitGiveBack, semaphoreKey),
        renew: Renew.make(lane, permits.renew, settings.statementTimeout)
      }
    }
  })

/** Waiters of a lock subscribe to wake-ups under its name (a revoke wakes them all by it). */
const lockKey = (name: string) => name
/**
 * Waiters of a semaphore subscribe under a key no lock name can have (lock names never contain
 * NUL): a lock revoked by name never wakes a semaphore's waiters, nor the reverse.
 */
const semaphoreKey = (name: string) => `\u0000${name}`

/**
 * Acquires with `attempt`: one attempt for a request that does not wait, else attempts until
 * granted or the deadline; the first attempt that finds it busy also takes this request's place
 * in the queue, and later ones keep it. Subscribed to wake-ups (under `key(name)`) before the
 * first attempt, and the wake-up count is taken before each attempt and waited on after it: a
 * wake-up that lands at any moment after subscribing ends the next wait at once. Leaving without
 * a grant gives the place up at once (else it would block those behind it until it expires).
 */
const acquirer = <Q extends AcquireRequest, G, X extends { readonly _tag: string }>(
  settings: Settings,
  hub: WakeHub | undefined,
  attempt: Attempt.AttemptFn<Q, G, X>,
  giveBack: GiveBack.GiveBack,
  key: (name: string) => string
) => {
  const pollMillis = Duration.toMillis(settings.pollInterval)

  const sleepFor = (wakeAt: number | undefined, deadline: Option.Option<number>) =>
    Effect.gen(function*() {
      // With a listener that proves it hears, a waiter sleeps until something could change
      // unannounced (a crashed holder or waiter ahead sends nothing) or a long re-check.
      // Otherwise it polls, jittered. Either way it retries before its place could expire.
      const trusted = hub !== undefined && wakeAt !== undefined && (yield* hub.trusted)
      const jitter = yield* Random.next
      const cap = trusted ? Duration.toMillis(settings.checkInterval) * TRUSTED_POLL_FACTOR : pollMillis * (0.5 + jitter / 2)
      const now = yield* monotonicMillis
      const untilChange = wakeAt === undefined ? Number.POSITIVE_INFINITY : wakeAt - now
      // Never past the deadline: the next attempt then reports the timeout.
      const untilDeadline = Option.match(deadline, { onNone: () => Number.POSITIVE_INFINITY, onSome: (at) => at - now })
      return Duration.millis(Math.max(0, Math.min(cap, Place.PLACE_RETRY_MILLIS, untilChange, untilDeadline)))
    })

  /**
   * Attempts until not busy, waiting between attempts. Plain flatMaps, not a generator: the first
   * attempt is on every acquire's path, and a generator costs its frames and steps on each.
   */
  const waitFor = (
    request: Q,
    waiter: string,
    subscription: Subscription | undefined
  ): Effect.Effect<Attempt.Granted<G> | { readonly _tag: "TimedOut" } | X, LockBackendError> => {
    // What this request's answers say of the store's clock: a lease handed to its place is timed by them.
    const samples: Array<Handover.Sample> = []
    const attemptFrom = (first: boolean) => (mark: number) =>
      Effect.flatMap(attempt(request, waiter, first), (result) => isBusy(result) ? waitThen(result, mark, first) : Effect.succeed(result))
    /** After a wake-up: the lease a release handed to this place, granted with no statement; else the next attempt. */
    const afterWake = () => {
      const handed = subscription?.handed()
      if (handed !== undefined && attempt.handed !== undefined) {
        const until = Handover.validUntil(handed.expiresMs, samples)
        if (until !== undefined) return Effect.succeed(attempt.handed(request, waiter, handed.token, until))
      }
      return next(false)
    }
    // Each attempt takes the wake-up count before it is sent, and waits on it after.
    const next = (first: boolean) =>
      subscription === undefined ? attemptFrom(first)(0) : Effect.flatMap(subscription.mark, attemptFrom(first))
    const waitThen = (result: Attempt.Busy, mark: number, first: boolean) => {
      Handover.remember(samples, result.storeAhead, result.sentAt)
      // A release that started before this request's place was committed cannot see it, so
      // it wakes nobody for it: after taking its place, a waiter looks again once such a
      // release has had time to commit (a few of its own statement times). Not where every
      // release sees every committed place: its wake-up is on the way (subscribed before). Nor
      // behind a live place: such a release wakes that waiter, and the release after its turn
      // (a later statement) sees this place. Left open: that waiter granted and released while
      // this place's statement still ran; this one then sleeps until its place's refresh.
      const followUp = first && !result.behind && settings.placesSeenByEveryRelease !== true
        ? Duration.millis(FOLLOW_UP_FACTOR * result.tookMillis + FOLLOW_UP_MIN_MILLIS)
        : undefined
      return Effect.flatMap(sleepFor(result.wakeAt, request.deadline), (sleep) => {
        const delay = Duration.min(sleep, followUp ?? Duration.infinity)
        // Only waits are interruptible or cut at the deadline; they grant nothing.
        return Effect.flatMap(
          request.waitUntilDeadline(subscription === undefined ? Effect.sleep(delay) : subscription.wait(mark, delay)),
          // Recursion through flatMap is a loop: the runtime returns to its run loop between steps.
          (woke): Effect.Effect<Attempt.Granted<G> | { readonly _tag: "TimedOut" } | X, LockBackendError> =>
            Option.isNone(woke) ? Effect.succeed({ _tag: "TimedOut" } as const) : afterWake()
        )
      })
    }
    return next(true)
  }

  /** Subscribed (no scope: taken off again in the same step as the place is given up) for the whole wait. */
  const subscribedWait = (request: Q, waiter: string) =>
    Effect.flatMap(hub === undefined ? Effect.succeed(undefined) : hub.subscribeNow(key(request.name), waiter), (registered) =>
      // `Effect.onExit` by hand (the clean-up only ever dies): no mask where the caller is
      // uninterruptible already (the core), and a grant goes on in one step.
      uninterruptibleMask((restore) =>
        Effect.matchCauseEffect(restore(waitFor(request, waiter, registered?.subscription)), {
          onFailure: (cause) => {
            registered?.unsubscribe()
            // Interrupted: the place is gone before the interrupt returns (awaited, one statement
            // bound), else a try right after it would find a waiter ahead; otherwise in the background.
            return Effect.matchCauseEffect(giveBack.leave(request.name, waiter, Cause.isInterrupted(cause)), {
              // As `Effect.onExit`: a clean-up that dies adds its cause to the first.
              onFailure: (again) => Effect.failCause(Cause.sequential(cause, again)),
              onSuccess: () => Effect.failCause(cause)
            })
          },
          onSuccess: (result) => {
            registered?.unsubscribe(isGranted(result))
            return isGranted(result) ? Effect.succeed(result) : Effect.as(giveBack.leave(request.name, waiter, false), result)
          }
        })
      ))

  return (request: Q): Effect.Effect<AcquireResult<G> | X, LockBackendError> =>
    Effect.suspend(() => {
      // This request's place in the queue, kept across its attempts (each has its own owner).
      const waiter = Crypto.randomUUID()
      if (request.attempt === "wait") return subscribedWait(request, waiter)
      return Effect.map(attempt(request, waiter, true), (result) => (isBusy(result) ? { _tag: "Busy" } as const : result))
    })
}

const isBusy = (result: { readonly _tag: string }): result is Attempt.Busy => result._tag === "Busy"
const isGranted = (result: { readonly _tag: string }): boolean => result._tag === "Granted"

/**
 * Creates the tables once per backend, on first use (`ready`); a failure is retried by the next
 * acquire. `isReady`: nothing left to create.
 */
const tableReadiness = (
  lane: Lane.Lane,
  settings: Settings,
  ensureTable: Dialect["locks"]["ensureTable"],
  retryCreate: Dialect["retryCreate"]
): Effect.Effect<{ readonly ready: Effect.Effect<void, LockBackendError>; readonly isReady: () => boolean }> =>
  Effect.gen(function*() {
    let ready = !settings.createTable
    const lock = yield* Effect.makeSemaphore(1)
    const create = Effect.forEach(
      ensureTable,
      (statement) =>
        Lane.send(lane, undefined, statement, undefined, settings.statementTimeout).pipe(
          Effect.retry({ times: CREATE_ATTEMPTS - 1, while: retryCreate })
        ),
      { discard: true }
    ).pipe(
      Effect.tap(() =>
        Effect.sync(() => {
          ready = true
        })
      )
    )
    return {
      ready: Effect.suspend(() => (ready ? Effect.void : lock.withPermits(1)(Effect.suspend(() => (ready ? Effect.void : create))))),
      isReady: () => ready
    }
  })

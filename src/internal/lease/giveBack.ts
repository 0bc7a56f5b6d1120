/**
 * Giving back: the holder's release, a waiter's place when it stops waiting, and everything an
 * attempt may have taken when nobody reads its outcome (interrupted, past its deadline, failed
 * ambiguously). One statement does all three, owner-scoped — it frees a lease only while this
 * acquisition's random owner holds it — so a retry, or a give-back landing late, never frees
 * someone else's lease; and when it frees the lock it wakes the waiters now at the head.
 *
 * An attempt whose outcome is unknown (no answer within its bound: its connection was destroyed,
 * but the server may still be running its statement, waiting behind a row lock, say) can still
 * commit its grant after a give-back has found nothing to free. Its give-back is therefore
 * repeated, spaced out, until it frees the lease or the lease would have expired anyway: a grant
 * committed late is freed within one spacing of its commit, never left held until its ttl.
 *
 * A holder's release that got no answer within its bound (the store stalled, or no connection
 * came) is repeated the same way in the background, until one is answered: the lease is still its
 * owner's, and is freed once the store answers again, not left until its ttl.
 */
import * as Cause from "effect/Cause"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import type { LockBackendError } from "../../LockError.js"
import { monotonicMillis, sleepMillis } from "../core/clock.js"
import type { ReleaseAnswer, ReleaseInput, Statement, WakeSharedInput } from "./dialect.js"
import * as Lane from "./lane.js"
import type { WakeHub } from "./waiters.js"
import * as Owner from "../runtime/owner.js"
import { sqliteCodeOf, sqlStateOf } from "../sql/state.js"

/** Attempts of a release before it gives up and leaves the lease to expire. */
const RELEASE_RETRIES = 2
const RELEASE_RETRY_SPACING = Duration.millis(50)
/** How long closing the layer waits for give-backs still running, beyond one statement bound. */
const SHUTDOWN_GIVE_BACK = Duration.seconds(3)
/** Spacing of an abandoned attempt's repeated give-backs: from the first to the longest. */
const ABANDON_FIRST_SPACING_MS = 50
const ABANDON_MAX_SPACING_MS = 1_000
/** Slack of an interrupted caller's wait for its give-back over the statements' own bounds. */
const AWAIT_GRACE_MS = 250

export interface GiveBack {
  /**
   * The holder's release: retried, at most `statementTimeout` in all. With the lease's `ttlMillis`:
   * when that fails, repeated in the background until answered or the lease would have expired.
   */
  readonly release: (name: string, owner: string, ttlMillis?: number) => Effect.Effect<void, LockBackendError>
  /**
   * `release` driven by the lane's callbacks (`Lane.runNow`), no fiber: the grant's
   * `Grant.releaseNow`. Undefined on a lane without a callback path.
   */
  readonly releaseNow:
    | ((name: string, owner: string, ttlMillis?: number) => (done: (failure: LockBackendError | undefined) => void) => void)
    | undefined
  /**
   * Leaves the waiting place `waiter`, as the layer's work (a place left behind expires by itself).
   * `awaited`: the caller waits for it, at most one statement bound (an interrupted waiter);
   * otherwise this returns at once.
   */
  readonly leave: (name: string, waiter: string, awaited: boolean) => Effect.Effect<void>
  /**
   * Once `attempt` settles, gives back what it may have taken (its grant, its waiting place), as
   * the layer's work, retried with backoff until the lease would have expired anyway. `awaited`:
   * the caller waits for the first give-back, at most two statement bounds (the attempt's still
   * in flight, then the give-back's) — an interrupted caller, which must have let go when its
   * interrupt returns; the repeats go on in the background. Otherwise this returns at once.
   */
  readonly abandon: (
    /** The attempt's outcome, once it has one. */
    attempt: Effect.Effect<Exit.Exit<unknown, LockBackendError>>,
    name: string,
    owner: string,
    waiter: string,
    ttlMillis: number,
    awaited: boolean
  ) => Effect.Effect<void>
}

export const make = (
  lane: Lane.Lane,
  statementTimeout: Duration.Duration,
  statement: Statement<ReleaseInput, ReleaseAnswer>,
  hub: WakeHub | undefined,
  owner: Owner.Owner,
  wakeSharedHeads?: Statement<WakeSharedInput, void>
): Effect.Effect<GiveBack, never, Scope.Scope> =>
  Effect.gen(function*() {
    /**
     * What a give-back's answer asks of this process: wake-ups. `afterFailure`: an earlier try of
     * this give-back failed, so it may have committed with its answer lost.
     */
    const answered = (name: string, value: ReleaseAnswer, afterFailure: boolean): void => {
      // Waiters of this process that the release found at the head are woken without a round trip.
      if (hub !== undefined && value.wake.length > 0) hub.wake(value.wake)
      // The readers behind 16 shared heads fit too: woken by a statement of their own, as the
      // layer's work (a wake-up only: a failure leaves them to their next retry, within 1.5 s).
      // A try that frees nothing after a failed one may follow a first try that did commit, its
      // crowd signal lost with its answer: the wake is sent then too (it wakes only shared heads).
      const crowd = value.crowd === true || (afterFailure && !value.released)
      if (crowd && wakeSharedHeads !== undefined) {
        owner.unsafeFork(Effect.ignore(Lane.send(lane, name, wakeSharedHeads, { name }, statementTimeout)))
      }
    }
    /** One give-back statement; true when it freed a lease. `afterFailure`: see `answered`. */
    const giveBack = (name: string, grantOwner: string | null, waiter: string | null, bound = statementTimeout, afterFailure = false) =>
      Lane.send(lane, name, statement, { name, owner: grantOwner, waiter }, bound).pipe(
        Effect.map(({ value }) => {
          answered(name, value, afterFailure)
          return value.released
        })
      )

    // Background give-backs are awaited (bounded) when the layer closes: cut short, they would
    // leave a row held until its ttl runs out. Added before the lane's finalizers run, so the lane
    // is still open; attempts still in flight are bounded by one statement bound, awaited too.
    const running = new Set<Fiber.RuntimeFiber<void>>()
    const shutdownWait = Duration.sum(statementTimeout, SHUTDOWN_GIVE_BACK)
    let closing = false
    yield* Effect.addFinalizer(() =>
      Effect.suspend(() => {
        // A failed release's repeats stop here: shutdown waits for give-backs under way, not for a store that is down.
        closing = true
        const fibers = Array.from(running)
        return Effect.forEach(Array.from(repeating), Fiber.interrupt, { discard: true }).pipe(
          Effect.zipRight(Owner.awaitAll(fibers, Duration.toMillis(shutdownWait))),
          Effect.zipRight(Effect.forEach(fibers, Fiber.interrupt, { discard: true }))
        )
      })
    )
    /** Runs `self` as the layer's work, tracked for shutdown: it outlives the caller (and its transaction). */
    const background = (self: Effect.Effect<void>) =>
      Effect.flatMap(owner.fork(self), (fiber) =>
        Effect.sync(() => {
          running.add(fiber)
          fiber.addObserver(() => running.delete(fiber))
          return fiber
        }))
    /**
     * A failed release's repeats, on the layer's runtime from a driver's callback or a fiber:
     * stopped (interrupted) as the layer starts closing, never waited for — the store may be down.
     */
    const repeating = new Set<Fiber.RuntimeFiber<void>>()
    const repeatNow = (self: Effect.Effect<void>): void => {
      if (closing) return
      const fiber = owner.unsafeFork(self)
      repeating.add(fiber)
      fiber.addObserver(() => repeating.delete(fiber))
    }
    /**
     * `background`; when `awaited`, the caller also waits for it to end, at most `millis` (a timer
     * and an observer, no fiber of the caller's). The work runs on the layer's runtime either way:
     * it finishes whether or not anybody waits, and past the bound the caller goes on without it.
     */
    const backgroundAwaited = (self: Effect.Effect<void>, awaited: boolean, millis: number) =>
      awaited
        ? Effect.flatMap(background(self), (fiber) => Owner.awaitWithin(fiber, millis))
        : background(self)

    const totalMillis = Duration.toMillis(statementTimeout)
    /**
     * A give-back retried within one statement bound in all; with `ttlMillis` (a holder's release),
     * repeated in the background after that (`repeatRelease`) when every try failed.
     */
    const retried = (
      name: string,
      grantOwner: string | null,
      waiter: string | null,
      ttlMillis?: number
    ): Effect.Effect<void, LockBackendError> =>
      Effect.gen(function*() {
        const deadline = (yield* monotonicMillis) + totalMillis
        for (let attempt = 0;; attempt++) {
          // Each try gets what is left of the whole bound; owner-scoped and idempotent, so a
          // retry after an ambiguous failure is safe.
          const left = deadline - (yield* monotonicMillis)
          const outcome = yield* Effect.either(giveBack(name, grantOwner, waiter, Duration.millis(Math.max(1, left)), attempt > 0))
          if (outcome._tag === "Right") return
          const spent = deadline - (yield* monotonicMillis) <= Duration.toMillis(RELEASE_RETRY_SPACING)
          if (attempt >= RELEASE_RETRIES || spent) {
            if (ttlMillis !== undefined && grantOwner !== null) repeatRelease(name, grantOwner, ttlMillis)
            return yield* outcome.left
          }
          yield* Effect.sleep(RELEASE_RETRY_SPACING)
        }
      })
    /**
     * The give-back repeated, spaced out, until `enough` of an answer (whether it freed a lease) or
     * `expiresBy` (monotonic ms), whichever is first. Owner-scoped: a repeat never frees another's.
     */
    const repeated = (
      name: string,
      grantOwner: string | null,
      waiter: string | null,
      expiresBy: number,
      enough: (freed: boolean) => boolean,
      /** Whether the give-back before the first repeat failed (see `answered`). */
      failedBefore: boolean
    ): Effect.Effect<void> =>
      Effect.gen(function*() {
        let spacing = ABANDON_FIRST_SPACING_MS
        let afterFailure = failedBefore
        while (true) {
          const left = expiresBy - (yield* monotonicMillis)
          if (left <= 0) return
          yield* sleepMillis(Math.min(spacing, left))
          spacing = Math.min(ABANDON_MAX_SPACING_MS, spacing * 2)
          const again = yield* Effect.either(giveBack(name, grantOwner, waiter, statementTimeout, afterFailure))
          if (again._tag === "Right" && enough(again.right)) return
          afterFailure = again._tag === "Left"
        }
      })
    /**
     * A release told failed, repeated in the background until any answer (it freed the lease, or
     * it was no longer the owner's) or the lease would have expired: the lease was renewed last
     * before the release began, so it expires within its ttl from now.
     */
    const repeatRelease = (name: string, grantOwner: string, ttlMillis: number): void =>
      repeatNow(Effect.flatMap(monotonicMillis, (now) => repeated(name, grantOwner, null, now + ttlMillis, () => true, true)))
    const release: GiveBack["release"] = (name, owner, ttlMillis) => retried(name, owner, null, ttlMillis)

    const runNow = lane.runNow
    const spacingMillis = Duration.toMillis(RELEASE_RETRY_SPACING)
    const releaseNow: GiveBack["releaseNow"] = runNow === undefined ? undefined : (name, grantOwner, ttlMillis) => (done) => {
      // `release`'s rule, on callbacks: each try gets what is left of the whole bound.
      const deadline = performance.now() + totalMillis
      let attempt = 0
      const once = () =>
        Lane.sendNow(runNow, name, statement, { name, owner: grantOwner, waiter: null }, Duration.millis(Math.max(1, deadline - performance.now())), (error, value) => {
          if (error === undefined) {
            answered(name, value!, attempt > 0)
            return done(undefined)
          }
          if (attempt >= RELEASE_RETRIES || deadline - performance.now() <= spacingMillis) {
            // Told failed within its bound; the lease is still this owner's: given back once the store answers.
            if (ttlMillis !== undefined) repeatRelease(name, grantOwner, ttlMillis)
            return done(error)
          }
          attempt++
          // Owner-scoped and idempotent: a retry after an ambiguous failure is safe.
          setTimeout(once, spacingMillis)
        })
      once()
    }

    // An awaited leave is a give-back retried within one statement bound, and some slack for the fiber.
    const leaveWaitMillis = totalMillis + AWAIT_GRACE_MS
    const leave: GiveBack["leave"] = (name, waiter, awaited) =>
      // Retried as a release is: a lease a release handed to the place as it left is freed by it,
      // not left to its ttl; a place left behind would hold those behind it until it expires.
      backgroundAwaited(Effect.ignore(retried(name, null, waiter)), awaited, leaveWaitMillis)

    // An awaited abandon is the attempt still in flight (its statement bound), then one give-back.
    const abandonWaitMillis = 2 * totalMillis + AWAIT_GRACE_MS
    const abandon: GiveBack["abandon"] = (attempt, name, grantOwner, waiter, ttlMillis, awaited) =>
      backgroundAwaited(Effect.gen(function*() {
        // Never ahead of the attempt: a give-back sent first could be overtaken by its own grant.
        const exit = yield* attempt
        // The lease the attempt may have taken lasts at most its ttl from now: every send of it
        // (resends included) began before it settled, and the server counts from its statement's start.
        const expiresBy = (yield* monotonicMillis) + ttlMillis
        // Answered, or refused by the server: whatever it took is committed already. Otherwise
        // its statement may still commit later, and an empty give-back proves nothing yet.
        const unknown = outcomeUnknown(exit)
        const freed = yield* Effect.either(giveBack(name, grantOwner, waiter))
        if (freed._tag === "Right" && (freed.right || !unknown)) return
        // Repeats in a fiber of their own: an awaiting caller waits for the first give-back only.
        yield* background(repeated(name, grantOwner, waiter, expiresBy, (again) => again || !unknown, freed._tag === "Left"))
      }), awaited, abandonWaitMillis)

    return { release, releaseNow, leave, abandon }
  })

/**
 * Whether an attempt that ended so may still commit a grant at the store: interrupted or cut off
 * at its bound (its connection destroyed while the server may still run it), or failed without
 * the store's word. A SQLSTATE is PostgreSQL refusing the statement, an `SQLITE_` code SQLite
 * refusing it (its statements run in process): either way nothing of it committed.
 */
const outcomeUnknown = (exit: Exit.Exit<unknown, LockBackendError>): boolean => {
  if (Exit.isSuccess(exit)) return false
  const failure = Cause.failureOption(exit.cause)
  return Option.isNone(failure) || (sqlStateOf(failure.value) === undefined && sqliteCodeOf(failure.value) === undefined)
}

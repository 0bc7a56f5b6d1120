/**
 * Giving back: the holder's release, a waiter's place when it stops waiting, and everything an
 * attempt may have taken when nobody reads its outcome (interrupted, past its deadline, failed
 * ambiguously). One statement does all three, owner-scoped — it frees a lease only while this
 * acquisition's random owner holds it — so a retry, or a give-back landing late, never frees
 * someone else's lease; and when it frees the lock it wakes the waiters now at the head.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Schedule from "effect/Schedule"
import type * as Scope from "effect/Scope"
import type { LockBackendError } from "../LockError.js"
import { monotonicMillis } from "./clock.js"
import { within } from "./stallSafe.js"
import { type Lane, outsideTransaction } from "./leaseLane.js"
import type { WakeHub } from "./leaseWaiters.js"

/** Attempts of a release before it gives up and leaves the lease to expire. */
const RELEASE_RETRIES = 2
const RELEASE_RETRY_SPACING = Duration.millis(50)
/** How long closing the layer waits for give-backs still running. */
const SHUTDOWN_GIVE_BACK = Duration.seconds(3)

/** What giving back needs of the dialect. */
export interface GiveBackDialect {
  readonly release: string
  readonly releaseParams: (name: string, owner: string | null, waiter: string | null) => ReadonlyArray<unknown>
  readonly wokenBy: (rows: ReadonlyArray<object>) => ReadonlyArray<string>
}

export interface GiveBack {
  /** The holder's release: retried, at most `statementTimeout` in all. */
  readonly release: (name: string, owner: string) => Effect.Effect<void, LockBackendError>
  /** Leaves the waiting place `waiter` (in the background; a place left behind expires by itself). */
  readonly leave: (name: string, waiter: string) => Effect.Effect<void>
  /**
   * Once `attempt` settles, gives back what it may have taken (its grant, its waiting place),
   * retried with backoff until the lease would have expired anyway. Returns at once.
   */
  readonly abandon: (
    attempt: Fiber.Fiber<unknown, LockBackendError>,
    name: string,
    owner: string,
    waiter: string,
    ttlMillis: number
  ) => Effect.Effect<void>
}

export const make = (
  lane: Lane,
  statementTimeout: Duration.Duration,
  dialect: GiveBackDialect,
  hub: WakeHub | undefined
): Effect.Effect<GiveBack, never, Scope.Scope> =>
  Effect.gen(function*() {
    const giveBack = (name: string, owner: string | null, waiter: string | null, bound = statementTimeout) =>
      lane.run("release", name, dialect.release, dialect.releaseParams(name, owner, waiter), bound).pipe(
        // Waiters of this process that the release found at the head are woken without a round trip.
        Effect.tap(({ rows }) => hub === undefined ? Effect.void : Effect.sync(() => hub.wake(dialect.wokenBy(rows))))
      )

    // Background give-backs are awaited (bounded) when the layer closes: cut short, they would
    // leave a row held until its ttl runs out. Added before the lane's finalizers run, so the lane is still open.
    const running = new Set<Fiber.RuntimeFiber<void>>()
    yield* Effect.addFinalizer(() =>
      Effect.suspend(() => {
        const fibers = Array.from(running)
        return within(Effect.forEach(fibers, Fiber.await, { discard: true }), SHUTDOWN_GIVE_BACK).pipe(
          Effect.zipRight(Effect.forEach(fibers, Fiber.interrupt, { discard: true }))
        )
      })
    )
    /** Runs `self` in a daemon fiber tracked for shutdown; never inside the caller's transaction (it outlives it). */
    const background = (self: Effect.Effect<void>) =>
      outsideTransaction(Effect.forkDaemon(Effect.interruptible(self))).pipe(
        Effect.tap((fiber) =>
          Effect.sync(() => {
            running.add(fiber)
            fiber.addObserver(() => running.delete(fiber))
          })
        ),
        Effect.asVoid
      )

    const totalMillis = Duration.toMillis(statementTimeout)
    const release = (name: string, owner: string): Effect.Effect<void, LockBackendError> =>
      Effect.gen(function*() {
        const deadline = (yield* monotonicMillis) + totalMillis
        for (let attempt = 0;; attempt++) {
          // Each try gets what is left of the whole bound; owner-scoped and idempotent, so a
          // retry after an ambiguous failure is safe.
          const left = deadline - (yield* monotonicMillis)
          const outcome = yield* Effect.either(giveBack(name, owner, null, Duration.millis(Math.max(1, left))))
          if (outcome._tag === "Right") return
          const spent = deadline - (yield* monotonicMillis) <= Duration.toMillis(RELEASE_RETRY_SPACING)
          if (attempt >= RELEASE_RETRIES || spent) return yield* outcome.left
          yield* Effect.sleep(RELEASE_RETRY_SPACING)
        }
      })

    const leave = (name: string, waiter: string) => background(Effect.ignore(giveBack(name, null, waiter)))

    const abandon: GiveBack["abandon"] = (attempt, name, owner, waiter, ttlMillis) =>
      background(Effect.zipRight(
        Fiber.await(attempt),
        giveBack(name, owner, waiter).pipe(
          Effect.retry(Schedule.exponential(Duration.millis(50)).pipe(Schedule.upTo(Duration.millis(ttlMillis)))),
          Effect.ignore
        )
      ))

    return { release, leave, abandon }
  })

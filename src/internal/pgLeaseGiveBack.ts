/**
 * Giving lease rows back: the holder's release, and the give-back of an attempt whose outcome
 * nobody reads (interrupted, timed out, failed ambiguously), which may still have taken the row.
 * Every statement is owner-scoped — it frees the row only while this acquisition's random owner
 * holds it — so a retry, or a give-back landing late, never frees someone else's lease.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Schedule from "effect/Schedule"
import type * as Scope from "effect/Scope"
import type { LockBackendError } from "../LockError.js"
import type { Lane } from "./pgLeaseLane.js"
import { outsideTransaction } from "./pgLeaseLane.js"
import * as Sql from "./pgLeaseSql.js"
import { monotonicMillis } from "./clock.js"
import { timeoutOption } from "./pgLeaseBound.js"

/** Attempts of a release before it gives up and leaves the lease to expire. */
const RELEASE_RETRIES = 2
const RELEASE_RETRY_SPACING = Duration.millis(50)
/** How long closing the layer waits for give-backs still running. */
const SHUTDOWN_GIVE_BACK = Duration.seconds(3)

export interface GiveBackSettings {
  readonly table: Sql.TableRef
  readonly channel: string
  readonly statementTimeout: Duration.Duration
}

export interface GiveBack {
  /** The holder's release: owner-scoped, retried, at most `statementTimeout` in all. */
  readonly release: (name: string, owner: string) => Effect.Effect<void, LockBackendError>
  /**
   * Once `attempt` settles, frees the row if it may have taken it (granted, or failed without
   * knowing); retried with backoff until the lease would have expired anyway. Returns at once.
   */
  readonly abandon: <A>(
    attempt: Fiber.Fiber<A, LockBackendError>,
    mayHold: (result: A) => boolean,
    name: string,
    owner: string,
    ttlMillis: number
  ) => Effect.Effect<void>
}

export const make = (lane: Lane, settings: GiveBackSettings): Effect.Effect<GiveBack, never, Scope.Scope> =>
  Effect.gen(function*() {
    const text = Sql.release(settings.table)
    const releaseRow = (name: string, owner: string, bound: Duration.Duration = settings.statementTimeout) =>
      lane.run("release", name, text, [name, owner, settings.channel, Sql.RELEASED_PREFIX + name], bound)

    // Give-backs are awaited (bounded) when the layer closes: cut short, they would leave a row
    // held until its ttl runs out. Added before the lane's finalizers run, so the lane is still open.
    const running = new Set<Fiber.RuntimeFiber<void>>()
    yield* Effect.addFinalizer(() =>
      Effect.suspend(() => {
        const fibers = Array.from(running)
        return timeoutOption(Effect.forEach(fibers, Fiber.await, { discard: true }), SHUTDOWN_GIVE_BACK).pipe(
          Effect.zipRight(Effect.forEach(fibers, Fiber.interrupt, { discard: true }))
        )
      })
    )

    const totalMillis = Duration.toMillis(settings.statementTimeout)
    const release = (name: string, owner: string): Effect.Effect<void, LockBackendError> =>
      Effect.gen(function*() {
        const deadline = (yield* monotonicMillis) + totalMillis
        for (let attempt = 0; ; attempt++) {
          // Each try gets what is left of the whole bound; owner-scoped and idempotent, so a
          // retry after an ambiguous failure is safe.
          const left = deadline - (yield* monotonicMillis)
          const outcome = yield* Effect.either(releaseRow(name, owner, Duration.millis(Math.max(1, left))))
          if (outcome._tag === "Right") return
          const spent = deadline - (yield* monotonicMillis) <= Duration.toMillis(RELEASE_RETRY_SPACING)
          if (attempt >= RELEASE_RETRIES || spent) return yield* outcome.left
          yield* Effect.sleep(RELEASE_RETRY_SPACING)
        }
      })

    const abandon: GiveBack["abandon"] = (attempt, mayHold, name, owner, ttlMillis) =>
      // Not inside the caller's transaction: this fiber outlives it.
      outsideTransaction(Effect.forkDaemon(
        Effect.flatMap(Fiber.await(attempt), (exit) =>
          Exit.isSuccess(exit) && !mayHold(exit.value) ? Effect.void : releaseRow(name, owner).pipe(
            Effect.retry(Schedule.exponential(Duration.millis(50)).pipe(Schedule.upTo(Duration.millis(ttlMillis)))),
            Effect.ignore
          )).pipe(Effect.interruptible)
      )).pipe(
        Effect.tap((fiber) =>
          Effect.sync(() => {
            running.add(fiber)
            fiber.addObserver(() => running.delete(fiber))
          })
        ),
        Effect.asVoid
      )

    return { release, abandon }
  })

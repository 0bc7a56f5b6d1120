import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import type * as Fiber from "effect/Fiber"
import * as FiberSet from "effect/FiberSet"
import type * as Scope from "effect/Scope"
import { fiberMillis, sleepMillis } from "./clock.js"

/**
 * How the renewal loop sleeps and is woken. The loop is either awake (from waking up until it
 * has chosen its next sleep) or asleep until a time or a ring. A ring while it is awake makes it
 * look again before sleeping, so nothing registered while it works can be missed; a ring while
 * it sleeps wakes it. `dueBefore` tells a registration whether it needs to ring at all: waking
 * the loop for every new lease would rescan every lease per acquire (quadratic).
 */
export interface LoopAlarm {
  /** The loop looks again: at once if it sleeps, before it sleeps if it is awake. */
  readonly ring: () => void
  /**
   * Something is due at `at` (monotonic ms; `now` is the time): a loop that sleeps past it is rung
   * *at* `at` by a timer, not woken now (nothing is due before); an awake loop looks again before
   * it sleeps. A timer already armed at or before `at` does.
   */
  readonly wakeBy: (at: number, now: number) => void
  /** Called by the loop as it starts a round. */
  readonly wokeUp: () => void
  /** Sleeps until `wakeAt` (monotonic ms; `Infinity`: until rung), or returns at once if rung meanwhile. */
  readonly sleepUntil: (wakeAt: number) => Effect.Effect<void>
  /** Stops every timer (the service is closing). */
  readonly stop: Effect.Effect<void>
}

/** `fork`: starts a timer fiber as the layer's work (from a caller's synchronous step). */
export const makeLoopAlarm = (
  fork: <A, E>(self: Effect.Effect<A, E>) => Fiber.RuntimeFiber<A, E>
): Effect.Effect<LoopAlarm, never, Scope.Scope> => Effect.gen(function*() {
  /** Timers that ring the alarm; never interrupted before `stop` (see `armTimer`). */
  const timers = yield* FiberSet.make<void>()
  /** When each running timer fires (monotonic ms). */
  const timerTimes = new Set<number>()
  let awake = true
  let rescan = false
  let scheduledWake = Number.POSITIVE_INFINITY
  let alarm: Deferred.Deferred<void> | undefined

  const ring = (): void => {
    if (awake) rescan = true
    else if (alarm !== undefined) Deferred.unsafeDone(alarm, Exit.void)
  }

  /**
   * Makes sure a timer rings at `at` or earlier. A timer is never interrupted: one no longer
   * needed rings a loop that finds nothing to do. (Interrupting a sleep just as it starts can
   * also leak a permit of TestClock's internal semaphore in effect 3.22 and hang every later
   * sleep of the test: Effect-TS/effect#6910.)
   */
  const armTimer = (at: number, now: number): Effect.Effect<void> =>
    Effect.suspend(() => {
      for (const t of timerTimes) if (t <= at) return Effect.void
      timerTimes.add(at)
      const fired = Effect.sync(() => {
        timerTimes.delete(at)
        ring()
      })
      return Effect.asVoid(FiberSet.run(timers, Effect.ensuring(sleepMillis(at - now), fired)))
    })

  const wakeBy = (at: number, now: number): void => {
    if (awake) {
      rescan = true
      return
    }
    if (at >= scheduledWake) return
    // One timer rings the loop at `at`; every grant due later needs nothing more until then.
    scheduledWake = at
    timerTimes.add(at)
    FiberSet.unsafeAdd(timers, fork(Effect.ensuring(sleepMillis(at - now), Effect.sync(() => {
      timerTimes.delete(at)
      ring()
    }))))
  }

  const sleepUntil = (wakeAt: number): Effect.Effect<void> =>
    Effect.withFiberRuntime((fiber) => {
      if (rescan) {
        rescan = false
        return Effect.void
      }
      // From here on a ring completes this signal, and a registration compares itself with `scheduledWake`.
      const signal = Deferred.unsafeMake<void>(fiber.id())
      alarm = signal
      // A timer still armed rings the loop at its time even when the loop asks for none (every lease
      // went): a lease due after it needs no ring now. Without this, every grant after the loop
      // found nothing would wake it for a round (a tick per acquire on a lease backend, issue 23).
      let earliest = wakeAt
      for (const t of timerTimes) if (t < earliest) earliest = t
      scheduledWake = earliest
      awake = false
      const rung = Deferred.await(signal)
      return wakeAt === Number.POSITIVE_INFINITY ? rung : Effect.zipRight(armTimer(wakeAt, fiberMillis(fiber)), rung)
    })

  return {
    ring,
    wakeBy,
    wokeUp: () => {
      awake = true
      rescan = false
      alarm = undefined
    },
    sleepUntil,
    stop: FiberSet.clear(timers)
  }
})

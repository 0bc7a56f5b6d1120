/**
 * The expiry alarm of one memory backend: when the earliest lease ahead of its waiters, or of its
 * own holders, runs out, it sweeps the entries they wait in or hold (`queue.sweep`), which drops
 * the expired holders, wakes the waiters that now fit and frees a name left idle (a lease nobody
 * gives back frees its name when it runs out, not never). Waiters themselves wait for their
 * wake-up only.
 *
 * Why timers of the backend's own that are never interrupted, rather than each waiter racing a
 * sleep against its wake-up: the losing sleep of such a race is interrupted, and a TestClock sleep
 * interrupted just as it starts can leak a permit of TestClock's internal semaphore in effect
 * 3.22 and hang every later sleep of the test (Effect-TS/effect#6910: the seeded
 * shared/exclusive mix test hung that way under a 12-op yield budget). A timer here runs to its
 * time on the layer's runtime (`runtime/owner.ts`), never on a caller's fiber; one no longer
 * needed sweeps nothing. Only closing the layer interrupts them.
 */
import * as Effect from "effect/Effect"
import { fiberMillis, monotonicMillis, sleepMillis } from "../core/clock.js"
import type { Owner } from "../runtime/owner.js"
import * as Queue from "./queue.js"

/** The alarm of a backend whose background fibers `owner` runs. */
export const make = (owner: Owner): Queue.Alarm => {
  const watched = new Set<Queue.Entry>()
  /** When each running timer fires (monotonic ms). */
  const timers = new Set<number>()

  const fire = Effect.withFiberRuntime((fiber) => {
    const swept = Queue.sweep(watched, fiberMillis(fiber))
    if (swept.next !== Number.POSITIVE_INFINITY) arm(swept.next)
    // Swept because a waiter takes over: those expired holders hear it as a takeover; a lease
    // nobody waited for (swept only to free its name) simply expired.
    return Effect.zipRight(Queue.tellLost(swept.stolen, "stolen"), Queue.tellLost(swept.expired, "expired"))
  })

  const arm = (at: number): void => {
    for (const t of timers) if (t <= at) return
    timers.add(at)
    const timer = Effect.flatMap(monotonicMillis, (now) => sleepMillis(at - now)).pipe(
      Effect.ensuring(Effect.sync(() => timers.delete(at))),
      Effect.zipRight(fire)
    )
    owner.unsafeFork(timer)
  }

  return { watched, arm }
}

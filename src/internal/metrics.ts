import * as Effect from "effect/Effect"
import * as Metric from "effect/Metric"
import * as MetricBoundaries from "effect/MetricBoundaries"
import type { LostReason } from "../LockError.js"

/** Time from asking for a lock to holding it, in milliseconds. */
export const acquireWait = Metric.histogram(
  "effect_lock_acquire_wait_ms",
  MetricBoundaries.exponential({ start: 0.5, factor: 2, count: 20 }),
  "time from asking for a lock to holding it"
)
export const heldGauge = Metric.gauge("effect_lock_held", { description: "locks this process holds" })
export const acquisitions = Metric.counter("effect_lock_acquisitions_total", { incremental: true })
export const timeouts = Metric.counter("effect_lock_timeouts_total", { incremental: true })
export const losses = Metric.counter("effect_lock_lost_total", { incremental: true })
export const releaseFailures = Metric.counter("effect_lock_release_failures_total", { incremental: true })
export const destroyedSessions = Metric.counter("effect_lock_destroyed_sessions_total", { incremental: true })

/** Tagged metrics are built once per backend and reused: building one per update is costly. */
const cache = new Map<Metric.Metric<any, any, any>, Map<string, Metric.Metric<any, any, any>>>()
const tagged = <M extends Metric.Metric<any, any, any>>(metric: M, backend: string): M => {
  let byBackend = cache.get(metric)
  if (byBackend === undefined) cache.set(metric, byBackend = new Map())
  let found = byBackend.get(backend)
  if (found === undefined) byBackend.set(backend, found = Metric.tagged(metric, "backend", backend))
  return found as M
}

export const held = (backend: string, delta: number): Effect.Effect<void> =>
  Metric.modify(tagged(heldGauge, backend), delta)

export const acquired = (backend: string, waitedMillis: number): Effect.Effect<void> =>
  Effect.zipRight(
    Metric.update(tagged(acquireWait, backend), waitedMillis),
    Metric.increment(tagged(acquisitions, backend))
  )

export const timedOut = (backend: string): Effect.Effect<void> => Metric.increment(tagged(timeouts, backend))

export const lost = (backend: string, reason: LostReason): Effect.Effect<void> =>
  Metric.increment(Metric.tagged(tagged(losses, backend), "reason", reason))

export const releaseFailed = (backend: string): Effect.Effect<void> =>
  Metric.increment(tagged(releaseFailures, backend))

export const sessionDestroyed = (backend: string): Effect.Effect<void> =>
  Metric.increment(tagged(destroyedSessions, backend))

import * as Arr from "effect/Array"
import * as Effect from "effect/Effect"
import type * as Fiber from "effect/Fiber"
import * as FiberRef from "effect/FiberRef"
import * as Metric from "effect/Metric"
import * as MetricBoundaries from "effect/MetricBoundaries"
import * as MetricLabel from "effect/MetricLabel"
import type { LostReason } from "../../LockError.js"

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

/** The labels of one metric update, as an array Effect's metric hooks cache by identity. */
export type Labels = ReadonlyArray<MetricLabel.MetricLabel>

// Effect caches a metric's hook per labels array *identity*: updating through `Metric.tagged`
// builds a new array (and a registry lookup by hash) on every update. Every array handed to a
// metric here is built once and reused, so an update is a cached hook call and no allocation.
const byBackend = new Map<string, Labels>()
const byReason = new WeakMap<Labels, Map<LostReason, Labels>>()
const withFiberLabels = new WeakMap<Labels, WeakMap<Labels, Labels>>()

/** `[backend=<name>]`, built once per backend. */
export const backendLabels = (backend: string): Labels => {
  let labels = byBackend.get(backend)
  if (labels === undefined) byBackend.set(backend, labels = [MetricLabel.make("backend", backend)])
  return labels
}

const reasonLabels = (base: Labels, reason: LostReason): Labels => {
  let forBase = byReason.get(base)
  if (forBase === undefined) byReason.set(base, forBase = new Map())
  let labels = forBase.get(reason)
  if (labels === undefined) forBase.set(reason, labels = Arr.union(base, [MetricLabel.make("reason", reason)]))
  return labels
}

/**
 * `base` plus the labels the fiber carries (`Effect.tagMetrics`), the same array every time for
 * the same pair, so the metric hook cache keeps hitting.
 */
export const labelsOn = (fiber: Fiber.RuntimeFiber<unknown, unknown>, base: Labels): Labels => {
  const extra = fiber.getFiberRef(FiberRef.currentMetricLabels)
  if (extra.length === 0) return base
  let forExtra = withFiberLabels.get(extra)
  if (forExtra === undefined) withFiberLabels.set(extra, forExtra = new WeakMap())
  let labels = forExtra.get(base)
  if (labels === undefined) forExtra.set(base, labels = Arr.union(base, extra))
  return labels
}

/** Synchronous updates for the hot path; `labels` come from `labelsOn`. */
export const unsafe = {
  held: (labels: Labels, delta: number): void => heldGauge.unsafeModify(delta, labels),
  acquired: (labels: Labels, waitedMillis: number): void => {
    acquireWait.unsafeUpdate(waitedMillis, labels)
    acquisitions.unsafeUpdate(1, labels)
  },
  timedOut: (labels: Labels): void => timeouts.unsafeUpdate(1, labels),
  lost: (labels: Labels, reason: LostReason): void => losses.unsafeUpdate(1, reasonLabels(labels, reason)),
  releaseFailed: (labels: Labels): void => releaseFailures.unsafeUpdate(1, labels),
  sessionDestroyed: (labels: Labels): void => destroyedSessions.unsafeUpdate(1, labels)
}

const onFiber = (backend: string, update: (labels: Labels) => void): Effect.Effect<void> =>
  Effect.withFiberRuntime((fiber) => {
    update(labelsOn(fiber, backendLabels(backend)))
    return Effect.void
  })

export const held = (backend: string, delta: number): Effect.Effect<void> =>
  onFiber(backend, (labels) => unsafe.held(labels, delta))

export const acquired = (backend: string, waitedMillis: number): Effect.Effect<void> =>
  onFiber(backend, (labels) => unsafe.acquired(labels, waitedMillis))

export const timedOut = (backend: string): Effect.Effect<void> => onFiber(backend, unsafe.timedOut)

export const lost = (backend: string, reason: LostReason): Effect.Effect<void> =>
  onFiber(backend, (labels) => unsafe.lost(labels, reason))

export const releaseFailed = (backend: string): Effect.Effect<void> => onFiber(backend, unsafe.releaseFailed)

export const sessionDestroyed = (backend: string): Effect.Effect<void> => onFiber(backend, unsafe.sessionDestroyed)

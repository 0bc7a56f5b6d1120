import { describe, expect, it } from "@effect/vitest"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Logger from "effect/Logger"
import * as Exit from "effect/Exit"
import * as Metric from "effect/Metric"
import * as Scope from "effect/Scope"
import * as TestClock from "effect/TestClock"
import * as Tracer from "effect/Tracer"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as LockMetrics from "effect-lock/LockMetrics"
import * as MemoryBackend from "effect-lock/MemoryBackend"
import { LockBackendError } from "effect-lock/LockError"
import { recordingTracer } from "./support/tracing.js"

const counter = (metric: Metric.Metric.Counter<number>, tags: Record<string, string> = {}) => {
  let tagged = Metric.tagged(metric, "backend", "memory")
  for (const [key, value] of Object.entries(tags)) tagged = Metric.tagged(tagged, key, value)
  return Effect.map(Metric.value(tagged), (state) => state.count)
}
const heldNow = Effect.map(Metric.value(Metric.tagged(LockMetrics.held, "backend", "memory")), (s) => s.value)
const waits = Effect.map(Metric.value(Metric.tagged(LockMetrics.acquireWait, "backend", "memory")), (s) => s.count)


describe("observability", () => {
  it.scoped("metrics count acquisitions, waits, timeouts, losses, release failures and held locks", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const backend = yield* MemoryBackend.makeBackend({ store })
      let failRelease = false
      const a = yield* DistributedLock.make({
        ...backend,
        acquire: (request) =>
          Effect.map(backend.acquire(request), (result) =>
            result._tag !== "Granted" ? result : {
              ...result,
              grant: {
                ...result.grant,
                release: Effect.suspend(() =>
                  failRelease
                    ? Effect.fail(new LockBackendError({ operation: "release", cause: "injected" }))
                    : result.grant.release
                )
              }
            })
      })
      const before = {
        acquisitions: yield* counter(LockMetrics.acquisitions),
        timeouts: yield* counter(LockMetrics.timeouts),
        revoked: yield* counter(LockMetrics.losses, { reason: "revoked" }),
        releaseFailures: yield* counter(LockMetrics.releaseFailures),
        held: yield* heldNow,
        waits: yield* waits
      }
      yield* Effect.scoped(a.acquire("m-1"))
      yield* a.acquire("m-2")
      expect(yield* heldNow).toBe(before.held + 1)
      const timedOut = yield* Effect.fork(Effect.scoped(a.acquire("m-2", { timeout: "1 second" })))
      yield* TestClock.adjust(Duration.seconds(2))
      yield* Effect.flip(Fiber.join(timedOut))
      yield* a.acquire("m-3")
      yield* MemoryBackend.revoke(store, "m-3")
      failRelease = true
      yield* Effect.scoped(a.acquire("m-4"))
      expect(yield* counter(LockMetrics.acquisitions)).toBe(before.acquisitions + 4)
      expect(yield* waits).toBe(before.waits + 4)
      expect(yield* counter(LockMetrics.timeouts)).toBe(before.timeouts + 1)
      expect(yield* counter(LockMetrics.losses, { reason: "revoked" })).toBe(before.revoked + 1)
      expect(yield* counter(LockMetrics.releaseFailures)).toBe(before.releaseFailures + 1)
      expect(yield* heldNow).toBe(before.held + 1)
    }))

  it.scoped("every operation is a span with the lock's name, token, backend and wait", () =>
    Effect.gen(function*() {
      const { spans, tracer } = yield* recordingTracer
      const store = yield* MemoryBackend.makeStore
      const lease = yield* Effect.gen(function*() {
        const a = yield* DistributedLock.make(yield* MemoryBackend.makeBackend({ store, ttl: "3 seconds" }))
        const lease = yield* Effect.scoped(Effect.as(a.acquire("traced"), undefined)).pipe(
          Effect.zipRight(a.acquire("traced-2"))
        )
        yield* TestClock.adjust(Duration.seconds(2))
        yield* MemoryBackend.revoke(store, "traced-2")
        return lease
      }).pipe(Effect.withTracer(tracer))
      const byName = (name: string) => spans.filter((span) => span.name === name)
      const [acquire] = byName("effect-lock.acquire")
      expect(acquire!.attributes.get("lock.name")).toBe("traced")
      expect(acquire!.attributes.get("lock.backend")).toBe("memory")
      expect(acquire!.attributes.get("lock.token")).toBe("1")
      expect(acquire!.attributes.get("lock.wait_ms")).toBe(0)
      expect(byName("effect-lock.release")[0]!.attributes.get("lock.name")).toBe("traced")
      expect(byName("effect-lock.renew").length).toBeGreaterThan(0)
      const [lost] = byName("effect-lock.lost")
      expect(lost!.attributes.get("lock.reason")).toBe("revoked")
      // The store's one counter: "traced-2" took the store's second token.
      expect(lost!.attributes.get("lock.token")).toBe(String(lease.token))
    }))

  it.scoped("metrics carry the labels of the fiber that acquired (Effect.tagMetrics), up and down alike", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const a = yield* DistributedLock.make(yield* MemoryBackend.makeBackend({ store }))
      const tenant = (value: string) => Metric.tagged(Metric.tagged(LockMetrics.held, "backend", "memory"), "tenant", value)
      const heldFor = (value: string) => Effect.map(Metric.value(tenant(value)), (s) => s.value)
      const acquiredFor = (value: string) =>
        Effect.map(
          Metric.value(Metric.tagged(Metric.tagged(LockMetrics.acquisitions, "backend", "memory"), "tenant", value)),
          (s) => s.count
        )
      const before = { held: yield* heldFor("a"), acquired: yield* acquiredFor("a"), other: yield* heldFor("b") }
      const scope = yield* Scope.make()
      yield* Scope.extend(a.acquire("tagged").pipe(Effect.tagMetrics("tenant", "a")), scope)
      expect(yield* heldFor("a")).toBe(before.held + 1)
      expect(yield* acquiredFor("a")).toBe(before.acquired + 1)
      expect(yield* heldFor("b")).toBe(before.other)
      // Released from another fiber (no tags): the gauge goes down where it went up.
      yield* Scope.close(scope, Exit.void)
      expect(yield* heldFor("a")).toBe(before.held)
    }))

  it.scoped("under a parent span that is not sampled, acquire and release start no span", () =>
    Effect.gen(function*() {
      const { spans, tracer } = yield* recordingTracer
      yield* Effect.gen(function*() {
        const a = yield* DistributedLock.make(yield* MemoryBackend.makeBackend())
        // A request whose trace the caller's upstream decided not to sample.
        const unsampled = Tracer.externalSpan({ traceId: "t-1", spanId: "s-1", sampled: false })
        yield* Effect.scoped(a.acquire("unsampled")).pipe(Effect.withParentSpan(unsampled))
        yield* Effect.scoped(a.acquire("sampled")).pipe(Effect.withSpan("caller"))
      }).pipe(Effect.withTracer(tracer))
      const lockSpans = spans.filter((span) => span.name.startsWith("effect-lock."))
      // Only the sampled call's acquire and release.
      expect(lockSpans.map((span) => [span.name, span.attributes.get("lock.name")])).toEqual([
        ["effect-lock.acquire", "sampled"],
        ["effect-lock.release", "sampled"]
      ])
    }))

  it.scoped("a lost lease is logged once, at warning level, with its name, token and reason", () =>
    Effect.gen(function*() {
      const logs: Array<{ level: string; message: unknown; annotations: Record<string, unknown> }> = []
      const logger = Logger.make(({ annotations, logLevel, message }) => {
        logs.push({ level: logLevel.label, message, annotations: Object.fromEntries(annotations) })
      })
      const store = yield* MemoryBackend.makeStore
      yield* Effect.gen(function*() {
        const a = yield* DistributedLock.make(yield* MemoryBackend.makeBackend({ store }))
        yield* a.acquire("logged")
        yield* MemoryBackend.revoke(store, "logged")
        yield* MemoryBackend.revoke(store, "logged")
      }).pipe(Effect.provide(Logger.replace(Logger.defaultLogger, logger)))
      const warnings = logs.filter((log) => log.level === "WARN")
      expect(warnings).toHaveLength(1)
      expect(warnings[0]!.annotations).toMatchObject({ "lock.name": "logged", "lock.token": "1", reason: "revoked" })
    }))
})

/**
 * DistributedLock.schedule on the memory backend under TestClock: three replicas (three services
 * over one shared store) step the same cron schedule; each occurrence runs on one of them.
 * A replica's clock skew is a Clock whose wall time is behind TestClock's (its monotonic time, like
 * the store's, is not).
 */
import { describe, expect, it } from "@effect/vitest"
import * as Clock from "effect/Clock"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Logger from "effect/Logger"
import * as LogLevel from "effect/LogLevel"
import * as Schedule from "effect/Schedule"
import * as TestClock from "effect/TestClock"
import * as Cron from "effect/Cron"
import * as DistributedLock from "effect-lock/DistributedLock"
import type { LockBackend } from "effect-lock/LockBackend"
import { LockBackendError } from "effect-lock/LockError"
import * as MemoryBackend from "effect-lock/MemoryBackend"
import { skewed } from "./support/clocks.js"
import { TIGHT_YIELD_BUDGET, withYieldBudget } from "./support/contract.js"

const EVERY_SECOND = Schedule.cron("* * * * * *")
const EVERY_5_SECONDS = Cron.unsafeParse("*/5 * * * * *")
const EVERY_5_SECONDS_SCHEDULE = Schedule.cron(EVERY_5_SECONDS)

interface Run {
  readonly replica: string
  readonly scheduledAt: number
  /** TestClock's time when the job started. */
  readonly startedAt: number
  readonly token: bigint
}

/** Log lines, captured from every fiber of the test (down to Debug). */
const captureLogs = () => {
  const lines: Array<{ readonly level: string; readonly message: string }> = []
  const logger = Logger.make(({ logLevel, message }) => {
    lines.push({ level: logLevel.label, message: Array.isArray(message) ? message.map(String).join(" ") : String(message) })
  })
  const provide = <A, E, R>(self: Effect.Effect<A, E, R>) =>
    self.pipe(Effect.provide(Logger.replace(Logger.defaultLogger, logger)), Logger.withMinimumLogLevel(LogLevel.Debug))
  return { lines, provide }
}

/** One replica's lock service over the shared store, its backend optionally wrapped. */
const replica = (store: MemoryBackend.Store, wrap: (backend: LockBackend<any>) => LockBackend<any> = (b) => b) =>
  Effect.flatMap(MemoryBackend.makeBackend({ store }), (backend) => DistributedLock.make(wrap(backend)))

/**
 * A job that records who ran which occurrence, and when: on the test's own clock (`base`), not on
 * the replica's (inside a skewed replica, `Clock` and `TestClock.testClock()` are the skewed one).
 */
const recording = (runs: Array<Run>, who: string, base: Clock.Clock) => (occurrence: DistributedLock.Occurrence) =>
  Effect.sync(() =>
    runs.push({
      replica: who,
      scheduledAt: occurrence.scheduledAt,
      startedAt: base.unsafeCurrentTimeMillis(),
      token: occurrence.lease.token
    })
  )

/** One replica of `cluster`: its wall clock (default the test's) and its backend wrapper. */
interface ReplicaSpec {
  readonly who: string
  readonly clock?: ((base: Clock.Clock) => Clock.Clock) | undefined
  readonly wrap?: ((backend: LockBackend<any>) => LockBackend<any>) | undefined
}

/**
 * Starts a replica per spec over one shared store, each running the same `schedule` line with a
 * recording job; returns the store and what the jobs recorded.
 */
const cluster = (
  name: string,
  steps: Schedule.Schedule<unknown, unknown>,
  options: DistributedLock.ScheduleOptions | undefined,
  specs: ReadonlyArray<ReplicaSpec>
) =>
  Effect.gen(function*() {
    const base = yield* Effect.clock
    const store = yield* MemoryBackend.makeStore
    const runs: Array<Run> = []
    for (const spec of specs) {
      const service = yield* replica(store, spec.wrap)
      yield* Effect.forkScoped(
        DistributedLock.schedule(name, steps, recording(runs, spec.who, base), options).pipe(
          Effect.provideService(DistributedLock.DistributedLock, service),
          Effect.withClock(spec.clock === undefined ? base : spec.clock(base))
        )
      )
    }
    return { store, runs }
  })

/** Replicas a, b, c… whose wall clocks are behind the test's by these amounts (ms). */
const behind = (...amounts: ReadonlyArray<number>): ReadonlyArray<ReplicaSpec> =>
  amounts.map((ms, i) => ({ who: String.fromCharCode(97 + i), clock: (base: Clock.Clock) => skewed(base, ms) }))

/** How many times each occurrence ran, keyed by its scheduled time. */
const countsOf = (runs: ReadonlyArray<Run>) => {
  const counts = new Map<number, number>()
  for (const run of runs) counts.set(run.scheduledAt, (counts.get(run.scheduledAt) ?? 0) + 1)
  return [...counts.entries()].sort(([a], [b]) => a - b)
}

const secondsFrom = (first: number, count: number, step = 1) =>
  Array.from({ length: count }, (_, i) => [(first + i * step) * 1_000, 1] as const)

/** Moves TestClock forward in steps, so every sleep in between fires in order. */
const advance = (total: Duration.DurationInput, step: Duration.DurationInput = "100 millis") =>
  Effect.suspend(() => {
    const steps = Math.round(Duration.toMillis(Duration.decode(total)) / Duration.toMillis(Duration.decode(step)))
    return Effect.repeatN(TestClock.adjust(step), steps - 1)
  })

describe("DistributedLock.schedule on the memory backend", () => {
  for (const budget of [undefined, TIGHT_YIELD_BUDGET]) {
    const label = budget === undefined ? "" : ` (runtime switching fibers every ${budget} ops)`
    it.scoped(`three replicas: each of 20 occurrences runs exactly once${label}`, () =>
      Effect.gen(function*() {
        const { runs } = yield* cluster("report", EVERY_SECOND, undefined, behind(0, 0, 0))
        yield* advance("20 seconds")
        expect(countsOf(runs)).toEqual(secondsFrom(1, 20))
        // Each run started at its occurrence's time, and under a fresh grant.
        expect(runs.every((run) => run.startedAt === run.scheduledAt)).toBe(true)
        expect(new Set(runs.map((run) => run.token)).size).toBe(20)
      }).pipe((self) => (budget === undefined ? self : withYieldBudget(budget)(self))))
  }

  it.scoped("without a hold (atLeastFor 0) a fast job runs again on the replicas that come next (so the test above can fail)", () =>
    Effect.gen(function*() {
      const { runs } = yield* cluster("report", EVERY_SECOND, { atLeastFor: 0 }, behind(0, 0, 0))
      yield* advance("5 seconds")
      expect(countsOf(runs).some(([, count]) => count > 1)).toBe(true)
    }))

  it.scoped("a hung job is interrupted at atMostFor, its finalizers run, the lock is given back and the schedule goes on", () =>
    Effect.gen(function*() {
      const logs = captureLogs()
      const store = yield* MemoryBackend.makeStore
      const service = yield* replica(store)
      const events: Array<string> = []
      const hung = (occurrence: DistributedLock.Occurrence) =>
        Effect.flatMap(TestClock.currentTimeMillis, (now) =>
          Effect.sync(() => events.push(`start ${occurrence.scheduledAt} at ${now}`))).pipe(
            Effect.zipRight(Effect.never),
            Effect.onInterrupt(() =>
              Effect.flatMap(TestClock.currentTimeMillis, (now) => Effect.sync(() => events.push(`stopped at ${now}`))))
          )
      yield* Effect.forkScoped(
        DistributedLock.schedule("hung", EVERY_5_SECONDS, hung, { atMostFor: "2 seconds", atLeastFor: "1 second" }).pipe(
          Effect.provideService(DistributedLock.DistributedLock, service),
          logs.provide
        )
      )
      yield* advance("6900 millis")
      expect(events).toEqual(["start 5000 at 5000"])
      expect(yield* MemoryBackend.holders(store)).toHaveLength(1)
      yield* advance("100 millis")
      expect(events).toEqual(["start 5000 at 5000", "stopped at 7000"])
      // Held 2 s (past atLeastFor): given back as soon as the job stopped.
      expect(yield* MemoryBackend.holders(store)).toEqual([])
      expect(logs.lines.filter((l) => l.level === "WARN").map((l) => l.message)).toEqual([
        `schedule "hung": the job of occurrence ${new Date(5000).toISOString()} ran past atMostFor (2s) and was interrupted`
      ])
      yield* advance("3 seconds")
      expect(events.at(-1)).toBe("start 10000 at 10000")
    }))

  it.scoped("a replica whose clock is 300 ms behind and one 600 ms behind never run a fast job again (atLeastFor 1 s)", () =>
    Effect.gen(function*() {
      // At 1 s, every replica's next occurrence is the one at 5 s (its clock is less than 1 s behind).
      yield* TestClock.adjust("1 second")
      const { runs } = yield* cluster("skewed", EVERY_5_SECONDS_SCHEDULE, { atLeastFor: "1 second" }, behind(0, 300, 600))
      yield* advance("49 seconds")
      expect(countsOf(runs)).toEqual(secondsFrom(5, 10, 5))
      // The accurate clock reaches every occurrence first.
      expect(new Set(runs.map((run) => run.replica))).toEqual(new Set(["a"]))
    }))

  it.scoped("the same skew with atLeastFor 0 runs each occurrence three times (so the test above can fail)", () =>
    Effect.gen(function*() {
      yield* TestClock.adjust("1 second")
      const { runs } = yield* cluster("skewed", EVERY_5_SECONDS_SCHEDULE, { atLeastFor: 0 }, behind(0, 300, 600))
      yield* advance("20 seconds")
      expect(countsOf(runs)).toEqual([[5000, 3], [10000, 3], [15000, 3], [20000, 3]])
    }))

  it.scoped("skew beyond atLeastFor is not covered: a clock 300 ms behind runs again with atLeastFor 200 ms", () =>
    Effect.gen(function*() {
      yield* TestClock.adjust("1 second")
      const { runs } = yield* cluster("skewed", EVERY_5_SECONDS_SCHEDULE, { atLeastFor: "200 millis" }, behind(0, 300))
      yield* advance("10 seconds")
      expect(countsOf(runs)).toEqual([[5000, 2], [10000, 2]])
    }))

  it.scoped("a replica whose timer fires 1.5 s late (a GC pause) skips the occurrence instead of running it again", () =>
    Effect.gen(function*() {
      yield* TestClock.adjust("1 second")
      // Same wall time as the others, but every sleep ends 1.5 s late: it reaches each occurrence
      // after the winner's hold (1 s) has ended, when the lock is free again.
      const late = (base: Clock.Clock): Clock.Clock => ({
        ...skewed(base, 0),
        sleep: (duration) => base.sleep(Duration.sum(duration, "1500 millis"))
      })
      const { runs } = yield* cluster("late", EVERY_5_SECONDS_SCHEDULE, { atLeastFor: "1 second" }, [
        { who: "a" },
        { who: "late", clock: late }
      ])
      yield* advance("25 seconds")
      expect(countsOf(runs)).toEqual(secondsFrom(5, 5, 5))
    }))

  it.scoped("a claim that reaches the store after the claim window is given back without running the job", () =>
    Effect.gen(function*() {
      yield* TestClock.adjust("1 second")
      // Its requests take 1.5 s to reach the store: by then the winner's 1 s hold is over.
      const slow = (backend: LockBackend<any>): LockBackend<any> => ({
        ...backend,
        acquire: (request) => Effect.zipRight(request.interruptible(Effect.sleep("1500 millis")), backend.acquire(request))
      })
      const { runs, store } = yield* cluster("slow", EVERY_5_SECONDS_SCHEDULE, { atLeastFor: "1 second" }, [
        { who: "a" },
        { who: "slow", wrap: slow }
      ])
      yield* advance("25 seconds")
      expect(countsOf(runs)).toEqual(secondsFrom(5, 5, 5))
      expect(yield* MemoryBackend.holders(store)).toEqual([])
    }))

  it.scoped("with the store's clock (LockBackend.now) replicas 3 s behind agree on every occurrence", () =>
    Effect.gen(function*() {
      const base = yield* Effect.clock
      yield* TestClock.adjust("1 second")
      // The store's clock is TestClock's own wall time, whatever the replicas' clocks say.
      const withStoreClock = (backend: LockBackend<any>): LockBackend<any> => ({
        ...backend,
        now: Effect.sync(() => base.unsafeCurrentTimeMillis())
      })
      const { runs } = yield* cluster(
        "store-clock",
        EVERY_5_SECONDS_SCHEDULE,
        { atLeastFor: "200 millis" },
        behind(3_000, 0, 1_500).map((spec) => ({ ...spec, wrap: withStoreClock }))
      )
      yield* advance("30 seconds")
      expect(countsOf(runs)).toEqual(secondsFrom(5, 6, 5))
      // Run at the store's time of each occurrence, by whichever replica got there first.
      expect(runs.every((run) => run.startedAt === run.scheduledAt)).toBe(true)
    }))

  it.scoped("lock store errors are logged and retried within the claim window; a store down for the whole window skips the occurrence", () =>
    Effect.gen(function*() {
      const logs = captureLogs()
      const base = yield* Effect.clock
      const store = yield* MemoryBackend.makeStore
      let failures = 0
      const flaky = (backend: LockBackend<any>): LockBackend<any> => ({
        ...backend,
        acquire: (request) =>
          failures > 0
            ? Effect.suspend(() => {
              failures--
              return Effect.fail(new LockBackendError({ operation: "acquire", name: request.name, cause: new Error("injected: store unreachable") }))
            })
            : backend.acquire(request)
      })
      const service = yield* replica(store, flaky)
      const runs: Array<Run> = []
      failures = 2
      yield* Effect.forkScoped(
        DistributedLock.schedule("flaky", EVERY_5_SECONDS, recording(runs, "a", base), { atLeastFor: "1 second" }).pipe(
          Effect.provideService(DistributedLock.DistributedLock, service),
          logs.provide
        )
      )
      // Two failures at 5.0 s and 5.1 s (backoff 100 ms, then 200 ms): won at 5.3 s.
      yield* advance("6 seconds")
      expect(runs.map((run) => [run.scheduledAt, run.startedAt])).toEqual([[5000, 5300]])
      expect(logs.lines.filter((l) => l.level === "WARN")).toHaveLength(2)
      // Down for longer than the 1 s claim window (tries at 10.0, 10.1, 10.3, 10.7 s; at 11.5 s
      // the window has closed): the 10 s occurrence is skipped, the 15 s one runs.
      failures = 1_000
      yield* advance("5600 millis")
      failures = 0
      yield* advance("4 seconds")
      expect(runs.map((run) => run.scheduledAt)).toEqual([5000, 15000])
      expect(logs.lines.some((l) =>
        l.level === "WARN" &&
        l.message === `schedule "flaky": occurrence ${new Date(10_000).toISOString()} skipped: the lock store could not be reached in time (1500 ms after its time)`
      )).toBe(true)
    }))

  it.scoped("a lost lock interrupts the job with a warning; the schedule goes on with the next occurrence", () =>
    Effect.gen(function*() {
      const logs = captureLogs()
      const store = yield* MemoryBackend.makeStore
      const service = yield* replica(store)
      const started: Array<number> = []
      const long = (occurrence: DistributedLock.Occurrence) =>
        Effect.zipRight(Effect.sync(() => started.push(occurrence.scheduledAt)), Effect.sleep("3 seconds"))
      yield* Effect.forkScoped(
        DistributedLock.schedule("revoked", EVERY_5_SECONDS, long).pipe(
          Effect.provideService(DistributedLock.DistributedLock, service),
          logs.provide
        )
      )
      yield* advance("6 seconds")
      expect(started).toEqual([5000])
      yield* MemoryBackend.revoke(store, "revoked")
      yield* advance("100 millis")
      expect(logs.lines.some((l) => l.level === "WARN" && l.message.includes(`lost lock "revoked"`))).toBe(true)
      yield* advance("4 seconds")
      expect(started).toEqual([5000, 10000])
    }))

  it.scoped("a job that fails gives the lock back and fails the schedule with its error", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const service = yield* replica(store)
      const run = yield* Effect.fork(
        DistributedLock.schedule("failing", EVERY_SECOND, Effect.fail("report failed" as const)).pipe(
          Effect.provideService(DistributedLock.DistributedLock, service)
        )
      )
      yield* advance("1 second")
      expect(yield* Effect.flip(Fiber.join(run))).toBe("report failed")
      expect(yield* MemoryBackend.holders(store)).toEqual([])
    }))

  it.effect("an invalid name fails at once; a schedule with no spacing dies saying why; a finite schedule returns its output", () =>
    Effect.gen(function*() {
      const invalid = yield* Effect.flip(DistributedLock.schedule("", EVERY_SECOND, Effect.void))
      expect(invalid).toMatchObject({ _tag: "InvalidLockName" })
      const defect = yield* Effect.exit(DistributedLock.schedule("busy", Schedule.forever, Effect.void))
      expect(String(defect)).toContain("is not after the previous one")
      const finite = yield* Effect.fork(
        DistributedLock.schedule("twice", Schedule.intersect(EVERY_SECOND, Schedule.recurs(2)), Effect.void)
      )
      // Occurrences at 1 s and 2 s; the last is held for atLeastFor (10 s) before the schedule returns.
      yield* advance("12 seconds")
      expect(yield* Fiber.poll(finite)).toMatchObject({ _tag: "Some" })
      expect((yield* Fiber.join(finite))[1]).toBe(2)
    }).pipe(Effect.provide(MemoryBackend.layer())))
})

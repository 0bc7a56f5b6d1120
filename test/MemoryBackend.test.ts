import { describe, expect, it } from "@effect/vitest"
import * as Cause from "effect/Cause"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Logger from "effect/Logger"
import * as LogLevel from "effect/LogLevel"
import * as Option from "effect/Option"
import * as Runtime from "effect/Runtime"
import * as Scope from "effect/Scope"
import * as Supervisor from "effect/Supervisor"
import * as TestClock from "effect/TestClock"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as DistributedSemaphore from "effect-lock/DistributedSemaphore"
import type { LockMode } from "effect-lock/Lease"
import type { LostReason } from "effect-lock/LockError"
import type { AcquireRequest, Grant, LockBackend } from "effect-lock/LockBackend"
import * as MemoryBackend from "effect-lock/MemoryBackend"
import * as Net from "node:net"
import { monotonicMillis } from "../src/internal/core/clock.js"
import { heldOf } from "../src/internal/core/registry.js"
import { contractSuite, freshName, holdFor, stallSuite, TIGHT_YIELD_BUDGET, waitUntil, withYieldBudget } from "./support/contract.js"
import { type Faults, makeFaults, waitingFor, withFaults, yieldTimes } from "./support/faults.js"
import { blockThread } from "../tools/blockThread.js"

const store = Effect.runSync(MemoryBackend.makeStore)

contractSuite("MemoryBackend", {
  clock: "test",
  ttl: Duration.seconds(3),
  makeBackend: MemoryBackend.makeBackend({ store }),
  storeHolders: (name) =>
    Effect.map(MemoryBackend.holders(store), (all) => all.filter((lease) => lease.name === name).length),
  advance: TestClock.adjust,
  revoke: (name) => MemoryBackend.revoke(store, name),
  maxNameBytes: 1024,
  minTtl: Duration.millis(100)
})

stallSuite("MemoryBackend", Effect.flatMap(MemoryBackend.makeBackend(), DistributedLock.make))

/** One "process" of a cluster sharing `shared`, with injectable renewal faults. */
const node = (shared: MemoryBackend.Store, faults: Faults = makeFaults(), ttl?: Duration.DurationInput) =>
  Effect.flatMap(MemoryBackend.makeBackend({ store: shared, ttl }), (backend) =>
    DistributedLock.make(withFaults(backend, faults)))

const provide = (service: DistributedLock.Service) => Effect.provideService(DistributedLock.DistributedLock, service)

/** A store whose every release first runs `before` (a round trip, or a release that never ends), not instant. */
const slowRelease = <G extends Grant>(backend: LockBackend<G>, before: Effect.Effect<void>): LockBackend<G> => ({
  ...mapGrants(backend, (grant) => ({ ...grant, release: Effect.zipRight(before, grant.release) })),
  instantRelease: false
})

/** `backend` with every grant it hands out changed by `f`. */
const mapGrants = <G extends Grant>(backend: LockBackend<G>, f: (grant: G) => G): LockBackend<G> => ({
  ...backend,
  acquire: (request) =>
    Effect.map(backend.acquire(request), (result) => (result._tag === "Granted" ? { ...result, grant: f(result.grant) } : result))
})

/**
 * A guarded body that logs its start in `events` and runs until interrupted, then takes a few
 * steps to clean up (as a real one does) before logging its end: a release that did not wait
 * for it would come between the two.
 */
const slowToStop = (events: Array<string>) =>
  Effect.sync(() => events.push("body:start")).pipe(
    Effect.zipRight(Effect.never),
    Effect.ensuring(Effect.zipRight(yieldTimes(50), Effect.sync(() => events.push("body:end"))))
  )

/** A supervisor that calls `f` once, in the step that forks the first fiber under it. */
class OnFirstFork extends Supervisor.AbstractSupervisor<void> {
  private called = false
  constructor(private readonly f: () => void) {
    super()
  }
  override get value() {
    return Effect.void
  }
  override onStart() {
    if (this.called) return
    this.called = true
    this.f()
  }
}

/**
 * The budget of the window test: the guard's fiber yields every `WINDOW_BUDGET + 1` operations,
 * and the body's fiber reaches its own first step within its first slice.
 */
const WINDOW_BUDGET = 40

/** `self` after `n` steps of exactly one operation each. */
const afterSteps = <A, E, R>(n: number, self: Effect.Effect<A, E, R>): Effect.Effect<A, E, R> =>
  n === 0 ? self : Effect.withFiberRuntime(() => afterSteps(n - 1, self))

/** A store whose grants have no deadline (as a session advisory lock's): never renewed, no stall watch. */
const withoutDeadline = <G extends Grant>(backend: LockBackend<G>): LockBackend<G> =>
  mapGrants(backend, (grant) => ({ ...grant, validUntil: Option.none() }))

/** Waits (bounded, on the TestClock) until `condition` holds. */
const until = (what: string, condition: Effect.Effect<boolean>) => waitUntil("test", what, condition)

/** Until the store holds `count` leases of `name`. */
const storeHolds = (shared: MemoryBackend.Store, name: string, count = 1) =>
  until(
    `the store holds ${count} lease(s) of "${name}"`,
    Effect.map(MemoryBackend.holders(shared), (all) => all.filter((h) => h.name === name).length === count)
  )

/** A small seeded generator (mulberry32), so a failing random test can be re-run with its seed. */
const seededRandom = (seed: number) => {
  let a = seed >>> 0
  return () => {
    a = (a + 0x6d2b79f5) >>> 0
    let t = a
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
}

/** Counts holders inside a body and remembers the worst overlap seen. */
const exclusionProbe = () => {
  let exclusive = 0
  let shared = 0
  let violations = 0
  const inside = (mode: LockMode) =>
    Effect.acquireUseRelease(
      Effect.sync(() => {
        if (mode === "exclusive") exclusive++
        else shared++
        if (exclusive > 1 || (exclusive === 1 && shared > 0)) violations++
      }),
      // A few steps inside the body, so the runtime switches fibers while it is held.
      () => yieldTimes(3),
      () =>
        Effect.sync(() => {
          if (mode === "exclusive") exclusive--
          else shared--
        })
    )
  return { inside, violations: () => violations }
}

const TRIALS = 100
const FIBERS = 8

describe("MemoryBackend exclusion when the runtime switches fibers every 12 ops", () => {
  it.scoped(`two layers sharing a store: ${FIBERS} fibers in withLock never overlap (${TRIALS} trials)`, () =>
    Effect.gen(function*() {
      let overlapping = 0
      for (let trial = 0; trial < TRIALS; trial++) {
        const shared = yield* MemoryBackend.makeStore
        const layers = [yield* node(shared), yield* node(shared)]
        const probe = exclusionProbe()
        yield* Effect.forEach(
          Array.from({ length: FIBERS }, (_, i) => i),
          (i) => DistributedLock.withLock(probe.inside("exclusive"), "counter").pipe(provide(layers[i % 2]!)),
          { concurrency: "unbounded", discard: true }
        ).pipe(withYieldBudget(TIGHT_YIELD_BUDGET))
        if (probe.violations() > 0) overlapping++
      }
      expect(overlapping).toBe(0)
    }))

  it.scoped(`${FIBERS} fibers calling tryAcquire never hold one exclusive lock together (${TRIALS} trials)`, () =>
    Effect.gen(function*() {
      let overlapping = 0
      let granted = 0
      for (let trial = 0; trial < TRIALS; trial++) {
        const shared = yield* MemoryBackend.makeStore
        const layers = [yield* node(shared), yield* node(shared)]
        const probe = exclusionProbe()
        yield* Effect.forEach(
          Array.from({ length: FIBERS }, (_, i) => i),
          (i) =>
            Effect.scoped(Effect.flatMap(layers[i % 2]!.tryAcquire("try"), (lease) =>
              Option.isSome(lease) ? Effect.zipRight(Effect.sync(() => granted++), probe.inside("exclusive")) : Effect.void)),
          { concurrency: "unbounded", discard: true }
        ).pipe(withYieldBudget(TIGHT_YIELD_BUDGET))
        if (probe.violations() > 0) overlapping++
      }
      expect(overlapping).toBe(0)
      // The check could fail: every trial granted the lock at least once.
      expect(granted).toBeGreaterThanOrEqual(TRIALS)
    }))

  it.scoped("shared and exclusive holders in a random mix never overlap (seeded)", () =>
    Effect.gen(function*() {
      const seed = Number(process.env.EFFECT_LOCK_TEST_SEED ?? Date.now() % 1_000_000)
      const random = seededRandom(seed)
      let overlapping = 0
      for (let trial = 0; trial < 50; trial++) {
        const shared = yield* MemoryBackend.makeStore
        const layers = [yield* node(shared), yield* node(shared)]
        const probe = exclusionProbe()
        const modes = Array.from({ length: FIBERS }, (): LockMode => (random() < 0.5 ? "shared" : "exclusive"))
        yield* Effect.forEach(
          modes,
          (mode, i) => DistributedLock.withLock(probe.inside(mode), "mixed", { mode }).pipe(provide(layers[i % 2]!)),
          { concurrency: "unbounded", discard: true }
        ).pipe(withYieldBudget(TIGHT_YIELD_BUDGET))
        if (probe.violations() > 0) overlapping++
      }
      expect(overlapping, `seed ${seed} (re-run with EFFECT_LOCK_TEST_SEED=${seed})`).toBe(0)
    }))
})

/**
 * A waiting request straight to the store (no renewal loop): its lease runs out `ttl` after its
 * grant. `waits` counts the waits it began.
 */
const storeRequest = (
  name: string,
  ttl: Duration.DurationInput,
  lost: Array<LostReason>,
  waits = { count: 0 }
): AcquireRequest => ({
  name,
  mode: "exclusive",
  attempt: "wait",
  ttl: Duration.decode(ttl),
  deadline: Option.none(),
  interruptible: (e) => e,
  waitUntilDeadline: (e) => Effect.zipRight(Effect.sync(() => waits.count++), Effect.asSome(e)),
  onLost: (reason) => Effect.sync(() => lost.push(reason))
})

describe("MemoryBackend waiting order", () => {
  it.scoped("a release wakes only the head waiters that now fit: the shared ones at the head together, none behind a waiting exclusive", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const name = "heads"
      const letGo = yield* holdFor(yield* node(shared), name)
      const granted: Array<string> = []
      const release = new Map<string, Effect.Latch>()
      const waiters = [["b", "shared"], ["c", "shared"], ["d", "exclusive"], ["e", "shared"]] as const
      for (const [label, mode] of waiters) {
        const faults = makeFaults()
        const process = yield* node(shared, faults)
        const done = yield* Effect.makeLatch(false)
        release.set(label, done)
        yield* Effect.forkScoped(
          Effect.scoped(Effect.zipRight(process.acquire(name, { mode }), Effect.zipRight(Effect.sync(() => granted.push(label)), done.await)))
        )
        // Each is queued before the next one arrives.
        yield* until(`${label} is queued`, Effect.sync(() => waitingFor(faults, name) === 1))
      }
      yield* letGo
      yield* until("b and c hold together", Effect.sync(() => granted.length === 2))
      expect([...granted].sort()).toEqual(["b", "c"])
      // e would fit beside b and c, but it came after the waiting d: both keep waiting.
      yield* yieldTimes(200)
      expect(granted).toHaveLength(2)
      expect((yield* MemoryBackend.holders(shared)).map((h) => h.mode)).toEqual(["shared", "shared"])
      yield* release.get("b")!.open
      yield* yieldTimes(200)
      expect(granted).toHaveLength(2)
      yield* release.get("c")!.open
      yield* until("d holds", Effect.sync(() => granted.length === 3))
      expect(granted[2]).toBe("d")
      yield* release.get("d")!.open
      yield* until("e holds", Effect.sync(() => granted.length === 4))
      expect(granted[3]).toBe("e")
      yield* release.get("e")!.open
      yield* until("nothing is held", Effect.map(MemoryBackend.holders(shared), (all) => all.length === 0))
    }))

  it.scoped("a waiter is woken when the lease ahead of it runs out, also one granted from the queue after it began to wait", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const name = "expiry-ahead"
      const store = yield* MemoryBackend.makeBackend({ store: shared })
      const lost: Array<LostReason> = []
      // a holds for 10 s; b (never renewed, 1 s) and then c wait behind it.
      const a = yield* store.acquire({ ...storeRequest(name, "10 seconds", lost), attempt: "once" })
      if (a._tag !== "Granted") throw new Error("expected a grant")
      const bWaits = { count: 0 }
      const b = yield* Effect.fork(store.acquire(storeRequest(name, "1 second", lost, bWaits)))
      yield* until("b is queued", Effect.sync(() => bWaits.count === 1))
      const cFaults = makeFaults()
      const c = yield* node(shared, cFaults)
      const cGrantedAt = yield* Effect.fork(Effect.zipRight(c.acquire(name), monotonicMillis))
      yield* until("c is queued", Effect.sync(() => waitingFor(cFaults, name) === 1))
      // b takes the lock at once, with a lease that runs out in 1 s, well before a's would have.
      const start = yield* monotonicMillis
      yield* a.grant.release
      const bGrant = yield* Fiber.join(b)
      expect(bGrant._tag).toBe("Granted")
      yield* TestClock.adjust("1 second")
      // c is woken by b's expiry (not at a's 10 s, whose timer is still pending).
      yield* until("c got the lock", Effect.map(Fiber.poll(cGrantedAt), Option.isSome))
      expect(yield* Fiber.join(cGrantedAt)).toBe(start + 1000)
      expect(lost).toEqual(["stolen"])
    }))

  it.scoped("a woken waiter interrupted before it takes the lock hands its place on (every yield point)", () =>
    Effect.gen(function*() {
      for (let at = 0; at < 40; at++) {
        yield* Effect.scoped(
          Effect.gen(function*() {
            const shared = yield* MemoryBackend.makeStore
            const name = "handed-on"
            const letGo = yield* holdFor(yield* node(shared), name)
            const bFaults = makeFaults()
            const b = yield* node(shared, bFaults)
            const cFaults = makeFaults()
            const c = yield* node(shared, cFaults)
            const bFiber = yield* Effect.fork(Effect.scoped(Effect.zipRight(b.acquire(name), Effect.never)))
            yield* until("b is queued", Effect.sync(() => waitingFor(bFaults, name) === 1))
            const cFiber = yield* Effect.fork(Effect.scoped(Effect.map(c.acquire(name), (lease) => lease.token)))
            yield* until("c is queued", Effect.sync(() => waitingFor(cFaults, name) === 1))
            // The release wakes b alone, setting the lock aside for it; b is interrupted `at` turns later.
            yield* letGo
            yield* yieldTimes(at)
            yield* Fiber.interrupt(bFiber)
            yield* until("c got the lock", Effect.map(Fiber.poll(cFiber), Option.isSome))
            expect((yield* Fiber.join(cFiber)) > 1n).toBe(true)
            expect(yield* MemoryBackend.holders(shared)).toEqual([])
          }).pipe(withYieldBudget(TIGHT_YIELD_BUDGET))
        )
      }
    }))
})

describe("DistributedLock on the memory backend", () => {
  it.scoped("interrupting acquire at any yield point leaves no grant behind", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const faults = makeFaults()
      // A yield between the store's grant and its hand-over, as a network round trip would be.
      faults.afterGrant = Effect.yieldNow()
      const a = yield* node(shared, faults)
      const b = yield* node(shared, faults)
      const name = "sweep"
      // Sweep the interruption over every yield point of an acquire that races a release.
      for (let at = 0; at < 120; at++) {
        const holder = yield* Effect.forkScoped(Effect.scoped(Effect.zipRight(a.acquire(name), Effect.never)))
        yield* storeHolds(shared, name)
        const waiter = yield* Effect.fork(Effect.scoped(Effect.zipRight(b.acquire(name), Effect.never)))
        for (let i = 0; i < at; i++) {
          if (i === Math.floor(at / 2)) yield* Fiber.interruptFork(holder)
          yield* Effect.yieldNow()
        }
        yield* Fiber.interrupt(waiter)
        yield* Fiber.interrupt(holder)
        expect(yield* MemoryBackend.holders(shared)).toEqual([])
      }
      // And over the uncontended path.
      for (let at = 0; at < 40; at++) {
        const taker = yield* Effect.fork(Effect.scoped(Effect.zipRight(a.acquire(`free-${at}`), Effect.never)))
        for (let i = 0; i < at; i++) yield* Effect.yieldNow()
        yield* Fiber.interrupt(taker)
        expect(yield* MemoryBackend.holders(shared)).toEqual([])
      }
    }))

  it.scoped("a loss reported while acquire hands the grant over is never dropped (every yield point)", () =>
    Effect.gen(function*() {
      const dropped: Array<number> = []
      for (let yields = 0; yields < 60; yields++) {
        yield* Effect.scoped(
          Effect.gen(function*() {
            const faults = makeFaults()
            // The session "dies" right after its grant: the loss is reported by another fiber,
            // `yields` turns later, wherever the acquiring fiber happens to be.
            faults.loseAfterGrant = yields
            const a = yield* node(yield* MemoryBackend.makeStore, faults)
            const lease = yield* a.acquire("early")
            yield* until("the loss was reported", Effect.sync(() => faults.lossesReported === 1))
            // Either the grant was given back and a fresh one taken, or the holder was told.
            if (lease.token === 1n && (yield* lease.isHeld)) dropped.push(yields)
          }).pipe(withYieldBudget(TIGHT_YIELD_BUDGET))
        )
      }
      expect(dropped).toEqual([])
    }))

  it.scoped("a lease registered while the renewal loop is awake is renewed on time (every yield point)", () =>
    Effect.gen(function*() {
      const late: Array<number> = []
      for (let yields = 0; yields < 30; yields++) {
        yield* Effect.scoped(
          Effect.gen(function*() {
            const faults = makeFaults()
            const startShort = yield* Deferred.make<void>()
            let armed = false
            // Four long leases whose first renewals hang: the loop wakes for them, starts four
            // batches and then has nothing to wake it but its own timer.
            const hung = new Set<string>()
            faults.renewHook = (names) =>
              names[0]!.startsWith("long") && !hung.has(names[0]!)
                ? Effect.zipRight(Effect.sync(() => hung.add(names[0]!)), Effect.never)
                : Effect.void
            // The short lease's grant is handed over while the loop is starting those batches.
            faults.afterGrant = Effect.suspend(() =>
              armed ? Effect.zipRight(Deferred.await(startShort), yieldTimes(yields)) : Effect.void
            )
            const base = withFaults(yield* MemoryBackend.makeBackend(), faults)
            const backend: typeof base = {
              ...base,
              get renewBatchSize() {
                // Read by the loop as it starts batches: the moment the short lease is handed over.
                if (armed) Deferred.unsafeDone(startShort, Exit.void)
                return 1
              }
            }
            const a = yield* DistributedLock.make(backend)
            for (let i = 0; i < 4; i++) yield* a.acquire(`long-${i}`, { ttl: "3 seconds" })
            armed = true
            const short = yield* Effect.fork(
              Effect.zipRight(Effect.sleep("999 millis"), a.acquire("short", { ttl: "300 millis" }))
            )
            yield* TestClock.adjust("1 second")
            const lease = yield* Fiber.join(short)
            armed = false
            // Past its first renewal (at 1,099 ms) and its safety deadline (1,239 ms).
            yield* TestClock.adjust("260 millis")
            const renewed = faults.renewCalls.some((call) => call.names.includes("short"))
            if ((yield* lease.isHeld) && !renewed) late.push(yields)
            // Let the hung renewals reach their budget so the scope can release the long leases.
            yield* TestClock.adjust("1 second")
          }).pipe(withYieldBudget(TIGHT_YIELD_BUDGET))
        )
      }
      expect(late).toEqual([])
    }))

  it.scoped("withLock reports LockLost, never a bare interruption, whichever fiber stops the body first", () =>
    Effect.gen(function*() {
      for (let yields = 0; yields < 40; yields++) {
        const shared = yield* MemoryBackend.makeStore
        const a = yield* node(shared)
        const running = yield* Deferred.make<void>()
        // A body that keeps resuming: its fibers see the loss as soon as they resume, and may
        // stop before the watcher interrupts them.
        const body = Effect.zipRight(
          Deferred.succeed(running, undefined),
          Effect.forever(Effect.yieldNow())
        )
        const run = yield* Effect.fork(
          DistributedLock.withLock(body, "race").pipe(provide(a), withYieldBudget(TIGHT_YIELD_BUDGET))
        )
        yield* Deferred.await(running)
        yield* yieldTimes(yields)
        yield* MemoryBackend.revoke(shared, "race")
        const exit = yield* Fiber.await(run)
        expect(exit).toMatchObject({ _tag: "Failure" })
        if (Exit.isFailure(exit)) {
          expect(Cause.isInterruptedOnly(exit.cause)).toBe(false)
          expect(Cause.failureOption(exit.cause)).toMatchObject({ value: { _tag: "LockLost", reason: "revoked" } })
        }
      }
    }))

  it.scoped("withLock: a lost lease interrupts the body and the result is LockLost with its token", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const a = yield* node(shared)
      const interrupted = yield* Effect.makeLatch(false)
      const started = yield* Deferred.make<void>()
      const body = Effect.zipRight(Deferred.succeed(started, undefined), Effect.never)
      const run = yield* Effect.fork(
        DistributedLock.withLock(body.pipe(Effect.onInterrupt(() => interrupted.open)), "job").pipe(provide(a))
      )
      yield* Deferred.await(started)
      const [held] = yield* MemoryBackend.holders(shared)
      yield* MemoryBackend.revoke(shared, "job")
      const error = yield* Effect.flip(Fiber.join(run))
      expect(error).toMatchObject({ _tag: "LockLost", name: "job", token: held!.token, reason: "revoked" })
      yield* interrupted.await
    }))

  it.scoped("withLock: the body and its finalizers stop before the release runs, also when the caller is interrupted", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const faults = makeFaults()
      const a = yield* node(shared, faults)
      const started = yield* Deferred.make<void>()
      const finalizing = yield* Deferred.make<void>()
      const body = Effect.zipRight(Deferred.succeed(started, undefined), Effect.never).pipe(
        Effect.ensuring(
          Deferred.succeed(finalizing, undefined).pipe(
            Effect.zipRight(Effect.sleep(Duration.seconds(1))),
            Effect.zipRight(Effect.sync(() => faults.events.push("body:finalized")))
          )
        )
      )
      const run = yield* Effect.fork(DistributedLock.withLock(body, "ordered").pipe(provide(a)))
      yield* Deferred.await(started)
      const interrupting = yield* Effect.fork(Fiber.interrupt(run))
      // The body's finalizer is running (and sleeping): the release must wait for it.
      yield* Deferred.await(finalizing)
      yield* TestClock.adjust(Duration.seconds(2))
      yield* Fiber.join(interrupting)
      expect(faults.events.filter((e) => !e.startsWith("renew"))).toEqual([
        "body:finalized",
        "release:start:ordered",
        "release:end:ordered"
      ])
      expect(yield* MemoryBackend.holders(shared)).toEqual([])
    }))

  // withLock takes its lease in a scope of its own (no Effect.scoped: bench/README.md); the body
  // still sees that scope, as it did under Effect.scoped, so what it opens there is closed first.
  it.scoped("withLock, tryWithLock and withPermits: what the body adds to its Scope is closed when the call ends, before the release", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const faults = makeFaults()
      const a = yield* node(shared, faults)
      const semaphore = yield* Effect.flatMap(MemoryBackend.makeBackend({ store: shared }), (backend) =>
        DistributedSemaphore.make(backend.semaphore))
      const events: Array<string> = []
      // The body's own scoped resource: released with the body's Scope.
      const body = (label: string) =>
        Effect.acquireRelease(Effect.sync(() => events.push(`${label}:open`)), () => Effect.sync(() => events.push(`${label}:closed`)))
      // An outer scope the caller keeps open: a body that added to it would be closed only at its end.
      const outer = yield* Scope.make()
      yield* DistributedLock.withLock(body("lock"), "scoped-body").pipe(provide(a), Scope.extend(outer))
      expect(events).toEqual(["lock:open", "lock:closed"])
      expect(faults.events.filter((e) => !e.startsWith("renew"))).toEqual(["release:start:scoped-body", "release:end:scoped-body"])
      yield* DistributedLock.tryWithLock(body("try"), "scoped-body").pipe(provide(a), Scope.extend(outer))
      yield* DistributedSemaphore.withPermits(body("permits"), "scoped-body-permits", { limit: 2 }).pipe(
        Effect.provideService(DistributedSemaphore.DistributedSemaphore, semaphore),
        Scope.extend(outer)
      )
      expect(events).toEqual(["lock:open", "lock:closed", "try:open", "try:closed", "permits:open", "permits:closed"])
      expect(yield* MemoryBackend.holders(shared)).toEqual([])
      expect(yield* MemoryBackend.semaphores(shared)).toEqual([])
      yield* Scope.close(outer, Exit.void)
    }))

  it.scoped("withLock on a wrapper of a made service (spread, Object.create, a method replaced in place) goes through the wrapper's acquire", () =>
    Effect.gen(function*() {
      const asked: Array<string> = []
      const counted = (a: DistributedLock.Service, label: string): Pick<DistributedLock.Service, "acquire" | "tryAcquire"> => ({
        acquire: (name, options) => Effect.zipRight(Effect.sync(() => asked.push(`${label}:acquire`)), a.acquire(name, options)),
        tryAcquire: (name, options) => Effect.zipRight(Effect.sync(() => asked.push(`${label}:try`)), a.tryAcquire(name, options))
      })
      const store = yield* MemoryBackend.makeStore
      const a = yield* node(store)
      const spread: DistributedLock.Service = { ...a, ...counted(a, "spread") }
      const derived: DistributedLock.Service = Object.assign(Object.create(a) as DistributedLock.Service, counted(a, "derived"))
      // The made service itself, its methods replaced in place (as a spy does).
      const inPlace = yield* node(store)
      const original = { acquire: inPlace.acquire, tryAcquire: inPlace.tryAcquire } as DistributedLock.Service
      Object.assign(inPlace, counted(original, "in-place"))
      for (const wrapped of [spread, derived, inPlace]) {
        expect(yield* DistributedLock.withLock(Effect.succeed(1), "wrapped").pipe(provide(wrapped))).toBe(1)
        expect(yield* DistributedLock.tryWithLock(Effect.succeed(2), "wrapped").pipe(provide(wrapped))).toEqual(Option.some(2))
      }
      expect(asked).toEqual(["spread:acquire", "spread:try", "derived:acquire", "derived:try", "in-place:acquire", "in-place:try"])
    }))

  it.scoped("withLock ignores the hidden entry of another copy of effect-lock (another version's key) and goes through acquire", () =>
    Effect.gen(function*() {
      const a = yield* node(yield* MemoryBackend.makeStore)
      // As a copy whose entry has another shape would mark the service: under its own key.
      Object.defineProperty(a, Symbol.for("effect-lock/internal/TakeIn"), {
        value: { take: () => Effect.die("another version's entry was used"), acquire: a.acquire, tryAcquire: a.tryAcquire },
        enumerable: false
      })
      expect(yield* DistributedLock.withLock(Effect.succeed(1), "other-copy").pipe(provide(a))).toBe(1)
      expect(yield* DistributedLock.tryWithLock(Effect.succeed(2), "other-copy").pipe(provide(a))).toEqual(Option.some(2))
    }))

  it.scoped("withLock returns the body's value and its own failures unchanged", () =>
    Effect.gen(function*() {
      const a = yield* node(yield* MemoryBackend.makeStore)
      expect(yield* DistributedLock.withLock(Effect.succeed(42), "value").pipe(provide(a))).toBe(42)
      const failure = yield* Effect.flip(DistributedLock.withLock(Effect.fail("boom" as const), "value").pipe(provide(a)))
      expect(failure).toBe("boom")
      const piped = yield* Effect.succeed(7).pipe(DistributedLock.withLock("value"), provide(a))
      expect(piped).toBe(7)
    }))

  it.scoped("tryWithLock skips when someone else holds the lock", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const a = yield* node(shared)
      const b = yield* node(shared)
      yield* a.acquire("cron")
      const skipped = yield* DistributedLock.tryWithLock(Effect.succeed("ran"), "cron").pipe(provide(b))
      expect(Option.isNone(skipped)).toBe(true)
      const ran = yield* Effect.succeed("ran").pipe(DistributedLock.tryWithLock("free"), provide(b))
      expect(ran).toEqual(Option.some("ran"))
    }))

  it.scoped("a waiter is woken by the release itself, not by a timer", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const bFaults = makeFaults()
      const a = yield* node(shared, makeFaults(), Duration.seconds(30))
      const b = yield* node(shared, bFaults)
      const scope = yield* Scope.make()
      yield* Scope.extend(a.acquire("handoff"), scope)
      const waiter = yield* Effect.fork(Effect.scoped(Effect.map(b.acquire("handoff"), (lease) => lease.token)))
      yield* until("the waiter is queued", Effect.sync(() => waitingFor(bFaults, "handoff") === 1))
      // No time passes: only the release can wake it.
      yield* Scope.close(scope, Exit.void)
      yield* until("the waiter got the lock", Effect.map(Fiber.poll(waiter), Option.isSome))
      expect(yield* Fiber.join(waiter)).toBe(2n)
    }))

  it.scoped("renews each lease between ttl/4 and ttl/3 after the last renewal, in one batch per tick", () =>
    Effect.gen(function*() {
      const faults = makeFaults()
      const a = yield* node(yield* MemoryBackend.makeStore, faults, Duration.seconds(3))
      for (let i = 0; i < 50; i++) yield* a.acquire(`many-${i}`)
      yield* TestClock.adjust(Duration.seconds(10))
      const times = faults.renewCalls.map((call) => call.at)
      expect(faults.renewCalls.every((call) => call.size === 50)).toBe(true)
      expect(times.length).toBeGreaterThanOrEqual(9)
      expect(times.length).toBeLessThanOrEqual(14)
      for (let i = 1; i < times.length; i++) {
        const gap = times[i]! - times[i - 1]!
        expect(gap).toBeGreaterThanOrEqual(750)
        expect(gap).toBeLessThanOrEqual(1000)
      }
    }))

  it.scoped("after grants the loop found already released, a new lease is renewed on time, a shorter one too", () =>
    Effect.gen(function*() {
      const faults = makeFaults()
      const a = yield* node(yield* MemoryBackend.makeStore, faults, Duration.seconds(3))
      // Short-lived grants, as in a busy loop: the renewal loop finds each one gone (a grant wakes
      // it by a timer at the lease's renewal, not at once, so it never sees them).
      for (let i = 0; i < 100; i++) yield* Effect.scoped(a.acquire(`brief-${i}`))
      yield* TestClock.adjust("100 millis")
      const kept = yield* a.acquire("kept")
      // Due before the timer the brief grants left behind: it must be rung earlier.
      const short = yield* a.acquire("short", { ttl: "1200 millis" })
      yield* TestClock.adjust("500 millis")
      expect(faults.renewCalls.some((call) => call.names.includes("short"))).toBe(true)
      expect(faults.renewCalls.some((call) => call.names.includes("kept"))).toBe(false)
      yield* TestClock.adjust("700 millis")
      expect(faults.renewCalls.some((call) => call.names.includes("kept"))).toBe(true)
      // Both still held well past their first ttl.
      yield* TestClock.adjust("4 seconds")
      expect(yield* kept.isHeld).toBe(true)
      expect(yield* short.isHeld).toBe(true)
      expect(faults.renewCalls.some((call) => call.names.some((name) => name.startsWith("brief")))).toBe(false)
    }).pipe(withYieldBudget(TIGHT_YIELD_BUDGET)))

  it.scoped("a renewal in flight finishes before the release starts", () =>
    Effect.gen(function*() {
      const faults = makeFaults()
      faults.renewDelay = Effect.sleep(Duration.millis(200))
      const shared = yield* MemoryBackend.makeStore
      const a = yield* node(shared, faults, Duration.seconds(3))
      const holder = yield* Effect.fork(Effect.scoped(Effect.zipRight(a.acquire("slow-renew"), Effect.never)))
      yield* storeHolds(shared, "slow-renew")
      yield* TestClock.adjust(Duration.millis(1050))
      expect(faults.events).toEqual(["renew:start"])
      const closing = yield* Effect.fork(Fiber.interrupt(holder))
      // The release has started (the service no longer lists the lease) and waits for the renewal.
      yield* until("the release started", Effect.map(a.inspect, (held) => held.length === 0))
      expect(faults.events).toEqual(["renew:start"])
      yield* TestClock.adjust(Duration.millis(300))
      yield* Fiber.join(closing)
      expect(faults.events).toEqual(["renew:start", "renew:end", "release:start:slow-renew", "release:end:slow-renew"])
    }))

  it.scoped("a hung renewal still ends in LockLost before the lease expires in the store", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const faults = makeFaults()
      faults.hangRenew = true
      const a = yield* node(shared, faults, Duration.seconds(3))
      const lease = yield* a.acquire("hung")
      const lost = yield* Effect.fork(Effect.flip(lease.lost))
      yield* TestClock.adjust(Duration.millis(2400))
      const error = yield* Fiber.join(lost)
      expect(error.reason).toBe("renewal-failed")
      expect(yield* MemoryBackend.holders(shared)).toHaveLength(1)
    }))

  it.scoped("one hung renewal does not delay another lease's loss past its safety deadline", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const faults = makeFaults()
      faults.hangRenew = true
      const a = yield* node(shared, faults)
      yield* a.acquire("slow", { ttl: "3 seconds" })
      yield* TestClock.adjust(Duration.millis(950))
      const short = yield* a.acquire("short", { ttl: "300 millis" })
      const lostAt = yield* Effect.fork(Effect.zipRight(Effect.flip(short.lost), monotonicMillis))
      // "slow"'s renewal hangs from 1,000 ms with a 1 s budget; "short" must go at 950 + 240 ms.
      yield* TestClock.adjust(Duration.millis(300))
      const at = yield* Fiber.join(lostAt)
      expect(at).toBeLessThanOrEqual(1190)
      // Let the hung renewal reach its own budget so the test's scope can release "slow".
      yield* TestClock.adjust(Duration.seconds(2))
    }))

  it.scoped("closing the service tells its holders, interrupts guarded bodies and releases, even mid-renewal", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const faults = makeFaults()
      faults.renewDelay = Effect.never
      const scope = yield* Scope.make()
      const a = yield* Scope.extend(node(shared, faults, Duration.seconds(3)), scope)
      const stopped = yield* Effect.makeLatch(false)
      const started = yield* Deferred.make<void>()
      const body = Effect.zipRight(Deferred.succeed(started, undefined), Effect.never)
      const run = yield* Effect.fork(
        DistributedLock.withLock(body.pipe(Effect.onInterrupt(() => stopped.open)), "closing").pipe(provide(a))
      )
      yield* Deferred.await(started)
      yield* TestClock.adjust(Duration.millis(1100))
      expect(faults.events).toContain("renew:start")
      yield* Scope.close(scope, Exit.void)
      const error = yield* Effect.flip(Fiber.join(run))
      expect(error).toMatchObject({ _tag: "LockLost", name: "closing", reason: "shutdown" })
      yield* stopped.await
      expect(yield* MemoryBackend.holders(shared)).toEqual([])
      const refused = yield* Effect.flip(Effect.scoped(a.acquire("after-close")))
      expect(refused._tag).toBe("LockBackendError")
    }))

  // The window between the body's fork and its registration with the lease: a close that ran there
  // found no body to wait for and gave the lease back, and the body then started. The close is
  // scheduled from the fork itself (a supervisor's onStart, ahead of the body's start), and the
  // guard's start is stepped through its yield budget, so that one run yields in that window.
  it.scoped("a close that runs right after the guard forks its body never lets the body run past the release", () =>
    Effect.gen(function*() {
      const runtime = yield* Effect.runtime<never>()
      // Runs whose close started before the guard's next step (it had not yet asked to hear of the loss).
      let inWindow = 0
      // The guard starts after `run` steps of one operation each: one run yields in the window.
      for (let run = 0; run <= WINDOW_BUDGET + 1; run++) {
        const shared = yield* MemoryBackend.makeStore
        const faults = makeFaults()
        const scope = yield* Scope.make()
        // A grant with no deadline, as a session advisory lock's: no stall watch checks the body's steps.
        const a = yield* Scope.extend(Effect.flatMap(MemoryBackend.makeBackend({ store: shared }), (backend) =>
          DistributedLock.make(withoutDeadline(withFaults(backend, faults)))), scope)
        const name = `window-${run}`
        const lease = yield* a.acquire(name)
        let closing: Fiber.RuntimeFiber<void> | undefined
        const closeOnFork = new OnFirstFork(() => {
          const started = Effect.sync(() => {
            if ((heldOf(lease)!.onLost?.size ?? 0) === 0) inWindow++
          })
          closing = Runtime.runFork(runtime)(Effect.zipRight(started, Scope.close(scope, Exit.void)), { immediate: false })
        })
        const guarded = Effect.supervised(DistributedLock.guard(lease, slowToStop(faults.events)), closeOnFork)
        const exit = yield* Effect.exit(afterSteps(run, guarded)).pipe(withYieldBudget(WINDOW_BUDGET))
        yield* Fiber.join(closing!)
        expect(Exit.isFailure(exit) && Cause.failureOption(exit.cause)).toMatchObject(Option.some({ _tag: "LockLost", reason: "shutdown" }))
        const events = faults.events.filter((event) => event.startsWith("body") || event === `release:start:${name}`)
        // Whatever of the body ran, all of it ran before the lease was given back.
        const expected = [...events.filter((event) => event.startsWith("body")), `release:start:${name}`]
        expect(`run ${run}: ${events.join(" ")}`).toBe(`run ${run}: ${expected.join(" ")}`)
      }
      // The case checked something: in some run the close did start in the window.
      expect(inWindow, "runs whose close started between the fork and the guard's next step").toBeGreaterThan(0)
    }))

  it.scoped("interrupting a holder while its release is under way neither cuts the release off nor reports it failed", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const logs: Array<string> = []
      const captured = Logger.replace(Logger.defaultLogger, Logger.make(({ message }) => logs.push(String(message))))
      const releasing = yield* Deferred.make<void>()
      const gate = yield* Effect.makeLatch(false)
      // A store whose release takes a round trip (as a database's does), held at the gate.
      const a = yield* Effect.flatMap(MemoryBackend.makeBackend({ store: shared }), (backend) =>
        DistributedLock.make(slowRelease(backend, Effect.zipRight(Deferred.succeed(releasing, undefined), gate.await)))).pipe(
          Effect.provide(captured)
        )
      const holder = yield* Effect.fork(DistributedLock.withLock(Effect.void, "released-late").pipe(provide(a), Effect.provide(captured)))
      yield* Deferred.await(releasing)
      // The caller goes away (a client dropped its request) while the release is on its way.
      const interrupting = yield* Effect.fork(Fiber.interrupt(holder))
      yield* yieldTimes(50)
      yield* gate.open
      yield* Fiber.join(interrupting)
      yield* until("the release reached the store", Effect.map(MemoryBackend.holders(shared), (held) => held.length === 0))
      expect(logs.filter((line) => line.includes("failed"))).toEqual([])
    }))

  // Review of bfba86d: on the live clock a wait is a callback raced with its deadline, in the
  // caller's region; an uninterruptible caller interrupted while it waited then waited on for the holder.
  it.live("on the live clock, an uninterruptible acquire interrupted while it waits ends at once and leaves no waiter", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const semaphores = yield* Effect.flatMap(MemoryBackend.makeBackend({ store: shared }), (backend) => DistributedSemaphore.make(backend.semaphore))
      const waitingOn = (name: string) =>
        Effect.map(MemoryBackend.semaphores(shared), (all) => all.find((s) => s.name === name)?.waiting ?? [])
      yield* semaphores.acquire("held", { limit: 1 })
      const waiter = yield* Effect.fork(Effect.uninterruptible(Effect.scoped(semaphores.acquire("held", { limit: 1 }))))
      yield* waitUntil("live", "the waiter is queued", Effect.map(waitingOn("held"), (w) => w.length === 1))
      const started = Date.now()
      const exit = yield* Fiber.interrupt(waiter)
      // The holder keeps its permit for its 30 s ttl: the interrupt, not the holder, ended the wait.
      expect(Date.now() - started).toBeLessThan(1_000)
      expect(Exit.isInterrupted(exit)).toBe(true)
      expect(yield* waitingOn("held")).toEqual([])
    }).pipe(Effect.scoped))

  it.live("a release that never settles, even uninterruptibly, holds the scope's close for its bound only", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const logs: Array<string> = []
      const captured = Logger.replace(Logger.defaultLogger, Logger.make(({ message }) => logs.push(String(message))))
      const a = yield* Effect.flatMap(MemoryBackend.makeBackend({ store: shared }), (backend) =>
        DistributedLock.make(slowRelease(backend, Effect.uninterruptible(Effect.never)), { releaseTimeout: Duration.millis(100) })).pipe(
          Effect.provide(captured)
        )
      const started = Date.now()
      yield* Effect.scoped(a.acquire("never-released")).pipe(Effect.provide(captured))
      // The bound the core keeps for any release: twice releaseTimeout plus a second of slack.
      expect(Date.now() - started).toBeLessThan(2 * 100 + 1_000 + 500)
      expect(logs.some((line) => line.includes("releasing lock \"never-released\" failed"))).toBe(true)
    }).pipe(Effect.scoped))

  it.scoped("a grant that arrives after its safety deadline is given back and the acquire tries again", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const faults = makeFaults()
      let slowAnswers = 1
      faults.afterGrant = Effect.suspend(() => slowAnswers-- > 0 ? Effect.sleep(Duration.millis(2500)) : Effect.void)
      const a = yield* node(shared, faults, Duration.seconds(3))
      const taking = yield* Effect.fork(a.acquire("late"))
      // Granted in the store, its answer on its way.
      yield* storeHolds(shared, "late")
      yield* TestClock.adjust(Duration.millis(2600))
      const lease = yield* Fiber.join(taking)
      expect(lease.token).toBe(2n)
      expect(yield* lease.isHeld).toBe(true)
      expect((yield* MemoryBackend.holders(shared)).map((h) => h.token)).toEqual([2n])
    }))

  it.scoped("guard never starts the body on a lease already lost", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const a = yield* node(shared)
      const lease = yield* a.acquire("gone")
      yield* MemoryBackend.revoke(shared, "gone")
      let ran = false
      const error = yield* Effect.flip(DistributedLock.guard(lease, Effect.sync(() => (ran = true))))
      expect(error).toMatchObject({ _tag: "LockLost", reason: "revoked" })
      expect(ran).toBe(false)
    }))

  it.scoped("guard never starts the body on a lease already released, nor one released before the body's first step: a defect naming the misuse", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const a = yield* node(shared)
      let ran = 0
      const body = Effect.sync(() => ran++)
      // The lease's scope closed before the guard ran.
      const released = yield* Effect.scoped(a.acquire("given-back"))
      const early = yield* Effect.exit(DistributedLock.guard(released, body))
      // The guard forked off, its lease's scope closing before the body's first step.
      const late = yield* Effect.scoped(Effect.flatMap(a.acquire("given-back"), (lease) => Effect.fork(DistributedLock.guard(lease, body))))
      const lateExit = yield* Fiber.await(late)
      for (const exit of [early, lateExit]) {
        const defect = Exit.isFailure(exit) ? Cause.dieOption(exit.cause) : Option.none()
        expect(Option.getOrThrow(defect)).toMatchObject({ _tag: "IllegalArgumentException", message: expect.stringContaining("after it was released") })
      }
      expect(ran).toBe(0)
      expect(yield* MemoryBackend.holders(shared)).toEqual([])
    }))

  it.scoped("a guard forked off whose lease's scope closes while the body runs: the body is interrupted and has stopped before the lease is given back", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const faults = makeFaults()
      const a = yield* node(shared, faults)
      const leaseScope = yield* Scope.make()
      const lease = yield* Scope.extend(a.acquire("forked"), leaseScope)
      const guarded = yield* Effect.fork(DistributedLock.guard(lease, slowToStop(faults.events)))
      yield* until("the body started", Effect.sync(() => faults.events.includes("body:start")))
      yield* Scope.close(leaseScope, Exit.void)
      expect(faults.events.filter((event) => event.startsWith("body") || event.startsWith("release:start"))).toEqual([
        "body:start",
        "body:end",
        "release:start:forked"
      ])
      const exit = yield* Fiber.await(guarded)
      expect(Exit.isFailure(exit) && Cause.isInterruptedOnly(exit.cause)).toBe(true)
      expect(yield* MemoryBackend.holders(shared)).toEqual([])
    }))

  it.scoped("a stolen lease is reported as stolen", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const faults = makeFaults()
      const a = yield* node(shared, faults, Duration.seconds(3))
      const b = yield* node(shared)
      const lease = yield* a.acquire("stolen")
      // The holder's process is frozen: no renewal reaches the store, then it wakes up.
      faults.renewDelay = Effect.sleep(Duration.seconds(5))
      yield* Effect.fork(b.acquire("stolen"))
      const lost = yield* Effect.fork(Effect.flip(lease.lost))
      yield* TestClock.adjust(Duration.seconds(7))
      const error = yield* Fiber.join(lost)
      // Told before the takeover by its own deadline; the store confirms the takeover afterwards.
      expect(error.reason).toBe("renewal-failed")
      const [holder] = yield* MemoryBackend.holders(shared)
      expect(holder!.token > lease.token).toBe(true)
    }))

  it.scoped("a renewal that finds the lease taken over reports it stolen", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const backend = yield* MemoryBackend.makeBackend({ store: shared })
      const granted = yield* backend.acquire({
        name: "direct",
        mode: "exclusive",
        attempt: "once",
        ttl: Duration.seconds(1),
        deadline: Option.none(),
        interruptible: (e) => e,
        waitUntilDeadline: (e) => Effect.asSome(e),
        onLost: () => Effect.void
      })
      if (granted._tag !== "Granted") throw new Error("expected a grant")
      yield* TestClock.adjust(Duration.seconds(2))
      const b = yield* node(shared)
      yield* b.acquire("direct")
      const [outcome] = yield* backend.renew([granted.grant])
      expect(outcome).toEqual({ _tag: "Lost", reason: "stolen" })
      yield* granted.grant.release
      expect(yield* MemoryBackend.holders(shared)).toHaveLength(1)
    }))

  it.scoped("singleton: exactly one of three contenders runs the effect; on loss another takes over", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const nodes = [yield* node(shared), yield* node(shared), yield* node(shared)]
      let running = 0
      let maxRunning = 0
      const runs: Array<number> = []
      const effect = (id: number) =>
        Effect.acquireRelease(
          Effect.sync(() => {
            running++
            maxRunning = Math.max(maxRunning, running)
            runs.push(id)
          }),
          () => Effect.sync(() => running--)
        ).pipe(Effect.zipRight(Effect.never), Effect.scoped)
      const fibers = yield* Effect.forEach(nodes, (service, id) =>
        Effect.fork(DistributedLock.singleton("leader", effect(id)).pipe(provide(service))))
      yield* until("a leader runs", Effect.sync(() => runs.length === 1))
      for (let round = 0; round < 3; round++) {
        const before = runs.length
        yield* MemoryBackend.revoke(shared, "leader")
        yield* until("a new leader runs", Effect.sync(() => runs.length === before + 1))
        // Competitors that lost wait out their backoff; none of them may run meanwhile.
        yield* TestClock.adjust(Duration.millis(10))
        expect(running).toBe(1)
      }
      expect(maxRunning).toBe(1)
      expect(runs.length).toBe(4)
      // The leader's process stops: one of the others takes over.
      const leader = runs[runs.length - 1]!
      yield* Fiber.interrupt(fibers[leader]!)
      yield* until("another process leads", Effect.sync(() => runs.length === 5))
      expect(running).toBe(1)
      expect(runs[runs.length - 1]).not.toBe(leader)
      expect(maxRunning).toBe(1)
      yield* Fiber.interruptAll(fibers)
    }))

  it.scoped("singleton: a finished run releases and competes again; a failure ends it with the error", () =>
    Effect.gen(function*() {
      const a = yield* node(yield* MemoryBackend.makeStore)
      let runs = 0
      const fiber = yield* Effect.fork(
        DistributedLock.singleton("batch", Effect.sync(() => runs++), { restartAfter: "1 second" }).pipe(provide(a))
      )
      // Runs at 0, 1, 2 and 3 s (adjust waits until the singleton is asleep before moving time).
      yield* TestClock.adjust(Duration.millis(3500))
      expect(runs).toBe(4)
      yield* Fiber.interrupt(fiber)
      const failed = yield* Effect.flip(
        DistributedLock.singleton("batch", Effect.fail("bad input" as const)).pipe(provide(a))
      )
      expect(failed).toBe("bad input")
      expect(yield* a.inspect).toEqual([])
    }))

  it.scoped("inspect lists the locks this process holds", () =>
    Effect.gen(function*() {
      const a = yield* node(yield* MemoryBackend.makeStore)
      const name = freshName("inspect")
      const lease = yield* a.acquire(name, { mode: "shared" })
      const [held] = yield* a.inspect
      expect(held).toMatchObject({ name, token: lease.token, mode: "shared", backend: "memory" })
      expect(Option.isSome(held!.validUntil)).toBe(true)
    }))

  it.effect("the layer provides the service; acquire is scoped", () =>
    Effect.gen(function*() {
      const token = yield* Effect.scoped(Effect.map(DistributedLock.acquire("nightly"), (lease) => lease.token))
      expect(token).toBe(1n)
      const exit = yield* Effect.exit(Effect.scoped(DistributedLock.acquire("")))
      expect(Exit.isFailure(exit)).toBe(true)
    }).pipe(Effect.provide(MemoryBackend.layer())))
})

/** Records every log line (debug included) of what runs inside it. */
const capturingLogs = () => {
  const lines: Array<{ readonly level: string; readonly message: string }> = []
  const logger = Logger.make(({ logLevel, message }) => {
    lines.push({ level: logLevel.label, message: Array.isArray(message) ? message.map(String).join(" ") : String(message) })
  })
  const provideLogs = <A, E, R>(self: Effect.Effect<A, E, R>) =>
    self.pipe(Effect.provide(Logger.replace(Logger.defaultLogger, logger)), Logger.withMinimumLogLevel(LogLevel.Debug))
  return { lines, provideLogs }
}

describe("the renewal loop is supervised", () => {
  it.scoped("a defect in the loop is logged, the loop restarts, and leases are still declared lost on time", () =>
    Effect.gen(function*() {
      const logs = capturingLogs()
      let throwOnce = true
      // A logger that throws the first time a loss is logged: a defect inside the loop's own step.
      const throwing = Logger.make(({ logLevel, message }) => {
        const text = Array.isArray(message) ? message.map(String).join(" ") : String(message)
        if (throwOnce && text.includes("lost lock")) {
          throwOnce = false
          throw new Error("injected: the logger broke")
        }
        logs.lines.push({ level: logLevel.label, message: text })
      })
      yield* Effect.gen(function*() {
        const faults = makeFaults()
        faults.failRenew = true
        const a = yield* node(yield* MemoryBackend.makeStore, faults)
        const first = yield* a.acquire("first", { ttl: "1 second" })
        const second = yield* a.acquire("second", { ttl: "3 seconds" })
        const firstLostAt = yield* Effect.fork(Effect.zipRight(Effect.flip(first.lost), monotonicMillis))
        const secondLostAt = yield* Effect.fork(Effect.zipRight(Effect.flip(second.lost), monotonicMillis))
        yield* TestClock.adjust("3 seconds")
        // Safety deadlines: 1 s − 1/5 and 3 s − 3/5 (renewals all failed).
        expect(yield* Fiber.poll(firstLostAt)).toEqual(Option.some(Exit.succeed(800)))
        expect(yield* Fiber.poll(secondLostAt)).toEqual(Option.some(Exit.succeed(2400)))
        // And a lease taken after the defect is still looked after.
        faults.failRenew = false
        const third = yield* a.acquire("third", { ttl: "1 second" })
        yield* TestClock.adjust("5 seconds")
        expect(yield* third.isHeld).toBe(true)
      }).pipe(Effect.provide(Logger.replace(Logger.defaultLogger, throwing)))
      expect(throwOnce).toBe(false)
      expect(logs.lines.some((l) => l.level === "ERROR" && l.message.includes("renewal loop failed"))).toBe(true)
    }))

  it.scoped("a renew call that throws or dies is retried at the retry pace, not in a spin; losses stay on time", () =>
    Effect.gen(function*() {
      for (const broken of ["throws", "dies"] as const) {
        const shared = yield* MemoryBackend.makeStore
        const base = yield* MemoryBackend.makeBackend({ store: shared })
        let calls = 0
        const backend: typeof base = {
          ...base,
          renew: (grants) => {
            calls++
            if (broken === "throws") throw new Error("injected: renew threw")
            return Effect.zipRight(Effect.die(new Error("injected: renew died")), base.renew(grants))
          }
        }
        const a = yield* DistributedLock.make(backend)
        const start = yield* monotonicMillis
        const lease = yield* a.acquire("broken", { ttl: "3 seconds" })
        const lostAt = yield* Effect.fork(Effect.zipRight(Effect.flip(lease.lost), monotonicMillis))
        yield* TestClock.adjust("3 seconds")
        expect((yield* Fiber.join(lostAt)) - start).toBeLessThanOrEqual(2400)
        // First attempt at 1,000 ms, then ttl/10 apart, sooner near the store's expiry (a quarter of
        // the time left): 1,000, 1,300, 1,600, 1,900, 2,175 and 2,381 ms, until the deadline at 2,400.
        expect(calls).toBeGreaterThanOrEqual(4)
        expect(calls).toBeLessThanOrEqual(6)
      }
    }))

  it.scoped("a backend whose renewBatchSize is not a positive integer is refused when the service is built", () =>
    Effect.gen(function*() {
      const base = yield* MemoryBackend.makeBackend()
      for (const renewBatchSize of [0, -1, 1.5, Number.NaN]) {
        const exit = yield* Effect.exit(DistributedLock.make({ ...base, renewBatchSize }))
        expect(Exit.isFailure(exit)).toBe(true)
        if (Exit.isFailure(exit)) {
          const defect = Cause.dieOption(exit.cause)
          expect(Option.isSome(defect)).toBe(true)
          expect(String(Option.getOrUndefined(defect))).toContain("renewBatchSize must be a positive integer")
        }
      }
    }))
})

/**
 * A local TCP peer that answers each request at once and can then block the event loop: the
 * answer sits in the socket buffer during the stall, as a database's answer does during a GC
 * pause. After a stall Node runs due timers before it reads sockets.
 */
const stallingPeer = Effect.acquireRelease(
  Effect.promise(async () => {
    let stallNext = 0
    let stallEnded = 0
    const server = Net.createServer((socket) => {
      socket.on("data", () => {
        socket.write("!")
        const millis = stallNext
        stallNext = 0
        if (millis > 0) {
          stallEnded = blockThread(millis)
        }
      })
    })
    await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve))
    const { port } = server.address() as Net.AddressInfo
    const client = Net.connect(port, "127.0.0.1")
    client.setNoDelay(true)
    await new Promise<void>((resolve) => client.once("connect", resolve))
    const roundTrip = Effect.async<void>((resume) => {
      const onData = () => resume(Effect.void)
      client.once("data", onData)
      client.write("?")
      return Effect.sync(() => client.off("data", onData))
    })
    return {
      server,
      client,
      roundTrip,
      stallAfterNextAnswer: (millis: number) => (stallNext = millis),
      stallEnded: () => stallEnded
    }
  }),
  ({ client, server }) =>
    Effect.promise(() => {
      client.destroy()
      return new Promise<void>((resolve) => server.close(() => resolve()))
    })
)

describe("bounds on backend calls survive event-loop stalls", () => {
  it.scopedLive("a renewal answered during a stall longer than its budget counts: no failure, no retry", () =>
    Effect.gen(function*() {
      const peer = yield* stallingPeer
      const logs = capturingLogs()
      const base = yield* MemoryBackend.makeBackend()
      let calls = 0
      // Every renewal is a round trip to the peer first, as a database's would be.
      const backend: typeof base = {
        ...base,
        renew: (grants) => Effect.zipRight(Effect.zipRight(Effect.sync(() => calls++), peer.roundTrip), base.renew(grants))
      }
      const { a, lease } = yield* logs.provideLogs(Effect.gen(function*() {
        const a = yield* DistributedLock.make(backend)
        // ttl 9 s: the renewal starts at 3 s with a 3 s budget; safety deadline at 7.2 s.
        const lease = yield* a.acquire(freshName("stall-renew"), { ttl: "9 seconds" })
        return { a, lease }
      }))
      const [before] = yield* a.inspect
      // The peer answers the first renewal at once, then the process stalls 3.3 s (> the budget).
      peer.stallAfterNextAnswer(3_300)
      yield* waitUntil("live", "the stall happened and ended", Effect.sync(() => peer.stallEnded() > 0))
      yield* waitUntil("live", "the renewal's answer was applied", Effect.map(a.inspect, ([held]) =>
        held !== undefined && Option.getOrThrow(held.validUntil) > Option.getOrThrow(before!.validUntil)))
      expect(calls).toBeGreaterThanOrEqual(1)
      expect(yield* lease.isHeld).toBe(true)
      // The answer that waited in the socket during the stall counted: nothing timed out or retried.
      expect(logs.lines.filter((l) => l.message.includes("renewal"))).toEqual([])
    }), 30_000)
})

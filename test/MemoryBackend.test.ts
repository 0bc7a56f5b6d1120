import { describe, expect, it } from "@effect/vitest"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import * as TestClock from "effect/TestClock"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as MemoryBackend from "effect-lock/MemoryBackend"
import { monotonicMillis } from "../src/internal/clock.js"
import { contractSuite, freshName } from "./support/contract.js"
import { type Faults, makeFaults, withFaults } from "./support/faults.js"

const settle = Effect.repeatN(Effect.yieldNow(), 50)

const store = Effect.runSync(MemoryBackend.makeStore)

contractSuite("MemoryBackend", {
  clock: "test",
  ttl: Duration.seconds(3),
  makeBackend: MemoryBackend.makeBackend({ store }),
  storeHolders: (name) =>
    Effect.map(MemoryBackend.holders(store), (all) => all.filter((lease) => lease.name === name).length),
  advance: TestClock.adjust,
  settle,
  maxNameBytes: 1024,
  minTtl: Duration.millis(100)
})

/** One "process" of a cluster sharing `shared`, with injectable renewal faults. */
const node = (shared: MemoryBackend.Store, faults: Faults = makeFaults(), ttl?: Duration.DurationInput) =>
  Effect.flatMap(MemoryBackend.makeBackend({ store: shared, ttl }), (backend) =>
    DistributedLock.make(withFaults(backend, faults)))

const provide = (service: DistributedLock.Service) => Effect.provideService(DistributedLock.DistributedLock, service)

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
        yield* settle
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

  it.scoped("withLock: a lost lease interrupts the body and the result is LockLost with its token", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const a = yield* node(shared)
      const interrupted = yield* Effect.makeLatch(false)
      const run = yield* Effect.fork(
        DistributedLock.withLock(Effect.never.pipe(Effect.onInterrupt(() => interrupted.open)), "job").pipe(provide(a))
      )
      yield* settle
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
      const body = Effect.never.pipe(
        Effect.ensuring(
          Effect.zipRight(Effect.sleep(Duration.seconds(1)), Effect.sync(() => faults.events.push("body:finalized")))
        )
      )
      const run = yield* Effect.fork(DistributedLock.withLock(body, "ordered").pipe(provide(a)))
      yield* settle
      const interrupting = yield* Effect.fork(Fiber.interrupt(run))
      yield* settle
      yield* TestClock.adjust(Duration.seconds(2))
      yield* Fiber.join(interrupting)
      expect(faults.events.filter((e) => !e.startsWith("renew"))).toEqual([
        "body:finalized",
        "release:start:ordered",
        "release:end:ordered"
      ])
      expect(yield* MemoryBackend.holders(shared)).toEqual([])
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

  it.scoped("a renewal in flight finishes before the release starts", () =>
    Effect.gen(function*() {
      const faults = makeFaults()
      faults.renewDelay = Effect.sleep(Duration.millis(200))
      const a = yield* node(yield* MemoryBackend.makeStore, faults, Duration.seconds(3))
      const holder = yield* Effect.fork(Effect.scoped(Effect.zipRight(a.acquire("slow-renew"), Effect.never)))
      yield* settle
      yield* TestClock.adjust(Duration.millis(1050))
      expect(faults.events).toEqual(["renew:start"])
      const closing = yield* Effect.fork(Fiber.interrupt(holder))
      yield* settle
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
      const run = yield* Effect.fork(
        DistributedLock.withLock(Effect.never.pipe(Effect.onInterrupt(() => stopped.open)), "closing").pipe(provide(a))
      )
      yield* settle
      yield* TestClock.adjust(Duration.millis(1100))
      expect(faults.events).toContain("renew:start")
      yield* Scope.close(scope, Exit.void)
      const error = yield* Effect.flip(Fiber.join(run))
      expect(error).toMatchObject({ _tag: "LockLost", name: "closing", reason: "revoked" })
      yield* stopped.await
      expect(yield* MemoryBackend.holders(shared)).toEqual([])
      const refused = yield* Effect.flip(Effect.scoped(a.acquire("after-close")))
      expect(refused._tag).toBe("LockBackendError")
    }))

  it.scoped("a grant that arrives after its safety deadline is given back and the acquire tries again", () =>
    Effect.gen(function*() {
      const shared = yield* MemoryBackend.makeStore
      const faults = makeFaults()
      let slowAnswers = 1
      faults.afterGrant = Effect.suspend(() => slowAnswers-- > 0 ? Effect.sleep(Duration.millis(2500)) : Effect.void)
      const a = yield* node(shared, faults, Duration.seconds(3))
      const taking = yield* Effect.fork(a.acquire("late"))
      yield* settle
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
      yield* settle
      expect(running).toBe(1)
      for (let round = 0; round < 3; round++) {
        yield* MemoryBackend.revoke(shared, "leader")
        yield* settle
        yield* TestClock.adjust(Duration.millis(10))
        yield* settle
        expect(running).toBe(1)
      }
      expect(maxRunning).toBe(1)
      expect(runs.length).toBe(4)
      // The leader's process stops: one of the others takes over.
      const leader = runs[runs.length - 1]!
      yield* Fiber.interrupt(fibers[leader]!)
      yield* settle
      expect(running).toBe(1)
      expect(runs[runs.length - 1]).not.toBe(leader)
      yield* Fiber.interruptAll(fibers)
    }))

  it.scoped("singleton: a finished run releases and competes again; a failure ends it with the error", () =>
    Effect.gen(function*() {
      const a = yield* node(yield* MemoryBackend.makeStore)
      let runs = 0
      const fiber = yield* Effect.fork(
        DistributedLock.singleton("batch", Effect.sync(() => runs++), { restartAfter: "1 second" }).pipe(provide(a))
      )
      yield* settle
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

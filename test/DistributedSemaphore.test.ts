/**
 * DistributedSemaphore on the memory backend, under TestClock: several "processes" (services over
 * one shared store), permits under contention with the runtime switching fibers every 12 ops,
 * limits, fair wake-ups, loss and interruption.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as TestClock from "effect/TestClock"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as DistributedSemaphore from "effect-lock/DistributedSemaphore"
import type { SemaphoreBackend } from "effect-lock/LockBackend"
import { LockBackendError } from "effect-lock/LockError"
import * as MemoryBackend from "effect-lock/MemoryBackend"
import { TIGHT_YIELD_BUDGET, waitUntil, withYieldBudget } from "./support/contract.js"
import { yieldTimes } from "./support/faults.js"
import { seededRandom, testSeed } from "./support/random.js"
import { occupancy } from "./support/occupancy.js"

/** One "process" of a cluster sharing `store`: its own semaphore service (own registry, own renewals). */
const node = (store: MemoryBackend.Store, wrap: (backend: SemaphoreBackend<any>) => SemaphoreBackend<any> = (b) => b) =>
  Effect.flatMap(MemoryBackend.makeBackend({ store }), (backend) => DistributedSemaphore.make(wrap(backend.semaphore)))

const provide = (service: DistributedSemaphore.Service) =>
  Effect.provideService(DistributedSemaphore.DistributedSemaphore, service)

const until = (what: string, condition: Effect.Effect<boolean>) => waitUntil("test", what, condition)

const stateOf = (store: MemoryBackend.Store, name: string) =>
  Effect.map(MemoryBackend.semaphores(store), (all) => all.find((s) => s.name === name))

/** Until `name` has waiters asking for exactly these permits, in this order. */
const waitingAre = (store: MemoryBackend.Store, name: string, permits: ReadonlyArray<number>) =>
  until(
    `"${name}" has waiters ${JSON.stringify(permits)}`,
    Effect.map(stateOf(store, name), (s) => JSON.stringify(s?.waiting ?? []) === JSON.stringify(permits))
  )

const heldPermits = (store: MemoryBackend.Store, name: string) =>
  Effect.map(stateOf(store, name), (s) => (s?.holders ?? []).reduce((sum, h) => sum + h.permits, 0))


const LIMIT = 3
const PROCESSES = 3
const FIBERS_PER_PROCESS = 4
const ROUNDS = 25

describe("DistributedSemaphore on the memory backend", () => {
  for (const budget of [undefined, TIGHT_YIELD_BUDGET]) {
    const label = budget === undefined ? "" : ` (runtime switching fibers every ${budget} ops)`
    it.scoped(`never more than limit permits held across ${PROCESSES} processes × ${FIBERS_PER_PROCESS} fibers${label}`, () =>
      Effect.gen(function*() {
        const seed = testSeed()
        const random = seededRandom(seed)
        const store = yield* MemoryBackend.makeStore
        const services = yield* Effect.forEach(Array.from({ length: PROCESSES }), () => node(store))
        // A few steps inside, so the runtime switches fibers while the permits are held.
        const probe = occupancy(LIMIT, yieldTimes(3))
        const plans = Array.from(
          { length: PROCESSES * FIBERS_PER_PROCESS },
          () => Array.from({ length: ROUNDS }, () => 1 + Math.floor(random() * LIMIT))
        )
        const worker = (plan: ReadonlyArray<number>, i: number) =>
          Effect.forEach(plan, (permits) =>
            probe.body(permits).pipe(
              DistributedSemaphore.withPermits("pool", { limit: LIMIT, permits }),
              provide(services[i % PROCESSES]!)
            ), { discard: true })
        const run = Effect.forEach(plans, worker, { concurrency: "unbounded", discard: true })
        yield* budget === undefined ? run : withYieldBudget(budget)(run)
        const context = `seed ${seed} (re-run with EFFECT_LOCK_TEST_SEED=${seed})`
        expect(probe.violations(), context).toBe(0)
        // The check could fail: the permits were all in use at some moment.
        expect(probe.most(), context).toBe(LIMIT)
        expect(yield* MemoryBackend.semaphores(store)).toEqual([])
      }))
  }

  it.scoped("each permit carries a fencing token, strictly increasing per name across grants", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const [a, b] = [yield* node(store), yield* node(store)]
      const first = yield* a.acquire("tokens", { limit: 5, permits: 3 })
      const second = yield* b.acquire("tokens", { limit: 5, permits: 2 })
      expect(first.tokens).toEqual([1n, 2n, 3n])
      expect(second.tokens).toEqual([4n, 5n])
      expect([first.permits, first.limit, second.permits]).toEqual([3, 5, 2])
      // One counter per store: another name's permits take the store's next token.
      const other = yield* a.acquire("other-name", { limit: 1 })
      expect(other.tokens).toEqual([6n])
    }))

  it.scoped("asking with another limit than the holders' fails with LimitMismatch; a free name takes any limit", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const [a, b] = [yield* node(store), yield* node(store)]
      const held = yield* Effect.forkScoped(Effect.scoped(Effect.zipRight(a.acquire("sized", { limit: 3 }), Effect.never)))
      yield* until("the first holder holds", Effect.map(heldPermits(store, "sized"), (n) => n === 1))
      const error = yield* Effect.flip(Effect.scoped(b.acquire("sized", { limit: 4 })))
      expect(error).toBeInstanceOf(DistributedSemaphore.LimitMismatch)
      expect(error).toMatchObject({ _tag: "LimitMismatch", name: "sized", limit: 4, current: 3 })
      expect(error.message).toBe(`semaphore "sized" is in use with limit 3; asked with limit 4`)
      // tryAcquire too, and a waiter counts as "in use": its limit is the name's limit.
      expect(yield* Effect.flip(Effect.scoped(b.tryAcquire("sized", { limit: 2 })))).toMatchObject({ _tag: "LimitMismatch" })
      yield* Fiber.interrupt(held)
      expect(yield* stateOf(store, "sized")).toBeUndefined()
      const fresh = yield* Effect.scoped(b.acquire("sized", { limit: 4 }))
      expect(fresh.limit).toBe(4)
    }))

  it.scoped("a waiter fixes the limit too: a request with another limit is refused while it waits", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const [a, b] = [yield* node(store), yield* node(store)]
      const holder = yield* Effect.forkScoped(Effect.scoped(Effect.zipRight(a.acquire("w", { limit: 1 }), Effect.never)))
      yield* until("held", Effect.map(heldPermits(store, "w"), (n) => n === 1))
      const waiter = yield* Effect.fork(Effect.scoped(b.acquire("w", { limit: 1 })))
      yield* waitingAre(store, "w", [1])
      expect(yield* Effect.flip(Effect.scoped(a.acquire("w", { limit: 7, timeout: 0 })))).toMatchObject({
        _tag: "LimitMismatch",
        current: 1
      })
      yield* Fiber.interrupt(holder)
      expect((yield* Fiber.join(waiter)).limit).toBe(1)
    }))

  it.effect("bad limits and permit counts are InvalidPermits, before anything is asked of the store", () =>
    Effect.gen(function*() {
      const cases: ReadonlyArray<[DistributedSemaphore.PermitOptions, string]> = [
        [{ limit: 0 }, "limit must be a positive integer, got 0"],
        [{ limit: 2.5 }, "limit must be a positive integer, got 2.5"],
        [{ limit: 3, permits: 0 }, "permits must be a positive integer, got 0"],
        [{ limit: 3, permits: 4 }, "asked for 4 permits of a limit of 3"],
        [{ limit: Number.NaN }, "limit must be a positive integer, got NaN"]
      ]
      for (const [options, reason] of cases) {
        const error = yield* Effect.flip(Effect.scoped(DistributedSemaphore.acquire("bad", options)))
        expect(error).toMatchObject({ _tag: "InvalidPermits", name: "bad", reason })
      }
      expect(yield* Effect.flip(Effect.scoped(DistributedSemaphore.acquire("", { limit: 1 })))).toMatchObject({
        _tag: "InvalidLockName"
      })
    }).pipe(Effect.provide(MemoryBackend.layer())))

  it.scoped("a holder of 2 releasing them wakes the waiters that fit, in order; the next waits for its 3", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const [a, b] = [yield* node(store), yield* node(store)]
      const name = "wake"
      const releaseTwo = yield* Deferred.make<void>()
      const two = yield* Effect.forkScoped(
        Effect.scoped(Effect.zipRight(a.acquire(name, { limit: 3, permits: 2 }), Deferred.await(releaseTwo)))
      )
      const one = yield* Effect.forkScoped(Effect.scoped(Effect.zipRight(a.acquire(name, { limit: 3 }), Effect.never)))
      yield* until("3 permits held", Effect.map(heldPermits(store, name), (n) => n === 3))
      const granted: Array<string> = []
      const wait = (who: string, permits: number) =>
        Effect.forkScoped(
          Effect.scoped(
            Effect.zipRight(
              Effect.tap(b.acquire(name, { limit: 3, permits }), () => Effect.sync(() => granted.push(who))),
              Effect.never
            )
          )
        )
      const w1 = yield* wait("w1", 1)
      yield* waitingAre(store, name, [1])
      const w2 = yield* wait("w2", 1)
      yield* waitingAre(store, name, [1, 1])
      const w3 = yield* wait("w3", 3)
      yield* waitingAre(store, name, [1, 1, 3])
      yield* Deferred.succeed(releaseTwo, void 0)
      yield* Fiber.join(two)
      yield* until("w1 and w2 hold", Effect.sync(() => granted.length === 2))
      // Both were woken in one step (their fibers then resume in either order).
      expect([...granted].sort()).toEqual(["w1", "w2"])
      expect(yield* stateOf(store, name)).toMatchObject({ waiting: [3] })
      expect(yield* heldPermits(store, name)).toBe(3)
      // w3 needs every permit: it is served once the three single holders are gone.
      yield* Fiber.interrupt(one)
      yield* Fiber.interrupt(w1)
      expect(granted).toHaveLength(2)
      yield* Fiber.interrupt(w2)
      yield* until("w3 holds", Effect.sync(() => granted.length === 3))
      expect(yield* stateOf(store, name)).toMatchObject({ waiting: [], holders: [{ permits: 3 }] })
      yield* Fiber.interrupt(w3)
    }))

  it.scoped("waiters are served in order: a big request is not overtaken by smaller ones behind it", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const [a, b] = [yield* node(store), yield* node(store)]
      const name = "fifo"
      const holder = yield* Effect.forkScoped(
        Effect.scoped(Effect.zipRight(a.acquire(name, { limit: 3, permits: 2 }), Effect.never))
      )
      yield* until("held", Effect.map(heldPermits(store, name), (n) => n === 2))
      const big = yield* Effect.fork(Effect.scoped(b.acquire(name, { limit: 3, permits: 2 })))
      yield* waitingAre(store, name, [2])
      // One permit is free, but the request for it would overtake the waiter ahead: it waits.
      expect(yield* Effect.scoped(b.tryAcquire(name, { limit: 3 }))).toEqual(Option.none())
      const small = yield* Effect.fork(Effect.scoped(b.acquire(name, { limit: 3 })))
      yield* waitingAre(store, name, [2, 1])
      yield* Fiber.interrupt(holder)
      // Both fit once the holder is gone: served in order.
      expect((yield* Fiber.join(big)).permits).toBe(2)
      expect((yield* Fiber.join(small)).permits).toBe(1)
    }))

  it.scoped("loss of the permits interrupts the withPermits body with LockLost carrying the first token", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const service = yield* node(store)
      const started = yield* Deferred.make<ReadonlyArray<bigint>>()
      let finalized = false
      const body = Effect.gen(function*() {
        const permits = yield* Effect.scoped(DistributedSemaphore.acquire("other", { limit: 1 }))
        yield* Deferred.succeed(started, permits.tokens)
        yield* Effect.never
      }).pipe(Effect.ensuring(Effect.sync(() => (finalized = true))))
      const run = yield* Effect.fork(body.pipe(DistributedSemaphore.withPermits("lost", { limit: 4, permits: 2 }), provide(service)))
      yield* Deferred.await(started)
      const [held] = (yield* stateOf(store, "lost"))!.holders
      yield* MemoryBackend.revokePermits(store, "lost")
      const exit = yield* Fiber.await(run)
      expect(exit).toEqual(Exit.fail(expect.anything()))
      const error = yield* Effect.flip(exit)
      expect(error).toMatchObject({ _tag: "LockLost", name: "lost", reason: "revoked", token: held!.tokens[0] })
      expect(finalized).toBe(true)
    }))

  it.scoped("permits are renewed far past their ttl; when renewals fail the body is interrupted before the lease runs out", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      let failing = false
      const flaky = (backend: SemaphoreBackend<any>): SemaphoreBackend<any> => ({
        ...backend,
        renew: (grants) =>
          failing ? Effect.fail(new LockBackendError({ operation: "renew", cause: new Error("injected") })) : backend.renew(grants)
      })
      const [a, b] = [yield* node(store, flaky), yield* node(store)]
      const started = yield* Deferred.make<void>()
      const run = yield* Effect.fork(
        Effect.zipRight(Deferred.succeed(started, void 0), Effect.never).pipe(
          DistributedSemaphore.withPermits("renewed", { limit: 1, ttl: "3 seconds" }),
          provide(a)
        )
      )
      yield* Deferred.await(started)
      yield* TestClock.adjust(Duration.minutes(1))
      expect(yield* heldPermits(store, "renewed")).toBe(1)
      expect(yield* Effect.scoped(b.tryAcquire("renewed", { limit: 1 }))).toEqual(Option.none())
      failing = true
      // Given up at ttl − ttl/5 after the last good renewal (at most 1 s before this point).
      yield* TestClock.adjust(Duration.millis(2_400))
      expect(yield* Effect.flip(Fiber.join(run))).toMatchObject({ _tag: "LockLost", reason: "renewal-failed" })
    }))

  it.scoped("an interrupted wait leaves no permit behind, also when it is woken in the same step (every yield point)", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const [a, b] = [yield* node(store), yield* node(store)]
      const name = "interrupted"
      for (let at = 0; at < 80; at++) {
        const release = yield* Deferred.make<void>()
        const holder = yield* Effect.fork(Effect.scoped(Effect.zipRight(a.acquire(name, { limit: 2, permits: 2 }), Deferred.await(release))))
        yield* until("held", Effect.map(heldPermits(store, name), (n) => n === 2))
        const first = yield* Effect.fork(Effect.scoped(Effect.zipRight(b.acquire(name, { limit: 2, permits: 2 }), Effect.never)))
        yield* waitingAre(store, name, [2])
        const second = yield* Effect.fork(Effect.scoped(b.acquire(name, { limit: 2 })))
        yield* waitingAre(store, name, [2, 1])
        // The release wakes `first` and sets its permits aside; `first` is interrupted `at`
        // yields later — before, while or after it takes them.
        yield* Deferred.succeed(release, void 0)
        yield* yieldTimes(at)
        yield* Fiber.interrupt(first)
        // Whatever happened to `first`, its permits reach `second`, and nothing stays behind.
        yield* until(`the second waiter is served (interrupt after ${at} yields)`, Effect.map(Fiber.poll(second), Option.isSome))
        const got = yield* Fiber.join(second)
        expect(got.permits).toBe(1)
        yield* Fiber.join(holder)
        expect(yield* stateOf(store, name)).toBeUndefined()
      }
    }).pipe(withYieldBudget(TIGHT_YIELD_BUDGET)))

  it.scoped("interrupting acquire at any point of an uncontended or a queued request leaves nothing", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const service = yield* node(store)
      for (let at = 0; at < 40; at++) {
        const taker = yield* Effect.fork(Effect.scoped(Effect.zipRight(service.acquire(`free-${at}`, { limit: 2 }), Effect.never)))
        yield* yieldTimes(at)
        yield* Fiber.interrupt(taker)
        expect(yield* MemoryBackend.semaphores(store)).toEqual([])
      }
    }).pipe(withYieldBudget(TIGHT_YIELD_BUDGET)))

  it.effect("a timed-out wait gives its place up: a later request is served, the store is left empty", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const [a, b] = yield* Effect.all([node(store), node(store)])
      const holder = yield* Effect.fork(Effect.scoped(Effect.zipRight(a.acquire("t", { limit: 1 }), Effect.sleep("10 seconds"))))
      yield* until("held", Effect.map(heldPermits(store, "t"), (n) => n === 1))
      const timedOut = yield* Effect.fork(Effect.scoped(b.acquire("t", { limit: 1, timeout: "2 seconds" })))
      yield* waitingAre(store, "t", [1])
      yield* TestClock.adjust("2 seconds")
      expect(yield* Effect.flip(Fiber.join(timedOut))).toMatchObject({ _tag: "LockTimeout", name: "t" })
      expect(yield* stateOf(store, "t")).toMatchObject({ waiting: [] })
      yield* TestClock.adjust("8 seconds")
      yield* Fiber.join(holder)
      expect(yield* MemoryBackend.semaphores(store)).toEqual([])
    }).pipe(Effect.scoped))

  it.effect("MemoryBackend.layer provides both services; semaphore names do not exclude lock names", () =>
    Effect.gen(function*() {
      const lease = yield* DistributedLock.acquire("same-name")
      const permits = yield* DistributedSemaphore.acquire("same-name", { limit: 1 })
      // Both granted at once; their tokens come from the store's one counter.
      expect(lease.token).toBe(1n)
      expect(permits.tokens).toEqual([2n])
      const both = yield* DistributedSemaphore.tryWithPermits(Effect.succeed("ran"), "free", { limit: 2, permits: 2 })
      expect(both).toEqual(Option.some("ran"))
      const none = yield* DistributedSemaphore.tryWithPermits(Effect.succeed("ran"), "same-name", { limit: 1 })
      expect(none).toEqual(Option.none())
    }).pipe(Effect.scoped, Effect.provide(MemoryBackend.layer())))
})

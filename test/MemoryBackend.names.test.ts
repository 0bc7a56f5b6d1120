/**
 * Names come and go (DESIGN.md, "Names come and go"): on the memory backend a name nobody holds
 * or waits for keeps no state in the store, and fencing tokens come from one counter per store
 * (locks and semaphores alike), so a name freed and used again still gets larger tokens.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Cause from "effect/Cause"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import * as TestClock from "effect/TestClock"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as DistributedSemaphore from "effect-lock/DistributedSemaphore"
import * as MemoryBackend from "effect-lock/MemoryBackend"
import * as Internal from "../src/internal/memory/store.js"
import { onceRequest } from "./support/requests.js"

const TTL = Duration.seconds(3)

/** What the store keeps, read from its own state: names with an entry, and entries its alarms watch. */
const kept = (store: MemoryBackend.Store) => {
  const state = store[Internal.StoreTypeId]
  let watched = 0
  // Alarms are known to the store since idle names are freed; before, there was nothing to count.
  for (const alarm of (state as { alarms?: Set<{ watched: Set<unknown> }> }).alarms ?? []) watched += alarm.watched.size
  return { locks: state.entries.size, semaphores: state.permits.size, watched }
}

const hasName = (store: MemoryBackend.Store, name: string): boolean => {
  const state = store[Internal.StoreTypeId]
  return state.entries.has(name) || state.permits.has(name)
}

/** Until `name`'s entry has `count` waiters queued (a few yields: no time passes on the TestClock). */
const queued = (store: MemoryBackend.Store, name: string, count = 1) =>
  Effect.gen(function*() {
    for (let i = 0; i < 1_000; i++) {
      if ((store[Internal.StoreTypeId].entries.get(name)?.queue.length ?? 0) >= count) return
      yield* Effect.yieldNow()
    }
    throw new Error(`no waiter queued on "${name}"`)
  })

/** A lock and a semaphore service on `store`, and the raw backend under them. */
const services = (store: MemoryBackend.Store) =>
  Effect.gen(function*() {
    const backend = yield* MemoryBackend.makeBackend({ store, ttl: TTL })
    const lock = yield* DistributedLock.make(backend)
    const semaphore = yield* DistributedSemaphore.make(backend.semaphore)
    return { backend, lock, semaphore }
  })

/** A raw request of the backend SPI, granted once and never released: only its expiry ends it. */
const rawRequest = (name: string) => onceRequest(name, TTL)

describe("MemoryBackend: an idle name keeps nothing", () => {
  it.scoped("10,000 names locked once each every way leave no entry; tokens of a name increase across its entry being freed", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const { backend, lock, semaphore } = yield* services(store)
      const N = 10_000
      const KINDS = 7
      const expiring: Array<string> = []
      const expiredTokens: Array<bigint> = []
      const timingOut: Array<string> = []
      for (let i = 0; i < N; i++) {
        const name = `acct-${i}`
        switch (i % KINDS) {
          case 0: // exclusive, released
            yield* Effect.scoped(lock.acquire(name))
            break
          case 1: // shared, two holders, released
            yield* Effect.scoped(Effect.zip(lock.acquire(name, { mode: "shared" }), lock.acquire(name, { mode: "shared" })))
            break
          case 2: // semaphore permits
            yield* Effect.scoped(Effect.zip(
              semaphore.acquire(name, { limit: 3, permits: 2 }),
              semaphore.acquire(name, { limit: 3, permits: 1 })
            ))
            break
          case 3: { // a waiter interrupted, then the holder releases
            const scope = yield* Scope.make()
            yield* Scope.extend(lock.acquire(name), scope)
            const waiter = yield* Effect.fork(Effect.scoped(lock.acquire(name)))
            yield* queued(store, name)
            yield* Fiber.interrupt(waiter)
            yield* Scope.close(scope, Exit.void)
            break
          }
          case 4: // a waiter that times out, then the holder releases: below, in batches (one clock step each)
            timingOut.push(name)
            break
          case 5: // a lease nobody gives back, granted below: it expires on the TestClock
            expiring.push(name)
            break
          case 6: { // revoked while held
            const scope = yield* Scope.make()
            const lease = yield* Scope.extend(lock.acquire(name), scope)
            yield* MemoryBackend.revoke(store, name)
            expect(yield* lease.isHeld).toBe(false)
            yield* Scope.close(scope, Exit.void)
            break
          }
        }
        // Freed as soon as it is idle, not by a later sweep.
        expect(hasName(store, name), name).toBe(false)
      }
      for (let from = 0; from < timingOut.length; from += 250) {
        const batch = timingOut.slice(from, from + 250)
        const scope = yield* Scope.make()
        for (const name of batch) yield* Scope.extend(lock.acquire(name), scope)
        const waiters = yield* Effect.forEach(batch, (name) => Effect.fork(Effect.scoped(lock.acquire(name, { timeout: "100 millis" }))))
        for (const name of batch) yield* queued(store, name)
        yield* TestClock.adjust("100 millis")
        for (const waiter of waiters) {
          const exit = yield* Fiber.await(waiter)
          expect(Exit.isFailure(exit) ? Option.getOrUndefined(Cause.failureOption(exit.cause))?._tag : exit).toBe("LockTimeout")
        }
        // The waiters are gone: each name is held, with nobody queued.
        for (const name of batch) expect(store[Internal.StoreTypeId].entries.get(name)?.queue.length).toBe(0)
        yield* Scope.close(scope, Exit.void)
        for (const name of batch) expect(hasName(store, name), name).toBe(false)
      }
      expect(kept(store)).toEqual({ locks: 0, semaphores: 0, watched: 0 })
      for (const name of expiring) {
        const result = yield* backend.acquire(rawRequest(name))
        if (result._tag !== "Granted") throw new Error(`"${name}" not granted`)
        expiredTokens.push(result.grant.token)
      }
      // The leases nobody gave back are held until they run out, and listed meanwhile.
      expect((yield* MemoryBackend.holders(store)).length).toBe(expiring.length)
      expect(kept(store).locks).toBe(expiring.length)
      yield* TestClock.adjust(Duration.sum(TTL, Duration.millis(1)))
      expect(yield* MemoryBackend.holders(store)).toEqual([])
      expect(kept(store)).toEqual({ locks: 0, semaphores: 0, watched: 0 })

      // One name: granted, released (its entry freed), granted again: the token still increases.
      const name = "acct-0"
      const tokenOf = (n: string) => Effect.scoped(Effect.map(lock.acquire(n), (lease) => lease.token))
      const first = yield* tokenOf(name)
      expect(hasName(store, name)).toBe(false)
      const second = yield* Effect.scoped(Effect.map(lock.acquire(name), (lease) => lease.token))
      expect(hasName(store, name)).toBe(false)
      expect(second).toBeGreaterThan(first)
      // A name whose last lease expired unreleased (its entry freed by the sweep) gets a larger token than it had then.
      const third = yield* tokenOf(expiring[0]!)
      expect(third).toBeGreaterThan(expiredTokens[0]!)
      expect(third).toBeGreaterThan(second)
      expect(kept(store)).toEqual({ locks: 0, semaphores: 0, watched: 0 })
    }), { timeout: 120_000 })

  it.scoped("tokens come from one counter per store: interleaved names and a semaphore's permits", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      // Two layers of one store (two processes) draw from the same counter.
      const a = yield* services(store)
      const b = yield* services(store)
      const tokenOf = (service: typeof a, name: string) => Effect.scoped(Effect.map(service.lock.acquire(name), (lease) => lease.token))
      const x1 = yield* tokenOf(a, "x")
      const y1 = yield* tokenOf(b, "y")
      const x2 = yield* tokenOf(b, "x")
      const y2 = yield* tokenOf(a, "y")
      expect([x1, y1, x2, y2]).toEqual([1n, 2n, 3n, 4n])
      const permits = yield* Effect.scoped(Effect.map(a.semaphore.acquire("s", { limit: 5, permits: 3 }), (p) => p.tokens))
      expect(permits).toEqual([5n, 6n, 7n])
      // A lock named like the semaphore is another namespace, but the same counter.
      const s = yield* tokenOf(b, "s")
      expect(s).toBe(8n)
      const more = yield* Effect.scoped(Effect.map(b.semaphore.acquire("s", { limit: 2 }), (p) => p.tokens))
      expect(more).toEqual([9n])
      expect(kept(store)).toEqual({ locks: 0, semaphores: 0, watched: 0 })
    }))

  it.scoped("a lease left by a backend that closed is swept by another backend of the store (or the next one made)", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const grantOn = (scope: Scope.Scope, name: string) =>
        Effect.gen(function*() {
          const backend = yield* Scope.extend(MemoryBackend.makeBackend({ store, ttl: TTL }), scope)
          const result = yield* backend.acquire(rawRequest(name))
          expect(result._tag).toBe("Granted")
        })
      // Another backend open: it takes the closing one's leases over.
      const other = yield* Scope.make()
      yield* Scope.extend(MemoryBackend.makeBackend({ store, ttl: TTL }), other)
      const first = yield* Scope.make()
      yield* grantOn(first, "left-1")
      yield* Scope.close(first, Exit.void)
      yield* Scope.close(other, Exit.void)
      // No backend open: the next one made takes them.
      const second = yield* Scope.make()
      yield* grantOn(second, "left-2")
      yield* Scope.close(second, Exit.void)
      expect(kept(store).locks).toBe(2)
      yield* MemoryBackend.makeBackend({ store, ttl: TTL })
      yield* TestClock.adjust(Duration.sum(TTL, Duration.millis(1)))
      expect(kept(store)).toEqual({ locks: 0, semaphores: 0, watched: 0 })
    }))
})

/**
 * Testing your own lock-using code without a database or real waiting: provide the memory
 * backend and move time with TestClock. Two layers over one store act as two processes.
 */
import { describe, expect, it } from "@effect/vitest"
import { Effect, Fiber, Layer, Option, TestClock } from "effect"
import { DistributedLock, MemoryBackend } from "effect-lock"

// The code under test: refresh a cache at most once across replicas, skipping when busy.
const refreshCache = (refreshed: Array<string>, who: string) =>
  Effect.sync(() => refreshed.push(who)).pipe(
    Effect.zipRight(Effect.sleep("10 seconds")),
    Effect.as(who),
    DistributedLock.tryWithLock("cache-refresh")
  )

describe("refreshCache", () => {
  it.effect("runs on one replica while the other skips", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const replica = (who: string) => refreshCache(refreshed, who).pipe(Effect.provide(MemoryBackend.layer({ store })))
      const refreshed: Array<string> = []
      const a = yield* Effect.fork(replica("a"))
      yield* TestClock.adjust("1 second")
      const b = yield* replica("b")
      expect(Option.isNone(b)).toBe(true)
      yield* TestClock.adjust("10 seconds")
      expect(yield* Fiber.join(a)).toEqual(Option.some("a"))
      expect(refreshed).toEqual(["a"])
    }))

  it.effect("a lease that is taken away interrupts the work with LockLost", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const run = yield* Effect.fork(
        refreshCache([], "a").pipe(Effect.provide(MemoryBackend.layer({ store })))
      )
      yield* TestClock.adjust("1 second")
      yield* MemoryBackend.revoke(store, "cache-refresh")
      const error = yield* Effect.flip(Fiber.join(run))
      expect(error).toMatchObject({ _tag: "LockLost", reason: "revoked" })
    }))

  it.effect("leases are renewed while the work runs, far past their ttl", () =>
    Effect.gen(function*() {
      const lease = yield* DistributedLock.acquire("long-job", { ttl: "3 seconds" })
      yield* TestClock.adjust("1 minute")
      expect(yield* lease.isHeld).toBe(true)
    }).pipe(Effect.scoped, Effect.provide(Layer.fresh(MemoryBackend.layer()))))
})

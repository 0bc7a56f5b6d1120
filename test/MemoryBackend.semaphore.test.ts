/**
 * The semaphore contract on the memory backend, under TestClock: the reference the lease
 * backends' runs of the same suite are held to.
 */
import { beforeEach } from "@effect/vitest"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as TestClock from "effect/TestClock"
import * as MemoryBackend from "effect-lock/MemoryBackend"
import { semaphoreContractSuite } from "./support/semaphoreContract.js"

// A fresh store (one "cluster") per test: tokens come from one counter per store, and the suite
// expects a test's first grant to carry token 1.
let store = Effect.runSync(MemoryBackend.makeStore)
beforeEach(() => {
  store = Effect.runSync(MemoryBackend.makeStore)
})

semaphoreContractSuite("MemoryBackend", {
  clock: "test",
  ttl: Duration.seconds(3),
  makeBackend: Effect.suspend(() => Effect.map(MemoryBackend.makeBackend({ store }), (backend) => backend.semaphore)),
  state: (name) =>
    Effect.map(MemoryBackend.semaphores(store), (all) => {
      const semaphore = all.find((s) => s.name === name)
      return {
        held: (semaphore?.holders ?? []).reduce((sum, holder) => sum + holder.permits, 0),
        waiting: semaphore?.waiting ?? []
      }
    }),
  revoke: (name) => MemoryBackend.revokePermits(store, name),
  advance: (duration) => TestClock.adjust(duration),
  rounds: 25,
  // On the TestClock no time passes while a give-back is awaited.
  giveBackBound: Duration.zero
})

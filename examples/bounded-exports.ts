/**
 * At most two exports at a time across replicas: each replica takes a permit of the semaphore
 * "exports" (limit 2) around its export; a third waits until a permit is free. Three replicas
 * share one in-memory store here (in production: `DistributedSemaphore` from a database backend's
 * layer, one per process, once PgLease and PgAdvisory provide it).
 *
 *   npx tsx examples/bounded-exports.ts
 */
import { Effect } from "effect"
import { DistributedSemaphore, MemoryBackend } from "effect-lock"

let running = 0
let most = 0

const exportReport = (replica: string, report: number) =>
  Effect.gen(function*() {
    running++
    most = Math.max(most, running)
    yield* Effect.log(`${replica}: exporting report ${report} (${running} running)`)
    yield* Effect.sleep("50 millis")
    running--
  }).pipe(DistributedSemaphore.withPermits("exports", { limit: 2 }))

const replica = (name: string, store: MemoryBackend.Store) =>
  Effect.forEach([1, 2], (report) => exportReport(name, report), { concurrency: "unbounded" }).pipe(
    Effect.provide(MemoryBackend.layer({ store }))
  )

const program = Effect.gen(function*() {
  const store = yield* MemoryBackend.makeStore
  yield* Effect.all([replica("replica-a", store), replica("replica-b", store), replica("replica-c", store)], {
    concurrency: "unbounded"
  })
  yield* Effect.log(`6 exports done, at most ${most} at a time`)
})

Effect.runPromise(program)

/**
 * At most two exports at a time across replicas: each replica takes a permit of the semaphore
 * "exports" (limit 2) around its export; a third waits until a permit is free, and is woken by
 * the release's notification. Three replicas run in this one process here, each with its own
 * PgLease layer (in production: one per process); they share the semaphore table.
 *
 *   DATABASE_URL=postgres://… npx tsx examples/bounded-exports.ts
 */
import { PgClient } from "@effect/sql-pg"
import { Config, Effect, Layer } from "effect"
import { DistributedSemaphore, PgLease } from "effect-lock"

let running = 0
let most = 0

const exportReport = (replica: string, report: number) =>
  Effect.gen(function*() {
    running++
    most = Math.max(most, running)
    yield* Effect.log(`${replica}: exporting report ${report} (${running} running)`)
    yield* Effect.sleep("300 millis")
    running--
  }).pipe(DistributedSemaphore.withPermits("exports", { limit: 2 }))

// Each replica has its own layer; PgLease.layer provides DistributedSemaphore beside DistributedLock.
const replica = (name: string) =>
  Effect.forEach([1, 2], (report) => exportReport(name, report), { concurrency: "unbounded" }).pipe(
    Effect.provide(PgLease.layer({ ttl: "5 seconds" }))
  )

const program = Effect.gen(function*() {
  yield* Effect.all([replica("replica-a"), replica("replica-b"), replica("replica-c")], { concurrency: "unbounded" })
  yield* Effect.log(`6 exports done, at most ${most} at a time`)
})

program.pipe(
  Effect.provide(Layer.orDie(PgClient.layerConfig({ url: Config.redacted("DATABASE_URL") }))),
  Effect.runPromise
)

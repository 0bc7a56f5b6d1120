/**
 * A job that runs on one replica at a time, with leader takeover: each replica calls
 * `DistributedLock.singleton`; the one holding the lease runs the job, and when it goes away the
 * next one takes over within a lease's ttl. Two replicas run in this one process to show it.
 *
 *   DATABASE_URL=postgres://… npx tsx examples/cron-singleton.ts
 */
import { PgClient } from "@effect/sql-pg"
import { Config, Duration, Effect, Fiber, Layer, Schedule } from "effect"
import { DistributedLock, PgLease } from "effect-lock"

const nightlyReport = (replica: string) =>
  Effect.log(`${replica}: building the report`).pipe(Effect.repeat(Schedule.spaced("500 millis")))

// Each replica has its own lock layer (in production: its own process); they share the table.
const replica = (name: string) =>
  DistributedLock.singleton("example-nightly-report", nightlyReport(name)).pipe(
    Effect.provide(PgLease.layer({ ttl: "2 seconds" }))
  )

const program = Effect.gen(function*() {
  const first = yield* Effect.fork(replica("replica-a"))
  yield* Effect.sleep("300 millis")
  const second = yield* Effect.fork(replica("replica-b"))
  yield* Effect.sleep("1500 millis")
  yield* Effect.log("replica-a shuts down; replica-b takes over")
  yield* Fiber.interrupt(first)
  yield* Effect.sleep(Duration.seconds(2))
  yield* Fiber.interrupt(second)
})

program.pipe(
  Effect.provide(Layer.orDie(PgClient.layerConfig({ url: Config.redacted("DATABASE_URL") }))),
  Effect.runPromise
)

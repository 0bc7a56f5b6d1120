/**
 * A nightly report built once across replicas: every replica runs the same
 * `DistributedLock.schedule` line; at each occurrence one of them wins the lock and builds the
 * report, the others skip it. To watch it here, the schedule fires every second and three
 * replicas run in this one process for 5 s (in production: `Cron.unsafeParse("0 2 * * *")`, one
 * line per process).
 *
 *   DATABASE_URL=postgres://… npx tsx examples/nightly-report.ts
 */
import { PgClient } from "@effect/sql-pg"
import { Config, Cron, Effect, Layer } from "effect"
import { DistributedLock, PgLease } from "effect-lock"

const nightly = Cron.unsafeParse("* * * * * *")

const buildReport = (replica: string) => (occurrence: DistributedLock.Occurrence) =>
  Effect.log(
    `${replica}: building the report for ${new Date(occurrence.scheduledAt).toISOString()}` +
      ` (fencing token ${occurrence.lease.token})`
  ).pipe(Effect.zipRight(Effect.sleep("100 millis")))

// Each replica has its own lock layer (in production: its own process); they share the table.
// (Lock name distinct from cron-singleton.ts's: the examples run side by side on one database.)
const replica = (name: string) =>
  DistributedLock.schedule("example-scheduled-report", nightly, buildReport(name), {
    // A replica whose clock is up to 0.8 s behind finds the occurrence taken, and skips it.
    atLeastFor: "800 millis",
    // A build still running after 30 s is interrupted, and its lock given back.
    atMostFor: "30 seconds"
  }).pipe(Effect.provide(PgLease.layer()))

const program = Effect.gen(function*() {
  const replicas = Effect.all([replica("replica-a"), replica("replica-b"), replica("replica-c")], {
    concurrency: "unbounded"
  })
  // The schedules never return: stop them after 5 s.
  yield* Effect.raceFirst(replicas, Effect.sleep("5 seconds"))
  yield* Effect.log("replicas stopped")
})

program.pipe(
  Effect.provide(Layer.orDie(PgClient.layerConfig({ url: Config.redacted("DATABASE_URL") }))),
  Effect.runPromise
)

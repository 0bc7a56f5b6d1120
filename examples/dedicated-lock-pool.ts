/**
 * Layer composition in an application: the app's work pool and the lock backend side by side.
 * `PgAdvisory.layer` opens its own few lock sessions, so 200 lock holders that each need a work
 * connection can never starve the 4-connection work pool of the connection that would let them
 * finish (the classic pool-starvation deadlock of locking on the work pool).
 *
 *   DATABASE_URL=postgres://… npx tsx examples/dedicated-lock-pool.ts
 */
import { SqlClient } from "@effect/sql"
import { PgClient } from "@effect/sql-pg"
import { Config, Effect, Layer, Redacted } from "effect"
import { DistributedLock, PgAdvisory } from "effect-lock"

const WorkPool = PgClient.layerConfig({
  url: Config.redacted("DATABASE_URL"),
  maxConnections: Config.succeed(4),
  applicationName: Config.succeed("example-work-pool")
})

const LockSessions = Layer.unwrapEffect(
  Effect.map(Config.redacted("DATABASE_URL"), (url) =>
    PgAdvisory.layer({ url: Redacted.value(url), maxSessions: 2, applicationName: "example-locks" }))
)

const handle = (order: number) =>
  Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    yield* sql`select pg_sleep(0.001)`
    return order
  }).pipe(DistributedLock.withLock(`example-order-${order % 20}`))

const program = Effect.gen(function*() {
  const done = yield* Effect.forEach(Array.from({ length: 200 }, (_, i) => i), handle, { concurrency: "unbounded" })
  yield* Effect.log(`${done.length} locked bodies finished on a 4-connection work pool`)
})

program.pipe(Effect.provide(Layer.merge(WorkPool, LockSessions)), Effect.runPromise)

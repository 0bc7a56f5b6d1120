/**
 * Run database migrations once across replicas: every replica calls `migrate` at start-up; the
 * transaction advisory lock lets one apply them while the others wait, then find them applied.
 * Works behind transaction-mode PgBouncer too (the lock lives and dies with the transaction).
 *
 *   DATABASE_URL=postgres://… npx tsx examples/migration-lock.ts
 */
import { SqlClient } from "@effect/sql"
import { PgClient } from "@effect/sql-pg"
import { Config, Effect } from "effect"
import { PgAdvisory } from "effect-lock"

const migrate = (replica: number) =>
  Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    // One row per application, no unique key: were the lock to let two replicas in, both rows would show.
    yield* sql`create table if not exists example_migrations (id int not null, applied_by int not null)`
    const applied = yield* sql`select 1 from example_migrations where id = 1`
    if (applied.length > 0) return yield* Effect.log(`replica ${replica}: migrations already applied`)
    yield* sql`create table if not exists example_orders (id serial primary key, total numeric not null)`
    yield* sql`insert into example_migrations (id, applied_by) values (1, ${replica})`
    yield* Effect.log(`replica ${replica}: applied migration 1`)
  }).pipe(
    // Held until this transaction commits or rolls back; the migration's SQL runs inside it.
    PgAdvisory.withXactLock("example-migrations", { timeout: "30 seconds" })
  )

const program = Effect.gen(function*() {
  yield* Effect.all([1, 2, 3].map(migrate), { concurrency: "unbounded" })
  const sql = yield* SqlClient.SqlClient
  // Column names come back as written (this client has no name transforms).
  const rows = yield* sql<{ applied_by: number }>`select applied_by from example_migrations where id = 1`
  const by = rows.map((row) => `replica ${row.applied_by}`).join(", ")
  yield* Effect.log(`migration 1 was applied ${rows.length} time${rows.length === 1 ? "" : "s"}, by ${by}`)
})

program.pipe(
  Effect.provide(PgClient.layerConfig({ url: Config.redacted("DATABASE_URL") })),
  Effect.runPromise
)

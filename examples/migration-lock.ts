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
    yield* sql`create table if not exists example_migrations (id int primary key, applied_by int not null)`
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
  const rows = yield* sql<{ appliedBy: number }>`select applied_by from example_migrations`
  yield* Effect.log(`migration 1 was applied exactly ${rows.length} time(s), by replica ${rows[0]?.appliedBy}`)
})

program.pipe(
  Effect.provide(PgClient.layerConfig({ url: Config.redacted("DATABASE_URL") })),
  Effect.runPromise
)

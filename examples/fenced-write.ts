/**
 * Protecting a table from a stale holder: every write presents the lease's fencing token to
 * `Fence.check` in the same transaction. A holder that lost its lease (it paused, someone else
 * took over and wrote) has an older token, and its write is rejected with `StaleFencingToken`.
 *
 *   DATABASE_URL=postgres://… npx tsx examples/fenced-write.ts
 */
import { SqlClient } from "@effect/sql"
import { PgClient } from "@effect/sql-pg"
import { Config, Effect, Layer } from "effect"
import { DistributedLock, Fence, type FencingToken, PgLease } from "effect-lock"

const writeBalance = (token: FencingToken.FencingToken, balance: number) =>
  Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    yield* sql.withTransaction(Effect.gen(function*() {
      yield* Fence.check("example-accounts", token) // StaleFencingToken once a newer token wrote
      yield* sql`update example_accounts set balance = ${balance} where id = 1`
    }))
  })

const program = Effect.gen(function*() {
  const sql = yield* SqlClient.SqlClient
  yield* sql`create table if not exists example_accounts (id int primary key, balance int not null)`
  yield* sql`insert into example_accounts (id, balance) values (1, 0) on conflict (id) do nothing`
  // An old holder's token and a newer holder's token, as two successive grants give them.
  const old = yield* Effect.scoped(Effect.map(DistributedLock.acquire("example-account-1"), (l) => l.token))
  const current = yield* Effect.scoped(Effect.map(DistributedLock.acquire("example-account-1"), (l) => l.token))
  yield* writeBalance(current, 100)
  yield* Effect.log(`holder with token ${current} wrote balance 100`)
  const stale = yield* writeBalance(old, 5).pipe(Effect.flip)
  yield* Effect.log(`holder with token ${old} was refused: ${stale.message}`)
  const [row] = yield* sql<{ balance: number }>`select balance from example_accounts where id = 1`
  yield* Effect.log(`balance is ${row!.balance}`)
})

program.pipe(
  Effect.provide(PgLease.layer().pipe(Layer.provideMerge(PgClient.layerConfig({ url: Config.redacted("DATABASE_URL") })))),
  Effect.runPromise
)

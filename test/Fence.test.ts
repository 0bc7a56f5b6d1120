import { SqlClient } from "@effect/sql"
import { describe, expect, it, layer } from "@effect/vitest"
import { Array as Arr, Deferred, Duration, Effect, Either, Fiber, Random, Schedule, Tracer } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as Fence from "effect-lock/Fence"
import * as FencingToken from "effect-lock/FencingToken"
import { LockBackendError, StaleFencingToken } from "effect-lock/LockError"
import * as MemoryBackend from "effect-lock/MemoryBackend"
import { stop, thaw } from "./support/freeze.js"
import { PgTest, scopedClient, useTestDatabase } from "./support/pg.js"

// First, so that their afterAll (leak check, drop) runs after every pool of this file is closed.
const db = useTestDatabase("fence")
// Databases where no fence table exists yet, for the first-use races on the default table.
const freshForAutocommit = useTestDatabase("fence_first_use")
const freshForTransactions = useTestDatabase("fence_first_use_tx")

/** Enough connections for 20 concurrent transactions plus the test's own statements. */
const POOL = { maxConnections: 30 } as const

const token = (n: number | bigint) => FencingToken.make(BigInt(n))

/** The token the fence table holds for `resource`, or undefined when it has no row. */
const recorded = (resource: string, table = Fence.DEFAULT_TABLE) =>
  Effect.flatMap(SqlClient.SqlClient, (sql) =>
    Effect.map(
      sql.unsafe<{ token: string }>(`select token::text as token from ${table} where resource = $1`, [resource]),
      ([row]) => (row === undefined ? undefined : BigInt(row.token))
    ))

const tableExists = (table: string) =>
  Effect.flatMap(SqlClient.SqlClient, (sql) =>
    Effect.map(sql<{ rel: string | null }>`select to_regclass(${table})::text as rel`, ([row]) => row?.rel != null))

/** A random pause of up to `maxMs`, drawn from the current Random (seeded by `seeded`). */
const jitter = (maxMs: number) => Effect.flatMap(Random.nextIntBetween(0, maxMs + 1), (ms) => Effect.sleep(Duration.millis(ms)))

/**
 * Runs `effect` with a seeded Random: the seed is FENCE_SEED when set, else drawn and printed, and
 * named in the failure, so a failing interleaving can be asked for again (the draws repeat; the
 * fibers' scheduling around them is the machine's).
 */
const seeded = <A, E, R>(label: string, effect: Effect.Effect<A, E, R>): Effect.Effect<A, E, R> => {
  const fromEnv = process.env["FENCE_SEED"]
  const seed = fromEnv !== undefined && fromEnv !== "" ? Number(fromEnv) : Math.floor(Math.random() * 2 ** 31)
  console.log(`${label}: seed ${seed} (re-run with FENCE_SEED=${seed})`)
  return effect.pipe(
    Effect.withRandom(Random.make(seed)),
    Effect.tapErrorCause(() => Effect.sync(() => console.error(`${label} failed with seed ${seed}: FENCE_SEED=${seed}`)))
  )
}

/** How long a check may take to show up as blocked in pg_stat_activity before the test gives up. */
const BLOCKED_WITHIN = Duration.seconds(10)
const POLL = Duration.millis(20)

/**
 * Waits (bounded) until `count` fence checks of this database are blocked on a lock, and returns
 * them with the number of sessions blocking each: the server's own view of "waiting".
 */
const blockedChecks = (count: number) =>
  Effect.flatMap(SqlClient.SqlClient, (sql) =>
    sql<{ query: string; blockers: number }>`
      select query, cardinality(pg_blocking_pids(pid))::int as blockers from pg_stat_activity
      where datname = current_database() and wait_event_type = 'Lock' and query like 'insert into "effect_lock_fences"%'`
      .pipe(
        Effect.filterOrFail((rows) => rows.length >= count, () => "not blocked yet"),
        Effect.retry(Schedule.spaced(POLL)),
        Effect.timeoutFail({
          duration: BLOCKED_WITHIN,
          onTimeout: () => new Error(`${count} fence check(s) were not seen blocked within ${Duration.format(BLOCKED_WITHIN)}`)
        })
      ))

/** A table of guarded writes: each row is written in the transaction that passed `Fence.check`. */
const writesTable = (name: string) =>
  Effect.flatMap(SqlClient.SqlClient, (sql) =>
    sql.unsafe(
      `create table ${name} (id bigserial primary key, resource text not null, token bigint not null, body text not null)`
    ))

/** The fenced write pattern: check the token, then write, in one transaction. */
const fencedWrite = (table: string, resource: string, presented: FencingToken.FencingToken, body: string) =>
  Effect.flatMap(SqlClient.SqlClient, (sql) =>
    sql.withTransaction(
      Effect.zipRight(
        Fence.check(resource, presented),
        sql.unsafe(`insert into ${table} (resource, token, body) values ($1, $2, $3)`, [resource, presented.toString(), body])
      )
    ))

const writesOf = (table: string) =>
  Effect.flatMap(SqlClient.SqlClient, (sql) =>
    sql.unsafe<{ token: string; body: string }>(`select token::text as token, body from ${table} order by id`))

/** The SQL statements `effect` sends through @effect/sql (BEGIN/COMMIT are not statements of its own). */
const statementsOf = <A, E, R>(effect: Effect.Effect<A, E, R>) =>
  Effect.flatMap(Effect.tracer, (native) => {
    const texts: Array<string> = []
    const tracer = Tracer.make({
      context: (f, fiber) => native.context(f, fiber),
      span: (name, parent, context, links, startTime, kind, options) => {
        const span = native.span(name, parent, context, links, startTime, kind, options)
        if (name !== "sql.execute") return span
        return new Proxy(span, {
          get: (target, key) => {
            if (key === "attribute") {
              return (attribute: string, value: unknown) => {
                if (attribute === "db.query.text") texts.push(String(value).split("\n")[0]!)
                target.attribute(attribute, value)
              }
            }
            const value: unknown = Reflect.get(target, key, target)
            return typeof value === "function" ? value.bind(target) : value
          }
        })
      }
    })
    return Effect.map(Effect.withTracer(Effect.either(effect), tracer), (result) => ({ result, texts }))
  })

layer(PgTest.layer(db, POOL), { excludeTestServices: true })("Fence", (it) => {
  it.effect("accepts increasing and equal tokens and records the highest", () =>
    Effect.gen(function*() {
      yield* Fence.check("orders", token(1))
      yield* Fence.check("orders", token(2))
      yield* Fence.check("orders", token(2))
      yield* Fence.check("orders", token(7))
      expect(yield* recorded("orders")).toBe(7n)
      // Resources are fenced independently.
      yield* Fence.check("invoices", token(3))
      expect(yield* recorded("invoices")).toBe(3n)
      expect(yield* recorded("orders")).toBe(7n)
      // Tokens keep their full 64-bit precision.
      const big = 2n ** 62n + 1n
      yield* Fence.check("orders", token(big))
      expect(yield* recorded("orders")).toBe(big)
      const stale = yield* Effect.flip(Fence.check("orders", token(big - 1n)))
      expect(stale).toMatchObject({ presented: big - 1n, current: big })
    }))

  it.effect("rejects a lower token with StaleFencingToken carrying resource, presented and current", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      yield* Fence.check("ledger", token(5))
      const error = yield* Effect.flip(Fence.check("ledger", token(3)))
      expect(error).toBeInstanceOf(StaleFencingToken)
      expect(error).toMatchObject({ _tag: "StaleFencingToken", resource: "ledger", presented: 3n, current: 5n })
      expect(error.message).toBe(`stale fencing token for "ledger": presented 3, but 5 was already accepted`)
      // The same inside a transaction.
      const inTransaction = yield* Effect.flip(sql.withTransaction(Fence.check("ledger", token(4))))
      expect(inTransaction).toMatchObject({ _tag: "StaleFencingToken", resource: "ledger", presented: 4n, current: 5n })
      expect(yield* recorded("ledger")).toBe(5n)
    }))

  it.effect("a refused check inside a transaction lets the caller roll back its write; an accepted one rolls back with it", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      yield* writesTable("doc_writes")
      yield* Fence.check("doc", token(4))

      // Written first, then refused: the caller's transaction rolls the write back.
      const refused = yield* Effect.flip(
        sql.withTransaction(
          Effect.zipRight(
            sql`insert into doc_writes (resource, token, body) values ('doc', 3, 'stale')`,
            Fence.check("doc", token(3))
          )
        )
      )
      expect(refused).toMatchObject({ _tag: "StaleFencingToken", presented: 3n, current: 4n })
      expect(yield* writesOf("doc_writes")).toEqual([])

      // An accepted token is recorded only if the caller's transaction commits.
      const failed = yield* Effect.flip(sql.withTransaction(Effect.zipRight(Fence.check("doc", token(9)), Effect.fail("boom"))))
      expect(failed).toBe("boom")
      expect(yield* recorded("doc")).toBe(4n)

      // A refusal is a typed failure, not an SQL error: the transaction stays usable if the caller recovers.
      yield* sql.withTransaction(
        Fence.check("doc", token(2)).pipe(
          Effect.catchTag("StaleFencingToken", (stale) =>
            sql`insert into doc_writes (resource, token, body) values ('doc', ${stale.current.toString()}, 'noted')`)
        )
      )
      yield* fencedWrite("doc_writes", "doc", token(4), "fresh")
      expect(yield* writesOf("doc_writes")).toEqual([{ token: "4", body: "noted" }, { token: "4", body: "fresh" }])
    }))

  it.scoped("a paused holder that lost its lock cannot write after the new holder did (tokens from the memory backend)", () =>
    Effect.gen(function*() {
      yield* writesTable("report_writes")
      const store = yield* MemoryBackend.makeStore
      // Two "processes" of one cluster.
      const processA = yield* Effect.flatMap(MemoryBackend.makeBackend({ store }), DistributedLock.make)
      const processB = yield* Effect.flatMap(MemoryBackend.makeBackend({ store }), DistributedLock.make)

      const leaseA = yield* DistributedLock.acquire("report").pipe(
        Effect.provideService(DistributedLock.DistributedLock, processA)
      )
      // A pauses here (a GC pause, a partition) and does not look at its lease; meanwhile the
      // lock is taken from it and B takes over.
      yield* MemoryBackend.revoke(store, "report")
      const leaseB = yield* DistributedLock.acquire("report").pipe(
        Effect.provideService(DistributedLock.DistributedLock, processB)
      )
      expect(leaseB.token > leaseA.token).toBe(true)
      yield* fencedWrite("report_writes", "report", leaseB.token, "from B")

      // A wakes up and writes with its old token.
      const stale = yield* Effect.flip(fencedWrite("report_writes", "report", leaseA.token, "from A"))
      expect(stale).toBeInstanceOf(StaleFencingToken)
      expect(stale).toMatchObject({ resource: "report", presented: leaseA.token, current: leaseB.token })
      expect(yield* writesOf("report_writes")).toEqual([{ token: leaseB.token.toString(), body: "from B" }])
    }))

  it.scoped("a stale holder whose transaction is still open delays the new holder's check, never overwrites it", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      yield* writesTable("ticket_writes")
      const store = yield* MemoryBackend.makeStore
      const processA = yield* Effect.flatMap(MemoryBackend.makeBackend({ store }), DistributedLock.make)
      const processB = yield* Effect.flatMap(MemoryBackend.makeBackend({ store }), DistributedLock.make)
      const leaseA = yield* DistributedLock.acquire("ticket").pipe(
        Effect.provideService(DistributedLock.DistributedLock, processA)
      )

      // A passes its check, then pauses with its transaction open.
      const checked = yield* Deferred.make<void>()
      const resume = yield* Deferred.make<void>()
      const writerA = yield* Effect.fork(
        sql.withTransaction(
          Effect.gen(function*() {
            yield* Fence.check("ticket", leaseA.token)
            yield* Deferred.succeed(checked, undefined)
            yield* Deferred.await(resume)
            yield* sql`insert into ticket_writes (resource, token, body) values ('ticket', ${leaseA.token.toString()}, 'from A')`
          })
        )
      )
      yield* Deferred.await(checked)

      yield* MemoryBackend.revoke(store, "ticket")
      const leaseB = yield* DistributedLock.acquire("ticket").pipe(
        Effect.provideService(DistributedLock.DistributedLock, processB)
      )
      const writerB = yield* Effect.fork(fencedWrite("ticket_writes", "ticket", leaseB.token, "from B"))
      // B's check waits on the resource's row, locked by A's open transaction: seen in the server.
      const blocked = yield* blockedChecks(1)
      expect(blocked).toEqual([{ query: expect.stringMatching(/^insert into "effect_lock_fences"/), blockers: 1 }])
      expect(writerB.unsafePoll()).toBeNull()

      yield* Deferred.succeed(resume, undefined)
      yield* Fiber.join(writerA)
      yield* Fiber.join(writerB)
      // Commit order is token order: A's write (checked before the takeover) first, then B's.
      expect(yield* writesOf("ticket_writes")).toEqual([
        { token: leaseA.token.toString(), body: "from A" },
        { token: leaseB.token.toString(), body: "from B" }
      ])
      expect(yield* recorded("ticket")).toBe(leaseB.token)
      const late = yield* Effect.flip(fencedWrite("ticket_writes", "ticket", leaseA.token, "from A again"))
      expect(late).toMatchObject({ _tag: "StaleFencingToken", presented: leaseA.token, current: leaseB.token })
    }))

  it.scoped("a check in an uninterruptible part of a guarded body completes when the lease is lost meanwhile", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      yield* writesTable("sent_writes")
      yield* Fence.ensureTable
      const store = yield* MemoryBackend.makeStore
      const service = yield* Effect.flatMap(MemoryBackend.makeBackend({ store }), DistributedLock.make)
      // Another writer holds the resource's row, so the body's check waits at the server.
      const checked = yield* Deferred.make<void>()
      const resume = yield* Deferred.make<void>()
      const other = yield* Effect.fork(
        sql.withTransaction(
          Effect.zipRight(Fence.check("sent", token(1)), Effect.zipRight(Deferred.succeed(checked, undefined), Deferred.await(resume)))
        )
      )
      yield* Deferred.await(checked)
      const body = yield* Effect.fork(
        DistributedLock.withLock(
          // A write already on its way, made uninterruptible by the caller: it must land or fail on its own.
          Effect.uninterruptible(
            Effect.flatMap(DistributedLock.inspect, ([held]) => fencedWrite("sent_writes", "sent", held!.token, "on its way"))
          ),
          "sent-job"
        ).pipe(Effect.provideService(DistributedLock.DistributedLock, service))
      )
      yield* blockedChecks(1)
      // The lease goes while the check waits: the guard asks the body to stop, the write finishes first.
      yield* MemoryBackend.revoke(store, "sent-job")
      yield* Deferred.succeed(resume, undefined)
      yield* Fiber.join(other)
      const exit = yield* Fiber.await(body)
      expect(exit).toMatchObject({ _tag: "Failure" })
      expect(yield* writesOf("sent_writes")).toEqual([{ token: expect.any(String), body: "on its way" }])
    }))

  it.scoped("a check started in an uninterruptible part of a guarded body after the lease was lost still runs", () =>
    Effect.gen(function*() {
      yield* writesTable("late_writes")
      yield* Fence.ensureTable
      const store = yield* MemoryBackend.makeStore
      const service = yield* Effect.flatMap(MemoryBackend.makeBackend({ store }), DistributedLock.make)
      const entered = yield* Deferred.make<void>()
      const go = yield* Deferred.make<void>()
      const body = yield* Effect.fork(
        DistributedLock.withLock(
          // The write is on its way (uninterruptible) when the lease goes; its check starts only afterwards.
          Effect.uninterruptible(
            Effect.flatMap(DistributedLock.inspect, ([held]) =>
              Effect.zipRight(
                Effect.zipRight(Deferred.succeed(entered, undefined), Deferred.await(go)),
                fencedWrite("late_writes", "late", held!.token, "sent before the loss")
              ))
          ),
          "late-job"
        ).pipe(Effect.provideService(DistributedLock.DistributedLock, service))
      )
      yield* Deferred.await(entered)
      yield* MemoryBackend.revoke(store, "late-job")
      yield* Deferred.succeed(go, undefined)
      expect(yield* Fiber.await(body)).toMatchObject({ _tag: "Failure" })
      expect(yield* writesOf("late_writes")).toEqual([{ token: expect.any(String), body: "sent before the loss" }])
    }))

  it.effect("concurrent transactions commit only in token order: a lower token never commits after a higher one", () =>
    seeded("token-order race", Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      yield* sql`create table race_writes (id bigserial primary key, resource text not null, token bigint not null, seen_max bigint not null)`
      const WRITERS = 20
      for (let round = 0; round < 3; round++) {
        const resource = `race-${round}`
        const tokens = Arr.fromIterable(yield* Random.shuffle(Arr.range(1, WRITERS)))
        const outcomes = yield* Effect.forEach(
          tokens,
          (n) =>
            jitter(15).pipe(
              Effect.zipRight(
                sql.withTransaction(
                  Effect.gen(function*() {
                    yield* Fence.check(resource, token(n))
                    yield* jitter(5)
                    // seen_max: the highest token among the writes committed before this one was made
                    // (READ COMMITTED: the statement sees every transaction committed before it starts).
                    yield* sql`insert into race_writes (resource, token, seen_max)
                      select ${resource}, ${n}, coalesce(max(token), 0) from race_writes where resource = ${resource}`
                    yield* jitter(5)
                  })
                )
              ),
              Effect.either,
              Effect.map((result) => ({ n, result }))
            ),
          { concurrency: "unbounded" }
        )

        const accepted = outcomes.filter((o) => Either.isRight(o.result)).map((o) => o.n)
        const refused = outcomes.flatMap((o) => (Either.isLeft(o.result) ? [{ n: o.n, error: o.result.left }] : []))
        for (const { n, error } of refused) {
          expect(error).toBeInstanceOf(StaleFencingToken)
          const stale = error as StaleFencingToken
          expect(stale.presented).toBe(BigInt(n))
          expect(stale.current > stale.presented).toBe(true)
        }
        const rows = yield* sql<{ token: string; seen_max: string }>`
          select token::text as token, seen_max::text as seen_max from race_writes where resource = ${resource} order by id`
        // Exactly the accepted writes committed.
        expect(rows.map((r) => Number(r.token)).sort((a, b) => a - b)).toEqual([...accepted].sort((a, b) => a - b))
        // No write committed after a write with a higher token had committed.
        for (const row of rows) expect(BigInt(row.token) >= BigInt(row.seen_max)).toBe(true)
        // The highest token always wins, and the fence ends on the highest committed token.
        expect(accepted).toContain(WRITERS)
        expect(yield* recorded(resource)).toBe(BigInt(WRITERS))
      }
    })))

  it.effect("first use under contention: 8 fibers per fresh table, with and without transactions, for 10 tables", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      for (let round = 0; round < 10; round++) {
        const fence = yield* Fence.make({ table: `contended_fences_${round}` })
        const results = yield* Effect.all(
          Arr.makeBy(8, (i) => {
            const check = fence.check(`resource-${i}`, token(1))
            return Effect.either(i % 2 === 0 ? check : sql.withTransaction(check))
          }),
          { concurrency: "unbounded" }
        )
        expect(results.filter(Either.isLeft)).toEqual([])
        const [{ n }] = yield* sql.unsafe<{ n: number }>(`select count(*)::int as n from contended_fences_${round}`)
        expect(n).toBe(8)
      }
    }))

  it.effect("an accepted check is one statement, in a transaction or not; a refusal reads the current token once more", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      yield* Fence.check("counted", token(1))
      const outside = yield* statementsOf(Fence.check("counted", token(2)))
      expect(outside.texts).toEqual([expect.stringMatching(/^insert into "effect_lock_fences"/)])
      const inside = yield* statementsOf(sql.withTransaction(Fence.check("counted", token(3))))
      expect(inside.texts).toEqual([expect.stringMatching(/^insert into "effect_lock_fences"/)])
      const refused = yield* statementsOf(sql.withTransaction(Fence.check("counted", token(1))))
      expect(Either.isLeft(refused.result)).toBe(true)
      expect(refused.texts).toEqual([
        expect.stringMatching(/^insert into "effect_lock_fences"/),
        expect.stringMatching(/^select token::text as token from "effect_lock_fences"/)
      ])

      // A table this process has not seen yet: the first check in a transaction pays for a
      // savepoint and for learning who created it; the next ones are one statement again.
      yield* sql`create table preexisting_fences (resource text primary key, token bigint not null, updated_at timestamptz not null default now())`
      const fence = yield* Fence.make({ table: "preexisting_fences" })
      const first = yield* statementsOf(sql.withTransaction(fence.check("counted", token(1))))
      expect(first.texts).toEqual([
        "savepoint effect_lock_fence",
        expect.stringMatching(/^insert into "preexisting_fences"/),
        "release savepoint effect_lock_fence",
        "select txid_current()::text as xact"
      ])
      const next = yield* statementsOf(sql.withTransaction(fence.check("counted", token(2))))
      expect(next.texts).toEqual([expect.stringMatching(/^insert into "preexisting_fences"/)])
    }))

  it.effect("a table created in a transaction that rolls back is created again by the next check", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      const fence = yield* Fence.make({ table: "rolled_back_fences" })
      // Two checks in the transaction that creates the table, then it rolls back.
      const failed = yield* Effect.flip(
        sql.withTransaction(
          Effect.gen(function*() {
            yield* fence.check("a", token(1))
            yield* fence.check("b", token(1))
            return yield* Effect.fail("rolled back")
          })
        )
      )
      expect(failed).toBe("rolled back")
      expect(yield* tableExists("rolled_back_fences")).toBe(false)
      // The next transaction does not trust a table it never saw committed.
      yield* sql.withTransaction(fence.check("a", token(2)))
      expect(yield* tableExists("rolled_back_fences")).toBe(true)
      yield* sql.withTransaction(fence.check("a", token(3)))
      expect(yield* recorded("a", "rolled_back_fences")).toBe(3n)
    }))

  it.effect("a dropped table: the check in a transaction fails with LockBackendError, the next check recreates it", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      const fence = yield* Fence.make({ table: "dropped_fences" })
      yield* fence.check("x", token(1))
      yield* sql`drop table dropped_fences`
      const error = yield* Effect.flip(sql.withTransaction(fence.check("x", token(2))))
      expect(error).toBeInstanceOf(LockBackendError)
      expect(error).toMatchObject({ operation: "fence-check", name: "x" })
      yield* sql.withTransaction(fence.check("x", token(2)))
      expect(yield* recorded("x", "dropped_fences")).toBe(2n)
      // Outside a transaction a missing table is recreated on the spot.
      yield* sql`drop table dropped_fences`
      yield* fence.check("x", token(1))
      expect(yield* recorded("x", "dropped_fences")).toBe(1n)
    }))

  it.effect("custom tables: validated identifiers, schema-qualified and case-preserving names, a layer", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      for (const bad of ["", "fences; drop table x", "a.b.c", "1fences", `"quoted"`, "x".repeat(64)]) {
        const error = yield* Effect.flip(Fence.make({ table: bad }))
        expect(error).toBeInstanceOf(LockBackendError)
        expect(error.operation).toBe("configure")
      }
      yield* sql`create schema fencing`
      const qualified = yield* Fence.make({ table: "fencing.AppFences" })
      yield* sql.withTransaction(qualified.check("r", token(2)))
      expect(yield* recorded("r", `fencing."AppFences"`)).toBe(2n)

      const viaLayer = yield* Effect.provide(
        Effect.flatMap(Fence.Fence, (fence) => Effect.as(fence.check("r", token(5)), fence.table)),
        Fence.layer({ table: "layer_fences" })
      )
      expect(viaLayer).toBe("layer_fences")
      expect(yield* recorded("r", "layer_fences")).toBe(5n)

      // ensureTable: idempotent, also when called concurrently, in transactions or not.
      const ensured = yield* Fence.make({ table: "ensured_fences", createTable: false })
      yield* Effect.all(
        Arr.makeBy(6, (i) => (i % 2 === 0 ? ensured.ensureTable : sql.withTransaction(ensured.ensureTable))),
        { concurrency: "unbounded" }
      )
      yield* ensured.check("r", token(1))
      yield* Fence.ensureTable
      expect(yield* tableExists(Fence.DEFAULT_TABLE)).toBe(true)
    }))

  it.effect("createTable: false never creates it: a missing table is a LockBackendError until the migration runs", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      const fence = yield* Fence.make({ table: "migrated_fences", createTable: false })
      const outside = yield* Effect.flip(fence.check("m", token(1)))
      expect(outside).toBeInstanceOf(LockBackendError)
      expect(outside).toMatchObject({ operation: "fence-check", name: "m" })
      // The driver's error is kept as the cause, never the failure itself.
      expect(outside.cause).toMatchObject({ _tag: "SqlError", cause: { code: "42P01" } })
      const inside = yield* Effect.flip(sql.withTransaction(fence.check("m", token(1))))
      expect(inside).toBeInstanceOf(LockBackendError)
      expect(yield* tableExists("migrated_fences")).toBe(false)

      expect(fence.migration).toBe(
        `create table if not exists "migrated_fences" (\n  resource text primary key,\n  token bigint not null,\n` +
          `  updated_at timestamptz not null default now()\n);\n`
      )
      expect(Fence.migration).toBe(fence.migration.replace("migrated_fences", Fence.DEFAULT_TABLE))
      yield* sql.unsafe(fence.migration)
      yield* sql.unsafe(fence.migration) // idempotent
      yield* sql.withTransaction(fence.check("m", token(1)))
      expect(yield* recorded("m", "migrated_fences")).toBe(1n)
    }))
})

describe("Fence on a database without its table", () => {
  it.live("8 fibers checking at once outside transactions create the default table; no catalog race escapes", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      expect(yield* tableExists(Fence.DEFAULT_TABLE)).toBe(false)
      const results = yield* Effect.all(
        Arr.makeBy(8, (i) => Effect.either(Fence.check(`first-${i}`, token(i)))),
        { concurrency: "unbounded" }
      )
      expect(results.filter(Either.isLeft)).toEqual([])
      const rows = yield* sql<{ resource: string; token: string }>`
        select resource, token::text as token from effect_lock_fences order by resource`
      expect(rows).toEqual(Arr.makeBy(8, (i) => ({ resource: `first-${i}`, token: `${i}` })))
      // Created with its documented columns.
      const columns = yield* sql<{ column_name: string; data_type: string; is_nullable: string }>`
        select column_name, data_type, is_nullable from information_schema.columns
        where table_name = 'effect_lock_fences' order by ordinal_position`
      expect(columns).toEqual([
        { column_name: "resource", data_type: "text", is_nullable: "NO" },
        { column_name: "token", data_type: "bigint", is_nullable: "NO" },
        { column_name: "updated_at", data_type: "timestamp with time zone", is_nullable: "NO" }
      ])
    }).pipe(Effect.provide(PgTest.layer(freshForAutocommit, POOL))))

  it.live("8 transactions checking at once create the default table in their own transactions", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      expect(yield* tableExists(Fence.DEFAULT_TABLE)).toBe(false)
      const results = yield* Effect.all(
        Arr.makeBy(8, (i) =>
          Effect.either(
            sql.withTransaction(Effect.zipRight(Fence.check(`first-${i}`, token(1)), sql`select 1`))
          )),
        { concurrency: "unbounded" }
      )
      expect(results.filter(Either.isLeft)).toEqual([])
      const [{ n }] = yield* sql<{ n: number }>`select count(*)::int as n from effect_lock_fences`
      expect(n).toBe(8)
      // A later transaction takes the one-statement path and still sees the table.
      yield* sql.withTransaction(Fence.check("first-0", token(2)))
      expect(yield* recorded("first-0")).toBe(2n)
    }).pipe(Effect.provide(PgTest.layer(freshForTransactions, POOL))))
})

/** The bound these tests give a check; the promise is the bound plus two event-loop turns. */
const BOUND_MS = 500
/** What a loaded 2-core machine may add to the bound (scheduling, the timer's own lateness). */
const SLACK_MS = 1_500

const timed = <A, E, R>(effect: Effect.Effect<A, E, R>) =>
  Effect.gen(function*() {
    const started = Date.now()
    const result = yield* Effect.either(effect)
    return { result, elapsed: Date.now() - started }
  })

layer(PgTest.layer(db, POOL), { excludeTestServices: true })("Fence bounds", (it) => {
  it.effect("a check blocked behind another writer's open transaction fails at statementTimeout, and its statement is cancelled", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      const fence = yield* Fence.make({ statementTimeout: Duration.millis(BOUND_MS) })
      yield* fence.check("held-row", token(1))
      const checked = yield* Deferred.make<void>()
      const resume = yield* Deferred.make<void>()
      const holder = yield* Effect.fork(
        sql.withTransaction(
          Effect.zipRight(fence.check("held-row", token(2)), Effect.zipRight(Deferred.succeed(checked, undefined), Deferred.await(resume)))
        )
      )
      yield* Deferred.await(checked)
      const { elapsed, result } = yield* timed(fence.check("held-row", token(3)))
      expect(Either.isLeft(result) && result.left).toMatchObject({ _tag: "LockBackendError", operation: "fence-check", name: "held-row" })
      expect(elapsed).toBeGreaterThanOrEqual(BOUND_MS - 20)
      expect(elapsed).toBeLessThan(BOUND_MS + SLACK_MS)
      // The abandoned statement does not stay queued on the row at the server.
      yield* Effect.flatMap(
        sql<{ n: number }>`select count(*)::int as n from pg_stat_activity
          where datname = current_database() and wait_event_type = 'Lock' and query like 'insert into "effect_lock_fences"%'`,
        ([row]) => (row!.n === 0 ? Effect.void : Effect.fail("still waiting"))
      ).pipe(Effect.retry(Schedule.spaced(POLL)), Effect.timeout(BLOCKED_WITHIN))
      yield* Deferred.succeed(resume, undefined)
      yield* Fiber.join(holder)
      expect(yield* recorded("held-row")).toBe(2n)
    }))

  it.effect("first use waiting for another transaction's table creation fails at statementTimeout", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      const fence = yield* Fence.make({ table: "fences_created_slowly", statementTimeout: Duration.millis(BOUND_MS) })
      const created = yield* Deferred.make<void>()
      const resume = yield* Deferred.make<void>()
      // A first check in a transaction creates the table there and keeps the creation lock until it ends.
      const creator = yield* Effect.fork(
        sql.withTransaction(
          Effect.zipRight(fence.check("slow", token(1)), Effect.zipRight(Deferred.succeed(created, undefined), Deferred.await(resume)))
        )
      )
      yield* Deferred.await(created)
      const { elapsed, result } = yield* timed(fence.check("slow", token(2)))
      expect(Either.isLeft(result) && result.left).toMatchObject({ _tag: "LockBackendError", operation: "fence-check" })
      expect(elapsed).toBeLessThan(BOUND_MS + SLACK_MS)
      yield* Deferred.succeed(resume, undefined)
      yield* Fiber.join(creator)
      yield* fence.check("slow", token(2))
      expect(yield* recorded("slow", "fences_created_slowly")).toBe(2n)
    }))

  it.effect("a frozen server backend (SIGSTOP) fails a check within statementTimeout, on first use and after", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      for (const table of ["fences_on_frozen", Fence.DEFAULT_TABLE]) {
        const fence = yield* Fence.make({ table, statementTimeout: Duration.millis(BOUND_MS) })
        let checked: { readonly result: Either.Either<void, unknown>; readonly elapsed: number } | undefined
        // The caller's transaction may end either way after the thaw (its statement was cancelled); the check's own outcome is what counts.
        yield* Effect.either(sql.withTransaction(Effect.gen(function*() {
          const [{ pid }] = yield* sql<{ pid: number }>`select pg_backend_pid() as pid`
          stop(pid)
          checked = yield* timed(fence.check("frozen", token(1)))
          thaw(pid)
        })))
        expect(checked).toBeDefined()
        expect(Either.isLeft(checked!.result) && checked!.result.left).toMatchObject({ _tag: "LockBackendError", operation: "fence-check" })
        expect(checked!.elapsed).toBeLessThan(BOUND_MS + SLACK_MS)
      }
    }))

  it.effect("a check abandoned at its bound in a transaction leaves no cancel behind for the transaction's next statement", () =>
    Effect.gen(function*() {
      const sql = yield* SqlClient.SqlClient
      const fence = yield* Fence.make({ statementTimeout: Duration.millis(BOUND_MS) })
      yield* fence.check("late-cancel", token(1))
      const key = 7_023_001
      // Outside the pool: it holds the lock the transaction's next statement waits for, and watches that wait.
      const admin = yield* scopedClient(db.url)
      yield* Effect.promise(() => admin.query("select pg_advisory_lock($1)", [key]))
      // The pool's other connection is kept busy, so a cancel sent through the pool (pg_cancel_backend) waits for it.
      const occupied = yield* Deferred.make<void>()
      const free = yield* Deferred.make<void>()
      const blocker = yield* Effect.fork(Effect.zipRight(
        sql.withTransaction(Effect.zipRight(sql`select 1`, Effect.zipRight(Deferred.succeed(occupied, undefined), Deferred.await(free)))),
        // Queued behind whatever waited for this connection: when it answers, a queued cancel has run.
        sql`select 1`
      ))
      yield* Deferred.await(occupied)
      yield* sql.withTransaction(Effect.gen(function*() {
        const [{ pid }] = yield* sql<{ pid: number }>`select pg_backend_pid() as pid`
        yield* sql`savepoint before_check`
        stop(pid)
        const checked = yield* Effect.either(fence.check("late-cancel", token(2)))
        thaw(pid)
        expect(Either.isLeft(checked) && checked.left).toMatchObject({ _tag: "LockBackendError", operation: "fence-check" })
        // The abandoned statement ends after the thaw (cancelled or not); the savepoint keeps the transaction usable.
        yield* sql`rollback to savepoint before_check`
        const next = yield* Effect.fork(sql`select pg_advisory_xact_lock(${key})`)
        yield* Effect.promise(() =>
          admin.query("select count(*)::int as n from pg_locks where pid = $1 and locktype = 'advisory' and not granted", [pid])
        ).pipe(
          Effect.flatMap((result) => (result.rows[0].n === 1 ? Effect.void : Effect.fail("not waiting yet"))),
          Effect.retry(Schedule.spaced(POLL)),
          Effect.timeout(BLOCKED_WITHIN)
        )
        // Now a cancel still queued in the pool would run, while the next statement is on the server.
        yield* Deferred.succeed(free, undefined)
        yield* Fiber.join(blocker)
        yield* Effect.promise(() => admin.query("select pg_advisory_unlock($1)", [key]))
        const outcome = yield* Effect.either(Fiber.join(next))
        // A late cancel would have failed it with 57014 (query_canceled).
        expect(Either.isRight(outcome) ? "answered" : `${(outcome.left.cause as { code?: string })?.code}: ${outcome.left.cause}`).toBe("answered")
      }))
    }).pipe(Effect.scoped, Effect.provide(PgTest.layer(db, { maxConnections: 2 }))))

  it.effect("statementTimeout must be a positive, finite duration", () =>
    Effect.gen(function*() {
      for (const bad of [0, -1, Duration.infinity, "soon"] as const) {
        const error = yield* Effect.flip(Fence.make({ statementTimeout: bad as Duration.DurationInput }))
        expect(error).toMatchObject({ _tag: "LockBackendError", operation: "configure" })
      }
    }))
})

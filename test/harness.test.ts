import { SqlClient } from "@effect/sql"
import { describe, expect, it, layer } from "@effect/vitest"
import { Effect } from "effect"
import pg from "pg"
import {
  adminUrl,
  advisoryLocks,
  assertNoLeaks,
  countSessions,
  PgTest,
  terminateBackends,
  useTestDatabase
} from "./support/pg.js"
import { describeWithPgBouncer, startPgBouncer } from "./support/pgbouncer.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("harness")

/** A raw session owned by the scope: 'error' listener before connect, closed on release. */
const rawClient = (url: string, applicationName = "harness-raw") =>
  Effect.acquireRelease(
    Effect.promise(async () => {
      const client = new pg.Client({ connectionString: url, application_name: applicationName })
      client.on("error", () => {})
      await client.connect()
      return client
    }),
    (client) => Effect.promise(() => client.end().catch(() => {}))
  )

const query = <R extends pg.QueryResultRow>(client: pg.Client, text: string, values?: ReadonlyArray<unknown>) =>
  Effect.promise(() => client.query<R>(text, values === undefined ? undefined : [...values]))

const backendPid = (client: pg.Client) =>
  query<{ pid: number }>(client, "select pg_backend_pid() as pid").pipe(Effect.map((r) => r.rows[0]!.pid))

describe("test harness", () => {
  it("exposes the admin URL to tests and to child processes", () => {
    expect(adminUrl()).toMatch(/^postgres(ql)?:\/\//)
    expect(process.env["EFFECT_LOCK_TEST_ADMIN_URL"]).toBe(adminUrl())
    expect(db.name).toMatch(/^el_harness_[0-9a-f]{10}$/)
  })

  layer(PgTest.layer(db), { excludeTestServices: true })("through @effect/sql-pg", (it) => {
    it.effect("creates a table, inserts and reads back", () =>
      Effect.gen(function*() {
        const sql = yield* SqlClient.SqlClient
        yield* sql`create table harness_items (id int primary key, label text not null)`
        yield* sql`insert into harness_items ${sql.insert([{ id: 1, label: "one" }, { id: 2, label: "two" }])}`
        const rows = yield* sql<{ id: number; label: string }>`select id, label from harness_items order by id`
        expect(rows).toEqual([{ id: 1, label: "one" }, { id: 2, label: "two" }])
        const [{ db: current }] = yield* sql<{ db: string }>`select current_database() as db`
        expect(current).toBe(db.name)
      }))
  })

  it.scopedLive("assertNoLeaks detects a leaked advisory lock and passes once it is released", () =>
    Effect.gen(function*() {
      const client = yield* rawClient(db.url, "harness-leaker")
      yield* query(client, "select pg_advisory_lock(42)")

      const locks = yield* Effect.promise(() => advisoryLocks(db.url))
      expect(locks).toEqual([expect.objectContaining({ application_name: "harness-leaker", objid: 42, granted: true })])

      const leaked = yield* Effect.promise(() => assertNoLeaks(db.url, { settleMs: 0 }).then(() => undefined, (e: Error) => e))
      expect(leaked?.message).toMatch(/advisory lock pid=\d+ application_name="harness-leaker" classid=0 objid=42 .*granted=true mode=ExclusiveLock/)

      yield* query(client, "select pg_advisory_unlock(42)")
      yield* Effect.promise(() => assertNoLeaks(db.url, { settleMs: 0 }))
    }))

  it.scopedLive("assertNoLeaks detects a held lease row and tolerates a missing lease table", () =>
    Effect.gen(function*() {
      const client = yield* rawClient(db.url)
      yield* query(
        client,
        `create table harness_leases (name text primary key, owner text null, token bigint, expires_at timestamptz null)`
      )
      yield* query(client, `insert into harness_leases values ('job', 'worker-1', 7, now() + interval '1 minute')`)
      const held = yield* Effect.promise(() => assertNoLeaks(db.url, { settleMs: 0 }).then(() => undefined, (e: Error) => e))
      expect(held?.message).toContain(`held lease harness_leases: {"name":"job","owner":"worker-1","token":7`)

      // Explicit table list: a table that does not exist is ignored, an expired lease is not held.
      yield* query(client, `update harness_leases set expires_at = now() - interval '1 second'`)
      yield* Effect.promise(() => assertNoLeaks(db.url, { settleMs: 0, leaseTables: ["no_such_table", "harness_leases"] }))
      yield* query(client, `update harness_leases set owner = null, expires_at = null`)
      yield* Effect.promise(() => assertNoLeaks(db.url, { settleMs: 0 }))
    }))

  it.live("countSessions and terminateBackends see sessions by application_name", () =>
    Effect.gen(function*() {
      const victim = yield* rawClient(db.url, "harness-victim")
      expect(yield* Effect.promise(() => countSessions(db.url, "harness-victim"))).toBe(1)
      expect(yield* Effect.promise(() => terminateBackends(db.url, "harness-victim"))).toBe(1)
      const failure = yield* Effect.promise(() => victim.query("select 1").then(() => undefined, (e: Error) => e))
      expect(failure).toBeInstanceOf(Error)
      expect(yield* Effect.promise(() => countSessions(db.url, "harness-victim"))).toBe(0)
    }).pipe(Effect.scoped))
})

/** Backend pid of `a` before and after a second client holds a transaction open in between. */
const affinityProbe = (url: string) =>
  Effect.gen(function*() {
    const a = yield* rawClient(url, "harness-probe-a")
    const b = yield* rawClient(url, "harness-probe-b")
    const before = yield* backendPid(a)
    yield* query(b, "begin")
    const other = yield* backendPid(b)
    const after = yield* backendPid(a)
    yield* query(b, "commit")
    return { before, other, after }
  }).pipe(Effect.scoped)

const withPgBouncer = (poolMode: "session" | "transaction") =>
  Effect.acquireRelease(
    Effect.promise(() => startPgBouncer({ targetUrl: db.url, poolMode })),
    (bouncer) => Effect.promise(() => bouncer.stop())
  )

describeWithPgBouncer("test harness with PgBouncer", () => {
  it.scopedLive("session mode passes queries through and keeps a client on one backend", () =>
    Effect.gen(function*() {
      const bouncer = yield* withPgBouncer("session")
      const client = yield* rawClient(bouncer.url)
      const { rows } = yield* query<{ db: string; answer: number }>(client, "select current_database() as db, 41 + 1 as answer")
      expect(rows).toEqual([{ db: db.name, answer: 42 }])

      const probe = yield* affinityProbe(bouncer.url)
      expect(probe.after).toBe(probe.before)
      expect(probe.other).not.toBe(probe.before)
    }))

  it.scopedLive("transaction mode moves a client to another backend while a second client holds a transaction", () =>
    Effect.gen(function*() {
      const bouncer = yield* withPgBouncer("transaction")
      const probe = yield* affinityProbe(bouncer.url)
      // PgBouncer hands out its most recently used server connection: b's transaction takes a's.
      expect(probe.other).toBe(probe.before)
      expect(probe.after).not.toBe(probe.before)
    }))
})

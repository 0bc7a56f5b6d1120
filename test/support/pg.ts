/**
 * Helpers for test files that use the real PostgreSQL started by `globalSetup.ts`.
 *
 * Every test file works in its own fresh database (`useTestDatabase`), so files running in
 * parallel never see each other's locks or rows, and `assertNoLeaks` can prove per file that no
 * advisory lock, no held lease row and no live semaphore holder or place outlived the file's tests.
 */
import type { SqlClient, SqlError } from "@effect/sql"
import { PgClient } from "@effect/sql-pg"
import { Effect, Layer, Redacted, type Scope } from "effect"
import * as Crypto from "node:crypto"
import pg from "pg"
import { afterAll, beforeAll, inject } from "vitest"
import { withTimeout } from "../../tools/embeddedPostgres.js"

/** application_name of the harness's own raw sessions, so tests can tell them apart from the library's. */
export const HARNESS_APPLICATION_NAME = "effect-lock-test-harness"

/** How long `assertNoLeaks` waits for backends of just-closed sessions to exit and drop their locks. */
const DEFAULT_SETTLE_MS = 2_000
const POLL_MS = 50
const MAX_IDENTIFIER_LENGTH = 63

/** Superuser URL of the test server (its `postgres` database), provided by the global setup. */
export const adminUrl = (): string => {
  const url = inject("pgAdminUrl")
  if (typeof url !== "string" || url === "") {
    throw new Error("pgAdminUrl was not provided: is test/support/globalSetup.ts listed in vitest.config.ts globalSetup?")
  }
  return url
}

/**
 * The harness's kept sessions, per URL. A new session costs this test server about 17 ms of its
 * own CPU (a backend's start-up, mostly page faults on this VM) and the client its SCRAM exchange;
 * the suite's probes and polls opened about a thousand of them per run. Idle ones close after
 * `HARNESS_IDLE_MS`, and those a server restart or a terminate kills leave the pool on their error.
 */
const harnessPools = new Map<string, pg.Pool>()
const HARNESS_IDLE_MS = 1_000
/** Bound on getting a session (connecting, or waiting for a free one) for a probe. */
const HARNESS_CONNECT_MS = 15_000
/** How long the reset of a session handed back may take before the session is closed instead. */
const HARNESS_RESET_MS = 2_000
/** How long closing a URL's kept sessions may wait for those still checked out. */
const HARNESS_CLOSE_MS = 2_000

/** Never a bound on the harness's concurrency (a session may wait on a lock while others poll). */
const harnessPool = (url: string): pg.Pool => {
  let pool = harnessPools.get(url)
  if (pool === undefined) {
    pool = new pg.Pool({
      connectionString: url,
      application_name: HARNESS_APPLICATION_NAME,
      max: 64,
      idleTimeoutMillis: HARNESS_IDLE_MS,
      allowExitOnIdle: true,
      // A probe never waits unbounded for a session: a connect (or a free slot) past this fails it.
      connectionTimeoutMillis: HARNESS_CONNECT_MS
    })
    // An idle session killed (restart, terminate, drop database) is dropped by the pool; no crash.
    pool.on("error", () => {})
    // A session killed while checked out errors on the client; the caller sees its query fail.
    pool.on("connect", (client) => client.on("error", () => {}))
    harnessPools.set(url, pool)
  }
  return pool
}

/** Closes the kept sessions of `url` (before its database is dropped). */
const closeHarnessPool = async (url: string): Promise<void> => {
  const pool = harnessPools.get(url)
  harnessPools.delete(url)
  // Bounded: end() waits for sessions still checked out (a test that failed while one waited on a
  // lock); the forced drop that follows terminates them.
  await withTimeout(pool?.end() ?? Promise.resolve(), HARNESS_CLOSE_MS, "closing the harness's sessions").catch(() => {})
}

/** A raw session of its own for the enclosing scope (a test's second party), ended with it. */
export const scopedClient = (url: string): Effect.Effect<pg.Client, never, Scope.Scope> =>
  Effect.acquireRelease(
    Effect.promise(async () => {
      const client = new pg.Client({ connectionString: url })
      await client.connect()
      return client
    }),
    (client) => Effect.promise(() => client.end())
  )

/**
 * Runs `f` on a raw session (named as the harness), as a fresh one: a kept session is handed back
 * only after `f` succeeded and `DISCARD ALL` reset it (advisory locks, LISTEN, settings, prepared
 * statements); a session left in a transaction, mid-query or in error is closed, as before.
 */
export const withClient = async <A>(url: string, f: (client: pg.Client) => Promise<A>): Promise<A> => {
  const client = await harnessPool(url).connect()
  let reusable = false
  try {
    const result = await f(client as unknown as pg.Client)
    reusable = await withTimeout(client.query("discard all"), HARNESS_RESET_MS, "resetting a harness session").then(() => true, () => false)
    return result
  } finally {
    // release(true) closes the session instead of keeping it.
    client.release(!reusable)
  }
}

/** How many statements of the connections named `application` wait for a lock (a row's, a transaction's) right now. */
export const lockWaitsOf = (url: string, application: string): Effect.Effect<number> =>
  Effect.promise(() =>
    withClient(url, (client) =>
      client.query<{ n: number }>(
        "select count(*)::int as n from pg_stat_activity where application_name = $1 and wait_event_type = 'Lock'",
        [application]
      ).then((result) => result.rows[0]!.n))
  )

const databaseUrl = (base: string, database: string): string => {
  const url = new URL(base)
  url.pathname = `/${encodeURIComponent(database)}`
  return url.toString()
}

const databaseNameFor = (label: string): string => {
  const random = Crypto.randomBytes(5).toString("hex")
  const sanitized = label.toLowerCase().replace(/[^a-z0-9_]+/g, "_").replace(/^_+|_+$/g, "") || "db"
  const room = MAX_IDENTIFIER_LENGTH - "el__".length - random.length
  return `el_${sanitized.slice(0, room)}_${random}`
}

/** A database created for one test file. */
export interface TestDatabase {
  readonly url: string
  readonly name: string
  /** Drops the database, terminating any session still connected to it. */
  readonly drop: () => Promise<void>
}

/** Creates a fresh database `el_<label>_<random>` on the test server. */
export const createTestDatabase = async (label: string): Promise<TestDatabase> => {
  const admin = adminUrl()
  const name = databaseNameFor(label)
  await withClient(admin, (client) => client.query(`create database ${client.escapeIdentifier(name)}`))
  return {
    name,
    url: databaseUrl(admin, name),
    drop: async () => {
      await closeHarnessPool(databaseUrl(admin, name))
      await withClient(admin, async (client) => {
        await client.query(`drop database if exists ${client.escapeIdentifier(name)} with (force)`)
      })
    }
  }
}

/** One advisory lock row of `pg_locks` in the checked database, with who holds or waits for it. */
export interface AdvisoryLockRow {
  readonly pid: number
  readonly application_name: string | null
  readonly classid: number
  readonly objid: number
  readonly objsubid: number
  readonly granted: boolean
  readonly mode: string
  readonly state: string | null
  readonly query: string | null
}

const advisoryLocksQuery = `
  select l.pid, a.application_name, l.classid, l.objid, l.objsubid, l.granted, l.mode, a.state, a.query
  from pg_locks l
  left join pg_stat_activity a on a.pid = l.pid
  where l.locktype = 'advisory'
    and l.database = (select oid from pg_database where datname = current_database())
  order by l.pid, l.classid, l.objid`

const queryAdvisoryLocks = async (client: pg.Client): Promise<ReadonlyArray<AdvisoryLockRow>> =>
  (await client.query<AdvisoryLockRow>(advisoryLocksQuery)).rows

/** Advisory locks (granted or awaited) in the database at `url`, from `pg_locks`. */
export const advisoryLocks = (url: string): Promise<ReadonlyArray<AdvisoryLockRow>> =>
  withClient(url, queryAdvisoryLocks)

/** Sessions connected to the database at `url` with this application_name. */
export const countSessions = (url: string, applicationName: string): Promise<number> =>
  withClient(url, async (client) => {
    const result = await client.query<{ n: number }>(
      `select count(*)::int as n from pg_stat_activity
       where datname = current_database() and application_name = $1 and pid <> pg_backend_pid()`,
      [applicationName]
    )
    return result.rows[0]?.n ?? 0
  })

/**
 * Terminates every session of the database at `url` with this application_name; returns how many.
 * On PostgreSQL 14 and later it returns once they have exited (up to 5 s each): the one-argument
 * form only signals, and a backend can stay in pg_stat_activity for a moment after (a fresh-clone
 * run counted the terminated session right after its client had seen the connection end).
 */
export const terminateBackends = (url: string, applicationName: string): Promise<number> =>
  withClient(url, async (client) => {
    const version = await client.query<{ v: number }>(`select current_setting('server_version_num')::int as v`)
    const terminate = (version.rows[0]?.v ?? 0) >= 140000 ? "pg_terminate_backend(pid, 5000)" : "pg_terminate_backend(pid)"
    const result = await client.query<{ n: number }>(
      `select count(*) filter (where ${terminate})::int as n from pg_stat_activity
       where datname = current_database() and application_name = $1 and pid <> pg_backend_pid()`,
      [applicationName]
    )
    return result.rows[0]?.n ?? 0
  })

/** Tables in user schemas that look like lease tables (`owner` and `expires_at` columns). */
const discoverLeaseTables = async (client: pg.Client): Promise<ReadonlyArray<string>> => {
  const result = await client.query<{ table: string }>(
    `select c.oid::regclass::text as table
     from pg_class c
     join pg_namespace n on n.oid = c.relnamespace
     where c.relkind in ('r', 'p')
       and n.nspname not in ('pg_catalog', 'information_schema') and n.nspname not like 'pg_toast%'
       and exists (select 1 from pg_attribute a where a.attrelid = c.oid and a.attname = 'owner' and not a.attisdropped)
       and exists (select 1 from pg_attribute a where a.attrelid = c.oid and a.attname = 'expires_at' and not a.attisdropped)`
  )
  return result.rows.map((row) => row.table)
}

const heldLeases = async (client: pg.Client, tables: ReadonlyArray<string>): Promise<ReadonlyArray<string>> => {
  const held: Array<string> = []
  for (const table of tables) {
    // to_regclass tolerates a table the tests never created; its text form is safely quoted.
    const found = await client.query<{ rel: string | null }>("select to_regclass($1)::text as rel", [table])
    const rel = found.rows[0]?.rel
    if (rel === null || rel === undefined) continue
    const rows = await client.query<{ row: unknown }>(
      `select to_jsonb(t) as row from ${rel} t where t.owner is not null and t.expires_at > now()`
    )
    for (const { row } of rows.rows) held.push(`${rel}: ${JSON.stringify(row)}`)
  }
  return held
}

/** Tables in user schemas that look like semaphore tables (`holders` and `waiters` jsonb columns: PgLease's `<table>_sem`). */
const discoverSemaphoreTables = async (client: pg.Client): Promise<ReadonlyArray<string>> => {
  const result = await client.query<{ table: string }>(
    `select c.oid::regclass::text as table
     from pg_class c
     join pg_namespace n on n.oid = c.relnamespace
     where c.relkind in ('r', 'p')
       and n.nspname not in ('pg_catalog', 'information_schema') and n.nspname not like 'pg_toast%'
       and exists (select 1 from pg_attribute a where a.attrelid = c.oid and a.attname = 'holders'
         and a.atttypid = 'jsonb'::regtype and not a.attisdropped)
       and exists (select 1 from pg_attribute a where a.attrelid = c.oid and a.attname = 'waiters'
         and a.atttypid = 'jsonb'::regtype and not a.attisdropped)`
  )
  return result.rows.map((row) => row.table)
}

/** Live holder entries (permits held) and live waiting places of semaphore rows, by the server's clock. */
const heldPermits = async (client: pg.Client, tables: ReadonlyArray<string>): Promise<ReadonlyArray<string>> => {
  const held: Array<string> = []
  for (const table of tables) {
    const found = await client.query<{ rel: string | null }>("select to_regclass($1)::text as rel", [table])
    const rel = found.rows[0]?.rel
    if (rel === null || rel === undefined) continue
    const rows = await client.query<{ name: string; kind: string; entry: unknown }>(
      `select s.name, x.kind, x.entry from ${rel} s, lateral (
         select 'holder' as kind, h as entry from jsonb_array_elements(s.holders) h
         union all select 'waiter', w from jsonb_array_elements(s.waiters) w
       ) x
       where (x.entry->>'expires')::numeric > extract(epoch from now()) * 1000`
    )
    for (const row of rows.rows) held.push(`${rel}: semaphore ${JSON.stringify(row.name)} ${row.kind} ${JSON.stringify(row.entry)}`)
  }
  return held
}

/** Options of `assertNoLeaks`. */
export interface AssertNoLeaksOptions {
  /** Lease tables to check; tables that do not exist are ignored. Default: every table with `owner` and `expires_at` columns. */
  readonly leaseTables?: ReadonlyArray<string>
  /** Semaphore tables to check (live holders and places); default: every table with `holders` and `waiters` jsonb columns. */
  readonly semaphoreTables?: ReadonlyArray<string>
  /** How long to keep re-checking before failing, for backends that are still exiting. Default 2000 ms. */
  readonly settleMs?: number
}

/**
 * Throws if the database at `url` still has an advisory lock (granted or awaited), a held lease
 * row (owner set, not yet expired), or a semaphore's live holder or waiting place. Backends of
 * sessions closed a moment ago may still be exiting, so it re-checks for `settleMs` before failing.
 */
export const assertNoLeaks = (url: string, options?: AssertNoLeaksOptions): Promise<void> =>
  withClient(url, async (client) => {
    const deadline = Date.now() + (options?.settleMs ?? DEFAULT_SETTLE_MS)
    for (;;) {
      const locks = await queryAdvisoryLocks(client)
      const tables = options?.leaseTables ?? (await discoverLeaseTables(client))
      const leases = await heldLeases(client, tables)
      const permits = await heldPermits(client, options?.semaphoreTables ?? (await discoverSemaphoreTables(client)))
      if (locks.length === 0 && leases.length === 0 && permits.length === 0) return
      if (Date.now() >= deadline) {
        const database = (await client.query<{ db: string }>("select current_database() as db")).rows[0]?.db
        const lines = [
          `leak check failed in database ${database}:`,
          ...locks.map(
            (l) =>
              `  advisory lock pid=${l.pid} application_name=${JSON.stringify(l.application_name)} ` +
              `classid=${l.classid} objid=${l.objid} objsubid=${l.objsubid} granted=${l.granted} mode=${l.mode} ` +
              `state=${l.state} query=${JSON.stringify(l.query)}`
          ),
          ...leases.map((lease) => `  held lease ${lease}`),
          ...permits.map((entry) => `  live semaphore entry ${entry}`)
        ]
        throw new Error(lines.join("\n"))
      }
      await new Promise((resolve) => setTimeout(resolve, POLL_MS))
    }
  })

/** Handle returned by `useTestDatabase`; its getters are valid inside tests and hooks that run after its `beforeAll`. */
export interface UsedTestDatabase {
  readonly url: string
  readonly name: string
}

/**
 * Gives the calling test file its own database: created in `beforeAll`, leak-checked and dropped
 * in `afterAll` (a leak fails the file). Call it at the top of the file, before any `layer(...)`,
 * so the file's pools are closed (afterAll hooks run in reverse order) before the leak check.
 */
export const useTestDatabase = (label: string, options?: AssertNoLeaksOptions): UsedTestDatabase => {
  let database: TestDatabase | undefined
  const current = (): TestDatabase => {
    if (database === undefined) {
      throw new Error(
        `test database "${label}" read before its beforeAll ran: pass the handle itself ` +
          "(PgTest.layer(db)) rather than db.url where the value is needed at collection time"
      )
    }
    return database
  }
  beforeAll(async () => {
    database = await createTestDatabase(label)
  })
  afterAll(async () => {
    if (database === undefined) return
    try {
      await assertNoLeaks(database.url, options)
    } finally {
      await database.drop()
    }
  })
  return {
    get url() {
      return current().url
    },
    get name() {
      return current().name
    }
  }
}

/**
 * Makes `db`'s default isolation `level` for every session opened afterwards (ALTER DATABASE …
 * SET default_transaction_isolation), in a beforeAll that runs after the database's own: the
 * library's statements must hold on a database stricter than READ COMMITTED.
 */
export const defaultIsolation = (db: UsedTestDatabase, level: "repeatable read" | "serializable"): void => {
  beforeAll(async () => {
    await withClient(adminUrl(), (client) =>
      client.query(`alter database ${client.escapeIdentifier(db.name)} set default_transaction_isolation = '${level}'`))
  })
}

/** A URL, or something that yields one once the database exists (a `useTestDatabase` handle or a thunk). */
export type UrlSource = string | { readonly url: string } | (() => string)

const resolveUrl = (source: UrlSource): string =>
  typeof source === "string" ? source : typeof source === "function" ? source() : source.url

/** Effect layers against the test server. */
export const PgTest = {
  /**
   * `PgClient`/`SqlClient` from @effect/sql-pg on the given database. The URL is read when the
   * layer is built, so a `useTestDatabase` handle can be passed to `layer(...)` at collection time.
   * Use with `layer(PgTest.layer(db), { excludeTestServices: true })` or `it.live`: against a real
   * server, sleeps and retries must not run on the TestClock.
   */
  layer: (
    url: UrlSource,
    config?: Omit<PgClient.PgClientConfig, "url">
  ): Layer.Layer<PgClient.PgClient | SqlClient.SqlClient, SqlError.SqlError> =>
    Layer.unwrapEffect(
      Effect.sync(() => PgClient.layer({ ...config, url: Redacted.make(resolveUrl(url)) }))
    )
}

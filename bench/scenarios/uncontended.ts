/**
 * Scenario 1 — uncontended cycles/s: acquire + release of names no other worker uses, by 1 and
 * by 16 concurrent workers, for every backend next to the floor it is measured against: raw pg
 * sending the same statements on the same number of connections, and Effect.makeSemaphore for
 * the memory backend.
 *
 * Each worker keeps its own name for the whole run (names are distinct between workers, reused
 * across cycles): the steady state of an application with a fixed set of lock names, where the
 * fencing counter and lease rows already exist and every grant is an UPDATE.
 */
import { PgClient } from "@effect/sql-pg"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Redacted from "effect/Redacted"
import type pg from "pg"
import * as Crypto from "node:crypto"
import * as Os from "node:os"
import * as DistributedLock from "../../src/DistributedLock.js"
import { advisoryKey } from "../../src/internal/core/lockKey.js"
import * as AdvisorySql from "../../src/internal/advisory/sql.js"
import { fencingTokensSql } from "../../src/internal/advisory/bootstrap.js"
import * as LeaseSql from "../../src/internal/lease/pg/sql.js"
import { DEFAULT_CONNECTIONS as DEFAULT_LOCK_CONNECTIONS } from "../../src/internal/lease/pg/make.js"
import * as MemoryBackend from "../../src/MemoryBackend.js"
import * as PgAdvisory from "../../src/PgAdvisory.js"
import * as PgLease from "../../src/PgLease.js"
import type { Context, Scenario } from "../lib/context.js"
import { effectLoop, promiseLoop, type ThroughputSample } from "../lib/loops.js"
import { createDatabase, type Database } from "../lib/postgres.js"
import { closeAll, connectMany, serialized } from "../lib/rawPg.js"
import * as Report from "../lib/report.js"
import type { Target } from "../lib/report.js"
import { isolated } from "../lib/isolated.js"
import { lengthOf, type Subject } from "../lib/rounds.js"
import { openRuntime } from "../lib/runtime.js"
import { measureThroughput, ratioOf, renderThroughput, type ThroughputRow, type ThroughputSpec } from "../lib/throughput.js"

export const CONCURRENCIES = [1, 16] as const

const range = (n: number): Array<number> => Array.from({ length: n }, (_, i) => i)

// ---------------------------------------------------------------- the statements mirrored

/**
 * What PgAdvisory sends per uncontended cycle — its own SQL text, imported from
 * src/internal/advisory/sql.ts so the mirror cannot drift: `tryBatchSql`, the try-lock fused
 * with the fencing-counter upsert (its batch statement, which carries every try queued on a
 * session, here with one key as a single caller sends it), then `releaseSql`, the unlock that
 * notifies only when a notification-only waiter registered interest (here nobody does). Extended
 * protocol with parameters.
 */
export const RAW_FENCING_TABLE = "bench_raw_fencing"
const RAW_FENCING = { text: RAW_FENCING_TABLE, sql: `"${RAW_FENCING_TABLE}"`, relname: RAW_FENCING_TABLE }
/** The raw fencing table, and the token sequence its upserts draw from (as PgAdvisory's). */
export const fencingDdl = `CREATE TABLE IF NOT EXISTS "${RAW_FENCING_TABLE}" (key bigint PRIMARY KEY, name text NOT NULL, token bigint NOT NULL);\n` +
  fencingTokensSql(RAW_FENCING)
const tryGrantSql = AdvisorySql.tryBatchSql(RAW_FENCING)
const releaseSql = AdvisorySql.releaseSql("exclusive")
const interestKeyOf = (key: string) => advisoryKey(key, AdvisorySql.INTEREST_NAMESPACE).toString()

/**
 * What withXactLock sends per uncontended cycle (src/internal/advisory/xact.ts,
 * `lockInTransaction`) with an empty body: the try succeeds, so no setting is touched.
 */
const xactStatements = (key: string): ReadonlyArray<readonly [string, ReadonlyArray<unknown>]> => [
  ["BEGIN", []],
  ["select pg_try_advisory_xact_lock($1::bigint) as granted", [key]],
  ["COMMIT", []]
]

/** The lease table of the raw baseline; same DDL as the library's, its own name. */
const RAW_LEASE_TABLE = LeaseSql.parseTable("bench_raw_leases") as LeaseSql.TableRef

// ---------------------------------------------------------------- subjects

const workerNames = (prefix: string, concurrency: number) => range(concurrency).map((w) => `${prefix}-c${concurrency}-w${w}`)

type Query = ReturnType<typeof serialized>

const rawSubject = (
  id: string,
  database: Database,
  sessions: number,
  concurrency: number,
  durationMs: number,
  setup: (client: pg.Client) => Promise<unknown>,
  cycle: (query: Query, worker: number) => Promise<void>,
  prepared = false
): Subject<ThroughputSample> => ({
  id,
  open: async () => {
    const clients = await connectMany(database.url, sessions, `bench-${id}`)
    await setup(clients[0]!)
    const queries = clients.map(prepared ? serializedPrepared : serialized)
    return {
      run: (round) => promiseLoop(concurrency, lengthOf(round, durationMs), (worker) => cycle(queries[worker % queries.length]!, worker)),
      close: () => closeAll(clients)
    }
  }
})

const preparedNames = new Map<string, string>()

/**
 * `serialized` with named (prepared) statements, as PgAdvisory sends its parameterised
 * statements: parsed and planned once per session, then only bound.
 */
const serializedPrepared = (client: pg.Client): Query => {
  let tail: Promise<unknown> = Promise.resolve()
  return <R extends pg.QueryResultRow>(text: string, values?: ReadonlyArray<unknown>): Promise<pg.QueryResult<R>> => {
    let name = preparedNames.get(text)
    if (name === undefined) preparedNames.set(text, name = `bench_prepared_${preparedNames.size + 1}`)
    const config = values === undefined ? text : { name, text, values: [...values] }
    const next = tail.then(() => client.query<R>(config))
    tail = next.catch(() => {})
    return next
  }
}

const expectRows = (result: pg.QueryResult, rows: number, what: string): void => {
  if (result.rows.length !== rows) throw new Error(`${what}: expected ${rows} rows, got ${result.rows.length}`)
}

/** Raw pg: plain `pg_advisory_lock` + `pg_advisory_unlock`, no fencing write. */
export const rawAdvisoryLock = (database: Database, concurrency: number, durationMs: number): Subject<ThroughputSample> => {
  const keys = workerNames("raw-lock", concurrency).map((name) => advisoryKey(name).toString())
  return rawSubject(`raw-advisory-lock-${concurrency}`, database, concurrency, concurrency, durationMs, async () => {}, async (query, w) => {
    await query("select pg_advisory_lock($1)", [keys[w]])
    await query("select pg_advisory_unlock($1)", [keys[w]])
  })
}

/**
 * PgAdvisory's two statements for worker `w` of `names` (try-lock + fencing upsert; unlock +
 * notify if anyone waits), as PgAdvisory sends them: what the raw floor and the Effect floor send.
 */
const advisoryStatements = (names: ReadonlyArray<string>) => {
  const keys = names.map((name) => advisoryKey(name).toString())
  const interestKeys = keys.map(interestKeyOf)
  return {
    acquire: async (query: Query, w: number) =>
      // One row for the granted key, one carrying the backend pid (PgAdvisory checks it).
      expectRows(await query(tryGrantSql, [[keys[w]], [names[w]], [false]]), 2, "try-lock + fencing upsert"),
    release: (query: Query, w: number) => query(releaseSql, [keys[w], interestKeys[w], AdvisorySql.CHANNEL])
  }
}

/** Raw pg: exactly PgAdvisory's two statements (try-lock + fencing upsert; unlock + notify if anyone waits). */
export const rawAdvisoryFenced = (
  database: Database,
  concurrency: number,
  sessions: number,
  durationMs: number
): Subject<ThroughputSample> => {
  const statements = advisoryStatements(workerNames(`raw-fenced-s${sessions}`, concurrency))
  return rawSubject(
    `raw-advisory-fenced-${concurrency}-${sessions}`,
    database,
    sessions,
    concurrency,
    durationMs,
    (client) => client.query(fencingDdl),
    async (query, w) => {
      await statements.acquire(query, w)
      await statements.release(query, w)
    },
    true
  )
}

/**
 * The least an Effect program that takes and gives back a fenced advisory lock can do:
 * `rawAdvisoryFenced`'s two prepared statements (a session per worker) as
 * `Effect.scoped(Effect.acquireRelease(...))`, on the same fibers' loop as the library's rows.
 * What it costs against `rawAdvisoryFenced` is Effect's, whichever lock library runs in it.
 */
export const effectAdvisoryFloor = (database: Database, concurrency: number, durationMs: number): Subject<ThroughputSample> => {
  const statements = advisoryStatements(workerNames("effect-fenced", concurrency))
  return effectFloor("effect-advisory-floor", database, concurrency, durationMs, fencingDdl, statements.acquire, (query, w) => statements.release(query, w))
}

/** Sends a statement with parameters and answers its rows (node-postgres's `query`, however it is queued or prepared). */
export type LeaseQuery = <R extends pg.QueryResultRow>(text: string, values: ReadonlyArray<unknown>) => Promise<pg.QueryResult<R>>

/**
 * PgLease's acquire and owner-scoped release (+ notify) on `table`, with the parameters PgLease
 * sends: what the raw floor, the Effect floor and `bench/gaps.ts` all send. A holder's release
 * goes as PgLease sends it alone: `releaseBatch` with one member, then `release` where that
 * decided nothing (never here: nobody waits for a worker's own name).
 */
export const leaseStatements = (table: LeaseSql.TableRef, application: string) => {
  const acquire = LeaseSql.acquire(table)
  const release = LeaseSql.release(table)
  const releaseAlone = LeaseSql.releaseBatch(table)
  const host = Os.hostname()
  return {
    createTable: LeaseSql.createTable(table),
    /** One granted acquire of `name`; its owner, for the release. */
    acquire: async (query: LeaseQuery, name: string): Promise<string> => {
      const owner = Crypto.randomUUID()
      // A waiting place id (`waiter`), the mode, the ttl, the place's ttl, who holds, and true to
      // take a place when not granted (a waiting acquire).
      const granted = await query<{ token: string | null }>(acquire, [
        name, owner, Crypto.randomUUID(), "exclusive", 30_000, 5_000, application, host, process.pid, true
      ])
      if (granted.rows[0]?.token == null) throw new Error(`${application}: lease ${name} was not granted`)
      return owner
    },
    release: async (query: LeaseQuery, name: string, owner: string) => {
      const alone = await query(releaseAlone, [[name], [owner], table.relname])
      return alone.rows.length > 0 ? alone : query(release, [name, owner, null, table.relname])
    }
  }
}

/** Raw pg: PgLease's acquire upsert and owner-scoped release (+ notify), same parameters, prepared. */
export const rawLease = (database: Database, concurrency: number, durationMs: number): Subject<ThroughputSample> => {
  const names = workerNames("raw-lease", concurrency)
  const statements = leaseStatements(RAW_LEASE_TABLE, "bench-raw-lease")
  return rawSubject(
    `raw-lease-${concurrency}`,
    database,
    concurrency,
    concurrency,
    durationMs,
    (client) => client.query(statements.createTable),
    async (query, w) => {
      const owner = await statements.acquire(query, names[w]!)
      await statements.release(query, names[w]!, owner)
    },
    // Prepared, as PgLease's own connections send them.
    true
  )
}

/**
 * The least an Effect program that takes and gives back a lease can do: `rawLease`'s two prepared
 * statements as `Effect.scoped(Effect.acquireRelease(...))`, on the same fibers' loop as the
 * library's rows. What it costs against `rawLease` is Effect's, whichever lock library runs in it.
 */
export const effectLeaseFloor = (database: Database, concurrency: number, durationMs: number): Subject<ThroughputSample> => {
  const names = workerNames("effect-lease", concurrency)
  const statements = leaseStatements(RAW_LEASE_TABLE, "bench-effect-lease")
  return effectFloor(
    "effect-lease-floor",
    database,
    concurrency,
    durationMs,
    statements.createTable,
    (query, w) => statements.acquire(query, names[w]!),
    (query, w, owner) => statements.release(query, names[w]!, owner)
  )
}

/**
 * An Effect floor: worker `w`'s `acquire` and `release` (prepared statements on a session of its
 * own) as `Effect.scoped(Effect.acquireRelease(Effect.promise(…), …))` on the library rows' fiber
 * loop, after `ddl` once.
 */
const effectFloor = <A>(
  id: string,
  database: Database,
  concurrency: number,
  durationMs: number,
  ddl: string,
  acquire: (query: Query, w: number) => Promise<A>,
  release: (query: Query, w: number, acquired: A) => Promise<unknown>
): Subject<ThroughputSample> => ({
  id: `${id}-${concurrency}`,
  open: async () => {
    const clients = await connectMany(database.url, concurrency, `bench-${id}-${concurrency}`)
    await clients[0]!.query(ddl)
    const queries = clients.map(serializedPrepared)
    const runtime = await openRuntime(Layer.empty)
    const cycle = (w: number) =>
      Effect.scoped(Effect.acquireRelease(
        Effect.promise(() => acquire(queries[w]!, w)),
        (acquired) => Effect.promise(() => release(queries[w]!, w, acquired))
      ))
    return {
      run: (round) => runtime.run(effectLoop(concurrency, lengthOf(round, durationMs), cycle)),
      close: async () => {
        await runtime.close()
        await closeAll(clients)
      }
    }
  }
})

/** Raw pg: the smallest transaction-lock cycle, BEGIN; pg_advisory_xact_lock; COMMIT. */
export const rawXactMinimal = (database: Database, concurrency: number, durationMs: number): Subject<ThroughputSample> => {
  const keys = workerNames("raw-xact-min", concurrency).map((name) => advisoryKey(name).toString())
  return rawSubject(`raw-xact-min-${concurrency}`, database, concurrency, concurrency, durationMs, async () => {}, async (query, w) => {
    await query("BEGIN")
    await query("select pg_advisory_xact_lock($1::bigint)", [keys[w]])
    await query("COMMIT")
  })
}

/** Raw pg: exactly withXactLock's statements (uncontended: BEGIN, the try, COMMIT). */
export const rawXactLibrary = (database: Database, concurrency: number, durationMs: number): Subject<ThroughputSample> => {
  const keys = workerNames("raw-xact-lib", concurrency).map((name) => advisoryKey(name).toString())
  return rawSubject(`raw-xact-lib-${concurrency}`, database, concurrency, concurrency, durationMs, async () => {}, async (query, w) => {
    for (const [text, values] of xactStatements(keys[w]!)) await query(text, [...values])
  })
}

export const pgClientLayer = (database: Database, maxConnections: number, applicationName: string) =>
  PgClient.layer({ url: Redacted.make(database.url), maxConnections, applicationName })

/**
 * One cycle of a worker on its own name: `Effect.scoped(DistributedLock.acquire(name))`, or
 * `DistributedLock.withLock(Effect.void, name)` (the guarded form most code uses: the body in a
 * fiber of its own, stopped on loss).
 */
export const lockCycle = (form: "acquire" | "withLock", name: string): Effect.Effect<void, unknown, DistributedLock.DistributedLock> =>
  form === "acquire" ? Effect.scoped(DistributedLock.acquire(name)) : DistributedLock.withLock(Effect.void, name)

/** Cycles of `DistributedLock.acquire` + scope close (or `withLock`) over a lock layer. */
const lockSubject = <E>(
  id: string,
  layer: () => Layer.Layer<DistributedLock.DistributedLock, E>,
  concurrency: number,
  durationMs: number,
  form: "acquire" | "withLock" = "acquire"
): Subject<ThroughputSample> => {
  const names = workerNames(id, concurrency)
  return {
    id,
    open: async () => {
      const runtime = await openRuntime(layer())
      return {
        run: (round) => runtime.run(effectLoop(concurrency, lengthOf(round, durationMs), (w) => lockCycle(form, names[w]!))),
        close: runtime.close
      }
    }
  }
}

export const pgAdvisorySubject = (database: Database, concurrency: number, durationMs: number): Subject<ThroughputSample> =>
  lockSubject(
    `pg-advisory-${concurrency}`,
    () => PgAdvisory.layer({ url: database.url, applicationName: `bench-pg-advisory-${concurrency}` }),
    concurrency,
    durationMs
  )

export const pgLeaseSubject = (
  database: Database,
  concurrency: number,
  durationMs: number,
  form: "acquire" | "withLock" = "acquire",
  connections = Math.min(concurrency, DEFAULT_LOCK_CONNECTIONS)
): Subject<ThroughputSample> => {
  const id = `pg-lease${form === "acquire" ? "" : "-withlock"}${connections < concurrency ? "" : "-own"}-${concurrency}`
  return lockSubject(
    id,
    () => Layer.provide(PgLease.layer({ connections }), pgClientLayer(database, concurrency, `bench-${id}`)),
    concurrency,
    durationMs,
    form
  )
}

export const memorySubject = (concurrency: number, durationMs: number): Subject<ThroughputSample> =>
  lockSubject(`memory-${concurrency}`, () => MemoryBackend.layer(), concurrency, durationMs)

/** The in-process floor: one Effect semaphore per name, taken and given back in a scope. */
export const semaphoreSubject = (concurrency: number, durationMs: number): Subject<ThroughputSample> => ({
  id: `semaphore-${concurrency}`,
  open: async () => {
    const semaphores = await Effect.runPromise(Effect.forEach(range(concurrency), () => Effect.makeSemaphore(1)))
    const cycle = (w: number) =>
      Effect.scoped(Effect.acquireRelease(semaphores[w]!.take(1), () => semaphores[w]!.release(1)))
    return { run: (round) => Effect.runPromise(effectLoop(concurrency, lengthOf(round, durationMs), cycle)), close: async () => {} }
  }
})

export const xactSubject = (database: Database, concurrency: number, durationMs: number): Subject<ThroughputSample> => {
  const id = `pg-xact-${concurrency}`
  const names = workerNames(id, concurrency)
  return {
    id,
    open: async () => {
      const runtime = await openRuntime(pgClientLayer(database, concurrency, `bench-${id}`))
      return {
        run: (round) => runtime.run(effectLoop(concurrency, lengthOf(round, durationMs), (w) => PgAdvisory.withXactLock(names[w]!)(Effect.void))),
        close: runtime.close
      }
    }
  }
}

/**
 * withXactLock's fair floor: @effect/sql-pg's own `withTransaction` on the same pool sending the
 * same three statements (BEGIN, the try, COMMIT). withXactLock runs in the user's transaction on
 * the user's SqlClient, so the @effect/sql machinery is a cost the user pays with or without it.
 */
export const sqlXactSubject = (database: Database, concurrency: number, durationMs: number): Subject<ThroughputSample> => {
  const id = `sql-xact-${concurrency}`
  const keys = workerNames(id, concurrency).map((name) => advisoryKey(name).toString())
  return {
    id,
    open: async () => {
      const runtime = await openRuntime(pgClientLayer(database, concurrency, `bench-${id}`))
      const cycle = (w: number) =>
        Effect.flatMap(PgClient.PgClient, (sql) =>
          sql.withTransaction(sql`select pg_try_advisory_xact_lock(${keys[w]!}::bigint) as granted`.withoutTransform))
      return {
        run: (round) => runtime.run(effectLoop(concurrency, lengthOf(round, durationMs), cycle)),
        close: runtime.close
      }
    }
  }
}

// ---------------------------------------------------------------- scenario

export interface UncontendedResult {
  readonly database: string
  readonly byConcurrency: ReadonlyArray<{
    readonly concurrency: number
    readonly memory: ReadonlyArray<ThroughputRow>
    readonly postgres: ReadonlyArray<ThroughputRow>
  }>
}

const pool = (n: number) => `${n} (pool)`

/** The subject factories a row can be built from in a process of its own. */
export const FACTORIES = {
  rawAdvisoryLock: (database: Database, c: number, ms: number) => rawAdvisoryLock(database, c, ms),
  rawAdvisoryFenced: (database: Database, c: number, sessions: number, ms: number) => rawAdvisoryFenced(database, c, sessions, ms),
  effectAdvisoryFloor: (database: Database, c: number, ms: number) => effectAdvisoryFloor(database, c, ms),
  pgAdvisorySubject: (database: Database, c: number, ms: number) => pgAdvisorySubject(database, c, ms),
  rawLease: (database: Database, c: number, ms: number) => rawLease(database, c, ms),
  pgLeaseSubject: (database: Database, c: number, ms: number) => pgLeaseSubject(database, c, ms),
  pgLeaseWithLockSubject: (database: Database, c: number, ms: number) => pgLeaseSubject(database, c, ms, "withLock"),
  pgLeaseOwnSubject: (database: Database, c: number, ms: number) => pgLeaseSubject(database, c, ms, "acquire", c),
  effectLeaseFloor: (database: Database, c: number, ms: number) => effectLeaseFloor(database, c, ms),
  rawXactMinimal: (database: Database, c: number, ms: number) => rawXactMinimal(database, c, ms),
  rawXactLibrary: (database: Database, c: number, ms: number) => rawXactLibrary(database, c, ms),
  sqlXactSubject: (database: Database, c: number, ms: number) => sqlXactSubject(database, c, ms),
  xactSubject: (database: Database, c: number, ms: number) => xactSubject(database, c, ms),
  semaphoreSubject: (_: undefined, c: number, ms: number) => semaphoreSubject(c, ms),
  memorySubject: (_: undefined, c: number, ms: number) => memorySubject(c, ms)
}

/** Set to measure every row in the bench's own process, as runs before 2026-12-02 did (for comparison). */
export const IN_PROCESS = process.env["BENCH_IN_PROCESS"] === "1"
/** `BENCH_BLOCKS=xact,lease` (development only): measure just these blocks of the uncontended tables. */
const BLOCKS = process.env["BENCH_BLOCKS"]?.split(",").filter((b) => b !== "")
const inBlocks = <S extends { readonly block?: string | undefined }>(specs: Array<S>): Array<S> =>
  BLOCKS === undefined ? specs : specs.filter((spec) => spec.block !== undefined && BLOCKS.includes(spec.block))

/**
 * The row of `FACTORIES[factory]`, measured in a process of its own (`isolated.ts`): each
 * backend, raw floor and baseline runs as an application would, alone in its process.
 */
export const own = <K extends keyof typeof FACTORIES>(
  factory: K,
  database: Database | undefined,
  ...args: Parameters<(typeof FACTORIES)[K]> extends [unknown, ...infer Rest] ? Rest : never
): Subject<ThroughputSample> => {
  const local = (FACTORIES[factory] as (database: Database | undefined, ...args: Array<unknown>) => Subject<ThroughputSample>)(database, ...args)
  if (IN_PROCESS) return local
  return isolated(local, {
    module: import.meta.url,
    factory,
    database: database === undefined ? undefined : { name: database.name, url: database.url },
    args
  })
}

const postgresSpecs = (database: Database, c: number, ms: number): Array<ThroughputSpec> => {
  const specs: Array<ThroughputSpec> = [
    { block: "advisory", id: "raw-advisory-lock", label: "raw pg: lock + unlock (no fencing write)", connections: `${c}`, concurrency: c, subject: own("rawAdvisoryLock", database, c, ms) },
    { block: "advisory", id: "raw-advisory-fenced", label: "raw pg: PgAdvisory's statements (fenced)", connections: `${c}`, concurrency: c, subject: own("rawAdvisoryFenced", database, c, c, ms) }
  ]
  if (c > 1) {
    specs.push({
      block: "advisory",
      id: "raw-advisory-fenced-1conn",
      label: `raw pg: PgAdvisory's statements, ${c} callers on 1 connection`,
      connections: "1",
      concurrency: c,
      baseline: "raw-advisory-fenced",
      subject: own("rawAdvisoryFenced", database, c, 1, ms)
    })
  }
  specs.push(
    // Information: what any Effect program pays on these statements (the library's row stays judged against raw pg).
    { block: "advisory", id: "effect-advisory-floor", label: "Effect.scoped(acquireRelease) of PgAdvisory's statements on raw pg", connections: `${c}`, concurrency: c, baseline: "raw-advisory-fenced", subject: own("effectAdvisoryFloor", database, c, ms) },
    { block: "advisory", id: "pg-advisory", label: "PgAdvisory.layer", connections: "own sessions (≤ 4)", concurrency: c, baseline: "raw-advisory-fenced", subject: own("pgAdvisorySubject", database, c, ms) },
    { block: "lease", id: "raw-lease", label: "raw pg: PgLease's statements", connections: `${c}`, concurrency: c, subject: own("rawLease", database, c, ms) },
    // Information: what any Effect program pays on these statements (the library's row stays judged against raw pg).
    { block: "lease", id: "effect-lease-floor", label: "Effect.scoped(acquireRelease) of PgLease's statements on raw pg", connections: `${c}`, concurrency: c, baseline: "raw-lease", subject: own("effectLeaseFloor", database, c, ms) },
    // Its default lock connections (4): with more workers, statements queue at its pool and those of
    // different names go out in batches (issue 37). At 1 worker the same as a layer of 1 connection.
    { block: "lease", id: "pg-lease", label: c > DEFAULT_LOCK_CONNECTIONS ? `PgLease.layer (its default ${DEFAULT_LOCK_CONNECTIONS} lock connections)` : "PgLease.layer", connections: `${Math.min(c, DEFAULT_LOCK_CONNECTIONS)} (own)`, concurrency: c, baseline: "raw-lease", subject: own("pgLeaseSubject", database, c, ms) },
    // Information: the guarded form (`withLock(Effect.void, name)`) on the same layer.
    { block: "lease", id: "pg-lease-withlock", label: "PgLease.layer, withLock (information)", connections: `${Math.min(c, DEFAULT_LOCK_CONNECTIONS)} (own)`, concurrency: c, baseline: "raw-lease", subject: own("pgLeaseWithLockSubject", database, c, ms) },
    // Information: as many lock connections as workers, as the raw row has: nothing queues, so nothing is batched.
    ...(c > DEFAULT_LOCK_CONNECTIONS
      ? [{ block: "lease", id: "pg-lease-own", label: `PgLease.layer, ${c} lock connections (information: nothing queues, nothing is batched)`, connections: `${c} (own)`, concurrency: c, baseline: "raw-lease", subject: own("pgLeaseOwnSubject", database, c, ms) } satisfies ThroughputSpec]
      : []),
    { block: "xact", id: "raw-xact-min", label: "raw pg: BEGIN; xact lock; COMMIT", connections: `${c}`, concurrency: c, subject: own("rawXactMinimal", database, c, ms) },
    { block: "xact", id: "raw-xact-lib", label: "raw pg: withXactLock's statements", connections: `${c}`, concurrency: c, subject: own("rawXactLibrary", database, c, ms) },
    { block: "xact", id: "sql-xact", label: "@effect/sql-pg withTransaction: the same statements", connections: pool(c), concurrency: c, baseline: "raw-xact-lib", subject: own("sqlXactSubject", database, c, ms) },
    { block: "xact", id: "pg-xact", label: "PgAdvisory.withXactLock", connections: pool(c), concurrency: c, baseline: "sql-xact", subject: own("xactSubject", database, c, ms) }
  )
  return inBlocks(specs)
}

const memorySpecs = (c: number, ms: number): Array<ThroughputSpec> => inBlocks([
  { block: "memory", id: "semaphore", label: "Effect.makeSemaphore", connections: "–", concurrency: c, subject: own("semaphoreSubject", undefined, c, ms) },
  { block: "memory", id: "memory", label: "MemoryBackend.layer", connections: "–", concurrency: c, baseline: "semaphore", subject: own("memorySubject", undefined, c, ms) }
])

const run = async (context: Context): Promise<UncontendedResult> => {
  const database = await createDatabase(context.adminUrl, "uncontended")
  try {
    const byConcurrency: Array<UncontendedResult["byConcurrency"][number]> = []
    for (const c of CONCURRENCIES) {
      const memory = await measureThroughput(context, `uncontended c=${c} memory`, memorySpecs(c, context.settings.memoryThroughputMs))
      const postgres = await measureThroughput(context, `uncontended c=${c} postgres`, postgresSpecs(database, c, context.settings.throughputMs))
      byConcurrency.push({ concurrency: c, memory, postgres })
    }
    return { database: database.name, byConcurrency }
  } finally {
    await database.drop()
  }
}

const render = (result: UncontendedResult): string => {
  const sections = result.byConcurrency.map((level) =>
    [
      `### ${level.concurrency} concurrent ${level.concurrency === 1 ? "worker" : "workers"}`,
      "",
      renderThroughput([...level.memory, ...level.postgres])
    ].join("\n")
  )
  return [
    "Each worker acquires and releases its own name (distinct between workers, reused across cycles) back to back. " +
    "A cycle is `Effect.scoped(DistributedLock.acquire(name))` for the lock layers, `withXactLock(name)(Effect.void)` " +
    "for transaction locks, and the same statements sent by hand with node-postgres for the raw rows.",
    "",
    "- *raw pg: lock + unlock*: `select pg_advisory_lock($1)`, `select pg_advisory_unlock($1)` — no fencing token.",
    "- *raw pg: PgAdvisory's statements (fenced)*: the two statements PgAdvisory sends per cycle — " +
    "`pg_try_advisory_lock` fused with the fencing-counter upsert (`insert … on conflict do update set token = token + 1`; " +
    "PgAdvisory's batch statement, `unnest` of keys, with the one key a single caller sends), and `pg_advisory_unlock` " +
    "fused with a check for registered notification-only waiters (`pg_notify` only if one is registered: here none). " +
    "The first commits a write, and a commit that writes waits for the WAL flush. Both are prepared statements " +
    "(named: parsed and planned once per session), as PgAdvisory sends them.",
    "- *… N callers on 1 connection*: the same statements one at a time, all workers sharing one session. PgAdvisory " +
    "also takes uncontended locks on one session (its home session), but sends the tries queued behind a running " +
    "statement together as one statement (one commit), and the releases queued together as one statement too; this " +
    "row shows what one session does without that.",
    "- *Effect.scoped(acquireRelease) of PgAdvisory's statements on raw pg* (information only): the fenced raw row's " +
    "two statements (a session per worker) as a user would write them in Effect (`Effect.promise` around each, in " +
    "`Effect.scoped(Effect.acquireRelease(...))`, on the library rows' fiber loop): what any Effect program pays on them.",
    "- *raw pg: PgLease's statements*: the acquire statement and the owner-scoped release (which notifies only " +
    "waiters at the head of the queue) from `src/internal/lease/pg/sql.ts`, same parameters, one connection per " +
    "worker. PgLease runs on its default 4 lock connections of its own: with more workers than that, the statements " +
    "of different names that wait for a connection together go out as one (`acquireBatch`, `releaseBatch`: one round " +
    "trip and one commit for all); the row with as many lock connections as workers (information) never queues, so " +
    "it never batches.",
    "- *Effect.scoped(acquireRelease) of PgLease's statements on raw pg* (information only): the raw row's two " +
    "statements as a user would write them in Effect (`Effect.promise` around each, in " +
    "`Effect.scoped(Effect.acquireRelease(...))`, on the library rows' fiber loop): what any Effect program pays on them.",
    "- *PgLease.layer, withLock* (information only): the same layer, each cycle `DistributedLock.withLock(Effect.void, " +
    "name)` instead of `Effect.scoped(DistributedLock.acquire(name))`: the guarded form, whose body runs in a fiber of " +
    "its own (stopped on a loss).",
    "- *withXactLock's statements*: `BEGIN`, `pg_try_advisory_xact_lock`, `COMMIT` — what the combinator sends " +
    "uncontended with an empty body.",
    "- *@effect/sql-pg withTransaction*: the same three statements through `PgClient`'s own `withTransaction` on the " +
    "same pool: withXactLock runs in the user's transaction on the user's `SqlClient`, so this is its fair floor " +
    "(its target is measured against this row; the raw row stays beside it for information).",
    "",
    sections.join("\n\n")
  ].join("\n")
}

const findRow = (rows: ReadonlyArray<ThroughputRow>, id: string) => rows.find((row) => row.id === id)

/** The fencing write's cost, from the two raw advisory rows: reported, not judged against a number. */
const fencingCost = (level: UncontendedResult["byConcurrency"][number]): Target => {
  const plain = findRow(level.postgres, "raw-advisory-lock")
  const fenced = findRow(level.postgres, "raw-advisory-fenced")
  const subject = `raw pg advisory rows, ${level.concurrency} ${level.concurrency === 1 ? "worker" : "workers"}`
  const target = "advisory cycles/s reported with and without the fencing-token write"
  if (plain?.result._tag !== "Measured" || fenced?.result._tag !== "Measured") {
    return { target, subject, status: "MISS", detail: "a raw advisory row was not measured" }
  }
  const a = plain.result.cyclesPerSecond.median
  const b = fenced.result.cyclesPerSecond.median
  return {
    target,
    subject,
    status: "PASS",
    detail: `lock + unlock ${Report.rate(a)}/s; with the fencing upsert ${Report.rate(b)}/s (${Report.ratio(b / a)}: the durable write costs ${Report.ms(1000 / b - 1000 / a)} ms per cycle per connection)`
  }
}

/** The speed targets: each row against its own baseline, measured in the same rounds. */
const RATIO_TARGETS: ReadonlyArray<{ readonly id: string; readonly block: "postgres" | "memory"; readonly atLeast: number; readonly against: string }> = [
  { id: "pg-advisory", block: "postgres", atLeast: 0.8, against: "raw pg, same statements" },
  { id: "pg-lease", block: "postgres", atLeast: 0.8, against: "raw pg, same statements" },
  { id: "pg-xact", block: "postgres", atLeast: 0.8, against: "@effect/sql-pg withTransaction, same statements" },
  { id: "memory", block: "memory", atLeast: 0.5, against: "Effect.makeSemaphore" }
]

const targets = (result: UncontendedResult): ReadonlyArray<Target> =>
  result.byConcurrency.flatMap((level) => [fencingCost(level), ...
    RATIO_TARGETS.map(({ id, block, atLeast, against }): Target => {
      const rows = level[block]
      const row = findRow(rows, id)
      const ratio = ratioOf(row)
      const base = row?.baseline === undefined ? undefined : findRow(rows, row.baseline)
      const subject = `${row?.label ?? id}, ${level.concurrency} ${level.concurrency === 1 ? "worker" : "workers"}`
      const target = `uncontended ≥ ${atLeast}× ${against}`
      if (row === undefined || row.result._tag !== "Measured" || ratio === undefined || base?.result._tag !== "Measured") {
        return { target, subject, status: "N/A", detail: row?.result._tag === "Skipped" ? row.result.reason : "not measured" }
      }
      return {
        target,
        subject,
        status: ratio >= atLeast ? "PASS" : "MISS",
        detail: `${Report.rate(row.result.cyclesPerSecond.median)}/s vs ${Report.rate(base.result.cyclesPerSecond.median)}/s = ${Report.ratio(ratio)}`
      }
    })
  ])

export const scenario: Scenario<UncontendedResult> = {
  name: "uncontended",
  title: "1. Uncontended cycles/s",
  run,
  render,
  targets
}

/**
 * PostgreSQL advisory locks.
 *
 * `layer` provides `DistributedLock` on **session** advisory locks held on a few PostgreSQL
 * sessions the library owns (raw `pg.Client`s, never a shared pool connection): waiters are
 * woken by the server itself, an interrupted wait is cancelled at the server, and a session
 * whose state cannot be proven is destroyed so the server drops its locks. `withXactLock` runs
 * an effect in a transaction of your own `SqlClient` holding a **transaction** advisory lock —
 * the variant that also works behind transaction-mode PgBouncer.
 *
 * Both derive the lock's 64-bit key from its name (`keyOf`), so they exclude each other on the
 * same name and namespace.
 *
 * @since 0.1.0
 */
import type * as SqlClient from "@effect/sql/SqlClient"
import type { PgClient } from "@effect/sql-pg/PgClient"
import type { SqlError } from "@effect/sql/SqlError"
import * as Context from "effect/Context"
import * as Config from "effect/Config"
import type * as ConfigError from "effect/ConfigError"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import { dual } from "effect/Function"
import type * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import type * as DistributedLock from "./DistributedLock.js"
import * as DistributedSemaphore from "./DistributedSemaphore.js"
import type { LockMode } from "./Lease.js"
import type { LockAndSemaphoreBackend } from "./LockBackend.js"
import { type InvalidLockName, LockBackendError, LockTimeout, type UnsafeConnectionPooling } from "./LockError.js"
import * as inspect from "./internal/advisory/inspect.js"
import { advisoryKey, cachedAdvisoryKey } from "./internal/core/lockKey.js"
import { isTraced } from "./internal/core/tracing.js"
import { parseTable } from "./internal/sql/tables.js"
import * as internal from "./internal/advisory/engine.js"
import * as optionsOf from "./internal/advisory/options.js"
import * as xact from "./internal/advisory/xact.js"
import { decodeDuration, modeProblem, nameProblem } from "./internal/core/validate.js"

/**
 * Options of the session-lock layer.
 *
 * Where to connect (directly, or through a pooler in **session** mode):
 * - `url`: a PostgreSQL connection URL (`sslmode`, `application_name`, … in it work as in node-pg);
 * - or, also on top of a URL, fields: `host` (a unix-socket directory works too), `port`,
 *   `database`, `user`, `password` (text, `Redacted`, or a function asked at each connect, for
 *   rotating credentials), and `ssl` (`true`, or node's TLS options, e.g. `{ ca }` for a custom
 *   CA). `layerFromPgClient` takes all of them from the app's `PgClient` instead.
 *
 * The layer:
 * - `maxSessions`: most server connections the layer opens (default 4, at least 1). One carries
 *   every uncontended lock and every semaphore permit; the others are for waiting on contended
 *   locks. With 1, contended waits rely on release notifications.
 * - `applicationName`: shown in `pg_stat_activity` so an operator can see who holds what
 *   (default `"effect-lock"`; an `application_name` in the URL is used when this is not given).
 * - `namespace`: mixed into every key, so two applications can use the same names apart.
 * - `fencingTable`: table of the fencing tokens of names in use, `name` or `schema.name` as for
 *   `PgLease`'s table (default `effect_lock_fencing`, in the session's search_path); tokens are
 *   drawn from the sequence `effect_lock_tokens` in the same schema.
 * - `createTables`: create the fencing table on first use (default `true`). With `false` the
 *   layer only checks it exists, for roles that may not run DDL: create it with `migration()`.
 * - `connectTimeout`: bound on opening one session (default 10 s).
 * - `heartbeatInterval` / `heartbeatTimeout`: idle sessions are checked this often and
 *   destroyed (their leases lost) when a check gets no answer in time (default 500 ms / 1 s), so a
 *   holder learns of a silent network drop or a frozen server within about 1.6 s.
 * - `sweepInterval`: how often the fencing rows of lock names nobody holds or waits for are
 *   deleted (default 5 s; zero: never). Tokens come from the database's one sequence, so a
 *   name's next grant still gets a larger token.
 *
 * @since 0.1.0
 * @category models
 */
export interface Options extends optionsOf.ConnectionFields {}

/**
 * The `SqlClient` tag, referenced by its key so that importing this module (or `effect-lock`)
 * does not load `@effect/sql`: only its types are imported.
 */
const SqlClientTag = Context.GenericTag<SqlClient.SqlClient>("@effect/sql/SqlClient")

/** Same bound as the other backends, although the key is a hash: names behave alike everywhere. */
const MAX_NAME_BYTES = 1024

/** The `PgClient` tag, by its key (see `SqlClientTag`). */
const PgClientTag = Context.GenericTag<PgClient>("@effect/sql-pg/PgClient")

/**
 * Builds the backend (the SPI) for wrapping or for `DistributedLock.make`; its `semaphore` is
 * the permit store, for `DistributedSemaphore.make`, on the same sessions. Fails with
 * `UnsafeConnectionPooling` when the connection has no session affinity. Closing the scope
 * closes every session, so the server drops every lock and permit still held.
 *
 * @since 0.1.0
 * @category constructors
 */
export const makeBackend = (
  settings: Options
): Effect.Effect<LockAndSemaphoreBackend, UnsafeConnectionPooling | LockBackendError, Scope.Scope> =>
  Effect.flatMap(optionsOf.resolve(settings), internal.make)

/**
 * `DistributedLock` and `DistributedSemaphore` on PostgreSQL session advisory locks, on the
 * sessions this layer owns (at most `maxSessions` for both). Needs nothing else; fails to build
 * with `UnsafeConnectionPooling` behind a transaction-mode pooler.
 *
 * Semaphores here: permits are taken all or none in one statement with their fencing tokens.
 * Waiters are served first in, first out across processes, as on every other backend: a request
 * is granted only when the free permits cover it and every waiter ahead of it, so a big request
 * is not overtaken by smaller ones behind it and a `tryAcquire` never overtakes a waiter. A
 * release wakes only the head waiters that now fit (by a notification naming them, in other
 * processes); a waiter whose session died loses its place, and a holder that crashed (and
 * notified nobody) is noticed by a re-try about once a second; a waiter that times out or is
 * interrupted gives its place up at once. A limit is at most 1024 (each held permit is an entry
 * of the server's shared lock table). The fencing table keeps each semaphore's limit and waiter
 * queue (`permit_limit` and `permit_queue` columns, added to an older table on first use unless
 * `createTables` is `false`; see `migration`). Needs PostgreSQL 12 or later.
 *
 * @since 0.1.0
 * @category layers
 */
export const layer = (
  options: Options
): Layer.Layer<
  DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore,
  UnsafeConnectionPooling | LockBackendError
> => DistributedSemaphore.layerBackend(makeBackend(options))

/**
 * `layer` with its options read from configuration, e.g.
 * `PgAdvisory.layerConfig({ url: Config.redacted("DATABASE_URL") })`.
 *
 * @since 0.1.0
 * @category layers
 */
export const layerConfig = (
  config: Config.Config.Wrap<Omit<Options, "password" | "ssl">>
): Layer.Layer<
  DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore,
  ConfigError.ConfigError | UnsafeConnectionPooling | LockBackendError
> => DistributedSemaphore.layerBackend(Effect.flatMap(Config.unwrap(config), makeBackend))

/**
 * `layer` on the same server, database, credentials and TLS as the app's `PgClient`
 * (`PgClient.config`) — its own sessions, never the app's pool connections. `settings` adds or
 * overrides layer options (`maxSessions`, `namespace`, …).
 *
 * @since 0.1.0
 * @category layers
 */
export const layerFromPgClient = (
  settings?: Omit<Options, "url" | "host" | "port" | "database" | "user" | "password" | "ssl">
): Layer.Layer<
  DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore,
  UnsafeConnectionPooling | LockBackendError,
  PgClient
> =>
  DistributedSemaphore.layerBackend(
    Effect.flatMap(PgClientTag, (client) => makeBackend({ ...optionsOf.fromPgClientConfig(client.config), ...settings }))
  )

/**
 * The fencing table's DDL, for roles that may not run DDL at run time (`createTables: false`):
 * run it once in your migrations. Idempotent: it also adds the semaphores' `permit_limit` and
 * `permit_queue` columns to a fencing table made before semaphores or their queue. `fencingTable`
 * as for `layer`; an invalid name throws.
 *
 * @since 0.1.0
 * @category layers
 */
export const migration = (settings?: { readonly fencingTable?: string | undefined }): string => {
  const table = parseTable(settings?.fencingTable ?? optionsOf.DEFAULT_FENCING_TABLE)
  if (typeof table === "string") throw new RangeError(`fencingTable: ${table}`)
  return `${internal.fencingTableSql(table)};\n${internal.permitColumnsSql(table)};\n${internal.fencingTokensSql(table)};`
}

/**
 * The signed 64-bit advisory-lock key of a lock name, as PostgreSQL sees it in `pg_locks`
 * (`(classid::bigint << 32) | objid` with `objsubid = 1`): for operators looking for a holder.
 *
 * @since 0.1.0
 * @category keys
 */
export const keyOf = (name: string, namespace?: string): bigint => advisoryKey(name, namespace)

/**
 * Options of `withXactLock`.
 *
 * - `timeout`: bound on the lock wait (absent: wait forever; zero or negative: one attempt).
 *   Waiting for the pool's connection is bounded by the pool's own `connectTimeout`. A pool
 *   `statement_timeout` shorter than `timeout` does not cut the wait short.
 * - `mode`: `exclusive` (default) or `shared`.
 * - `namespace`: as for `layer`; the same name and namespace give the same key in both.
 * - `statementTimeout`: client-side bound on each statement `withXactLock` sends itself — the
 *   lock statements (a wait slice gets it on top of the slice) and the COMMIT or ROLLBACK after
 *   the body (default 5 s). A killed or frozen connection there ends in `LockBackendError`
 *   within it; at COMMIT that error means the transaction's outcome is unknown.
 *
 * @since 0.1.0
 * @category models
 */
export interface XactLockOptions {
  readonly timeout?: Duration.DurationInput | undefined
  readonly statementTimeout?: Duration.DurationInput | undefined
  readonly mode?: LockMode | undefined
  readonly namespace?: string | undefined
}

/**
 * Runs `self` in a transaction of the current `SqlClient` holding the transaction advisory
 * lock `name` (`pg_advisory_xact_lock`, or `_shared`): `self`'s own SQL runs in that
 * transaction, and the lock is released with it — on commit, on failure (rollback) and on
 * interruption. Works behind transaction-mode poolers.
 *
 * A contended wait runs in slices of at most a second within the transaction (a savepoint and a
 * transaction-local lock_timeout per slice), so interrupting it takes effect within about a
 * second even when the pool has no connection to spare for a cancel.
 *
 * Errors: `self`'s own errors and defects unchanged; `LockTimeout` when the lock was not granted
 * within `timeout`; `InvalidLockName`; `LockBackendError` for the transaction machinery (BEGIN,
 * COMMIT, a connection killed under the transaction).
 *
 * @since 0.1.0
 * @category combinators
 */
export const withXactLock: {
  (
    name: string,
    options?: XactLockOptions
  ): <A, E, R>(
    self: Effect.Effect<A, E, R>
  ) => Effect.Effect<A, E | LockTimeout | InvalidLockName | LockBackendError, R | SqlClient.SqlClient>
  <A, E, R>(
    self: Effect.Effect<A, E, R>,
    name: string,
    options?: XactLockOptions
  ): Effect.Effect<A, E | LockTimeout | InvalidLockName | LockBackendError, R | SqlClient.SqlClient>
} = dual(
  (args) => Effect.isEffect(args[0]),
  <A, E, R>(
    self: Effect.Effect<A, E, R>,
    rawName: string,
    options?: XactLockOptions
  ): Effect.Effect<A, E | LockTimeout | InvalidLockName | LockBackendError, R | SqlClient.SqlClient> =>
    Effect.withFiberRuntime((fiber) => {
      // Read synchronously, no Effect per step: this runs once per transaction, on the hot path.
      const problem = nameProblem(rawName, MAX_NAME_BYTES) ?? modeProblem(rawName, options?.mode)
      const statementTimeout = decodeDuration(options?.statementTimeout)
      const locked: Effect.Effect<A, E | LockTimeout | InvalidLockName | LockBackendError, R> = problem !== undefined
        ? Effect.fail(problem)
        : xact.run(Context.unsafeGet(fiber.currentContext, SqlClientTag), self, {
        name: rawName,
        key: cachedAdvisoryKey(rawName, options?.namespace),
        mode: options?.mode ?? "exclusive",
        timeout: decodeDuration(options?.timeout),
        statementTimeoutMillis: statementTimeout === undefined ? xact.DEFAULT_STATEMENT_TIMEOUT_MS : Duration.toMillis(statementTimeout)
      })
      // A span only when a tracer would keep it: on the hot path it costs more than it tells nobody.
      return isTraced(fiber)
        ? Effect.withSpan(locked, "effect-lock.withXactLock", { captureStackTrace: false, attributes: { "lock.name": rawName } })
        : locked
    })
)

/**
 * Options of `listHolders`.
 *
 * - `fencingTable`: where session locks record their names (default `effect_lock_fencing`, as
 *   for `layer`). Keys found there are named, whatever their namespace.
 * - `names` / `namespace`: more names to recognise, hashed with `namespace` — for example the
 *   names of `withXactLock`, which records none in the fencing table.
 *
 * @since 0.1.0
 * @category models
 */
export interface ListHoldersOptions {
  readonly fencingTable?: string | undefined
  readonly names?: Iterable<string> | undefined
  readonly namespace?: string | undefined
}

/**
 * One advisory lock request in the database, granted or waiting, and the session behind it.
 * Details of other roles' sessions (`clientAddress`, `since`, `state`, …) are `None` unless the
 * reading role is a superuser or has `pg_read_all_stats`.
 *
 * - `key`: the signed 64-bit key (`keyOf`); `name`: the lock name when the key is known.
 * - `granted`: `false` for a session queued behind the holders.
 * - `since`: for a waiter, when it began waiting. PostgreSQL records no grant time, so for a
 *   holder it is the start of the holding session: the lock was taken at that time or later.
 * - `waitEvent`: what the session waits on right now, e.g. `Lock:advisory`.
 * - Times are ms since the epoch, server clock.
 *
 * @since 0.1.0
 * @category models
 */
export interface AdvisoryHolder {
  readonly key: bigint
  readonly name: Option.Option<string>
  readonly mode: LockMode
  readonly granted: boolean
  readonly pid: number
  readonly applicationName: Option.Option<string>
  readonly clientAddress: Option.Option<string>
  readonly user: Option.Option<string>
  readonly since: Option.Option<number>
  readonly state: Option.Option<string>
  readonly waitEvent: Option.Option<string>
}

/** Names for keys: first those the caller gave, then the fencing table's for the rest. */
const nameKeys = (
  sql: SqlClient.SqlClient,
  rows: ReadonlyArray<inspect.LockRow & { readonly key: bigint }>,
  options: ListHoldersOptions | undefined
): Effect.Effect<ReadonlyMap<bigint, string>, SqlError> =>
  Effect.gen(function*() {
    const names = new Map<bigint, string>()
    const wanted = new Set(rows.map((row) => row.key))
    for (const name of options?.names ?? []) {
      const key = advisoryKey(name, options?.namespace)
      if (wanted.has(key)) names.set(key, name)
    }
    const unnamed = Array.from(wanted).filter((key) => !names.has(key))
    const table = rows[0]?.fencing ?? null
    if (unnamed.length === 0 || table === null) return names
    const stored = yield* sql.unsafe<{ key: string; name: string }>(
      inspect.namesSql(table),
      [unnamed.map(String)]
    ).withoutTransform
    for (const row of stored) names.set(BigInt(row.key), row.name)
    return names
  })

/**
 * The advisory locks held, and awaited, across the cluster in the current database — by any
 * process, not only this one — with who holds them (`pg_locks` ⋈ `pg_stat_activity`), named
 * from the fencing table. Runs on your `SqlClient`; two statements at most, no writes. For the
 * locks this process holds, see `DistributedLock.inspect`.
 *
 * @since 0.1.0
 * @category inspection
 */
export const listHolders = (
  options?: ListHoldersOptions
): Effect.Effect<ReadonlyArray<AdvisoryHolder>, LockBackendError, SqlClient.SqlClient> =>
  Effect.gen(function*() {
    const sql = yield* SqlClientTag
    const table = parseTable(options?.fencingTable ?? optionsOf.DEFAULT_FENCING_TABLE)
    if (typeof table === "string") return yield* Effect.fail(new Error(`fencingTable: ${table}`))
    const raw = yield* sql.unsafe<inspect.LockRow>(inspect.listSql, [table.sql]).withoutTransform
    const rows = raw.flatMap((row) => {
      const mode = inspect.modeOf(row.mode)
      return mode === undefined ? [] : [{ ...row, mode, key: inspect.keyFromLockTag(BigInt(row.classid), BigInt(row.objid)) }]
    })
    // pg_locks orders by the unsigned halves; readers expect signed key order, holders before waiters.
    rows.sort((a, b) => a.key < b.key ? -1 : a.key > b.key ? 1 : Number(b.granted) - Number(a.granted) || a.pid - b.pid)
    const names = yield* nameKeys(sql, rows, options)
    return rows.map((row): AdvisoryHolder => ({
      key: row.key,
      name: Option.fromNullable(names.get(row.key)),
      mode: row.mode,
      granted: row.granted,
      pid: row.pid,
      applicationName: Option.fromNullable(row.application),
      clientAddress: Option.fromNullable(row.client),
      user: Option.fromNullable(row.username),
      since: Option.fromNullable(row.granted ? row.sessionstart : row.waitstart),
      state: Option.fromNullable(row.state),
      waitEvent: Option.fromNullable(
        row.waittype === null ? null : row.waitevent === null ? row.waittype : `${row.waittype}:${row.waitevent}`
      )
    }))
  }).pipe(
    Effect.mapError((cause) => new LockBackendError({ operation: "inspect", cause })),
    Effect.withSpan("effect-lock.inspect", { captureStackTrace: false, attributes: { backend: "pg-advisory" } })
  )

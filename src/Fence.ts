/**
 * Fencing at the protected resource: a lock alone cannot stop a holder that paused (GC, network,
 * a suspended VM) past the loss of its lease from writing afterwards. The resource has to refuse
 * it. `Fence.check(resource, token)` runs inside the writer's own transaction, accepts the write
 * only when its fencing token is at least the highest token the resource has accepted, and records
 * it — so the check commits or rolls back together with the write it guards.
 *
 * ```ts
 * const sql = yield* SqlClientTag
 * yield* sql.withTransaction(Effect.gen(function*() {
 *   yield* Fence.check("invoices", lease.token) // fails StaleFencingToken after a takeover
 *   yield* sql`update invoices set status = 'sent' where id = ${id}`
 * }))
 * ```
 *
 * PostgreSQL only (the check's upsert, the creation's DO block).
 *
 * **Table.** One row per resource in `effect_lock_fences` (`resource` text primary key, `token`
 * bigint, `updated_at`). Rows are never deleted. Run `migration` from your own migrations, or let
 * the first check create it:
 *
 * - outside a transaction, a check that finds the table missing (SQLSTATE 42P01) creates it in
 *   its own autocommit statement and retries once;
 * - inside a transaction a failed statement would abort the caller's transaction, so until this
 *   process has seen the table exist for a `SqlClient`, a check runs under a savepoint (three
 *   extra round trips: the savepoint, its release, and the transaction id that tells whether this
 *   very transaction created the table), and a missing table is created **in the caller's
 *   transaction**: borrowing a second connection from their pool could deadlock on a full pool.
 *   If they roll back, the table goes with the token it recorded — nothing is lost, the next check
 *   creates it again. Until that transaction ends, other first checks wait for it (the creation
 *   lock). Once the table is seen committed, a check is one statement, without a savepoint.
 *
 * Concurrent creators serialize on a transaction advisory lock and re-check, since concurrent
 * `create table if not exists` can fail on the catalog's unique index. An existing table needs no
 * CREATE privilege; set `createTable: false` when your migrations own it.
 *
 * **Bounds.** Every statement a check sends (the check, its savepoint, the first-use creation and
 * its creation lock) is bounded on the client by `statementTimeout` (default 5 s): a frozen server,
 * a dropped connection or a writer of the same resource whose transaction stays open fails the
 * check with a `LockBackendError` within the bound, and the statement is cancelled in the
 * background. Inside a transaction the caller's transaction is then unusable: roll it back.
 *
 * **Isolation.** Written for READ COMMITTED (PostgreSQL's default). Under REPEATABLE READ or
 * SERIALIZABLE a check racing a concurrent writer of the same resource fails with a
 * `LockBackendError` wrapping a serialization failure (40001): retry the transaction.
 *
 * @since 0.1.0
 */
import type * as SqlClient from "@effect/sql/SqlClient"
import * as Context from "effect/Context"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as FencingToken from "./FencingToken.js"
import { LockBackendError, StaleFencingToken } from "./LockError.js"
import { sqlStateOf } from "./internal/sql/state.js"
import { detachedWithin } from "./internal/runtime/stallSafe.js"
import { durationOption, MAX_TIMER } from "./internal/core/validate.js"
import { CATALOG_RACE, CREATE_ATTEMPTS, ensureTableSql, parseTable, type TableRef } from "./internal/sql/tables.js"

/**
 * The default table name.
 *
 * @since 0.1.0
 * @category constants
 */
export const DEFAULT_TABLE = "effect_lock_fences"

/**
 * Options of a fence.
 *
 * - `table`: `name` or `schema.name` (plain identifiers, used quoted, so case is kept); default
 *   `effect_lock_fences`.
 * - `createTable`: create the table on first use (default true); set false when your migrations
 *   run `migration` and the application's role may not create tables. A missing table is then a
 *   `LockBackendError`.
 * - `statementTimeout`: client-side bound on each statement a check sends (default 5 s), so a
 *   frozen server or a dropped connection fails the check with a `LockBackendError` instead of
 *   hanging it. It includes waiting for a concurrent writer of the same resource whose
 *   transaction holds the resource's row: raise it if your guarded transactions run longer.
 *
 * @since 0.1.0
 * @category models
 */
export interface Options {
  readonly table?: string | undefined
  readonly createTable?: boolean | undefined
  readonly statementTimeout?: Duration.DurationInput | undefined
}

/**
 * A fence over one table.
 *
 * @since 0.1.0
 * @category models
 */
export interface Service {
  /** The table, as given in the options. */
  readonly table: string
  /** The DDL of the table: idempotent, for your own migrations. */
  readonly migration: string
  /**
   * Accepts `token` for `resource` when it is at least the highest token accepted so far, and
   * records it; else fails `StaleFencingToken`. Runs on the caller's transaction, if any.
   */
  readonly check: (
    resource: string,
    token: FencingToken.FencingToken
  ) => Effect.Effect<void, StaleFencingToken | LockBackendError, SqlClient.SqlClient>
  /** Creates the table if it does not exist (in the caller's transaction, if any). */
  readonly ensureTable: Effect.Effect<void, LockBackendError, SqlClient.SqlClient>
}

/**
 * A fence as a service, for applications that configure its table once (see `layer`).
 *
 * @since 0.1.0
 * @category tags
 */
export class Fence extends Context.Tag("effect-lock/Fence")<Fence, Service>() {}

// --- the SqlClient tags, by key ------------------------------------------------------------------

// By key, not by import: an import of @effect/sql here would load it for every user of the root
// entry, memory-only apps included. Effect finds a service by its tag's key, so these are the same tags.
const SqlClientTag = Context.GenericTag<SqlClient.SqlClient>("@effect/sql/SqlClient")
const TransactionConnectionTag = Context.GenericTag<
  SqlClient.TransactionConnection,
  readonly [conn: unknown, depth: number]
>("@effect/sql/SqlClient/TransactionConnection")

// --- SQL ----------------------------------------------------------------------------------------

const UNDEFINED_TABLE = "42P01"
/** Default client-side bound on one statement of a check. */
const DEFAULT_STATEMENT_TIMEOUT = Duration.seconds(5)
const SAVEPOINT = "effect_lock_fence"
/** Transactions remembered per table as having created it, so their own success proves nothing. */
const MAX_REMEMBERED_CREATORS = 64
const DDL_LOCK_NAMESPACE = "effect-lock/Fence/ddl"

const createTableSql = (table: TableRef): string =>
  `create table if not exists ${table.sql} (
  resource text primary key,
  token bigint not null,
  updated_at timestamptz not null default now()
)`

/** Creation on first use; inside a transaction the DDL lock is held until it ends. */
const ensureSql = (table: TableRef): string => ensureTableSql(table, createTableSql(table), DDL_LOCK_NAMESPACE)

/** The check, one statement: $1 resource, $2 token. Returns a row only when the token was accepted. */
const acceptSql = (table: TableRef): string =>
  // Race-free in READ COMMITTED: ON CONFLICT DO UPDATE locks the conflicting row (waiting out a concurrent checker's transaction) and evaluates WHERE on its latest committed version, and the lock holds until our transaction ends.
  `insert into ${table.sql} as f (resource, token) values ($1::text, $2::bigint)
on conflict (resource) do update set token = excluded.token, updated_at = now()
  where f.token <= excluded.token
returning true as accepted`

/**
 * The token that refused a check. A second statement because the first one's snapshot may
 * predate the version its WHERE saw (a writer that committed while it waited); this one's fresh
 * snapshot sees it, and the row lock the refused upsert kept holds it there in a transaction.
 */
const currentSql = (table: TableRef): string => `select token::text as token from ${table.sql} where resource = $1::text`

// --- statements ---------------------------------------------------------------------------------

/** Sends one statement of the fence, bounded by `bound` ms. */
const run = <A extends object>(
  sql: SqlClient.SqlClient,
  bound: number,
  operation: string,
  name: string | undefined,
  text: string,
  params: ReadonlyArray<unknown> = []
): Effect.Effect<ReadonlyArray<A>, LockBackendError> => {
  const fail = (cause: unknown) => new LockBackendError({ operation, ...(name === undefined ? {} : { name }), cause })
  // Detached: a check inside a write the caller made uninterruptible is never cut short by the
  // caller's interruption, only by the bound; at the bound it fails at once, and sql-pg's cancel
  // of the statement (up to 5 s through the pool) goes on in the background.
  return Effect.flatMap(
    detachedWithin(sql.unsafe<A>(text, params).withoutTransform.pipe(Effect.mapError(fail)), Duration.millis(bound)),
    Option.match({
      onNone: () => Effect.fail(fail(new Error(`no answer from the database within ${bound} ms`))),
      onSome: Effect.succeed
    })
  )
}

const isUndefinedTable = (error: unknown): error is LockBackendError =>
  error instanceof LockBackendError && sqlStateOf(error) === UNDEFINED_TABLE
const isCatalogRace = (error: unknown): boolean => CATALOG_RACE.has(sqlStateOf(error) ?? "")

/**
 * Runs `body` under a savepoint of the caller's transaction: a failed statement in it leaves
 * their transaction usable (rolled back to the savepoint) instead of aborted.
 */
const inSavepoint = <A, E>(
  sql: SqlClient.SqlClient,
  bound: number,
  operation: string,
  name: string | undefined,
  body: Effect.Effect<A, E>
): Effect.Effect<A, E | LockBackendError> =>
  Effect.uninterruptibleMask((restore) =>
    Effect.zipRight(
      run(sql, bound, operation, name, `savepoint ${SAVEPOINT}`),
      Effect.flatMap(Effect.exit(restore(body)), (exit) =>
        Effect.zipRight(
          Exit.isSuccess(exit)
            ? run(sql, bound, operation, name, `release savepoint ${SAVEPOINT}`)
            : Effect.zipRight(
              run(sql, bound, operation, name, `rollback to savepoint ${SAVEPOINT}`),
              run(sql, bound, operation, name, `release savepoint ${SAVEPOINT}`)
            ),
          exit
        ))
    )
  )

// --- what this process knows about a table ------------------------------------------------------

interface TableState {
  /** The table was seen to exist, created by some other transaction: checks in transactions skip the savepoint. */
  known: boolean
  /** Top-level transaction ids that created the table themselves: their later checks prove nothing. */
  readonly creators: Set<string>
}

const states = new WeakMap<SqlClient.SqlClient, Map<string, TableState>>()

const stateOf = (sql: SqlClient.SqlClient, table: TableRef): TableState => {
  let tables = states.get(sql)
  if (tables === undefined) {
    tables = new Map()
    states.set(sql, tables)
  }
  let state = tables.get(table.text)
  if (state === undefined) {
    state = { known: false, creators: new Set() }
    tables.set(table.text, state)
  }
  return state
}

const markKnown = (state: TableState): void => {
  state.known = true
  state.creators.clear()
}

const rememberCreator = (state: TableState, xact: string): void => {
  if (state.creators.size >= MAX_REMEMBERED_CREATORS) {
    const oldest = state.creators.values().next()
    if (oldest.done !== true) state.creators.delete(oldest.value)
  }
  state.creators.add(xact)
}

// --- the fence ----------------------------------------------------------------------------------

const makeService = (table: TableRef, createTable: boolean, bound: number): Service => {
  const ensure = (
    sql: SqlClient.SqlClient,
    inTransaction: boolean,
    operation: string,
    name: string | undefined
  ): Effect.Effect<void, LockBackendError> => {
    const once = run(sql, bound, operation, name, ensureSql(table))
    // Inside a transaction every attempt gets a savepoint, so a lost race can be retried.
    return (inTransaction ? inSavepoint(sql, bound, operation, name, once) : once).pipe(
      Effect.retry({ times: CREATE_ATTEMPTS - 1, while: isCatalogRace }),
      Effect.asVoid
    )
  }

  const attempt = (
    sql: SqlClient.SqlClient,
    resource: string,
    token: FencingToken.FencingToken
  ): Effect.Effect<void, StaleFencingToken | LockBackendError> =>
    Effect.flatMap(
      run<{ accepted: boolean }>(sql, bound, "fence-check", resource, acceptSql(table), [resource, token.toString()]),
      (accepted) => accepted.length > 0 ? Effect.void : refuse(sql, resource, token)
    )

  const refuse = (
    sql: SqlClient.SqlClient,
    resource: string,
    presented: FencingToken.FencingToken
  ): Effect.Effect<never, StaleFencingToken | LockBackendError> =>
    Effect.flatMap(
      run<{ token: string }>(sql, bound, "fence-check", resource, currentSql(table), [resource]),
      ([row]) =>
        Effect.fail<StaleFencingToken | LockBackendError>(
          row === undefined
            ? new LockBackendError({
              operation: "fence-check",
              name: resource,
              cause: new Error(`the fence row of "${resource}" was deleted while it was checked`)
            })
            : new StaleFencingToken({ resource, presented, current: FencingToken.make(BigInt(row.token)) })
        )
    )

  /** The caller's top-level transaction id (the same in every savepoint of it). */
  const currentXact = (sql: SqlClient.SqlClient, resource: string) =>
    Effect.map(
      run<{ xact: string }>(sql, bound, "fence-check", resource, "select txid_current()::text as xact"),
      ([row]) => row?.xact ?? ""
    )

  /** Outside a transaction: one statement; a missing table is created and the check retried once. */
  const checkAutocommit = (sql: SqlClient.SqlClient, state: TableState, resource: string, token: FencingToken.FencingToken) =>
    attempt(sql, resource, token).pipe(
      Effect.catchIf(
        isUndefinedTable,
        () => Effect.zipRight(ensure(sql, false, "fence-check", resource), attempt(sql, resource, token))
      ),
      // Either outcome proves the table is committed (autocommit), whoever created it: checks in
      // transactions can skip the savepoint from now on.
      Effect.tap(() => Effect.sync(() => markKnown(state))),
      Effect.tapErrorTag("StaleFencingToken", () => Effect.sync(() => markKnown(state)))
    )

  /** In a transaction, before the table is known: the first try under a savepoint, so 42P01 is recoverable. */
  const checkFirstInTransaction = (
    sql: SqlClient.SqlClient,
    state: TableState,
    resource: string,
    token: FencingToken.FencingToken
  ) =>
    Effect.gen(function*() {
      const first = yield* Effect.either(inSavepoint(sql, bound, "fence-check", resource, attempt(sql, resource, token)))
      if (first._tag === "Right") {
        const xact = yield* currentXact(sql, resource)
        // A table this very transaction created may still roll back: only someone else's proves it is there.
        if (!state.creators.has(xact)) markKnown(state)
        return
      }
      if (!isUndefinedTable(first.left)) return yield* first.left
      yield* ensure(sql, true, "fence-check", resource)
      yield* attempt(sql, resource, token)
      rememberCreator(state, yield* currentXact(sql, resource))
    })

  const check = Effect.fn("effect-lock.fence.check")(function*(resource: string, token: FencingToken.FencingToken) {
    yield* Effect.annotateCurrentSpan({ "fence.resource": resource, "lock.token": token.toString(), "fence.table": table.text })
    const sql = yield* SqlClientTag
    const inTransaction = Option.isSome(yield* Effect.serviceOption(TransactionConnectionTag))
    const state = stateOf(sql, table)
    if (!inTransaction) {
      if (!createTable) return yield* attempt(sql, resource, token)
      return yield* checkAutocommit(sql, state, resource, token)
    }
    if (!createTable || state.known) {
      // The caller's transaction is aborted if the table was dropped since; the next check starts over.
      return yield* Effect.tapError(attempt(sql, resource, token), (error) =>
        Effect.sync(() => {
          if (isUndefinedTable(error)) state.known = false
        }))
    }
    return yield* checkFirstInTransaction(sql, state, resource, token)
  })

  const ensureTable = Effect.gen(function*() {
    const sql = yield* SqlClientTag
    const inTransaction = Option.isSome(yield* Effect.serviceOption(TransactionConnectionTag))
    yield* ensure(sql, inTransaction, "fence-ensure-table", undefined)
    if (!inTransaction) markKnown(stateOf(sql, table))
  }).pipe(Effect.withSpan("effect-lock.fence.ensure-table", { attributes: { "fence.table": table.text } }))

  return { table: table.text, migration: `${createTableSql(table)};\n`, check, ensureTable }
}

const defaultService = makeService(parseTable(DEFAULT_TABLE) as TableRef, true, Duration.toMillis(DEFAULT_STATEMENT_TIMEOUT))

/**
 * Builds a fence over a table of your choice. Fails with a `LockBackendError` (operation
 * `configure`) when the table name is not a plain identifier.
 *
 * @since 0.1.0
 * @category constructors
 */
export const make = (options?: Options): Effect.Effect<Service, LockBackendError> =>
  Effect.suspend(() => {
    const table = parseTable(options?.table ?? DEFAULT_TABLE)
    if (typeof table === "string") {
      return Effect.fail(new LockBackendError({ operation: "configure", cause: new Error(`Fence: ${table}`) }))
    }
    // The bound is a timer: past Node's longest one it would never fire, and the check could hang.
    const bound = durationOption("statementTimeout", options?.statementTimeout, DEFAULT_STATEMENT_TIMEOUT, { max: MAX_TIMER })
    if (Either.isLeft(bound)) {
      return Effect.fail(new LockBackendError({ operation: "configure", cause: new Error(`Fence: ${bound.left}`) }))
    }
    return Effect.succeed(makeService(table, options?.createTable ?? true, Duration.toMillis(bound.right)))
  })

/**
 * Provides `Fence` over the table of `options`.
 *
 * @since 0.1.0
 * @category layers
 */
export const layer = (options?: Options): Layer.Layer<Fence, LockBackendError> => Layer.effect(Fence, make(options))

/**
 * Accepts a write to `resource` under `token` when the token is at least the highest one the
 * resource has accepted, and records it; otherwise fails `StaleFencingToken` with the current
 * token. Run it in the transaction of the write it guards (`sql.withTransaction`): it is one
 * statement on that transaction's connection, so it commits or rolls back with the write, and it
 * holds the resource's row lock until then (a refused check too), so writers of one resource
 * commit in token order. Uses the default table, created on first use.
 *
 * @since 0.1.0
 * @category combinators
 */
export const check: (
  resource: string,
  token: FencingToken.FencingToken
) => Effect.Effect<void, StaleFencingToken | LockBackendError, SqlClient.SqlClient> = defaultService.check

/**
 * Creates the default table if it does not exist, for applications that prefer to create it at
 * startup rather than on the first check. In a transaction it is created in that transaction.
 *
 * @since 0.1.0
 * @category combinators
 */
export const ensureTable: Effect.Effect<void, LockBackendError, SqlClient.SqlClient> = defaultService.ensureTable

/**
 * The DDL of the default table (idempotent), for applications that run their own migrations.
 *
 * @since 0.1.0
 * @category migrations
 */
export const migration: string = defaultService.migration

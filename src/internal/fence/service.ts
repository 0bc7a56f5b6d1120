/**
 * The fence's statements: one upsert that accepts a token at least the highest accepted (and
 * records it) under the resource's row lock, the read that says which token is current when it
 * refuses, and the table's first-use creation — each bounded, run on the caller's `SqlClient` and
 * in its transaction if any (inside it in a savepoint, so a lost creation race can be retried).
 * `Fence.ts` is the public API over `makeService` here.
 */
import type * as SqlClient from "@effect/sql/SqlClient"
import * as Context from "effect/Context"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"
import * as FencingToken from "../../FencingToken.js"
import { LockBackendError, StaleFencingToken } from "../../LockError.js"
import { sqlStateOf } from "../sql/state.js"
import type pg from "pg"
import { checkoutOf, isSqlPgClient, isStillBusy, sendCancel, sqlPgClientOf } from "../pg/driver.js"
import { detachedWithin, within } from "../runtime/stallSafe.js"
import { resending } from "../sql/resend.js"
import { SqlClientTag, TransactionConnectionTag } from "../sql/tags.js"
import { CATALOG_RACE, CREATE_ATTEMPTS, ensureTableSql, type TableRef } from "../sql/tables.js"

/** A fence over one table (`Fence.Service`). */
export interface FenceService {
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


// --- SQL ----------------------------------------------------------------------------------------

const UNDEFINED_TABLE = "42P01"
/** Default client-side bound on one statement of a check. */
export const DEFAULT_STATEMENT_TIMEOUT = Duration.seconds(5)
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
  const statement = sql.unsafe<A>(text, params).withoutTransform.pipe(Effect.mapError(fail))
  return Effect.withFiberRuntime((fiber) => {
    const client = isSqlPgClient(sql)
      ? sqlPgClientOf(Option.getOrUndefined(Context.getOption(fiber.currentContext, TransactionConnectionTag))?.[0])
      : undefined
    // Detached: a check inside a write the caller made uninterruptible is never cut short by the
    // caller's interruption, only by the bound; at the bound it fails at once.
    const outcome = client === undefined
      // Outside a transaction (or on another SqlClient) the driver cancels the left-behind
      // statement; sql-pg hands the connection back only after that cancel has run.
      ? detachedWithin(statement, Duration.millis(bound))
      : inTransaction(client, statement, bound)
    return Effect.flatMap(
      outcome,
      Option.match({
        onNone: () => Effect.fail(fail(new Error(`no answer from the database within ${bound} ms`))),
        onSome: Effect.succeed
      })
    )
  })
}

/**
 * A statement in a transaction on @effect/sql-pg's client, bounded. sql-pg would cancel an
 * interrupted one with `pg_cancel_backend` through its pool, which waits for a free connection:
 * sent after the caller moved on, it lands on the transaction's *next* statement (a 57014 on the
 * caller's own work, or its COMMIT). So the statement is left uninterruptible, and a caller that
 * leaves it behind first stops it itself, with a protocol CancelRequest on a socket of its own
 * (no pool slot), and goes on only once the server has taken that cancel.
 */
const inTransaction = <A>(
  client: pg.Client,
  statement: Effect.Effect<A, LockBackendError>,
  bound: number
): Effect.Effect<Option.Option<A>, LockBackendError> => {
  const checkout = checkoutOf(client)
  // Only while our statement is still on the wire: once answered, the backend is idle or running
  // the caller's next statement, and a cancel then could only hit that.
  const abandon = Effect.suspend(() =>
    isStillBusy(client, checkout) ? Effect.asVoid(within(sendCancel(client), Duration.millis(bound))) : Effect.void
  )
  return detachedWithin(Effect.uninterruptible(statement), Duration.millis(bound), abandon)
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

export const makeService = (table: TableRef, createTable: boolean, bound: number): FenceService => {
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

  /** The accepting upsert; when it accepts nothing, the current token read for the refusal. */
  const attempt = (
    sql: SqlClient.SqlClient,
    resource: string,
    presented: FencingToken.FencingToken,
    // A resend gets what is left of the check's bound, not a new one.
    within: number = bound
  ): Effect.Effect<void, StaleFencingToken | LockBackendError> => {
    const statement = <A extends object>(text: string, params: ReadonlyArray<unknown>) =>
      run<A>(sql, within, "fence-check", resource, text, params)
    const refuse = Effect.flatMap(statement<{ token: string }>(currentSql(table), [resource]), ([row]) =>
      Effect.fail<StaleFencingToken | LockBackendError>(
        row === undefined
          ? new LockBackendError({
            operation: "fence-check",
            name: resource,
            cause: new Error(`the fence row of "${resource}" was deleted while it was checked`)
          })
          : new StaleFencingToken({ resource, presented, current: FencingToken.make(BigInt(row.token)) })
      ))
    return Effect.flatMap(
      statement<{ accepted: boolean }>(acceptSql(table), [resource, presented.toString()]),
      (accepted) => accepted.length > 0 ? Effect.void : refuse
    )
  }

  /** The caller's top-level transaction id (the same in every savepoint of it). */
  const currentXact = (sql: SqlClient.SqlClient, resource: string) =>
    Effect.map(
      run<{ xact: string }>(sql, bound, "fence-check", resource, "select txid_current()::text as xact"),
      ([row]) => row?.xact ?? ""
    )

  /** Outside a transaction: one statement; a missing table is created and the check retried once. */
  const checkAutocommit = (
    sql: SqlClient.SqlClient,
    state: TableState,
    resource: string,
    token: FencingToken.FencingToken,
    within: number = bound
  ) =>
    attempt(sql, resource, token, within).pipe(
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
      // Its own autocommit statements: one refused as a whole (a stricter default isolation's
      // 40001) rolled back and is sent again, within the check's bound.
      if (!createTable) return yield* resending(Duration.millis(bound), (left) => attempt(sql, resource, token, Duration.toMillis(left)))
      return yield* resending(Duration.millis(bound), (left) => checkAutocommit(sql, state, resource, token, Duration.toMillis(left)))
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


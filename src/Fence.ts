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
import * as Layer from "effect/Layer"
import * as FencingToken from "./FencingToken.js"
import { LockBackendError, StaleFencingToken } from "./LockError.js"
import { durationOption, MAX_TIMER } from "./internal/core/validate.js"
import { DEFAULT_STATEMENT_TIMEOUT, makeService } from "./internal/fence/service.js"
import type * as Internal from "./internal/fence/service.js"
import { parseTable, type TableRef } from "./internal/sql/tables.js"

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
export interface Service extends Internal.FenceService {}

/**
 * A fence as a service, for applications that configure its table once (see `layer`).
 *
 * @since 0.1.0
 * @category tags
 */
export class Fence extends Context.Tag("effect-lock/Fence")<Fence, Service>() {}

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

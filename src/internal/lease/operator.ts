/**
 * The operator and inspection functions of a lease store, one implementation for PgLease and
 * SqliteLease: `holders`, `listHolders`, `revoke`, `semaphores` and `revokePermits` run the
 * store's typed operator statements (`Dialect.operator`) as ordinary statements of the caller's
 * `SqlClient` — inside its transaction if it has one — and fail with `LockBackendError` naming
 * the operation.
 */
import type { SqlClient } from "@effect/sql/SqlClient"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { LockBackendError } from "../../LockError.js"
import { resending } from "../sql/resend.js"
import { SqlClientTag, TransactionConnectionTag } from "../sql/tags.js"
import type { LeaseTables, OperatorStatements, Row, Statement } from "./dialect.js"
import type { StoredLease } from "./stored.js"

export type { StoredLease, StoredPermitHolder, StoredSemaphore } from "./stored.js"


/** What the operator functions need of a store. */
export interface Store<T extends LeaseTables> {
  /** Short name in the `inspect` span (`pg-lease`, `sqlite-lease`). */
  readonly backend: string
  readonly resolveTables: (table: string | undefined) => Effect.Effect<T, LockBackendError>
  /** The statements on `tables`; a store that notifies does so on `channel`. */
  readonly statements: (tables: T, channel: string) => OperatorStatements
}

export interface TableOptions {
  readonly table?: string | undefined
}

export interface NameOptions extends TableOptions {
  readonly name?: string | undefined
}

export interface RevokeOptions extends TableOptions {
  /** The NOTIFY channel (stores that notify); default the lease table's own name. */
  readonly channel?: string | undefined
}

/** How long an operator statement outside a transaction is resent for while the server refuses it as a whole. */
const OPERATOR_RESEND_BOUND = Duration.seconds(5)

/**
 * `statement` with `input` on the caller's `SqlClient`; a failure names the operation and `name`.
 * Outside a transaction, a statement refused as a whole (a stricter default isolation's 40001) is
 * sent again; inside the caller's, the refusal aborted it, and only the caller can retry.
 */
const run = <I, O>(statement: Statement<I, O>, input: I, name: string | undefined) =>
  Effect.flatMap(SqlClientTag, (sql) => {
    const once = sql.unsafe<Row>(statement.text, statement.encode(input)).withoutTransform.pipe(
      Effect.map(statement.decode),
      Effect.mapError((cause) => new LockBackendError({ operation: statement.operation, ...(name === undefined ? {} : { name }), cause }))
    )
    return Effect.flatMap(Effect.serviceOption(TransactionConnectionTag), (transaction) =>
      Option.isSome(transaction) ? once : resending(OPERATOR_RESEND_BOUND, () => once))
  })

/** `use` with the store's statements on the tables `options` names. */
const onTables = <T extends LeaseTables, A>(
  store: Store<T>,
  options: RevokeOptions | undefined,
  use: (statements: OperatorStatements) => Effect.Effect<A, LockBackendError, SqlClient>
): Effect.Effect<A, LockBackendError, SqlClient> =>
  Effect.flatMap(store.resolveTables(options?.table), (tables) =>
    use(store.statements(tables, options?.channel ?? tables.leases.relname)))

/** A listing of every name, or of `options.name`. */
const listing = <O>(pick: (statements: OperatorStatements) => Statement<{ readonly name: string | null }, O>) =>
<T extends LeaseTables>(store: Store<T>, options: NameOptions | undefined): Effect.Effect<O, LockBackendError, SqlClient> =>
  onTables(store, options, (statements) => run(pick(statements), { name: options?.name ?? null }, options?.name))

/** An operator's change to one name: whether there was something to change. */
const change = (pick: (statements: OperatorStatements) => Statement<{ readonly name: string }, boolean>) =>
<T extends LeaseTables>(store: Store<T>, name: string, options: RevokeOptions | undefined): Effect.Effect<boolean, LockBackendError, SqlClient> =>
  onTables(store, options, (statements) => run(pick(statements), { name }, name))

export const holders = listing((statements) => statements.holders)

export const semaphores = listing((statements) => statements.semaphores)

export const revoke = change((statements) => statements.revoke)

export const revokePermits = change((statements) => statements.revokePermits)

/**
 * `holders` for inspection tools: no lease while the tables do not exist yet, and a failure of
 * the listing reported as `inspect`, the operation asked for.
 */
export const listHolders = <T extends LeaseTables>(
  store: Store<T>,
  options: NameOptions | undefined
): Effect.Effect<ReadonlyArray<StoredLease>, LockBackendError, SqlClient> =>
  onTables(store, options, (statements) =>
    Effect.flatMap(run(statements.present, undefined, options?.name), (present) =>
      present
        ? Effect.mapError(holders(store, options), (error) =>
          error.operation === "holders"
            ? new LockBackendError({ operation: "inspect", ...(options?.name === undefined ? {} : { name: options.name }), cause: error.cause })
            : error)
        : Effect.succeed([]))).pipe(Effect.withSpan("effect-lock.inspect", { attributes: { backend: store.backend } }))

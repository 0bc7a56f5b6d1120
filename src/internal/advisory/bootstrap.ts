/**
 * What a layer checks before it serves: session affinity (the behavioural probe, for sessions
 * that reach the server through a pooler) and the fencing table. Every step is bounded.
 */
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import type pg from "pg"
import { LockBackendError, UnsafeConnectionPooling } from "../../LockError.js"
import * as driver from "../pg/driver.js"
import { advisoryKey } from "../core/lockKey.js"
import { CATALOG_RACE, CREATE_ATTEMPTS, ensureTableSql, type TableRef } from "../sql/tables.js"
import * as Tokens from "../sql/tokens.js"
import { within, withinOrFail } from "../runtime/stallSafe.js"
import type { Engine, Settled } from "./state.js"

/** How long the affinity probe waits for a statement before concluding it queued behind another client. */
const PROBE_WAIT_MS = 1_000
/** Serializes creation of the fencing table across processes (a transaction advisory lock). */
const DDL_NAMESPACE = "effect-lock/PgAdvisory/ddl"

const unsafe = (problem: string) =>
  new UnsafeConnectionPooling({
    detail: `${problem}: the connection has no session affinity (PgBouncer pool_mode=transaction or ` +
      "statement?), so a session advisory lock would attach to other clients' sessions. Point PgAdvisory " +
      "at PostgreSQL directly or at a pooler in session mode; behind transaction pooling use " +
      "PgAdvisory.withXactLock or PgLease instead."
  })

const probeError = (cause: unknown) => new LockBackendError({ operation: "connect", cause })

/** Statements the session sends after the other clients' transactions ended (a round-robin pooler hops among them). */
const PROBE_AFTER = 3

/**
 * Session affinity check for a session that reaches its backend through a pooler (its announced
 * pid is not its backend's), behavioural and independent of which server connection the pooler
 * hands out:
 *
 * 1. two other clients open a transaction each and keep it open (each pins a server connection);
 *    the session reads its backend pid. A transaction-mode pooler has to give the session another
 *    server connection (the pid changes), make it wait for one (no answer in time), or has
 *    already given one of the others the session's own backend (equal pids);
 * 2. the others commit; the session reads its pid a few more times. A pooler that hands out
 *    server connections in turn (`server_round_robin`) moves it among the now idle ones.
 *
 * On a real session (or PgBouncer session mode) the pid never changes and differs from the
 * others'. The session keeps proving it afterwards: every statement's answer must come from `pid`.
 */
export const probeAffinity = (
  engine: Engine,
  session: pg.Client,
  pid: number
): Effect.Effect<void, UnsafeConnectionPooling | LockBackendError> => {
  const bound = engine.options.connect.connectTimeoutMillis
  const pidOf = (client: pg.Client) =>
    withinOrFail(
      Effect.mapError(driver.query(client, "select pg_backend_pid() as pid"), (failure) => failure.error),
      bound,
      () => new Error(`the affinity probe got no answer within ${bound} ms`)
    ).pipe(Effect.map((result) => Number(result.rows[0]?.pid)))
  const run = (client: pg.Client, text: string) =>
    withinOrFail(
      Effect.mapError(driver.query(client, text), (failure) => failure.error),
      bound,
      () => new Error(`the affinity probe's ${text} got no answer within ${bound} ms`)
    )
  const other = Effect.acquireRelease(
    withinOrFail(
      driver.connect(engine.driver, engine.clientConfig, { onClosed: () => {} }),
      bound,
      () => new Error(`connecting the affinity probe got no answer within ${bound} ms`)
    ),
    (client) => Effect.sync(() => driver.destroy(client))
  )
  return Effect.gen(function*() {
    const others = [yield* other, yield* other]
    yield* Effect.forEach(others, (client) => run(client, "begin"), { discard: true })
    const otherPids = yield* Effect.forEach(others, pidOf)
    const during = yield* Effect.fork(pidOf(session))
    const answered = yield* within(Effect.flatten(during.await), PROBE_WAIT_MS)
    yield* Effect.forEach(others, (client) => run(client, "commit"), { discard: true })
    const duringPid = yield* Effect.flatten(during.await)
    if (Option.isNone(answered)) {
      return yield* unsafe(
        `a statement on one connection waited for other clients' transactions to end (backend pid ${pid} then ${duringPid})`
      )
    }
    if (duringPid !== pid) {
      return yield* unsafe(
        `the backend pid of one connection changed from ${pid} to ${duringPid} while other clients held transactions open`
      )
    }
    if (otherPids.includes(pid)) return yield* unsafe(`two connections were served by the same backend (pid ${pid})`)
    for (let i = 0; i < PROBE_AFTER; i++) {
      const after = yield* pidOf(session)
      if (after !== pid) {
        return yield* unsafe(`the backend pid of one connection changed from ${pid} to ${after} between two statements`)
      }
    }
  }).pipe(
    Effect.scoped,
    Effect.mapError((error) => error instanceof UnsafeConnectionPooling ? error : probeError(error))
  )
}

/**
 * The fencing-token table: one row per key in use, its last token (drawn from the database's token
 * sequence in each grant's statement; the row of an idle lock name is swept). Semaphores keep
 * their limit and their waiter queue beside their counter (`permit_limit`, `permit_queue`; null on
 * lock rows, and `permit_queue` on a semaphore nobody waits for), and the base of their limit
 * markers' keys (`marker_base`: null on lock rows), which tells the sweep whether anyone holds or
 * waits for the semaphore.
 */
export const fencingTableSql = (table: TableRef): string =>
  `CREATE TABLE IF NOT EXISTS ${table.sql} (key bigint PRIMARY KEY, name text NOT NULL, token bigint NOT NULL, ` +
  `permit_limit integer, permit_queue jsonb, marker_base bigint)`

/** The token sequence the fencing table draws from, with the table's guard (`sql/tokens`). */
export const fencingTokensSql = (table: TableRef): string =>
  Tokens.ensureTokens(Tokens.tokenSequence(table), [{ table, kind: "fencing" }])

/** Adds the semaphores' columns to a fencing table made before semaphores, or before their queue (idempotent). */
export const permitColumnsSql = (table: TableRef): string =>
  `ALTER TABLE ${table.sql} ADD COLUMN IF NOT EXISTS permit_limit integer, ADD COLUMN IF NOT EXISTS permit_queue jsonb, ` +
  `ADD COLUMN IF NOT EXISTS marker_base bigint`

/** Whether the fencing table has the three semaphore columns. Parameters: $1 the table's quoted name. */
const PERMIT_COLUMN_SQL = "select (select count(*) from pg_attribute where attrelid = to_regclass($1) " +
  "and attname in ('permit_limit', 'permit_queue', 'marker_base') and not attisdropped) = 3 as present, pg_backend_pid() as pid"

type Run = (text: string, values?: ReadonlyArray<unknown>) => Effect.Effect<Settled>

/**
 * Creates the fencing-token table if it is missing, in one bounded statement under a DDL lock
 * (see `ensureTableSql`), retried when it loses the catalog race to a creator that takes no lock.
 * A table that exists is never touched, so no CREATE right is needed then. With `createTables:
 * false` it only checks that the table is there.
 *
 * Then the semaphores' columns: added to a table from before semaphores (under the same DDL lock)
 * when tables may be created. Its absence never fails the layer — locks need no such column — but
 * is returned as the reason semaphores cannot be used (`undefined` when they can).
 */
export const ensureFencingTable = (
  engine: Engine,
  statement: Run
): Effect.Effect<string | undefined, LockBackendError> =>
  Effect.gen(function*() {
    const table = engine.options.fencingTable
    const fail = (cause: unknown) => new LockBackendError({ operation: "create fencing table", cause })
    if (!engine.options.createTables) {
      const found = yield* statement(
        "select to_regclass($1) is not null and to_regclass($2) is not null as present, pg_backend_pid() as pid",
        [table.sql, Tokens.tokenSequence(table).sql]
      )
      if (found._tag !== "Ok" || found.rows[0]?.present !== true) {
        return yield* fail(
          found._tag === "Ok"
            ? new Error(
              `the fencing table ${table.text} or its token sequence does not exist; create them with PgAdvisory.migration()`
            )
            : found
        )
      }
    } else {
      const text = ensureTableSql(table, fencingTableSql(table), DDL_NAMESPACE)
      for (let attempt = 1;; attempt++) {
        const settled = yield* statement(text)
        if (settled._tag === "Ok") break
        const code = settled._tag === "Failed" && settled.failure._tag === "Sql" ? settled.failure.code : undefined
        if (attempt >= CREATE_ATTEMPTS || code === undefined || !CATALOG_RACE.has(code)) {
          return yield* fail(settled._tag === "Failed" ? settled.failure.error : new Error(`fencing table: ${settled._tag}`))
        }
      }
      // The token sequence and the table's guard (`sql/tokens`): a catalog lookup once installed.
      const tokens = yield* statement(fencingTokensSql(table))
      if (tokens._tag !== "Ok") {
        return yield* fail(tokens._tag === "Failed" ? tokens.failure.error : new Error(`token sequence: ${tokens._tag}`))
      }
    }
    return yield* ensurePermitColumns(engine, statement)
  })

const ensurePermitColumns = (engine: Engine, statement: Run): Effect.Effect<string | undefined> =>
  Effect.gen(function*() {
    const table = engine.options.fencingTable
    const found = yield* statement(PERMIT_COLUMN_SQL, [table.sql])
    if (found._tag === "Ok" && found.rows[0]?.present === true) return undefined
    const missing = `the fencing table ${table.text} lacks the permit_limit, permit_queue or marker_base column (it was made before ` +
      `semaphores or their queue); add them with the statements of PgAdvisory.migration()`
    if (!engine.options.createTables) return missing
    // ADD COLUMN IF NOT EXISTS is idempotent; the DDL lock keeps concurrent layers from racing on the catalog.
    const added = yield* statement(
      `do $effect_lock$ begin perform pg_advisory_xact_lock(${advisoryKey(table.text, DDL_NAMESPACE)}); ` +
        `${permitColumnsSql(table)}; end $effect_lock$`
    )
    return added._tag === "Ok" ? undefined : `${missing}: ${added._tag === "Failed" ? String(added.failure.error) : added._tag}`
  })

/**
 * SqliteLease's dialect of the lease engine: the statements of `sqlite/sql` (locks, operators)
 * and `sqlite/permitSql` (semaphores), typed, with the engine's parameters encoded as
 * better-sqlite3 binds them. SQLite has no notifications: a release answers the waiters it found
 * at the head, and this process wakes its own (`sqlite/wake`); the others poll.
 */
import { decode, ddl, type Dialect, type OperatorStatements, params, type Row } from "../dialect.js"
import * as PermitSql from "./permitSql.js"
import * as Sql from "./sql.js"

/**
 * Parameters as better-sqlite3 binds them: numbered `?1 …` placeholders take ONE object keyed by
 * number (an array would be refused as "too many parameters"); booleans become 0/1 and arrays
 * JSON text (SQLite has neither). sql-sqlite-node hands the parameters to the driver as they are,
 * so the object travels as the statement's single parameter.
 */
export const encode = (list: ReadonlyArray<unknown>): ReadonlyArray<unknown> => {
  if (list.length === 0) return []
  const named: Record<string, unknown> = {}
  list.forEach((param, i) => {
    named[String(i + 1)] = typeof param === "boolean" ? (param ? 1 : 0) : Array.isArray(param) ? JSON.stringify(param) : param
  })
  return [named]
}

/** The waiter ids of a release's answer (`woken`: a JSON array of the heads). */
export const headsOf = (rows: ReadonlyArray<Row>): ReadonlyArray<string> => {
  const woken = rows[0]?.["woken"]
  if (typeof woken !== "string" || woken === "[]") return []
  const parsed: unknown = JSON.parse(woken)
  return Array.isArray(parsed) ? parsed.filter((id): id is string => typeof id === "string") : []
}

/** `list` (the engine's positional parameters of `I`) encoded for better-sqlite3. */
const numbered = <I>(list: (input: I) => ReadonlyArray<unknown>) => (input: I) => encode(list(input))

/** The operator statements of the tables `tables`. */
export const operator = (tables: Sql.Tables): OperatorStatements => ({
  holders: { operation: "holders", text: Sql.holders(tables), encode: numbered(params.named), decode: decode.holders },
  present: { operation: "inspect", text: Sql.present(tables), encode: params.none, decode: decode.present },
  revoke: { operation: "revoke", text: Sql.revoke(tables), encode: numbered(params.named), decode: decode.revoked },
  semaphores: { operation: "semaphores", text: PermitSql.semaphores(tables), encode: numbered(params.named), decode: decode.semaphores },
  revokePermits: { operation: "revoke", text: PermitSql.revoke(tables), encode: numbered(params.named), decode: decode.revoked }
})

/** The statements of the tables `tables` (no channel: SQLite cannot notify). */
export const dialect = (tables: Sql.Tables): Dialect => {
  // The release answers the waiters now at the head; this process wakes its own.
  const release = (text: string) => ({ operation: "release", text, encode: numbered(params.release), decode: decode.release(headsOf) })
  const renew = (text: string) => ({ operation: "renew", text, encode: numbered(params.renew), decode: decode.renew })
  const sweep = (text: string) => ({ operation: "sweep", text, encode: numbered(params.sweep), decode: decode.swept })
  return {
    backend: "sqlite-lease",
    locks: {
      acquire: { operation: "acquire", text: Sql.acquire(tables), encode: numbered(params.lockAcquire), decode: decode.lockAcquire },
      release: release(Sql.release(tables)),
      renew: renew(Sql.renew(tables)),
      ensureTable: ddl(Sql.createTable(tables), encode),
      sweep: sweep(Sql.sweep(tables))
    },
    permits: {
      acquire: { operation: "acquire", text: PermitSql.acquire(tables), encode: numbered(params.permitAcquire), decode: decode.permitAcquire },
      release: release(PermitSql.release(tables)),
      renew: renew(PermitSql.renew(tables)),
      // Created with the lock tables (`Sql.createTable`).
      ensureTable: [],
      sweep: sweep(PermitSql.sweep(tables))
    },
    operator: operator(tables),
    now: { operation: "now", text: "select unixepoch('subsec') * 1000.0 as now", encode: params.none, decode: decode.now },
    // Creation statements serialize on the write lock and are idempotent; the lane retries a busy database.
    retryCreate: () => false
  }
}

/**
 * PgLease's dialect of the lease engine: the statements of `pg/sql` (locks, operators) and
 * `pg/permitSql` (semaphores), typed, with node-postgres binding the engine's parameters as they
 * are (arrays included). Releases and revokes notify the waiters to wake from their own
 * statement (on `channel`), so the releasing process hears them through LISTEN like every other;
 * a failed first-use creation is retried when it lost a catalog race.
 */
import { sqlStateOf } from "../../sql/state.js"
import { CATALOG_RACE } from "../../sql/tables.js"
import { decode, ddl, type Dialect, type OperatorStatements, params, type Statement } from "../dialect.js"
import * as PermitSql from "./permitSql.js"
import * as Sql from "./sql.js"

const asIs = (list: ReadonlyArray<unknown>) => list

/** The operator statements of the tables `tables`: a revoke notifies on `channel`. */
export const operator = (tables: Sql.Tables, channel: string): OperatorStatements => ({
  holders: { operation: "holders", text: Sql.holders(tables), encode: params.named, decode: decode.holders },
  present: { operation: "inspect", text: Sql.present, encode: () => [tables.leases.sql, tables.queue.sql], decode: decode.present },
  // A revoke wakes every waiter of the lock, by its name.
  revoke: {
    operation: "revoke",
    text: Sql.revoke(tables),
    encode: ({ name }) => [name, channel, Sql.RELEASED_PREFIX + name],
    decode: decode.revoked
  },
  semaphores: { operation: "semaphores", text: PermitSql.semaphores(tables), encode: params.named, decode: decode.semaphores },
  revokePermits: { operation: "revoke", text: PermitSql.revoke(tables), encode: ({ name }) => [name, channel], decode: decode.revoked }
})

/** The statements of the tables `tables`, notifying on `channel`. */
export const dialect = (tables: Sql.Tables, channel: string): Dialect => {
  // The release statement notifies the heads itself; they hear it through LISTEN, this process too.
  const release = (text: string) => ({
    operation: "release",
    text,
    encode: (i: Parameters<typeof params.release>[0]) => [...params.release(i), channel],
    decode: decode.release(() => [])
  })
  return {
    backend: "pg-lease",
    locks: {
      acquire: { operation: "acquire", text: Sql.acquire(tables), encode: params.lockAcquire, decode: decode.lockAcquire },
      release: release(Sql.release(tables)),
      renew: { operation: "renew", text: Sql.renew(tables), encode: params.renew, decode: decode.renew },
      ensureTable: ddl([Sql.ensureTable(tables), Sql.ensureLockTokens(tables)], asIs),
      sweep: { operation: "sweep", text: Sql.sweep(tables), encode: params.sweep, decode: decode.swept }
    },
    permits: {
      acquire: { operation: "acquire", text: PermitSql.acquire(tables), encode: params.permitAcquire, decode: decode.permitAcquire },
      release: release(PermitSql.release(tables)),
      renew: { operation: "renew", text: PermitSql.renew(tables), encode: params.renew, decode: decode.renew },
      ensureTable: ddl([Sql.ensureSemTable(tables), Sql.ensureSemTokens(tables)], asIs),
      sweep: { operation: "sweep", text: PermitSql.sweep(tables), encode: params.sweep, decode: decode.swept }
    },
    operator: operator(tables, channel),
    // clock_timestamp(), not now(): the time of the read, not of a transaction's start.
    now: { operation: "now", text: "select (extract(epoch from clock_timestamp()) * 1000)::float8 as now", encode: params.none, decode: decode.now },
    retryCreate: (error) => CATALOG_RACE.has(sqlStateOf(error) ?? "")
  }
}

/** A wake-up sent through the lock lane, to check that the LISTEN connection still hears. */
export const ping: Statement<{ readonly channel: string; readonly payload: string }, void> = {
  operation: "notify",
  text: Sql.ping,
  encode: ({ channel, payload }) => [channel, payload],
  decode: decode.nothing
}

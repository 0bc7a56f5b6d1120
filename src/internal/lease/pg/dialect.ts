/**
 * PgLease's dialect of the lease engine: the statements of `pg/sql` (locks, operators) and
 * `pg/permitSql` (semaphores), typed, with node-postgres binding the engine's parameters as they
 * are (arrays included). Releases and revokes notify the waiters to wake from their own
 * statement (on `channel`), so the releasing process hears them through LISTEN like every other;
 * a failed first-use creation is retried when it lost a catalog race.
 */
import { sqlStateOf } from "../../sql/state.js"
import { CATALOG_RACE } from "../../sql/tables.js"
import { type BatchSpec, decode, ddl, type Dialect, type OperatorStatements, params, type Row, type Statement } from "../dialect.js"
import * as PermitSql from "./permitSql.js"
import * as Sql from "./sql.js"

const asIs = (list: ReadonlyArray<unknown>) => list

/**
 * Exclusive first attempts of different names that wait for a lock connection together go out as
 * one `acquireBatch` (`params.lockAcquire`'s positions: 0 name, 1 owner, 2 waiter, 3 mode, 4 ttl,
 * 6 application, 7 host, 8 pid). A member the batch did not grant sends its own `acquire`.
 */
const acquireBatch = (tables: Sql.Tables): BatchSpec => ({
  // Only exclusive requests; the name, which the rows of one batch are keyed on.
  key: (p) => (p[3] === "exclusive" ? p[0] as string : undefined),
  text: Sql.acquireBatch(tables),
  max: Sql.BATCH_MAX,
  encode: (members) => [0, 1, 2, 4, 6, 7, 8].map((at) => members.map((p) => p[at])),
  // Only a grant is decided; the others send their own statement.
  split: (rows, members) => byIndex(rows.filter((row) => row["token"] !== null && row["token"] !== undefined), members)
})

/**
 * Give-backs of exclusive leases (an owner, no waiter: `params.release`'s 0 name, 1 owner, 2
 * waiter, 3 channel) go out as one `releaseBatch`: those of different names that wait for a lock
 * connection together, and one alone as well (`alone`: cheaper at the server than `release`,
 * which it falls back to). One it did not make sends its own `release`.
 */
const releaseBatch = (tables: Sql.Tables, tidy: boolean): BatchSpec => ({
  key: (p) => (p[1] !== null && p[2] === null ? p[0] as string : undefined),
  text: Sql.releaseBatch(tables, tidy),
  max: Sql.BATCH_MAX,
  alone: true,
  encode: (members) => [members.map((p) => p[0]), members.map((p) => p[1]), members[0]![3]],
  split: byIndex
})

/** Each member's row of a batch's answer (`idx`, 1-based); none for a member the batch did not decide. */
const byIndex = (rows: ReadonlyArray<Row>, members: number): ReadonlyArray<ReadonlyArray<Row> | undefined> => {
  const own: Array<ReadonlyArray<Row> | undefined> = new Array(members).fill(undefined)
  for (const row of rows) own[Number(row["idx"]) - 1] = [row]
  return own
}

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

/** The statements of the tables `tables`, notifying on `channel`; `sweeping`: the layer's sweep is on. */
export const dialect = (tables: Sql.Tables, channel: string, { sweeping = true }: { readonly sweeping?: boolean } = {}): Dialect => {
  // The release statement notifies the heads itself; they hear it through LISTEN, this process too.
  const release = (text: string, crowdAt?: number) => ({
    operation: "release",
    text,
    encode: (i: Parameters<typeof params.release>[0]) => [...params.release(i), channel],
    decode: decode.release(() => [], crowdAt)
  })
  return {
    backend: "pg-lease",
    locks: {
      acquire: { operation: "acquire", text: Sql.acquire(tables), encode: params.lockAcquire, decode: decode.lockAcquire, batch: acquireBatch(tables) },
      // Without a sweep, the batch give-back removes long-dead places in passing, as release does.
      release: { ...release(Sql.release(tables), Sql.WOKEN_CROWD), batch: releaseBatch(tables, !sweeping) },
      wakeSharedHeads: {
        operation: "wake",
        text: Sql.wakeSharedHeads(tables),
        encode: ({ name }) => [name, channel],
        decode: decode.nothing
      },
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

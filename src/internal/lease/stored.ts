/**
 * What a lease store holds, as operators and inspection tools see it: the live leases
 * (`StoredLease`) and semaphores in use (`StoredSemaphore`) of PgLease and SqliteLease alike, and
 * how the rows of their `holders` and `semaphores` statements (the same columns on both
 * databases) become them.
 */
import * as FencingToken from "../../FencingToken.js"
import type { LockMode } from "../../Lease.js"

/** A live lease as stored in a lease table. */
export interface StoredLease {
  readonly name: string
  /** `exclusive`, or `shared` (then the name may have several holders, each listed). */
  readonly mode: LockMode
  readonly token: FencingToken.FencingToken
  /** The store's time (ms since epoch) when the lease runs out unless renewed. */
  readonly expiresAt: number
  readonly acquiredAt: number
  readonly application: string | null
  readonly host: string | null
  readonly pid: number | null
  /** The store's time (ms since epoch) since when the oldest live waiter has been waiting for it, if anyone. */
  readonly waitingSince: number | null
}

/** One holder of a semaphore: its permits, one fencing token per permit, its times (store ms since the epoch), who. */
export interface StoredPermitHolder {
  readonly permits: number
  readonly tokens: ReadonlyArray<FencingToken.FencingToken>
  readonly expiresAt: number
  readonly acquiredAt: number
  readonly application: string | null
  readonly host: string | null
  readonly pid: number | null
}

/** A semaphore in use as stored in a semaphore table: its limit, live holders, and live waiters in queue order. */
export interface StoredSemaphore {
  readonly name: string
  readonly limit: number
  readonly holders: ReadonlyArray<StoredPermitHolder>
  readonly waiting: ReadonlyArray<{ readonly permits: number; readonly since: number }>
}

type Entry = Readonly<Record<string, unknown>>

/** Numbers may arrive as bigints (SQLite's safe integers) or strings (PostgreSQL's bigint). */
const numberOrNull = (value: unknown): number | null => (value === null || value === undefined ? null : Number(value))

const textOrNull = (value: unknown): string | null => (typeof value === "string" ? value : null)

/** A row of a `holders` statement. */
export const storedLease = (row: Entry): StoredLease => ({
  name: row["name"] as string,
  mode: row["mode"] as LockMode,
  token: FencingToken.make(BigInt(row["token"] as string)),
  expiresAt: Number(row["expires"]),
  acquiredAt: Number(row["acquired"]),
  application: row["application"] as string | null,
  host: row["host"] as string | null,
  pid: numberOrNull(row["pid"]),
  waitingSince: numberOrNull(row["waiting"])
})

/** An array column of entries: jsonb (PostgreSQL) or JSON text (SQLite). */
const entries = (value: unknown): ReadonlyArray<Entry> => (typeof value === "string" ? JSON.parse(value) : value) as ReadonlyArray<Entry>

const permitHolder = (holder: Entry): StoredPermitHolder => {
  const permits = Number(holder["permits"])
  const first = BigInt(String(holder["token"]))
  return {
    permits,
    tokens: Array.from({ length: permits }, (_, i) => FencingToken.make(first + BigInt(i))),
    expiresAt: Number(holder["expires"]),
    acquiredAt: Number(holder["acquired"]),
    application: textOrNull(holder["application"]),
    host: textOrNull(holder["host"]),
    pid: numberOrNull(holder["pid"])
  }
}

/** A row of a `semaphores` statement. */
export const storedSemaphore = (row: Entry): StoredSemaphore => ({
  name: row["name"] as string,
  limit: Number(row["lim"]),
  holders: entries(row["holders"]).map(permitHolder),
  waiting: entries(row["waiters"]).map((waiter) => ({ permits: Number(waiter["permits"]), since: Number(waiter["since"]) }))
})

/**
 * Reading advisory locks back out of PostgreSQL: the `pg_locks` ⋈ `pg_stat_activity` query,
 * the 64-bit key reconstruction, and mapping keys back to names.
 */
import type { LockMode } from "../../Lease.js"

const TWO_32 = 1n << 32n

/**
 * The signed 64-bit key of a bigint advisory lock from its `pg_locks` row. PostgreSQL splits
 * the key into `classid` (high 32 bits) and `objid` (low 32 bits), both shown as unsigned `oid`s
 * (`objsubid = 1`), so a negative key has a `classid` of 2^31 or more.
 */
export const keyFromLockTag = (classid: bigint, objid: bigint): bigint => {
  if (classid < 0n || classid >= TWO_32 || objid < 0n || objid >= TWO_32) {
    throw new RangeError(`classid ${classid} and objid ${objid} must be unsigned 32-bit values`)
  }
  return BigInt.asIntN(64, (classid << 32n) | objid)
}

/** The `pg_locks` (`classid`, `objid`) pair of a key: the inverse of `keyFromLockTag`. */
export const lockTagOfKey = (key: bigint): { readonly classid: bigint; readonly objid: bigint } => {
  const unsigned = BigInt.asUintN(64, key)
  return { classid: unsigned >> 32n, objid: unsigned & (TWO_32 - 1n) }
}

/** `pg_locks.mode` of an advisory lock; anything else is not one of ours to name. */
export const modeOf = (pgMode: string): LockMode | undefined =>
  pgMode === "ExclusiveLock" ? "exclusive" : pgMode === "ShareLock" ? "shared" : undefined


/**
 * Advisory locks on 64-bit keys (`objsubid = 1`; two-int4 keys are not effect-lock's) in the
 * current database, granted or awaited, with their sessions. Columns are single lowercase words
 * so that a client's result-name transform cannot rename them.
 *
 * `waitstart` (PostgreSQL 14+) is read through `to_jsonb` so the statement also runs on older
 * servers. Other users' `pg_stat_activity` details are null without `pg_read_all_stats`.
 * `fencing` is the fencing table's quoted name when it exists and may be read, else null.
 *
 * Parameters: $1 the fencing table's quoted name (`TableRef.sql`).
 */
export const listSql = `select l.classid::int8::text as classid, l.objid::int8::text as objid,
  l.mode, l.granted, l.pid,
  a.application_name as application, host(a.client_addr) as client, a.usename as username,
  a.state, a.wait_event_type as waittype, a.wait_event as waitevent,
  (extract(epoch from a.backend_start) * 1000)::float8 as sessionstart,
  (extract(epoch from coalesce((to_jsonb(l) ->> 'waitstart')::timestamptz, a.query_start)) * 1000)::float8 as waitstart,
  (select case when r is not null and has_table_privilege(r, 'select') then r::text end
    from to_regclass($1::text) as r) as fencing
from pg_locks l
left join pg_stat_activity a on a.pid = l.pid
where l.locktype = 'advisory' and l.objsubid = 1
  and l.database = (select oid from pg_database where datname = current_database())`

/** One row of `listSql`. */
export interface LockRow {
  readonly classid: string
  readonly objid: string
  readonly mode: string
  readonly granted: boolean
  readonly pid: number
  readonly application: string | null
  readonly client: string | null
  readonly username: string | null
  readonly state: string | null
  readonly waittype: string | null
  readonly waitevent: string | null
  readonly sessionstart: number | null
  readonly waitstart: number | null
  readonly fencing: string | null
}

/**
 * The names of the given keys in the fencing table. `table` is `regclass::text` from `listSql`,
 * which PostgreSQL quotes (and schema-qualifies when needed), so it is safe to splice.
 *
 * Parameters: $1 keys (bigint[] as text).
 */
export const namesSql = (table: string): string =>
  `select key::text as key, name from ${table} where key = any($1::bigint[])`

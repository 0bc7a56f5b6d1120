/**
 * SqliteLease's tables and what its statements share (`sqlite/sql` for locks, `sqlite/permitSql`
 * for semaphores): the table names of one lease table, the database's clock, trigger names, and
 * the rows of a renewal batch.
 */
import { parseTable, type TableRef } from "../../sql/tables.js"
import type { LeaseTables } from "../dialect.js"

/** The tables of one lease table name (plain identifiers: SQLite's `schema.` means an attached file). */
export interface Tables extends LeaseTables {
  /** The operations table: always empty between statements. */
  readonly op: TableRef
  /** Prefix of the triggers' and index's names. */
  readonly prefix: string
}

const QUEUE_SUFFIX = "_queue"
const OP_SUFFIX = "_op"
const SEM_SUFFIX = "_sem"

/** The tables for a user-given name, or why it is refused. */
export const parseTables = (input: string): Tables | string => {
  if (typeof input === "string" && input.includes(".")) {
    return `"${input}" names a schema; SqliteLease takes a plain table name (its file is the database)`
  }
  const leases = parseTable(input)
  if (typeof leases === "string") return leases
  const queue = parseTable(`${leases.text}${QUEUE_SUFFIX}`)
  const op = parseTable(`${leases.text}${OP_SUFFIX}`)
  const sem = parseTable(`${leases.text}${SEM_SUFFIX}`)
  if (typeof queue === "string") return queue
  if (typeof op === "string") return op
  if (typeof sem === "string") return sem
  return { leases, queue, op, sem, prefix: leases.relname }
}

export const quote = (identifier: string) => `"${identifier}"`

/** A trigger's name: its kind and the `version` of its text (a new version is created beside the old). */
export const trigger = (tables: Tables, kind: string, version: string) => quote(`${tables.prefix}_${kind}_${version}`)

/** The database's time in whole milliseconds since the epoch (the same instant throughout a statement). */
export const NOW = "cast(round(unixepoch('subsec') * 1000) as integer)"
/** Larger than any time or sequence number: the neutral value of `min` (SQLite's `min(a, null)` is null). */
export const NEVER = "9223372036854775807"

/**
 * A renewal batch as rows (`idx`, `name`, `owner`, `token`, `ttl`, `mode`) from its parallel JSON
 * arrays (?1 names, ?2 owners, ?3 tokens, ?4 ttls in ms, ?5 modes), read before anything is
 * renewed (`materialized`).
 */
export const RENEW_INPUT = `input as materialized (
  select cast(a.key as integer) as idx, a.value as name,
    json_extract(?2, '$[' || a.key || ']') as owner,
    cast(json_extract(?3, '$[' || a.key || ']') as integer) as token,
    json_extract(?4, '$[' || a.key || ']') as ttl,
    json_extract(?5, '$[' || a.key || ']') as mode
  from json_each(?1) a
)`

/**
 * SqliteLease's tables and what its statements share (`sqlite/sql` for locks, `sqlite/permitSql`
 * for semaphores): the table names of one lease table, the database file's one token counter,
 * the database's clock, trigger names, and the rows of a renewal batch.
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
  // SQLite's names are case-insensitive: the counter's table is every lease table's, never one.
  if (leases.relname.toLowerCase() === TOKENS_TABLE) return `"${input}" is the name of SqliteLease's token counter table`
  const queue = parseTable(`${leases.text}${QUEUE_SUFFIX}`)
  const op = parseTable(`${leases.text}${OP_SUFFIX}`)
  const sem = parseTable(`${leases.text}${SEM_SUFFIX}`)
  if (typeof queue === "string") return queue
  if (typeof op === "string") return op
  if (typeof sem === "string") return sem
  return { leases, queue, op, sem, prefix: leases.relname }
}

export const quote = (identifier: string) => `"${identifier}"`

/**
 * A trigger's name: its kind and the `version` of its text. A trigger is database state, shared
 * by the processes of every version on the file, and `create trigger if not exists` never
 * replaces one: its text under a name is frozen once released, and nothing drops an old one (a
 * process of the version that made it re-creates it at start). A change is therefore a new
 * trigger beside the old ones — which all fire — never an edit of one.
 */
export const trigger = (tables: Tables, kind: string, version: string) => quote(`${tables.prefix}_${kind}_${version}`)

/**
 * The table of the database file's one fencing-token counter (one row, `id` 1), shared by every
 * SqliteLease lease table in the file, its locks and its semaphores alike. Every grant takes its
 * token(s) above both the counter and its name's row (`max(counter, row token) + 1`, a block of
 * `n` for `n` permits) and sets the counter to the last token it handed out, in the granting
 * statement (its triggers). SQLite serializes writers — a write statement takes the file's one
 * write lock before it reads, and holds it until it commits — so no two grants ever read the same
 * counter: race-free without any further locking. A name's row therefore carries no counter of
 * its own that must survive, and rows of idle names are deleted (`sweep` of `sqlite/sql` and
 * `sqlite/permitSql`) once the counter is at or past their token.
 */
export const TOKENS_TABLE = "effect_lock_tokens"
const TOKENS = quote(TOKENS_TABLE)

/** The counter's value (0 before any grant). */
export const COUNTER = `coalesce((select value from ${TOKENS} where id = 1), 0)`

/** Raises the counter to `value` (an expression of the statement or trigger) if it is below: never lowers it. */
export const raiseCounter = (value: string) =>
  `insert into ${TOKENS} (id, value) values (1, ${value})
  on conflict (id) do update set value = max(value, excluded.value)`

/** The counter's table (idempotent). */
export const createTokens = `create table if not exists ${TOKENS} (
  id integer primary key check (id = 1),
  value integer not null
)`

/**
 * Raises the counter to at least every token of the lease table and its semaphore table: a file
 * written by a version before the counter has per-name tokens up to anything. Run after the
 * counter's triggers exist, so a grant of an older process in between raises it too.
 */
export const raiseToTables = ({ leases, sem }: Tables) =>
  `insert into ${TOKENS} (id, value)
select 1, max(coalesce((select max(token) from ${leases.sql}), 0), coalesce((select max(token) from ${sem.sql}), 0)) where true
on conflict (id) do update set value = max(value, excluded.value)`

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

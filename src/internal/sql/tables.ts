/**
 * Tables the library keeps (lease rows, fencing counters, fence rows): user-given names validated
 * once and quoted for SQL — `table` or `schema.table`, plain identifiers only, never spliced into
 * SQL unchecked — and their creation on first use.
 */
import { advisoryKey } from "../core/lockKey.js"

/** Longest PostgreSQL identifier part, in bytes (NAMEDATALEN - 1). */
export const MAX_IDENTIFIER_BYTES = 63
const IDENTIFIER = /^[A-Za-z_][A-Za-z0-9_]*$/

/** A validated table reference: its quoted SQL form and its last (unqualified) part. */
export interface TableRef {
  /** As written by the user, e.g. `locks.leases`. */
  readonly text: string
  /** Quoted for SQL, e.g. `"locks"."leases"`. */
  readonly sql: string
  /** The table's own name without schema, e.g. `leases`. */
  readonly relname: string
}

/**
 * Parses `table` or `schema.table`. Each part must be a plain identifier (letters, digits,
 * underscores, not starting with a digit, at most 63 bytes); it is quoted, so its case is kept.
 * Returns the reason when the identifier is refused.
 */
export const parseTable = (input: string): TableRef | string => {
  if (typeof input !== "string" || input.length === 0) return "the table name must be a non-empty string"
  const parts = input.split(".")
  if (parts.length > 2) return `"${input}" has more than one dot; use table or schema.table`
  for (const part of parts) {
    if (!IDENTIFIER.test(part)) {
      return `"${part}" is not a plain identifier (letters, digits and underscores, not starting with a digit)`
    }
    if (Buffer.byteLength(part, "utf8") > MAX_IDENTIFIER_BYTES) {
      return `"${part}" is longer than ${MAX_IDENTIFIER_BYTES} bytes`
    }
  }
  return { text: input, sql: parts.map((part) => `"${part}"`).join("."), relname: parts[parts.length - 1]! }
}


/**
 * SQLSTATEs of a concurrent `CREATE TABLE IF NOT EXISTS` losing the catalog race to a creator
 * that does not take our lock (unique_violation, duplicate_table, duplicate_object: all seen).
 */
export const CATALOG_RACE: ReadonlySet<string> = new Set(["23505", "42P07", "42710"])

/** Attempts at creating a table before its error is reported. */
export const CREATE_ATTEMPTS = 3

/**
 * Creates a table on first use in ONE statement (so it also runs behind a transaction pooler):
 * concurrent `create table if not exists` can fail on the catalog's unique index, so creators
 * serialize on a transaction advisory lock of their own (`ddlNamespace`, released when the
 * statement's transaction ends) and re-check under it. An existing table costs a catalog lookup only and
 * needs no CREATE privilege.
 */
export const ensureTableSql = (
  table: TableRef,
  createSql: string,
  ddlNamespace: string,
  options?: {
    /** When to create (or upgrade): default, when `table` does not exist. */
    readonly missing?: string | undefined
    /** Whose creation lock to take: default `table`'s (tables created together share one). */
    readonly lockOn?: TableRef | undefined
  }
): string =>
  // The identifiers were validated (no quotes), so they are safe inside string literals.
  ensureSql(options?.missing ?? `to_regclass('${table.sql}') is null`, createSql, ddlNamespace, options?.lockOn ?? table)

const ensureSql = (missing: string, createSql: string, ddlNamespace: string, lockOn: TableRef): string =>
  `do $effect_lock$
begin
  if ${missing} then
    perform pg_advisory_xact_lock(${advisoryKey(lockOn.text, ddlNamespace)});
    -- Again under the lock (each statement of the block reads anew): a creator that waited for
    -- another's commit finds nothing to do, and takes no lock on the now live tables (an ALTER's
    -- ACCESS EXCLUSIVE would queue every lock statement behind it, and deadlock with them).
    if ${missing} then
      ${createSql.replace(/\n/g, "\n      ")};
    end if;
  end if;
end
$effect_lock$`

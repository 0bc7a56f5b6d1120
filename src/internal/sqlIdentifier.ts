/**
 * Table names given by users, validated once and quoted for SQL: `table` or `schema.table`,
 * plain identifiers only (a name is never spliced into SQL unchecked).
 */

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


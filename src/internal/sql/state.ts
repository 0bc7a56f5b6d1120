/**
 * The SQLSTATE of a failed statement, read through the wrappers it arrives in: our
 * `LockBackendError`, @effect/sql's `SqlError`, or the driver's own error (`pg.DatabaseError`).
 * `undefined` when no server error code is found (a dead connection, a client-side failure).
 */
export const sqlStateOf = (error: unknown): string | undefined => {
  let current: unknown = error
  // A few levels at most: LockBackendError → SqlError → driver error.
  for (let depth = 0; depth < 4 && typeof current === "object" && current !== null; depth++) {
    const code = (current as { readonly code?: unknown }).code
    if (typeof code === "string" && /^[0-9A-Z]{5}$/.test(code)) return code
    current = (current as { readonly cause?: unknown }).cause
  }
  return undefined
}

/** The `SQLITE_…` result code in `error` or its causes (better-sqlite3's errors carry it), if any. */
export const sqliteCodeOf = (error: unknown): string | undefined => {
  let current: unknown = error
  for (let depth = 0; depth < 4 && typeof current === "object" && current !== null; depth++) {
    const code = (current as { readonly code?: unknown }).code
    if (typeof code === "string" && code.startsWith("SQLITE_")) return code
    current = (current as { readonly cause?: unknown }).cause
  }
  return undefined
}

/**
 * @effect/sql's tags, by key, not by import: an import of @effect/sql would load it (an optional
 * peer) for every user of the modules that mention them, memory-only apps and PgAdvisory's session
 * locks included. Effect finds a service by its tag's key, so these are the same tags.
 */
import type * as SqlClient from "@effect/sql/SqlClient"
import * as Context from "effect/Context"

export const SqlClientTag = Context.GenericTag<SqlClient.SqlClient>("@effect/sql/SqlClient")

/** Present in the context inside `sql.withTransaction`: a statement sent there joins the caller's transaction. */
export const TransactionConnectionTag = Context.GenericTag<
  SqlClient.TransactionConnection,
  readonly [conn: unknown, depth: number]
>("@effect/sql/SqlClient/TransactionConnection")

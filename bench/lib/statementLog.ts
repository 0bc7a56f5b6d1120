/**
 * Counts the statements a library sends through a `SqlClient`, by wrapping the client it is
 * given: every `sql.unsafe(text, params)` call is logged with its time and first parameter's
 * size (the batch size of an array-parameter statement). PgLease sends every statement this
 * way, so the log is exact for it; a server-side count (pg_stat_database) is taken alongside.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import { PgClient } from "@effect/sql-pg"
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { now } from "./timing.js"

export interface LoggedStatement {
  readonly at: number
  readonly text: string
  /** Length of the first parameter when it is an array (rows in a batch), else 1. */
  readonly batch: number
}

export class StatementLog {
  readonly entries: Array<LoggedStatement> = []

  record(text: string, params: ReadonlyArray<unknown> | undefined): void {
    const first = params?.[0]
    this.entries.push({ at: now(), text, batch: Array.isArray(first) ? first.length : 1 })
  }

  between(from: number, to: number): Array<LoggedStatement> {
    return this.entries.filter((e) => e.at >= from && e.at < to)
  }
}

const counting = (sql: SqlClient.SqlClient, log: StatementLog): SqlClient.SqlClient =>
  new Proxy(sql, {
    get(target, property) {
      if (property === "unsafe") {
        const unsafe: SqlClient.SqlClient["unsafe"] = (text, params) => {
          log.record(text, params)
          return target.unsafe(text, params)
        }
        return unsafe
      }
      return Reflect.get(target, property, target)
    }
  })

/**
 * `PgClient` as given, and `SqlClient` wrapped to log into `log`. Built from one pg layer, so
 * both tags share the same pool.
 */
export const countingPgLayer = <E>(
  pg: Layer.Layer<PgClient.PgClient | SqlClient.SqlClient, E>,
  log: StatementLog
): Layer.Layer<PgClient.PgClient | SqlClient.SqlClient, E> =>
  Layer.effectContext(
    Effect.gen(function*() {
      const client = yield* PgClient.PgClient
      const sql = yield* SqlClient.SqlClient
      return Context.make(PgClient.PgClient, client).pipe(Context.add(SqlClient.SqlClient, counting(sql, log)))
    })
  ).pipe(Layer.provide(pg))

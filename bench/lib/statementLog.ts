/**
 * Counts the statements a library sends, with their time and first parameter's size (the batch
 * size of an array-parameter statement), at PgLease's own connection lane, where it sends them
 * (they do not pass through the app's `SqlClient`: renewals have connections of their own). A
 * server-side count (pg_stat_database) is taken alongside.
 */
import type { Lane } from "../../src/internal/lease/pg/lane.js"
import * as Effect from "effect/Effect"
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

/** PgLease's lane, logging every lock and renewal statement into `log` before sending it. */
export const countingLane = (log: StatementLog) => (lane: Lane): Lane => ({
  ...lane,
  run: (operation, name, text, params, bound) =>
    Effect.suspend(() => {
      log.record(text, params)
      return lane.run(operation, name, text, params, bound)
    }),
  renew: (text, params, bound) =>
    Effect.suspend(() => {
      log.record(text, params)
      return lane.renew(text, params, bound)
    })
})

/**
 * PgLease's dialect of the lease engine: the statements of `pgLeaseSql` (locks) and
 * `pgLeasePermitSql` (semaphores), first-use creation that
 * retries a lost catalog race, and wake-ups through LISTEN/NOTIFY (`pgLeaseWake`) when the lane
 * can listen — a release notifies the waiters at the head from its own statement, so the
 * releasing process hears them like every other.
 */
import * as Effect from "effect/Effect"
import type * as Scope from "effect/Scope"
import type { LockAndSemaphoreBackend } from "../../../LockBackend.js"
import type { LeaseGrant } from "../attempt.js"
import type { PermitLeaseGrant } from "../permits.js"
import * as Engine from "../engine.js"
import type { Lane } from "../lane.js"
import type { Owner } from "../../runtime/owner.js"
import * as PermitSql from "./permitSql.js"
import * as Sql from "./sql.js"
import * as Wake from "./wake.js"
import { sqlStateOf } from "../../sql/state.js"
import { CATALOG_RACE } from "../../sql/tables.js"

export { MAX_NAME_BYTES, MIN_TTL } from "../engine.js"

export interface Settings extends Engine.Settings {
  readonly tables: Sql.Tables
  readonly channel: string
  /** `auto`: listen when the lane can and notifications prove to arrive; `always`; `never`. */
  readonly listen: "auto" | "always" | "never"
}

/** The statements and error handling of PostgreSQL. */
export const dialect = (tables: Sql.Tables, channel: string): Engine.Dialect => ({
  backend: "pg-lease",
  acquire: Sql.acquire(tables),
  release: Sql.release(tables),
  renew: Sql.renew(tables),
  ensureTable: [Sql.ensureTable(tables)],
  releaseParams: (name, owner, waiter) => [name, owner, waiter, channel],
  // The release statement notifies the heads itself; they hear it through LISTEN, this process too.
  wokenBy: () => [],
  retryCreate: (error) => CATALOG_RACE.has(sqlStateOf(error) ?? ""),
  // clock_timestamp(), not now(): the time of the read, not of a transaction's start.
  now: "select (extract(epoch from clock_timestamp()) * 1000)::float8 as now",
  permits: {
    acquire: PermitSql.acquire(tables),
    release: PermitSql.release(tables),
    renew: PermitSql.renew(tables),
    ensureTable: [Sql.ensureSemTable(tables)],
    releaseParams: (name, owner, waiter) => [name, owner, waiter, channel],
    // As for locks: the release statement notifies the heads itself.
    wokenBy: () => []
  }
})

/**
 * Builds the backend on `lane`. The table is created on the first acquire, not here, so an
 * application can start while the database is down.
 */
export const make = (
  lane: Lane,
  settings: Settings,
  owner: Owner
): Effect.Effect<LockAndSemaphoreBackend<LeaseGrant, PermitLeaseGrant>, never, Scope.Scope> =>
  Effect.gen(function*() {
    const hub = settings.listen === "never" || lane.listen === undefined ? undefined : yield* Wake.make({
      listen: lane.listen,
      notify: (channel, payload) => lane.run("notify", undefined, Sql.ping, [channel, payload], settings.statementTimeout),
      channel: settings.channel,
      checkInterval: settings.checkInterval,
      mode: settings.listen === "always" ? "always" : "auto"
    }, owner)
    return yield* Engine.make(lane, settings, dialect(settings.tables, settings.channel), hub, owner)
  })

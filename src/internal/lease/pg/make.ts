/**
 * From `PgLease.Options` to a running backend: options validated and defaulted, the lane chosen
 * and opened, the pieces assembled. `wrapLane` lets tests observe or delay the lane's statements.
 */
import type { SqlClient } from "@effect/sql/SqlClient"
import type { PgClient } from "@effect/sql-pg/PgClient"
import * as Context from "effect/Context"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import { identity } from "effect/Function"
import * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import * as Os from "node:os"
import type { LockAndSemaphoreBackend } from "../../../LockBackend.js"
import { LockBackendError } from "../../../LockError.js"
import type { LeaseGrant } from "../attempt.js"
import type { PermitLeaseGrant } from "../permits.js"
import * as LeaseOptions from "../inspect.js"
import * as Backend from "./backend.js"
import * as Lane from "./lane.js"
import * as Sql from "./sql.js"
import { TIMER } from "../../core/validate.js"
import * as Owner from "../../runtime/owner.js"

/** The options of `PgLease.layer`; documented there. */
export interface Options {
  readonly table?: string | undefined
  readonly ttl?: Duration.DurationInput | undefined
  readonly pool?: "own" | "application" | undefined
  readonly connections?: number | undefined
  readonly listen?: boolean | "auto" | undefined
  readonly channel?: string | undefined
  readonly pollInterval?: Duration.DurationInput | undefined
  readonly listenCheckInterval?: Duration.DurationInput | undefined
  readonly statementTimeout?: Duration.DurationInput | undefined
  readonly createTable?: boolean | undefined
  readonly applicationName?: string | undefined
}

export const DEFAULT_TABLE = "effect_lock_leases"
export const DEFAULT_TTL = Duration.seconds(30)
export const DEFAULT_POLL = Duration.millis(500)
export const DEFAULT_CHECK = Duration.seconds(5)
export const DEFAULT_STATEMENT_TIMEOUT = Duration.seconds(5)
export const DEFAULT_CONNECTIONS = 4
const DEFAULT_APPLICATION = "effect-lock"

/** The tags, referenced by key: this module needs neither @effect/sql nor @effect/sql-pg at run time. */
export const SqlClientTag = Context.GenericTag<SqlClient>("@effect/sql/SqlClient")
const PgClientTag = Context.GenericTag<PgClient>("@effect/sql-pg/PgClient")

export const configError = LeaseOptions.configError("PgLease")

/** The validated tables (default when absent), or the configuration error that names the problem. */
export const resolveTables = (table: string | undefined): Effect.Effect<Sql.Tables, LockBackendError> => {
  const parsed = Sql.parseTables(table ?? DEFAULT_TABLE)
  return typeof parsed === "string" ? Effect.fail(configError(parsed)) : Effect.succeed(parsed)
}

const duration = LeaseOptions.durationOf(configError)

export const makeBackend = (
  options?: Options,
  wrapLane: (lane: Lane.Lane) => Lane.Lane = identity
): Effect.Effect<LockAndSemaphoreBackend<LeaseGrant, PermitLeaseGrant>, LockBackendError, SqlClient | Scope.Scope> =>
  Effect.gen(function*() {
    const tables = yield* resolveTables(options?.table)
    const channel = options?.channel ?? tables.leases.relname
    const badChannel = Sql.checkChannel(channel)
    if (badChannel !== undefined) return yield* configError(badChannel)
    const connections = options?.connections ?? DEFAULT_CONNECTIONS
    if (!Number.isInteger(connections) || connections < 1) {
      return yield* configError(`connections must be a whole number of at least 1, got ${String(connections)}`)
    }
    // All before any connection is opened: a bad option fails the build at once.
    const statementTimeout = yield* duration("statementTimeout", options?.statementTimeout, DEFAULT_STATEMENT_TIMEOUT, TIMER)
    // A positive ttl below the floor or above the ceiling is clamped by DistributedLock, so no max here.
    const defaultTtl = yield* duration("ttl", options?.ttl, DEFAULT_TTL)
    const pollInterval = yield* duration("pollInterval", options?.pollInterval, DEFAULT_POLL, TIMER)
    const checkInterval = yield* duration("listenCheckInterval", options?.listenCheckInterval, DEFAULT_CHECK, TIMER)
    const sql = yield* SqlClientTag
    const pg = yield* Effect.serviceOption(PgClientTag)
    const pool = options?.pool ?? (Option.isSome(pg) ? "own" : "application")
    if (pool === "own" && Option.isNone(pg)) {
      return yield* configError("pool: \"own\" needs a PgClient in the context to take its connection settings from")
    }
    const listenOption = options?.listen ?? "auto"
    const application = options?.applicationName ??
      Option.getOrUndefined(Option.flatMapNullable(pg, (client) => client.config.applicationName)) ??
      DEFAULT_APPLICATION
    // Before the lane: the layer's own fibers are stopped only after everything else has closed.
    const owner = yield* Owner.make
    const lane = wrapLane(
      pool === "own" && Option.isSome(pg)
        ? yield* Lane.own(Lane.clientConfig(pg.value.config, application, statementTimeout), connections, statementTimeout)
        : yield* Lane.application(sql, Option.getOrUndefined(Option.map(pg, (client) => client.listen)), owner)
    )
    if (listenOption === true && lane.listen === undefined) {
      return yield* configError("listen: true needs a PgClient in the context (or use listen: \"auto\" to poll without one)")
    }
    return yield* Backend.make(lane, {
      tables,
      channel,
      application,
      host: Os.hostname(),
      statementTimeout,
      defaultTtl,
      pollInterval,
      checkInterval,
      createTable: options?.createTable !== false,
      listen: listenOption === true ? "always" : listenOption === false ? "never" : "auto"
    }, owner)
  })

/**
 * From `PgLease.Options` to a running backend: options validated and defaulted, the lane chosen
 * and opened, wake-ups through LISTEN/NOTIFY (`pg/wake`) when the lane can listen, and the lease
 * engine assembled with PostgreSQL's dialect. `wrapLane` lets tests observe or delay the lane's
 * statements.
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
import type { LockBackendError } from "../../../LockError.js"
import type { LeaseGrant } from "../attempt.js"
import * as Engine from "../engine.js"
import * as Lanes from "../lane.js"
import * as LeaseOptions from "../options.js"
import type * as Operator from "../operator.js"
import type { PermitLeaseGrant } from "../permits.js"
import * as Dialect from "./dialect.js"
import * as Lane from "./lane.js"
import * as Sql from "./sql.js"
import * as Wake from "./wake.js"
import * as Owner from "../../runtime/owner.js"

/** The options of `PgLease.layer`; documented there. */
export interface Options extends LeaseOptions.ListeningOptions {
  readonly pool?: "own" | "application" | undefined
  readonly connections?: number | undefined
  readonly listen?: boolean | "auto" | undefined
  readonly channel?: string | undefined
  readonly listenCheckInterval?: Duration.DurationInput | undefined
}

export const DEFAULT_POLL = Duration.millis(500)
export const DEFAULT_CHECK = Duration.seconds(5)
export const DEFAULT_CONNECTIONS = 4

/** The tags, referenced by key: this module needs neither @effect/sql nor @effect/sql-pg at run time. */
export const SqlClientTag = Context.GenericTag<SqlClient>("@effect/sql/SqlClient")
const PgClientTag = Context.GenericTag<PgClient>("@effect/sql-pg/PgClient")

export const options = LeaseOptions.resolver("PgLease", Sql.parseTables)

/** `PgLease.migration`: one statement creating (or upgrading) every table. */
export const migration = LeaseOptions.migration("PgLease", Sql.parseTables, (tables) => [Sql.createTable(tables)])

/** The store the operator functions (`PgLease.holders` …) work on. */
export const store: Operator.Store<Sql.Tables> = { backend: "pg-lease", resolveTables: options.resolveTables, statements: Dialect.operator }

export const makeBackend = (
  input?: Options,
  wrapLane: (lane: Lane.Lane) => Lane.Lane = identity
): Effect.Effect<LockAndSemaphoreBackend<LeaseGrant, PermitLeaseGrant>, LockBackendError, SqlClient | Scope.Scope> =>
  Effect.gen(function*() {
    const tables = yield* options.resolveTables(input?.table)
    const channel = input?.channel ?? tables.leases.relname
    const badChannel = Sql.checkChannel(channel)
    if (badChannel !== undefined) return yield* options.configError(badChannel)
    const connections = input?.connections ?? DEFAULT_CONNECTIONS
    if (!Number.isInteger(connections) || connections < 1) {
      return yield* options.configError(`connections must be a whole number of at least 1, got ${String(connections)}`)
    }
    // All before any connection is opened: a bad option fails the build at once.
    const timings = yield* options.timings(input, { poll: DEFAULT_POLL, check: DEFAULT_CHECK })
    const { checkInterval, statementTimeout } = timings
    const sql = yield* SqlClientTag
    const pg = yield* Effect.serviceOption(PgClientTag)
    const pool = input?.pool ?? (Option.isSome(pg) ? "own" : "application")
    if (pool === "own" && Option.isNone(pg)) {
      return yield* options.configError("pool: \"own\" needs a PgClient in the context to take its connection settings from")
    }
    const listen = input?.listen ?? "auto"
    const application = input?.applicationName ??
      Option.getOrUndefined(Option.flatMapNullable(pg, (client) => client.config.applicationName)) ??
      LeaseOptions.DEFAULT_APPLICATION
    // Before the lane: the layer's own fibers are stopped only after everything else has closed.
    const owner = yield* Owner.make
    const lane = wrapLane(
      pool === "own" && Option.isSome(pg)
        ? yield* Lane.own(Lane.clientConfig(pg.value.config, application, statementTimeout), connections, statementTimeout, owner)
        : yield* Lane.application(sql, Option.getOrUndefined(Option.map(pg, (client) => client.listen)), owner)
    )
    if (listen === true && lane.listen === undefined) {
      return yield* options.configError("listen: true needs a PgClient in the context (or use listen: \"auto\" to poll without one)")
    }
    const hub = listen === false || lane.listen === undefined ? undefined : yield* Wake.make({
      listen: lane.listen,
      notify: (channel, payload) => Lanes.send(lane, undefined, Dialect.ping, { channel, payload }, statementTimeout),
      channel,
      checkInterval,
      mode: listen === true ? "always" : "auto"
    }, owner)
    // The tables are created on the first acquire, not here, so an application can start while the database is down.
    return yield* Engine.make(lane, {
      ...timings,
      application,
      host: Os.hostname(),
      createTable: input?.createTable !== false
    }, Dialect.dialect(tables, channel, { sweeping: Duration.toMillis(timings.sweepInterval) > 0 }), hub, owner)
  })

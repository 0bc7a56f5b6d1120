/**
 * From `SqliteLease.Options` to a running backend: options validated and defaulted, the database
 * file chosen (the option, else the application's `SqliteClient`'s), the backend's own client
 * opened on it, the tables created, and the lease engine assembled with SQLite's dialect.
 */
import type { SqliteClient } from "@effect/sql-sqlite-node/SqliteClient"
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
import * as Schema from "./schema.js"
import * as Sql from "./sql.js"
import { TIMER } from "../../core/validate.js"
import * as Wake from "./wake.js"
import * as Owner from "../../runtime/owner.js"

/** The options of `SqliteLease.layer`; documented there. */
export interface Options extends LeaseOptions.CommonOptions {
  readonly filename?: string | undefined
  readonly busyTimeout?: Duration.DurationInput | undefined
}

export const DEFAULT_POLL = Duration.millis(50)
export const DEFAULT_BUSY_TIMEOUT = Duration.millis(50)
/** Unused by SQLite's hub (never trusted); the engine's long re-check interval. */
const CHECK_INTERVAL = Duration.seconds(5)

/** sql-sqlite-node's tag, referenced by key: this module needs no driver at run time. */
const SqliteClientTag = Context.GenericTag<SqliteClient>("@effect/sql-sqlite-node/SqliteClient")

export const options = LeaseOptions.resolver("SqliteLease", Schema.parseTables)

/** `SqliteLease.migration`: the tables and triggers, statement by statement. */
export const migration = LeaseOptions.migration("SqliteLease", Schema.parseTables, Sql.createTable)

/** The store the operator functions (`SqliteLease.holders` …) work on. */
export const store: Operator.Store<Schema.Tables> = { backend: "sqlite-lease", resolveTables: options.resolveTables, statements: Dialect.operator }

/** The database file: the option, else the application's `SqliteClient`'s (never an in-memory one). */
const resolveFilename = (filename: string | undefined): Effect.Effect<string, LockBackendError> =>
  Effect.gen(function*() {
    if (filename !== undefined) {
      if (typeof filename !== "string" || filename.length === 0) return yield* options.configError("filename must be a non-empty string")
    }
    const client = yield* Effect.serviceOption(SqliteClientTag)
    const file = filename ?? Option.getOrUndefined(Option.map(client, (c) => c.config.filename))
    if (file === undefined) {
      return yield* options.configError("give a filename, or provide a SqliteClient (its database file is then used)")
    }
    if (file === ":memory:" || file === "" || file.startsWith("file::memory:")) {
      return yield* options.configError(
        `an in-memory database ("${file}") is private to one connection; give SqliteLease the file the processes share`
      )
    }
    return file
  })

export const makeBackend = (
  input?: Options,
  wrapLane: (lane: Lanes.Lane) => Lanes.Lane = identity
): Effect.Effect<LockAndSemaphoreBackend<LeaseGrant, PermitLeaseGrant>, LockBackendError, Scope.Scope> =>
  Effect.gen(function*() {
    const tables = yield* options.resolveTables(input?.table)
    const statementTimeout = yield* options.statementTimeout(input)
    // Zero is SQLite's "never wait for the write lock": each try fails at once and is retried
    // asynchronously. The cap keeps it within busy_timeout's C int of milliseconds.
    const busyTimeout = yield* options.duration("busyTimeout", input?.busyTimeout, DEFAULT_BUSY_TIMEOUT, { ...TIMER, allowZero: true })
    const pollInterval = yield* options.duration("pollInterval", input?.pollInterval, DEFAULT_POLL, TIMER)
    const ttl = yield* options.ttl(input)
    const sweepInterval = yield* options.sweepInterval(input)
    if (Duration.greaterThanOrEqualTo(busyTimeout, statementTimeout)) {
      return yield* options.configError(
        `busyTimeout (${Duration.format(busyTimeout)}) must be shorter than statementTimeout (${Duration.format(statementTimeout)})`
      )
    }
    const application = input?.applicationName ?? LeaseOptions.DEFAULT_APPLICATION
    const filename = yield* resolveFilename(input?.filename)
    // First: its fibers (give-backs, attempts) are stopped only after everything else has closed.
    const owner = yield* Owner.make
    const own = yield* Lane.own(filename, busyTimeout)
    const sqlite = Dialect.dialect(tables)
    if (input?.createTable !== false) {
      // At build, not first use: the file is local, and a file that cannot be written is then a
      // layer error rather than the first acquire's.
      yield* Effect.forEach(sqlite.locks.ensureTable, (statement) => Lanes.send(own, undefined, statement, undefined, statementTimeout), {
        discard: true
      }).pipe(Effect.mapError((error) => Lane.openError(filename, error.cause)))
    }
    return yield* Engine.make(wrapLane(own), {
      application,
      host: Os.hostname(),
      statementTimeout,
      defaultTtl: ttl,
      pollInterval,
      checkInterval: CHECK_INTERVAL,
      // Created above (or by the application's migrations).
      createTable: false,
      sweepInterval
    }, sqlite, Wake.make(), owner)
  })

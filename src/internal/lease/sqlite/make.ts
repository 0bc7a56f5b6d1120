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
import { LockBackendError } from "../../../LockError.js"
import type { LeaseGrant } from "../attempt.js"
import type { PermitLeaseGrant } from "../permits.js"
import * as Engine from "../engine.js"
import type { Lane } from "../lane.js"
import * as LeaseOptions from "../inspect.js"
import * as Lanes from "./lane.js"
import * as PermitSql from "./permitSql.js"
import * as Sql from "./sql.js"
import { TIMER } from "../../core/validate.js"
import * as Wake from "./wake.js"
import * as Owner from "../../runtime/owner.js"

/** The options of `SqliteLease.layer`; documented there. */
export interface Options {
  readonly filename?: string | undefined
  readonly table?: string | undefined
  readonly ttl?: Duration.DurationInput | undefined
  readonly pollInterval?: Duration.DurationInput | undefined
  readonly busyTimeout?: Duration.DurationInput | undefined
  readonly statementTimeout?: Duration.DurationInput | undefined
  readonly createTable?: boolean | undefined
  readonly applicationName?: string | undefined
}

export const DEFAULT_TABLE = "effect_lock_leases"
export const DEFAULT_TTL = Duration.seconds(30)
export const DEFAULT_POLL = Duration.millis(50)
export const DEFAULT_BUSY_TIMEOUT = Duration.millis(50)
export const DEFAULT_STATEMENT_TIMEOUT = Duration.seconds(5)
const DEFAULT_APPLICATION = "effect-lock"
/** Unused by SQLite's hub (never trusted); the engine's long re-check interval. */
const CHECK_INTERVAL = Duration.seconds(5)

/** sql-sqlite-node's tag, referenced by key: this module needs no driver at run time. */
const SqliteClientTag = Context.GenericTag<SqliteClient>("@effect/sql-sqlite-node/SqliteClient")

export const configError = LeaseOptions.configError("SqliteLease")

/** The validated tables (default when absent), or the configuration error that names the problem. */
export const resolveTables = (table: string | undefined): Effect.Effect<Sql.Tables, LockBackendError> => {
  const parsed = Sql.parseTables(table ?? DEFAULT_TABLE)
  return typeof parsed === "string" ? Effect.fail(configError(parsed)) : Effect.succeed(parsed)
}

const duration = LeaseOptions.durationOf(configError)

/** The database file: the option, else the application's `SqliteClient`'s (never an in-memory one). */
const resolveFilename = (filename: string | undefined): Effect.Effect<string, LockBackendError> =>
  Effect.gen(function*() {
    if (filename !== undefined) {
      if (typeof filename !== "string" || filename.length === 0) return yield* configError("filename must be a non-empty string")
    }
    const client = yield* Effect.serviceOption(SqliteClientTag)
    const file = filename ?? Option.getOrUndefined(Option.map(client, (c) => c.config.filename))
    if (file === undefined) {
      return yield* configError("give a filename, or provide a SqliteClient (its database file is then used)")
    }
    if (file === ":memory:" || file === "" || file.startsWith("file::memory:")) {
      return yield* configError(
        `an in-memory database ("${file}") is private to one connection; give SqliteLease the file the processes share`
      )
    }
    return file
  })

/** The statements and error handling of SQLite. */
export const dialect = (tables: Sql.Tables): Engine.Dialect => ({
  backend: "sqlite-lease",
  acquire: Sql.acquire(tables),
  release: Sql.release(tables),
  renew: Sql.renew(tables),
  ensureTable: Sql.createTable(tables),
  releaseParams: (name, owner, waiter) => [name, owner, waiter],
  wokenBy: Wake.headsOf,
  // Creation statements serialize on the write lock and are idempotent; the lane retries a busy database.
  retryCreate: () => false,
  now: "select unixepoch('subsec') * 1000.0 as now",
  permits: {
    acquire: PermitSql.acquire(tables),
    release: PermitSql.release(tables),
    renew: PermitSql.renew(tables),
    // Created at build with the others (`createTable`).
    ensureTable: [],
    releaseParams: (name, owner, waiter) => [name, owner, waiter],
    // The release answers the waiters now at the head; this process wakes its own.
    wokenBy: Wake.headsOf
  }
})

export const makeBackend = (
  options?: Options,
  wrapLane: (lane: Lane) => Lane = identity
): Effect.Effect<LockAndSemaphoreBackend<LeaseGrant, PermitLeaseGrant>, LockBackendError, Scope.Scope> =>
  Effect.gen(function*() {
    const tables = yield* resolveTables(options?.table)
    const statementTimeout = yield* duration("statementTimeout", options?.statementTimeout, DEFAULT_STATEMENT_TIMEOUT, TIMER)
    // Zero is SQLite's "never wait for the write lock": each try fails at once and is retried
    // asynchronously. The cap keeps it within busy_timeout's C int of milliseconds.
    const busyTimeout = yield* duration("busyTimeout", options?.busyTimeout, DEFAULT_BUSY_TIMEOUT, { ...TIMER, allowZero: true })
    const pollInterval = yield* duration("pollInterval", options?.pollInterval, DEFAULT_POLL, TIMER)
    // A positive ttl below the floor or above the ceiling is clamped by DistributedLock, so no max here.
    const ttl = yield* duration("ttl", options?.ttl, DEFAULT_TTL)
    if (Duration.greaterThanOrEqualTo(busyTimeout, statementTimeout)) {
      return yield* configError(
        `busyTimeout (${Duration.format(busyTimeout)}) must be shorter than statementTimeout (${Duration.format(statementTimeout)})`
      )
    }
    const application = options?.applicationName ?? DEFAULT_APPLICATION
    const filename = yield* resolveFilename(options?.filename)
    // First: its fibers (give-backs, attempts) are stopped only after everything else has closed.
    const owner = yield* Owner.make
    const own = yield* Lanes.own(filename, busyTimeout)
    const createTable = options?.createTable !== false
    const sqlite = dialect(tables)
    if (createTable) {
      // At build, not first use: the file is local, and a file that cannot be written is then a
      // layer error rather than the first acquire's.
      yield* Effect.forEach(sqlite.ensureTable, (text) => own.run("create-table", undefined, text, [], statementTimeout), {
        discard: true
      }).pipe(Effect.mapError((error) => Lanes.openError(filename, error.cause)))
    }
    const lane = wrapLane(own)
    return yield* Engine.make(lane, {
      application,
      host: Os.hostname(),
      statementTimeout,
      defaultTtl: ttl,
      pollInterval,
      checkInterval: CHECK_INTERVAL,
      // Created above (or by the application's migrations).
      createTable: false
    }, sqlite, Wake.make(), owner)
  })

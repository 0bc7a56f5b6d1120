/**
 * SqliteLease's lane: a `SqliteClient` of the backend's own on the database file, opened when the
 * layer is built and used by nothing else — the application's statements run on its own client's
 * connection and never delay a renewal, and the lock statements are never sent on (or inside a
 * transaction of) the application's client.
 *
 * better-sqlite3 is synchronous: a statement runs to completion inside the call, the event loop
 * blocked meanwhile. A statement is short (one write of a few rows), so what can block long is
 * waiting for SQLite's single write lock while another connection holds it. That wait is bounded
 * by `busy_timeout` (default 50 ms) per try; a try that still finds the lock taken fails with
 * SQLITE_BUSY and is retried after an asynchronous pause (the event loop runs), until the
 * statement's bound. So one call blocks the event loop for at most about `busyTimeout`, and a
 * writer holding the lock for long costs a statement its bound, never a frozen process.
 *
 * One connection serves lock statements and renewals alike: the driver being synchronous, a
 * statement holds the connection only while it runs, and a retry waits outside it, so a renewal
 * never queues behind anything but one running statement.
 *
 * `@effect/sql-sqlite-node` and `@effect/experimental` (and through them better-sqlite3) are loaded
 * when a layer is built, not when `effect-lock` is imported.
 */
import type { SqlClient } from "@effect/sql/SqlClient"
import type * as SqliteClientModule from "@effect/sql-sqlite-node/SqliteClient"
import type * as ReactivityModule from "@effect/experimental/Reactivity"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Random from "effect/Random"
import type * as Scope from "effect/Scope"
import { LockBackendError } from "../../../LockError.js"
import { monotonicMillis } from "../../core/clock.js"
import type { Lane } from "../lane.js"
import { sqliteCodeOf } from "../../sql/state.js"

/** Pause between tries of a statement that found the write lock taken: half of it to all of it. */
const RETRY_PAUSE_MILLIS = 10

interface Modules {
  readonly SqliteClient: typeof SqliteClientModule
  readonly Reactivity: typeof ReactivityModule
}

let loaded: Promise<Modules> | undefined

/** Loads the driver modules (once per process); fails with a `LockBackendError` naming what is missing. */
export const load: Effect.Effect<Modules, LockBackendError> = Effect.tryPromise({
  try: () =>
    (loaded ??= Promise.all([import("@effect/sql-sqlite-node/SqliteClient"), import("@effect/experimental/Reactivity")]).then(
      ([SqliteClient, Reactivity]) => ({ SqliteClient, Reactivity })
    )).catch((error: unknown) => {
      loaded = undefined
      throw error
    }),
  catch: (cause) =>
    new LockBackendError({
      operation: "configure",
      cause: new Error(
        `SqliteLease needs the "@effect/sql-sqlite-node" package (and its "better-sqlite3"): ${String(cause)}`
      )
    })
})

/** Another connection holds the lock this statement needs: worth another try. */
const isBusy = (code: string | undefined) =>
  code !== undefined && (code.startsWith("SQLITE_BUSY") || code.startsWith("SQLITE_LOCKED"))

const failed = (operation: string, name: string | undefined, cause: unknown) =>
  new LockBackendError({ operation, ...(name === undefined ? {} : { name }), cause })

/** A failure to open or prepare the database file, as the layer reports it. */
export const openError = (filename: string, cause: unknown) =>
  new LockBackendError({
    operation: "open",
    cause: new Error(`SqliteLease could not open the database "${filename}": ${messageOf(cause)}`, { cause })
  })

const messageOf = (cause: unknown): string => {
  const code = sqliteCodeOf(cause)
  const inner = typeof cause === "object" && cause !== null && "cause" in cause ? (cause as { cause: unknown }).cause : undefined
  const message = inner instanceof Error ? inner.message : cause instanceof Error ? cause.message : String(cause)
  return code === undefined || message.includes(code) ? message : `${message} (${code})`
}

export interface OwnLane extends Lane {
  /** The backend's own client, for its statements outside the engine (table creation at build). */
  readonly client: SqlClient
}

/**
 * Opens the backend's own client on `filename` (WAL mode, `busy_timeout`), closed with the scope.
 * A file that cannot be opened or is not a database is a `LockBackendError { operation: "open" }`.
 */
export const own = (filename: string, busyTimeout: Duration.Duration): Effect.Effect<OwnLane, LockBackendError, Scope.Scope> =>
  Effect.gen(function*() {
    const { Reactivity, SqliteClient } = yield* load
    // better-sqlite3 throws from its constructor and from the WAL pragma (a missing directory, a
    // read-only path, a file that is not a database): sql-sqlite-node lets that through as a defect.
    const client = yield* SqliteClient.make({ filename }).pipe(
      Effect.provide(Reactivity.layer),
      Effect.catchAllDefect((defect) => Effect.fail(openError(filename, defect)))
    )
    const pragma = (text: string) =>
      client.unsafe<Record<string, unknown>>(text).withoutTransform.pipe(Effect.mapError((cause) => openError(filename, cause)))
    yield* pragma(`pragma busy_timeout = ${Math.max(0, Math.round(Duration.toMillis(busyTimeout)))}`)
    const [mode] = yield* pragma("pragma journal_mode")
    if (mode?.["journal_mode"] !== "wal") {
      return yield* openError(filename, new Error(`the database is in journal mode "${String(mode?.["journal_mode"])}", not WAL`))
    }

    // Parameters go to the driver as the dialect encoded them (`sqlite/dialect`).
    const run: Lane["run"] = (operation, name, text, params, bound) =>
      Effect.gen(function*() {
        const deadline = (yield* monotonicMillis) + Duration.toMillis(bound)
        while (true) {
          // Taken before each try: the database's clock is read inside the call, so later than this.
          const sentAt = yield* monotonicMillis
          // Run as the layer's work (attempts, give-backs, renewals): never on a caller's transaction.
          // Rows of whatever shape the caller reads them as (`never` fits every `A`).
          const result = yield* Effect.either(client.unsafe<never>(text, params).withoutTransform)
          if (result._tag === "Right") return { rows: result.right, sentAt }
          if (!isBusy(sqliteCodeOf(result.left))) return yield* failed(operation, name, result.left)
          const left = deadline - (yield* monotonicMillis)
          if (left <= 0) {
            return yield* failed(
              operation,
              name,
              new Error(`the ${operation} statement found the database locked by another connection for ${Duration.format(bound)}`, {
                cause: result.left
              })
            )
          }
          // The event loop runs meanwhile: the lock's holder (maybe in this process) can finish.
          const pause = RETRY_PAUSE_MILLIS * (0.5 + (yield* Random.next) / 2)
          yield* Effect.sleep(Duration.millis(Math.min(pause, left)))
        }
      })

    return {
      kind: "own",
      client,
      run,
      renew: (text, params, bound) => run("renew", undefined, text, params, bound),
      listen: undefined,
      prepareRenewals: () => {}
    }
  })

/**
 * The lane PgLease's statements travel on, so that they never queue behind the application's
 * statements — and renewals never behind anything.
 *
 * - `own` (the default when a `PgClient` is in the context): connections the backend opens
 *   itself from the `PgClient`'s settings. Lock statements (acquire, release, give-back, table
 *   creation, wake-up pings) share a small pool of `connections` (opened on demand, closed after
 *   idling); renewals run on connections nothing else uses (one, a second only while the first
 *   is busy or stuck); the LISTEN connection is a fourth kind. A statement that does not answer
 *   within its bound has its connection destroyed, never reused: a frozen server or a silently
 *   dropped connection costs one connection and one bound, and the next statement gets a fresh one.
 * - `application`: every statement through the application's `SqlClient` (the only choice with a
 *   plain `SqlClient`). Renewals use one connection reserved from the application's pool and kept
 *   while the backend lives, so a saturated pool does not starve them; a stuck renewal there
 *   cannot be destroyed (no Effect API does), only given back to the pool and replaced.
 */
import type { SqlClient } from "@effect/sql/SqlClient"
import type { Connection as SqlConnection } from "@effect/sql/SqlConnection"
import type { PgClientConfig } from "@effect/sql-pg/PgClient"
import * as Cause from "effect/Cause"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as ExecutionStrategy from "effect/ExecutionStrategy"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as FiberId from "effect/FiberId"
import * as Option from "effect/Option"
import * as Redacted from "effect/Redacted"
import * as Schedule from "effect/Schedule"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import type pg from "pg"
import { LockBackendError } from "../../../LockError.js"
import { monotonicMillis } from "../../core/clock.js"
import * as Driver from "../../pg/pool.js"
import { identifier } from "../../pg/driver.js"
import type { Lane, Sent } from "../lane.js"
import { awaitWithin, type Owner } from "../../runtime/owner.js"
import { withinOrFail } from "../../runtime/stallSafe.js"
import { resendable } from "../../sql/resend.js"

export type { Lane, Sent } from "../lane.js"

/** Connections for renewals: one in use normally, a second while the first is busy or stuck. */
export const RENEW_CONNECTIONS = 2
/** Idle own connections are closed after this long. */
const IDLE_TIMEOUT = Duration.seconds(30)

const timedOut = (operation: string, name: string | undefined, bound: Duration.Duration) => () =>
  new LockBackendError({
    operation,
    ...(name === undefined ? {} : { name }),
    cause: new Error(`the ${operation} statement did not complete within ${Duration.format(bound)}`)
  })

const failed = (operation: string, name: string | undefined) => (cause: unknown) =>
  cause instanceof LockBackendError ? cause : new LockBackendError({ operation, ...(name === undefined ? {} : { name }), cause })

// --- own connections ------------------------------------------------------------------------------

/** The connection settings of the backend's own connections, from the application's `PgClient`. */
export const clientConfig = (config: PgClientConfig, applicationName: string, connectTimeout: Duration.Duration): pg.ClientConfig => ({
  ...(config.url === undefined ? {} : { connectionString: Redacted.value(config.url) }),
  ...(config.host === undefined ? {} : { host: config.host }),
  ...(config.port === undefined ? {} : { port: config.port }),
  ...(config.database === undefined ? {} : { database: config.database }),
  ...(config.username === undefined ? {} : { user: config.username }),
  ...(config.password === undefined ? {} : { password: Redacted.value(config.password) }),
  ...(config.ssl === undefined ? {} : { ssl: config.ssl }),
  ...(config.stream === undefined ? {} : { stream: config.stream }),
  application_name: applicationName,
  connectionTimeoutMillis: Duration.toMillis(connectTimeout),
  // So that a peer that vanished is eventually noticed even on an idle connection.
  keepAlive: true,
  keepAliveInitialDelayMillis: 5_000
})

/** The error of a statement that failed or did not answer within its bound. */
const statementError = (operation: string, name: string | undefined, bound: Duration.Duration) => (cause: unknown) =>
  cause instanceof Driver.StatementTimeout ? timedOut(operation, name, bound)() : failed(operation, name)(cause)

/** A statement on a connection of `pool`. */
const statementOn = (pool: Driver.Pool): Lane["run"] => (operation, name, text, params, bound) =>
  // Taken before waiting for a connection: earlier than the send, so never later than the server's now().
  Effect.flatMap(monotonicMillis, (sentAt) =>
    // Rows of whatever shape the caller reads them as (`never` fits every `A`).
    pool.statement<never>(text, params, Duration.toMillis(bound)).pipe(
      Effect.map((rows) => ({ rows, sentAt })),
      Effect.mapError(statementError(operation, name, bound))
    ))

/**
 * LISTEN on a connection of its own, payloads handed over synchronously from the driver's event:
 * fails as soon as the connection errors or ends, and destroys the connection when it stops (an
 * UNLISTEN on a dead socket could hang).
 */
const listenOn = (driver: Driver.Driver, config: pg.ClientConfig, bound: Duration.Duration) =>
(channel: string, deliver: (payload: string) => void): Effect.Effect<void, LockBackendError> =>
  Effect.scoped(Effect.gen(function*() {
    const millis = Duration.toMillis(bound)
    const connection = yield* Effect.acquireRelease(
      Effect.mapError(Driver.connect(driver, config, millis), statementError("listen", undefined, bound)),
      Driver.destroy
    )
    const lost = yield* Deferred.make<never, LockBackendError>()
    const dead = () =>
      Deferred.unsafeDone(lost, Exit.fail(new LockBackendError({ operation: "listen", cause: new Error("the LISTEN connection was lost") })))
    const client = connection.client
    client.on("notification", (message) => {
      if (message.channel === channel && message.payload !== undefined && message.payload !== "") deliver(message.payload)
    })
    client.on("error", dead)
    client.on("end", dead)
    if (connection.broken) dead()
    yield* Driver.query(connection, `listen ${identifier(channel)}`, [], millis).pipe(
      Effect.mapError(statementError("listen", undefined, bound))
    )
    return yield* Deferred.await(lost)
  }))

/** The statement failed with a SQLSTATE the server refuses a whole statement with (its session is fine). */
const refusedAsWhole = (exit: Exit.Exit<unknown, unknown>): boolean =>
  Exit.isFailure(exit) && Option.match(Cause.failureOption(exit.cause), { onNone: () => false, onSome: resendable })

/** What the lane of own connections tells beside its statements (tests and benchmarks read it). */
export interface OwnLane {
  readonly openConnections: () => number
  /** Statements sent for two or more waiting ones (`pg/pool`). */
  readonly batchesSent: () => number
  /** Lock statements waiting for a connection. */
  readonly queuedStatements: () => number
}

/** The lane of connections the backend owns. */
export const own = (
  config: pg.ClientConfig,
  connections: number,
  listenBound: Duration.Duration,
  owner: Owner
): Effect.Effect<Lane & OwnLane, LockBackendError, Scope.Scope> =>
  Effect.gen(function*() {
    const driver = yield* Driver.load
    const lock = yield* ownPool(driver, config, connections, owner)
    const renewals = yield* ownPool(driver, config, RENEW_CONNECTIONS, owner)
    return {
      kind: "own",
      run: statementOn(lock),
      runNow: (operation, name, text, params, bound, done, batch) =>
        lock.statementNow(text, params, Duration.toMillis(bound), (error, rows) =>
          error === undefined ? done(undefined, rows as ReadonlyArray<never>) : done(statementError(operation, name, bound)(error)), batch),
      renew: (text, params, bound) => statementOn(renewals)("renew", undefined, text, params, bound),
      listen: listenOn(driver, config, listenBound),
      // Own renewal connections open on demand, in a few ms, whatever the application does.
      prepareRenewals: () => {},
      openConnections: () => lock.size() + renewals.size(),
      batchesSent: lock.batches,
      queuedStatements: lock.queued
    }
  })

/** A pool of own connections, closed with the scope; idle connections are closed after `IDLE_TIMEOUT`. */
const ownPool = (driver: Driver.Driver, config: pg.ClientConfig, size: number, owner: Owner) =>
  Effect.gen(function*() {
    const pool = yield* Effect.acquireRelease(Effect.sync(() => Driver.makePool(driver, config, size)), (pool) => Effect.sync(pool.close))
    const idleMillis = Duration.toMillis(IDLE_TIMEOUT)
    // The layer's work, on its owner (interruptible whatever the builder's region; stopped when the layer closes).
    yield* owner.fork(Effect.repeat(Effect.sync(() => pool.reap(idleMillis)), Schedule.spaced(Duration.millis(idleMillis / 2))))
    return pool
  })

// --- the application's SqlClient ------------------------------------------------------------------

/**
 * The lane over the application's `SqlClient`; `listen` is the `PgClient`'s when there is one.
 * Statements run as the layer's work (`owner`): outside any transaction of the caller, and
 * awaited by the caller for at most their bound, without waiting for the driver's cancel.
 */
export const application = (
  sql: SqlClient,
  listen: ((channel: string) => Stream.Stream<string, unknown>) | undefined,
  owner: Owner
): Effect.Effect<Lane, never, Scope.Scope> =>
  Effect.gen(function*() {
    const scope = yield* Effect.scope
    const run: Lane["run"] = <A extends object>(
      operation: string,
      name: string | undefined,
      text: string,
      params: ReadonlyArray<unknown>,
      bound: Duration.Duration
    ) =>
      Effect.flatMap(
        owner.fork(
          Effect.flatMap(monotonicMillis, (sentAt) =>
            Effect.map(sql.unsafe<A>(text, params).withoutTransform, (rows): Sent<A> => ({ rows, sentAt }))).pipe(
              Effect.mapError(failed(operation, name))
            )
        ),
        (fiber) =>
          Effect.flatMap(awaitWithin(fiber, Duration.toMillis(bound)), (done) =>
            Option.isSome(done)
              ? done.value
              // Past its bound: cancelled in the background (sql-pg cancels the query), not awaited.
              : Effect.zipRight(Fiber.interruptFork(fiber), Effect.fail(timedOut(operation, name, bound)()))).pipe(
              Effect.onInterrupt(() => Fiber.interruptFork(fiber))
            )
      )

    // The reserved renewal connection. Reserving runs in a fiber of the lane's own that is never
    // interrupted: sql-pg leaks the pool slot of a reserve interrupted while it waits.
    let reserved: { readonly connection: SqlConnection; readonly scope: Scope.CloseableScope } | undefined
    let reserving: Deferred.Deferred<{ readonly connection: SqlConnection; readonly scope: Scope.CloseableScope }, LockBackendError> | undefined
    const reservation = Effect.suspend(() => {
      if (reserved !== undefined) return Effect.succeed(reserved)
      if (reserving !== undefined) return Deferred.await(reserving)
      const pending = Deferred.unsafeMake<{ readonly connection: SqlConnection; readonly scope: Scope.CloseableScope }, LockBackendError>(
        FiberId.none
      )
      reserving = pending
      const reserve = Effect.gen(function*() {
        const own = yield* Scope.fork(scope, ExecutionStrategy.sequential)
        const connection = yield* Scope.extend(sql.reserve, own).pipe(
          Effect.tapError(() => Scope.close(own, Exit.void)),
          Effect.mapError(failed("renew", undefined))
        )
        return { connection, scope: own }
      }).pipe(
        Effect.exit,
        Effect.flatMap((exit) =>
          Effect.sync(() => {
            reserving = undefined
            if (Exit.isSuccess(exit)) reserved = exit.value
          }).pipe(Effect.zipRight(Deferred.done(pending, exit)))
        )
      )
      return Effect.zipRight(owner.fork(Effect.uninterruptible(reserve)), Deferred.await(pending))
    })
    const drop = (held: { readonly scope: Scope.CloseableScope }) =>
      Effect.suspend(() => {
        if (reserved !== held) return Effect.void
        reserved = undefined
        // Back to the application's pool: a connection cannot be destroyed through @effect/sql.
        return owner.fork(Scope.close(held.scope, Exit.void))
      })

    const renew: Lane["renew"] = <A extends object>(text: string, params: ReadonlyArray<unknown>, bound: Duration.Duration) =>
      withinOrFail(
        Effect.flatMap(reservation, (held) =>
          Effect.flatMap(monotonicMillis, (sentAt) =>
            Effect.disconnect(held.connection.execute(text, params, undefined)).pipe(
              Effect.map((rows): Sent<A> => ({ rows: rows as ReadonlyArray<A>, sentAt })),
              // Kept when the server refused the statement as a whole (a healthy session answered):
              // a new reservation could queue behind the application's own statements.
              Effect.onExit((exit) => (Exit.isSuccess(exit) || refusedAsWhole(exit) ? Effect.void : drop(held)))
            ))).pipe(Effect.mapError(failed("renew", undefined))),
        bound,
        timedOut("renew", undefined, bound)
      )

    return {
      kind: "application",
      run,
      renew,
      // Reserved at the first grant, before the application's pool may be saturated.
      prepareRenewals: () => {
        if (reserved === undefined && reserving === undefined) owner.unsafeFork(Effect.ignore(reservation))
      },
      listen: listen === undefined
        ? undefined
        : (channel, deliver) =>
          Stream.runForEach(listen(channel), (payload) => Effect.sync(() => deliver(payload))).pipe(
            Effect.mapError(failed("listen", undefined))
          )
    }
  })

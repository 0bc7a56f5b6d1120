/**
 * Lease rows in PostgreSQL, over any `SqlClient`: the backend for deployments behind a
 * transaction pooler (PgBouncer `pool_mode = transaction`), for long critical sections, and for
 * processes that hold many locks at once. Holding a lease costs no connection.
 *
 * **Table.** One row per lock name (default table `effect_lock_leases`, created on first use,
 * or by your own migration from `migration()`): `name` (text, primary key), `owner` (a random
 * uuid per acquisition, null when free), `token` (the fencing counter), `expires_at`, and who
 * holds or last held it (`acquired_at`, `holder_application`, `holder_host`, `holder_pid`).
 * Rows are never deleted — a released row keeps its token — so tokens increase forever per name.
 * Operators must not delete rows either: a deleted row's name starts again at token 1, below
 * tokens a `Fence` has already seen. `waiting_since` records that someone waits, so that only
 * contended releases notify.
 *
 * **Statements.** Every operation is ONE autocommit statement, so it is correct behind a
 * transaction pooler: acquire is an upsert that takes a free or expired row and bumps the token;
 * renew updates a whole batch of (name, owner) pairs at once (`renewBatchSize` 1000: 10,000
 * held leases cost 10 statements per renewal round) and says, for the misses, whether the lease
 * was `stolen` (a newer token), `expired` or `revoked`; release is owner-scoped — a holder whose
 * lease expired and was taken can neither renew nor release the new holder's lease — and
 * notifies waiters in the same statement.
 *
 * **Transactions.** Lock statements never run in the caller's transaction: a `withLock` inside
 * `sql.withTransaction` still takes, renews and releases its row in autocommit statements of
 * its own, on other pool connections (so the pool needs a connection besides the transaction's),
 * and a rollback of the caller's transaction undoes neither the grant's token bump nor the
 * release. The inspection and operator functions (`holders`, `listHolders`, `revoke`) are
 * ordinary statements: inside a transaction they run in it — they read its snapshot, and a
 * revoke takes effect when it commits. Neither bumps a token, so a rollback there is harmless.
 * Prefer the transaction inside the lock, `withLock(sql.withTransaction(body), name)`: with the
 * lock inside, it is released before the transaction commits, so the next holder may start
 * before the body's writes are visible.
 *
 * **Durability of tokens.** A token is only as durable as the commit that bumped it: with
 * `synchronous_commit = off` (for the role, database or server) a crash can lose the last
 * grants' commits and the token repeats after recovery; likewise a failover to an asynchronous
 * replica. Keep `synchronous_commit` at `on` or above where leases guard fenced writes (an
 * autocommit statement cannot `set local` it, so this backend cannot set it for you).
 *
 * **Time.** Expiry is computed and compared with the server's `now()` only; the ttl travels as
 * milliseconds. The local clock only measures durations, on the monotonic timeline
 * (`Clock.currentTimeNanos`), never the wall clock that NTP may step: a grant or renewal is
 * valid locally until (monotonic time before the statement was sent) + ttl, which is never
 * later than the server's expiry — also when the answer arrives late (then little or none of
 * it is left, and `DistributedLock` gives such a grant back at once). A client clock hours off
 * changes nothing.
 *
 * **Renewal and loss.** `DistributedLock` renews every ttl/3 and gives a lease up
 * (`LockLost { reason: "renewal-failed" }`) when ttl/5 is left on its local deadline without a
 * successful renewal, before the store can let anyone else in. Hence the default ttl of 30 s
 * and the floor of 1 s: shorter requests are clamped up.
 *
 * **Waiting.** A waiter retries when it is woken by a notification (LISTEN/NOTIFY on a
 * dedicated connection via `PgClient.listen`, when a `PgClient` is provided), when the holder's
 * lease runs out (the failed attempt returns the remaining time), or on a jittered poll. The
 * listener proves it hears with pings through the pool while anyone waits; when it cannot
 * (PgBouncer transaction mode, a killed LISTEN backend, only a plain `SqlClient`) waiters poll
 * every `pollInterval` (default 500 ms, jittered down to half of it).
 *
 * **Shared mode** is not supported yet: asking for it fails with a `LockBackendError` saying so.
 *
 * @since 0.1.0
 */
import * as SqlClient from "@effect/sql/SqlClient"
import type { PgClient } from "@effect/sql-pg/PgClient"
import * as Config from "effect/Config"
import type * as ConfigError from "effect/ConfigError"
import * as Context from "effect/Context"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import type * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Random from "effect/Random"
import * as Schedule from "effect/Schedule"
import type * as Scope from "effect/Scope"
import * as Crypto from "node:crypto"
import * as Os from "node:os"
import * as DistributedLock from "./DistributedLock.js"
import * as FencingToken from "./FencingToken.js"
import type { AcquireRequest, AcquireResult, Grant, LockBackend, RenewOutcome } from "./LockBackend.js"
import { LockBackendError } from "./LockError.js"
import { monotonicMillis } from "./internal/clock.js"
import * as Sql from "./internal/pgLeaseSql.js"
import { sqlStateOf } from "./internal/sqlState.js"
import { CATALOG_RACE, CREATE_ATTEMPTS } from "./internal/sqlTable.js"
import * as Wake from "./internal/pgLeaseWake.js"

/**
 * Options of the lease backend.
 *
 * - `table`: `name` or `schema.name` (plain identifiers, used quoted, so case is kept); default
 *   `effect_lock_leases`.
 * - `ttl`: default lease length, 30 s (floor 1 s). Renewed every ttl/3, given up at ttl/5 left.
 * - `listen`: `"auto"` (default) listens for release notifications when a `PgClient` is in
 *   the context and they prove to arrive, else polls; `true` requires a `PgClient` (the layer
 *   fails without one) and keeps restarting a dead listener; `false` only polls.
 * - `channel`: the NOTIFY channel; default the table's own name (≤ 63 bytes). Releases always
 *   notify, whatever `listen` says, so mixed deployments wake each other.
 * - `pollInterval`: retry interval of waiters without notifications; default 500 ms, jittered
 *   to between half and all of it.
 * - `listenCheckInterval`: while anyone waits, how often the listener proves it still hears
 *   (default 5 s); a waiter relying on notifications re-reads the row at least every 6 of these.
 * - `statementTimeout`: client-side bound on one acquire attempt or release; default 5 s.
 * - `createTable`: create the table on first use (default true); set false when your migrations
 *   run `migration()` and the application's role may not create tables.
 * - `applicationName`: written to `holder_application`; default the `PgClient`'s
 *   application name, else `effect-lock`.
 *
 * @since 0.1.0
 * @category models
 */
export interface Options {
  readonly table?: string | undefined
  readonly ttl?: Duration.DurationInput | undefined
  readonly listen?: boolean | "auto" | undefined
  readonly channel?: string | undefined
  readonly pollInterval?: Duration.DurationInput | undefined
  readonly listenCheckInterval?: Duration.DurationInput | undefined
  readonly statementTimeout?: Duration.DurationInput | undefined
  readonly createTable?: boolean | undefined
  readonly applicationName?: string | undefined
}

/**
 * A lease row held by this process.
 *
 * @since 0.1.0
 * @category models
 */
export interface PgLeaseGrant extends Grant {
  readonly name: string
  /** The random owner token of this acquisition, as stored in the row. */
  readonly owner: string
  readonly ttlMillis: number
}

/**
 * The default table name.
 *
 * @since 0.1.0
 * @category constants
 */
export const DEFAULT_TABLE = "effect_lock_leases"

/** Longest lock name, in UTF-8 bytes; a btree entry could take ~2700, this leaves room. */
const MAX_NAME_BYTES = 1024
/** Renewals per statement: big enough that 10,000 leases renew in 10 statements, small enough to stay fast. */
const RENEW_BATCH_SIZE = 1000
const DEFAULT_TTL = Duration.seconds(30)
const MIN_TTL = Duration.seconds(1)
const DEFAULT_POLL = Duration.millis(500)
const DEFAULT_CHECK = Duration.seconds(5)
/** How long closing the layer waits for abandoned attempts to give their rows back. */
const SHUTDOWN_GIVE_BACK = Duration.seconds(3)
const DEFAULT_STATEMENT_TIMEOUT = Duration.seconds(5)
const DEFAULT_APPLICATION = "effect-lock"
/**
 * While notifications are proven to arrive, a waiter still re-reads the row at least every
 * this many check intervals, in case a wake-up was lost on a healthy-looking listener. A dead
 * listener is caught sooner, by its next check, which wakes every waiter.
 */
const TRUSTED_POLL_FACTOR = 6
/** Attempts of a release before it gives up and leaves the lease to expire. */
const RELEASE_RETRIES = 2
const RELEASE_RETRY_SPACING = Duration.millis(50)

/**
 * sql-pg's tag, referenced by key so that this module needs no driver at run time: any
 * `SqlClient` works, and a `PgClient` found in the context only adds LISTEN.
 */
const PgClientTag = Context.GenericTag<PgClient>("@effect/sql-pg/PgClient")

/** The validated table (default when absent), or the configuration error that names the problem. */
const resolveTable = (table: string | undefined): Effect.Effect<Sql.TableRef, LockBackendError> => {
  const parsed = Sql.parseTable(table ?? DEFAULT_TABLE)
  return typeof parsed === "string" ? Effect.fail(configError(parsed)) : Effect.succeed(parsed)
}

const configError = (reason: string) =>
  new LockBackendError({ operation: "configure", cause: new Error(`PgLease: ${reason}`) })


/**
 * The SQL that creates the lease table, for applications that run their own migrations (then
 * pass `createTable: false`). Idempotent. Throws on an invalid identifier (a programming error).
 *
 * Never delete rows of this table (no cleanup job, no `truncate`): a row carries its name's
 * fencing counter, and a deleted name starts again at token 1 — a stale token to every `Fence`.
 *
 * @since 0.1.0
 * @category migrations
 */
export const migration = (table: string = DEFAULT_TABLE): string => {
  const ref = Sql.parseTable(table)
  if (typeof ref === "string") throw new TypeError(`PgLease.migration: ${ref}`)
  return `${Sql.createTable(ref)};\n`
}

interface Statements {
  readonly run: <A extends object>(
    operation: string,
    name: string | undefined,
    text: string,
    params: ReadonlyArray<unknown>
  ) => Effect.Effect<ReadonlyArray<A>, LockBackendError>
}

/**
 * `own`: each statement runs outside any transaction of the caller (lock operations); otherwise
 * it runs wherever the caller runs it (inspection and operator tools).
 */
const statements = (sql: SqlClient.SqlClient, placement: "own" | "caller's"): Statements => ({
  run: <A extends object>(operation: string, name: string | undefined, text: string, params: ReadonlyArray<unknown>) => {
    const statement = sql.unsafe<A>(text, params).withoutTransform.pipe(
      Effect.mapError((cause) => new LockBackendError({ operation, ...(name === undefined ? {} : { name }), cause }))
    )
    return placement === "own" ? Sql.outsideTransaction(statement) : statement
  }
})

/**
 * Forks into `scope` a fiber that does not inherit the caller's transaction connection: the
 * backend's own fibers (grant statement, give-back of an abandoned attempt) outlive the
 * caller's transaction, and must never send a statement on its connection.
 */
const forkOutside = <A, E, R>(self: Effect.Effect<A, E, R>, scope: Scope.Scope) =>
  Sql.outsideTransaction(Effect.forkIn(self, scope))

type Attempt =
  | { readonly _tag: "Granted"; readonly grant: PgLeaseGrant }
  | { readonly _tag: "Busy"; readonly wakeAt: number | undefined }
  | { readonly _tag: "TimedOut" }

/**
 * Builds the backend (the SPI), for `DistributedLock.make` or for tests that wrap it. The table
 * is created on the first acquire, not here, so an application can start while the database is
 * down. Fails only on invalid options.
 *
 * @since 0.1.0
 * @category constructors
 */
export const makeBackend = (
  options?: Options
): Effect.Effect<LockBackend<PgLeaseGrant>, LockBackendError, SqlClient.SqlClient | Scope.Scope> =>
  Effect.gen(function*() {
    const table = yield* resolveTable(options?.table)
    const channel = options?.channel ?? table.relname
    const badChannel = Sql.checkChannel(channel)
    if (badChannel !== undefined) return yield* configError(badChannel)

    const sql = yield* SqlClient.SqlClient
    const pg = yield* Effect.serviceOption(PgClientTag)
    const listenOption = options?.listen ?? "auto"
    if (listenOption === true && Option.isNone(pg)) {
      return yield* configError("listen: true needs a PgClient in the context (or use listen: \"auto\" to poll without one)")
    }
    const scope = yield* Effect.scope
    // Give-backs of abandoned attempts are awaited (bounded) when the layer closes: cut short,
    // they would leave a row held until its ttl runs out. Added first, so it runs last, after
    // the grant fibers in `scope` are stopped and while the pool is still open.
    const givingBack = new Set<Fiber.RuntimeFiber<void>>()
    yield* Effect.addFinalizer(() =>
      Effect.forEach(Array.from(givingBack), Fiber.await, { discard: true }).pipe(
        Effect.timeout(SHUTDOWN_GIVE_BACK),
        Effect.ignore,
        Effect.zipRight(Effect.forEach(Array.from(givingBack), Fiber.interrupt, { discard: true }))
      )
    )
    // Every lock statement runs in an autocommit transaction of its own, never the caller's.
    const { run } = statements(sql, "own")

    const pollMillis = Duration.toMillis(Duration.decode(options?.pollInterval ?? DEFAULT_POLL))
    const checkInterval = Duration.decode(options?.listenCheckInterval ?? DEFAULT_CHECK)
    const statementTimeout = Duration.decode(options?.statementTimeout ?? DEFAULT_STATEMENT_TIMEOUT)
    const statementMillis = Duration.toMillis(statementTimeout)
    const application = options?.applicationName ??
      Option.getOrUndefined(Option.flatMapNullable(pg, (client) => client.config.applicationName)) ??
      DEFAULT_APPLICATION
    const host = Os.hostname()
    const text = {
      ensureTable: Sql.ensureTable(table),
      acquire: Sql.acquire(table),
      renew: Sql.renew(table),
      release: Sql.release(table)
    }

    const hub = listenOption === false || Option.isNone(pg)
      ? undefined
      : yield* Wake.make({
        listen: pg.value.listen,
        notify: (ch, payload) => run("notify", undefined, Sql.ping, [ch, payload]),
        channel,
        checkInterval,
        mode: listenOption === true ? "always" : "auto"
      }, scope)

    // The table is created once per backend; a failure is retried by the next acquire.
    let tableReady = options?.createTable === false
    const tableLock = yield* Effect.makeSemaphore(1)
    const ensureTable = Effect.suspend(() =>
      tableReady ? Effect.void : tableLock.withPermits(1)(
        Effect.suspend(() =>
          tableReady ? Effect.void : run("create-table", undefined, text.ensureTable, []).pipe(
            Effect.retry({
              times: CREATE_ATTEMPTS - 1,
              while: (error) => CATALOG_RACE.has(sqlStateOf(error) ?? "")
            }),
            Effect.tap(() =>
              Effect.sync(() => {
                tableReady = true
              })
            )
          )
        )
      )
    )

    const releaseRow = (name: string, owner: string) =>
      run<{ released: boolean }>("release", name, text.release, [
        name,
        owner,
        channel,
        Sql.RELEASED_PREFIX + name
      ])

    /**
     * An attempt whose outcome nobody will read (interrupted, timed out, failed ambiguously) may
     * still have taken the row: once it settles, its owner — unique to that attempt — gives the
     * row back. If the database stays unreachable, the lease simply expires after its ttl.
     */
    const abandon = (fiber: Fiber.Fiber<Attempt, LockBackendError>, name: string, owner: string, ttlMillis: number) =>
      Sql.outsideTransaction(Effect.forkDaemon(
        Effect.flatMap(Fiber.await(fiber), (exit) =>
          Exit.isSuccess(exit) && exit.value._tag === "Busy" ? Effect.void : releaseRow(name, owner).pipe(
            Effect.retry(Schedule.exponential(Duration.millis(50)).pipe(Schedule.upTo(Duration.millis(ttlMillis)))),
            Effect.ignore
          )).pipe(Effect.interruptible)
      )).pipe(
        Effect.tap((giveBack) =>
          Effect.sync(() => {
            givingBack.add(giveBack)
            giveBack.addObserver(() => givingBack.delete(giveBack))
          })
        ),
        Effect.asVoid
      )

    const grantStatement = (
      name: string,
      owner: string,
      ttlMillis: number,
      mark: boolean
    ): Effect.Effect<Attempt, LockBackendError> =>
      Effect.gen(function*() {
        yield* ensureTable
        // Monotonic time before sending: the server's expiry is at least this plus the ttl, also
        // when the answer comes late (a row lock, a slow network). `validUntil` is never measured
        // from the answer's arrival: the core compares it with the arrival to drop a late grant.
        const sentAt = yield* monotonicMillis
        const rows = yield* run<{ token: string | null; wait: number | null }>("acquire", name, text.acquire, [
          name,
          owner,
          ttlMillis,
          application,
          host,
          process.pid,
          mark
        ])
        const receivedAt = yield* monotonicMillis
        const row = rows[0]
        if (row !== undefined && row.token !== null) {
          return {
            _tag: "Granted",
            grant: {
              name,
              owner,
              ttlMillis,
              token: FencingToken.make(BigInt(row.token)),
              validUntil: Option.some(sentAt + ttlMillis),
              release: releaseGrant(name, owner)
            }
          } as const
        }
        // The holder's lease runs out at the latest `wait` ms after the server read it.
        const wait = row?.wait ?? null
        return { _tag: "Busy", wakeAt: wait === null ? undefined : receivedAt + Math.ceil(wait) + 1 } as const
      })

    const releaseGrant = (name: string, owner: string): Effect.Effect<void, LockBackendError> =>
      releaseRow(name, owner).pipe(
        // Owner-scoped and idempotent, so a retry after an ambiguous failure is safe.
        Effect.retry({ times: RELEASE_RETRIES, schedule: Schedule.spaced(RELEASE_RETRY_SPACING) }),
        // Not waiting for the driver's cancel of a stuck statement; the lease expires by itself.
        Effect.disconnect,
        Effect.timeoutFail({
          duration: statementTimeout,
          onTimeout: () =>
            new LockBackendError({
              operation: "release",
              name,
              cause: new Error(`release did not complete within ${Duration.format(statementTimeout)}`)
            })
        }),
        Effect.asVoid
      )

    /**
     * One grant attempt. The statement runs in its own fiber so that the caller can stop
     * waiting for it (interruption, deadline, statement timeout) without the outcome being
     * lost: an abandoned attempt gives back whatever it took.
     */
    const attempt = (request: AcquireRequest, first: boolean): Effect.Effect<Attempt, LockBackendError> =>
      Effect.gen(function*() {
        // The deadline is on the monotonic timeline (the SPI's contract).
        const now = yield* monotonicMillis
        const remaining = Option.map(request.deadline, (deadline) => deadline - now)
        if (Option.isSome(remaining) && remaining.value <= 0 && !first) return { _tag: "TimedOut" } as const
        // A zero timeout still gets its one attempt, bounded by the statement timeout.
        const byDeadline = Option.isSome(remaining) && remaining.value > 0 && remaining.value < statementMillis
        const bound = byDeadline ? Option.getOrThrow(remaining) : statementMillis
        const owner = Crypto.randomUUID()
        const ttlMillis = Duration.toMillis(request.ttl)
        // A waiter marks the row wanted, so that the holder's release notifies.
        const mark = request.attempt === "wait"
        const fiber = yield* forkOutside(
          Effect.interruptible(grantStatement(request.name, owner, ttlMillis, mark)),
          scope
        )
        const settled = yield* request.interruptible(Effect.timeoutOption(Fiber.await(fiber), Duration.millis(bound))).pipe(
          Effect.onInterrupt(() => abandon(fiber, request.name, owner, ttlMillis))
        )
        if (Option.isNone(settled)) {
          yield* abandon(fiber, request.name, owner, ttlMillis)
          if (byDeadline) return { _tag: "TimedOut" } as const
          return yield* new LockBackendError({
            operation: "acquire",
            name: request.name,
            cause: new Error(`the acquire statement did not complete within ${Duration.format(statementTimeout)}`)
          })
        }
        const exit = settled.value
        if (Exit.isFailure(exit)) yield* abandon(fiber, request.name, owner, ttlMillis)
        return yield* exit
      })

    const sleepFor = (wakeAt: number | undefined) =>
      Effect.gen(function*() {
        // With a listener that proves it hears, a waiter sleeps until the holder's lease ends
        // (a crashed holder sends nothing) or a long re-check. Otherwise it polls, jittered — also
        // when the attempt could not read the holder's row, since it could not mark it wanted.
        const trusted = hub !== undefined && wakeAt !== undefined && (yield* hub.trusted)
        const jitter = yield* Random.next
        const cap = trusted ? Duration.toMillis(checkInterval) * TRUSTED_POLL_FACTOR : pollMillis * (0.5 + jitter / 2)
        const now = yield* monotonicMillis
        const untilExpiry = wakeAt === undefined ? Number.POSITIVE_INFINITY : wakeAt - now
        return Duration.millis(Math.max(0, Math.min(cap, untilExpiry)))
      })

    const acquire = (request: AcquireRequest): Effect.Effect<AcquireResult<PgLeaseGrant>, LockBackendError> =>
      Effect.gen(function*() {
        if (request.mode !== "exclusive") {
          return yield* new LockBackendError({
            operation: "acquire",
            name: request.name,
            cause: new Error("the PgLease backend does not support shared mode yet; use mode \"exclusive\"")
          })
        }
        // Subscribed before the first attempt, so a release landing between a failed attempt
        // and the wait still wakes this waiter.
        const subscription = request.attempt === "wait" && hub !== undefined
          ? yield* hub.subscribe(request.name)
          : undefined
        let first = true
        while (true) {
          const wake = subscription === undefined ? undefined : yield* subscription.current
          const result = yield* attempt(request, first)
          first = false
          if (result._tag !== "Busy") return result
          if (request.attempt === "once") return { _tag: "Busy" } as const
          const delay = yield* sleepFor(result.wakeAt)
          const wait = wake === undefined ? Effect.sleep(delay) : Effect.raceFirst(Deferred.await(wake), Effect.sleep(delay))
          // Only waits are interruptible or cut at the deadline; they grant nothing.
          const woke = yield* request.waitUntilDeadline(wait)
          if (Option.isNone(woke)) return { _tag: "TimedOut" } as const
        }
      }).pipe(Effect.scoped)

    const renew = (grants: ReadonlyArray<PgLeaseGrant>): Effect.Effect<ReadonlyArray<RenewOutcome>, LockBackendError> =>
      grants.length === 0 ? Effect.succeed([]) : Effect.gen(function*() {
        // Monotonic time before sending: the renewed expiry on the server is at least this plus the ttl.
        const sentAt = yield* monotonicMillis
        const rows = yield* run<{ idx: number; outcome: string }>("renew", undefined, text.renew, [
          grants.map((g) => g.name),
          grants.map((g) => g.owner),
          grants.map((g) => g.token.toString()),
          grants.map((g) => g.ttlMillis)
        ])
        if (rows.length !== grants.length) {
          return yield* new LockBackendError({
            operation: "renew",
            cause: new Error(`renewal returned ${rows.length} outcomes for ${grants.length} leases`)
          })
        }
        return rows.map((row, i): RenewOutcome => {
          switch (row.outcome) {
            case "renewed":
              return { _tag: "Renewed", validUntil: sentAt + grants[i]!.ttlMillis }
            case "stolen":
              return { _tag: "Lost", reason: "stolen" }
            case "expired":
              return { _tag: "Lost", reason: "expired" }
            default:
              return { _tag: "Lost", reason: "revoked" }
          }
        })
      }).pipe(
        // The caller bounds each renewal; it must not wait for the driver's cancel of a stuck
        // statement. A renewal landing late is harmless: it matches only rows still ours.
        Effect.disconnect
      )

    return {
      backend: "pg-lease",
      maxNameBytes: MAX_NAME_BYTES,
      defaultTtl: Duration.decode(options?.ttl ?? DEFAULT_TTL),
      minTtl: MIN_TTL,
      renewBatchSize: RENEW_BATCH_SIZE,
      acquire,
      renew
    }
  })

/**
 * A `DistributedLock` on lease rows, over the `SqlClient` in the context (for example
 * `PgClient.layer({ url })`; a `PgClient` also enables LISTEN wake-ups). Fails only on invalid
 * options.
 *
 * @since 0.1.0
 * @category layers
 */
export const layer = (
  options?: Options
): Layer.Layer<DistributedLock.DistributedLock, LockBackendError, SqlClient.SqlClient> =>
  DistributedLock.layerBackend(makeBackend(options))

/**
 * `layer` with its options read from configuration, e.g.
 * `PgLease.layerConfig({ table: Config.string("LOCK_TABLE"), ttl: Config.duration("LOCK_TTL") })`.
 *
 * @since 0.1.0
 * @category layers
 */
export const layerConfig = (
  config: Config.Config.Wrap<Options>
): Layer.Layer<DistributedLock.DistributedLock, LockBackendError | ConfigError.ConfigError, SqlClient.SqlClient> =>
  DistributedLock.layerBackend(Effect.flatMap(Config.unwrap(config), makeBackend))

/**
 * A live lease as stored in the table.
 *
 * @since 0.1.0
 * @category models
 */
export interface StoredLease {
  readonly name: string
  readonly token: FencingToken.FencingToken
  /** Server time (ms since epoch) when the lease runs out unless renewed. */
  readonly expiresAt: number
  readonly acquiredAt: number
  readonly application: string | null
  readonly host: string | null
  readonly pid: number | null
  /** Server time (ms since epoch) since when someone has been waiting for it, if anyone. */
  readonly waitingSince: number | null
}

/**
 * The leases held right now across the cluster (all names, or one), read from the table: what
 * an operator or a test inspects.
 *
 * @since 0.1.0
 * @category inspection
 */
export const holders = (
  options?: { readonly table?: string | undefined; readonly name?: string | undefined }
): Effect.Effect<ReadonlyArray<StoredLease>, LockBackendError, SqlClient.SqlClient> =>
  Effect.gen(function*() {
    const table = yield* resolveTable(options?.table)
    const { run } = statements(yield* SqlClient.SqlClient, "caller's")
    const rows = yield* run<{
      name: string
      token: string
      expires: number
      acquired: number
      application: string | null
      host: string | null
      pid: number | null
      waiting: number | null
    }>("holders", options?.name, Sql.holders(table), [options?.name ?? null])
    return rows.map((row) => ({
      name: row.name,
      token: FencingToken.make(BigInt(row.token)),
      expiresAt: row.expires,
      acquiredAt: row.acquired,
      application: row.application,
      host: row.host,
      pid: row.pid,
      waitingSince: row.waiting
    }))
  })

/**
 * The leases held right now across the cluster, with who holds each (application, host, pid),
 * its fencing token and its times: `holders` for inspection tools. A table that does not exist
 * yet holds no lease, so it gives an empty list rather than an error. Failures are
 * `LockBackendError { operation: "inspect" }`.
 *
 * @since 0.1.0
 * @category inspection
 */
export const listHolders = (
  options?: { readonly table?: string | undefined; readonly name?: string | undefined }
): Effect.Effect<ReadonlyArray<StoredLease>, LockBackendError, SqlClient.SqlClient> =>
  Effect.gen(function*() {
    const table = yield* resolveTable(options?.table)
    const { run } = statements(yield* SqlClient.SqlClient, "caller's")
    const found = yield* run<{ present: boolean }>(
      "inspect",
      options?.name,
      "select to_regclass($1::text) is not null as present",
      [table.sql]
    )
    if (found[0]?.present !== true) return []
    return yield* holders(options).pipe(
      Effect.mapError((error) =>
        error.operation === "holders"
          ? new LockBackendError({ operation: "inspect", ...(options?.name === undefined ? {} : { name: options.name }), cause: error.cause })
          : error
      )
    )
  }).pipe(Effect.withSpan("effect-lock.inspect", { attributes: { backend: "pg-lease" } }))

/**
 * Takes the lock `name` away from whoever holds it and wakes waiters. The holder learns at its
 * next renewal (within ttl/3) and fails with `LockLost { reason: "revoked" }`; until then it
 * may still be working, so revoke only what you know to be stuck. Returns whether a lease was held.
 *
 * @since 0.1.0
 * @category combinators
 */
export const revoke = (
  name: string,
  options?: { readonly table?: string | undefined; readonly channel?: string | undefined }
): Effect.Effect<boolean, LockBackendError, SqlClient.SqlClient> =>
  Effect.gen(function*() {
    const table = yield* resolveTable(options?.table)
    const { run } = statements(yield* SqlClient.SqlClient, "caller's")
    const rows = yield* run("revoke", name, Sql.revoke(table), [
      name,
      options?.channel ?? table.relname,
      Sql.RELEASED_PREFIX + name
    ])
    return rows.length > 0
  })

/**
 * The defaults, for documentation and tests.
 *
 * @since 0.1.0
 * @category constants
 */
export const defaults = {
  ttl: DEFAULT_TTL,
  minTtl: MIN_TTL,
  pollInterval: DEFAULT_POLL,
  listenCheckInterval: DEFAULT_CHECK,
  statementTimeout: DEFAULT_STATEMENT_TIMEOUT,
  renewBatchSize: RENEW_BATCH_SIZE,
  maxNameBytes: MAX_NAME_BYTES
} as const

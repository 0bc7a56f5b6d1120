/**
 * Lease rows in SQLite: locks for processes on one host with no database server — a CLI and its
 * daemon, cluster-mode workers, a desktop app. The same lease engine as `PgLease` (same tables,
 * same semantics: fencing tokens, FIFO fairness, shared mode, batched renewal), over
 * `@effect/sql-sqlite-node` (better-sqlite3) on a database file the processes share.
 *
 * **Connection.** The layer opens a `SqliteClient` of its own on the file — `filename`, else the
 * file of the application's `SqliteClient` in the context — and uses it for nothing else. Why:
 * sql-sqlite-node serialises every statement of a client on its one connection, so on the
 * application's client a lock statement (a renewal) would queue behind the application's
 * statements and inside its transactions. With a connection of its own a lock statement waits
 * for nothing in this process but one running statement (the driver is synchronous: a statement
 * holds the connection only while it runs), and never runs in the application's transaction.
 *
 * **One writer per file.** SQLite lets one connection write at a time, whatever the process.
 * Every lock operation is one short write (microseconds), but the application's own write
 * transactions on the same file hold that lock for as long as they run, and a renewal waits
 * for them. If the application keeps write transactions open for a sizeable part of the ttl,
 * give the locks a file of their own (`filename: "locks.db"` beside the application's): then no
 * application write ever delays a renewal.
 *
 * **Waiting for the write lock, bounded.** better-sqlite3 is synchronous: while a statement waits
 * for the write lock, the event loop of its process is blocked. Each try waits at most
 * `busyTimeout` (SQLite's `busy_timeout`, default 50 ms); a try that still finds the lock taken
 * (SQLITE_BUSY) is retried after an asynchronous pause of 5–10 ms — the event loop runs — until
 * `statementTimeout` (default 5 s), after which the operation fails with `LockBackendError`. So a
 * lock operation blocks the event loop for at most about `busyTimeout` at a time, never for a
 * whole long write transaction of someone else.
 *
 * **Statements.** Every operation is ONE statement (an acquire attempt, a release, a renewal of a
 * batch of up to 1000 leases, a revoke): SQLite has no data-modifying CTEs, so a statement that
 * writes several rows is an `insert … returning` into the operations table `<table>_op`, whose
 * trigger carries the writes out and deletes the row (the table is always empty). The statement
 * reads, decides and writes under SQLite's write lock, so nothing changes between its decision
 * and its writes, and no transaction is ever left open across an await. An attempt that changes
 * nothing (a waiter keeping a fresh place) writes nothing.
 *
 * **Tables.** Those of `PgLease` (default `effect_lock_leases`, its queue `<table>_queue`, its
 * semaphores `<table>_sem`), plus `<table>_op` and its triggers; created when the layer is built (`createTable: false` when your
 * migrations run `migration()`). Times are integers, milliseconds since the epoch. Tokens come
 * from the file's one counter (`effect_lock_tokens`), so the rows of idle names are swept
 * (`sweepInterval`) and tokens still increase forever per name. The file
 * is put in WAL mode (persistent for the file), so readers never block the writer.
 *
 * **Durability of tokens.** better-sqlite3 keeps SQLite's default `synchronous = FULL`: in WAL
 * mode every commit is flushed to disk, so after a crash (of a process, or of the machine) a
 * token never repeats. Do not lower it on this file for the locks' sake.
 *
 * **Time.** Expiry is computed and compared with the database's clock only (`unixepoch('subsec')`,
 * SQLite ≥ 3.42; better-sqlite3 12 bundles 3.5x), read inside each statement. On one host that is
 * the same clock for every process, but it is still never the process's `Date.now()` captured
 * before an await. Locally a grant is valid until (monotonic time before the statement was sent)
 * + ttl, never later than its expiry in the table. The database's clock is the host's wall clock:
 * a step of it forward (NTP correcting a clock that ran slow) shortens every live lease by the
 * step, as a step of the server's clock does for `PgLease` — keep the host's clock slewed, not
 * stepped, if leases guard work that must never overlap.
 *
 * **Renewal and loss.** As `PgLease`: `DistributedLock` renews every ttl/3 and gives a lease up
 * (`LockLost { reason: "renewal-failed" }`) when ttl/5 is left without a successful renewal;
 * a renewal says `stolen`, `expired` or `revoked` for a lease it could not renew. Default ttl
 * 30 s, floor 1 s.
 *
 * **Waiting.** Waiters are served in arrival order (the queue table), shared requests queue behind
 * a waiting exclusive one. A release returns the waiters now at the head: those in the releasing
 * process are woken at once. SQLite has no notifications, so waiters in other processes poll, every
 * `pollInterval` (default 50 ms, jittered down to half of it): a handoff across processes takes
 * about half the interval on average. A waiter also retries when the holder's lease runs out.
 *
 * **Semaphores.** The layer provides `DistributedSemaphore` too (N permits per name), on the same
 * connection and with the same guarantees as `PgLease`'s: one row per semaphore name in
 * `<table>_sem` holding its limit, fencing counter (a token per permit), live holders and waiters
 * (JSON arrays); each operation is one statement under SQLite's write lock, so never more than
 * `limit` permits are held; waiters are served in arrival order (a release wakes the waiters at
 * the head that now fit: at once in the releasing process, by their poll elsewhere); a name in use
 * with another limit refuses a request with `LimitMismatch`.
 *
 * **Transactions.** Lock statements never run in the caller's transaction (they have their own
 * connection): a rollback of the application's transaction undoes neither a grant nor a release.
 * `holders`, `listHolders` and `revoke` are ordinary statements of the caller's `SqlClient`
 * (inside its transaction if any). `Fence.check` is PostgreSQL-only for now.
 *
 * **Crashes.** A process killed while holding a lease keeps it until its ttl runs out; then the
 * next waiter takes it over (with a higher token).
 *
 * @since 0.1.0
 */
import type * as SqlClient from "@effect/sql/SqlClient"
import type { SqliteClient } from "@effect/sql-sqlite-node/SqliteClient"
import * as Config from "effect/Config"
import type * as ConfigError from "effect/ConfigError"
import * as Effect from "effect/Effect"
import type * as Layer from "effect/Layer"
import type * as Scope from "effect/Scope"
import type * as DistributedLock from "./DistributedLock.js"
import * as DistributedSemaphore from "./DistributedSemaphore.js"
import type { LockAndSemaphoreBackend } from "./LockBackend.js"
import type { LockBackendError } from "./LockError.js"
import type * as Attempt from "./internal/lease/attempt.js"
import * as Operator from "./internal/lease/operator.js"
import * as LeaseOptions from "./internal/lease/options.js"
import type * as Permits from "./internal/lease/permits.js"
import * as Make from "./internal/lease/sqlite/make.js"

/**
 * Options of the SQLite lease backend.
 *
 * - `filename`: the database file the processes share. Default: the file of the `SqliteClient`
 *   in the context (an in-memory database is refused: it cannot be shared). A file of its own
 *   keeps the application's write transactions from delaying renewals.
 * - `table`: a plain identifier (no schema), used quoted; default `effect_lock_leases`. Its queue
 *   table adds `_queue`, its operations table `_op`.
 * - `ttl`: default lease length, 30 s (floor 1 s). Renewed every ttl/3, given up at ttl/5 left.
 * - `pollInterval`: how often a waiter retries (waiters of other processes cannot be notified);
 *   default 50 ms, jittered to between half and all of it.
 * - `busyTimeout`: longest one statement blocks the event loop waiting for SQLite's write lock
 *   before it retries asynchronously; default 50 ms.
 * - `statementTimeout`: bound on each operation, retries included; default 5 s.
 * - `createTable`: create the tables when the layer is built (default true). With false, re-run
 *   `migration()` after an upgrade: it also makes the file's one token counter
 *   (`effect_lock_tokens`), raised above every token already in the tables.
 * - `sweepInterval`: how often this layer deletes the rows of idle names (nobody holds or waits;
 *   their tokens come from the file's one counter, so a name's next grant still gets a larger
 *   one); default 5 s, zero: never. A process of the previous version on the same file gets an
 *   error, never a smaller token, when it grants a name whose row was swept.
 * - `applicationName`: written to `holder_application`; default `effect-lock`.
 *
 * @since 0.1.0
 * @category models
 */
export interface Options extends Make.Options {}

/**
 * A lease held by this process: its row in the database file's lease table (a shared holder's in
 * the queue table), renewed by the backend.
 *
 * @since 0.1.0
 * @category models
 */
export interface SqliteLeaseGrant extends Attempt.LeaseGrant {}

/**
 * Permits of a semaphore held by this process: one holder entry (an element of a JSON array) of
 * the semaphore's row.
 *
 * @since 0.1.0
 * @category models
 */
export interface SqliteLeasePermitGrant extends Permits.PermitLeaseGrant {}

/**
 * The default table name, in the database file's main schema.
 *
 * @since 0.1.0
 * @category constants
 */
export const DEFAULT_TABLE = LeaseOptions.DEFAULT_TABLE

/**
 * The SQL that creates the tables and triggers, for applications that run their own migrations
 * (then pass `createTable: false`): idempotent statements separated by `;` lines. Throws on an
 * invalid identifier (a programming error).
 *
 * Never delete rows of the lease table: a row carries its name's fencing counter.
 *
 * @since 0.1.0
 * @category migrations
 */
export const migration = (table: string = DEFAULT_TABLE): string => Make.migration(table)

/**
 * Builds the backend (the SPI), for `DistributedLock.make` or for tests that wrap it: opens the
 * backend's own connection and creates the tables. A file that cannot be opened or written, or
 * is not a database, fails with `LockBackendError { operation: "open" }`; so does a missing
 * `@effect/sql-sqlite-node` (`operation: "configure"`).
 *
 * @since 0.1.0
 * @category constructors
 */
export const makeBackend: {
  (options: Options & { readonly filename: string }): Effect.Effect<Backend, LockBackendError, Scope.Scope>
  (options?: Options): Effect.Effect<Backend, LockBackendError, SqliteClient | Scope.Scope>
} = (options?: Options) => Make.makeBackend(options)

/**
 * The backend `makeBackend` builds: a lock store whose `semaphore` is the permit store.
 *
 * @since 0.1.0
 * @category models
 */
export type Backend = LockAndSemaphoreBackend<SqliteLeaseGrant, SqliteLeasePermitGrant>

/**
 * A `DistributedLock` and a `DistributedSemaphore` on lease rows in SQLite, sharing one backend
 * (its connection). With `filename` it needs nothing; without, it takes the file of the
 * `SqliteClient` in the context (e.g. `SqliteClient.layer({ filename })`).
 *
 * @since 0.1.0
 * @category layers
 */
export const layer: {
  (options: Options & { readonly filename: string }): Layer.Layer<Services, LockBackendError>
  (options?: Options): Layer.Layer<Services, LockBackendError, SqliteClient>
} = (options?: Options) => DistributedSemaphore.layerBackend(Make.makeBackend(options))

/**
 * The services the layers provide.
 *
 * @since 0.1.0
 * @category models
 */
export type Services = DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore

/**
 * `layer` with its options read from configuration, e.g.
 * `SqliteLease.layerConfig({ filename: Config.string("LOCK_FILE"), ttl: Config.duration("LOCK_TTL") })`.
 * Without a `filename`, the `SqliteClient` in the context gives the file.
 *
 * @since 0.1.0
 * @category layers
 */
export const layerConfig = (
  config: Config.Config.Wrap<Options>
): Layer.Layer<Services, LockBackendError | ConfigError.ConfigError> =>
  DistributedSemaphore.layerBackend(Effect.flatMap(Config.unwrap(config), (options) => Make.makeBackend(options)))

/** Which table (default `effect_lock_leases`) and which name (default every name) an inspection reads. */
type Listing = { readonly table?: string | undefined; readonly name?: string | undefined }

/** Which table an operator's change is made in. */
type Revoking = { readonly table?: string | undefined }

/** An inspection or operator statement on the caller's `SqlClient` (in its transaction, if any). */
type Operation<A> = Effect.Effect<A, LockBackendError, SqlClient.SqlClient>

/**
 * A live lease as stored in the table (times are the database's, in ms since the epoch).
 *
 * @since 0.1.0
 * @category models
 */
export interface StoredLease extends Operator.StoredLease {}

/**
 * The leases held right now (all names, or one), read from the table with the caller's
 * `SqlClient` (a `SqliteClient` on the same file): what an operator or a test inspects.
 *
 * @since 0.1.0
 * @category inspection
 */
export const holders = (options?: Listing): Operation<ReadonlyArray<StoredLease>> => Operator.holders(Make.store, options)

/**
 * `holders` for inspection tools: a file without the tables yet holds no lease, so it gives an
 * empty list rather than an error. Failures are `LockBackendError { operation: "inspect" }`.
 *
 * @since 0.1.0
 * @category inspection
 */
export const listHolders = (options?: Listing): Operation<ReadonlyArray<StoredLease>> => Operator.listHolders(Make.store, options)

/**
 * Takes the lock `name` away from whoever holds it. The holder learns at its next renewal (within
 * ttl/3) and fails with `LockLost { reason: "revoked" }`; until then it may still be working, so
 * revoke only what you know to be stuck. Waiters take it at their next poll. Returns whether a
 * lease was held.
 *
 * @since 0.1.0
 * @category combinators
 */
export const revoke = (name: string, options?: Revoking): Operation<boolean> => Operator.revoke(Make.store, name, options)

/**
 * A semaphore in use (held or waited for), as stored in the semaphore table: its limit, its live
 * holders (permits, one fencing token per permit, times in database ms since the epoch, who) and
 * its live waiters in queue order (permits asked, since when).
 *
 * @since 0.1.0
 * @category models
 */
export interface StoredSemaphore extends Operator.StoredSemaphore {}

/**
 * The semaphores in use right now (all names, or one), read from the semaphore table with the
 * caller's `SqlClient` (a `SqliteClient` on the same file).
 *
 * @since 0.1.0
 * @category inspection
 */
export const semaphores = (options?: Listing): Operation<ReadonlyArray<StoredSemaphore>> => Operator.semaphores(Make.store, options)

/**
 * Takes every permit of the semaphore `name` away from whoever holds them. Holders learn at their
 * next renewal (within ttl/3) and fail with `LockLost { reason: "revoked" }`; until then they may
 * still be working, so revoke only what you know to be stuck. Waiters take the permits at their
 * next poll. Returns whether a permit was held.
 *
 * @since 0.1.0
 * @category combinators
 */
export const revokePermits = (name: string, options?: Revoking): Operation<boolean> => Operator.revokePermits(Make.store, name, options)

/**
 * The defaults, for documentation and tests.
 *
 * @since 0.1.0
 * @category constants
 */
export const defaults = LeaseOptions.defaults({ pollInterval: Make.DEFAULT_POLL, busyTimeout: Make.DEFAULT_BUSY_TIMEOUT })

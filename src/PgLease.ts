/**
 * Lease rows in PostgreSQL: the backend for deployments behind a transaction pooler (PgBouncer
 * `pool_mode = transaction`), for long critical sections, for processes that hold many locks at
 * once, and for readers/writers (`shared` mode). Holding a lease costs no connection.
 *
 * **Tables.** One row per lock name in use in the lease table (default `effect_lock_leases`,
 * created on first use, or by your own migration from `migration()`): `name` (primary key),
 * `owner` (a random uuid per acquisition, null when free), `token` (the last token granted),
 * `expires_at`, who holds or last held it (`acquired_at`, `holder_application`, `holder_host`,
 * `holder_pid`), and for shared holders their count and bound (`shared_count`, `shared_until`,
 * `shared_since`). Its queue table (`<table>_queue`, same schema) has a row per waiting request —
 * its place in arrival order — and per shared holder. Tokens are drawn from one sequence per
 * schema, `effect_lock_tokens` (shared with PgAdvisory's fencing table there), so the rows of a
 * name nobody holds or waits for are deleted by the sweep (`sweepInterval`) and its next grant
 * still gets a larger token.
 *
 * **Statements.** Every operation is ONE autocommit statement, so it is correct behind a
 * transaction pooler: an acquire attempt takes the lock (bumping the token) or its place in the
 * queue; renew updates a whole batch of leases at once (`renewBatchSize` 1000: 10,000 held leases
 * cost 10 statements per renewal round) and says, for the misses, whether the lease was `stolen`
 * (a newer holder), `expired` or `revoked`; release is owner-scoped — a holder whose lease expired
 * and was taken can neither renew nor release the new holder's lease — and, when it frees the lock
 * and someone waits, acts for the waiters now at the head in the same statement (an uncontended
 * release notifies nothing: NOTIFY serializes commits server-wide): an exclusive request at the
 * head whose place was written in the last 2.5 s is **handed the lease** (its place becomes the
 * holder, with a new token and its own ttl, and the notification says so: it holds the lease with
 * no statement of its own); so are shared requests at the head, each a shared lease, when the
 * release frees a live exclusive lease; other heads are notified to try again.
 *
 * **Fairness.** Waiters are served in arrival order: a request takes the lock only when no live
 * waiter is ahead of it (for a shared request, no exclusive waiter), so a releaser that asks again
 * goes to the back, `tryAcquire` never overtakes a waiter, and new shared requests queue behind a
 * waiting exclusive one. A waiter keeps its place by retrying (at least every 1.5 s); a place
 * lasts 5 s, so the place of a waiter whose process died is given up within 5 s.
 *
 * **Shared mode.** Any number of shared holders, none while an exclusive lease is live and no
 * exclusive grant while a shared one is. Each shared holder has its own row, token, renewal and
 * loss. A shared holder that crashed keeps exclusive requests out until its lease runs out, as an
 * exclusive one would.
 *
 * **Semaphores.** The layer provides `DistributedSemaphore` too (N permits per name), on the same
 * connections, with the same statements' guarantees: one autocommit statement per operation,
 * the server's `now()`, every statement bounded. Its table (`<table>_sem`, same schema, created
 * with the others) has one row per semaphore name in use: its limit, its last token (a grant
 * takes one per permit, a block drawn from `effect_lock_tokens`; the row of a semaphore nobody
 * holds or waits for is swept), and its live holders and waiters (jsonb arrays). Every grant,
 * renewal and release updates that one row, so they serialize on its row lock and each decides
 * on the newest row: never more than `limit` permits are held, whatever the concurrency. Waiters
 * are served in arrival order — a release wakes (NOTIFY, in its own statement) the waiters at the
 * head whose permits now fit, and stops at the first that does not, so a big request is not
 * starved by small ones — and a newcomer never takes permits a waiter ahead of it needs. A name in
 * use (held or waited for) with another limit refuses a request with `LimitMismatch`. Semaphore
 * names are their own namespace, apart from lock names.
 *
 * **Connections.** With a `PgClient` in the context the backend opens connections of its own from
 * the `PgClient`'s settings (`pool: "own"`), so that neither the application's queries nor the
 * library's own acquires can delay a renewal: up to `connections` (default 4) for acquire, release
 * and wake-up pings, opened on demand and closed after 30 s idle; up to 2 used by renewals only
 * (the second only while the first is busy or stuck); and 1 for LISTEN, opened by the first
 * `acquire` that may wait and kept — at most 7 server connections per layer by default, beside
 * the application's pool. With a plain `SqlClient` (or `pool: "application"`), statements go
 * through the application's pool and renewals keep one of its connections, reserved at the first
 * grant (the pool must have one to spare); a stuck renewal there cannot be destroyed, only handed
 * back to the pool and replaced.
 *
 * **Bounds.** Every statement has a client-side bound, `statementTimeout` (default 5 s): acquire,
 * release, give-back, renewal (also bounded by the renewal loop), table creation, LISTEN, wake-up
 * pings; an own connection that did not answer in time is destroyed, never reused, so a frozen
 * server or a silently dropped connection costs one bound and the next statement gets a fresh
 * connection. A bound fires only after the event loop has read what already arrived, so an
 * event-loop stall never turns an answered statement into a failure. A database restart costs a
 * lease nothing if its ttl outlasts the restart: renewals retry on fresh connections, and the same
 * layer serves new acquisitions once the server is back.
 *
 * **Transactions.** Lock statements never run in the caller's transaction: a `withLock` inside
 * `sql.withTransaction` still takes, renews and releases its row in autocommit statements of its
 * own, and a rollback of the caller's transaction undoes neither the grant's token bump nor the
 * release (with `pool: "application"` they use other pool connections, so the pool needs one
 * besides the transaction's). The inspection and operator functions (`holders`, `listHolders`,
 * `revoke`) are ordinary statements of the caller's `SqlClient`: inside a transaction they run in
 * it — they read its snapshot, and a revoke takes effect when it commits. Neither bumps a token,
 * so a rollback there is harmless. Prefer the transaction inside the lock,
 * `withLock(sql.withTransaction(body), name)`: with the lock inside, it is released before the
 * transaction commits, so the next holder may start before the body's writes are visible.
 *
 * **Durability of tokens.** A token is only as durable as the commit that bumped it: with
 * `synchronous_commit = off` (for the role, database or server) a crash can lose the last
 * grants' commits and the token repeats after recovery; likewise a failover to an asynchronous
 * replica. Keep `synchronous_commit` at `on` or above where leases guard fenced writes. A commit
 * that grants nothing — a release, a waiting place — does not wait for the WAL flush (its statement
 * sets `synchronous_commit = off` for its own transaction): a crash can undo it, never a grant,
 * since a grant that saw it commits later and its flush writes both. An undone release leaves the
 * lease to run out at its ttl; an undone place is taken again by the waiter's next try.
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
 * **Waiting.** A waiter holds a lease handed to it as soon as its notification arrives, or its next
 * attempt finds it (its deadline: the server's expiry less how far the server's clock was ahead of
 * this process's monotonic clock at its latest attempts, less 0.1 %). It retries when it is woken
 * by a notification naming it (LISTEN/NOTIFY on a
 * connection of its own, or `PgClient.listen` with `pool: "application"`), when what blocks it
 * runs out (the failed attempt returns the time left), or on a jittered poll. The listener proves
 * it hears with pings while anyone waits; when it cannot (PgBouncer transaction mode, a killed
 * LISTEN backend, a plain `SqlClient`) waiters poll every `pollInterval` (default 500 ms, jittered
 * down to half of it).
 *
 * @since 0.1.0
 */
import type * as SqlClient from "@effect/sql/SqlClient"
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
import { RENEW_CONNECTIONS } from "./internal/lease/pg/lane.js"
import * as Make from "./internal/lease/pg/make.js"

/**
 * Options of the lease backend.
 *
 * - `table`: `name` or `schema.name` (plain identifiers, used quoted, so case is kept; at most
 *   57 bytes, its queue table adds `_queue`); default `effect_lock_leases`.
 * - `ttl`: default lease length, 30 s (floor 1 s). Renewed every ttl/3, given up at ttl/5 left.
 * - `pool`: where the backend's statements run. `"own"` (the default when a `PgClient` is in the
 *   context): connections of its own, opened from the `PgClient`'s settings — up to
 *   `connections` for acquire and release, up to 2 for renewals only, 1 for LISTEN — so that
 *   neither the application's queries nor the library's own acquires delay a renewal.
 *   `"application"` (the only choice with a plain `SqlClient`): through the application's pool;
 *   renewals then keep one of its connections reserved.
 * - `connections`: most own connections for acquire and release (default 4), opened on demand
 *   and closed after 30 s idle.
 * - `listen`: `"auto"` (default) listens for release notifications when the lane can (own
 *   connections, or a `PgClient`) and they prove to arrive, else polls; `true` requires it (the
 *   layer fails without) and keeps restarting a dead listener; `false` only polls.
 * - `channel`: the NOTIFY channel; default the table's own name (≤ 63 bytes). Releases notify
 *   the waiters at the head whatever `listen` says, so mixed deployments wake each other.
 * - `pollInterval`: retry interval of waiters without notifications; default 500 ms, jittered
 *   to between half and all of it.
 * - `listenCheckInterval`: while anyone waits, how often the listener proves it still hears
 *   (default 5 s): a wake-up of one of this process's waiters proves it, else a ping (a NOTIFY
 *   it must hear back). A waiter retries at least every 1.5 s whatever it is told, to keep its place.
 * - `statementTimeout`: client-side bound on every statement (acquire attempt, release,
 *   give-back, renewal, table creation, LISTEN); default 5 s. An own connection whose statement
 *   did not answer in time is destroyed.
 * - `createTable`: create the table on first use (default true); set false when your migrations
 *   run `migration()` and the application's role may not create tables.
 * - `sweepInterval`: how often this layer deletes the rows of idle names (names nobody holds or
 *   waits for, places and shared holders that ran out), in rounds of at most 1,000 rows per table
 *   that skip rows in use; default 5 s (an idle name's rows go within about that), zero: never.
 * - `applicationName`: written to `holder_application` and used as the own connections'
 *   `application_name`; default the `PgClient`'s application name, else `effect-lock`.
 *
 * @since 0.1.0
 * @category models
 */
export interface Options extends Make.Options {}

/**
 * A lease held by this process: its row in the lease table (a shared holder's in the queue
 * table), renewed by the backend.
 *
 * @since 0.1.0
 * @category models
 */
export interface PgLeaseGrant extends Attempt.LeaseGrant {}

/**
 * Permits of a semaphore held by this process: one holder entry (an element of a jsonb array) of
 * the semaphore's row.
 *
 * @since 0.1.0
 * @category models
 */
export interface PgLeasePermitGrant extends Permits.PermitLeaseGrant {}

/**
 * The default table name, created in the first schema of the connections' `search_path`.
 *
 * @since 0.1.0
 * @category constants
 */
export const DEFAULT_TABLE = LeaseOptions.DEFAULT_TABLE

/**
 * The SQL that creates the lease table, its queue table and the semaphore table, for
 * applications that run their own migrations (then pass `createTable: false`; re-run it after an
 * upgrade that adds a table, as the token sequence's). Idempotent. Throws on an invalid
 * identifier (a programming error). It also creates the token sequence `effect_lock_tokens` in
 * the table's schema, raised above every token already in the tables, and a `before insert`
 * trigger on each that makes a process of the previous version (which counts tokens per name)
 * draw from it too.
 *
 * Never drop or reset the sequence, nor lower it: it is every name's fencing counter. Rows of
 * idle names may go (the sweep deletes them); a `truncate` of held rows frees their locks.
 *
 * @since 0.1.0
 * @category migrations
 */
export const migration = (table: string = DEFAULT_TABLE): string => Make.migration(table)

/**
 * Builds the backend (the SPI), for `DistributedLock.make` (and its `semaphore` for
 * `DistributedSemaphore.make`) or for tests that wrap it. The tables are created on the first
 * acquire, not here, so an application can start while the database is down. Fails only on
 * invalid options.
 *
 * @since 0.1.0
 * @category constructors
 */
export const makeBackend = (
  options?: Options
): Effect.Effect<LockAndSemaphoreBackend<PgLeaseGrant, PgLeasePermitGrant>, LockBackendError, SqlClient.SqlClient | Scope.Scope> =>
  Make.makeBackend(options)

/**
 * A `DistributedLock` and a `DistributedSemaphore` on lease rows, sharing one backend (its
 * connections, its listener), over the `SqlClient` in the context (for example
 * `PgClient.layer({ url })`; a `PgClient` also enables LISTEN wake-ups). Fails only on invalid
 * options.
 *
 * @since 0.1.0
 * @category layers
 */
export const layer = (
  options?: Options
): Layer.Layer<DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore, LockBackendError, SqlClient.SqlClient> =>
  DistributedSemaphore.layerBackend(makeBackend(options))

/**
 * `layer` with its options read from configuration, e.g.
 * `PgLease.layerConfig({ table: Config.string("LOCK_TABLE"), ttl: Config.duration("LOCK_TTL") })`.
 *
 * @since 0.1.0
 * @category layers
 */
export const layerConfig = (
  config: Config.Config.Wrap<Options>
): Layer.Layer<
  DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore,
  LockBackendError | ConfigError.ConfigError,
  SqlClient.SqlClient
> => DistributedSemaphore.layerBackend(Effect.flatMap(Config.unwrap(config), makeBackend))

/** Which table (default `effect_lock_leases`) and which name (default every name) an inspection reads. */
type Listing = { readonly table?: string | undefined; readonly name?: string | undefined }

/**
 * Which table an operator's change is made in, and the NOTIFY channel its waiters are woken on
 * (default the table's own name).
 */
type Revoking = { readonly table?: string | undefined; readonly channel?: string | undefined }

/** An inspection or operator statement on the caller's `SqlClient` (in its transaction, if any). */
type Operation<A> = Effect.Effect<A, LockBackendError, SqlClient.SqlClient>

/**
 * A live lease as stored in the table (times are the server's, in ms since the epoch).
 *
 * @since 0.1.0
 * @category models
 */
export interface StoredLease extends Operator.StoredLease {}

/**
 * The leases held right now across the cluster (all names, or one), read from the table: what
 * an operator or a test inspects.
 *
 * @since 0.1.0
 * @category inspection
 */
export const holders = (options?: Listing): Operation<ReadonlyArray<StoredLease>> => Operator.holders(Make.store, options)

/**
 * The leases held right now across the cluster, with who holds each (application, host, pid),
 * its fencing token and its times: `holders` for inspection tools. A table that does not exist
 * yet holds no lease, so it gives an empty list rather than an error. Failures are
 * `LockBackendError { operation: "inspect" }`.
 *
 * @since 0.1.0
 * @category inspection
 */
export const listHolders = (options?: Listing): Operation<ReadonlyArray<StoredLease>> => Operator.listHolders(Make.store, options)

/**
 * Takes the lock `name` away from whoever holds it and wakes waiters. The holder learns at its
 * next renewal (within ttl/3) and fails with `LockLost { reason: "revoked" }`; until then it
 * may still be working, so revoke only what you know to be stuck. Returns whether a lease was held.
 *
 * @since 0.1.0
 * @category combinators
 */
export const revoke = (name: string, options?: Revoking): Operation<boolean> => Operator.revoke(Make.store, name, options)

/**
 * A semaphore in use (held or waited for), as stored in the semaphore table: its limit, its live
 * holders (permits, one fencing token per permit, times in server ms since the epoch, who) and
 * its live waiters in queue order (permits asked, since when).
 *
 * @since 0.1.0
 * @category models
 */
export interface StoredSemaphore extends Operator.StoredSemaphore {}

/**
 * The semaphores in use right now across the cluster (all names, or one), read from the
 * semaphore table with the caller's `SqlClient`: what an operator or a test inspects.
 *
 * @since 0.1.0
 * @category inspection
 */
export const semaphores = (options?: Listing): Operation<ReadonlyArray<StoredSemaphore>> => Operator.semaphores(Make.store, options)

/**
 * Takes every permit of the semaphore `name` away from whoever holds them, and wakes the waiters
 * that now fit. Holders learn at their next renewal (within ttl/3) and fail with
 * `LockLost { reason: "revoked" }`; until then they may still be working, so revoke only what you
 * know to be stuck. Returns whether a permit was held.
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
export const defaults = LeaseOptions.defaults({
  pollInterval: Make.DEFAULT_POLL,
  listenCheckInterval: Make.DEFAULT_CHECK,
  connections: Make.DEFAULT_CONNECTIONS,
  renewConnections: RENEW_CONNECTIONS
})

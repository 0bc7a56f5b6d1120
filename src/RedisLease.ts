/**
 * Leases in Redis: locks and semaphores on the Redis that most Node services already run, with
 * fencing tokens, first-in-first-out waiting and shared mode. The same lease engine as `PgLease` and
 * `SqliteLease` (attempts, give-backs, batched renewal, interruption, shutdown, stall handling),
 * over `ioredis` ^5 (an optional peer dependency, loaded only when a layer is built: without it
 * the layer fails with a `LockBackendError` saying `npm install ioredis`).
 *
 * **Keys.** Every key of one name is in one hash slot — `<prefix>{<tag>}:lease`, `:queue`,
 * `:places`, `:shared`, where the tag is a digest of the name (a name may contain braces) and
 * the prefix defaults to `effect-lock:` — so each operation's script touches one slot, as Redis
 * Cluster requires. The lease hash holds the exclusive holder (owner, token, expiry, who), the
 * name's last token and its readable name; the queue (a sorted set by arrival) and the places
 * hash hold the waiting requests; the shared hash holds each shared holder's lease. No key
 * outlives its use: every write extends the key's expiry to cover what it holds, and a release
 * that leaves a name with no holder and no waiter keeps its lease hash only until the server's
 * clock is past the name's last token (2 ms), so a name nobody holds or waits for leaves no key
 * behind (there is nothing to sweep). Run the server with `maxmemory-policy noeviction` (or no
 * `maxmemory`): every key here carries an expiry, and an evicted lease lets a second holder in.
 *
 * **Scripts.** Every operation is ONE Lua script (an acquire attempt, a release, the renewal of
 * one lease, a revoke), sent as EVALSHA and again as EVAL when the server answers NOSCRIPT (after
 * a restart, a failover or `SCRIPT FLUSH`). A renewal batch is one script call per lease, all in
 * one pipeline on the renewal connection: a single script over many names' keys would cross
 * hash slots on Cluster.
 *
 * **Time.** Expiry is the server's clock only (`TIME`, read inside each script); the client's
 * clock never reaches the keys. Locally a grant is valid until (monotonic time before the script
 * was sent) + ttl, never later than its expiry on the server.
 *
 * **Fencing tokens.** A token is `max(last + 1, server time in µs)`: it strictly increases per
 * name while the name's keys exist, and also after they expired while idle or were lost in a
 * restart without persistence, because the keys live until the server's clock is past the
 * name's last token in µs. A failover to a replica whose
 * clock is behind by D (or a step back of the server's clock by D) can repeat a token granted
 * within the last D if the replica had not received the name's last grant: keep the servers'
 * clocks synchronised.
 *
 * **Waiting.** As `PgLease`: waiters are served in arrival order, a try never overtakes a live
 * waiter, a shared request queues behind a waiting exclusive one, and a place lasts 5 s unless
 * its waiter retries (a dead waiter's place is given up within 5 s). A release that frees the
 * lock publishes a wake-up for the waiters now at the head on one channel (`<prefix>wake`),
 * heard by each layer on one subscriber connection; the subscription is acknowledged before a
 * waiter's first try. The subscription is trusted only while it proves it hears (a ping every
 * check interval while anyone waits); otherwise waiters poll every `pollInterval`.
 *
 * **Connections.** Three per layer, opened lazily (a layer builds while Redis is down): lock
 * commands, renewals (never queued behind a lock command or the application's commands), and the
 * subscriber. With `client` the application's own ioredis client carries the lock commands; the
 * layer then opens only the renewal and subscriber connections (copies of the client's
 * settings) and never quits the application's client. Every command has a client-side bound
 * (`statementTimeout`): a frozen server is noticed within it, and an own connection on which
 * nothing came back is dropped and reconnected.
 *
 * **Release.** Owner-scoped and proven by the owner's id in the lease: a holder whose lease
 * expired and was taken can neither renew nor release the new holder's. There is no session to
 * destroy: a release that cannot be proven (Redis unreachable) leaves the lease to run out at
 * its ttl.
 *
 * **Semaphores.** `DistributedSemaphore` with the same contract as `PgLease`'s: one hash per
 * semaphore name, `<prefix>{<tag>}:sem` (the lock of the same name's slot, never its keys),
 * holding the limit, the last token, the holders and the waiting places. A request takes its
 * permits when they fit into what is free after every live waiter ahead of it has taken its own
 * (a newcomer is behind every waiter); asking with another limit while the name is in use fails
 * with `LimitMismatch`; a release wakes the waiters at the head that now fit. A grant of n
 * permits takes n consecutive tokens from `max(last + 1, server time in µs)`, and the hash
 * expires exactly when nothing in it matters any more (its last lease or place has run out and
 * the server's µs clock is past its last token): an idle semaphore leaves no key, and its next
 * grant still gets larger tokens. `semaphores` and `revokePermits` are the operator's tools.
 *
 * @since 0.1.0
 */
import * as Config from "effect/Config"
import type * as ConfigError from "effect/ConfigError"
import * as Effect from "effect/Effect"
import type * as Layer from "effect/Layer"
import type * as Scope from "effect/Scope"
import type { Cluster, Redis } from "ioredis"
import type * as DistributedLock from "./DistributedLock.js"
import * as DistributedSemaphore from "./DistributedSemaphore.js"
import type { LockAndSemaphoreBackend } from "./LockBackend.js"
import type { LockBackendError } from "./LockError.js"
import type * as Attempt from "./internal/lease/attempt.js"
import * as LeaseOptions from "./internal/lease/options.js"
import type * as Permits from "./internal/lease/permits.js"
import type * as Stored from "./internal/lease/stored.js"
import * as Keys from "./internal/redis/keys.js"
import * as Make from "./internal/redis/make.js"
import * as Operator from "./internal/redis/operator.js"

/**
 * Options of the Redis lease backend.
 *
 * - `url`: the server, e.g. `redis://localhost:6379` (ioredis's URL forms), as a string or a
 *   `Redacted` (`Config.redacted`); default ioredis's (localhost:6379), or what `redis` says.
 * - `redis`: ioredis options for the layer's own connections (host, port, password, tls, …);
 *   the layer sets its own `lazyConnect`, offline-queue, retry and resend settings over them.
 *   `keyPrefix` is refused: use `prefix`.
 * - `client`: an application's ioredis client — a `Redis` or a `Cluster` — to reuse for lock
 *   commands (not with `url` or `redis`): the layer opens only its renewal and subscriber
 *   connections, copying the client's settings (for a `Cluster`: Clusters on the same startup
 *   nodes with the same options), and never quits the client. A client with `keyPrefix` is
 *   refused. On a Cluster a renewal batch goes as one call per lease, and wake-ups use plain
 *   PUBLISH, which reaches every node's subscribers.
 * - `ttl`: default lease length, 30 s (floor 1 s). Renewed every ttl/3, given up at ttl/5 left.
 * - `prefix`: of every key and of the wake-up channel; default `effect-lock:`. No `{` or `}`.
 *   Layers that share locks must use the same prefix.
 * - `pollInterval`: how often a waiter retries while wake-ups are not proven to arrive; default
 *   500 ms, jittered to between half and all of it.
 * - `statementTimeout`: bound on each command (and on connecting); default 5 s.
 * - `waitForReplicas`: `{ count, timeout? }`, opt-in: after every script that grants a lease
 *   (lock or permits), and after every renewal batch that renewed one, `WAIT count timeout` runs
 *   on the same connection. A grant fewer than `count` replicas acknowledged fails with
 *   `LockBackendError` ("WAIT: n of count replicas acknowledged …") and is given back at once;
 *   such a renewal does not extend the lease (the holder is told `LockLost` when no acknowledged
 *   renewal comes in time). This layer's waiters are then never handed a lease by a release (it
 *   would skip their WAIT): they are woken, and their own acquire is waited for.
 *   `timeout`: at least 1 ms and below `statementTimeout`; default the
 *   lesser of 1 s and half of `statementTimeout`. WAIT holds up the connection it runs on (your
 *   `client`'s, when given) for up to `timeout`. It narrows what a failover can lose but is not
 *   strong consistency (README, "Redis: failover and WAIT"). Refused with a `Cluster` client.
 * - `sweepInterval`: keys expire by themselves, so there is nothing to sweep; default zero (off).
 * - `applicationName`: stored with each lease and in the connections' names; default `effect-lock`.
 * - `listenCheckInterval`: how often the subscription proves it hears while anyone waits (a
 *   wake-up of one of this process's waiters proves it, else a PUBLISH it must hear back); default 5 s.
 *
 * @since 0.1.0
 * @category models
 */
export interface Options extends Make.Options {}

/**
 * A lease held by this process: its entry in the name's lease hash (a shared holder's in the
 * name's shared hash), renewed by the backend.
 *
 * @since 0.1.0
 * @category models
 */
export interface RedisLeaseGrant extends Attempt.LeaseGrant {}

/**
 * Permits of a semaphore held by this process: its entry in the semaphore's hash, renewed by the
 * backend.
 *
 * @since 0.1.0
 * @category models
 */
export interface RedisLeasePermitGrant extends Permits.PermitLeaseGrant {}

/**
 * The backend `makeBackend` builds: a lock store and its `semaphore` store.
 *
 * @since 0.1.0
 * @category models
 */
export type Backend = LockAndSemaphoreBackend<RedisLeaseGrant, RedisLeasePermitGrant>

/**
 * The default key prefix.
 *
 * @since 0.1.0
 * @category constants
 */
export const DEFAULT_PREFIX = Keys.DEFAULT_PREFIX

/**
 * Builds the backend (the SPI), for `DistributedLock.make` or for tests that wrap it. Nothing
 * connects until the first acquire. A missing `ioredis` fails with
 * `LockBackendError { operation: "configure" }` saying what to install; so does a bad option.
 *
 * @since 0.1.0
 * @category constructors
 */
export const makeBackend = (options?: Options): Effect.Effect<Backend, LockBackendError, Scope.Scope> => Make.makeBackend(options)

/**
 * The services the layer provides.
 *
 * @since 0.1.0
 * @category models
 */
export type Services = DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore

/**
 * A `DistributedLock` and a `DistributedSemaphore` on leases in Redis, from one backend (one set
 * of connections), e.g. `RedisLease.layer({ url: "redis://localhost:6379" })`.
 *
 * @since 0.1.0
 * @category layers
 */
export const layer = (options?: Options): Layer.Layer<Services, LockBackendError> =>
  DistributedSemaphore.layerBackend(Make.makeBackend(options))

/**
 * `layer` with its options read from configuration, e.g.
 * `RedisLease.layerConfig({ url: Config.redacted("REDIS_URL"), ttl: Config.duration("LOCK_TTL") })`.
 *
 * @since 0.1.0
 * @category layers
 */
export const layerConfig = (
  config: Config.Config.Wrap<Options>
): Layer.Layer<Services, LockBackendError | ConfigError.ConfigError> =>
  DistributedSemaphore.layerBackend(Effect.flatMap(Config.unwrap(config), Make.makeBackend))

/**
 * A live lease as stored in Redis (times are the server's, in ms since the epoch).
 *
 * @since 0.1.0
 * @category models
 */
export interface StoredLease extends Stored.StoredLease {}

/**
 * The live leases of `name` (its exclusive holder, or each shared holder), read with `client`
 * (any ioredis client on the server; `prefix` as the layer's).
 *
 * @since 0.1.0
 * @category inspection
 */
export const holders = (
  client: Redis,
  name: string,
  options?: { readonly prefix?: string | undefined }
): Effect.Effect<ReadonlyArray<StoredLease>, LockBackendError> => Operator.holders(client, name, options)

/**
 * A lock name that is held or waited for: its live leases (`StoredLease`s) and who waits for it
 * (live places by mode, and the oldest's arrival in server ms). `name` is the tag `{…}` when the
 * name's keys do not keep it (`named: false`: only waiters are left, its lease hash ran out).
 *
 * @since 0.1.0
 * @category models
 */
export interface LockInUse extends Operator.LockInUse {}

/**
 * Everything in use under a prefix: lock names held or waited for, semaphores in use, the
 * server's clock when the listing began, and whether more names were found than `limit`.
 *
 * @since 0.1.0
 * @category models
 */
export interface Listing extends Operator.Listing {}

/**
 * Every lock name held or waited for and every semaphore in use, with who holds each (application,
 * host, pid), its fencing tokens, its times and its waiters: `holders` and `semaphores` for
 * inspection tools, over all names. Read with `client` (any ioredis client on the server, or an
 * ioredis `Cluster`, without `keyPrefix`; `prefix` as the layer's): names are found with SCAN
 * (`COUNT 1000`, at most `limit` of each kind, default 10,000; the whole listing is bounded to
 * 60 s) and each is read with its own scripts, so the result is a name-by-name snapshot, not one
 * instant. With a `Cluster`, every master is listed (SCAN on each, through the Cluster's own
 * node clients, once it is ready) and the lists are merged: sorted by name, `limit` over the
 * merged total, `truncated` if any node's was, `serverTime` the earliest master's. Failures are
 * `LockBackendError { operation: "inspect" }` (or that of the script that failed).
 *
 * @since 0.1.0
 * @category inspection
 */
export const listHolders = (
  client: Redis | Cluster,
  options?: { readonly prefix?: string | undefined; readonly limit?: number | undefined }
): Effect.Effect<Listing, LockBackendError> => Operator.list(client, options)

/**
 * Takes the lock `name` away from whoever holds it, exclusive or shared, and wakes its waiters.
 * The holder learns at its next renewal (within ttl/3) and fails with
 * `LockLost { reason: "revoked" }`; until then it may still be working, so revoke only what you
 * know to be stuck. Returns whether a lease was held.
 *
 * @since 0.1.0
 * @category combinators
 */
export const revoke = (
  client: Redis,
  name: string,
  options?: { readonly prefix?: string | undefined }
): Effect.Effect<boolean, LockBackendError> => Operator.revoke(client, name, options)

/**
 * A semaphore in use as stored in Redis: its limit, live holders and live waiters in queue order
 * (times are the server's, in ms since the epoch).
 *
 * @since 0.1.0
 * @category models
 */
export interface StoredSemaphore extends Stored.StoredSemaphore {}

/**
 * The semaphore `name` if it is in use (a live holder or waiter; else an empty array), read with
 * `client` (any ioredis client on the server; `prefix` as the layer's).
 *
 * @since 0.1.0
 * @category inspection
 */
export const semaphores = (
  client: Redis,
  name: string,
  options?: { readonly prefix?: string | undefined }
): Effect.Effect<ReadonlyArray<StoredSemaphore>, LockBackendError> => Operator.semaphores(client, name, options)

/**
 * Takes every permit of the semaphore `name` away and wakes the waiters that now fit. The holders
 * learn at their next renewal (within ttl/3) and fail with `LockLost { reason: "revoked" }`;
 * until then they may still be working, so revoke only what you know to be stuck. Returns
 * whether a permit was held.
 *
 * @since 0.1.0
 * @category combinators
 */
export const revokePermits = (
  client: Redis,
  name: string,
  options?: { readonly prefix?: string | undefined }
): Effect.Effect<boolean, LockBackendError> => Operator.revokePermits(client, name, options)

/**
 * The defaults, for documentation and tests.
 *
 * @since 0.1.0
 * @category constants
 */
export const defaults = {
  ...LeaseOptions.defaults({ pollInterval: Make.DEFAULT_POLL, prefix: Keys.DEFAULT_PREFIX }),
  sweepInterval: Make.DEFAULT_SWEEP_INTERVAL,
  listenCheckInterval: Make.DEFAULT_CHECK
} as const


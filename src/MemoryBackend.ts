/**
 * An in-process lock store with the same semantics as the database backends: leases with a ttl,
 * renewal, expiry and takeover, fencing tokens, shared mode, and semaphores (`DistributedSemaphore`).
 * Time is read only through Effect's Clock, so `TestClock.adjust` drives expiry and renewal; two
 * layers sharing one `Store` behave like two processes of a cluster. Waiting is the database
 * backends' too: first in, first out; a try never overtakes a waiter; a new shared request
 * queues behind a waiting exclusive one. (The store lives in `internal/memory/`.)
 *
 * @since 0.1.0
 */
import * as Cause from "effect/Cause"
import * as Config from "effect/Config"
import type * as ConfigError from "effect/ConfigError"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import type * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import type * as DistributedLock from "./DistributedLock.js"
import * as DistributedSemaphore from "./DistributedSemaphore.js"
import { fiberMillis } from "./internal/core/clock.js"
import { durationOption } from "./internal/core/validate.js"
import * as Locks from "./internal/memory/locks.js"
import * as Permits from "./internal/memory/permits.js"
import * as Queue from "./internal/memory/queue.js"
import * as internal from "./internal/memory/store.js"
import type { LockAndSemaphoreBackend } from "./LockBackend.js"

/**
 * The shared state of one in-memory "cluster". Give the same store to several layers to model
 * several processes.
 *
 * @since 0.1.0
 * @category models
 */
export interface Store extends internal.Store {}

/**
 * Creates an empty store.
 *
 * @since 0.1.0
 * @category constructors
 */
export const makeStore: Effect.Effect<Store> = internal.makeStore

/**
 * One live lease in a store, as `holders` reports it.
 *
 * @since 0.1.0
 * @category models
 */
export type StoredLease = Locks.StoredLease

/**
 * The leases a store holds right now (expired ones excluded): what a test checks to prove
 * nothing was left behind.
 *
 * @since 0.1.0
 * @category inspection
 */
export const holders = (store: Store): Effect.Effect<ReadonlyArray<StoredLease>> =>
  Effect.withFiberRuntime((fiber) => Effect.succeed(Locks.holders(store[internal.StoreTypeId].entries, fiberMillis(fiber))))

/**
 * Takes the lock `name` away from every holder: their leases fail `lost` with
 * `LockLost { reason: "revoked" }` and the waiters that now fit are woken.
 *
 * @since 0.1.0
 * @category combinators
 */
export const revoke = (store: Store, name: string): Effect.Effect<void> =>
  Queue.revoke(store[internal.StoreTypeId].entries, name)

/**
 * Takes every permit of the semaphore `name` away: their holders fail `lost` with
 * `LockLost { reason: "revoked" }` (a `withPermits` body is interrupted) and waiters that now fit
 * are woken.
 *
 * @since 0.1.0
 * @category combinators
 */
export const revokePermits = (store: Store, name: string): Effect.Effect<void> =>
  Queue.revoke(store[internal.StoreTypeId].permits, name)

/**
 * One semaphore in use in a store: its limit, live holders and queued waiters.
 *
 * @since 0.1.0
 * @category models
 */
export type StoredSemaphore = Permits.StoredSemaphore

/**
 * The semaphores a store has in use right now (held or waited for; expired holders excluded):
 * what a test checks to prove no permit and no waiter was left behind.
 *
 * @since 0.1.0
 * @category inspection
 */
export const semaphores = (store: Store): Effect.Effect<ReadonlyArray<StoredSemaphore>> =>
  Effect.withFiberRuntime((fiber) =>
    Effect.succeed(Permits.snapshot(store[internal.StoreTypeId].permits, fiberMillis(fiber))))

/**
 * Options for the memory backend.
 *
 * - `ttl`: default lease length (30 s); renewals run every ttl/3.
 * - `store`: share one store between layers to model several processes.
 *
 * @since 0.1.0
 * @category models
 */
export interface Options {
  readonly ttl?: Duration.DurationInput | undefined
  readonly store?: Store | undefined
}

/**
 * Builds the backend (the SPI), for wrapping or for `DistributedLock.make`; its `semaphore` is
 * the permit store, for `DistributedSemaphore.make`. The backend's background work (waking its
 * waiters when a lease ahead of them expires) runs until the scope closes.
 *
 * @since 0.1.0
 * @category constructors
 */
export const makeBackend = (
  options?: Options
): Effect.Effect<LockAndSemaphoreBackend<Queue.MemoryGrant, Permits.MemoryPermitGrant>, never, Scope.Scope> =>
  Effect.gen(function*() {
    const store = options?.store ?? (yield* makeStore)
    // The layer's error type is `never`: a bad ttl is a defect naming the option (a positive one
    // is clamped to [100 ms, 24 h] by DistributedLock, so no upper bound here).
    const defaultTtl = yield* Either.match(durationOption("ttl", options?.ttl, Duration.seconds(30)), {
      onLeft: (reason) => Effect.die(new Cause.IllegalArgumentException(`MemoryBackend: ${reason}`)),
      onRight: Effect.succeed
    })
    return yield* internal.makeBackend(store, defaultTtl)
  })

/**
 * A `DistributedLock` and a `DistributedSemaphore` on an in-memory store.
 *
 * @since 0.1.0
 * @category layers
 */
export const layer = (
  options?: Options
): Layer.Layer<DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore> =>
  DistributedSemaphore.layerBackend(makeBackend(options))

/**
 * `layer` with its ttl read from configuration (`ttl` as a Duration).
 *
 * @since 0.1.0
 * @category layers
 */
export const layerConfig = (
  config: Config.Config<{ readonly ttl?: Duration.Duration | undefined }> = Config.all({
    ttl: Config.option(Config.duration("ttl")).pipe(Config.map(Option.getOrUndefined))
  }),
  store?: Store
): Layer.Layer<DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore, ConfigError.ConfigError> =>
  DistributedSemaphore.layerBackend(Effect.flatMap(config, (resolved) => makeBackend({ ttl: resolved.ttl, store })))

/**
 * An in-process lock store with the same semantics as the database backends: leases with a ttl,
 * renewal, expiry and takeover, fencing tokens, shared mode. Time is read only through Effect's
 * Clock, so `TestClock.adjust` drives expiry and renewal; two layers sharing one `Store` behave
 * like two processes of a cluster.
 *
 * @since 0.1.0
 */
import * as Clock from "effect/Clock"
import * as Config from "effect/Config"
import type * as ConfigError from "effect/ConfigError"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as DistributedLock from "./DistributedLock.js"
import { monotonicMillis } from "./internal/clock.js"
import * as FencingToken from "./FencingToken.js"
import type { LockMode } from "./Lease.js"
import type { AcquireRequest, AcquireResult, Grant, LockBackend, RenewOutcome } from "./LockBackend.js"
import type { LostReason } from "./LockError.js"

interface Holder {
  readonly owner: number
  readonly mode: LockMode
  readonly token: FencingToken.FencingToken
  readonly onLost: (reason: LostReason) => Effect.Effect<void>
  expiresAt: number
}

interface Entry {
  /** Last token handed out for this name; entries are kept forever so tokens never repeat. */
  counter: bigint
  readonly holders: Map<number, Holder>
  /** Completed and replaced whenever a holder leaves, waking every waiter. */
  changed: Deferred.Deferred<void>
}

const StoreTypeId: unique symbol = Symbol.for("effect-lock/MemoryBackend/Store")

/**
 * The shared state of one in-memory "cluster". Give the same store to several layers to model
 * several processes.
 *
 * @since 0.1.0
 * @category models
 */
export interface Store {
  readonly [StoreTypeId]: {
    readonly entries: Map<string, Entry>
    nextOwner: number
  }
}

/**
 * Creates an empty store.
 *
 * @since 0.1.0
 * @category constructors
 */
export const makeStore: Effect.Effect<Store> = Effect.sync(() => ({
  [StoreTypeId]: { entries: new Map(), nextOwner: 0 }
}))

/**
 * One live lease in a store, as `holders` reports it.
 *
 * @since 0.1.0
 * @category models
 */
export interface StoredLease {
  readonly name: string
  readonly token: FencingToken.FencingToken
  readonly mode: LockMode
  /** When the lease runs out unless renewed, on the Clock's monotonic timeline (ms). */
  readonly expiresAt: number
}

/**
 * The leases a store holds right now (expired ones excluded): what a test checks to prove
 * nothing was left behind.
 *
 * @since 0.1.0
 * @category inspection
 */
export const holders = (store: Store): Effect.Effect<ReadonlyArray<StoredLease>> =>
  Effect.map(monotonicMillis, (now) => {
    const out: Array<StoredLease> = []
    for (const [name, entry] of store[StoreTypeId].entries) {
      for (const holder of entry.holders.values()) {
        if (holder.expiresAt > now) {
          out.push({ name, token: holder.token, mode: holder.mode, expiresAt: holder.expiresAt })
        }
      }
    }
    return out
  })

/**
 * Takes the lock `name` away from every holder: their leases fail `lost` with
 * `LockLost { reason: "revoked" }` and waiters are woken.
 *
 * @since 0.1.0
 * @category combinators
 */
export const revoke = (store: Store, name: string): Effect.Effect<void> =>
  Effect.suspend(() => {
    const entry = store[StoreTypeId].entries.get(name)
    if (entry === undefined) return Effect.void
    const gone = Array.from(entry.holders.values())
    entry.holders.clear()
    return Effect.forEach(gone, (holder) => holder.onLost("revoked"), { discard: true }).pipe(
      Effect.zipRight(signal(entry))
    )
  })

const signal = (entry: Entry): Effect.Effect<void> =>
  Effect.flatMap(Deferred.make<void>(), (next) => {
    const previous = entry.changed
    entry.changed = next
    return Deferred.succeed(previous, undefined)
  })

const entryOf = (store: Store, name: string): Effect.Effect<Entry> =>
  Effect.suspend(() => {
    const existing = store[StoreTypeId].entries.get(name)
    if (existing !== undefined) return Effect.succeed(existing)
    return Effect.map(Deferred.make<void>(), (changed) => {
      const entry: Entry = { counter: 0n, holders: new Map(), changed }
      store[StoreTypeId].entries.set(name, entry)
      return entry
    })
  })

/** Drops holders whose lease ran out; they learn they were taken over. */
const purgeExpired = (entry: Entry, now: number): Effect.Effect<void> => {
  const expired = Array.from(entry.holders.values()).filter((h) => h.expiresAt <= now)
  for (const holder of expired) entry.holders.delete(holder.owner)
  return Effect.forEach(expired, (holder) => holder.onLost("stolen"), { discard: true })
}

const compatible = (entry: Entry, mode: LockMode): boolean => {
  if (entry.holders.size === 0) return true
  if (mode === "exclusive") return false
  for (const holder of entry.holders.values()) if (holder.mode === "exclusive") return false
  return true
}

interface MemoryGrant extends Grant {
  readonly name: string
  readonly owner: number
  readonly ttlMillis: number
}

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

/** Shortest lease the memory store keeps; shorter requests are clamped up to it. */
const MIN_TTL = Duration.millis(100)
/** Same bound as the database backends, so names behave alike everywhere. */
const MAX_NAME_BYTES = 1024

/**
 * Builds the backend (the SPI), for wrapping or for `DistributedLock.make`.
 *
 * @since 0.1.0
 * @category constructors
 */
export const makeBackend = (options?: Options): Effect.Effect<LockBackend<MemoryGrant>> =>
  Effect.gen(function*() {
    const store = options?.store ?? (yield* makeStore)
    const state = store[StoreTypeId]

    const release = (name: string, owner: number): Effect.Effect<void> =>
      Effect.suspend(() => {
        const entry = state.entries.get(name)
        // Owner-scoped: a holder that was taken over finds no row of its own and touches nothing.
        if (entry === undefined || !entry.holders.delete(owner)) return Effect.void
        return signal(entry)
      })

    const tryGrant = (entry: Entry, request: AcquireRequest, owner: number) =>
      Effect.gen(function*() {
        const now = yield* monotonicMillis
        yield* purgeExpired(entry, now)
        if (!compatible(entry, request.mode)) return Option.none<MemoryGrant>()
        const ttlMillis = Duration.toMillis(request.ttl)
        entry.counter += 1n
        const token = FencingToken.make(entry.counter)
        entry.holders.set(owner, {
          owner,
          mode: request.mode,
          token,
          onLost: request.onLost,
          expiresAt: now + ttlMillis
        })
        return Option.some<MemoryGrant>({
          name: request.name,
          owner,
          ttlMillis,
          token,
          validUntil: Option.some(now + ttlMillis),
          release: release(request.name, owner)
        })
      })

    const acquire = (request: AcquireRequest): Effect.Effect<AcquireResult<MemoryGrant>> =>
      Effect.gen(function*() {
        const entry = yield* entryOf(store, request.name)
        const owner = state.nextOwner++
        while (true) {
          const granted = yield* tryGrant(entry, request, owner)
          if (Option.isSome(granted)) return { _tag: "Granted", grant: granted.value } as const
          if (request.attempt === "once") return { _tag: "Busy" } as const
          const now = yield* monotonicMillis
          const nextExpiry = Math.min(...Array.from(entry.holders.values(), (h) => h.expiresAt))
          // Wake when a holder leaves or when the earliest lease runs out, whichever is first.
          const woke = yield* request.waitUntilDeadline(
            Effect.raceFirst(Deferred.await(entry.changed), Clock.sleep(Duration.millis(Math.max(0, nextExpiry - now))))
          )
          if (Option.isNone(woke)) return { _tag: "TimedOut" } as const
        }
      })

    const renewOne = (grant: MemoryGrant, now: number): RenewOutcome => {
      const entry = state.entries.get(grant.name)
      const holder = entry?.holders.get(grant.owner)
      if (holder === undefined) {
        const taken = entry !== undefined && Array.from(entry.holders.values()).some((h) => h.expiresAt > now)
        return { _tag: "Lost", reason: taken ? "stolen" : "expired" }
      }
      if (holder.expiresAt <= now) {
        entry!.holders.delete(grant.owner)
        return { _tag: "Lost", reason: "expired" }
      }
      holder.expiresAt = now + grant.ttlMillis
      return { _tag: "Renewed", validUntil: holder.expiresAt }
    }

    return {
      backend: "memory",
      maxNameBytes: MAX_NAME_BYTES,
      defaultTtl: Duration.decode(options?.ttl ?? Duration.seconds(30)),
      minTtl: MIN_TTL,
      renewBatchSize: 10_000,
      acquire,
      renew: (grants) => Effect.map(monotonicMillis, (now) => grants.map((grant) => renewOne(grant, now)))
    }
  })

/**
 * A `DistributedLock` on an in-memory store.
 *
 * @since 0.1.0
 * @category layers
 */
export const layer = (options?: Options): Layer.Layer<DistributedLock.DistributedLock> =>
  DistributedLock.layerBackend(makeBackend(options))

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
): Layer.Layer<DistributedLock.DistributedLock, ConfigError.ConfigError> =>
  DistributedLock.layerBackend(Effect.flatMap(config, (resolved) => makeBackend({ ttl: resolved.ttl, store })))

/**
 * An in-process lock store with the same semantics as the database backends: leases with a ttl,
 * renewal, expiry and takeover, fencing tokens, shared mode, and semaphores (`DistributedSemaphore`).
 * Time is read only through Effect's Clock, so `TestClock.adjust` drives expiry and renewal; two
 * layers sharing one `Store` behave like two processes of a cluster.
 *
 * @since 0.1.0
 */
import * as Cause from "effect/Cause"
import * as Config from "effect/Config"
import type * as ConfigError from "effect/ConfigError"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import type * as FiberId from "effect/FiberId"
import type * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import type * as DistributedLock from "./DistributedLock.js"
import * as DistributedSemaphore from "./DistributedSemaphore.js"
import { fiberMillis, sleepMillis } from "./internal/core/clock.js"
import * as Permits from "./internal/memory/permits.js"
import { durationOption } from "./internal/core/validate.js"
import * as FencingToken from "./FencingToken.js"
import type { LockMode } from "./Lease.js"
import type { AcquireRequest, AcquireResult, Grant, LockAndSemaphoreBackend, RenewOutcome } from "./LockBackend.js"
import type { LostReason } from "./LockError.js"

// Every operation on the store reads the clock, checks and changes the entries in one
// synchronous step: no other fiber can run between a check and the change it decides, however
// often the runtime switches fibers. Only telling holders and waiters happens afterwards.

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
  /** Acquires waiting for a holder to leave; all are woken when one does, and look again. */
  waiters: Set<Deferred.Deferred<void>> | undefined
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
    /** Semaphores, a namespace of their own (see `internal/memory/permits.ts`). */
    readonly permits: Permits.PermitEntries
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
  [StoreTypeId]: { entries: new Map(), permits: new Map(), nextOwner: 0 }
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
  Effect.withFiberRuntime((fiber) => {
    const now = fiberMillis(fiber)
    const out: Array<StoredLease> = []
    for (const [name, entry] of store[StoreTypeId].entries) {
      for (const holder of entry.holders.values()) {
        if (holder.expiresAt > now) {
          out.push({ name, token: holder.token, mode: holder.mode, expiresAt: holder.expiresAt })
        }
      }
    }
    return Effect.succeed(out)
  })

/** Wakes every waiter of `entry` (a holder left); each looks again. Synchronous. */
const wakeWaiters = (entry: Entry): void => {
  const waiters = entry.waiters
  if (waiters === undefined) return
  entry.waiters = undefined
  for (const waiter of waiters) Deferred.unsafeDone(waiter, Exit.void)
}

/** Tells each of `gone` its lease is lost, after the store already changed. */
const tellLost = (gone: ReadonlyArray<Holder> | undefined, reason: LostReason): Effect.Effect<void> =>
  gone === undefined ? Effect.void : Effect.forEach(gone, (holder) => holder.onLost(reason), { discard: true })

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
    if (entry === undefined || entry.holders.size === 0) return Effect.void
    const gone = Array.from(entry.holders.values())
    entry.holders.clear()
    wakeWaiters(entry)
    return tellLost(gone, "revoked")
  })

/**
 * Takes every permit of the semaphore `name` away: their holders fail `lost` with
 * `LockLost { reason: "revoked" }` (a `withPermits` body is interrupted) and waiters that now fit
 * are woken.
 *
 * @since 0.1.0
 * @category combinators
 */
export const revokePermits = (store: Store, name: string): Effect.Effect<void> =>
  Permits.revoke(store[StoreTypeId].permits, name)

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
  Effect.withFiberRuntime((fiber) => Effect.succeed(Permits.snapshot(store[StoreTypeId].permits, fiberMillis(fiber))))

const entryOf = (store: Store, name: string): Entry => {
  const entries = store[StoreTypeId].entries
  let entry = entries.get(name)
  if (entry === undefined) entries.set(name, entry = { counter: 0n, holders: new Map(), waiters: undefined })
  return entry
}

/** Drops holders whose lease ran out and wakes the waiters; returns them so they can be told. */
const purgeExpired = (entry: Entry, now: number): Array<Holder> | undefined => {
  let expired: Array<Holder> | undefined
  for (const holder of entry.holders.values()) {
    if (holder.expiresAt <= now) (expired ??= []).push(holder)
  }
  if (expired === undefined) return undefined
  for (const holder of expired) entry.holders.delete(holder.owner)
  wakeWaiters(entry)
  return expired
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

/** What one look at the store decided. */
type Look =
  | { readonly _tag: "Granted"; readonly grant: MemoryGrant }
  | { readonly _tag: "Busy" }
  | { readonly _tag: "Wait"; readonly woken: Deferred.Deferred<void>; readonly sleepMillis: number }

/**
 * Builds the backend (the SPI), for wrapping or for `DistributedLock.make`; its `semaphore` is
 * the permit store, for `DistributedSemaphore.make`.
 *
 * @since 0.1.0
 * @category constructors
 */
export const makeBackend = (
  options?: Options
): Effect.Effect<LockAndSemaphoreBackend<MemoryGrant, Permits.MemoryPermitGrant>> =>
  Effect.gen(function*() {
    const store = options?.store ?? (yield* makeStore)
    const state = store[StoreTypeId]

    const release = (name: string, owner: number): Effect.Effect<void> =>
      Effect.sync(() => {
        const entry = state.entries.get(name)
        // Owner-scoped: a holder that was taken over finds no row of its own and touches nothing.
        if (entry !== undefined && entry.holders.delete(owner)) wakeWaiters(entry)
      })

    /** One synchronous look: grant, report busy, or register as a waiter, as of `now`. */
    const look = (entry: Entry, request: AcquireRequest, owner: number, now: number, fiberId: FiberId.FiberId): Look => {
      if (compatible(entry, request.mode)) {
        const ttlMillis = Duration.toMillis(request.ttl)
        entry.counter += 1n
        const token = FencingToken.make(entry.counter)
        entry.holders.set(owner, { owner, mode: request.mode, token, onLost: request.onLost, expiresAt: now + ttlMillis })
        return {
          _tag: "Granted",
          grant: {
            name: request.name,
            owner,
            ttlMillis,
            token,
            validUntil: Option.some(now + ttlMillis),
            release: release(request.name, owner)
          }
        }
      }
      if (request.attempt === "once") return { _tag: "Busy" }
      // Registered in the same step as the check: a holder leaving after it wakes this waiter.
      const woken = Deferred.unsafeMake<void>(fiberId)
      ;(entry.waiters ??= new Set()).add(woken)
      let nextExpiry = Number.POSITIVE_INFINITY
      for (const holder of entry.holders.values()) nextExpiry = Math.min(nextExpiry, holder.expiresAt)
      return { _tag: "Wait", woken, sleepMillis: Math.max(0, nextExpiry - now) }
    }

    const attempt = (request: AcquireRequest, owner: number): Effect.Effect<AcquireResult<MemoryGrant>> =>
      Effect.withFiberRuntime((fiber) => {
        const entry = entryOf(store, request.name)
        const now = fiberMillis(fiber)
        const expired = purgeExpired(entry, now)
        const seen = look(entry, request, owner, now, fiber.id())
        const told = tellLost(expired, "stolen")
        if (seen._tag !== "Wait") return expired === undefined ? Effect.succeed(seen) : Effect.as(told, seen)
        // Wake when a holder leaves or when the earliest lease runs out, whichever is first.
        const wait = request.waitUntilDeadline(
          Effect.raceFirst(Deferred.await(seen.woken), sleepMillis(seen.sleepMillis))
        ).pipe(Effect.ensuring(Effect.sync(() => entry.waiters?.delete(seen.woken))))
        return Effect.flatMap(Effect.zipRight(told, wait), (woke) =>
          Option.isNone(woke) ? Effect.succeed({ _tag: "TimedOut" } as const) : attempt(request, owner))
      })

    const renewOne = (grant: MemoryGrant, now: number): RenewOutcome => {
      const entry = state.entries.get(grant.name)
      const holder = entry?.holders.get(grant.owner)
      if (entry === undefined || holder === undefined) {
        let taken = false
        if (entry !== undefined) for (const h of entry.holders.values()) if (h.expiresAt > now) taken = true
        return { _tag: "Lost", reason: taken ? "stolen" : "expired" }
      }
      if (holder.expiresAt <= now) {
        entry.holders.delete(grant.owner)
        wakeWaiters(entry)
        return { _tag: "Lost", reason: "expired" }
      }
      holder.expiresAt = now + grant.ttlMillis
      return { _tag: "Renewed", validUntil: holder.expiresAt }
    }

    // The layer's error type is `never`: a bad ttl is a defect naming the option (a positive one
    // is clamped to [100 ms, 24 h] by DistributedLock, so no upper bound here).
    const defaultTtl = yield* Either.match(durationOption("ttl", options?.ttl, Duration.seconds(30)), {
      onLeft: (reason) => Effect.die(new Cause.IllegalArgumentException(`MemoryBackend: ${reason}`)),
      onRight: Effect.succeed
    })
    return {
      backend: "memory",
      maxNameBytes: MAX_NAME_BYTES,
      defaultTtl,
      minTtl: MIN_TTL,
      semaphore: Permits.makeSemaphoreBackend(state.permits, {
        backend: "memory",
        maxNameBytes: MAX_NAME_BYTES,
        defaultTtl,
        minTtl: MIN_TTL,
        nextOwner: () => state.nextOwner++
      }),
      renewBatchSize: 10_000,
      instantRelease: true,
      acquire: (request) => Effect.suspend(() => attempt(request, state.nextOwner++)),
      renew: (grants) =>
        Effect.withFiberRuntime((fiber) => {
          const now = fiberMillis(fiber)
          return Effect.succeed(grants.map((grant) => renewOne(grant, now)))
        })
    }
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

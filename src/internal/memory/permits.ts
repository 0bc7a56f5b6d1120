/**
 * The permit half of the in-memory store: semaphores with a per-name limit, permits taken all or
 * none, a FIFO queue of waiters, leases with a ttl, and a fencing token per permit.
 *
 * As in the lock half, every operation reads the clock, checks and changes the entries in one
 * synchronous step; only telling holders they lost their permits happens afterwards.
 *
 * Fairness: waiters are served in arrival order. A release wakes, from the head of the queue,
 * every waiter that fits into the permits now free, and stops at the first that does not: a
 * request for many permits is not starved by a stream of small ones, and a newcomer never takes
 * permits ahead of a waiter (it queues, and is served at once only when the queue lets it).
 * Permits of a woken waiter are set aside for it until it takes them or leaves.
 */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"
import * as FencingToken from "../../FencingToken.js"
import type { PermitGrant, PermitRequest, PermitResult, RenewOutcome, SemaphoreBackend } from "../../LockBackend.js"
import type { LostReason } from "../../LockError.js"
import { fiberMillis, sleepMillis } from "../core/clock.js"

interface PermitHolder {
  readonly owner: number
  readonly permits: number
  readonly tokens: ReadonlyArray<FencingToken.FencingToken>
  readonly onLost: (reason: LostReason) => Effect.Effect<void>
  expiresAt: number
}

interface Waiter {
  readonly permits: number
  /** Set by `pump` in the step that sets its permits aside; the waiter takes them when it looks again. */
  woken: boolean
  readonly signal: Deferred.Deferred<void>
}

/** One semaphore name in the store. */
export interface PermitEntry {
  /** Last token handed out; entries are kept forever so tokens never repeat. */
  counter: bigint
  /** The limit every holder and waiter agreed on; meaningful only while the name is in use. */
  limit: number
  /** Permits held, summed over holders. */
  held: number
  /** Permits set aside for woken waiters that have not taken them yet. */
  reserved: number
  readonly holders: Map<number, PermitHolder>
  /** Waiters in arrival order (woken ones stay until they take their permits or leave). */
  readonly queue: Array<Waiter>
}

/** The permit state of one store: semaphore names are a namespace of their own, apart from lock names. */
export type PermitEntries = Map<string, PermitEntry>

/** One semaphore in use, as `MemoryBackend.semaphores` reports it. */
export interface StoredSemaphore {
  readonly name: string
  readonly limit: number
  /** Live holders (expired ones excluded): permits and tokens of each. */
  readonly holders: ReadonlyArray<{
    readonly permits: number
    readonly tokens: ReadonlyArray<FencingToken.FencingToken>
    readonly expiresAt: number
  }>
  /** Permits asked by each waiter, in queue order. */
  readonly waiting: ReadonlyArray<number>
}

export interface MemoryPermitGrant extends PermitGrant {
  readonly name: string
  readonly owner: number
  readonly permits: number
  readonly ttlMillis: number
}

const inUse = (entry: PermitEntry): boolean => entry.holders.size > 0 || entry.queue.length > 0

const entryOf = (entries: PermitEntries, name: string): PermitEntry => {
  let entry = entries.get(name)
  if (entry === undefined) {
    entries.set(name, entry = { counter: 0n, limit: 0, held: 0, reserved: 0, holders: new Map(), queue: [] })
  }
  return entry
}

/** Wakes waiters from the head of the queue while they fit; stops at the first that does not. Synchronous. */
const pump = (entry: PermitEntry): void => {
  for (const waiter of entry.queue) {
    if (waiter.woken) continue
    if (waiter.permits > entry.limit - entry.held - entry.reserved) return
    // Set aside in the same step as the wake-up: nobody else can take these permits meanwhile.
    waiter.woken = true
    entry.reserved += waiter.permits
    Deferred.unsafeDone(waiter.signal, Exit.void)
  }
}

const removeHolder = (entry: PermitEntry, holder: PermitHolder): void => {
  if (entry.holders.delete(holder.owner)) entry.held -= holder.permits
}

/** Drops holders whose lease ran out and wakes the waiters that now fit; returns them to be told. */
const purgeExpired = (entry: PermitEntry, now: number): Array<PermitHolder> | undefined => {
  let expired: Array<PermitHolder> | undefined
  for (const holder of entry.holders.values()) {
    if (holder.expiresAt <= now) (expired ??= []).push(holder)
  }
  if (expired === undefined) return undefined
  for (const holder of expired) removeHolder(entry, holder)
  pump(entry)
  return expired
}

/** A waiter leaves without taking its permits: its place and anything set aside for it go to the next. */
const abandon = (entry: PermitEntry, waiter: Waiter): void => {
  const index = entry.queue.indexOf(waiter)
  if (index < 0) return
  entry.queue.splice(index, 1)
  if (waiter.woken) entry.reserved -= waiter.permits
  pump(entry)
}

const tellLost = (gone: ReadonlyArray<PermitHolder> | undefined, reason: LostReason): Effect.Effect<void> =>
  gone === undefined ? Effect.void : Effect.forEach(gone, (holder) => holder.onLost(reason), { discard: true })

/**
 * Takes every permit of `name` away: holders are told `revoked`, waiters that now fit are woken.
 */
export const revoke = (entries: PermitEntries, name: string): Effect.Effect<void> =>
  Effect.suspend(() => {
    const entry = entries.get(name)
    if (entry === undefined || entry.holders.size === 0) return Effect.void
    const gone = Array.from(entry.holders.values())
    for (const holder of gone) removeHolder(entry, holder)
    pump(entry)
    return tellLost(gone, "revoked")
  })

/** The semaphores in use right now (expired holders excluded). */
export const snapshot = (entries: PermitEntries, now: number): ReadonlyArray<StoredSemaphore> => {
  const out: Array<StoredSemaphore> = []
  for (const [name, entry] of entries) {
    const holders = Array.from(entry.holders.values())
      .filter((holder) => holder.expiresAt > now)
      .map((holder) => ({ permits: holder.permits, tokens: holder.tokens, expiresAt: holder.expiresAt }))
    if (holders.length === 0 && entry.queue.length === 0) continue
    out.push({ name, limit: entry.limit, holders, waiting: entry.queue.map((waiter) => waiter.permits) })
  }
  return out
}

/** The parameters the memory backend shares between its lock and permit halves. */
export interface PermitParams {
  readonly backend: string
  readonly maxNameBytes: number
  readonly defaultTtl: Duration.Duration
  readonly minTtl: Duration.Duration
  readonly nextOwner: () => number
}

/** Builds the permit store of one memory backend over `entries` (shared by every layer of one store). */
export const makeSemaphoreBackend = (
  entries: PermitEntries,
  params: PermitParams
): SemaphoreBackend<MemoryPermitGrant> => {
  const release = (name: string, owner: number): Effect.Effect<void> =>
    Effect.sync(() => {
      const entry = entries.get(name)
      const holder = entry?.holders.get(owner)
      // Owner-scoped: a holder whose permits were taken over finds nothing of its own and touches nothing.
      if (entry === undefined || holder === undefined) return
      removeHolder(entry, holder)
      pump(entry)
    })

  /** Grants `request.permits` free permits, with a token each. Synchronous. */
  const grant = (entry: PermitEntry, request: PermitRequest, owner: number, now: number) => {
    const permits = request.permits
    entry.held += permits
    const first = entry.counter + 1n
    entry.counter += BigInt(permits)
    const tokens = permits === 1
      ? [FencingToken.make(first)]
      : Array.from({ length: permits }, (_, i) => FencingToken.make(first + BigInt(i)))
    const ttlMillis = Duration.toMillis(request.ttl)
    entry.holders.set(owner, { owner, permits, tokens, onLost: request.onLost, expiresAt: now + ttlMillis })
    const granted: MemoryPermitGrant = {
      name: request.name,
      owner,
      permits,
      ttlMillis,
      token: tokens[0]!,
      tokens,
      validUntil: Option.some(now + ttlMillis),
      release: release(request.name, owner)
    }
    return { _tag: "Granted" as const, grant: granted }
  }

  /** Hands the permits set aside for `waiter` to it. Synchronous. */
  const take = (entry: PermitEntry, waiter: Waiter, request: PermitRequest, owner: number, now: number) => {
    const index = entry.queue.indexOf(waiter)
    if (index >= 0) entry.queue.splice(index, 1)
    entry.reserved -= waiter.permits
    return grant(entry, request, owner, now)
  }

  /** Waits until the waiter's permits are set aside for it (or a holder's lease runs out), then takes them. */
  const waitFor = (
    entry: PermitEntry,
    waiter: Waiter,
    request: PermitRequest,
    owner: number
  ): Effect.Effect<PermitResult<MemoryPermitGrant>> => {
    const look: Effect.Effect<PermitResult<MemoryPermitGrant>> = Effect.withFiberRuntime((fiber) => {
      const now = fiberMillis(fiber)
      const expired = purgeExpired(entry, now)
      const told = tellLost(expired, "stolen")
      if (waiter.woken) return Effect.as(told, take(entry, waiter, request, owner, now))
      let nextExpiry = Number.POSITIVE_INFINITY
      for (const holder of entry.holders.values()) nextExpiry = Math.min(nextExpiry, holder.expiresAt)
      // Wake when permits are set aside for this waiter, or when the earliest lease runs out.
      const woken = Deferred.await(waiter.signal)
      const wake = nextExpiry === Number.POSITIVE_INFINITY
        ? woken
        : Effect.raceFirst(woken, sleepMillis(Math.max(0, nextExpiry - now)))
      return Effect.zipRight(
        told,
        Effect.flatMap(request.waitUntilDeadline(wake), (woke) =>
          Option.isNone(woke) ? Effect.succeed({ _tag: "TimedOut" } as const) : look)
      )
    })
    // However the wait ends without a grant (deadline, interruption), the waiter's place and any
    // permits set aside for it are handed on: nothing is left behind.
    return Effect.onExit(look, (exit) =>
      Exit.isSuccess(exit) && exit.value._tag === "Granted" ? Effect.void : Effect.sync(() => abandon(entry, waiter)))
  }

  const attempt = (request: PermitRequest, owner: number): Effect.Effect<PermitResult<MemoryPermitGrant>> =>
    Effect.withFiberRuntime((fiber) => {
      const entry = entryOf(entries, request.name)
      const now = fiberMillis(fiber)
      const expired = entry.holders.size === 0 ? undefined : purgeExpired(entry, now)
      const told = <A>(result: A): Effect.Effect<A> =>
        expired === undefined ? Effect.succeed(result) : Effect.as(tellLost(expired, "stolen"), result)
      if (inUse(entry) && entry.limit !== request.limit) {
        return told({ _tag: "LimitMismatch" as const, current: entry.limit })
      }
      if (!inUse(entry)) entry.limit = request.limit
      // A newcomer is served at once only if nobody waits ahead of it and its permits are free
      // (with an empty queue nothing is set aside either); otherwise it queues, in this same step.
      if (entry.queue.length === 0 && request.permits <= entry.limit - entry.held) {
        return told(grant(entry, request, owner, now))
      }
      if (request.attempt === "once") return told({ _tag: "Busy" as const })
      const waiter: Waiter = { permits: request.permits, woken: false, signal: Deferred.unsafeMake<void>(fiber.id()) }
      entry.queue.push(waiter)
      pump(entry)
      if (waiter.woken) return told(take(entry, waiter, request, owner, now))
      return Effect.zipRight(told(undefined), waitFor(entry, waiter, request, owner))
    })

  const renewOne = (grant: MemoryPermitGrant, now: number): RenewOutcome => {
    const entry = entries.get(grant.name)
    const holder = entry?.holders.get(grant.owner)
    if (entry === undefined || holder === undefined) {
      let taken = false
      if (entry !== undefined) for (const h of entry.holders.values()) if (h.expiresAt > now) taken = true
      return { _tag: "Lost", reason: taken ? "stolen" : "expired" }
    }
    if (holder.expiresAt <= now) {
      removeHolder(entry, holder)
      pump(entry)
      return { _tag: "Lost", reason: "expired" }
    }
    holder.expiresAt = now + grant.ttlMillis
    return { _tag: "Renewed", validUntil: holder.expiresAt }
  }

  return {
    backend: params.backend,
    maxNameBytes: params.maxNameBytes,
    defaultTtl: params.defaultTtl,
    minTtl: params.minTtl,
    renewBatchSize: 10_000,
    instantRelease: true,
    acquire: (request) => Effect.suspend(() => attempt(request, params.nextOwner())),
    renew: (grants) =>
      Effect.withFiberRuntime((fiber) => {
        const now = fiberMillis(fiber)
        return Effect.succeed(grants.map((grant) => renewOne(grant, now)))
      })
  }
}

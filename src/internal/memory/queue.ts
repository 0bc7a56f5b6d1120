/**
 * The waiting machinery both halves of the memory store share (locks in `locks.ts`, semaphores in
 * `permits.ts`): per name, holders with a lease, a queue of waiters, and a capacity counted in
 * units. A semaphore has `limit` units and a holder takes its permits; a lock has `LOCK_UNITS`, a
 * shared holder takes one and an exclusive holder all of them (the reader-writer semaphore).
 *
 * Every operation reads the clock, checks and changes the entries in one synchronous step: no
 * other fiber can run between a check and the change it decides, however often the runtime
 * switches fibers. Only telling holders they lost their lease happens afterwards.
 *
 * Waiting order, the same as PgLease's: waiters are served first in, first out. A release, an
 * expiry or a waiter leaving wakes, from the head of the queue, every waiter that fits into the
 * units now free, and stops at the first that does not: a shared request queues behind a waiting
 * exclusive one, and a request for many permits is not starved by a stream of small ones. The
 * units of a woken waiter are set aside for it until it takes them or leaves, and a newcomer (a
 * try included) is served at once only when nobody is queued: nothing overtakes a waiter.
 *
 * A waiter waits for its wake-up, never on a timer of its own for the holders ahead of it: their
 * expiry is swept by its backend's alarm (`expiry.ts`), whose timers are never interrupted. Its
 * own deadline, when it has one, is the core's (`waitUntilDeadline`, a sleep raced against the
 * wait); a wait without a deadline races no sleep at all.
 *
 * Names come and go: an entry exists only while its name is held or waited for. Every step that
 * can leave a name idle (a release, a revocation, an expiry found by a renewal, an acquire or the
 * alarm's sweep, a waiter leaving) ends by deleting the entry when it has neither holders nor
 * waiters (`settle`). Fencing tokens therefore do not live in the entry: they come from the
 * store's one counter (`Tokens`), shared by its locks and semaphores, so a name freed and used
 * again still gets larger tokens. A holder is watched by its backend's alarm like a waiter, so a
 * lease nobody gives back is swept (and its name freed) when it runs out.
 *
 * Why a queue of its own rather than Effect's `Semaphore`: a store is shared by several layers
 * (processes), and its holders have leases that expire, are renewed, revoked and fenced.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import type * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as FencingToken from "../../FencingToken.js"
import type { AcquireRequest, AcquireResult, Grant, RenewOutcome } from "../../LockBackend.js"
import type { LostReason } from "../../LockError.js"
import { fiberMillis } from "../core/clock.js"
import { Cell } from "../runtime/cell.js"

/** The units of a lock: an exclusive holder takes them all, a shared one a single unit. */
export const LOCK_UNITS = Number.MAX_SAFE_INTEGER

/** The one token counter of a store: every lock and permit grant of the store draws from it. */
export interface Tokens {
  /** Last token handed out (0: none yet). */
  last: bigint
}

export interface Holder {
  readonly owner: number
  /** The alarm of the holder's backend, which sweeps the lease when it runs out (moved to another on close). */
  alarm: Alarm
  /** Units of the name's capacity it takes. */
  readonly units: number
  /** Its fencing tokens: one for a lock, one per permit for a semaphore. */
  readonly tokens: ReadonlyArray<FencingToken.FencingToken>
  readonly onLost: (reason: LostReason) => Effect.Effect<void>
  /** Its lease length: a renewal runs it from the renewal's time. */
  readonly ttlMillis: number
  expiresAt: number
}

interface Waiter {
  readonly units: number
  /** Set by `pump` in the step that sets its units aside; the waiter takes them when it resumes. */
  woken: boolean
  /** Set by `pump`: a cell, so that the wait races its deadline without a fiber (`callbackStep`). */
  readonly signal: Cell<void>
  /** The expiry alarm of the waiter's backend, which sweeps the holders ahead of it. */
  readonly alarm: Alarm
}

/** One name in the store, while it is held or waited for (deleted as soon as it is idle). */
export interface Entry {
  readonly name: string
  /** The map it is stored in, to delete itself from once idle. */
  readonly entries: Entries
  /** The capacity every holder and waiter agreed on; for a semaphore meaningful only while in use. */
  limit: number
  /** Units held, summed over holders. */
  held: number
  /** Units set aside for woken waiters that have not taken them yet. */
  reserved: number
  readonly holders: Map<number, Holder>
  /** Waiters in arrival order (woken ones stay until they take their units or leave). */
  readonly queue: Array<Waiter>
  /** The alarms of the backends whose waiters are queued or holders hold here, with how many each. */
  readonly watchers: Map<Alarm, number>
}

/** The entries of one namespace of a store (lock names and semaphore names are apart). */
export type Entries = Map<string, Entry>

/**
 * What the queue needs of a backend's expiry alarm (made in `expiry.ts`): the entries its
 * waiters wait in or its holders hold, and a timer that sweeps them.
 */
export interface Alarm {
  /** Entries in which waiters of this backend are queued or holders of it hold a lease. */
  readonly watched: Set<Entry>
  /** Makes sure the watched entries are swept at `at` (monotonic ms) or earlier. */
  readonly arm: (at: number) => void
}

/** What a memory grant carries, lock or permits: enough to renew and release it. */
export interface MemoryGrant extends Grant {
  readonly name: string
  readonly owner: number
  readonly ttlMillis: number
}

/**
 * One acquire of `units` of `request.name` (a name of capacity `limit`) for `owner`, whose grant
 * carries `tokens` fencing tokens.
 */
export interface Claim {
  readonly request: AcquireRequest
  readonly owner: number
  readonly limit: number
  readonly units: number
  readonly tokens: number
  /** The store's token counter the grant draws its tokens from. */
  readonly counter: Tokens
}

/**
 * Serves `wanted` in one step that checks its name as of now: expired holders are dropped (told
 * `stolen` afterwards: a newcomer takes over), a name nobody uses takes the claim's `limit`,
 * `refuse` may answer instead (a semaphore's limit mismatch), and then the claim is granted, found
 * busy, or queued until it is served or the deadline passes. `toGrant` shapes the grant.
 */
export const acquire = <G, R = never>(
  entries: Entries,
  alarm: Alarm,
  wanted: Claim,
  toGrant: (grant: MemoryGrant, holder: Holder) => G,
  refuse?: (entry: Entry) => R | undefined
): Effect.Effect<AcquireResult<G> | R> =>
  Effect.withFiberRuntime((fiber) => {
    const name = wanted.request.name
    const entry = entryOf(entries, name, wanted.limit)
    const expired = purgeExpired(entry, fiberMillis(fiber))
    if (!inUse(entry)) entry.limit = wanted.limit
    const refused = refuse?.(entry)
    const decided: Effect.Effect<AcquireResult<G> | R> = refused !== undefined
      ? Effect.succeed(refused)
      : Effect.map(claim(entry, wanted, alarm, fiber), (result) =>
        result._tag === "Granted" ? { _tag: "Granted", grant: toGrant(grantOf(entries, name, result.grant), result.grant) } : result)
    // A refusal or a busy try leaves nothing of its own; a name the purge left idle is freed.
    settle(entry)
    return expired === undefined ? decided : Effect.zipRight(tellLost(expired, "stolen"), decided)
  })

/** The grant handed out for `holder` of `name` (a lock's as is; a semaphore's adds its permits). */
const grantOf = (entries: Entries, name: string, holder: Holder): MemoryGrant => ({
  name,
  owner: holder.owner,
  ttlMillis: holder.ttlMillis,
  token: holder.tokens[0]!,
  validUntil: Option.some(holder.expiresAt),
  release: release(entries, name, holder.owner)
})

const entryOf = (entries: Entries, name: string, limit: number): Entry => {
  let entry = entries.get(name)
  if (entry === undefined) {
    entries.set(
      name,
      entry = { name, entries, limit, held: 0, reserved: 0, holders: new Map(), queue: [], watchers: new Map() }
    )
  }
  return entry
}

const inUse = (entry: Entry): boolean => entry.holders.size > 0 || entry.queue.length > 0

/**
 * Deletes `entry` from its store once nobody holds or waits for its name: an idle name keeps no
 * state (its tokens come from the store's counter). Called at the end of every step that can
 * leave a name idle, never in the middle of one (an acquire purges and then claims the same entry).
 */
const settle = (entry: Entry): void => {
  if (!inUse(entry) && entry.entries.get(entry.name) === entry) entry.entries.delete(entry.name)
}

/** When the earliest lease of `entry` runs out (`Infinity` without holders). */
const nextExpiry = (entry: Entry): number => {
  let next = Number.POSITIVE_INFINITY
  for (const holder of entry.holders.values()) next = Math.min(next, holder.expiresAt)
  return next
}

/** Wakes waiters from the head of the queue while they fit; stops at the first that does not. Synchronous. */
const pump = (entry: Entry): void => {
  for (const waiter of entry.queue) {
    if (waiter.woken) continue
    if (waiter.units > entry.limit - entry.held - entry.reserved) return
    // Set aside in the same step as the wake-up: nobody else can take these units meanwhile.
    waiter.woken = true
    entry.reserved += waiter.units
    waiter.signal.set(undefined)
  }
}

const watch = (entry: Entry, alarm: Alarm): void => {
  entry.watchers.set(alarm, (entry.watchers.get(alarm) ?? 0) + 1)
  alarm.watched.add(entry)
}

const unwatch = (entry: Entry, alarm: Alarm): void => {
  const left = (entry.watchers.get(alarm) ?? 1) - 1
  if (left > 0) return void entry.watchers.set(alarm, left)
  entry.watchers.delete(alarm)
  alarm.watched.delete(entry)
}

/** Takes `waiter` out of the queue (taking its units or leaving); false when it is no longer there. */
const dequeue = (entry: Entry, waiter: Waiter): boolean => {
  const index = entry.queue.indexOf(waiter)
  if (index < 0) return false
  entry.queue.splice(index, 1)
  if (waiter.woken) entry.reserved -= waiter.units
  unwatch(entry, waiter.alarm)
  return true
}

/** Removes a holder (released, expired, revoked) and wakes the waiters that now fit. */
const removeHolder = (entry: Entry, holder: Holder): void => {
  if (!entry.holders.delete(holder.owner)) return
  entry.held -= holder.units
  unwatch(entry, holder.alarm)
  pump(entry)
}

/** Drops holders whose lease ran out and wakes the waiters that now fit; returns them to be told. */
const purgeExpired = (entry: Entry, now: number): Array<Holder> | undefined => {
  let expired: Array<Holder> | undefined
  for (const holder of entry.holders.values()) {
    if (holder.expiresAt <= now) (expired ??= []).push(holder)
  }
  if (expired !== undefined) for (const holder of expired) removeHolder(entry, holder)
  return expired
}

/** Tells each of `gone` its lease is lost, after the store already changed. */
export const tellLost = (gone: ReadonlyArray<Holder> | undefined, reason: LostReason): Effect.Effect<void> =>
  gone === undefined || gone.length === 0
    ? Effect.void
    : Effect.forEach(gone, (holder) => holder.onLost(reason), { discard: true })

/** Adds the holder `wanted` asks for, with its tokens from the store's counter, as of `now`. Synchronous. */
const grant = (entry: Entry, wanted: Claim, alarm: Alarm, now: number): Holder => {
  const first = wanted.counter.last + 1n
  wanted.counter.last += BigInt(wanted.tokens)
  const tokens = wanted.tokens === 1
    ? [FencingToken.make(first)]
    : Array.from({ length: wanted.tokens }, (_, i) => FencingToken.make(first + BigInt(i)))
  const ttlMillis = Duration.toMillis(wanted.request.ttl)
  const holder: Holder = {
    owner: wanted.owner,
    alarm,
    units: wanted.units,
    tokens,
    onLost: wanted.request.onLost,
    ttlMillis,
    expiresAt: now + ttlMillis
  }
  entry.held += wanted.units
  entry.holders.set(wanted.owner, holder)
  // Its own backend sweeps the lease when it runs out, should nobody give it back or renew it.
  watch(entry, alarm)
  // Waiters still queued behind may have to be swept at this new lease's expiry, earlier than
  // any timer their alarms have yet (its own backend's alarm among them).
  for (const alarm of entry.watchers.keys()) alarm.arm(holder.expiresAt)
  return holder
}

/** What a claim came to: the grant is the holder added to the entry. */
type Claimed = AcquireResult<Holder>

/**
 * A claim served first in, first out, from `fiber`'s step that checks `entry` (its expired
 * holders already dropped). Granted at once when nobody is queued and it fits; otherwise busy
 * (`once`), or queued until woken with its units set aside.
 */
const claim = (entry: Entry, wanted: Claim, alarm: Alarm, fiber: Fiber.RuntimeFiber<unknown, unknown>): Effect.Effect<Claimed> => {
  const now = fiberMillis(fiber)
  if (entry.queue.length === 0 && wanted.units <= entry.limit - entry.held) {
    return Effect.succeed({ _tag: "Granted", grant: grant(entry, wanted, alarm, now) })
  }
  if (wanted.request.attempt === "once") return Effect.succeed({ _tag: "Busy" })
  const waiter: Waiter = { units: wanted.units, woken: false, signal: new Cell<void>(), alarm }
  // Queued in the same step as the check: whatever frees units after it wakes this waiter.
  entry.queue.push(waiter)
  watch(entry, alarm)
  pump(entry)
  if (waiter.woken) return Effect.succeed(take(entry, waiter, wanted, alarm, now))
  const expiry = nextExpiry(entry)
  if (expiry !== Number.POSITIVE_INFINITY) alarm.arm(expiry)
  const waited: Effect.Effect<Claimed> = Effect.flatMap(wanted.request.waitUntilDeadline(waiter.signal.step), (woke) =>
    Option.isNone(woke)
      ? Effect.succeed<Claimed>({ _tag: "TimedOut" })
      // Woken only by `pump`, which set the units aside: they are taken in this step.
      : Effect.withFiberRuntime((fiber) => Effect.succeed(take(entry, waiter, wanted, alarm, fiberMillis(fiber)))))
  // However the wait ends without a grant (deadline, interruption, the service closing), the
  // waiter's place and any units set aside for it go to the next: nothing is left behind, and
  // a name its last waiter left is freed.
  return Effect.onExit(waited, (exit) =>
    Exit.isSuccess(exit) && exit.value._tag === "Granted" ? Effect.void : Effect.sync(() => {
      if (dequeue(entry, waiter)) {
        pump(entry)
        settle(entry)
      }
    }))
}

/** Hands the units set aside for `waiter` to it. Synchronous. */
const take = (entry: Entry, waiter: Waiter, wanted: Claim, alarm: Alarm, now: number): Claimed => {
  dequeue(entry, waiter)
  return { _tag: "Granted", grant: grant(entry, wanted, alarm, now) }
}

/** Gives back the lease of `owner` on `name`; a holder that was taken over finds nothing of its own. */
export const release = (entries: Entries, name: string, owner: number): Effect.Effect<void> =>
  Effect.sync(() => {
    const entry = entries.get(name)
    const holder = entry?.holders.get(owner)
    // Owner-scoped: a holder that was taken over finds no lease of its own and touches nothing.
    if (entry !== undefined && holder !== undefined) {
      removeHolder(entry, holder)
      settle(entry)
    }
  })

/** Takes every lease of `name` away: holders are told `revoked`, waiters that now fit are woken. */
export const revoke = (entries: Entries, name: string): Effect.Effect<void> =>
  Effect.suspend(() => {
    const entry = entries.get(name)
    if (entry === undefined || entry.holders.size === 0) return Effect.void
    const gone = Array.from(entry.holders.values())
    for (const holder of gone) removeHolder(entry, holder)
    settle(entry)
    return tellLost(gone, "revoked")
  })

const renewOne = (entries: Entries, grant: MemoryGrant, now: number): RenewOutcome => {
  const entry = entries.get(grant.name)
  const holder = entry?.holders.get(grant.owner)
  if (entry === undefined || holder === undefined) {
    let taken = false
    if (entry !== undefined) for (const h of entry.holders.values()) if (h.expiresAt > now) taken = true
    return { _tag: "Lost", reason: taken ? "stolen" : "expired" }
  }
  if (holder.expiresAt <= now) {
    removeHolder(entry, holder)
    settle(entry)
    return { _tag: "Lost", reason: "expired" }
  }
  holder.expiresAt = now + holder.ttlMillis
  return { _tag: "Renewed", validUntil: holder.expiresAt }
}

/** Renews a batch of grants in one step, one outcome each, in order. */
export const renew = (entries: Entries, grants: ReadonlyArray<MemoryGrant>): Effect.Effect<ReadonlyArray<RenewOutcome>> =>
  Effect.withFiberRuntime((fiber) => {
    const now = fiberMillis(fiber)
    return Effect.succeed(grants.map((grant) => renewOne(entries, grant, now)))
  })

/**
 * The alarm's sweep of the entries its waiters wait in or its holders hold, at `now`: expired
 * holders are dropped (told `stolen` when a waiter takes over, else `expired`), the waiters that
 * now fit woken, and a name left idle freed. Returns when the entries must be swept next
 * (`Infinity`: no more), and the holders to tell.
 */
export const sweep = (
  watched: Iterable<Entry>,
  now: number
): { readonly next: number; readonly stolen: Array<Holder>; readonly expired: Array<Holder> } => {
  let next = Number.POSITIVE_INFINITY
  const stolen: Array<Holder> = []
  const expired: Array<Holder> = []
  // A copy: dropping a holder may take its entry out of the set being swept.
  for (const entry of Array.from(watched)) {
    const gone = purgeExpired(entry, now)
    if (gone !== undefined) (entry.queue.length > 0 ? stolen : expired).push(...gone)
    settle(entry)
    next = Math.min(next, nextExpiry(entry))
  }
  return { next, stolen, expired }
}

/**
 * Hands the leases of `from`'s holders over to `to` (a closing backend's to a live one), so a
 * lease nobody gives back is still swept when it runs out. Waiters stay with their own alarm.
 */
export const adopt = (from: Alarm, to: Alarm): void => {
  for (const entry of Array.from(from.watched)) {
    for (const holder of entry.holders.values()) {
      if (holder.alarm !== from) continue
      unwatch(entry, from)
      holder.alarm = to
      watch(entry, to)
      to.arm(holder.expiresAt)
    }
  }
}

/**
 * The waiters of one lease backend in this process, and how they are woken: each waiter is
 * subscribed under its lock name and its place in the queue (an id), and a wake-up names either
 * (a release names the waiters now at the head; a revoke names the lock). Where wake-ups come
 * from is the hub's business: PostgreSQL's LISTEN connection (`pg/wake`), or this process's
 * own give-backs (`SqliteLease`, whose waiters of other processes poll).
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type * as Scope from "effect/Scope"
import { callbackStep } from "../runtime/raceEnd.js"
import { PLACE_TTL_MILLIS } from "./place.js"

const noop = () => {}

/** How long an ended request's id is remembered: a place outlives its last write by at most this. */
const ENDED_KEPT_MILLIS = PLACE_TTL_MILLIS + 1_000

/** What a waiter holds while it waits for one name. */
export interface Subscription {
  /** The wake-ups so far: take it before an attempt, and wait with it after a failed one. */
  readonly mark: Effect.Effect<number>
  /**
   * Until a wake-up that came after `mark` (at once if one already has: true), or `delay` (false).
   * One wait at a time per subscription.
   */
  readonly wait: (mark: number, delay: Duration.Duration) => Effect.Effect<boolean>
  /** The lease a release handed to this waiter's place, once the hub heard of it (PgLease, RedisLease). */
  readonly handed: () => Handed | undefined
}

/** A lease a release handed to a waiting place, as its notification says (`pg/sql`'s release). */
export interface Handed {
  readonly token: bigint
  /** When the lease runs out at the store, on the store's clock (epoch ms). */
  readonly expiresMs: number
}

/**
 * A subscription whose end is the caller's (`unsubscribe`, synchronous and idempotent). `granted`:
 * the request ended holding the lease; otherwise its id is remembered for a while, so that a
 * lease a release hands to its place after all is given back (`WakeHub.onHandedToEnded`).
 */
export interface Unsubscribable {
  readonly subscription: Subscription
  readonly unsubscribe: (granted?: boolean) => void
}

export interface WakeHub {
  /**
   * Subscribes the waiter `waiter` (its place in the queue) of the lock `name`: it is woken by a
   * wake-up naming it, one naming the lock (a revoke), and whenever the hub loses its source.
   */
  readonly subscribe: (name: string, waiter: string) => Effect.Effect<Subscription, never, Scope.Scope>
  /** `subscribe` without a scope: the caller calls `unsubscribe` (once) when it stops waiting. */
  readonly subscribeNow: (name: string, waiter: string) => Effect.Effect<Unsubscribable>
  /** True while wake-ups are proven to arrive: waiters may then sleep long. */
  readonly trusted: Effect.Effect<boolean>
  /**
   * Wakes at once the waiters of this process among `waiters` (ids of places): a give-back of
   * this process found them at the head of the queue. Ids of other processes are ignored.
   */
  readonly wake: (waiters: ReadonlyArray<string>) => void
  /**
   * Sets who gives back a lease a release handed to the place of a request of this process that
   * has ended (its leave failed, or is still on its way): `name` is the key it subscribed under.
   * Absent on hubs of stores that never hand a lease over.
   */
  readonly onHandedToEnded?: ((giveBack: (name: string, waiter: string) => void) => void) | undefined
}

/** One waiter: a count of its wake-ups, and its pending wait if any. Every change is synchronous. */
interface Waiter {
  readonly name: string
  /** When it was registered, on the registry's clock. */
  readonly registeredAt: number
  wakes: number
  resume: (() => void) | undefined
  handed: Handed | undefined
}

/** The registry a hub keeps its waiters in; every method is synchronous. */
export interface Waiters {
  /** Subscribes a waiter; `onSubscribe` runs once it is registered (e.g. to start a listener). */
  readonly subscribe: (name: string, waiter: string, onSubscribe: Effect.Effect<void>) => Effect.Effect<Subscription, never, Scope.Scope>
  /** `subscribe` without a scope (see `WakeHub.subscribeNow`). */
  readonly subscribeNow: (name: string, waiter: string, onSubscribe: Effect.Effect<void>) => Effect.Effect<Unsubscribable>
  /** Registers a waiter in this call, for a hub whose `onSubscribe` has nothing left to do. */
  readonly register: (name: string, waiter: string) => Unsubscribable
  /**
   * Wakes the waiter with this id, if it is one of this process's: then returns when it was
   * registered (`makeWaiters`'s clock), else `undefined`.
   */
  readonly wakeWaiter: (waiter: string) => number | undefined
  /**
   * Tells the waiter with this id that its place was handed the lease, and wakes it; a request of
   * this process that ended lately has it given back (`onHandedToEnded`); others' are ignored.
   * Returns when the waiter was registered, if the id is one of this process's waiters.
   */
  readonly handWaiter: (waiter: string, handed: Handed) => number | undefined
  /** Whether the id is one of this process's waiters, or of its requests that ended lately. */
  readonly knows: (waiter: string) => boolean
  /** See `WakeHub.onHandedToEnded`. */
  readonly onHandedToEnded: (giveBack: (name: string, waiter: string) => void) => void
  /** Wakes every waiter of the lock `name`. */
  readonly wakeName: (name: string) => void
  /** Wakes every waiter (their source of wake-ups was lost: they re-check and poll). */
  readonly wakeAll: () => void
  /** How many waiters are subscribed. */
  readonly size: () => number
}

/** `now`: the clock registrations are timed on (a hub's monotonic one). */
export const makeWaiters = (now: () => number = () => performance.now()): Waiters => {
  // Each waiter has an entry of its own, added and removed synchronously: no entry is shared,
  // so none can be replaced or counted down under a waiter still holding it.
  const byName = new Map<string, Set<Waiter>>()
  const byId = new Map<string, Waiter>()
  // Requests that ended without a grant lately, in the order they ended: a release may still
  // hand a lease to a place whose leave has not landed (or failed) while the place lives.
  const ended = new Map<string, { readonly name: string; readonly until: number }>()
  let giveBackEnded: ((name: string, waiter: string) => void) | undefined
  /** Forgets the ended requests whose places have surely run out (the oldest first). */
  const trimEnded = (now: number) => {
    for (const [old, entry] of ended) {
      if (entry.until > now) break
      ended.delete(old)
    }
  }
  // Trims once the process goes quiet too: nothing of a burst of ended requests outlives its places.
  let trimming: ReturnType<typeof setTimeout> | undefined
  const trimLater = () => {
    if (trimming !== undefined || ended.size === 0) return
    trimming = setTimeout(() => {
      trimming = undefined
      trimEnded(performance.now())
      trimLater()
    }, ENDED_KEPT_MILLIS)
    // Never keeps the process alive: the memory goes with it.
    trimming.unref?.()
  }
  const rememberEnded = (id: string, name: string) => {
    // Only stores that hand leases over (PgLease, RedisLease) need it.
    if (giveBackEnded === undefined) return
    const now = performance.now()
    trimEnded(now)
    ended.set(id, { name, until: now + ENDED_KEPT_MILLIS })
    trimLater()
  }

  const fire = (waiter: Waiter) => {
    waiter.wakes++
    const resume = waiter.resume
    waiter.resume = undefined
    resume?.()
  }

  const subscriptionOf = (waiter: Waiter): Subscription => ({
    mark: Effect.sync(() => waiter.wakes),
    handed: () => waiter.handed,
    // A raw timer and a callback in one step, not the Clock's sleep raced against the wake-up:
    // that race is two fibers per wait on every handoff's path (issue 23), and an interrupted
    // sleep is the TestClock trap of Effect-TS/effect#6910. Lease backends run on real time only.
    // A callback step: the core races it with the deadline and the closing service without a fiber.
    wait: (mark, delay) =>
      callbackStep<boolean>((done) => {
        if (waiter.wakes !== mark) {
          done(true)
          return noop
        }
        const timer = setTimeout(() => {
          if (waiter.resume === woken) waiter.resume = undefined
          done(false)
        }, Duration.toMillis(delay))
        const woken = () => {
          clearTimeout(timer)
          done(true)
        }
        waiter.resume = woken
        return () => {
          clearTimeout(timer)
          if (waiter.resume === woken) waiter.resume = undefined
        }
      })
  })

  /** Registers a waiter in one synchronous step; the returned `unsubscribe` takes it off again. */
  const register = (name: string, id: string): Unsubscribable => {
    const waiter: Waiter = { name, registeredAt: now(), wakes: 0, resume: undefined, handed: undefined }
    byId.set(id, waiter)
    let named = byName.get(name)
    if (named === undefined) byName.set(name, named = new Set())
    named.add(waiter)
    let subscribed = true
    return {
      subscription: subscriptionOf(waiter),
      unsubscribe: (granted = false) => {
        if (!subscribed) return
        subscribed = false
        if (!granted) rememberEnded(id, name)
        if (byId.get(id) === waiter) byId.delete(id)
        const set = byName.get(name)
        set?.delete(waiter)
        if (set?.size === 0) byName.delete(name)
      }
    }
  }

  const subscribeNow = (name: string, id: string, onSubscribe: Effect.Effect<void>): Effect.Effect<Unsubscribable> =>
    Effect.suspend(() => Effect.as(onSubscribe, register(name, id)))

  const subscribe = (name: string, id: string, onSubscribe: Effect.Effect<void>): Effect.Effect<Subscription, never, Scope.Scope> =>
    Effect.map(
      Effect.acquireRelease(subscribeNow(name, id, onSubscribe), (registered) => Effect.sync(registered.unsubscribe)),
      (registered) => registered.subscription
    )

  return {
    subscribe,
    subscribeNow,
    register,
    wakeWaiter: (id) => {
      const waiter = byId.get(id)
      if (waiter === undefined) return undefined
      fire(waiter)
      return waiter.registeredAt
    },
    handWaiter: (id, handed) => {
      const waiter = byId.get(id)
      if (waiter !== undefined) {
        waiter.handed = handed
        fire(waiter)
        return waiter.registeredAt
      }
      const gone = ended.get(id)
      if (gone === undefined || gone.until <= performance.now()) return undefined
      ended.delete(id)
      giveBackEnded?.(gone.name, id)
      return undefined
    },
    knows: (id) => byId.has(id) || ended.has(id),
    onHandedToEnded: (giveBack) => {
      giveBackEnded = giveBack
    },
    wakeName: (name) => {
      for (const waiter of byName.get(name) ?? []) fire(waiter)
    },
    wakeAll: () => {
      for (const waiter of byId.values()) fire(waiter)
    },
    size: () => byId.size
  }
}

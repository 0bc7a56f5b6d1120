/**
 * The in-process admission table of the advisory backend. PostgreSQL session locks are
 * re-entrant per session, and this process multiplexes many locks over few sessions, so the
 * process itself must decide which of its fibers may ask the server for a key: at most one
 * exclusive at a time (holding or trying), and at most one *fresh* shared request at a time
 * (later shared requests join the server grant the first one got). Admission is FIFO per key, so
 * a queued exclusive request is not starved by a stream of shared ones.
 */
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"
import type { LockMode } from "../../Lease.js"
import { Cell } from "../runtime/cell.js"

interface Ticket {
  readonly mode: LockMode
  /** Set by `pump`: a cell, so that the wait races its deadline as a callback, with no fiber (`callbackStep`). */
  readonly admitted: Cell<void>
  state: "queued" | "admitted" | "abandoned"
}

interface Entry {
  /** An exclusive request is admitted (trying, waiting or holding). */
  exclusive: boolean
  /** A shared request is admitted and has no grant yet. */
  sharedPending: boolean
  /** Shared grants this process holds (admitted, granted, not yet released). */
  sharedHeld: number
  readonly queue: Array<Ticket>
}

/** What an admitted request gives back when it is done. */
export interface Admission {
  readonly key: string
  readonly mode: LockMode
}

export interface LocalKeys {
  /** Admits now, in this synchronous step, if nothing local stands in the way and nobody is queued; else undefined. */
  readonly tryAdmitNow: (key: string, mode: LockMode) => Admission | undefined
  /**
   * `admit`'s first step, synchronous: the admission when nothing local stands in the way and
   * nobody is queued, with no ticket; else undefined (then `queue`).
   */
  readonly admitNow: (key: string, mode: LockMode) => Admission | undefined
  /** `admit`'s slow path, for a caller whose `admitNow` just found the key taken: queues a ticket and waits for it. */
  readonly queue: (
    key: string,
    mode: LockMode,
    wait: (signal: Effect.Effect<void>) => Effect.Effect<Option.Option<void>>
  ) => Effect.Effect<Option.Option<Admission>>
  /**
   * Waits for admission. `wait` runs the interruptible, deadline-bounded wait for the signal and
   * returns `None` when the deadline passed. An admission that races the deadline or an
   * interruption is handed on, never lost.
   */
  readonly admit: (
    key: string,
    mode: LockMode,
    wait: (signal: Effect.Effect<void>) => Effect.Effect<Option.Option<void>>
  ) => Effect.Effect<Option.Option<Admission>>
  /** The admitted request ends: never granted, or its grant is released. Wakes the next ones. */
  readonly leave: (admission: Admission, wasGranted: boolean) => Effect.Effect<void>
  /** `leave` in this synchronous step (from a driver callback). */
  readonly leaveNow: (admission: Admission, wasGranted: boolean) => void
  /** The admitted request got a grant (shared: the next shared request may now join it); in this synchronous step. */
  readonly grantedNow: (admission: Admission) => void
}

export const makeLocalKeys = (): LocalKeys => {
  const entries = new Map<string, Entry>()

  const entryOf = (key: string): Entry => {
    let entry = entries.get(key)
    if (entry === undefined) {
      entry = { exclusive: false, sharedPending: false, sharedHeld: 0, queue: [] }
      entries.set(key, entry)
    }
    return entry
  }

  const admissible = (entry: Entry, mode: LockMode): boolean =>
    mode === "exclusive"
      ? !entry.exclusive && !entry.sharedPending && entry.sharedHeld === 0
      : !entry.exclusive && !entry.sharedPending

  const take = (entry: Entry, mode: LockMode) => {
    if (mode === "exclusive") entry.exclusive = true
    else entry.sharedPending = true
  }

  /** Admits queued tickets in order while they fit; wakes them synchronously. */
  const pump = (key: string, entry: Entry) => {
    while (entry.queue.length > 0) {
      const head = entry.queue[0]!
      if (head.state === "abandoned") {
        entry.queue.shift()
        continue
      }
      if (!admissible(entry, head.mode)) break
      entry.queue.shift()
      take(entry, head.mode)
      head.state = "admitted"
      head.admitted.set(undefined)
    }
    if (!entry.exclusive && !entry.sharedPending && entry.sharedHeld === 0 && entry.queue.length === 0) {
      entries.delete(key)
    }
  }

  const release = (key: string, mode: LockMode, wasGranted: boolean) => {
    const entry = entries.get(key)
    if (entry === undefined) return
    if (mode === "exclusive") entry.exclusive = false
    else if (wasGranted) entry.sharedHeld = Math.max(0, entry.sharedHeld - 1)
    else entry.sharedPending = false
    pump(key, entry)
  }

  /** Queues a ticket and waits for it; the slow path of `admit`. */
  const queued = (
    key: string,
    mode: LockMode,
    wait: (signal: Effect.Effect<void>) => Effect.Effect<Option.Option<void>>
  ): Effect.Effect<Option.Option<Admission>> =>
    // Uninterruptible but for `wait` (the caller decides how interruptible that is): a queued
    // ticket always gets its clean-up below, or it would hold up the key for good.
    Effect.uninterruptibleMask((restore) => {
      const entry = entryOf(key)
      const ticket: Ticket = { mode, admitted: new Cell<void>(), state: "queued" }
      entry.queue.push(ticket)
      pump(key, entry)
      if (ticket.state === "admitted") return Effect.succeed(Option.some<Admission>({ key, mode }))
      return restore(wait(ticket.admitted.step)).pipe(
        Effect.onExit((exit) =>
          Effect.sync(() => {
            if (Exit.isSuccess(exit) && Option.isSome(exit.value)) return
            // Interrupted or out of time: leave the queue, or hand on an admission that raced in.
            if (ticket.state === "admitted") release(key, mode, false)
            else ticket.state = "abandoned"
            const current = entries.get(key)
            if (current !== undefined) pump(key, current)
          })
        ),
        Effect.map((woke) => Option.map(woke, (): Admission => ({ key, mode })))
      )
    })

  /**
   * Admits now, in this one step and with no ticket, when nothing local is in the way and nobody
   * is queued. Abandoned tickets are pumped out first: they must not count as somebody queued.
   */
  const admitNow = (key: string, mode: LockMode): Admission | undefined => {
    const existing = entries.get(key)
    if (existing !== undefined) pump(key, existing)
    const entry = entryOf(key)
    if (entry.queue.length > 0 || !admissible(entry, mode)) return undefined
    take(entry, mode)
    return { key, mode }
  }

  const tryAdmitNow = (key: string, mode: LockMode): Admission | undefined => {
    const admitted = admitNow(key, mode)
    // An entry made only to look is dropped again.
    if (admitted === undefined) pump(key, entryOf(key))
    return admitted
  }

  const grantedNow = (admission: Admission): void => {
    if (admission.mode !== "shared") return
    const entry = entries.get(admission.key)
    if (entry === undefined) return
    entry.sharedPending = false
    entry.sharedHeld += 1
    pump(admission.key, entry)
  }

  return {
    tryAdmitNow,
    admitNow,
    queue: queued,

    admit: (key, mode, wait) =>
      Effect.suspend(() => {
        const admitted = admitNow(key, mode)
        return admitted !== undefined ? Effect.succeed(Option.some(admitted)) : queued(key, mode, wait)
      }),

    leave: (admission, wasGranted) => Effect.sync(() => release(admission.key, admission.mode, wasGranted)),
    leaveNow: (admission, wasGranted) => release(admission.key, admission.mode, wasGranted),
    grantedNow
  }
}

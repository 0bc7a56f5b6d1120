/**
 * The in-memory store and the backend over it: one store is one "cluster" (lock names and
 * semaphore names, each a namespace of its own), and each backend built on it is one process,
 * with its own runtime for its background work (the expiry alarm of its waiters).
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import { identity } from "effect/Function"
import type * as Scope from "effect/Scope"
import type { LockAndSemaphoreBackend } from "../../LockBackend.js"
import * as Owner from "../runtime/owner.js"
import * as Expiry from "./expiry.js"
import * as Locks from "./locks.js"
import * as Permits from "./permits.js"
import * as Queue from "./queue.js"

export const StoreTypeId: unique symbol = Symbol.for("effect-lock/MemoryBackend/Store")

/**
 * The shared state of one store. Only names in use have an entry (held or waited for; see
 * `queue.ts`): a name nobody holds or waits for keeps nothing here. Fencing tokens come from the
 * store's one counter, shared by locks and semaphores, so they never repeat and increase per name
 * also across a name's entry being freed and made again.
 */
export interface StoreState {
  readonly entries: Queue.Entries
  /** Semaphores, a namespace of their own. */
  readonly permits: Queue.Entries
  /** The one token counter of the store (locks and permits). */
  readonly tokens: Queue.Tokens
  /** The expiry alarms of the store's open backends: a closing one hands its leases to another. */
  readonly alarms: Set<Queue.Alarm>
  /** Leases of backends that closed while no other was open, for the next backend to sweep. */
  readonly orphans: Set<Queue.Alarm>
  nextOwner: number
}

export interface Store {
  readonly [StoreTypeId]: StoreState
}

export const makeStore: Effect.Effect<Store> = Effect.sync(() => ({
  [StoreTypeId]: {
    entries: new Map(),
    permits: new Map(),
    tokens: { last: 0n },
    alarms: new Set(),
    orphans: new Set(),
    nextOwner: 0
  }
}))

/**
 * What a store keeps, for tests that prove an idle name keeps nothing: the names with an entry
 * (locks and semaphores), and the entries watched by its backends' expiry alarms (orphans included).
 */
export const size = (store: Store): { readonly entries: number; readonly watched: number } => {
  const state = store[StoreTypeId]
  let watched = 0
  for (const alarm of state.alarms) watched += alarm.watched.size
  for (const alarm of state.orphans) watched += alarm.watched.size
  return { entries: state.entries.size + state.permits.size, watched }
}

/** Shortest lease the memory store keeps; shorter requests are clamped up to it. */
const MIN_TTL = Duration.millis(100)
/** Same bound as the database backends, so names behave alike everywhere. */
const MAX_NAME_BYTES = 1024

/** The backend of one process on `store`; its background fibers stop when the scope closes. */
export const makeBackend = (
  store: Store,
  defaultTtl: Duration.Duration
): Effect.Effect<LockAndSemaphoreBackend<Queue.MemoryGrant, Permits.MemoryPermitGrant>, never, Scope.Scope> =>
  Effect.gen(function*() {
    const owner = yield* Owner.make
    const state = store[StoreTypeId]
    const alarm = Expiry.make(owner)
    // Leases of backends that closed with no other open are this one's to sweep now.
    for (const orphan of state.orphans) Queue.adopt(orphan, alarm)
    state.orphans.clear()
    state.alarms.add(alarm)
    // Runs before the owner stops its timers (and after the service gave its leases back): a
    // lease left (a raw grant never released) is swept by another backend of the store.
    yield* Effect.addFinalizer(() =>
      Effect.sync(() => {
        state.alarms.delete(alarm)
        const heir = state.alarms.values().next()
        if (!heir.done) Queue.adopt(alarm, heir.value)
        else if (alarm.watched.size > 0) state.orphans.add(alarm)
      })
    )
    const common = {
      backend: "memory",
      maxNameBytes: MAX_NAME_BYTES,
      defaultTtl,
      minTtl: MIN_TTL,
      renewBatchSize: 10_000,
      instantRelease: true
    }
    return {
      ...common,
      acquire: (request) =>
        Effect.suspend(() => Queue.acquire(state.entries, alarm, Locks.claim(request, state.nextOwner++, state.tokens), identity)),
      renew: (grants) => Queue.renew(state.entries, grants),
      semaphore: {
        ...common,
        acquire: (request) =>
          Effect.suspend(() =>
            Queue.acquire(
              state.permits,
              alarm,
              Permits.claim(request, state.nextOwner++, state.tokens),
              Permits.toGrant,
              Permits.refuse(request)
            )
          ),
        renew: (grants) => Queue.renew(state.permits, grants)
      }
    }
  })

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

/** The shared state of one store. */
export interface StoreState {
  readonly entries: Queue.Entries
  /** Semaphores, a namespace of their own. */
  readonly permits: Queue.Entries
  nextOwner: number
}

export interface Store {
  readonly [StoreTypeId]: StoreState
}

export const makeStore: Effect.Effect<Store> = Effect.sync(() => ({
  [StoreTypeId]: { entries: new Map(), permits: new Map(), nextOwner: 0 }
}))

/** Shortest lease the memory store keeps; shorter requests are clamped up to it. */
const MIN_TTL = Duration.millis(100)
/** Same bound as the database backends, so names behave alike everywhere. */
const MAX_NAME_BYTES = 1024

/** The backend of one process on `store`; its background fibers stop when the scope closes. */
export const makeBackend = (
  store: Store,
  defaultTtl: Duration.Duration
): Effect.Effect<LockAndSemaphoreBackend<Queue.MemoryGrant, Permits.MemoryPermitGrant>, never, Scope.Scope> =>
  Effect.map(Owner.make, (owner) => {
    const state = store[StoreTypeId]
    const alarm = Expiry.make(owner)
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
        Effect.suspend(() => Queue.acquire(state.entries, alarm, Locks.claim(request, state.nextOwner++), identity)),
      renew: (grants) => Queue.renew(state.entries, grants),
      semaphore: {
        ...common,
        acquire: (request) =>
          Effect.suspend(() =>
            Queue.acquire(
              state.permits,
              alarm,
              Permits.claim(request, state.nextOwner++),
              Permits.toGrant,
              Permits.refuse(request)
            )
          ),
        renew: (grants) => Queue.renew(state.permits, grants)
      }
    }
  })

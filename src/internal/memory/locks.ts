/**
 * The lock half of the in-memory store: named locks, exclusive or shared, with leases, fencing
 * tokens and the waiting order of `queue.ts` (first in, first out; no try ahead of a waiter; a
 * shared request behind a waiting exclusive one).
 */
import type * as FencingToken from "../../FencingToken.js"
import type { LockMode } from "../../Lease.js"
import type { AcquireRequest } from "../../LockBackend.js"
import * as Queue from "./queue.js"

/** One live lease in a store, as `MemoryBackend.holders` reports it. */
export interface StoredLease {
  readonly name: string
  readonly token: FencingToken.FencingToken
  readonly mode: LockMode
  /** When the lease runs out unless renewed, on the Clock's monotonic timeline (ms). */
  readonly expiresAt: number
}

const modeOf = (holder: Queue.Holder): LockMode => holder.units === Queue.LOCK_UNITS ? "exclusive" : "shared"

/** The leases held at `now` (expired ones excluded). */
export const holders = (entries: Queue.Entries, now: number): ReadonlyArray<StoredLease> => {
  const out: Array<StoredLease> = []
  for (const [name, entry] of entries) {
    for (const holder of entry.holders.values()) {
      if (holder.expiresAt > now) {
        out.push({ name, token: holder.tokens[0]!, mode: modeOf(holder), expiresAt: holder.expiresAt })
      }
    }
  }
  return out
}

/** What the lock request of `owner` claims: one unit if shared, all of them if exclusive; one token from `counter`. */
export const claim = (request: AcquireRequest, owner: number, counter: Queue.Tokens): Queue.Claim => ({
  request,
  owner,
  counter,
  limit: Queue.LOCK_UNITS,
  units: request.mode === "exclusive" ? Queue.LOCK_UNITS : 1,
  tokens: 1
})

/**
 * The permit half of the in-memory store: semaphores with a per-name limit, permits taken all or
 * none, leases with a ttl, and a fencing token per permit. Waiting is `queue.ts`'s, as for locks:
 * first in, first out; a request for many permits is not starved by a stream of small ones, and
 * a newcomer never takes permits ahead of a waiter.
 */
import type * as FencingToken from "../../FencingToken.js"
import type { PermitGrant, PermitRequest } from "../../LockBackend.js"
import * as Queue from "./queue.js"

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

export interface MemoryPermitGrant extends PermitGrant, Queue.MemoryGrant {
  readonly permits: number
}

/** The semaphores in use at `now` (held or waited for; expired holders excluded). */
export const snapshot = (entries: Queue.Entries, now: number): ReadonlyArray<StoredSemaphore> => {
  const out: Array<StoredSemaphore> = []
  for (const [name, entry] of entries) {
    const holders = Array.from(entry.holders.values())
      .filter((holder) => holder.expiresAt > now)
      .map((holder) => ({ permits: holder.units, tokens: holder.tokens, expiresAt: holder.expiresAt }))
    if (holders.length === 0 && entry.queue.length === 0) continue
    out.push({ name, limit: entry.limit, holders, waiting: entry.queue.map((waiter) => waiter.units) })
  }
  return out
}

/** What the permit request of `owner` claims: its permits, a token each from `counter`, of a name of `limit` permits. */
export const claim = (request: PermitRequest, owner: number, counter: Queue.Tokens): Queue.Claim => ({
  request,
  owner,
  counter,
  limit: request.limit,
  units: request.permits,
  tokens: request.permits
})

/** The grant of permits: a memory grant with its permits and their tokens. */
export const toGrant = (grant: Queue.MemoryGrant, holder: Queue.Holder): MemoryPermitGrant => ({
  permits: holder.units,
  tokens: holder.tokens,
  // Spread last: V8 builds `{ ...x, a, b }` (x non-empty) microseconds slower than `{ a, b, ...x }` (bench/README.md).
  ...grant
})

/** Every holder and waiter of a name agrees on its limit (a name nobody used took the request's). */
export const refuse = (request: PermitRequest) => (entry: Queue.Entry) =>
  entry.limit === request.limit ? undefined : { _tag: "LimitMismatch" as const, current: entry.limit }

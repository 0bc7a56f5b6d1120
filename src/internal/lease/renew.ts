/**
 * Renewal of lease grants: one statement per batch (up to `RENEW_BATCH_SIZE` leases), on the
 * lane's renewal connections, telling for every lease it could not renew why it is gone.
 */
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type { LockMode } from "../../Lease.js"
import type { RenewOutcome } from "../../LockBackend.js"
import { LockBackendError } from "../../LockError.js"
import type { Lane } from "./lane.js"

/** Renewals per statement: big enough that 10,000 leases renew in 10 statements, small enough to stay fast. */
export const RENEW_BATCH_SIZE = 1000

/** What renewal needs of a grant (a semaphore's permits have no mode). */
export interface Renewable {
  readonly name: string
  readonly owner: string
  readonly token: bigint
  readonly mode?: LockMode | undefined
  readonly ttlMillis: number
}

export const make = (lane: Lane, text: string, bound: Duration.Duration) =>
  (grants: ReadonlyArray<Renewable>): Effect.Effect<ReadonlyArray<RenewOutcome>, LockBackendError> =>
    grants.length === 0 ? Effect.succeed([]) : Effect.gen(function*() {
      const { rows, sentAt } = yield* lane.renew<{ idx: number; outcome: string }>(text, [
        grants.map((g) => g.name),
        grants.map((g) => g.owner),
        grants.map((g) => g.token.toString()),
        grants.map((g) => g.ttlMillis),
        grants.map((g) => g.mode ?? null)
      ], bound)
      if (rows.length !== grants.length) {
        return yield* new LockBackendError({
          operation: "renew",
          cause: new Error(`renewal returned ${rows.length} outcomes for ${grants.length} leases`)
        })
      }
      // `sentAt` is monotonic time before sending: the server's new expiry is at least it plus the ttl.
      // In batch order, whatever order the database returned them in.
      return [...rows].sort((a, b) => Number(a.idx) - Number(b.idx)).map((row, i): RenewOutcome =>
        outcomeOf(row.outcome, sentAt + grants[i]!.ttlMillis)
      )
    })

const outcomeOf = (outcome: string, validUntil: number): RenewOutcome => {
  switch (outcome) {
    case "renewed":
      return { _tag: "Renewed", validUntil }
    case "stolen":
      return { _tag: "Lost", reason: "stolen" }
    case "expired":
      return { _tag: "Lost", reason: "expired" }
    default:
      return { _tag: "Lost", reason: "revoked" }
  }
}

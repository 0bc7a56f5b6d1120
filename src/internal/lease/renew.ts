/**
 * Renewal of lease grants: one statement per batch (up to `RENEW_BATCH_SIZE` leases), on the
 * lane's renewal connections, telling for every lease it could not renew why it is gone.
 */
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type { RenewOutcome } from "../../LockBackend.js"
import { LockBackendError } from "../../LockError.js"
import type { RenewAnswer, RenewInput, Statement } from "./dialect.js"
import * as Lane from "./lane.js"

/** Renewals per statement: big enough that 10,000 leases renew in 10 statements, small enough to stay fast. */
export const RENEW_BATCH_SIZE = 1000

export const make = (lane: Lane.Lane, statement: Statement<ReadonlyArray<RenewInput>, ReadonlyArray<RenewAnswer>>, bound: Duration.Duration) =>
  (grants: ReadonlyArray<RenewInput>): Effect.Effect<ReadonlyArray<RenewOutcome>, LockBackendError> =>
    grants.length === 0 ? Effect.succeed([]) : Effect.gen(function*() {
      const { sentAt, value } = yield* Lane.sendRenewal(lane, statement, grants, bound)
      if (value.length !== grants.length) {
        return yield* new LockBackendError({
          operation: "renew",
          cause: new Error(`renewal returned ${value.length} outcomes for ${grants.length} leases`)
        })
      }
      // `sentAt` is monotonic time before sending: the server's new expiry is at least it plus the ttl.
      return value.map((answer, i): RenewOutcome => outcomeOf(answer, sentAt + grants[i]!.ttlMillis))
    })

const outcomeOf = (answer: RenewAnswer, validUntil: number): RenewOutcome =>
  answer === "renewed" ? { _tag: "Renewed", validUntil } : { _tag: "Lost", reason: answer }

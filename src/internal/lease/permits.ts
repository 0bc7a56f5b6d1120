/**
 * The semaphores of a lease backend (`DistributedSemaphore` on PgLease and SqliteLease): permit
 * grants on the dialect's semaphore table, through the same machinery as the lease engine's
 * locks — the same lane and statement bound, attempts in fibers of their own whose outcome is
 * given back when nobody reads it, waiting places in a FIFO queue kept by retrying, wake-ups,
 * batched renewal (`engine` assembles them).
 *
 * A grant of `permits` permits is one entry of the semaphore's row, renewed, released and lost
 * as one, with `permits` consecutive fencing tokens from the name's counter.
 */
import * as FencingToken from "../../FencingToken.js"
import type { PermitGrant, PermitRequest } from "../../LockBackend.js"
import * as Attempt from "./attempt.js"
import type { PermitAcquireAnswer, PermitAcquireInput, Statement } from "./dialect.js"

/** Permits held by this process: one entry of the semaphore's row. */
export interface PermitLeaseGrant extends Attempt.Held, PermitGrant {
  readonly permits: number
  readonly limit: number
}

/** The outcome the semaphore's store adds to a lock's: the name is in use with another limit. */
export interface LimitMismatch {
  readonly _tag: "LimitMismatch"
  readonly current: number
}

/** The tokens `first`, `first + 1`, … of a grant of `permits` permits. */
const tokensFrom = (first: bigint, permits: number): ReadonlyArray<FencingToken.FencingToken> =>
  Array.from({ length: permits }, (_, i) => FencingToken.make(first + BigInt(i)))

/** Permit attempts: the dialect's permit acquire statement, run like a lock's (see `Attempt.attempts`). */
export const attempts = (
  settings: Attempt.AttemptSettings,
  deps: Attempt.AttemptDeps,
  statement: Statement<PermitAcquireInput, PermitAcquireAnswer>
): Attempt.AttemptFn<PermitRequest, PermitLeaseGrant, LimitMismatch> =>
  Attempt.attempts(settings, deps, {
    statement,
    input: (request: PermitRequest) => ({ limit: request.limit, permits: request.permits }),
    verdict: (answer, request, held): Attempt.Verdict<PermitLeaseGrant, LimitMismatch> => {
      if (answer.token !== null) {
        const tokens = tokensFrom(answer.token, request.permits)
        // Spread last: V8 builds `{ ...x, a, b }` (x non-empty) microseconds slower than `{ a, b, ...x }` (bench/README.md).
        return { _tag: "Granted", grant: { permits: request.permits, limit: request.limit, token: tokens[0]!, tokens, ...held } }
      }
      if (answer.current !== null) return { _tag: "LimitMismatch", current: answer.current }
      return { _tag: "NotGranted", wait: answer.wait, behind: answer.behind }
    }
  })

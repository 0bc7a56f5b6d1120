/**
 * The semaphores of a lease backend (`DistributedSemaphore` on PgLease and SqliteLease): permit
 * grants on the dialect's semaphore table, through the same machinery as the lease engine's
 * locks — the same lane and statement bound, attempts in fibers of their own whose outcome is
 * given back when nobody reads it, waiting places in a FIFO queue kept by retrying, wake-ups,
 * batched renewal (`leaseEngine` assembles them).
 *
 * A grant of `permits` permits is one entry of the semaphore's row, renewed, released and lost
 * as one, with `permits` consecutive fencing tokens from the name's counter.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as FencingToken from "../../FencingToken.js"
import type { PermitGrant, PermitRequest } from "../../LockBackend.js"
import * as Attempt from "./attempt.js"
import type { GiveBackDialect } from "./giveBack.js"

/** The semaphore statements of a dialect (their parameters: see `leaseEngine`). */
export interface PermitDialect extends GiveBackDialect {
  readonly acquire: string
  readonly renew: string
  /** Creates the semaphore table if needed (idempotent statements, run in order, on first use). */
  readonly ensureTable: ReadonlyArray<string>
}

/** Permits held by this process: one entry of the semaphore's row. */
export interface PermitLeaseGrant extends PermitGrant {
  readonly name: string
  /** The random owner token of this acquisition, as stored in its holder entry. */
  readonly owner: string
  readonly permits: number
  readonly limit: number
  readonly ttlMillis: number
}

/** The outcome the semaphore's store adds to a lock's: the name is in use with another limit. */
export interface LimitMismatch {
  readonly _tag: "LimitMismatch"
  readonly current: number
}

/** The tokens `first`, `first + 1`, … of a grant of `permits` permits. */
const tokensFrom = (first: bigint, permits: number): ReadonlyArray<FencingToken.FencingToken> =>
  Array.from({ length: permits }, (_, i) => FencingToken.make(first + BigInt(i)))

/** Permit attempts: the dialect's permit acquire statement, run like a lock's (see `leaseAttempt`). */
export const attempt = (
  settings: Attempt.AttemptSettings,
  deps: Attempt.AttemptDeps
): Attempt.AttemptFn<PermitRequest, PermitLeaseGrant, LimitMismatch> => {
  const placeMillis = Duration.toMillis(Attempt.PLACE_TTL)
  const statement: Attempt.Statement<PermitRequest, PermitLeaseGrant, LimitMismatch> = (request, owner, waiter, ttlMillis) =>
    Effect.gen(function*() {
      yield* deps.ready
      const { rows, sentAt } = yield* deps.lane.run<
        { token: string | null; current: number | bigint | null; wait: number | null }
      >(
        "acquire",
        request.name,
        deps.text,
        [
          request.name,
          owner,
          waiter,
          request.limit,
          request.permits,
          ttlMillis,
          placeMillis,
          settings.application,
          settings.host,
          process.pid,
          // Only a request that waits takes a place in the queue.
          request.attempt === "wait"
        ],
        settings.statementTimeout
      )
      const row = rows[0]
      if (row !== undefined && row.token !== null) {
        const tokens = tokensFrom(BigInt(row.token), request.permits)
        const grant: PermitLeaseGrant = {
          name: request.name,
          owner,
          permits: request.permits,
          limit: request.limit,
          ttlMillis,
          token: tokens[0]!,
          tokens,
          // Monotonic time before sending: the store's expiry is at least this plus the ttl.
          validUntil: Option.some(sentAt + ttlMillis),
          release: deps.giveBack.release(request.name, owner)
        }
        yield* deps.lane.prepareRenewals
        return { _tag: "Granted", grant } as const
      }
      if (row !== undefined && row.current !== null) return { _tag: "LimitMismatch", current: Number(row.current) } as const
      return yield* Attempt.busy(row?.wait ?? null, sentAt)
    })
  return Attempt.attempting(settings, deps, statement)
}

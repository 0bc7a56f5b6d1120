/**
 * One grant attempt of PgLease: the acquire statement, run in a fiber of its own so that the
 * caller can stop waiting for it (interruption, deadline, statement bound) without its outcome
 * being lost — an abandoned attempt gives back whatever it took.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import * as Crypto from "node:crypto"
import * as FencingToken from "../FencingToken.js"
import type { AcquireRequest, Grant } from "../LockBackend.js"
import { LockBackendError } from "../LockError.js"
import { monotonicMillis } from "./clock.js"
import type { GiveBack } from "./pgLeaseGiveBack.js"
import { type Lane, outsideTransaction } from "./pgLeaseLane.js"
import * as Sql from "./pgLeaseSql.js"
import { timeoutOption } from "./pgLeaseBound.js"

/**
 * A lease row held by this process.
 */
export interface PgLeaseGrant extends Grant {
  readonly name: string
  /** The random owner token of this acquisition, as stored in the row. */
  readonly owner: string
  readonly ttlMillis: number
}

export type Attempt =
  | { readonly _tag: "Granted"; readonly grant: PgLeaseGrant }
  /** Held by someone else; `wakeAt` (monotonic ms) is when the holder's lease runs out at the latest. */
  | { readonly _tag: "Busy"; readonly wakeAt: number | undefined }
  | { readonly _tag: "TimedOut" }

export interface AttemptSettings {
  readonly table: Sql.TableRef
  readonly application: string
  readonly host: string
  readonly statementTimeout: Duration.Duration
}

export interface AttemptDeps {
  readonly lane: Lane
  readonly giveBack: GiveBack
  /** Creates the table on first use (a no-op afterwards). */
  readonly ready: Effect.Effect<void, LockBackendError>
  /** The scope the statement fibers live in (the backend's). */
  readonly scope: Scope.Scope
}

export const make = (settings: AttemptSettings, deps: AttemptDeps) => {
  const text = Sql.acquire(settings.table)
  const statementMillis = Duration.toMillis(settings.statementTimeout)

  const statement = (name: string, owner: string, ttlMillis: number, mark: boolean, bound: Duration.Duration) =>
    Effect.gen(function*() {
      yield* deps.ready
      const { rows, sentAt } = yield* deps.lane.run<{ token: string | null; wait: number | null }>(
        "acquire",
        name,
        text,
        [name, owner, ttlMillis, settings.application, settings.host, process.pid, mark],
        bound
      )
      const receivedAt = yield* monotonicMillis
      const row = rows[0]
      if (row !== undefined && row.token !== null) {
        const grant: PgLeaseGrant = {
          name,
          owner,
          ttlMillis,
          token: FencingToken.make(BigInt(row.token)),
          // Monotonic time before sending: the server's expiry is at least this plus the ttl, also
          // when the answer comes late. The core compares it with the arrival to drop a late grant.
          validUntil: Option.some(sentAt + ttlMillis),
          release: deps.giveBack.release(name, owner)
        }
        yield* deps.lane.prepareRenewals
        return { _tag: "Granted", grant } as const
      }
      // The holder's lease runs out at the latest `wait` ms after the server read it.
      const wait = row?.wait ?? null
      return { _tag: "Busy", wakeAt: wait === null ? undefined : receivedAt + Math.ceil(wait) + 1 } as const
    })

  /**
   * One attempt. `first`: a zero timeout still gets its one attempt, bounded by the statement
   * bound; later attempts past the deadline are not sent.
   */
  return (request: AcquireRequest, first: boolean): Effect.Effect<Attempt, LockBackendError> =>
    Effect.gen(function*() {
      // The deadline is on the monotonic timeline (the SPI's contract).
      const now = yield* monotonicMillis
      const remaining = Option.map(request.deadline, (deadline) => deadline - now)
      if (Option.isSome(remaining) && remaining.value <= 0 && !first) return { _tag: "TimedOut" } as const
      const byDeadline = Option.isSome(remaining) && remaining.value > 0 && remaining.value < statementMillis
      const bound = byDeadline ? Duration.millis(Option.getOrThrow(remaining)) : settings.statementTimeout
      const owner = Crypto.randomUUID()
      const ttlMillis = Duration.toMillis(request.ttl)
      // A waiter marks the row wanted, so that the holder's release notifies.
      const mark = request.attempt === "wait"
      // The statement outlives a caller that stops waiting, and never joins its transaction.
      const fiber = yield* outsideTransaction(Effect.forkIn(
        Effect.interruptible(statement(request.name, owner, ttlMillis, mark, settings.statementTimeout)),
        deps.scope
      ))
      const mayHold = (attempt: Attempt) => attempt._tag === "Granted"
      const abandon = deps.giveBack.abandon(fiber, mayHold, request.name, owner, ttlMillis)
      // Awaiting never interrupts the attempt. Its statement is bounded by the lane; only a
      // deadline nearer than that bound needs a timer of its own (stall-safe: an answer already
      // received when it fires is still read).
      const settled = yield* request.interruptible(
        byDeadline ? timeoutOption(Fiber.await(fiber), bound) : Effect.asSome(Fiber.await(fiber))
      ).pipe(Effect.onInterrupt(() => abandon))
      if (Option.isNone(settled)) {
        yield* abandon
        return { _tag: "TimedOut" } as const
      }
      const exit = settled.value
      if (Exit.isFailure(exit)) yield* abandon
      return yield* exit
    })
}

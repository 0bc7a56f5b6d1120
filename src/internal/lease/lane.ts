/**
 * The lane a lease backend's statements travel on (PgLease's own connections or the
 * application's pool; SqliteLease's own connection), as the lease engine sees it: a lock
 * statement, a renewal statement, and optionally a way to listen for wake-ups. Each lane keeps
 * its statements from queueing behind the application's, and renewals behind anything.
 *
 * A lane carries text and driver parameters as they are; a dialect's typed statements travel on
 * it through `send` and `sendRenewal`, which encode their input and decode their answer.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import { LockBackendError } from "../../LockError.js"
import { backoffMillis, RESEND_ATTEMPTS, RESEND_MIN_LEFT_MS, resendable, resending } from "../sql/resend.js"
import type { BatchSpec, Row, Statement } from "./dialect.js"

/** Rows of a statement, with the monotonic time (ms) just before it was sent. */
export interface Sent<A> {
  readonly rows: ReadonlyArray<A>
  readonly sentAt: number
}

export interface Lane {
  readonly kind: "own" | "application"
  /** A lock statement, failing with `LockBackendError { operation }` when it has not answered within `bound`. */
  readonly run: <A extends object>(
    operation: string,
    name: string | undefined,
    text: string,
    params: ReadonlyArray<unknown>,
    bound: Duration.Duration
  ) => Effect.Effect<Sent<A>, LockBackendError>
  /** A renewal statement, on connections no other statement uses; same bound rule. */
  readonly renew: <A extends object>(
    text: string,
    params: ReadonlyArray<unknown>,
    bound: Duration.Duration
  ) => Effect.Effect<Sent<A>, LockBackendError>
  /**
   * LISTEN on a channel, handing each payload to `deliver` as it arrives; fails (never hangs)
   * once its connection is known dead. Undefined when this lane cannot listen.
   */
  readonly listen: ((channel: string, deliver: (payload: string) => void) => Effect.Effect<void, LockBackendError>) | undefined
  /**
   * Called on every grant, in the step that reads it (a driver's callback on the `runNow` path):
   * gets renewals' connection ready before the first renewal needs it, never waiting for it.
   */
  readonly prepareRenewals: () => void
  /**
   * `run` with a callback and no fiber, on lanes whose connections are the backend's own: `done`
   * is called once, from the driver's callback or the bound's timer, with the rows or the error.
   * Returns the abandon (nobody reads it any more).
   */
  readonly runNow?: ((
    operation: string,
    name: string | undefined,
    text: string,
    params: ReadonlyArray<unknown>,
    bound: Duration.Duration,
    done: (error: LockBackendError | undefined, rows?: ReadonlyArray<Row>) => void,
    batch?: BatchSpec
  ) => () => void) | undefined
}

/** A typed answer, with the monotonic time (ms) just before its statement was sent. */
export interface Answer<O> {
  readonly value: O
  readonly sentAt: number
}

const answer = <O>(statement: Statement<never, O>) => ({ rows, sentAt }: Sent<Row>): Answer<O> => ({
  value: statement.decode(rows),
  sentAt
})

/** Sends `statement` with `input` as a lock statement (about the lock `name`, for errors); resent while refused (`RESENDABLE`). */
export const send = <I, O>(
  lane: Lane,
  name: string | undefined,
  statement: Statement<I, O>,
  input: I,
  bound: Duration.Duration
): Effect.Effect<Answer<O>, LockBackendError> =>
  Effect.suspend(() => {
    const params = statement.encode(input)
    return Effect.map(
      resending(bound, (left) => lane.run<Row>(statement.operation, name, statement.text, params, left)),
      answer(statement)
    )
  })

/**
 * `send` on the lane's callback path (`Lane.runNow`, which the caller checked is there): `done`
 * once, with the typed answer or the error (a decoder that throws is the error's `cause`).
 * Resent as `send` resends, on timers; the abandon returned stops a resend still to come too.
 */
export const sendNow = <I, O>(
  runNow: NonNullable<Lane["runNow"]>,
  name: string | undefined,
  statement: Statement<I, O>,
  input: I,
  bound: Duration.Duration,
  done: (error: LockBackendError | undefined, value?: O) => void
): () => void => {
  const params = statement.encode(input)
  const deadline = performance.now() + Duration.toMillis(bound)
  let abandoned = false
  let abandonSend: () => void = () => {}
  let timer: ReturnType<typeof setTimeout> | undefined
  const finish = (error: LockBackendError | undefined, rows?: ReadonlyArray<Row>) => {
    if (error !== undefined) return done(error)
    let value: O
    try {
      value = statement.decode(rows!)
    } catch (cause) {
      return done(new LockBackendError({ operation: statement.operation, ...(name === undefined ? {} : { name }), cause }))
    }
    done(undefined, value)
  }
  const sendOnce = (resend: number, left: Duration.Duration) => {
    abandonSend = runNow(statement.operation, name, statement.text, params, left, (error, rows) => {
      if (error === undefined || abandoned) return finish(error, rows)
      const backoff = backoffMillis(resend + 1)
      if (resend + 1 >= RESEND_ATTEMPTS || !resendable(error) || deadline - performance.now() - backoff < RESEND_MIN_LEFT_MS) {
        return finish(error)
      }
      timer = setTimeout(() => {
        timer = undefined
        if (!abandoned) sendOnce(resend + 1, Duration.millis(Math.max(1, deadline - performance.now())))
      }, backoff)
    }, statement.batch)
  }
  sendOnce(0, bound)
  return () => {
    abandoned = true
    if (timer !== undefined) clearTimeout(timer)
    abandonSend()
  }
}

/** Sends `statement` with `input` on the renewal connections; resent as `send` resends, within the same bound. */
export const sendRenewal = <I, O>(
  lane: Lane,
  statement: Statement<I, O>,
  input: I,
  bound: Duration.Duration
): Effect.Effect<Answer<O>, LockBackendError> =>
  Effect.suspend(() => {
    const params = statement.encode(input)
    return Effect.map(resending(bound, (left) => lane.renew<Row>(statement.text, params, left)), answer(statement))
  })

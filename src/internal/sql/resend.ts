/**
 * Resending a statement the server refused as a whole, where the library's own autocommit
 * statements run (the lease lanes, `Fence.check` and the lease operator functions outside a
 * transaction): a database whose default isolation is stricter than READ COMMITTED refuses one
 * that met a concurrent update (40001), as do a deadlock (40P01) and a role's lock_timeout (55P03).
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import { fiberMillis, monotonicMillis, sleepMillis } from "../core/clock.js"
import { sqlStateOf } from "./state.js"

// Only an autocommit statement is resent: its own implicit transaction. Refused, it rolled back:
// nothing of it happened, and the same statement sent again takes a fresh snapshot, so it is
// correct (READ COMMITTED would have re-checked the newest row version instead). Always within the
// bound the caller gave the statement: never past it. SQLite has no SQLSTATE, so nothing of
// SQLite's is ever resent. Never inside a caller's transaction: there a refused statement has
// aborted the whole transaction, and only the caller can retry it.

/**
 * SQLSTATEs of a statement the server refused as a whole: serialization failure, deadlock,
 * lock_timeout, and a cancel (57014). A cancel of an autocommit statement rolled it back; on a
 * pooled connection it can be a stray one, meant for the connection's previous statement (sql-pg
 * cancels an interrupted query with `pg_cancel_backend`, which can land after that query ended).
 */
export const RESENDABLE: ReadonlySet<string> = new Set(["40001", "40P01", "55P03", "57014"])
/**
 * Sends of one statement in all, the first included: a backstop only — the statement's bound is
 * what ends the resends. Twelve were too few: under SERIALIZABLE a semaphore row that a dozen
 * requests write, and that releases delete and attempts make anew, refused one attempt twelve
 * times in a row within 0.6 s, with 4.4 s of its 5 s bound left (CI, 12-04).
 */
export const RESEND_ATTEMPTS = 200
/**
 * Backoff before resend `n` (1-based): jittered in [b/2, b], b = this × 2^(n-1), at most
 * `RESEND_BACKOFF_CAP_MS`. Many sends, short waits: on one row hammered by a dozen requests (the
 * contract's exclusion case) a statement needed up to eleven resends under REPEATABLE READ; each
 * refusal costs one statement's time.
 */
const RESEND_BACKOFF_MS = 4
const RESEND_BACKOFF_CAP_MS = 64
/** A resend goes only while at least this much of the statement's bound is left after its backoff. */
export const RESEND_MIN_LEFT_MS = 50

export const resendable = (error: unknown): boolean => RESENDABLE.has(sqlStateOf(error) ?? "")

export const backoffMillis = (resend: number): number => {
  const ceiling = Math.min(RESEND_BACKOFF_CAP_MS, RESEND_BACKOFF_MS * 2 ** (resend - 1))
  return ceiling / 2 + Math.random() * (ceiling / 2)
}

/**
 * `once` with the whole `bound`, then again with what is left of it (resend `n` after its
 * backoff) while the server refused it with a `RESENDABLE` SQLSTATE, at most `RESEND_ATTEMPTS`
 * sends and never past `bound` from the first send. The last failure is the one reported: a
 * refusal (nothing committed) or whatever the last send met (a timeout: outcome unknown).
 */
export const resending = <A, E>(
  bound: Duration.Duration,
  once: (bound: Duration.Duration) => Effect.Effect<A, E>
): Effect.Effect<A, E> =>
  Effect.withFiberRuntime((fiber) => {
    // Read synchronously: the uncontended path pays no extra step for the deadline.
    const deadline = fiberMillis(fiber) + Duration.toMillis(bound)
    const again = (resend: number, error: E): Effect.Effect<A, E> =>
      Effect.flatMap(monotonicMillis, (now) => {
        const backoff = backoffMillis(resend)
        if (resend >= RESEND_ATTEMPTS || !resendable(error) || deadline - now - backoff < RESEND_MIN_LEFT_MS) {
          return Effect.fail(error)
        }
        return Effect.zipRight(
          sleepMillis(backoff),
          Effect.flatMap(monotonicMillis, (sentAt) =>
            Effect.catchAll(once(Duration.millis(Math.max(1, deadline - sentAt))), (next) => again(resend + 1, next)))
        )
      })
    return Effect.catchAll(once(bound), (error) => (resendable(error) ? again(1, error) : Effect.fail(error)))
  })


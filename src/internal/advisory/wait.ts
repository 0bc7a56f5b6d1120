/**
 * Blocking waits: a contended request waits in PostgreSQL's own lock queue, on a wait session
 * that holds nothing, so the server hands the lock over the moment the holder lets go.
 *
 * The wait runs in **slices**: each is one simple-protocol round trip (`SET LOCAL lock_timeout`
 * to the slice, the lock, the fencing bump). A slice's answer proves the session alive, so a
 * frozen or silently dropped wait session is noticed within a slice plus the heartbeat timeout
 * (the session's bound on the statement) rather than after TCP keepalive's minutes. Between two
 * slices the waiter is out of the server's queue for one round trip, once every slice.
 *
 * An interrupted wait is cancelled with a protocol CancelRequest, then its outcome is awaited
 * for a bounded time. Whatever it was — not granted, or granted in the race —
 * `pg_advisory_unlock_all()` proves the session clean, which is exact because a waiting session
 * held nothing else (should it hold anything else after all, it is destroyed instead, so no lock
 * is dropped silently). No answer: the session is destroyed (the server then drops its locks;
 * `client_connection_check_interval` makes it notice promptly).
 */
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import type * as Queue from "effect/Queue"
import type { AcquireRequest } from "../../LockBackend.js"
import { LockBackendError } from "../../LockError.js"
import { monotonicMillis } from "../core/clock.js"
import type { Admission } from "./localKeys.js"
import * as driver from "../pg/driver.js"
import { within } from "../runtime/stallSafe.js"
import { recordGrant, Retry, type Step, TimedOut, tokenOf, TRANSIENT } from "./grants.js"
import { changed, isFatal, kill, movedError, sqlCode, statement, submitStatement, type Submitted, takeBack } from "./session.js"
import { UNLOCK_ALL_SQL, waitSql } from "./sql.js"
import type { Engine, Hint, Session, Settled } from "./state.js"

/** Longest slice of a blocking wait: a frozen wait session is noticed within this plus the heartbeat timeout. */
export const WAIT_SLICE_MS = 2_000
/** Bound on delivering a CancelRequest. */
const CANCEL_SEND_TIMEOUT_MS = 1_000
/** Bound on the outcome of a cancelled wait; past it the session is destroyed. */
const CANCEL_OUTCOME_TIMEOUT_MS = 2_000
/** Stray cancels can hit the clean-up statement; it is idempotent, so it is re-run a few times. */
const CLEANUP_ATTEMPTS = 3

export const freeWaitSession = (engine: Engine, session: Session): Effect.Effect<void> =>
  Effect.sync(() => {
    session.waiting = false
    changed(engine)
  })

/**
 * Proves a wait session clean after a slice that ended without a usable grant; true when it is
 * (it stays reserved), false when it had to be destroyed. The session held nothing before the
 * wait, so `pg_advisory_unlock_all()` undoes exactly that wait's grant if it happened. A stray
 * cancel can hit this statement: it is idempotent, so run it again.
 *
 * Defence in depth: should the session hold (or be about to record) any other lock — a recorded
 * grant, or a try-lock whose outcome is not recorded yet — unlock_all would drop it silently.
 * Then the session is destroyed instead, so its leases are told `connection-lost`.
 */
const cleanWaitSession = (engine: Engine, session: Session): Effect.Effect<boolean> =>
  Effect.gen(function*() {
    const holdsOthers = () => session.grants.size > 0 || session.claims > 0
    for (let attempt = 0; attempt < CLEANUP_ATTEMPTS && session.state === "open" && !holdsOthers(); attempt++) {
      const settled = yield* statement(engine, session, UNLOCK_ALL_SQL)
      // Re-checked after: a grant recorded while the statement ran may have been dropped by it.
      if (settled._tag === "Ok" && driver.isIdle(session.client) && !holdsOthers()) return true
      if (sqlCode(settled) !== "57014") break
    }
    yield* kill(
      engine,
      session,
      holdsOthers() ? "a wait session to clean up held other locks" : "a cancelled wait could not be proven clean"
    )
    return false
  })

/** The wait was interrupted: take it back, or cancel it at the server, then prove clean or destroy. */
const abandonWait = (engine: Engine, session: Session, sent: Submitted): Effect.Effect<void> =>
  Effect.gen(function*() {
    if (takeBack(sent.job)) return yield* freeWaitSession(engine, session)
    let settled: Settled | undefined
    settled = sent.settled()
    if (settled === undefined) {
      yield* within(driver.sendCancel(session.client), CANCEL_SEND_TIMEOUT_MS)
      settled = Option.getOrUndefined(yield* within(sent.outcome, CANCEL_OUTCOME_TIMEOUT_MS))
    }
    // No outcome: the wait may still be granted later. Destroy the session; the server drops it.
    if (settled === undefined) return yield* kill(engine, session, "a cancelled wait gave no outcome")
    if (isFatal(settled)) return
    // Not granted (57014), or granted in the race: either way unlock_all leaves it clean.
    if (yield* cleanWaitSession(engine, session)) yield* freeWaitSession(engine, session)
  })

/**
 * Waits for the lock at the server on a reserved wait session, slice by slice, until granted,
 * the deadline, or a reason to start over.
 */
export const blockingWait = (
  engine: Engine, session: Session, request: AcquireRequest, key: bigint, keyText: string, admission: Admission
): Effect.Effect<Step, LockBackendError> =>
  Effect.gen(function*() {
    while (true) {
      const now = yield* monotonicMillis
      const remaining = Option.map(request.deadline, (at) => at - now)
      if (Option.isSome(remaining) && remaining.value <= 0) {
        yield* freeWaitSession(engine, session)
        return TimedOut
      }
      const slice = Math.max(1, Math.ceil(Math.min(WAIT_SLICE_MS, Option.getOrElse(remaining, () => Infinity))))
      const sent = submitStatement(
        session,
        // The bump's fencing-row wait ends in 55P03 (a clean retry) well inside what the bound
        // below leaves after a wait that took its whole slice: the heartbeat timeout.
        waitSql(engine.options.fencingTable, key, request.name, request.mode, slice, engine.options.heartbeatTimeoutMillis / 2),
        undefined,
        slice + engine.options.heartbeatTimeoutMillis
      )
      // Raced with the service closing (and the deadline): a closing layer does not wait for a
      // lock that another process may hold for hours.
      const raced = yield* request.waitUntilDeadline(sent.outcomeStep()).pipe(
        // The layer's work: a body's stall watch must not stop the cancel half-way (a zombie session).
        Effect.onInterrupt(() => engine.owner.run(abandonWait(engine, session, sent)))
      )
      const settled = Option.isSome(raced) ? raced.value : yield* sliceEnd(engine, session, request, sent)
      if (settled === undefined) return TimedOut
      if (settled._tag === "Ok") {
        const token = tokenOf(settled)
        if (token !== undefined) return yield* recordGrant(engine, session, key, keyText, token, request, admission, true)
      }
      // No answer, connection lost, moved: the session was destroyed; the server drops the wait.
      const moved = movedError(request.name, settled)
      if (moved !== undefined) return yield* moved
      if (isFatal(settled)) return Retry
      // Anything else may have left the lock granted (a bump that failed after the grant): clean first.
      if (!(yield* cleanWaitSession(engine, session))) return Retry
      const code = sqlCode(settled)
      // 55P03: the slice ended; the next one starts (the loop re-checks the deadline).
      if (code === "55P03") continue
      yield* freeWaitSession(engine, session)
      if (code !== undefined && TRANSIENT.has(code)) return Retry
      return yield* new LockBackendError({
        operation: "acquire",
        name: request.name,
        cause: settled._tag === "Failed" ? settled.failure.error : new Error("the grant statement returned no fencing token")
      })
    }
  })

/**
 * The slice's wait ended without its outcome. At the deadline, the slice ends by itself now (its
 * `lock_timeout` is what was left): its outcome is awaited as any slice's. Otherwise the service
 * is closing: the wait is taken back at the server (cancelled, the session proven clean) and the
 * acquisition ends (`undefined`), which the core reports as the closed service.
 */
const sliceEnd = (engine: Engine, session: Session, request: AcquireRequest, sent: Submitted): Effect.Effect<Settled | undefined> =>
  Effect.flatMap(monotonicMillis, (now) =>
    // Within a millisecond of the deadline it is the deadline (the timer's clock and this one may
    // differ by less): the slice's lock_timeout, set to what was left, ends it now.
    Option.isSome(request.deadline) && now >= request.deadline.value - 1
      ? request.interruptible(sent.outcome).pipe(Effect.onInterrupt(() => engine.owner.run(abandonWait(engine, session, sent))))
      : Effect.as(engine.owner.run(abandonWait(engine, session, sent)), undefined))

/** Waits for a hint that concerns `keyText`: a session came free, or the key was released. */
export const nextHint = (hints: Queue.Dequeue<Hint>, keyText: string): Effect.Effect<"changed" | "released"> =>
  Effect.gen(function*() {
    while (true) {
      const hint = yield* hints.take
      if (hint._tag === "Changed") return "changed" as const
      if (hint.keyText === keyText) return "released" as const
    }
  })

/**
 * Grants: the try-lock fast path, recording what the server granted, handing leases to the core,
 * shared joins, and giving locks back.
 *
 * A grant is recorded on its session in the same synchronous step that checks the session is
 * still alive, and handed to the core in the same step that checks the grant is still open, so a
 * loss is reported for exactly the leases that were handed out. A try-lock that an interruption
 * or the deadline catches is taken back while still queued; once sent, its outcome is awaited
 * and a grant it made is undone.
 */
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as FencingToken from "../../FencingToken.js"
import type { AcquireRequest, AcquireResult, Grant } from "../../LockBackend.js"
import { LockBackendError } from "../../LockError.js"
import { monotonicMillis } from "../core/clock.js"
import { lockTagOfKey } from "./inspect.js"
import type { Admission } from "./localKeys.js"
import * as driver from "../pg/driver.js"
import { changed, forgetShared, isFatal, kill, killInBackground, movedError, sqlCode, statement, submitReleaseThen, submitTry, type Submitted, takeBack } from "./session.js"
import { advisoryKey } from "../core/lockKey.js"
import { uninterruptibleMask } from "../runtime/mask.js"
import { INTEREST_NAMESPACE, joinBumpSql, undoSql } from "./sql.js"
import type { Engine, Holder, ServerGrant, Session, Settled } from "./state.js"

/** What one step of an acquire came to; `Retry` starts the attempt over (the session died, a transient error). */
export type Step = AcquireResult<Grant> | { readonly _tag: "Retry" }

export const Busy = { _tag: "Busy" } as const
export const TimedOut = { _tag: "TimedOut" } as const
export const Retry = { _tag: "Retry" } as const

/**
 * Failures worth another try: a stray cancel (57014), a deadlock or serialization failure on a
 * fencing row (40P01, 40001), a fencing-row lock wait past the session's lock_timeout (55P03).
 */
export const TRANSIENT: ReadonlySet<string> = new Set(["57014", "40P01", "40001", "55P03"])

const interestKeys = new Map<string, string>()
/** Interest keys remembered, as lock keys are (a hash per release would cost more than the rest). */
const INTEREST_CACHE_SIZE = 4_096

/** The interest key of a lock key (see `releaseSql`), in decimal. */
export const interestKeyOf = (keyText: string): string => {
  let found = interestKeys.get(keyText)
  if (found === undefined) {
    if (interestKeys.size >= INTEREST_CACHE_SIZE) interestKeys.clear()
    found = advisoryKey(keyText, INTEREST_NAMESPACE).toString()
    interestKeys.set(keyText, found)
  }
  return found
}

export const tokenOf = (settled: Settled): FencingToken.FencingToken | undefined => {
  if (settled._tag !== "Ok") return undefined
  const raw = settled.rows[0]?.token
  return typeof raw === "string" ? FencingToken.make(BigInt(raw)) : undefined
}

const failed = (request: AcquireRequest, settled: Settled) =>
  new LockBackendError({
    operation: "acquire",
    name: request.name,
    cause: settled._tag === "Failed" ? settled.failure.error : new Error(`the grant statement ended with ${settled._tag}`)
  })

/**
 * Gives a grant back to the server once no holder uses it; destroys what it cannot prove. The
 * unlock is queued in the same step that closes the grant, so a later try of the key on the same
 * session runs after it. The layer's own work, driven by the answer's callback: `done` is called
 * once it is finished, whatever happens meanwhile to whoever waits for it.
 */
export const closeIfUnusedNow = (engine: Engine, grant: ServerGrant, done: () => void): void => {
  if (grant.holders.size > 0 || grant.closed) return done()
  grant.closed = true
  forgetShared(engine, grant)
  const session = grant.session
  // The lock died with its session; there is nothing left to unlock.
  if (session.state !== "open") return done()
  submitReleaseThen(session, grant.keyText, interestKeyOf(grant.keyText), grant.mode === "shared", (settled) => {
    const released = settled._tag === "Ok" && settled.rows[0]?.released === true
    if (!released || !driver.isIdle(session.client)) {
      // The unlock is unproven: the session (and any other lock on it) is destroyed, never reused.
      killInBackground(engine, session, "an unlock was not proven")
    } else {
      session.grants.delete(grant)
      if (session.role === "wait" && session.grants.size === 0) changed(engine)
      // Requests of this process waiting in-process for the key try again now.
      engine.hints.unsafeOffer({ _tag: "Released", keyText: grant.keyText })
    }
    done()
  })
}

/** `closeIfUnusedNow`, waited for. Interrupting the wait does not stop the give-back. */
export const closeIfUnused = (engine: Engine, grant: ServerGrant): Effect.Effect<void> =>
  Effect.async<void>((resume) => closeIfUnusedNow(engine, grant, () => resume(Effect.void)))

/**
 * The lease's release: the grant goes back once its last holder leaves; then the key's admission.
 * Driven by callbacks (see `closeIfUnusedNow`); `done` is called once it is finished.
 */
export const releaseNow = (engine: Engine, holder: Holder, done: () => void): void => {
  if (holder.state === "released") return done()
  holder.state = "released"
  holder.grant.holders.delete(holder)
  closeIfUnusedNow(engine, holder.grant, () => {
    engine.local.leaveNow(holder.admission, true)
    done()
  })
}

/** `releaseNow`, waited for. Interrupting the wait does not stop the release. */
export const release = (engine: Engine, holder: Holder): Effect.Effect<void> =>
  Effect.async<void>((resume) => releaseNow(engine, holder, () => resume(Effect.void)))

const newHolder = (grant: ServerGrant, request: AcquireRequest, admission: Admission): Holder => ({
  grant,
  admission,
  onLost: request.onLost,
  state: "held",
  handed: false
})

/**
 * Hands `holder` to the core, unless its grant closed meanwhile (its session died: the lock
 * is gone, so the request tries again). The check and the hand-over are one synchronous step,
 * so a loss is reported for exactly the holders that were handed out.
 */
const attachNow = (
  engine: Engine,
  grant: ServerGrant,
  token: FencingToken.FencingToken,
  admission: Admission,
  holder: Holder
): Step => {
  if (grant.closed || holder.state !== "held") {
    grant.holders.delete(holder)
    return Retry
  }
  holder.handed = true
  grant.holders.add(holder)
  engine.local.grantedNow(admission)
  return {
    _tag: "Granted",
    grant: {
      token,
      validUntil: Option.none(),
      release: release(engine, holder),
      releaseNow: (done: (failure: undefined) => void) => releaseNow(engine, holder, () => done(undefined))
    }
  }
}

const attach = (
  engine: Engine,
  grant: ServerGrant,
  token: FencingToken.FencingToken,
  admission: Admission,
  holder: Holder
): Effect.Effect<Step> => Effect.sync(() => attachNow(engine, grant, token, admission, holder))

/**
 * Records a grant the server just made on `session`, or reports that it died with it, in this
 * synchronous step. `fromWait`: the grant ends the session's blocking wait (a try-lock never
 * leaves a wait).
 */
const recordGrantNow = (
  engine: Engine,
  session: Session,
  key: bigint,
  keyText: string,
  token: FencingToken.FencingToken,
  request: AcquireRequest,
  admission: Admission,
  fromWait: boolean
): Step => {
  // The session died after granting: the lock went with it.
  if (session.state !== "open") return Retry
  const grant: ServerGrant = { key, keyText, mode: request.mode, session, holders: new Set(), closed: false }
  // In the same synchronous step as leaving a wait: a session is never seen free while it holds this.
  session.grants.add(grant)
  if (fromWait) session.waiting = false
  if (request.mode === "shared") engine.sharedGrants.set(keyText, grant)
  return attachNow(engine, grant, token, admission, newHolder(grant, request, admission))
}

/** `recordGrantNow` as a step of an Effect. */
export const recordGrant = (...args: Parameters<typeof recordGrantNow>): Effect.Effect<Step> =>
  Effect.sync(() => recordGrantNow(...args))

/** A shared join found an exclusive request queued at the server: this request must queue there too. */
export const JoinRefused = { _tag: "JoinRefused" } as const

/**
 * Shared mode: joins the shared grant this process already holds, with a fresh token — unless an
 * exclusive request waits for the key at the server (PostgreSQL would queue a fresh shared request
 * behind it, and so must a join, or a stream of overlapping local holders starves the waiter).
 * `undefined`: nothing to join.
 */
export const joinShared = (
  engine: Engine,
  request: AcquireRequest,
  key: bigint,
  keyText: string,
  admission: Admission
): Effect.Effect<Step | typeof JoinRefused | undefined, LockBackendError> =>
  Effect.gen(function*() {
    const grant = engine.sharedGrants.get(keyText)
    if (grant === undefined || grant.closed || grant.session.state !== "open") return undefined
    // Registered before the bump so that a concurrent release of the last holder keeps the lock;
    // not handed out until the bump succeeds, so a loss meanwhile is not reported (see `handed`).
    const holder = newHolder(grant, request, admission)
    grant.holders.add(holder)
    const tag = lockTagOfKey(key)
    const settled = yield* statement(engine, grant.session, joinBumpSql(engine.options.fencingTable), [
      keyText,
      request.name,
      tag.classid.toString(),
      tag.objid.toString()
    ])
    const token = tokenOf(settled)
    if (token !== undefined) return yield* attach(engine, grant, token, admission, holder)
    grant.holders.delete(holder)
    yield* closeIfUnused(engine, grant)
    const moved = movedError(request.name, settled)
    if (moved !== undefined) return yield* moved
    if (settled._tag === "Ok") return JoinRefused
    const code = sqlCode(settled)
    if (code !== undefined && !TRANSIENT.has(code)) return yield* failed(request, settled)
    return Retry
  })

/** Undoes a grant statement that failed after the server answered. */
const undoTry = (engine: Engine, session: Session, keyText: string, shared: boolean): Effect.Effect<void> =>
  Effect.gen(function*() {
    if (session.state !== "open") return
    const settled = yield* statement(engine, session, undoSql(shared ? "shared" : "exclusive"), [keyText])
    if (settled._tag !== "Ok" || !driver.isIdle(session.client)) {
      yield* kill(engine, session, "undoing a grant was not proven")
    }
  })

/** The try-lock was sent before an interruption could take it back: undo its grant, if any. */
const abandonTry = (engine: Engine, session: Session, sent: Submitted, keyText: string, shared: boolean) =>
  Effect.gen(function*() {
    if (takeBack(sent.job)) return
    const settled = yield* sent.outcome
    if (isFatal(settled)) return
    if (settled._tag === "Ok" && tokenOf(settled) === undefined) return
    yield* undoTry(engine, session, keyText, shared)
  })

/** What a try-lock's answer comes to: a grant recorded, busy, or undone after an error. */
const tryOutcome = (
  engine: Engine,
  session: Session,
  request: AcquireRequest,
  key: bigint,
  keyText: string,
  admission: Admission,
  settled: Settled
): Effect.Effect<Step, LockBackendError> => {
  if (settled._tag === "Ok") {
    const token = tokenOf(settled)
    if (token === undefined) return Effect.succeed(Busy)
    return recordGrant(engine, session, key, keyText, token, request, admission, false)
  }
  // No answer / connection lost / moved: the session was destroyed, any grant on it went with it.
  const moved = movedError(request.name, settled)
  if (moved !== undefined) return Effect.fail(moved)
  if (isFatal(settled)) return Effect.succeed(Retry)
  // The server answered with an error, possibly after granting (the bump failed): undo.
  return Effect.zipRight(
    undoTry(engine, session, keyText, request.mode === "shared"),
    Effect.suspend(() => {
      const code = sqlCode(settled)
      return code !== undefined && TRANSIENT.has(code) ? Effect.succeed<Step>(Retry) : Effect.fail(failed(request, settled))
    })
  )
}

/**
 * Waits for a step's turn (a queued statement, an admission): interruptible and bounded by the
 * deadline (`None` when it passed first). A single attempt whose deadline already passed still
 * gets its turn: the attempt itself is what was asked for (only `once` asks). Without a deadline
 * nothing but the step's own bound ends the wait: no race of fibers on the uncontended path.
 */
export const awaitTurn = <A, E>(request: AcquireRequest, step: Effect.Effect<A, E>): Effect.Effect<Option.Option<A>, E> =>
  request.attempt === "once"
    ? Effect.flatMap(monotonicMillis, (now) =>
      Option.isSome(request.deadline) && request.deadline.value <= now
        ? Effect.asSome(request.interruptible(step))
        : request.waitUntilDeadline(step))
    : Option.isNone(request.deadline)
    ? Effect.asSome(request.interruptible(step))
    : request.waitUntilDeadline(step)

/**
 * A try's outcome, once its turn came: `undefined` when the deadline passed first. Without a
 * deadline the wait is only made interruptible (no race, nothing more on the uncontended path).
 */
const awaitOutcome = (request: AcquireRequest, sent: Submitted): Effect.Effect<Settled | undefined> =>
  request.attempt === "wait" && Option.isNone(request.deadline)
    ? request.interruptible(sent.outcome)
    : Effect.map(awaitTurn(request, sent.outcome), Option.getOrUndefined)

/**
 * One try-lock + bump on a session that was claimed for it; the claim is given back once the
 * outcome is recorded or undone. Waiting for its turn is interruptible and bounded by the
 * deadline (it is checkout, not the lock); once sent, the statement's outcome is awaited. A
 * single attempt whose deadline has already passed (`timeout <= 0`) still gets its turn: the
 * attempt itself is what was asked for. An answer that is a grant or busy is read in the step
 * that resumes the caller (the common case: nothing more between the answer and the lease).
 */
export const tryGrant = (
  engine: Engine, session: Session, request: AcquireRequest, key: bigint, keyText: string, admission: Admission
): Effect.Effect<Step, LockBackendError> =>
  // Uninterruptible but for the wait, whoever calls (the core already is: then no mask at all,
  // `runtime/mask`): nothing between queuing the try and the match below can be interrupted, and
  // an interrupted wait reaches the take-back, which an interruptible region would skip.
  uninterruptibleMask((restore) => {
    const shared = request.mode === "shared"
    const sent = submitTry(session, keyText, request.name, shared)
    const claimBack = () => {
      session.claims -= 1
      if (session.role === "wait" && session.claims === 0 && session.grants.size === 0) changed(engine)
    }
    const claimBackAfter = <A, E>(self: Effect.Effect<A, E>) => Effect.ensuring(self, Effect.sync(claimBack))
    return Effect.matchCauseEffect(restore(awaitOutcome(request, sent)), {
      // Interrupted: taken back at once if it is still queued; else undone as the layer's work,
      // out of reach of the caller's interruption and stall watch.
      onFailure: (cause) =>
        Effect.zipRight(
          claimBackAfter(takeBack(sent.job) ? Effect.void : engine.owner.run(abandonTry(engine, session, sent, keyText, shared))),
          Effect.failCause(cause)
        ),
      onSuccess: (early): Effect.Effect<Step, LockBackendError> => {
        if (early === undefined && takeBack(sent.job)) {
          claimBack()
          return Effect.succeed(TimedOut)
        }
        const settled = early ?? sent.settled()
        // On the wire when the deadline passed: its outcome is still awaited, and read as any other.
        if (settled === undefined) {
          return claimBackAfter(Effect.flatMap(sent.outcome, (late) => tryOutcome(engine, session, request, key, keyText, admission, late)))
        }
        if (settled._tag !== "Ok") return claimBackAfter(tryOutcome(engine, session, request, key, keyText, admission, settled))
        const token = tokenOf(settled)
        // Recorded (or found busy) and the claim given back in this one step, as `tryOutcome` would.
        const step = token === undefined ? Busy : recordGrantNow(engine, session, key, keyText, token, request, admission, false)
        claimBack()
        return Effect.succeed(step)
      }
    })
  })

/**
 * Semaphores on session advisory locks: N permits per name, on the sessions the engine owns.
 *
 * Keys
 * ----
 * A semaphore name has keys of its own, apart from lock keys (other namespaces of the same
 * SHA-256 derivation, `permitKeysOf`): slot `i` (`slotBase # i`, `i < limit`) is one permit — a
 * session lock, so a dead session drops its permits; the limit marker of limit `L`
 * (`markerBase # L`) is held shared by every holder and every registered waiter using limit `L`;
 * the fencing row (the semaphore's own key) keeps the counter, the limit in use and the queue of
 * waiters. Each waiter holds a random key of its own while it waits, its *waiter key* — a new one
 * each time it registers: the backend of a session this process destroyed may live on for a while
 * (until its statement ends, or frozen) and still hold the key of an earlier registration.
 *
 * Granting
 * --------
 * One statement per attempt (`permitAttemptSql`): under the fencing row's lock it checks the
 * limit (or takes a free name over with a new one), takes the marker, try-locks free slots and,
 * when they cover its permits *and every live waiter ahead of it*, keeps `permits` of them and
 * bumps the counter by `permits` — or undoes every slot it took, all in that statement. Why it is
 * exact and race-free is written beside each step there. What is left for this module is the one
 * thing PostgreSQL does not do for us: a session's own locks never conflict with its own requests,
 * so this process keeps, per session, what it holds for each semaphore (`Session.permitUses`): the
 * slots to skip, and the limit of its own holders — a request with another limit is refused here,
 * since the server's probe cannot see this session's own marker — and, per name, its waiters
 * (their keys prove the session's own queue entries live, as a try of them cannot). Attempts of
 * one name are admitted one at a time per process (a FIFO gate), so that record is exact when an
 * attempt is sent; releases only shrink it, and are recorded when sent.
 *
 * Every permit statement runs on the home session, which never blocks: it waits for nothing but
 * the fencing row, held by another statement for one statement at most (the session's
 * lock_timeout, then the statement bound, cut that short). So "a session blocked in a wait holds
 * no lock" stays true: permits never block at the server.
 *
 * Order: first in, first out
 * --------------------------
 * A request that finds too few permits free registers as a waiter (in its next attempt's
 * statement: the marker is kept, the interest key taken shared before the slots are tried, its
 * waiter key taken and its entry appended to the fencing row's queue). From then on:
 *
 * - a request — a newcomer, a `tryAcquire`, a waiter — is granted only when the free permits cover
 *   it and every live waiter ahead of it: it never takes a permit somebody ahead waits for, so a
 *   big request is not overtaken by smaller ones behind it, nor by a newcomer;
 * - a release (and a waiter that leaves, and an attempt that finds permits free) wakes only the
 *   head waiters that now fit — those of this process directly, those of other processes by one
 *   notification naming their waiter keys (`PERMIT_WAKE_PREFIX`), delivered to each of them
 *   without a bounded buffer in between; a waiter woken tries again;
 * - a waiter whose session died loses its place: its waiter key went with the session, and the
 *   next statement that looks at the queue proves it and drops the entry. A holder that crashed,
 *   or a waiter that died at the head, notifies nobody: every waiter also re-tries every
 *   `PERMIT_FALLBACK_RETRY_MS` (jittered), always within its deadline, and an attempt that finds
 *   permits free wakes the heads that fit;
 * - a waiter that leaves (deadline, interruption) gives its place up at once, in one statement.
 *
 * A grant with nobody waiting, and a release with nobody waiting, cost what they cost without a
 * queue: the attempt reads the (empty) queue in the row it locks anyway and stops trying slots
 * at `permits`; the release looks at the queue only when the interest key or this process says
 * somebody waits.
 *
 * Release and loss
 * ----------------
 * A release unlocks the slots and the marker in one bounded statement; unless every unlock
 * returned true and the session is idle afterwards, the session is destroyed (its other holders
 * are told `connection-lost`). A session that dies tells every holder on it, as for locks. A waiter
 * that leaves without a grant unregisters the same way: proven, or the session is destroyed.
 *
 * Rolling deploys
 * ---------------
 * During a rolling deploy across the change that brought the queue, processes from before it
 * ignore `permit_queue`: they take free permits a waiter ahead of them waits for (overtaking it),
 * and their releases notify with a bare key, not a wake-up naming waiter keys, so a waiter of this
 * version is not woken by them and falls back to its re-try (`PERMIT_FALLBACK_RETRY_MS`). Nothing
 * is held twice meanwhile (the slots are what exclude); first in, first out holds once every
 * replica runs this version.
 */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as Option from "effect/Option"
import * as Schedule from "effect/Schedule"
import { randomBytes } from "node:crypto"
import * as FencingToken from "../../FencingToken.js"
import type { AcquireRequest, PermitGrant, PermitRequest, PermitResult, SemaphoreBackend } from "../../LockBackend.js"
import { LockBackendError } from "../../LockError.js"
import { type LocalKeys, makeLocalKeys } from "./localKeys.js"
import { advisoryKey } from "../core/lockKey.js"
import * as driver from "../pg/driver.js"
import { awaitTurn, interestKeyOf } from "./grants.js"
import { BACKEND, isFatal, kill, movedError, sqlCode, submitStatement, type Submitted, takeBack } from "./session.js"
import { CHANNEL, PERMIT_WAKE_PREFIX, permitAttemptSql, permitLeaveSql, permitReleaseSql, permitRowSql } from "./sql.js"
import type { Engine, Hint, Holder, PermitUse, Row, ServerGrant, Session, Settled } from "./state.js"

/** Default interval of a waiter's fallback re-try (jittered ±20%): for holders that crashed, which notify nobody. */
export const PERMIT_FALLBACK_RETRY_MS = 1_000
/**
 * Largest limit this backend takes: a busy attempt try-locks slots while it holds the fencing
 * row (about a microsecond each), and every held permit is an entry of PostgreSQL's lock table,
 * which the whole server shares (`max_locks_per_transaction` × connections, 6,400 by default).
 */
export const MAX_PERMIT_LIMIT = 1_024
/** Marker contention (another transaction's probe ending) is retried at once this many times, then waited out. */
const MARKER_RETRIES = 3
/** Names whose keys (and fencing rows) are remembered. */
const CACHE_SIZE = 4_096
/** Failures of an attempt that happen at the fencing row's lock wait, before anything is locked. */
const ROW_WAIT_CODES: ReadonlySet<string> = new Set(["55P03", "40P01"])

const SLOT_NAMESPACE = "effect-lock/PgAdvisory/semaphore-slot"
const MARKER_NAMESPACE = "effect-lock/PgAdvisory/semaphore-limit"
const ROW_NAMESPACE = "effect-lock/PgAdvisory/semaphore"

/** The keys of one semaphore name (see the module header). */
export interface PermitKeys {
  /** The fencing row's key; its decimal form names the semaphore in wake-ups. */
  readonly key: bigint
  readonly keyText: string
  readonly slotBase: bigint
  readonly markerBase: bigint
  readonly interestKey: string
}

/**
 * The keys of a semaphore name. A NUL separates our namespaces from the user's, so no lock name
 * (lock names hold no NUL) in a namespace without a NUL makes the same hash input: semaphore keys
 * are a key space of their own, apart from lock keys (up to the odds of a 64-bit hash collision;
 * slot and marker keys lie within `limit` of their base), per user namespace.
 */
export const permitKeysOf = (name: string, namespace: string): PermitKeys => {
  const key = advisoryKey(name, `${ROW_NAMESPACE}\u0000${namespace}`)
  const keyText = key.toString()
  return {
    key,
    keyText,
    slotBase: advisoryKey(name, `${SLOT_NAMESPACE}\u0000${namespace}`),
    markerBase: advisoryKey(name, `${MARKER_NAMESPACE}\u0000${namespace}`),
    interestKey: interestKeyOf(keyText)
  }
}

/** The session-lock key of slot `i` (as PostgreSQL computes `slotBase # i`). */
export const slotKeyOf = (keys: PermitKeys, i: number): bigint => keys.slotBase ^ BigInt(i)

/** The session-lock key of the limit marker of `limit`. */
export const markerKeyOf = (keys: PermitKeys, limit: number): bigint => keys.markerBase ^ BigInt(limit)

/** Whether a release notification's payload is a permit wake-up (`sql.ts`), not a lock's key. */
export const isPermitWake = (payload: string): boolean => payload.startsWith(PERMIT_WAKE_PREFIX)

/**
 * One waiter of this process, from its first registering attempt to the end of its request. Its
 * key is random (64 bits): unique among the server's waiters without any coordination, and never
 * a key a dead waiter left behind in the queue. Each registration takes a new one (`rekey`).
 */
interface Waiter {
  /** The waiter key of its latest registration. */
  keyText: string
  readonly name: string
  /** The session its registration was sent on (the home session of that moment). */
  session: Session | undefined
  /** Completed (and replaced) by each wake-up; a request captures it before its attempt. */
  signal: Deferred.Deferred<void>
}

/** A waiter's registration: its marker, interest, waiter key and queue entry, on `session`. */
interface Registration {
  readonly session: Session
  readonly limit: number
}

/** What one request carries from one attempt to the next. */
interface WaitState {
  registration: Registration | undefined
  waiter: Waiter | undefined
  /** The next attempt registers if it finds its permits busy. */
  register: boolean
  markerRetries: number
}

/** One grant of permits held on a session. */
interface PermitHold {
  readonly holder: Holder
  readonly keys: PermitKeys
  readonly limit: number
  readonly slots: ReadonlyArray<number>
}

type Attempt =
  | { readonly _tag: "Granted"; readonly hold: PermitHold; readonly tokens: ReadonlyArray<FencingToken.FencingToken> }
  | { readonly _tag: "Waiting" }
  | { readonly _tag: "Busy" }
  | { readonly _tag: "LimitMismatch"; readonly current: number }
  | { readonly _tag: "MarkerBusy" }
  | { readonly _tag: "Missing" }
  | { readonly _tag: "Retry" }
  | { readonly _tag: "TimedOut" }

const Waiting = { _tag: "Waiting" } as const
const Busy = { _tag: "Busy" } as const
const MarkerBusy = { _tag: "MarkerBusy" } as const
const Missing = { _tag: "Missing" } as const
const Retry = { _tag: "Retry" } as const
const TimedOut = { _tag: "TimedOut" } as const

const useOf = (session: Session, keys: PermitKeys, limit: number): PermitUse => {
  let use = session.permitUses.get(keys.keyText)
  if (use === undefined) session.permitUses.set(keys.keyText, use = { limit, markers: 0, slots: new Set() })
  return use
}

const forgetIfUnused = (session: Session, keys: PermitKeys, use: PermitUse): void => {
  if (use.markers <= 0 && use.slots.size === 0) session.permitUses.delete(keys.keyText)
}

/** What the semaphore backend needs from the engine beside its records. */
export interface PermitDeps {
  /** The home session (opened if it is gone), or `None` when the deadline passed first. */
  readonly homeSession: (request: AcquireRequest) => Effect.Effect<Option.Option<Session>, LockBackendError>
  readonly shuttingDown: (name: string) => LockBackendError
  /** Why semaphores cannot be used on this fencing table (`undefined`: they can). */
  readonly unavailable: string | undefined
}

/** The permit store of one engine: its records beside the engine's. */
interface PermitStore {
  readonly engine: Engine
  readonly deps: PermitDeps
  readonly attemptSql: string
  readonly rowSql: string
  readonly releaseSql: string
  readonly leaveSql: string
  readonly fallbackPause: Effect.Effect<unknown>
  /** One attempt per semaphore name per process at a time, in arrival order (see the header). */
  readonly gate: LocalKeys
  readonly keys: Map<string, PermitKeys>
  /** Semaphores whose fencing row is known to exist (rows are never deleted). */
  readonly rows: Set<string>
  /** This process's waiters, by semaphore key, and by waiter key (for wake-ups). */
  readonly waiters: Map<string, Set<Waiter>>
  readonly byKey: Map<string, Waiter>
  /** This process's waiters by the session they registered on: woken when it dies, to register again. */
  readonly bySession: Map<Session, Set<Waiter>>
}

const keysOf = (store: PermitStore, name: string): PermitKeys => {
  let found = store.keys.get(name)
  if (found === undefined) {
    if (store.keys.size >= CACHE_SIZE) store.keys.clear()
    found = permitKeysOf(name, store.engine.options.namespace)
    store.keys.set(name, found)
  }
  return found
}

const backendError = (name: string, cause: unknown) => new LockBackendError({ operation: "acquire", name, cause })

const failureOf = (settled: Settled) =>
  settled._tag === "Failed" ? settled.failure.error : new Error(`the permit statement ended with ${settled._tag}`)

// ------------------------------------------------------------------------------- waiters

const newSignal = () => Deferred.unsafeMake<void>(FiberId.none)

/** A random signed 64-bit key, in decimal. */
const randomKey = (): string => BigInt.asIntN(64, randomBytes(8).readBigUInt64BE()).toString()

const addWaiter = (store: PermitStore, keys: PermitKeys): Waiter => {
  const waiter: Waiter = { keyText: randomKey(), name: keys.keyText, session: undefined, signal: newSignal() }
  let set = store.waiters.get(keys.keyText)
  if (set === undefined) store.waiters.set(keys.keyText, set = new Set())
  set.add(waiter)
  store.byKey.set(waiter.keyText, waiter)
  return waiter
}

/**
 * A fresh waiter key for a registration, before its attempt is sent. Never the key of an earlier
 * registration: the backend of a session this process destroyed can live on (frozen, or until its
 * statement ends) still holding that key, and a new session's try of it would fail.
 */
const rekey = (store: PermitStore, waiter: Waiter): void => {
  store.byKey.delete(waiter.keyText)
  waiter.keyText = randomKey()
  store.byKey.set(waiter.keyText, waiter)
}

/** Records the session a waiter registers on, before its attempt is sent. */
const moveWaiter = (store: PermitStore, waiter: Waiter, session: Session | undefined): void => {
  if (waiter.session === session) return
  const before = waiter.session === undefined ? undefined : store.bySession.get(waiter.session)
  before?.delete(waiter)
  if (before?.size === 0) store.bySession.delete(waiter.session!)
  waiter.session = session
  if (session === undefined) return
  let set = store.bySession.get(session)
  if (set === undefined) store.bySession.set(session, set = new Set())
  set.add(waiter)
}

const removeWaiter = (store: PermitStore, waiter: Waiter): void => {
  moveWaiter(store, waiter, undefined)
  store.byKey.delete(waiter.keyText)
  const set = store.waiters.get(waiter.name)
  set?.delete(waiter)
  if (set?.size === 0) store.waiters.delete(waiter.name)
}

/**
 * Wakes one waiter of this process: its current signal completes, a fresh one takes its place.
 * A Deferred per wake-up rather than a Queue or PubSub: a wake-up is never dropped (no bound to
 * slide past) and never piles up (a waiter needs to know only that one came since it looked).
 */
const wake = (store: PermitStore, keyText: string): void => {
  const waiter = store.byKey.get(keyText)
  if (waiter === undefined) return
  const signal = waiter.signal
  waiter.signal = newSignal()
  Deferred.unsafeDone(signal, Exit.void)
}

/** Wakes the waiters of this process a statement named (its `wake` column). */
const wakeListed = (store: PermitStore, row: Row | undefined): void => {
  const listed = row?.wake
  if (Array.isArray(listed)) for (const keyText of listed) wake(store, String(keyText))
}

/** The waiter keys this process has for a name on `session` (registered there, or registering), but `except`. */
const ownKeys = (store: PermitStore, keys: PermitKeys, session: Session, except?: Waiter): Array<string> => {
  const found: Array<string> = []
  for (const waiter of store.waiters.get(keys.keyText) ?? []) {
    if (waiter !== except && waiter.session === session) found.push(waiter.keyText)
  }
  return found
}

/**
 * A hint from the engine: a wake-up naming waiters of this process (`permit:<key>:<waiter keys>`),
 * or a change of sessions — a waiter whose registration died with its session tries again now.
 */
const onHint = (store: PermitStore, hint: Hint): void => {
  if (hint._tag === "Released") {
    const listed = hint.keyText.slice(hint.keyText.indexOf(":", PERMIT_WAKE_PREFIX.length) + 1)
    for (const keyText of listed.split(",")) wake(store, keyText)
    return
  }
  for (const [session, waiters] of store.bySession) {
    if (session.state !== "open") for (const waiter of waiters) wake(store, waiter.keyText)
  }
}

// ------------------------------------------------------------------------ release, leave

/** Gives a grant of permits back; destroys the session when the release is not proven. */
const release = (store: PermitStore, hold: PermitHold): Effect.Effect<void> =>
  Effect.suspend(() => {
    const { engine } = store
    const { holder, keys, slots } = hold
    if (holder.state === "released") return Effect.void
    holder.state = "released"
    const grant = holder.grant
    grant.holders.delete(holder)
    grant.closed = true
    const session = grant.session
    // The permits died with their session; there is nothing left to unlock.
    if (session.state !== "open") return Effect.void
    // Recorded in the step that queues the unlocks: a later attempt on this session runs after them.
    const use = session.permitUses.get(keys.keyText)
    if (use !== undefined) {
      use.markers -= 1
      for (const slot of slots) use.slots.delete(slot)
      forgetIfUnused(session, keys, use)
    }
    // With waiters it waits for the fencing row (another statement's, one at most; lock_timeout
    // bounds it): past that the release is unproven below, and the session destroyed.
    const sent = submitStatement(
      session,
      store.releaseSql,
      [
        keys.slotBase.toString(),
        slots,
        markerKeyOf(keys, hold.limit).toString(),
        keys.interestKey,
        CHANNEL,
        keys.keyText,
        // This process's own waiters hold the interest on this very session, where the try cannot see it.
        store.waiters.has(keys.keyText),
        use === undefined ? [] : Array.from(use.slots),
        ownKeys(store, keys, session)
      ],
      engine.statementTimeoutMillis
    )
    return Effect.flatMap(sent.outcome, (settled) => {
      const row = settled._tag === "Ok" ? settled.rows[0] : undefined
      if (row?.unlocked !== slots.length || row.marker !== true || !driver.isIdle(session.client)) {
        // Unproven: the session (and every other lock on it) is destroyed, never reused.
        return kill(engine, session, "a release of permits was not proven")
      }
      return Effect.sync(() => {
        session.grants.delete(grant)
        // The head waiters of this process that now fit try again (others were notified).
        wakeListed(store, row)
      })
    })
  }).pipe(Effect.uninterruptible)

/**
 * A registered waiter leaves without a grant: its place, marker, interest and waiter key go at
 * once, and the heads that now fit are woken — proven, or the session is destroyed.
 */
const leave = (store: PermitStore, wait: WaitState, keys: PermitKeys): Effect.Effect<void> =>
  Effect.suspend(() => {
    const { engine } = store
    const registration = wait.registration
    const waiter = wait.waiter
    wait.registration = undefined
    if (registration === undefined || waiter === undefined || registration.session.state !== "open") return Effect.void
    const session = registration.session
    const use = session.permitUses.get(keys.keyText)
    if (use !== undefined) {
      use.markers -= 1
      forgetIfUnused(session, keys, use)
    }
    const sent = submitStatement(
      session,
      store.leaveSql,
      [
        keys.keyText,
        waiter.keyText,
        markerKeyOf(keys, registration.limit).toString(),
        keys.interestKey,
        keys.slotBase.toString(),
        use === undefined ? [] : Array.from(use.slots),
        ownKeys(store, keys, session, waiter),
        CHANNEL
      ],
      engine.statementTimeoutMillis
    )
    return Effect.flatMap(sent.outcome, (settled) => {
      const row = settled._tag === "Ok" ? settled.rows[0] : undefined
      if (row?.waiter !== true || row.marker !== true || row.interest !== true || !driver.isIdle(session.client)) {
        return kill(engine, session, "a permit waiter's leave was not proven")
      }
      return Effect.sync(() => wakeListed(store, row))
    })
  }).pipe(Effect.uninterruptible)

// ------------------------------------------------------------------------------ attempts

/** Creates the fencing row of a semaphore on its first use by this process. */
const ensureRow = (store: PermitStore, session: Session, keys: PermitKeys, name: string): Effect.Effect<Attempt, LockBackendError> =>
  Effect.flatMap(
    submitStatement(session, store.rowSql, [keys.keyText, name, keys.markerBase.toString()], store.engine.statementTimeoutMillis).outcome,
    (settled): Effect.Effect<Attempt, LockBackendError> => {
      if (settled._tag === "Ok") {
        if (store.rows.size >= CACHE_SIZE) store.rows.clear()
        store.rows.add(keys.keyText)
        return Effect.succeed(Retry)
      }
      return Effect.flatMap(rowWaitOrFail(name, settled), (retry) =>
        retry !== undefined ? Effect.succeed(retry) : Effect.fail(backendError(name, failureOf(settled))))
    }
  )

/**
 * A failure that left nothing locked, and so only asks for another attempt (`Retry`): the session
 * was destroyed with what it held, or the statement failed at its first step, the fencing row's
 * lock wait. A move of the session fails the request. Anything else is the caller's to judge.
 */
const rowWaitOrFail = (name: string, settled: Settled): Effect.Effect<Attempt | undefined, LockBackendError> => {
  const moved = movedError(name, settled)
  if (moved !== undefined) return Effect.fail(moved)
  // No answer / connection lost: the session was destroyed, and what it held with it.
  if (isFatal(settled)) return Effect.succeed(Retry)
  const code = sqlCode(settled)
  return Effect.succeed(code !== undefined && ROW_WAIT_CODES.has(code) ? Retry : undefined)
}

/** One attempt on its session, as `attemptOnce` sent it. */
interface Sent {
  readonly session: Session
  readonly keys: PermitKeys
  readonly request: PermitRequest
  readonly wait: WaitState
  /** The request was a registered waiter when the attempt was sent. */
  readonly registered: boolean
}

/** A failed attempt: retried, refused, or — when it may have taken locks — its session destroyed. */
const failedAttempt = (
  engine: Engine,
  sent: Sent,
  settled: Exclude<Settled, { _tag: "Ok" }>
): Effect.Effect<Attempt, LockBackendError> =>
  Effect.flatMap(rowWaitOrFail(sent.request.name, settled), (retry) => {
    if (retry !== undefined) return Effect.succeed(retry)
    const code = sqlCode(settled)
    // Refused before it ran (a missing table or column, a privilege): nothing was locked either.
    if (code !== undefined && code.startsWith("42")) return Effect.fail(backendError(sent.request.name, failureOf(settled)))
    // Anything else may have come after some try-locks: the session is destroyed, never trusted.
    return Effect.zipRight(
      kill(engine, sent.session, "a permit attempt failed after it may have taken locks"),
      Effect.fail(backendError(sent.request.name, failureOf(settled)))
    )
  })

/** Records a grant on its session, unless the session died with it; one synchronous step. */
const recordGrant = (store: PermitStore, sent: Sent, row: Row): Attempt => {
  const { keys, registered, request, session, wait } = sent
  if (session.state !== "open") return Retry
  const counter = BigInt(String(row.token))
  const slots = (row.taken as ReadonlyArray<number>).map(Number)
  const use = useOf(session, keys, request.limit)
  // A registered waiter's marker becomes its holder's; a fresh request took one of its own.
  if (registered) wait.registration = undefined
  else use.markers += 1
  use.limit = request.limit
  for (const slot of slots) use.slots.add(slot)
  const first = counter - BigInt(request.permits) + 1n
  const tokens = Array.from({ length: request.permits }, (_, i) => FencingToken.make(first + BigInt(i)))
  const grant: ServerGrant = { key: keys.key, keyText: keys.keyText, mode: "shared", session, holders: new Set(), closed: false }
  const holder: Holder = {
    grant,
    admission: { key: keys.keyText, mode: "shared" },
    onLost: request.onLost,
    state: "held",
    handed: false
  }
  grant.holders.add(holder)
  // In the same step as the liveness check: a session that dies from now on tells this holder.
  session.grants.add(grant)
  wakeListed(store, row)
  return { _tag: "Granted", hold: { holder, keys, limit: request.limit, slots }, tokens }
}

/** Records a registration on its session, unless the session died with it; one synchronous step. */
const recordWaiting = (sent: Sent): Attempt => {
  const { keys, request, session, wait } = sent
  if (session.state !== "open") return Retry
  const use = useOf(session, keys, request.limit)
  use.markers += 1
  use.limit = request.limit
  wait.registration = { session, limit: request.limit }
  return Waiting
}

/** What an attempt's answer comes to, recorded in one synchronous step with the session's bookkeeping. */
const interpret = (store: PermitStore, sent: Sent, settled: Settled): Effect.Effect<Attempt, LockBackendError> => {
  if (settled._tag !== "Ok") return failedAttempt(store.engine, sent, settled)
  const row = settled.rows[0]
  switch (row?.outcome) {
    case "granted":
      return Effect.sync(() => recordGrant(store, sent, row))
    case "waiting":
      return Effect.sync(() => {
        wakeListed(store, row)
        return recordWaiting(sent)
      })
    case "busy":
      return Effect.sync(() => {
        wakeListed(store, row)
        return Busy
      })
    case "mismatch":
      return Effect.succeed({ _tag: "LimitMismatch", current: Number(row.stored) })
    case "retry":
      return Effect.succeed(MarkerBusy)
    case "missing":
      return Effect.sync(() => {
        store.rows.delete(sent.keys.keyText)
        return Missing
      })
    default:
      // `failed` (an unlock was refused) or an answer of unknown shape: the session's locks are unknown.
      return Effect.as(kill(store.engine, sent.session, "undoing a permit attempt was not proven"), Retry)
  }
}

/** The attempt was sent before an interruption could take it back: undo whatever it took. */
const abandon = (store: PermitStore, sent: Sent, submitted: Submitted): Effect.Effect<void> =>
  Effect.gen(function*() {
    if (takeBack(submitted.job)) return
    const attempt = yield* Effect.either(interpret(store, sent, yield* submitted.outcome))
    // A grant never handed out is given back; a registration is withdrawn by the request's own exit.
    if (attempt._tag === "Right" && attempt.right._tag === "Granted") yield* release(store, attempt.right.hold)
  })

/**
 * Sends the attempt, in one synchronous step with reading what the session holds for the name
 * (exact then: see the module header), or refuses another limit than this session's own holders'.
 */
const send = (store: PermitStore, session: Session, keys: PermitKeys, request: PermitRequest, wait: WaitState) =>
  Effect.sync(() => {
    if (session.state !== "open") return Retry
    // A registration on a dead session went with it.
    if (wait.registration !== undefined && wait.registration.session.state !== "open") wait.registration = undefined
    const use = session.permitUses.get(keys.keyText)
    // The server cannot see this session's own marker (its locks never conflict with its own requests).
    if (use !== undefined && use.markers > 0 && use.limit !== request.limit) {
      return { _tag: "LimitMismatch", current: use.limit } as const
    }
    const registered = wait.registration?.session === session
    const registering = wait.register && !registered && wait.waiter !== undefined
    // Before the statement is sent: a wake-up naming this waiter can arrive before its answer.
    if (registering) {
      rekey(store, wait.waiter!)
      moveWaiter(store, wait.waiter!, session)
    }
    const submitted = submitStatement(
      session,
      store.attemptSql,
      [
        keys.keyText,
        request.limit,
        request.permits,
        keys.slotBase.toString(),
        keys.markerBase.toString(),
        keys.interestKey,
        registering,
        registered,
        use === undefined ? [] : Array.from(use.slots),
        registering || registered ? wait.waiter!.keyText : null,
        ownKeys(store, keys, session),
        CHANNEL
      ],
      store.engine.statementTimeoutMillis
    )
    const sent: Sent = { session, keys, request, wait, registered }
    return { _tag: "Sent", sent, submitted } as const
  })

/** One attempt, admitted through the name's gate, on the home session. */
const attemptOnce = (store: PermitStore, request: PermitRequest, keys: PermitKeys, wait: WaitState): Effect.Effect<Attempt, LockBackendError> =>
  Effect.gen(function*() {
    const home = yield* store.deps.homeSession(request)
    if (Option.isNone(home)) return TimedOut
    if (!store.rows.has(keys.keyText)) return yield* ensureRow(store, home.value, keys, request.name)
    const ready = yield* send(store, home.value, keys, request, wait)
    if (ready._tag !== "Sent") return ready
    const { sent, submitted } = ready
    // Given back as the layer's work, out of reach of the caller's interruption and stall watch.
    const early = yield* Effect.onInterrupt(
      awaitTurn(request, submitted.outcome),
      () => takeBack(submitted.job) ? Effect.void : store.engine.owner.run(abandon(store, sent, submitted))
    )
    if (Option.isNone(early) && takeBack(submitted.job)) return TimedOut
    return yield* interpret(store, sent, Option.isSome(early) ? early.value : yield* submitted.outcome)
  })

/** One attempt through the gate: attempts of one name in this process go one at a time, in order. */
const gated = (store: PermitStore, request: PermitRequest, keys: PermitKeys, wait: WaitState) =>
  Effect.gen(function*() {
    const admission = yield* store.gate.admit(keys.keyText, "exclusive", (signal) => awaitTurn(request, signal))
    if (Option.isNone(admission)) return TimedOut
    return yield* attemptOnce(store, request, keys, wait).pipe(Effect.ensuring(store.gate.leave(admission.value, false)))
  })

/** Hands a grant to the core, unless its session died meanwhile; one synchronous step. */
const hand = (
  store: PermitStore,
  attempt: Extract<Attempt, { _tag: "Granted" }>
): Effect.Effect<PermitResult<PermitGrant> | undefined> =>
  Effect.sync(() => {
    const { hold, tokens } = attempt
    if (hold.holder.grant.closed || hold.holder.state !== "held") return undefined
    hold.holder.handed = true
    const grant = { token: tokens[0]!, tokens, validUntil: Option.none(), release: release(store, hold) }
    return { _tag: "Granted", grant } as const
  })

/** Attempts until granted, refused or out of time, waiting registered (in the queue) between attempts. */
const acquire = (
  store: PermitStore,
  request: PermitRequest
): Effect.Effect<PermitResult<PermitGrant>, LockBackendError> =>
  Effect.gen(function*() {
    const { deps, engine } = store
    if (deps.unavailable !== undefined) return yield* backendError(request.name, new Error(deps.unavailable))
    // Refused before any statement: an out-of-range parameter would fail the statement, and a
    // failed attempt's session is destroyed with every lock on it.
    if (request.limit > MAX_PERMIT_LIMIT) {
      return yield* backendError(
        request.name,
        new RangeError(`PgAdvisory semaphores take a limit of at most ${MAX_PERMIT_LIMIT}, got ${request.limit}`)
      )
    }
    const keys = keysOf(store, request.name)
    const wait: WaitState = { registration: undefined, waiter: undefined, register: false, markerRetries: 0 }
    return yield* Effect.gen(function*() {
      while (true) {
        if (engine.closing) return yield* deps.shuttingDown(request.name)
        // Captured before the attempt: a wake-up from now on ends the wait below at once.
        const signal = wait.waiter?.signal
        const attempt = yield* gated(store, request, keys, wait)
        switch (attempt._tag) {
          case "Granted": {
            const handed = yield* hand(store, attempt)
            if (handed !== undefined) return handed
            continue
          }
          case "LimitMismatch":
          case "TimedOut":
            return attempt
          case "Missing":
          case "Retry":
            continue
          case "MarkerBusy":
            // Another transaction's probe of the marker is ending: try again at once, a few times.
            if (++wait.markerRetries <= MARKER_RETRIES) continue
            break
          case "Waiting":
          case "Busy":
            wait.markerRetries = 0
        }
        if (request.attempt === "once") return Busy
        if (wait.registration === undefined && !wait.register) {
          // The next attempt registers (interest taken before its tries): a release after this
          // busy attempt, here or elsewhere, either frees its permits first or sees it waiting.
          wait.waiter = addWaiter(store, keys)
          wait.register = true
          if (attempt._tag === "Busy") continue
        }
        const woke = yield* request.waitUntilDeadline(
          Effect.race(Deferred.await(signal ?? wait.waiter!.signal), store.fallbackPause)
        )
        if (Option.isNone(woke)) return TimedOut
      }
    }).pipe(
      // However the request ends, a place it still has is given up (a grant consumed its own): the
      // clean-up of a wait, run as the layer's work (out of reach of the caller's stall watch and
      // transaction); the caller waits for it, within the leave's own statement bound.
      Effect.ensuring(Effect.ensuring(
        engine.owner.run(leave(store, wait, keys)),
        Effect.sync(() => wait.waiter !== undefined && removeWaiter(store, wait.waiter))
      ))
    )
  })

/** Builds the permit store of one engine; it shares the engine's sessions, hints and bounds. */
export const makePermitBackend = (engine: Engine, deps: PermitDeps): SemaphoreBackend => {
  const table = engine.options.fencingTable
  const store: PermitStore = {
    engine,
    deps,
    attemptSql: permitAttemptSql(table),
    rowSql: permitRowSql(table),
    releaseSql: permitReleaseSql(table),
    leaveSql: permitLeaveSql(table),
    // One interval, jittered: waiters of many processes woken together do not re-try in step.
    fallbackPause: Effect.repeat(Effect.void, {
      schedule: Schedule.jittered(
        Schedule.spaced(Duration.millis(engine.options.permitRetryMillis ?? PERMIT_FALLBACK_RETRY_MS))
      ),
      times: 1
    }),
    gate: makeLocalKeys(),
    keys: new Map(),
    rows: new Set(),
    waiters: new Map(),
    byKey: new Map(),
    bySession: new Map()
  }
  engine.permitHint = (hint) => onHint(store, hint)
  return {
    backend: BACKEND,
    maxNameBytes: 1024,
    defaultTtl: Duration.seconds(30),
    minTtl: Duration.seconds(1),
    renewBatchSize: 1,
    acquire: (request) => acquire(store, request),
    // Session locks need no renewal; the core never calls this for grants without validUntil.
    renew: () => Effect.succeed([])
  }
}

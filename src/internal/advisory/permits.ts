/**
 * Semaphores on session advisory locks: N permits per name, on the sessions the engine owns.
 *
 * Keys
 * ----
 * A semaphore name has keys of its own, apart from lock keys (other namespaces of the same
 * SHA-256 derivation, `permitKeysOf`): slot `i` (`slotBase # i`, `i < limit`) is one permit — a
 * session lock, so a dead session drops its permits; the limit marker of limit `L`
 * (`markerBase # L`) is held shared by every holder and every registered waiter using limit `L`;
 * the fencing row (the semaphore's own key) keeps the counter and the limit in use.
 *
 * Granting
 * --------
 * One statement per attempt (`permitAttemptSql`): under the fencing row's lock it checks the
 * limit (or takes a free name over with a new one), takes the marker, try-locks free slots until
 * it has `permits` of them and bumps the counter by `permits` — or undoes every slot it took, all
 * in that statement. Why it is exact and race-free is written beside each step there. What is
 * left for this module is the one thing PostgreSQL does not do for us: a session's own locks never
 * conflict with its own requests, so this process keeps, per session, what it holds for each
 * semaphore (`Session.permitUses`): the slots to skip, and the limit of its own holders — a
 * request with another limit is refused here, since the server's probe cannot see this session's
 * own marker. Attempts of one name are admitted one at a time per process (a FIFO gate), so that
 * record is exact when an attempt is sent; releases only shrink it, and are recorded when sent.
 *
 * Every permit statement runs on the home session, which never blocks: it waits for nothing but
 * the fencing row, held by another attempt for one statement at most (the session's
 * lock_timeout, then the statement bound, cut that short). So "a session blocked in a wait holds
 * no lock" stays true: permits never block at the server.
 *
 * Waiting
 * -------
 * A request that finds too few free slots registers as a waiter (in its next attempt's
 * statement: the marker is kept and the interest key taken shared before the slots are tried) and
 * waits in-process for a hint: a release of the semaphore here, a notification of one elsewhere
 * (a release notifies when some other session holds the interest key), or its home session
 * dying. Each hint makes it try again. A crashed holder's session sends nothing, so a waiter also
 * re-tries every `PERMIT_FALLBACK_RETRY_MS` (jittered), always within its deadline.
 *
 * Order: none is promised. Every waiter of the name tries again on each release, and whoever's
 * attempt finds its permits free first is granted (within one process, attempts go in arrival
 * order); a request for many permits can be overtaken by smaller ones.
 *
 * Release and loss
 * ----------------
 * A release unlocks the slots and the marker in one bounded statement; unless every unlock
 * returned true and the session is idle afterwards, the session is destroyed (its other holders
 * are told `connection-lost`). A session that dies tells every holder on it, as for locks. A waiter
 * that leaves without a grant (deadline, interruption) unregisters the same way: proven, or the
 * session is destroyed.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as PubSub from "effect/PubSub"
import type * as Queue from "effect/Queue"
import * as Schedule from "effect/Schedule"
import * as FencingToken from "../../FencingToken.js"
import type { AcquireRequest, PermitGrant, PermitRequest, PermitResult, SemaphoreBackend } from "../../LockBackend.js"
import { LockBackendError } from "../../LockError.js"
import { monotonicMillis } from "../core/clock.js"
import { type LocalKeys, makeLocalKeys } from "./localKeys.js"
import { advisoryKey } from "../core/lockKey.js"
import * as driver from "../pg/driver.js"
import { interestKeyOf } from "./grants.js"
import { BACKEND, isFatal, kill, movedError, sqlCode, submitStatement, type Submitted, takeBack } from "./session.js"
import { CHANNEL, PERMIT_RELEASE_SQL, PERMIT_UNREGISTER_SQL, permitAttemptSql, permitRowSql } from "./sql.js"
import type { Engine, Hint, Holder, PermitUse, ServerGrant, Session, Settled } from "./state.js"

/** Default interval of a waiter's fallback re-try (jittered ±20%): for holders that crashed, which notify nobody. */
export const PERMIT_FALLBACK_RETRY_MS = 1_000
/**
 * Largest limit this backend takes: a busy attempt try-locks every slot while it holds the
 * fencing row (about a microsecond each), and every held permit is an entry of PostgreSQL's lock
 * table, which the whole server shares (`max_locks_per_transaction` × connections, 6,400 by default).
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
  /** The fencing row's key; its decimal form is the notification payload and the local hint's key. */
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

/** A waiter's registration: its marker and the interest key, held shared on `session`. */
interface Registration {
  readonly session: Session
  readonly limit: number
}

/** What one request carries from one attempt to the next. */
interface WaitState {
  registration: Registration | undefined
  /** Subscribed before the attempt that registers: no hint in between is missed. */
  hints: Queue.Dequeue<Hint> | undefined
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
  readonly fallbackPause: Effect.Effect<unknown>
  /** One attempt per semaphore name per process at a time, in arrival order (see the header). */
  readonly gate: LocalKeys
  readonly keys: Map<string, PermitKeys>
  /** Semaphores whose fencing row is known to exist (rows are never deleted). */
  readonly rows: Set<string>
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

/** Gives a grant of permits back; destroys the session when the release is not proven. */
const release = (engine: Engine, hold: PermitHold): Effect.Effect<void> =>
  Effect.suspend(() => {
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
    const sent = submitStatement(
      session,
      PERMIT_RELEASE_SQL,
      [keys.slotBase.toString(), slots, markerKeyOf(keys, hold.limit).toString(), keys.interestKey, CHANNEL, keys.keyText],
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
        // This process's waiters of the semaphore try again now (others were notified).
        engine.hints.unsafeOffer({ _tag: "Released", keyText: keys.keyText })
      })
    })
  }).pipe(Effect.uninterruptible)

/** A registered waiter leaves without a grant: marker and interest go, proven or the session is destroyed. */
const unregister = (engine: Engine, wait: WaitState, keys: PermitKeys): Effect.Effect<void> =>
  Effect.suspend(() => {
    const registration = wait.registration
    wait.registration = undefined
    if (registration === undefined || registration.session.state !== "open") return Effect.void
    const session = registration.session
    const use = session.permitUses.get(keys.keyText)
    if (use !== undefined) {
      use.markers -= 1
      forgetIfUnused(session, keys, use)
    }
    const sent = submitStatement(
      session,
      PERMIT_UNREGISTER_SQL,
      [markerKeyOf(keys, registration.limit).toString(), keys.interestKey],
      engine.statementTimeoutMillis
    )
    return Effect.flatMap(sent.outcome, (settled) => {
      const row = settled._tag === "Ok" ? settled.rows[0] : undefined
      return row?.marker === true && row.interest === true && driver.isIdle(session.client)
        ? Effect.void
        : kill(engine, session, "a permit waiter's unregistration was not proven")
    })
  }).pipe(Effect.uninterruptible)

/** Creates the fencing row of a semaphore on its first use by this process. */
const ensureRow = (
  store: PermitStore,
  session: Session,
  keys: PermitKeys,
  name: string
): Effect.Effect<Attempt, LockBackendError> =>
  Effect.flatMap(
    submitStatement(session, store.rowSql, [keys.keyText, name], store.engine.statementTimeoutMillis).outcome,
    (settled): Effect.Effect<Attempt, LockBackendError> => {
      if (settled._tag === "Ok") {
        if (store.rows.size >= CACHE_SIZE) store.rows.clear()
        store.rows.add(keys.keyText)
        return Effect.succeed(Retry)
      }
      const moved = movedError(name, settled)
      if (moved !== undefined) return Effect.fail(moved)
      if (isFatal(settled)) return Effect.succeed(Retry)
      const code = sqlCode(settled)
      return code !== undefined && ROW_WAIT_CODES.has(code)
        ? Effect.succeed(Retry)
        : Effect.fail(backendError(name, failureOf(settled)))
    }
  )

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
): Effect.Effect<Attempt, LockBackendError> => {
  const moved = movedError(sent.request.name, settled)
  if (moved !== undefined) return Effect.fail(moved)
  // No answer / connection lost: the session was destroyed, and what it held with it.
  if (isFatal(settled)) return Effect.succeed(Retry)
  const code = sqlCode(settled)
  // The fencing row's lock wait is the statement's first step: nothing was locked yet.
  if (code !== undefined && ROW_WAIT_CODES.has(code)) return Effect.succeed(Retry)
  // Refused before it ran (a missing table or column, a privilege): nothing was locked either.
  if (code !== undefined && code.startsWith("42")) return Effect.fail(backendError(sent.request.name, failureOf(settled)))
  // Anything else may have come after some try-locks: the session is destroyed, never trusted.
  return Effect.zipRight(
    kill(engine, sent.session, "a permit attempt failed after it may have taken locks"),
    Effect.fail(backendError(sent.request.name, failureOf(settled)))
  )
}

/** Records a grant on its session, unless the session died with it; one synchronous step. */
const recordGrant = (sent: Sent, row: Readonly<Record<string, unknown>>): Attempt => {
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
      return Effect.sync(() => recordGrant(sent, row))
    case "waiting":
      return Effect.sync(() => recordWaiting(sent))
    case "busy":
      return Effect.succeed(Busy)
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
    if (attempt._tag === "Right" && attempt.right._tag === "Granted") yield* release(store.engine, attempt.right.hold)
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
        wait.register && !registered,
        registered,
        use === undefined ? [] : Array.from(use.slots)
      ],
      store.engine.statementTimeoutMillis
    )
    const sent: Sent = { session, keys, request, wait, registered }
    return { _tag: "Sent", sent, submitted } as const
  })

/** One attempt, admitted through the name's gate, on the home session. */
const attemptOnce = (
  store: PermitStore,
  request: PermitRequest,
  keys: PermitKeys,
  wait: WaitState
): Effect.Effect<Attempt, LockBackendError> =>
  Effect.gen(function*() {
    const home = yield* store.deps.homeSession(request)
    if (Option.isNone(home)) return TimedOut
    if (!store.rows.has(keys.keyText)) return yield* ensureRow(store, home.value, keys, request.name)
    const ready = yield* send(store, home.value, keys, request, wait)
    if (ready._tag !== "Sent") return ready
    const { sent, submitted } = ready
    // Waiting for the statement's turn is interruptible and bounded by the deadline; a single
    // attempt whose deadline already passed still gets its turn (the attempt is what was asked).
    const now = yield* monotonicMillis
    const passed = request.attempt === "once" && Option.isSome(request.deadline) && request.deadline.value <= now
    const turn = passed ? Effect.asSome(request.interruptible(submitted.outcome)) : request.waitUntilDeadline(submitted.outcome)
    // Given back as the layer's work, out of reach of the caller's interruption and stall watch.
    const early = yield* Effect.onInterrupt(turn, () => takeBack(submitted.job) ? Effect.void : store.engine.owner.run(abandon(store, sent, submitted)))
    if (Option.isNone(early) && takeBack(submitted.job)) return TimedOut
    return yield* interpret(store, sent, Option.isSome(early) ? early.value : yield* submitted.outcome)
  })

/** One attempt through the gate: attempts of one name in this process go one at a time, in order. */
const gated = (
  store: PermitStore,
  request: PermitRequest,
  keys: PermitKeys,
  wait: WaitState
): Effect.Effect<Attempt, LockBackendError> =>
  Effect.gen(function*() {
    const now = yield* monotonicMillis
    const passed = request.attempt === "once" && Option.isSome(request.deadline) && request.deadline.value <= now
    const admission = yield* store.gate.admit(
      keys.keyText,
      "exclusive",
      (signal) => passed ? Effect.asSome(request.interruptible(signal)) : request.waitUntilDeadline(signal)
    )
    if (Option.isNone(admission)) return TimedOut
    return yield* attemptOnce(store, request, keys, wait).pipe(Effect.ensuring(store.gate.leave(admission.value, false)))
  })

/** Hands a grant to the core, unless its session died meanwhile; one synchronous step. */
const hand = (
  engine: Engine,
  attempt: Extract<Attempt, { _tag: "Granted" }>
): Effect.Effect<PermitResult<PermitGrant> | undefined> =>
  Effect.sync(() => {
    const { hold, tokens } = attempt
    if (hold.holder.grant.closed || hold.holder.state !== "held") return undefined
    hold.holder.handed = true
    const grant = { token: tokens[0]!, tokens, validUntil: Option.none(), release: release(engine, hold) }
    return { _tag: "Granted", grant } as const
  })

/** Waits for a release of the semaphore, or for the registration's session to die. */
const nextHint = (hints: Queue.Dequeue<Hint>, keyText: string, wait: WaitState): Effect.Effect<void> =>
  Effect.gen(function*() {
    while (true) {
      const hint = yield* hints.take
      if (hint._tag === "Released" && hint.keyText === keyText) return
      if (hint._tag === "Changed" && wait.registration?.session.state !== "open") return
    }
  })

/** Attempts until granted, refused or out of time, waiting registered between attempts. */
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
    const wait: WaitState = { registration: undefined, hints: undefined, register: false, markerRetries: 0 }
    return yield* Effect.gen(function*() {
      while (true) {
        if (engine.closing) return yield* deps.shuttingDown(request.name)
        const attempt = yield* gated(store, request, keys, wait)
        switch (attempt._tag) {
          case "Granted": {
            const handed = yield* hand(engine, attempt)
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
        if (attempt._tag === "Busy" && wait.registration === undefined) {
          // Subscribed first, then registered by the next attempt itself (interest taken before
          // its tries): a release after this busy attempt, here or elsewhere, is not missed.
          wait.hints ??= yield* PubSub.subscribe(engine.hints)
          wait.register = true
          continue
        }
        wait.hints ??= yield* PubSub.subscribe(engine.hints)
        const wake = Effect.race(nextHint(wait.hints, keys.keyText, wait), store.fallbackPause)
        const woke = yield* request.waitUntilDeadline(wake)
        if (Option.isNone(woke)) return TimedOut
      }
    }).pipe(
      // However the request ends, a registration it still has is withdrawn (the grant consumed its own).
      Effect.ensuring(unregister(engine, wait, keys)),
      Effect.scoped
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
    // One interval, jittered: waiters of many processes woken together do not re-try in step.
    fallbackPause: Effect.repeat(Effect.void, {
      schedule: Schedule.jittered(
        Schedule.spaced(Duration.millis(engine.options.permitRetryMillis ?? PERMIT_FALLBACK_RETRY_MS))
      ),
      times: 1
    }),
    gate: makeLocalKeys(),
    keys: new Map(),
    rows: new Set()
  }
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

/**
 * The PostgreSQL session advisory-lock backend, assembled from its pieces.
 *
 * Sessions
 * --------
 * Locks live on raw `pg.Client` sessions this module owns, never on a pool connection (a pool
 * recycles a connection with its session locks still on it). There are at most `maxSessions`:
 *
 * - one **home** session, which never runs a blocking statement. It takes uncontended locks,
 *   runs releases and heartbeats, and LISTENs for release notifications;
 * - up to `maxSessions - 1` **wait** sessions. A blocking `pg_advisory_lock` runs only on a wait
 *   session that holds nothing, has nothing queued and no try-lock whose outcome is still
 *   unrecorded (`claims`; a try-lock claims its session in the same synchronous step that selects
 *   it, and a wait reserves one in the step that finds it free). When the wait is granted the lock
 *   stays there, and that session then serves try-locks and releases like the home session until
 *   it holds nothing again.
 *
 * That is the rule answering "a release must never wait behind another lock's blocked wait":
 * **a session blocked in a lock wait holds no lock**. No release is ever routed to it, nothing
 * else is sent to it while it waits, and since a waiting backend holds nothing, two processes'
 * waits can never form a deadlock cycle. (The interruption fuzz test samples pg_locks for it.)
 * Each session's queue is drained by driver callbacks, not a fiber (`session.ts`'s pump).
 *
 * Granting
 * --------
 * An uncontended request is one `pg_try_advisory_lock` plus the fencing bump, in one statement;
 * tries queued behind a session's running statement are sent together (`grants.ts`). A contended
 * request reserves a free wait session and blocks in PostgreSQL, in slices (`wait.ts`). When no
 * wait session is free and no more may be opened, the request waits in-process for one to come
 * free, for a release of its key (here, or a notification from elsewhere), or — since
 * notifications are hints that a crashed holder never sends — a slow fallback re-try; always
 * bounded by its deadline.
 *
 * Re-entrancy
 * -----------
 * PostgreSQL grants a key twice to one session. `localKeys` admits, per key, one exclusive
 * request at a time, or one fresh shared request at a time; later shared requests join the
 * shared grant this process holds (a reference count, each with its own fencing token) unless an
 * exclusive request waits for the key at the server — then they queue at the server like a fresh
 * request, on a wait session that holds nothing. So no session ever holds a key twice, and a
 * failed grant statement is undone by a single unlock.
 *
 * Release and loss
 * ----------------
 * A release unlocks with a bounded wait; unless the unlock returned true and the session is idle
 * afterwards, the session is destroyed and every other lease on it is told `connection-lost`.
 * A session that dies ('error'/'end' events, a statement or heartbeat without answer, an answer
 * from another backend) tells every lease on it — only leases handed to the core.
 *
 * Semaphores
 * ----------
 * `permits.ts` serves `DistributedSemaphore` on the same sessions: its statements run on the home
 * session only and never block, so the rule above holds for them too.
 */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as Option from "effect/Option"
import * as PubSub from "effect/PubSub"
import * as Queue from "effect/Queue"
import * as Schedule from "effect/Schedule"
import * as Scope from "effect/Scope"
import type { AcquireRequest, AcquireResult, Grant, LockAndSemaphoreBackend } from "../../LockBackend.js"
import { LockBackendError, type UnsafeConnectionPooling } from "../../LockError.js"
import { makeLocalKeys, type Admission } from "./localKeys.js"
import { advisoryKey } from "../core/lockKey.js"
import * as driver from "../pg/driver.js"
import { ensureFencingTable } from "./bootstrap.js"
import { Busy, interestKeyOf, joinShared, Retry, type Step, TimedOut, tryGrant } from "./grants.js"
import { within } from "../runtime/stallSafe.js"
import { uninterruptibleMask } from "../runtime/mask.js"
import * as Owner from "../runtime/owner.js"
import * as Sweep from "../lease/sweep.js"
import {
  asBackendError,
  BACKEND,
  changed,
  isFreeWaitSession,
  markDead,
  open,
  statement
} from "./session.js"
import { isPermitWake, makePermitBackend } from "./permits.js"
import { HEARTBEAT_SQL, INTEREST_SQL, NOW_SQL, permitSweepSql, sweepSql, UNINTEREST_SQL } from "./sql.js"
import type { BackendOptions, Engine, Hint, Hints, Holder, Session } from "./state.js"
import { blockingWait, nextHint } from "./wait.js"

export { BACKEND } from "./session.js"
export { CHANNEL } from "./sql.js"
export { fencingTableSql, fencingTokensSql, permitColumnsSql } from "./bootstrap.js"
export type { BackendOptions } from "./state.js"

/** Bound on a statement that never waits for a lock (grant attempt, bump, unlock, cleanup). */
const STATEMENT_TIMEOUT_MS = 5_000
/** Re-try interval of a request that waits on notifications only (all wait sessions in use). */
const FALLBACK_RETRY_MS = 1_000
/**
 * The fallback re-try's pause: one interval, jittered, so that the in-process waiters of many
 * processes (all woken by the same restart, say) do not re-try in step.
 */
const fallbackPause = Effect.repeat(Effect.void, {
  schedule: Schedule.jittered(Schedule.spaced(Duration.millis(FALLBACK_RETRY_MS))),
  times: 1
})

/** Fencing rows one sweep statement deletes at most: it shares the home session with releases. */
const SWEEP_LIMIT = 200
/** Sweep statements in one pass at most; a larger backlog goes over the next passes. */
const SWEEP_MAX_ROUNDS = 500

/** Names whose advisory keys are remembered. */
const KEY_CACHE_SIZE = 4_096
/** Bound on closing a session gracefully at shutdown before its socket is destroyed. */
const CLOSE_TIMEOUT_MS = 2_000

const shuttingDown = (name: string) =>
  new LockBackendError({ operation: "acquire", name, cause: new Error("the PgAdvisory layer is shutting down") })

/**
 * The engine's hints: permit wake-ups go to the permit store alone (`isPermitWake`), session
 * changes to both; lock requests waiting in-process read the rest from a sliding PubSub — a lock
 * waiter that misses a hint under churn still has its server-side wait and its fallback re-try.
 */
const makeHints = (pubsub: PubSub.PubSub<Hint>, permits: (hint: Hint) => void): Hints => ({
  unsafeOffer: (hint) => {
    if (hint._tag === "Released" && isPermitWake(hint.keyText)) return permits(hint)
    if (hint._tag === "Changed") permits(hint)
    pubsub.unsafeOffer(hint)
  },
  subscribe: PubSub.subscribe(pubsub)
})

/** Adds a freshly opened session to the engine, unless the layer closed meanwhile. */
const adopt = (engine: Engine, session: Session): Effect.Effect<void> =>
  Effect.gen(function*() {
    if (engine.closing || session.state === "dead") return markDead(engine, session)
    engine.sessions.push(session)
    changed(engine)
  })

/** Opens a session in the background (a client that finishes connecting is always adopted or closed). */
const openInBackground = (
  engine: Engine,
  role: Session["role"],
  onDone: (exit: Exit.Exit<void, LockBackendError | UnsafeConnectionPooling>) => void
): Effect.Effect<void> =>
  open(engine, role).pipe(
    Effect.flatMap((session) => adopt(engine, session)),
    Effect.onExit((exit) => Effect.sync(() => onDone(Exit.asVoid(exit)))),
    Effect.ignore,
    Effect.uninterruptible,
    // The layer's work: an opener started from a guarded body outlives that body's stall watch.
    (opening) => engine.owner.fork(opening),
    Effect.asVoid
  )

/** Starts opening the home session (once) and returns the signal of its outcome. */
const openHome = (engine: Engine): Effect.Effect<Deferred.Deferred<void, LockBackendError>> =>
  Effect.suspend(() => {
    if (engine.homeOpening !== undefined) return Effect.succeed(engine.homeOpening)
    const done = Deferred.unsafeMake<void, LockBackendError>(FiberId.none)
    engine.homeOpening = done
    return Effect.as(
      openInBackground(engine, "home", (exit) => {
        engine.homeOpening = undefined
        Deferred.unsafeDone(done, Exit.mapError(exit, asBackendError("")))
      }),
      done
    )
  })

const waitSessionCount = (engine: Engine) => engine.sessions.filter((s) => s.role === "wait").length

/** Starts opening one wait session if there is room; its outcome arrives as `done`. */
const openWait = (engine: Engine): Effect.Effect<Option.Option<Deferred.Deferred<void, LockBackendError>>> =>
  Effect.suspend(() => {
    // One slot is always left for the home session.
    if (engine.closing || waitSessionCount(engine) + engine.openingWait >= engine.options.maxSessions - 1) {
      return Effect.succeedNone
    }
    const done = Deferred.unsafeMake<void, LockBackendError>(FiberId.none)
    engine.openingWait += 1
    return Effect.as(
      openInBackground(engine, "wait", (exit) => {
        engine.openingWait -= 1
        Deferred.unsafeDone(done, Exit.mapError(exit, asBackendError("")))
      }),
      Option.some(done)
    )
  })

/**
 * A session for a statement that never blocks, **claimed** for one try-lock (see
 * `Session.claims`; `tryGrant` gives the claim back): the home session or a wait session that
 * already holds a lock, the least busy one. Empty wait sessions stay free for waits (grants
 * need no spreading for throughput: concurrent tries on one session share one statement).
 * Opens the home session if it is gone (it also carries the LISTEN).
 */
const fastPathSession = (engine: Engine, request: AcquireRequest): Effect.Effect<Option.Option<Session>, LockBackendError> =>
  Effect.suspend(() => {
    if (engine.closing) return Effect.fail(shuttingDown(request.name))
    // Usually a session is there: selected and claimed right here, in one synchronous step.
    const ready = claimFastPathSession(engine)
    return ready !== undefined ? Effect.succeed(Option.some(ready)) : fastPathSessionSlow(engine, request)
  })

/**
 * Selects and claims a session for a try-lock, in one synchronous step: between two Effect steps
 * another fiber may run, release the session's last grant and reserve it for a blocking wait,
 * which this try would then queue behind (and whose clean-up would drop this try's grant).
 */
const claimFastPathSession = (engine: Engine): Session | undefined => {
  let best: Session | undefined
  for (const session of engine.sessions) {
    if (session.state !== "open" || session.waiting) continue
    if (session.role === "wait" && session.grants.size === 0) continue
    if (best === undefined || session.pending < best.pending) best = session
  }
  if (best !== undefined) best.claims += 1
  return best
}

const fastPathSessionSlow = (engine: Engine, request: AcquireRequest): Effect.Effect<Option.Option<Session>, LockBackendError> =>
  Effect.gen(function*() {
    while (true) {
      if (engine.closing) return yield* shuttingDown(request.name)
      const opening = engine.sessions.some((session) => session.role === "home") ? undefined : yield* openHome(engine)
      const best = yield* Effect.sync(() => claimFastPathSession(engine))
      if (best !== undefined) return Option.some(best)
      const done = opening ?? (yield* openHome(engine))
      const outcome = yield* request.waitUntilDeadline(Deferred.await(done))
      if (Option.isNone(outcome)) return Option.none()
    }
  })

/**
 * The home session, for a statement that never blocks (permits run there only): opened if it is
 * gone, the wait for it bounded by the deadline (`None` when the deadline passed first).
 */
const homeSession = (engine: Engine, request: AcquireRequest): Effect.Effect<Option.Option<Session>, LockBackendError> =>
  Effect.gen(function*() {
    while (true) {
      if (engine.closing) return yield* shuttingDown(request.name)
      const home = engine.sessions.find((session) => session.role === "home" && session.state === "open")
      if (home !== undefined) return Option.some(home)
      const outcome = yield* request.waitUntilDeadline(Deferred.await(yield* openHome(engine)))
      if (Option.isNone(outcome)) return Option.none()
    }
  })

type Reservation = { readonly _tag: "Session"; readonly session: Session } | typeof TimedOut | typeof Retry

/**
 * Registers this request's interest in release notifications of its key, on the home session,
 * until the scope closes (see `releaseSql`): `true` when registered now — the request must then
 * try the lock once more before it waits, `false` when it cannot be (no home session, or a release
 * is checking at this moment: trying again is right then too).
 */
const registerInterest = (engine: Engine, keyText: string): Effect.Effect<boolean, never, Scope.Scope> =>
  Effect.gen(function*() {
    const home = engine.sessions.find((session) => session.role === "home" && session.state === "open")
    if (home === undefined) return false
    const interestKey = interestKeyOf(keyText)
    const settled = yield* statement(engine, home, INTEREST_SQL, [interestKey])
    if (settled._tag !== "Ok" || settled.rows[0]?.registered !== true) return false
    // Withdrawn on the same session; gone anyway if that session dies.
    yield* Effect.addFinalizer(() => home.state === "open" ? statement(engine, home, UNINTEREST_SQL, [interestKey]) : Effect.void)
    return true
  })

/**
 * What a request needs to wait in-process: hints (subscribed), interest in notifications, and the
 * scope both live in — made only when a request first waits in-process, so the uncontended and the
 * server-side waits pay for no scope (closed when the request ends, `grantLoop`).
 */
interface InProcessWait {
  hints: Queue.Dequeue<Hint> | undefined
  registered: boolean
  scope: Scope.CloseableScope | undefined
}

/** The in-process wait's scope, made on first use. */
const scopeOf = (inProcess: InProcessWait): Effect.Effect<Scope.Scope> =>
  inProcess.scope !== undefined
    ? Effect.succeed(inProcess.scope)
    : Effect.map(Scope.make(), (scope) => (inProcess.scope = scope))

/** A wait session that holds nothing, reserved for one blocking wait; or a reason to try again. */

const reserveWaitSession = (
  engine: Engine,
  request: AcquireRequest,
  keyText: string,
  inProcess: InProcessWait
): Effect.Effect<Reservation, LockBackendError> =>
  Effect.gen(function*() {
    while (true) {
      if (engine.closing) return yield* shuttingDown(request.name)
      const free = yield* Effect.sync(() => {
        const found = engine.sessions.find(isFreeWaitSession)
        if (found !== undefined) found.waiting = true
        return found
      })
      if (free !== undefined) return { _tag: "Session", session: free } as const
      const opened = yield* openWait(engine)
      if (Option.isSome(opened)) {
        const outcome = yield* request.waitUntilDeadline(Deferred.await(opened.value))
        if (Option.isNone(outcome)) return TimedOut
        continue
      }
      // Every wait session is busy or holds a lock: wait for one to come free, or for a hint
      // that this key was released, then try again. Subscribed first, and tried once more: a
      // release between the busy try and the subscription is not missed. Releases elsewhere
      // notify only registered waiters, so register too (and try once more). Notifications are
      // hints (a crashed holder sends none), hence the fallback re-try.
      if (inProcess.hints === undefined) {
        inProcess.hints = yield* Scope.extend(engine.hints.subscribe, yield* scopeOf(inProcess))
        return Retry
      }
      if (!inProcess.registered) {
        inProcess.registered = yield* Scope.extend(registerInterest(engine, keyText), yield* scopeOf(inProcess))
        if (inProcess.registered) return Retry
      }
      const hints = inProcess.hints
      const woke = yield* request.waitUntilDeadline(
        Effect.race(nextHint(hints, keyText), Effect.as(fallbackPause, "released" as const))
      )
      if (Option.isNone(woke)) return TimedOut
      if (woke.value === "released") return Retry
    }
  })

/**
 * The uncontended path, kept free of the contended one's setup (a scope, a subscription): one
 * try-lock on a claimed session. `Retry` and `Busy` go on to `grantLoop`.
 */
const firstTry = (
  engine: Engine,
  request: AcquireRequest,
  key: bigint,
  keyText: string,
  admission: Admission
): Effect.Effect<Step, LockBackendError> =>
  Effect.flatMap(fastPathSession(engine, request), (session) =>
    Option.isNone(session) ? Effect.succeed(TimedOut) : tryGrant(engine, session.value, request, key, keyText, admission))

const grantLoop = (
  engine: Engine,
  request: AcquireRequest,
  key: bigint,
  keyText: string,
  admission: Admission,
  afterBusyTry: boolean
): Effect.Effect<AcquireResult<Grant>, LockBackendError> =>
  Effect.suspend(() => {
    const inProcess: InProcessWait = { hints: undefined, registered: false, scope: undefined }
    return grantSteps(engine, request, key, keyText, admission, afterBusyTry, inProcess).pipe(
      // The in-process wait's subscription and interest end with the request.
      Effect.onExit((exit) => inProcess.scope === undefined ? Effect.void : Scope.close(inProcess.scope, exit))
    )
  })

const grantSteps = (
  engine: Engine,
  request: AcquireRequest,
  key: bigint,
  keyText: string,
  admission: Admission,
  afterBusyTry: boolean,
  inProcess: InProcessWait
): Effect.Effect<AcquireResult<Grant>, LockBackendError> =>
  Effect.gen(function*() {
    // A shared request that found an exclusive one queued at the server queues there too; a
    // request whose first try was just busy goes straight to its wait.
    let mustQueue = afterBusyTry
    while (true) {
      if (request.mode === "shared" && !mustQueue) {
        const joined = yield* joinShared(engine, request, key, keyText, admission)
        if (joined !== undefined && joined._tag === "JoinRefused") mustQueue = true
        else if (joined !== undefined && joined._tag === "Retry") continue
        else if (joined !== undefined) return joined
      }
      if (!mustQueue) {
        // Claimed by fastPathSession; tryGrant gives the claim back (nothing between can fail or be interrupted).
        const session = yield* fastPathSession(engine, request)
        if (Option.isNone(session)) return TimedOut
        const tried: Step = yield* tryGrant(engine, session.value, request, key, keyText, admission)
        if (tried._tag === "Retry") continue
        if (tried._tag === "Granted") return tried
      }
      if (request.attempt === "once") return Busy
      const reservation = yield* reserveWaitSession(engine, request, keyText, inProcess)
      if (reservation._tag === "TimedOut") return TimedOut
      if (reservation._tag === "Retry") {
        mustQueue = false
        continue
      }
      const waited = yield* blockingWait(engine, reservation.session, request, key, keyText, admission)
      if (waited._tag !== "Retry") return waited
      mustQueue = false
    }
  })

/**
 * Builds the backend: connects the home session (refusing connections without session affinity),
 * creates the fencing table if needed, and starts the heartbeat and loss-report fibers. Closing
 * the scope closes every session (the server drops their locks). Its `semaphore` (`permits.ts`)
 * shares the sessions.
 */
export const make = (
  options: BackendOptions
): Effect.Effect<LockAndSemaphoreBackend, UnsafeConnectionPooling | LockBackendError, Scope.Scope> =>
  Effect.flatMap(driver.load, (pg) => makeWith(options, pg))

/**
 * `make` on a given driver module: node-pg, or a fake edge in tests of the session logic on the
 * TestClock (heartbeats, bounds), in addition to the tests against the real server.
 */
export const makeWith = (
  options: BackendOptions,
  pg: driver.Driver
): Effect.Effect<LockAndSemaphoreBackend, UnsafeConnectionPooling | LockBackendError, Scope.Scope> =>
  Effect.gen(function*() {
    // First: the engine's own fibers are stopped only after its sessions have been ended.
    const owner = yield* Owner.make
    const engine: Engine = {
      options,
      driver: pg,
      clientConfig: driver.clientConfig(options.connect),
      statementTimeoutMillis: STATEMENT_TIMEOUT_MS,
      local: makeLocalKeys(),
      sessions: [],
      sharedGrants: new Map(),
      lost: yield* Queue.unbounded<Holder>(),
      hints: makeHints(yield* PubSub.sliding<Hint>(64), (hint) => engine.permitHint(hint)),
      permitHint: () => {},
      owner,
      clock: yield* Effect.clock,
      closing: false,
      watchdogArmed: false,
      nextSessionId: 0,
      openingWait: 0,
      homeOpening: undefined
    }

    // Lost leases are told from a fiber: the driver's events arrive outside any fiber. The layer's
    // work, on its owner (interruptible whatever the builder's region; stopped when the layer closes).
    yield* owner.fork(
      Effect.forever(
        Effect.flatMap(Queue.take(engine.lost), (holder) => holder.handed ? holder.onLost("connection-lost") : Effect.void)
      )
    )

    // Heartbeat: a dead idle session (network drop, frozen backend, server restart without a FIN)
    // is noticed within interval + timeout and its leases are told. Busy sessions are covered by
    // the bound on their own statements, wait sessions by their slices.
    const heartbeat = Effect.suspend(() =>
      Effect.forEach(
        engine.sessions.filter((s) => s.state === "open" && !s.waiting && s.pending === 0),
        (session) => statement(engine, session, HEARTBEAT_SQL, undefined, options.heartbeatTimeoutMillis),
        { concurrency: "unbounded", discard: true }
      )
    )
    yield* owner.fork(Effect.repeat(heartbeat, Schedule.spaced(Duration.millis(options.heartbeatIntervalMillis))))

    // Idle lock names' fencing rows, on the home session (never blocking: rows locked elsewhere are
    // skipped), in small rounds so a release queued behind one waits little; failures wait for the next pass.
    const sweepRound = (text: string) =>
      Effect.suspend(() => {
        const session = engine.sessions.find((s) => s.role === "home" && s.state === "open")
        if (session === undefined) return Effect.succeed(0)
        return Effect.map(
          statement(engine, session, text, [SWEEP_LIMIT]),
          (settled) => (settled._tag === "Ok" ? Number(settled.rows[0]?.["swept"] ?? 0) : 0)
        )
      })
    const sweepPass = (text: string) => Sweep.rounds(sweepRound(text), SWEEP_LIMIT, SWEEP_MAX_ROUNDS)

    yield* Effect.addFinalizer(() =>
      Effect.gen(function*() {
        // Holders still alive were already told and released by DistributedLock's own close,
        // which runs before this finalizer; what is left here is ending the sessions.
        engine.closing = true
        const open = engine.sessions.slice()
        // A graceful goodbye ends the backends (and their locks) at once; a stuck one is destroyed.
        yield* Effect.forEach(open, (s) => within(driver.end(s.client), CLOSE_TIMEOUT_MS), {
          concurrency: "unbounded",
          discard: true
        })
        for (const session of open) {
          session.grants.clear()
          markDead(engine, session)
        }
      })
    )

    // ---------------------------------------------------------------- build-time checks

    const home = yield* open(engine, "home")
    yield* adopt(engine, home)
    const permitsUnavailable = yield* ensureFencingTable(engine, (text, values) => statement(engine, home, text, values))
    // Both sweeps read the semaphore columns: a table without them (createTables: false, an old
    // migration) is not swept until migration() has been re-run.
    if (options.sweepIntervalMillis > 0 && permitsUnavailable === undefined) {
      const pass = Effect.zipRight(sweepPass(sweepSql(options.fencingTable)), sweepPass(permitSweepSql(options.fencingTable)))
      // Each pass after a (jittered) interval, the first too: a sweep in flight makes the home
      // session busy, and a busy session's loss is noticed by its statement bound, not the heartbeat.
      yield* Sweep.every(Duration.millis(options.sweepIntervalMillis), pass, owner)
    }

    // Hashing a name (SHA-256) costs more than the rest of an uncontended acquire's CPU work:
    // names are few and reused, so their keys are remembered (up to a bound).
    const keys = new Map<string, { readonly key: bigint; readonly keyText: string }>()
    const keyOf = (name: string) => {
      let found = keys.get(name)
      if (found === undefined) {
        if (keys.size >= KEY_CACHE_SIZE) keys.clear()
        const key = advisoryKey(name, options.namespace)
        found = { key, keyText: key.toString() }
        keys.set(name, found)
      }
      return found
    }

    /**
     * After admission: an exclusive request's first try on the uncontended path (no generator, no
     * scope), then the loop; the admission is left again unless a grant holds it.
     */
    const admitted = (request: AcquireRequest, key: bigint, keyText: string, admission: Admission): Effect.Effect<AcquireResult<Grant>, LockBackendError> => {
      const loop = (afterBusyTry: boolean) =>
        grantLoop(engine, request, key, keyText, admission, afterBusyTry).pipe(
          Effect.onExit((exit) => Exit.isSuccess(exit) && exit.value._tag === "Granted" ? Effect.void : engine.local.leave(admission, false))
        )
      if (request.mode !== "exclusive") return loop(false)
      // `Effect.onError` by hand, its clean-up uninterruptible (no mask where the caller already is, `runtime/mask`).
      return uninterruptibleMask((restore) =>
        Effect.matchCauseEffect(restore(firstTry(engine, request, key, keyText, admission)), {
          onFailure: (cause) => Effect.zipRight(engine.local.leave(admission, false), Effect.failCause(cause)),
          onSuccess: (first): Effect.Effect<AcquireResult<Grant>, LockBackendError> => {
            if (first._tag === "Granted") return Effect.succeed(first)
            if (first._tag !== "Retry" && (first._tag !== "Busy" || request.attempt === "once")) {
              return Effect.as(engine.local.leave(admission, false), first)
            }
            return restore(loop(first._tag === "Busy"))
          }
        })
      )
    }

    const acquire = (request: AcquireRequest): Effect.Effect<AcquireResult<Grant>, LockBackendError> =>
      Effect.suspend(() => {
        const { key, keyText } = keyOf(request.name)
        // Admitted in this step when nothing local stands in the way and nobody is queued.
        const now = request.attempt === "once" ? engine.local.tryAdmitNow(keyText, request.mode) : engine.local.admitNow(keyText, request.mode)
        if (now !== undefined) return admitted(request, key, keyText, now)
        if (request.attempt === "once") return Effect.succeed(Busy)
        return Effect.flatMap(engine.local.queue(keyText, request.mode, request.waitUntilDeadline), (admission) =>
          Option.isNone(admission) ? Effect.succeed(TimedOut) : admitted(request, key, keyText, admission.value))
      })

    // The clock every replica shares, read on an open session that is not waiting: schedules
    // compare occurrence times on it.
    const now = Effect.suspend(() => {
      const session = engine.sessions.find((s) => s.state === "open" && !s.waiting)
      if (session === undefined) {
        return Effect.fail(new LockBackendError({ operation: "now", cause: new Error("no open lock session") }))
      }
      return Effect.flatMap(statement(engine, session, NOW_SQL), (settled) =>
        settled._tag === "Ok" && settled.rows[0] !== undefined
          ? Effect.succeed(Number(settled.rows[0]["now"]))
          : Effect.fail(new LockBackendError({ operation: "now", cause: new Error(`reading the server's clock: ${settled._tag}`) })))
    })

    return {
      backend: BACKEND,
      now,
      maxNameBytes: 1024,
      defaultTtl: Duration.seconds(30),
      minTtl: Duration.seconds(1),
      renewBatchSize: 1,
      semaphore: makePermitBackend(engine, {
        homeSession: (request) => homeSession(engine, request),
        shuttingDown,
        unavailable: permitsUnavailable
      }),
      acquire,
      // Session locks need no renewal; the core never calls this for grants without validUntil.
      renew: () => Effect.succeed([])
    }
  })

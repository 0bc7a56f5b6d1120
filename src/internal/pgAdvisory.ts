/**
 * The PostgreSQL session advisory-lock backend.
 *
 * Sessions
 * --------
 * Locks live on raw `pg.Client` sessions this module owns, never on a pool connection (a pool
 * recycles a connection with its session locks still on it). There are at most `maxSessions`:
 *
 * - one **home** session, which never runs a blocking statement. It takes uncontended locks,
 *   runs releases and heartbeats, and LISTENs for release notifications;
 * - up to `maxSessions - 1` **wait** sessions. A blocking `pg_advisory_lock` runs only on a wait
 *   session that holds nothing, has nothing in flight and no try-lock whose outcome is still
 *   unrecorded (`claims`; a try-lock claims its session in the same synchronous step that selects
 *   it, and a wait reserves one in the step that finds it free). When the wait is granted the lock
 *   stays there, and that session then serves try-locks and releases like the home session until
 *   it holds nothing again.
 *
 * That is the rule answering "a release must never wait behind another lock's blocked wait":
 * **a session blocked in a lock wait holds no lock**. No release is ever routed to it, nothing
 * else is sent to it while it waits, and since a waiting backend holds nothing, two processes'
 * waits can never form a deadlock cycle. (The interruption fuzz test samples pg_locks for it.)
 *
 * Granting
 * --------
 * An uncontended request is one `pg_try_advisory_lock` plus the fencing bump, in one statement.
 * Tries that queue behind a session's running statement are sent together as one statement
 * (`unnest` of keys), so concurrent grants share one commit and one WAL flush; a try still
 * queued can be taken back when its caller is interrupted or out of time. 1,000 locks fit on one
 * session.
 *
 * Waiting
 * -------
 * A contended request reserves a free wait session and blocks in PostgreSQL, which hands the
 * lock over the moment the holder lets go. `SET LOCAL lock_timeout` in the same simple-protocol
 * round trip bounds the wait by the caller's deadline (55P03: not granted), and the fencing bump
 * follows the grant in that round trip. When no wait session is free and no more may be opened,
 * the request waits in-process for one to come free, for a release notification on its key
 * (every release sends `pg_notify`), or — since notifications are hints that a crashed holder
 * never sends — a slow fallback re-try; always bounded by its deadline.
 *
 * Interruption
 * ------------
 * An interrupted blocking wait is cancelled with a protocol CancelRequest (pid + secret key on a
 * throw-away socket), then its outcome is awaited for a bounded time. Whatever it was — not
 * granted, or granted in the race — `pg_advisory_unlock_all()` proves the session clean, which is
 * exact because a waiting session held nothing else (should it hold anything else after all, it
 * is destroyed instead, so no lock is dropped silently). No answer: the session is destroyed (the
 * server then drops its locks; `client_connection_check_interval` makes it notice promptly).
 * Every other statement runs uninterruptibly once sent, and is bounded; a statement without an
 * answer destroys its session.
 *
 * Re-entrancy
 * -----------
 * PostgreSQL grants a key twice to one session. `localKeys` admits, per key, one exclusive
 * request at a time, or one fresh shared request at a time; later shared requests join the
 * shared grant this process holds (a reference count, each with its own fencing token). So no
 * session ever holds a key twice, and a failed grant statement is undone by a single unlock.
 *
 * Release and loss
 * ----------------
 * A release unlocks with a bounded wait; unless the unlock returned true and the session is idle
 * afterwards, the session is destroyed and every other lease on it is told `connection-lost`.
 * A session that dies ('error'/'end' events, a heartbeat without answer) tells every lease on it —
 * only leases handed to the core: an attempt that failed and was retried (a shared join whose
 * bump died with its session) reports nothing, so the retry's fresh grant is not condemned.
 */
import { monotonicMillis } from "./clock.js"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import * as Scope from "effect/Scope"
import type pg from "pg"
import * as FencingToken from "../FencingToken.js"
import type { LockMode } from "../Lease.js"
import type { AcquireRequest, AcquireResult, Grant, LockBackend } from "../LockBackend.js"
import { LockBackendError, type LostReason, UnsafeConnectionPooling } from "../LockError.js"
import { type Admission, makeLocalKeys } from "./localKeys.js"
import { advisoryKey } from "./lockKey.js"
import * as metrics from "./metrics.js"
import * as driver from "./pgDriver.js"
import { CATALOG_RACE, CREATE_ATTEMPTS, ensureTableSql, type TableRef } from "./sqlTable.js"

/** Short backend name for spans and metrics. */
export const BACKEND = "pg-advisory"
/** Channel of release notifications; the payload is the key in decimal. */
export const CHANNEL = "effect_lock_released"

/** Bound on a statement that never waits for a lock (grant attempt, bump, unlock, cleanup). */
const STATEMENT_TIMEOUT_MS = 5_000
/** Bound on delivering a CancelRequest. */
const CANCEL_SEND_TIMEOUT_MS = 1_000
/** Bound on the outcome of a cancelled wait; past it the session is destroyed. */
const CANCEL_OUTCOME_TIMEOUT_MS = 2_000
/** How long past its lock_timeout a wait may stay unanswered before the session is presumed dead. */
const WAIT_GRACE_MS = 5_000
/** Re-try interval of a request that waits on notifications only (all wait sessions in use). */
const FALLBACK_RETRY_MS = 1_000
/** Stray cancels can hit the clean-up statement; it is idempotent, so it is re-run a few times. */
const CLEANUP_ATTEMPTS = 3
/** Bound on closing a session gracefully at shutdown before its socket is destroyed. */
const CLOSE_TIMEOUT_MS = 2_000
/** Serializes creation of the fencing table across processes (a transaction advisory lock). */
const DDL_NAMESPACE = "effect-lock/PgAdvisory/ddl"
/** Settings of every lock session (those the server does not know are skipped). */
const SESSION_SETTINGS: ReadonlyArray<readonly [string, string]> = [
  // Fencing tokens must never repeat or go backwards, even across a server crash: every bump's
  // commit waits for its WAL flush, whatever the server, database or role default says (with
  // `off`, a crash could lose bumps that were already handed out as tokens).
  ["synchronous_commit", "on"],
  // These let the server drop a destroyed client's queued wait promptly.
  ["client_connection_check_interval", "500"],
  ["tcp_keepalives_idle", "5"],
  ["tcp_keepalives_interval", "2"],
  ["tcp_keepalives_count", "3"],
  // Heartbeats keep sessions busy enough, but a server-wide idle timeout would drop held locks.
  ["idle_session_timeout", "0"]
]

/** Resolved options. */
export interface BackendOptions {
  readonly connect: driver.ConnectConfig
  readonly explicitApplicationName: boolean
  readonly maxSessions: number
  readonly namespace: string
  readonly fencingTable: TableRef
  readonly heartbeatIntervalMillis: number
  readonly heartbeatTimeoutMillis: number
}

/** Session locks need nothing beyond the SPI's grant (no renewal, no validity deadline). */
export type AdvisoryGrant = Grant

interface Session {
  readonly id: number
  readonly role: "home" | "wait"
  readonly client: pg.Client
  state: "open" | "dead"
  /** In a blocking lock wait (or its clean-up): nothing else may be sent to it. */
  waiting: boolean
  inflight: number
  /**
   * Try-locks whose outcome is not yet recorded (or undone): the session may hold a lock nobody
   * has written down yet, so it must not be reserved for a blocking wait.
   */
  claims: number
  /** Settles when the last statement sent has settled. */
  tail: Promise<void>
  /** Try-locks queued behind the current statement, to be sent together. */
  openBatch: TryBatch | undefined
  readonly grants: Set<ServerGrant>
}

/** One lock the server granted to one session. */
interface ServerGrant {
  readonly key: bigint
  readonly keyText: string
  readonly mode: LockMode
  readonly session: Session
  readonly holders: Set<Holder>
  /** Unlocked, being unlocked, or gone with its session: no one may join it. */
  closed: boolean
}

/** One lease handed to the core. Shared holders of one key may share a ServerGrant. */
interface Holder {
  readonly grant: ServerGrant
  readonly admission: Admission
  readonly onLost: (reason: LostReason) => Effect.Effect<void>
  state: "held" | "lost" | "released"
  /**
   * Handed to the core in a `Granted` result. Only then is its loss reported: a holder of an
   * attempt that failed (and was retried) stands for no lease, and reporting its loss would
   * condemn the fresh grant of a later attempt of the same request.
   */
  handed: boolean
}

type Settled =
  | { readonly _tag: "Ok"; readonly result: pg.QueryResult }
  | { readonly _tag: "Failed"; readonly failure: driver.StatementFailure }
  | { readonly _tag: "NoAnswer" }

interface Statement {
  readonly text: string
  readonly values?: ReadonlyArray<unknown> | undefined
}

interface TryItem {
  readonly keyText: string
  readonly name: string
  readonly mode: LockMode
  dropped: boolean
}

interface TryBatch {
  readonly items: Array<TryItem>
  readonly sent: Sent
}

/**
 * Failures worth another try: a stray cancel (57014), a deadlock or serialization failure on a
 * fencing row (40P01, 40001).
 */
const TRANSIENT = new Set(["57014", "40P01", "40001"])

const compareKeys = (a: string, b: string): number => {
  const x = BigInt(a)
  const y = BigInt(b)
  return x < y ? -1 : x > y ? 1 : 0
}

const EMPTY_RESULT = { command: "SELECT", rowCount: 0, oid: 0, fields: [], rows: [] } as unknown as pg.QueryResult

/** Release notifications seen for one key, and a signal fired on each. */
interface KeyHint {
  readonly signal: Signal
  refs: number
  releases: number
}

interface Sent {
  /** Resolves when the statement is handed to the driver. */
  readonly started: Promise<void>
  /** Never rejects. */
  readonly settled: Promise<Settled>
  /** Takes the statement back if it has not started; true when it did. */
  readonly unqueue: () => boolean
}

type Step =
  | AcquireResult<AdvisoryGrant>
  | { readonly _tag: "Retry" }

const Busy = { _tag: "Busy" } as const
const TimedOut = { _tag: "TimedOut" } as const
const Retry = { _tag: "Retry" } as const

/** A one-shot broadcast: waiters take the current Deferred, `fire` completes it and starts a new one. */
class Signal {
  private deferred = Deferred.unsafeMake<void>(FiberId.none)
  current(): Deferred.Deferred<void> {
    return this.deferred
  }
  fire(): void {
    const previous = this.deferred
    this.deferred = Deferred.unsafeMake<void>(FiberId.none)
    Deferred.unsafeDone(previous, Exit.void)
  }
}

/** True when `promise` settles within `ms`; the timer is cleared either way, so it never holds the process open. */
const settlesWithin = (promise: Promise<unknown>, ms: number): Promise<boolean> => {
  let timer: NodeJS.Timeout | undefined
  return Promise.race([
    promise.then(() => true, () => true),
    new Promise<boolean>((resolve) => {
      timer = setTimeout(() => resolve(false), ms)
    })
  ]).finally(() => clearTimeout(timer))
}

const within = (promise: Promise<Settled>, ms: number): Promise<Settled> => {
  let timer: NodeJS.Timeout | undefined
  return Promise.race([
    promise,
    new Promise<Settled>((resolve) => {
      timer = setTimeout(() => resolve({ _tag: "NoAnswer" }), ms)
    })
  ]).finally(() => clearTimeout(timer))
}

/** Waits for a promise that never rejects; uninterruptible unless the caller wraps it. */
const awaitSettled = (promise: Promise<Settled>): Effect.Effect<Settled> =>
  Effect.async<Settled>((resume) => {
    promise.then((settled) => resume(Effect.succeed(settled)))
  })

const sqlCode = (settled: Settled): string | undefined =>
  settled._tag === "Failed" && settled.failure._tag === "Sql" ? settled.failure.code : undefined

/**
 * Builds the backend: connects the home session, refuses connections without session affinity,
 * creates the fencing table if needed, and starts the heartbeat and loss-notification fibers.
 * Closing the scope closes every session (the server drops their locks).
 */
export const make = (
  options: BackendOptions
): Effect.Effect<LockBackend<AdvisoryGrant>, UnsafeConnectionPooling | LockBackendError, Scope.Scope> =>
  Effect.gen(function*() {
    const scope = yield* Effect.scope
    const clientConfig = driver.clientConfig(options.connect, options.explicitApplicationName)
    const table = options.fencingTable.sql
    const local = makeLocalKeys()
    const sessions: Array<Session> = []
    const sharedGrants = new Map<string, ServerGrant>()
    const keySignals = new Map<string, KeyHint>()
    const sessionsChanged = new Signal()
    const lostQueue = yield* Queue.unbounded<Holder>()
    let nextSessionId = 0
    let openingWait = 0
    let homeOpening: Deferred.Deferred<void, LockBackendError> | undefined
    let closing = false

    // ---------------------------------------------------------------- sessions

    const markDead = (session: Session): void => {
      if (session.state === "dead") return
      session.state = "dead"
      const index = sessions.indexOf(session)
      if (index >= 0) sessions.splice(index, 1)
      for (const grant of session.grants) {
        grant.closed = true
        if (sharedGrants.get(grant.keyText) === grant) sharedGrants.delete(grant.keyText)
        for (const holder of grant.holders) {
          if (holder.state !== "held") continue
          holder.state = "lost"
          Queue.unsafeOffer(lostQueue, holder)
        }
      }
      session.grants.clear()
      driver.destroy(session.client)
      sessionsChanged.fire()
    }

    /** Destroys a session whose state cannot be proven: the server drops whatever it held. */
    const kill = (session: Session, reason: string): Effect.Effect<void> =>
      Effect.suspend(() => {
        if (session.state === "dead") return Effect.void
        const keys = Array.from(session.grants, (grant) => grant.keyText)
        markDead(session)
        // At shutdown every session is being ended on purpose: nothing to report.
        if (closing) return Effect.void
        return metrics.sessionDestroyed(BACKEND).pipe(
          Effect.zipRight(
            Effect.logWarning(`destroyed a lock session (${reason}); the server drops the ${keys.length} lock(s) it held`).pipe(
              Effect.annotateLogs({ "lock.session": session.id, "lock.keys": keys.join(","), reason })
            )
          )
        )
      })

    /**
     * Queues a statement behind the session's previous ones (one in flight per client, as
     * node-pg wants); `inflight` counts queued and running statements. Until it starts, a
     * statement can be taken back (`unqueue`) with no effect on the server.
     */
    const enqueue = (session: Session, statement: string | (() => Statement | undefined), values?: ReadonlyArray<unknown>): Sent => {
      if (session.state !== "open") {
        const closed: Settled = { _tag: "Failed", failure: { _tag: "Connection", error: new Error("session closed") } }
        return { started: Promise.resolve(), settled: Promise.resolve(closed), unqueue: () => false }
      }
      let phase: "queued" | "started" | "dropped" = "queued"
      let markStarted: () => void = () => {}
      const started = new Promise<void>((resolve) => {
        markStarted = resolve
      })
      session.inflight += 1
      const run = () => {
        if (phase === "dropped") return Promise.reject(new Error("taken back before it was sent"))
        phase = "started"
        markStarted()
        if (session.state !== "open") return Promise.reject(new Error("session closed"))
        // A lazy statement is built when its turn comes (a batch closes then); none: nothing to send.
        const built = typeof statement === "string" ? { text: statement, values } : statement()
        return built === undefined
          ? Promise.resolve(EMPTY_RESULT)
          : driver.query(session.client, built.text, built.values)
      }
      const settled = session.tail.then(run).then(
        (result): Settled => {
          const last = driver.lastResult(result)
          return last === undefined
            ? { _tag: "Failed", failure: { _tag: "Connection", error: new Error("no result") } }
            : { _tag: "Ok", result: last }
        },
        (error): Settled => ({ _tag: "Failed", failure: driver.classify(error) })
      ).finally(() => {
        session.inflight -= 1
        if (isFreeWaitSession(session)) sessionsChanged.fire()
      })
      session.tail = settled.then(() => undefined)
      return {
        started,
        settled,
        unqueue: () => {
          if (phase !== "queued") return false
          phase = "dropped"
          return true
        }
      }
    }

    const send = (session: Session, text: string, values?: ReadonlyArray<unknown>): Promise<Settled> =>
      enqueue(session, text, values).settled

    /** The outcome of a sent statement, bounded from the moment it started. */
    const outcome = (session: Session, sent: Sent, timeoutMillis = STATEMENT_TIMEOUT_MS): Effect.Effect<Settled> =>
      awaitSettled(sent.started.then(() => within(sent.settled, timeoutMillis))).pipe(
        Effect.tap((settled) =>
          settled._tag === "NoAnswer" || (settled._tag === "Failed" && settled.failure._tag === "Connection")
            ? kill(session, settled._tag === "NoAnswer" ? "a statement got no answer in time" : "its connection failed")
            : Effect.void
        )
      )

    /** A bounded statement; a session that did not answer or lost its connection is destroyed. */
    const statement = (
      session: Session,
      text: string,
      values?: ReadonlyArray<unknown>,
      timeoutMillis = STATEMENT_TIMEOUT_MS
    ): Effect.Effect<Settled> => Effect.suspend(() => outcome(session, enqueue(session, text, values), timeoutMillis))

    const onNotification = (channel: string, payload: string | undefined) => {
      if (channel !== CHANNEL || payload === undefined) return
      const hint = keySignals.get(payload)
      if (hint === undefined) return
      hint.releases += 1
      hint.signal.fire()
    }

    const setupSql = (role: Session["role"]) => {
      const values = SESSION_SETTINGS.map(([name, value]) => `(${driver.literal(name)}, ${driver.literal(value)})`)
      const settings = `select set_config(v.name, v.value, false) from (values ${values.join(", ")}) as v(name, value) ` +
        `where exists (select 1 from pg_settings s where s.name = v.name)`
      return role === "home" ? `${settings}; LISTEN ${driver.identifier(CHANNEL)}` : settings
    }

    const openSession = (role: Session["role"]): Effect.Effect<Session, LockBackendError> =>
      Effect.tryPromise({
        try: async () => {
          let session: Session | undefined
          const client = await driver.connect(clientConfig, {
            onClosed: () => {
              if (session !== undefined) markDead(session)
            },
            ...(role === "home" ? { onNotification } : {})
          })
          try {
            const setup = driver.query(client, setupSql(role))
            const answered = await settlesWithin(setup, options.connect.connectTimeoutMillis)
            if (!answered) throw new Error(`the session setup got no answer within ${options.connect.connectTimeoutMillis} ms`)
            await setup
          } catch (error) {
            driver.destroy(client)
            throw error
          }
          session = {
            id: nextSessionId++,
            role,
            client,
            state: "open",
            waiting: false,
            inflight: 0,
            claims: 0,
            tail: Promise.resolve(),
            openBatch: undefined,
            grants: new Set()
          }
          return session
        },
        catch: (cause) => new LockBackendError({ operation: "connect", cause })
      })

    /** Adds a freshly opened session to the pool, unless the layer closed meanwhile. */
    const adopt = (session: Session): Effect.Effect<void> =>
      Effect.sync(() => {
        if (closing || session.state === "dead") {
          markDead(session)
          return
        }
        sessions.push(session)
        sessionsChanged.fire()
      })

    const waitSessionCount = () => sessions.filter((s) => s.role === "wait").length

    /**
     * A wait session that may be reserved for a blocking wait: it holds nothing and has nothing
     * in flight (an in-flight try-lock could still add a grant to it).
     */
    function isFreeWaitSession(session: Session): boolean {
      return session.role === "wait" && session.state === "open" && !session.waiting && session.inflight === 0 &&
        session.claims === 0 && session.grants.size === 0
    }

    /** Starts opening the home session (once) and returns the signal of its outcome. */
    const openHome = (): Effect.Effect<Deferred.Deferred<void, LockBackendError>> =>
      Effect.suspend(() => {
        if (homeOpening !== undefined) return Effect.succeed(homeOpening)
        const done = Deferred.unsafeMake<void, LockBackendError>(FiberId.none)
        homeOpening = done
        return openSession("home").pipe(
          Effect.tap(adopt),
          Effect.onExit((exit) =>
            Effect.sync(() => {
              homeOpening = undefined
              Deferred.unsafeDone(done, Exit.asVoid(exit))
            })
          ),
          Effect.ignore,
          // Uninterruptible: a client that finishes connecting is always adopted or closed.
          Effect.uninterruptible,
          Effect.forkIn(scope),
          Effect.as(done)
        )
      })

    /** Starts opening one wait session if there is room; its outcome arrives as `done`. */
    const openWait = (): Effect.Effect<Option.Option<Deferred.Deferred<void, LockBackendError>>> =>
      Effect.suspend(() => {
        // One slot is always left for the home session.
        if (closing || waitSessionCount() + openingWait >= options.maxSessions - 1) return Effect.succeedNone
        const done = Deferred.unsafeMake<void, LockBackendError>(FiberId.none)
        openingWait += 1
        return openSession("wait").pipe(
          Effect.tap(adopt),
          Effect.onExit((exit) =>
            Effect.sync(() => {
              openingWait -= 1
              Deferred.unsafeDone(done, Exit.asVoid(exit))
            })
          ),
          Effect.ignore,
          Effect.uninterruptible,
          Effect.forkIn(scope),
          Effect.as(Option.some(done))
        )
      })

    const shuttingDown = (name: string) =>
      new LockBackendError({ operation: "acquire", name, cause: new Error("the PgAdvisory layer is shutting down") })

    /**
     * A session for a statement that never blocks, **claimed** for one try-lock (see
     * `Session.claims`; `tryGrant` gives the claim back): the home session or a wait session that
     * already holds a lock, the least busy one. Empty wait sessions stay free for waits (grants
     * need no spreading for throughput: concurrent tries on one session share one statement).
     * Opens the home session if it is gone (it also carries the LISTEN).
     */
    const fastPathSession = (request: AcquireRequest): Effect.Effect<Option.Option<Session>, LockBackendError> =>
      Effect.gen(function*() {
        while (true) {
          if (closing) return yield* shuttingDown(request.name)
          const opening = sessions.some((session) => session.role === "home") ? undefined : yield* openHome()
          // Selected and claimed in one synchronous step: between two Effect steps another fiber
          // may run, release the session's last grant and reserve it for a blocking wait, which
          // this try would then queue behind (and whose clean-up would drop this try's grant).
          let best: Session | undefined
          for (const session of sessions) {
            if (session.state !== "open" || session.waiting) continue
            if (session.role === "wait" && session.grants.size === 0) continue
            if (best === undefined || session.inflight < best.inflight) best = session
          }
          if (best !== undefined) {
            best.claims += 1
            return Option.some(best)
          }
          const done = opening ?? (yield* openHome())
          const outcome = yield* request.waitUntilDeadline(Deferred.await(done))
          if (Option.isNone(outcome)) return Option.none()
        }
      })

    // ---------------------------------------------------------------- statements

    const suffix = (mode: LockMode) => (mode === "shared" ? "_shared" : "")

    /**
     * Try-locks a batch of keys and bumps the fencing counter of each key granted, in one
     * statement and one commit: concurrent grants on a session share a WAL flush.
     */
    const tryBatchSql =
      `with request as (select * from unnest($1::bigint[], $2::text[], $3::boolean[]) as r(key, name, shared)), ` +
      `attempt as (select key, name, case when shared then pg_try_advisory_lock_shared(key) ` +
      `else pg_try_advisory_lock(key) end as granted from request) ` +
      `insert into ${table} as f (key, name, token) select key, name, 1 from attempt where granted ` +
      `on conflict (key) do update set token = f.token + 1, name = excluded.name ` +
      `returning f.key::text as key, f.token::text as token`

    /**
     * Queues a try-lock of one key on a session. Tries queued behind the session's current
     * statement join one batch, sent as a single statement when its turn comes; until then each
     * can be taken back. The handle's result holds this key's row only (none: busy).
     */
    const enqueueTry = (session: Session, keyText: string, name: string, mode: LockMode): Sent => {
      let batch = session.openBatch
      if (batch === undefined) {
        const items: Array<TryItem> = []
        const opened: TryBatch = {
          items,
          sent: enqueue(session, () => {
            if (session.openBatch === opened) session.openBatch = undefined
            // Key order: concurrent batches (other processes' too) lock fencing rows in one order.
            const live = items.filter((item) => !item.dropped).sort((a, b) => compareKeys(a.keyText, b.keyText))
            if (live.length === 0) return undefined
            return {
              text: tryBatchSql,
              values: [live.map((i) => i.keyText), live.map((i) => i.name), live.map((i) => i.mode === "shared")]
            }
          })
        }
        session.openBatch = opened
        batch = opened
      }
      const item: TryItem = { keyText, name, mode, dropped: false }
      batch.items.push(item)
      const sent = batch.sent
      return {
        started: sent.started,
        settled: sent.settled.then((settled): Settled =>
          settled._tag === "Ok"
            ? { _tag: "Ok", result: { ...settled.result, rows: settled.result.rows.filter((row) => row.key === keyText) } }
            : settled
        ),
        unqueue: () => {
          if (session.openBatch !== batch) return false
          item.dropped = true
          return true
        }
      }
    }

    const bumpSql = `insert into ${table} as f (key, name, token) values ($1::bigint, $2::text, 1) ` +
      `on conflict (key) do update set token = f.token + 1, name = excluded.name returning f.token::text as token`

    /** One simple-protocol round trip: bounded wait, grant, bump. Aborts as a whole on 55P03. */
    const waitSql = (key: bigint, name: string, mode: LockMode, lockTimeoutMillis: number) =>
      [
        `SET LOCAL lock_timeout = ${lockTimeoutMillis}`,
        `SET LOCAL statement_timeout = 0`,
        `SELECT pg_advisory_lock${suffix(mode)}('${key}'::bigint)`,
        `SET LOCAL lock_timeout TO DEFAULT`,
        `INSERT INTO ${table} AS f (key, name, token) VALUES ('${key}'::bigint, ${driver.literal(name)}, 1) ` +
        `ON CONFLICT (key) DO UPDATE SET token = f.token + 1, name = excluded.name RETURNING f.token::text AS token`
      ].join("; ")

    const unlockSql = (mode: LockMode) =>
      `select pg_advisory_unlock${suffix(mode)}($1::bigint) as released, pg_notify($2, $3)`

    const tokenOf = (settled: Settled): FencingToken.FencingToken | undefined => {
      if (settled._tag !== "Ok") return undefined
      const raw = settled.result.rows[0]?.token
      return typeof raw === "string" ? FencingToken.make(BigInt(raw)) : undefined
    }

    // ---------------------------------------------------------------- grants and release

    /** Gives a grant back to the server once no holder uses it; destroys what it cannot prove. */
    const closeIfUnused = (grant: ServerGrant): Effect.Effect<void> =>
      Effect.gen(function*() {
        if (grant.holders.size > 0 || grant.closed) return
        grant.closed = true
        if (sharedGrants.get(grant.keyText) === grant) sharedGrants.delete(grant.keyText)
        const session = grant.session
        // The lock died with its session; there is nothing left to unlock.
        if (session.state !== "open") return
        const settled = yield* statement(session, unlockSql(grant.mode), [grant.keyText, CHANNEL, grant.keyText])
        const released = settled._tag === "Ok" && settled.result.rows[0]?.released === true
        if (!released || !driver.isIdle(session.client)) {
          // The unlock is unproven: the session (and any other lock on it) is destroyed, never reused.
          yield* kill(session, "an unlock was not proven")
          return
        }
        session.grants.delete(grant)
        if (session.role === "wait" && session.grants.size === 0) sessionsChanged.fire()
      })

    const release = (holder: Holder): Effect.Effect<void> =>
      Effect.gen(function*() {
        if (holder.state === "released") return
        holder.state = "released"
        holder.grant.holders.delete(holder)
        yield* closeIfUnused(holder.grant)
        yield* local.leave(holder.admission, true)
      }).pipe(Effect.uninterruptible)

    /**
     * Records a grant the server just made on `session`, or reports that it died with it.
     * `fromWait`: the grant ends the session's blocking wait (a try-lock never leaves a wait).
     */
    const recordGrant = (
      session: Session,
      key: bigint,
      keyText: string,
      token: FencingToken.FencingToken,
      request: AcquireRequest,
      admission: Admission,
      fromWait: boolean
    ): Effect.Effect<Step> =>
      Effect.suspend(() => {
        // The session died after granting: the lock went with it.
        if (session.state !== "open") return Effect.succeed(Retry)
        const grant: ServerGrant = { key, keyText, mode: request.mode, session, holders: new Set(), closed: false }
        // In the same synchronous step as leaving a wait: a session is never seen free while it holds this.
        session.grants.add(grant)
        if (fromWait) session.waiting = false
        if (request.mode === "shared") sharedGrants.set(keyText, grant)
        return attach(grant, token, admission, newHolder(grant, request, admission))
      })

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
    const attach = (
      grant: ServerGrant,
      token: FencingToken.FencingToken,
      admission: Admission,
      holder: Holder
    ): Effect.Effect<Step> =>
      Effect.suspend((): Effect.Effect<Step> => {
        if (grant.closed || holder.state !== "held") {
          grant.holders.delete(holder)
          return Effect.succeed(Retry)
        }
        holder.handed = true
        grant.holders.add(holder)
        return Effect.as(local.granted(admission), {
          _tag: "Granted",
          grant: { token, validUntil: Option.none(), release: release(holder) }
        } as const)
      })

    /** Shared mode: joins the shared grant this process already holds, with a fresh token. */
    const joinShared = (
      request: AcquireRequest,
      keyText: string,
      admission: Admission
    ): Effect.Effect<Step | undefined, LockBackendError> =>
      Effect.gen(function*() {
        const grant = sharedGrants.get(keyText)
        if (grant === undefined || grant.closed || grant.session.state !== "open") return undefined
        // Registered before the bump so that a concurrent release of the last holder keeps the lock;
        // not handed out until the bump succeeds, so a loss meanwhile is not reported (see `handed`).
        const holder = newHolder(grant, request, admission)
        grant.holders.add(holder)
        const settled = yield* statement(grant.session, bumpSql, [keyText, request.name])
        const token = tokenOf(settled)
        if (token !== undefined) return yield* attach(grant, token, admission, holder)
        grant.holders.delete(holder)
        yield* closeIfUnused(grant)
        if (settled._tag === "Failed" && settled.failure._tag === "Sql") {
          return yield* new LockBackendError({ operation: "acquire", name: request.name, cause: settled.failure.error })
        }
        return Retry
      })

    /** Undoes a grant statement that failed after the server answered. */
    const undoTry = (session: Session, keyText: string, mode: LockMode): Effect.Effect<void> =>
      Effect.gen(function*() {
        if (session.state !== "open") return
        const settled = yield* statement(session, `select pg_advisory_unlock${suffix(mode)}($1::bigint)`, [keyText])
        if (settled._tag !== "Ok" || !driver.isIdle(session.client)) yield* kill(session, "undoing a grant was not proven")
      })

    /** The try-lock statement started before an interruption could take it back: undo its grant. */
    const abandonTry = (session: Session, sent: Sent, keyText: string, mode: LockMode): Effect.Effect<void> =>
      Effect.gen(function*() {
        if (sent.unqueue()) return
        const settled = yield* outcome(session, sent)
        if (settled._tag === "Ok" && tokenOf(settled) === undefined) return
        if (settled._tag === "NoAnswer" || (settled._tag === "Failed" && settled.failure._tag === "Connection")) return
        yield* undoTry(session, keyText, mode)
      })

    /**
     * One try-lock + bump statement on a non-blocking session that `fastPathSession` claimed for
     * it; the claim is given back once the outcome is recorded or undone. Waiting for its turn on
     * the session is interruptible and bounded by the deadline (it is checkout, not the lock);
     * once sent, the statement's outcome is awaited. A single attempt whose deadline has already
     * passed (`timeout <= 0`) still gets its turn: the attempt itself is what was asked for.
     */
    const tryGrant = (
      session: Session,
      request: AcquireRequest,
      key: bigint,
      keyText: string,
      admission: Admission
    ): Effect.Effect<Step, LockBackendError> =>
      tryGrantClaimed(session, request, key, keyText, admission).pipe(
        Effect.ensuring(Effect.sync(() => {
          session.claims -= 1
          if (isFreeWaitSession(session)) sessionsChanged.fire()
        }))
      )

    const tryGrantClaimed = (
      session: Session,
      request: AcquireRequest,
      key: bigint,
      keyText: string,
      admission: Admission
    ): Effect.Effect<Step, LockBackendError> =>
      Effect.gen(function*() {
        const sent = enqueueTry(session, keyText, request.name, request.mode)
        const now = yield* monotonicMillis
        const expired = Option.isSome(request.deadline) && request.deadline.value <= now
        const turn = request.attempt === "once" && expired
          ? Effect.asSome(request.interruptible(Effect.promise(() => sent.started)))
          : request.waitUntilDeadline(Effect.promise(() => sent.started))
        const began = yield* turn.pipe(Effect.onInterrupt(() => abandonTry(session, sent, keyText, request.mode)))
        if (Option.isNone(began) && sent.unqueue()) return TimedOut
        const settled = yield* outcome(session, sent)
        if (settled._tag === "Ok") {
          const token = tokenOf(settled)
          if (token === undefined) return Busy
          return yield* recordGrant(session, key, keyText, token, request, admission, false)
        }
        // No answer / connection lost: the session was destroyed, any grant on it went with it.
        if (settled._tag === "NoAnswer" || settled.failure._tag === "Connection") return Retry
        // The server answered with an error, possibly after granting (the bump failed): undo.
        yield* undoTry(session, keyText, request.mode)
        if (TRANSIENT.has(settled.failure.code)) return Retry
        return yield* new LockBackendError({ operation: "acquire", name: request.name, cause: settled.failure.error })
      })

    // ---------------------------------------------------------------- blocking waits

    const freeWaitSession = (session: Session): Effect.Effect<void> =>
      Effect.sync(() => {
        session.waiting = false
        sessionsChanged.fire()
      })

    /**
     * Proves a wait session clean after a wait that ended without a usable grant. The session
     * held nothing before the wait, so `pg_advisory_unlock_all()` undoes exactly that wait's grant
     * if it happened. A stray cancel can hit this statement: it is idempotent, so run it again.
     *
     * Defence in depth: should the session hold (or be about to record) any other lock — a
     * recorded grant, or a try-lock whose outcome is not recorded yet — unlock_all would drop it
     * silently. Then the session is destroyed instead, so its leases are told `connection-lost`.
     */
    const cleanWaitSession = (session: Session): Effect.Effect<void> =>
      Effect.gen(function*() {
        const holdsOthers = () => session.grants.size > 0 || session.claims > 0
        for (let attempt = 0; attempt < CLEANUP_ATTEMPTS && session.state === "open" && !holdsOthers(); attempt++) {
          const settled = yield* statement(session, "select pg_advisory_unlock_all()")
          // Re-checked after: a grant recorded while the statement ran may have been dropped by it.
          if (settled._tag === "Ok" && driver.isIdle(session.client) && !holdsOthers()) {
            return yield* freeWaitSession(session)
          }
          if (sqlCode(settled) !== "57014") break
        }
        yield* kill(
          session,
          holdsOthers() ? "a wait session to clean up held other locks" : "a cancelled wait could not be proven clean"
        )
      })

    /** The wait was interrupted or went unanswered: cancel it at the server, then prove or destroy. */
    const abandonWait = (session: Session, pending: Promise<Settled>, peek: () => Settled | undefined) =>
      Effect.gen(function*() {
        let settled = peek()
        if (settled === undefined) {
          yield* Effect.promise(() => driver.sendCancel(session.client, CANCEL_SEND_TIMEOUT_MS))
          settled = yield* awaitSettled(within(pending, CANCEL_OUTCOME_TIMEOUT_MS))
        }
        if (settled._tag === "NoAnswer" || (settled._tag === "Failed" && settled.failure._tag === "Connection")) {
          // No outcome: the wait may still be granted later. Destroy the session; the server drops it.
          return yield* kill(session, "a cancelled wait gave no outcome")
        }
        // Not granted (57014), or granted in the race: either way unlock_all leaves it clean.
        yield* cleanWaitSession(session)
      })

    const blockingWait = (
      session: Session,
      request: AcquireRequest,
      key: bigint,
      keyText: string,
      admission: Admission
    ): Effect.Effect<Step, LockBackendError> =>
      Effect.gen(function*() {
        const now = yield* monotonicMillis
        const remaining = Option.map(request.deadline, (at) => at - now)
        if (Option.isSome(remaining) && remaining.value <= 0) {
          yield* freeWaitSession(session)
          return TimedOut
        }
        // lock_timeout 0 waits forever; otherwise the server gives up at the caller's deadline.
        const lockTimeout = Option.match(remaining, { onNone: () => 0, onSome: (ms) => Math.max(1, Math.ceil(ms)) })
        let outcome: Settled | undefined
        const pending = send(session, waitSql(key, request.name, request.mode, lockTimeout)).then((settled) => {
          outcome = settled
          return settled
        })
        const guarded = Option.match(remaining, {
          onNone: () => pending,
          onSome: (ms) => within(pending, ms + WAIT_GRACE_MS)
        })
        const settled = yield* request.interruptible(awaitSettled(guarded)).pipe(
          Effect.onInterrupt(() => abandonWait(session, pending, () => outcome))
        )
        switch (settled._tag) {
          case "Ok": {
            const token = tokenOf(settled)
            if (token === undefined) {
              yield* cleanWaitSession(session)
              return yield* new LockBackendError({
                operation: "acquire",
                name: request.name,
                cause: new Error("the grant statement returned no fencing token")
              })
            }
            return yield* recordGrant(session, key, keyText, token, request, admission, true)
          }
          case "NoAnswer": {
            yield* abandonWait(session, pending, () => outcome)
            return TimedOut
          }
          case "Failed": {
            if (settled.failure._tag === "Connection") {
              yield* kill(session, "its connection failed during a wait")
              return Retry
            }
            yield* cleanWaitSession(session)
            // 55P03: lock_timeout struck (the loop re-checks the deadline); the rest are transient.
            if (settled.failure.code === "55P03" || TRANSIENT.has(settled.failure.code)) return Retry
            return yield* new LockBackendError({ operation: "acquire", name: request.name, cause: settled.failure.error })
          }
        }
      })

    /** Release notifications for one key, for as long as the scope lasts. */
    const subscribe = (keyText: string): Effect.Effect<KeyHint, never, Scope.Scope> =>
      Effect.acquireRelease(
        Effect.sync(() => {
          let entry = keySignals.get(keyText)
          if (entry === undefined) {
            entry = { signal: new Signal(), refs: 0, releases: 0 }
            keySignals.set(keyText, entry)
          }
          entry.refs += 1
          return entry
        }),
        () =>
          Effect.sync(() => {
            const entry = keySignals.get(keyText)
            if (entry === undefined) return
            entry.refs -= 1
            if (entry.refs === 0) keySignals.delete(keyText)
          })
      )

    type Reservation = { readonly _tag: "Session"; readonly session: Session } | typeof TimedOut | typeof Retry

    /** A wait session that holds nothing, reserved for one blocking wait; or a reason to try again. */
    const reserveWaitSession = (
      request: AcquireRequest,
      hint: KeyHint,
      releasesBeforeTry: number
    ): Effect.Effect<Reservation, LockBackendError> =>
      Effect.gen(function*() {
        while (true) {
          if (closing) return yield* shuttingDown(request.name)
          const free = sessions.find(isFreeWaitSession)
          if (free !== undefined) {
            free.waiting = true
            return { _tag: "Session", session: free } as const
          }
          const changed = sessionsChanged.current()
          const opened = yield* openWait()
          if (Option.isSome(opened)) {
            const outcome = yield* request.waitUntilDeadline(Deferred.await(opened.value))
            if (Option.isNone(outcome)) return TimedOut
            continue
          }
          // Every wait session is busy or holds a lock: wait for one to come free, or for a hint
          // that this key was released (also one that arrived since the last try), then try again.
          if (hint.releases !== releasesBeforeTry) return Retry
          const woke = yield* request.waitUntilDeadline(
            Effect.raceAll([
              Effect.as(Deferred.await(changed), "changed" as const),
              Effect.as(Deferred.await(hint.signal.current()), "released" as const),
              Effect.as(Effect.sleep(Duration.millis(FALLBACK_RETRY_MS)), "released" as const)
            ])
          )
          if (Option.isNone(woke)) return TimedOut
          if (woke.value === "released") return Retry
        }
      })

    // ---------------------------------------------------------------- acquire

    const grantLoop = (
      request: AcquireRequest,
      key: bigint,
      keyText: string,
      admission: Admission
    ): Effect.Effect<AcquireResult<AdvisoryGrant>, LockBackendError> =>
      Effect.gen(function*() {
        // Subscribed before the first try, so a release between a busy try and the wait is seen.
        const hint = yield* subscribe(keyText)
        while (true) {
          const releasesBeforeTry = hint.releases
          if (request.mode === "shared") {
            const joined = yield* joinShared(request, keyText, admission)
            if (joined !== undefined && joined._tag !== "Retry") return joined
            if (joined !== undefined) continue
          }
          // Claimed by fastPathSession; tryGrant gives the claim back (nothing between can fail or be interrupted).
          const session = yield* fastPathSession(request)
          if (Option.isNone(session)) return TimedOut
          const tried = yield* tryGrant(session.value, request, key, keyText, admission)
          if (tried._tag === "Retry") continue
          if (tried._tag === "Granted") return tried
          if (request.attempt === "once") return Busy
          const reservation = yield* reserveWaitSession(request, hint, releasesBeforeTry)
          if (reservation._tag === "TimedOut") return TimedOut
          if (reservation._tag === "Retry") continue
          const waited = yield* blockingWait(reservation.session, request, key, keyText, admission)
          if (waited._tag !== "Retry") return waited
        }
      }).pipe(Effect.scoped)

    const acquire = (request: AcquireRequest): Effect.Effect<AcquireResult<AdvisoryGrant>, LockBackendError> =>
      Effect.gen(function*() {
        const key = advisoryKey(request.name, options.namespace)
        const keyText = key.toString()
        const admission = request.attempt === "once"
          ? yield* local.tryAdmit(keyText, request.mode)
          : yield* local.admit(keyText, request.mode, request.waitUntilDeadline)
        if (Option.isNone(admission)) return request.attempt === "once" ? Busy : TimedOut
        return yield* grantLoop(request, key, keyText, admission.value).pipe(
          Effect.onExit((exit) =>
            Exit.isSuccess(exit) && exit.value._tag === "Granted" ? Effect.void : local.leave(admission.value, false)
          )
        )
      })

    // ---------------------------------------------------------------- background work

    // Lost leases are told from a fiber: the driver's events arrive outside any fiber.
    yield* Effect.forkScoped(
      Effect.forever(
        Effect.flatMap(Queue.take(lostQueue), (holder) => holder.handed ? holder.onLost("connection-lost") : Effect.void)
      )
    )

    // Heartbeat: a dead idle session (network drop, server restart without a FIN) is noticed
    // within interval + timeout and its leases are told. Busy sessions are covered by the bound
    // on their own statements.
    const heartbeat = Effect.suspend(() =>
      Effect.forEach(
        sessions.filter((s) => s.state === "open" && !s.waiting && s.inflight === 0),
        (session) => statement(session, "select 1", undefined, options.heartbeatTimeoutMillis),
        { concurrency: "unbounded", discard: true }
      )
    )
    yield* Effect.forkScoped(
      Effect.forever(Effect.zipRight(Effect.sleep(Duration.millis(options.heartbeatIntervalMillis)), heartbeat))
    )

    yield* Effect.addFinalizer(() =>
      Effect.gen(function*() {
        // Holders still alive were already told and released by DistributedLock's own close,
        // which runs before this finalizer; what is left here is ending the sessions.
        closing = true
        const open = sessions.slice()
        // A graceful goodbye ends the backends (and their locks) at once; a stuck one is destroyed.
        yield* Effect.promise(() =>
          Promise.all(open.map((s) => settlesWithin(s.client.end(), CLOSE_TIMEOUT_MS)))
        )
        for (const session of open) {
          session.grants.clear()
          markDead(session)
        }
      })
    )

    // ---------------------------------------------------------------- build-time checks

    const home = yield* openSession("home")
    yield* adopt(home)
    yield* probeAffinity(home.client, clientConfig)
    yield* ensureFencingTable(home.client, options.fencingTable)

    return {
      backend: BACKEND,
      maxNameBytes: 1024,
      defaultTtl: Duration.seconds(30),
      minTtl: Duration.seconds(1),
      renewBatchSize: 1,
      acquire,
      // Session locks need no renewal; the core never calls this for grants without validUntil.
      renew: () => Effect.succeed([])
    }
  })

/** How long the affinity probe waits for a statement before concluding it queued behind another client. */
const PROBE_WAIT_MS = 1_000

/**
 * Session affinity check: `a` reads its backend pid, a second client opens a transaction and
 * keeps it open, and `a` reads its pid again. On a real session (or PgBouncer session mode) the
 * pid is stable and differs from the other client's; a transaction-mode pooler hands the
 * backend to the other client's transaction, so `a` moves (or has to wait for it).
 */
const probeAffinity = (a: pg.Client, config: pg.ClientConfig): Effect.Effect<void, UnsafeConnectionPooling | LockBackendError> =>
  Effect.tryPromise({
    try: async (): Promise<string | undefined> => {
      const pidOf = async (client: pg.Client) =>
        Number((await client.query<{ pid: number }>("select pg_backend_pid() as pid")).rows[0]?.pid)
      const b = await driver.connect(config, { onClosed: () => {} })
      try {
        const before = await pidOf(a)
        await b.query("begin")
        const other = await pidOf(b)
        const after = pidOf(a)
        const answered = await settlesWithin(after, PROBE_WAIT_MS)
        await b.query("commit")
        const afterPid = await after
        if (!answered) {
          return `a statement on one connection waited for another client's transaction to end (backend pid ${before} ` +
            `then ${afterPid})`
        }
        if (afterPid !== before) {
          return `the backend pid of one connection changed from ${before} to ${afterPid} while another client held ` +
            "a transaction open"
        }
        if (other === before) return `two connections were served by the same backend (pid ${before})`
        return undefined
      } finally {
        driver.destroy(b)
      }
    },
    catch: (cause) => new LockBackendError({ operation: "connect", cause })
  }).pipe(
    Effect.flatMap((problem) =>
      problem === undefined ? Effect.void : Effect.fail(
        new UnsafeConnectionPooling({
          detail: `${problem}: the connection has no session affinity (PgBouncer pool_mode=transaction or ` +
            "statement?), so a session advisory lock would attach to other clients' sessions. Point PgAdvisory " +
            "at PostgreSQL directly or at a pooler in session mode; behind transaction pooling use " +
            "PgAdvisory.withXactLock or PgLease instead."
        })
      )
    )
  )

/** The fencing-token table: one counter per key, bumped in each grant's statement. */
export const fencingTableSql = (table: TableRef): string =>
  `CREATE TABLE IF NOT EXISTS ${table.sql} (key bigint PRIMARY KEY, name text NOT NULL, token bigint NOT NULL)`

/**
 * Creates the fencing-token table if it is missing, in one statement under a DDL lock (see
 * `ensureTableSql`), retried when it loses the catalog race to a creator that takes no lock.
 * A table that exists is never touched, so no CREATE right is needed then.
 */
const ensureFencingTable = (client: pg.Client, table: TableRef): Effect.Effect<void, LockBackendError> =>
  Effect.tryPromise({
    try: async () => {
      const text = ensureTableSql(table, fencingTableSql(table), DDL_NAMESPACE)
      for (let attempt = 1;; attempt++) {
        try {
          await client.query(text)
          return
        } catch (error) {
          const code = driver.classify(error)
          if (attempt >= CREATE_ATTEMPTS || code._tag !== "Sql" || !CATALOG_RACE.has(code.code)) throw error
        }
      }
    },
    catch: (cause) => new LockBackendError({ operation: "create fencing table", cause })
  })

/**
 * The records the advisory engine keeps: sessions, the jobs queued on them, the locks the server
 * granted them and the leases handed to the core. Plain mutable records, changed only in single
 * synchronous steps (one `Effect.sync`), so no other fiber ever sees half an update.
 */
import type * as Clock from "effect/Clock"
import type * as Deferred from "effect/Deferred"
import type * as Effect from "effect/Effect"
import type * as Queue from "effect/Queue"
import type * as Scope from "effect/Scope"
import type pg from "pg"
import type { LockMode } from "../../Lease.js"
import type { LostReason } from "../../LockError.js"
import type { Admission, LocalKeys } from "./localKeys.js"
import type { Owner } from "../runtime/owner.js"
import type * as driver from "../pg/driver.js"
import type { TableRef } from "../sql/tables.js"

/** Resolved options. */
export interface BackendOptions {
  readonly connect: driver.ConnectConfig
  readonly maxSessions: number
  readonly namespace: string
  readonly fencingTable: TableRef
  /** Create the fencing table when it is missing (false: it must exist, see `migration`). */
  readonly createTables: boolean
  readonly heartbeatIntervalMillis: number
  readonly heartbeatTimeoutMillis: number
  /** How often idle lock names' fencing rows are swept (0: never). */
  readonly sweepIntervalMillis: number
  /**
   * Interval of a permit waiter's fallback re-try (jittered ±20%), for releases that send no
   * notification (a crashed holder). Not a public option: tests stretch it to prove that
   * wake-ups come from notifications. Default `permits.ts`' `PERMIT_FALLBACK_RETRY_MS`.
   */
  readonly permitRetryMillis?: number | undefined
}

/** What the server said to one statement. */
export type Settled =
  | { readonly _tag: "Ok"; readonly rows: ReadonlyArray<Row> }
  | { readonly _tag: "Failed"; readonly failure: driver.StatementFailure }
  /** No answer within the statement's bound: the session is destroyed. */
  | { readonly _tag: "NoAnswer" }
  /** The answer came from another backend than the session's: a pooler moved it. Destroyed. */
  | { readonly _tag: "Moved"; readonly pid: number }

export type Row = Readonly<Record<string, unknown>>

/** A try-lock waiting for its session; adjacent ones are sent as one statement. */
export interface TryJob {
  readonly _tag: "Try"
  readonly keyText: string
  readonly name: string
  readonly shared: boolean
  /** `queued` jobs can still be taken back (`dropped`), with no effect on the server. */
  state: "queued" | "started" | "dropped"
  /** Called once with the outcome, from the answer's callback (or when the session dies). */
  readonly done: (settled: Settled) => void
}

/** Any other statement, run alone. */
export interface StatementJob {
  readonly _tag: "Statement"
  readonly text: string
  readonly values: ReadonlyArray<unknown> | undefined
  readonly timeoutMillis: number
  state: "queued" | "started" | "dropped"
  /** Called once with the outcome, from the answer's callback (or when the session dies). */
  readonly done: (settled: Settled) => void
}

/** A release of one key (see `releaseSql`); adjacent ones are sent as one statement. */
export interface ReleaseJob {
  readonly _tag: "Release"
  readonly keyText: string
  readonly interestKey: string
  readonly shared: boolean
  state: "queued" | "started" | "dropped"
  /** Called once with the outcome (its own row), from the answer's callback (or when the session dies). */
  readonly done: (settled: Settled) => void
}

export type Job = TryJob | StatementJob | ReleaseJob

export interface Session {
  readonly id: number
  readonly role: "home" | "wait"
  readonly client: pg.Client
  /** `pg_backend_pid()` at open; every answer must come from it. */
  readonly pid: number
  state: "open" | "dead"
  /** Reserved for (or in) a blocking lock wait: nothing else may be sent to it. */
  waiting: boolean
  /** Jobs submitted and not yet settled. */
  pending: number
  /**
   * Try-locks whose outcome is not yet recorded (or undone): the session may hold a lock nobody
   * has written down yet, so it must not be reserved for a blocking wait.
   */
  claims: number
  readonly grants: Set<ServerGrant>
  /**
   * What this session holds for each semaphore (by the semaphore's key, in decimal) on behalf of
   * this process's permit holders and waiters (see `permits.ts`). Changed in the same synchronous
   * step as submitting the statement that changes it at the server, so that, statements of a
   * session running in order, it always describes the server's state when the next statement runs.
   */
  readonly permitUses: Map<string, PermitUse>
  /** The engine the session belongs to (its pump settles and reports through it). */
  readonly engine: Engine
  /** Jobs submitted and not yet sent, in order (`session.ts`'s pump sends them). */
  readonly queue: Array<Job>
  /** A statement of this session is on the wire; the next one waits for its answer. */
  busy: boolean
  /**
   * The statement on the wire: when it was sent (monotonic Clock ms) and its bound. The engine's
   * watchdog destroys the session once it is overdue (one timer for all sessions, not one per
   * statement).
   */
  inflight: { readonly since: number; readonly bound: number } | undefined
}

/** One lock the server granted to one session. */
export interface ServerGrant {
  readonly key: bigint
  readonly keyText: string
  readonly mode: LockMode
  readonly session: Session
  readonly holders: Set<Holder>
  /** Unlocked, being unlocked, or gone with its session: no one may join it. */
  closed: boolean
}

/** One semaphore's locks on one session, held for this process (see `Session.permitUses`). */
export interface PermitUse {
  /** The limit of this process's holders and waiters of the semaphore on the session. */
  limit: number
  /** Holds of the limit marker (session locks count): one per holder and one per registered waiter. */
  markers: number
  /** Slots held, each by one holder. */
  readonly slots: Set<number>
}

/** One lease handed to the core. Shared holders of one key may share a ServerGrant. */
export interface Holder {
  readonly grant: ServerGrant
  /**
   * The key's admission in `Engine.local`, given back on release. Permit holders carry their
   * semaphore's key here but hold no admission (their per-name gate is given back after each
   * attempt); their release never reads it.
   */
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

/** Wake-ups for requests that wait in-process. */
export type Hint =
  /** A wait session came free, or the set of sessions changed. */
  | { readonly _tag: "Changed" }
  /** A lock on this key was released (here, or elsewhere as a notification said). */
  | { readonly _tag: "Released"; readonly keyText: string }

/**
 * Where hints go. Lock requests waiting in-process subscribe to every hint; a permit wake-up (a
 * release notification whose payload names waiters, see `sql.ts`' `PERMIT_WAKE_PREFIX`) goes
 * straight to the permit waiters it names, and never through the subscription: nothing drops it.
 */
export interface Hints {
  /** Delivers a hint at once; callable from driver events, outside any fiber. */
  readonly unsafeOffer: (hint: Hint) => void
  /** The hints for lock requests waiting in-process, from now on. */
  readonly subscribe: Effect.Effect<Queue.Dequeue<Hint>, never, Scope.Scope>
}

/** Everything the engine's pieces share; one per layer. */
export interface Engine {
  readonly options: BackendOptions
  readonly driver: driver.Driver
  readonly clientConfig: pg.ClientConfig
  readonly statementTimeoutMillis: number
  readonly local: LocalKeys
  readonly sessions: Array<Session>
  readonly sharedGrants: Map<string, ServerGrant>
  /** Losses to report; driver events arrive outside any fiber, so they are told from one. */
  readonly lost: Queue.Queue<Holder>
  readonly hints: Hints
  /** Hints for the permit store (`permits.ts`), set when it is built: its wake-ups, and session changes. */
  permitHint: (hint: Hint) => void
  /** Runs the engine's own work (openers, loss reports, clean-ups of abandoned statements). */
  readonly owner: Owner
  /** The Clock the engine was built on (TestClock in the session tests): statements' send times. */
  readonly clock: Clock.Clock
  closing: boolean
  /** The watchdog (`session.ts`) is running: it runs while any statement is on the wire, and only then. */
  watchdogArmed: boolean
  nextSessionId: number
  openingWait: number
  homeOpening: Deferred.Deferred<void, import("../../LockError.js").LockBackendError> | undefined
}

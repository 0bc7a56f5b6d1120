/**
 * Lock sessions: opening one (bounded connect, setup, affinity check), the pump that sends each
 * session's queued jobs, bounded statements, and destroying a session.
 *
 * One statement runs at a time per session (as node-pg wants). The pump is driver callbacks, not
 * a fiber: a job submitted to an idle session is sent in the submitting step, and the answer's
 * callback settles its jobs and sends what queued behind it — the adjacent try-locks in one go,
 * so concurrent try-locks on a session share one statement and one commit. No fiber hop between a
 * caller and its statement (issue 23). Every statement has a client-side bound that an event-loop
 * stall cannot trip (`stallSafe`), and every answer must come from the backend the session was
 * opened on: a statement without an answer, a failed connection or an answer from another
 * backend destroys the session, and the server then drops every lock it held.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Queue from "effect/Queue"
import type pg from "pg"
import { LockBackendError, UnsafeConnectionPooling } from "../../LockError.js"
import * as metrics from "../core/metrics.js"
import { clockMillis, monotonicMillis } from "../core/clock.js"
import * as driver from "../pg/driver.js"
import { Cell } from "../runtime/cell.js"
import { sleepThenReadIO } from "../runtime/stallSafe.js"
import { probeAffinity } from "./bootstrap.js"
import { CHANNEL, RELEASE_BATCH_SQL, releaseSql, setupSql, tryBatchSql } from "./sql.js"
import type { Engine, Job, ReleaseJob, Row, ServerGrant, Session, Settled, StatementJob, TryJob } from "./state.js"

/** Short backend name for spans and metrics. */
export const BACKEND = "pg-advisory"

/** Most try-locks one statement carries. */
const MAX_BATCH = 1_000

const CLOSED: Settled = { _tag: "Failed", failure: { _tag: "Connection", error: new Error("the lock session is closed") } }

/** A session failed in a way that leaves its server state unknown: it must be destroyed. */
export const isFatal = (settled: Settled): boolean =>
  settled._tag === "NoAnswer" || settled._tag === "Moved" ||
  (settled._tag === "Failed" && settled.failure._tag === "Connection")

/** The SQLSTATE of a statement the server refused, if that is what happened. */
export const sqlCode = (settled: Settled): string | undefined =>
  settled._tag === "Failed" && settled.failure._tag === "Sql" ? settled.failure.code : undefined

/**
 * A wait session that may be reserved for a blocking wait: it holds nothing and has nothing
 * queued or claimed (an in-flight try-lock could still add a grant to it).
 */
export const isFreeWaitSession = (session: Session): boolean =>
  session.role === "wait" && session.state === "open" && !session.waiting && session.pending === 0 &&
  session.claims === 0 && session.grants.size === 0

/** Wakes requests waiting in-process for a session to come free. */
export const changed = (engine: Engine): void => {
  engine.hints.unsafeOffer({ _tag: "Changed" })
}

/**
 * A closed shared grant is no longer joined. Another open shared grant of the key (a request that
 * had to queue at the server got one on another session) is joined instead, so that a fresh
 * request never goes to a session that still holds the key.
 */
export const forgetShared = (engine: Engine, grant: ServerGrant): void => {
  if (engine.sharedGrants.get(grant.keyText) !== grant) return
  engine.sharedGrants.delete(grant.keyText)
  for (const session of engine.sessions) {
    for (const other of session.grants) {
      if (other !== grant && !other.closed && other.keyText === grant.keyText && other.mode === "shared") {
        engine.sharedGrants.set(grant.keyText, other)
        return
      }
    }
  }
}

/**
 * Marks a session dead, in one synchronous step: its grants close, every lease handed out on it
 * is queued to be told `connection-lost`, and its socket is destroyed (the server then drops its
 * locks). Callable from driver events.
 */
export const markDead = (engine: Engine, session: Session): void => {
  if (session.state === "dead") return
  session.state = "dead"
  const index = engine.sessions.indexOf(session)
  if (index >= 0) engine.sessions.splice(index, 1)
  for (const grant of session.grants) {
    grant.closed = true
    forgetShared(engine, grant)
    for (const holder of grant.holders) {
      if (holder.state !== "held") continue
      holder.state = "lost"
      Queue.unsafeOffer(engine.lost, holder)
    }
  }
  session.grants.clear()
  // Fails the statement in flight at once (its callback settles its jobs); nothing is queued after this.
  driver.destroy(session.client)
  settleQueued(engine, session)
  changed(engine)
}

/** Settles every job still queued on a dead session as failed: nothing waits on a session nobody drains. */
const settleQueued = (engine: Engine, session: Session): void => {
  const queued = session.queue.splice(0)
  for (const job of start(session, queued)) settle(engine, session, job, CLOSED)
}

/** Destroys a session whose state cannot be proven: the server drops whatever it held. */
export const kill = (engine: Engine, session: Session, reason: string): Effect.Effect<void> =>
  Effect.suspend(() => killNow(engine, session, reason))

/**
 * `kill` from a callback: the session is marked dead in this step, and the report (logs, metrics)
 * runs as the layer's work.
 */
export const killInBackground = (engine: Engine, session: Session, reason: string): void => {
  engine.owner.unsafeFork(killNow(engine, session, reason))
}

/** `kill` in one synchronous step; what it returns reports the loss (logs, metrics). */
const killNow = (engine: Engine, session: Session, reason: string): Effect.Effect<void> => {
  if (session.state === "dead") return Effect.void
  const keys = Array.from(session.grants, (grant) => grant.keyText)
  markDead(engine, session)
  // At shutdown every session is being ended on purpose: nothing to report.
  if (engine.closing) return Effect.void
  return metrics.sessionDestroyed(BACKEND).pipe(
    Effect.zipRight(
      Effect.logWarning(`destroyed a lock session (${reason}); the server drops the ${keys.length} lock(s) it held`).pipe(
        Effect.annotateLogs({ "lock.session": session.id, "lock.keys": keys.join(","), reason })
      )
    )
  )
}

const reasonOf = (settled: Settled): string =>
  settled._tag === "NoAnswer"
    ? "a statement got no answer in time"
    : settled._tag === "Moved"
    ? `a statement was answered by backend ${settled.pid}, not the session's own: a pooler moved the session`
    : "its connection failed"

/** The answer, checked to come from the session's own backend (every statement returns `pid`). */
const verify = (session: Session, result: pg.QueryResult): Settled => {
  const rows = result.rows as ReadonlyArray<Row>
  for (const row of rows) {
    const pid = row.pid
    if (typeof pid === "number" && pid !== session.pid) return { _tag: "Moved", pid }
  }
  return { _tag: "Ok", rows }
}

/**
 * Sends one statement on the session now, bounded by `timeoutMillis` (the watchdog, `killOverdue`,
 * destroys the session past it, which ends the statement); `done` gets the outcome, after the
 * session was destroyed if the outcome leaves its state unknown.
 */
const execute = (
  engine: Engine,
  session: Session,
  text: string,
  values: ReadonlyArray<unknown> | undefined,
  timeoutMillis: number,
  done: (settled: Settled) => void
): void => {
  session.inflight = { since: clockMillis(engine.clock), bound: timeoutMillis }
  armWatchdog(engine)
  // Every parameterised statement of a session is one of a few fixed texts: prepared once per
  // session, then only bound (the server plans it once, not on every grant and release).
  driver.send(session.client, text, values, values === undefined ? undefined : driver.preparedName(text), undefined, (failure, result) => {
    session.inflight = undefined
    const settled: Settled = failure === undefined ? verify(session, result!) : { _tag: "Failed", failure }
    // Destroyed before anyone hears the outcome; the report is the layer's work, off this callback.
    if (isFatal(settled)) killInBackground(engine, session, reasonOf(settled))
    done(settled)
  })
}

/** How often the watchdog looks for overdue statements: a bound is kept within this much. */
const WATCHDOG_TICK_MS = 100

/**
 * Starts the watchdog unless it runs: one timer for every statement bound, as the layer's work.
 * Started by the statement that finds it stopped, it stops on the first tick that finds no
 * statement on the wire: an idle layer runs no tick (ten rounds of an Effect loop a second cost an
 * idle process about 8 ms of CPU a second).
 */
const armWatchdog = (engine: Engine): void => {
  if (engine.watchdogArmed) return
  engine.watchdogArmed = true
  engine.owner.unsafeFork(watchdog(engine))
}

/**
 * A tick, then the next while a statement is on the wire. It reads pending I/O before it judges,
 * so an answer that arrived during an event-loop stall counts (a stall costs nothing).
 */
const watchdog = (engine: Engine): Effect.Effect<void> =>
  Effect.zipRight(
    sleepThenReadIO(Duration.millis(WATCHDOG_TICK_MS)),
    Effect.flatMap(killOverdue(engine), () =>
      Effect.suspend(() => {
        if (engine.sessions.some((session) => session.inflight !== undefined)) return watchdog(engine)
        // Stopped in the same synchronous step as the check: a statement sent from now on starts it again.
        engine.watchdogArmed = false
        return Effect.void
      }))
  )

/**
 * The watchdog's check: destroys every session whose statement is past its bound. Run it after
 * `yieldToIO`, so that an answer that arrived during an event-loop stall is read first.
 */
export const killOverdue = (engine: Engine): Effect.Effect<void> =>
  Effect.flatMap(monotonicMillis, (now) =>
    Effect.forEach(
      engine.sessions.filter((s) => s.inflight !== undefined && now - s.inflight.since > s.inflight.bound),
      (session) => kill(engine, session, "a statement got no answer in time"),
      { discard: true }
    ))

/** Hands a job its outcome; one synchronous step with the session's bookkeeping. */
const settle = (engine: Engine, session: Session, job: Job, settled: Settled): void => {
  session.pending -= 1
  job.done(settled)
  if (isFreeWaitSession(session)) changed(engine)
}

/** Takes the jobs still queued in a group for sending; dropped ones leave the session's count. */
const start = <J extends Job>(session: Session, jobs: ReadonlyArray<J>): Array<J> => {
  const live: Array<J> = []
  for (const job of jobs) {
    if (job.state === "queued") {
      job.state = "started"
      live.push(job)
    } else {
      session.pending -= 1
    }
  }
  return live
}

const compareKeys = (a: TryJob, b: TryJob): number => {
  const x = BigInt(a.keyText)
  const y = BigInt(b.keyText)
  return x < y ? -1 : x > y ? 1 : 0
}

/** Adjacent jobs of the head's kind (try-locks, releases) that go out as one statement, taken off the queue. */
const takeBatch = <J extends TryJob | ReleaseJob>(session: Session, tag: J["_tag"]): Array<J> => {
  let end = 1
  while (end < session.queue.length && end < MAX_BATCH && session.queue[end]!._tag === tag) end++
  return start(session, session.queue.splice(0, end) as Array<J>)
}

/**
 * Sends one statement for `jobs` and hands each its outcome when the answer comes: its own rows
 * (by key) when `byKey`, else the whole answer (a statement for one job only).
 */
const sendBatch = <J extends TryJob | ReleaseJob>(
  engine: Engine,
  session: Session,
  jobs: ReadonlyArray<J>,
  text: string,
  values: ReadonlyArray<unknown>,
  byKey: boolean
): void => {
  session.busy = true
  execute(engine, session, text, values, engine.statementTimeoutMillis, (settled) => {
    session.busy = false
    for (const job of jobs) {
      const own: Settled = byKey && settled._tag === "Ok" ? { _tag: "Ok", rows: settled.rows.filter((row) => row.key === job.keyText) } : settled
      // Every job is settled whatever another's continuation does: one that throws must not
      // leave the rest of the batch (and the session's queue) waiting forever.
      try {
        settle(engine, session, job, own)
      } catch (defect) {
        killInBackground(engine, session, `a job's continuation failed: ${String(defect)}`)
      }
    }
    pump(engine, session)
  })
}

/**
 * Sends what is queued at the head of the session's queue unless a statement is on the wire:
 * adjacent try-locks as one statement, adjacent releases as one, any other job alone. Called when
 * a job is queued and from each answer's callback, so the session drains in order with no fiber
 * of its own.
 */
const pump = (engine: Engine, session: Session): void => {
  while (!session.busy && session.queue.length > 0) {
    if (session.state !== "open") return settleQueued(engine, session)
    const head = session.queue[0]!
    if (head._tag === "Try") {
      // Key order: concurrent batches (other processes' too) lock fencing rows in one order.
      const live = takeBatch<TryJob>(session, "Try").sort(compareKeys)
      if (live.length === 0) continue
      const values = [live.map((j) => j.keyText), live.map((j) => j.name), live.map((j) => j.shared)]
      // By key always: the answer also carries the row with the session's pid.
      sendBatch(engine, session, live, tryBatchSql(engine.options.fencingTable), values, true)
    } else if (head._tag === "Release") {
      const live = takeBatch<ReleaseJob>(session, "Release")
      if (live.length === 0) continue
      // One release alone is the plain statement; several share one round trip and one commit.
      if (live.length === 1) {
        const job = live[0]!
        sendBatch(engine, session, live, releaseSql(job.shared ? "shared" : "exclusive"), [job.keyText, job.interestKey, CHANNEL], false)
      } else {
        const values = [live.map((j) => j.keyText), live.map((j) => j.interestKey), live.map((j) => j.shared), CHANNEL]
        sendBatch(engine, session, live, RELEASE_BATCH_SQL, values, true)
      }
    } else {
      session.queue.shift()
      if (start(session, [head]).length === 0) continue
      session.busy = true
      execute(engine, session, head.text, head.values, head.timeoutMillis, (settled) => {
        session.busy = false
        settle(engine, session, head, settled)
        pump(engine, session)
      })
    }
  }
}

/** Queues a job, in the same synchronous step as checking the session is open. */
const submit = (session: Session, job: Job): boolean => {
  if (session.state !== "open") return false
  session.pending += 1
  session.queue.push(job)
  // Sent now if the session is idle: the caller's own step, no hop to another fiber.
  pump(session.engine, session)
  return true
}

/** A job handle: its outcome, and a way to take it back while it is still queued. */
export interface Submitted {
  readonly job: Job
  /** Waits for the outcome. */
  readonly outcome: Effect.Effect<Settled>
  /** `outcome` as a callback step: raced with a deadline (`waitUntilDeadline`) without a fiber. */
  readonly outcomeStep: () => Effect.Effect<Settled>
  /** The outcome when it is already there. */
  readonly settled: () => Settled | undefined
}

const submitted = (session: Session, job: Job, cell: Cell<Settled>): Submitted => {
  if (!submit(session, job)) cell.set(CLOSED)
  return { job, outcome: cell.await, outcomeStep: () => cell.step, settled: cell.poll }
}

/** Takes a job back if it has not been sent; true when it was taken back. */
export const takeBack = (job: Job): boolean => {
  if (job.state !== "queued") return false
  job.state = "dropped"
  return true
}

/** Queues a try-lock of one key (batched with the others queued on the session). */
export const submitTry = (session: Session, keyText: string, name: string, shared: boolean): Submitted => {
  const cell = new Cell<Settled>()
  return submitted(session, { _tag: "Try", keyText, name, shared, state: "queued", done: cell.set }, cell)
}

/**
 * Queues the release of one key, batched with the releases queued next to it; its outcome (its own
 * row) goes to `done`, called once from the answer's callback (or when the session dies) — no cell
 * and no fiber between the answer and what follows it; `CLOSED` at once when the session is not open.
 */
export const submitReleaseThen = (
  session: Session,
  keyText: string,
  interestKey: string,
  shared: boolean,
  done: (settled: Settled) => void
): void => {
  if (!submit(session, { _tag: "Release", keyText, interestKey, shared, state: "queued", done })) done(CLOSED)
}

/** Queues one statement. */
export const submitStatement = (
  session: Session,
  text: string,
  values: ReadonlyArray<unknown> | undefined,
  timeoutMillis: number
): Submitted => {
  const cell = new Cell<Settled>()
  return submitted(session, { _tag: "Statement", text, values, timeoutMillis, state: "queued", done: cell.set }, cell)
}

/** Runs one bounded statement on the session and waits for its outcome (one Effect.async, no cell). */
export const statement = (
  engine: Engine,
  session: Session,
  text: string,
  values?: ReadonlyArray<unknown>,
  timeoutMillis?: number
): Effect.Effect<Settled> =>
  Effect.async<Settled>((resume) => {
    const done = (settled: Settled) => resume(Effect.succeed(settled))
    const job: StatementJob = { _tag: "Statement", text, values, timeoutMillis: timeoutMillis ?? engine.statementTimeoutMillis, state: "queued", done }
    // Interrupting the wait only stops waiting: the statement runs and settles its session's bookkeeping.
    if (!submit(session, job)) done(CLOSED)
  })

const connectError = (cause: unknown) => new LockBackendError({ operation: "connect", cause })

/**
 * Opens one session: connect and setup, together bounded by the connect timeout, then the affinity
 * check. A client that does not become a session is destroyed. Not added to the engine's
 * sessions (see `adopt`).
 */
export const open = (
  engine: Engine,
  role: Session["role"]
): Effect.Effect<Session, LockBackendError | UnsafeConnectionPooling> =>
  Effect.gen(function*() {
    const events = { session: undefined as Session | undefined, closedEarly: false }
    const { client, setup } = yield* driver.open(engine.driver, engine.clientConfig, {
      events: {
        onClosed: () => {
          if (events.session === undefined) events.closedEarly = true
          else markDead(engine, events.session)
        },
        ...(role === "home" ? { onNotification: (channel, payload) => onNotification(engine, channel, payload) } : {})
      },
      setup: setupSql(role === "home"),
      // One bound on opening a session, connect and setup together: past it the client is destroyed.
      boundMillis: engine.options.connect.connectTimeoutMillis
    }).pipe(Effect.mapError(connectError))
    return yield* Effect.gen(function*() {
      const pid = setup?.rows[0]?.pid
      if (typeof pid !== "number") return yield* connectError(new Error("the session setup returned no backend pid"))
      // A direct connection announces the backend's own pid at startup; a pooler announces its own
      // key. Only then can the session be moved, so only then is the behavioural probe needed.
      if (driver.announcedPid(client) !== pid) yield* probeAffinity(engine, client, pid)
      if (events.closedEarly) return yield* connectError(new Error("the connection closed during setup"))
      const session: Session = {
        id: engine.nextSessionId++,
        role,
        client,
        pid,
        state: "open",
        waiting: false,
        pending: 0,
        claims: 0,
        grants: new Set(),
        permitUses: new Map(),
        engine,
        queue: [],
        busy: false,
        inflight: undefined
      }
      events.session = session
      return session
    }).pipe(Effect.onError(() => Effect.sync(() => driver.destroy(client))))
  })

const onNotification = (engine: Engine, channel: string, payload: string | undefined): void => {
  if (channel !== CHANNEL || payload === undefined) return
  engine.hints.unsafeOffer({ _tag: "Released", keyText: payload })
}

/**
 * An answer from another backend than the session's: a pooler moved it. The acquire that saw it
 * fails loudly (the session is already destroyed) rather than trying again on a connection
 * without session affinity.
 */
export const movedError = (name: string, settled: Settled): LockBackendError | undefined =>
  settled._tag !== "Moved" ? undefined : new LockBackendError({
    operation: "acquire",
    name,
    cause: new UnsafeConnectionPooling({
      detail: `a statement was answered by backend ${settled.pid}, not by the one the lock session was opened on: ` +
        "the connection has no session affinity (a pooler moved the session), so session advisory locks are unsafe on it"
    })
  })

/** An affinity failure found while opening a session during an acquire is that acquire's backend error. */
export const asBackendError = (name: string) => (error: LockBackendError | UnsafeConnectionPooling): LockBackendError =>
  error._tag === "LockBackendError" ? error : new LockBackendError({ operation: "connect", name, cause: error })

/**
 * Lock sessions: opening one (bounded connect, setup, affinity check), the one worker fiber per
 * session that drains its job queue, bounded statements, and destroying a session.
 *
 * One statement runs at a time per session (as node-pg wants). The worker takes whatever queued
 * behind the running statement in one go (`takeBetween`), so concurrent try-locks on a session
 * share one statement and one commit. Every statement has a client-side bound that an event-loop
 * stall cannot trip (`stallSafe`), and every answer must come from the backend the session was
 * opened on: a statement without an answer, a failed connection or an answer from another
 * backend destroys the session, and the server then drops every lock it held.
 */
import * as Chunk from "effect/Chunk"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as Queue from "effect/Queue"
import type pg from "pg"
import { LockBackendError, UnsafeConnectionPooling } from "../../LockError.js"
import * as metrics from "../core/metrics.js"
import { monotonicMillis } from "../core/clock.js"
import * as driver from "../pg/driver.js"
import { probeAffinity } from "./bootstrap.js"
import { CHANNEL, setupSql, tryBatchSql } from "./sql.js"
import type { Engine, Job, Row, ServerGrant, Session, Settled, StatementJob, TryJob } from "./state.js"

/** Short backend name for spans and metrics. */
export const BACKEND = "pg-advisory"

/** Most jobs one worker turn takes off the queue. */
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
  driver.destroy(session.client)
  // The worker settles what is still queued and stops; nothing can be queued after this.
  Queue.unsafeOffer(session.jobs, { _tag: "Stop" })
  changed(engine)
}

/** Destroys a session whose state cannot be proven: the server drops whatever it held. */
export const kill = (engine: Engine, session: Session, reason: string): Effect.Effect<void> =>
  Effect.suspend(() => {
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
  })

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
 * Runs one statement on the session now (the worker's turn), bounded by `timeoutMillis` (the
 * watchdog, `killOverdue`, destroys the session past it, which ends the statement); destroys the
 * session when the outcome leaves its state unknown.
 */
const execute = (
  engine: Engine,
  session: Session,
  text: string,
  values: ReadonlyArray<unknown> | undefined,
  timeoutMillis: number
): Effect.Effect<Settled> =>
  Effect.flatMap(monotonicMillis, (since) => {
    session.inflight = { since, bound: timeoutMillis }
    // Every parameterised statement of a session is one of a few fixed texts: prepared once per
    // session, then only bound (the server plans it once, not on every grant and release).
    return driver.query(session.client, text, values, values === undefined ? undefined : driver.preparedName(text)).pipe(
      Effect.map((result) => verify(session, result)),
      Effect.catchAll((failure) => Effect.succeed<Settled>({ _tag: "Failed", failure })),
      Effect.tap((settled) => {
        session.inflight = undefined
        return isFatal(settled) ? kill(engine, session, reasonOf(settled)) : Effect.void
      })
    )
  })

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
const settle = (engine: Engine, session: Session, job: TryJob | StatementJob, settled: Settled): void => {
  session.pending -= 1
  Deferred.unsafeDone(job.done, Exit.succeed(settled))
  if (isFreeWaitSession(session)) changed(engine)
}

/** Takes the jobs still queued in a group for sending; dropped ones leave the session's count. */
const start = <J extends TryJob | StatementJob>(session: Session, jobs: ReadonlyArray<J>): Array<J> => {
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

const runTries = (engine: Engine, session: Session, group: ReadonlyArray<TryJob>): Effect.Effect<void> =>
  Effect.suspend(() => {
    // Key order: concurrent batches (other processes' too) lock fencing rows in one order.
    const live = start(session, group).sort(compareKeys)
    if (live.length === 0) return Effect.void
    const values = [live.map((j) => j.keyText), live.map((j) => j.name), live.map((j) => j.shared)]
    return Effect.map(
      execute(engine, session, tryBatchSql(engine.options.fencingTable), values, engine.statementTimeoutMillis),
      (settled) => {
        for (const job of live) {
          settle(
            engine,
            session,
            job,
            settled._tag === "Ok" ? { _tag: "Ok", rows: settled.rows.filter((row) => row.key === job.keyText) } : settled
          )
        }
      }
    )
  })

const runStatement = (engine: Engine, session: Session, job: StatementJob): Effect.Effect<void> =>
  Effect.suspend(() => {
    if (start(session, [job]).length === 0) return Effect.void
    return Effect.map(
      execute(engine, session, job.text, job.values, job.timeoutMillis),
      (settled) => settle(engine, session, job, settled)
    )
  })

/**
 * The session's worker: drains its queue in order, sending adjacent try-locks as one statement,
 * until the session is destroyed; then settles what is left as failed and stops.
 */
export const worker = (engine: Engine, session: Session): Effect.Effect<void> =>
  Effect.gen(function*() {
    while (true) {
      const batch = Chunk.toReadonlyArray(yield* Queue.takeBetween(session.jobs, 1, MAX_BATCH))
      let stopped = false
      let i = 0
      while (i < batch.length) {
        const job = batch[i]!
        if (job._tag === "Stop") {
          stopped = true
          i++
        } else if (session.state !== "open") {
          if (start(session, [job]).length > 0) settle(engine, session, job, CLOSED)
          i++
        } else if (job._tag === "Try") {
          const group: Array<TryJob> = []
          for (let next = batch[i]; next !== undefined && next._tag === "Try"; next = batch[++i]) group.push(next)
          yield* runTries(engine, session, group)
        } else {
          yield* runStatement(engine, session, job)
          i++
        }
      }
      if (stopped) return
    }
  })

/**
 * A worker ended (the session died, the layer closed, or a defect): the session is marked dead
 * if it was not, and every job still queued is settled as failed — nothing waits on a session
 * nobody drains. Its own exit, however it came, is observed here.
 */
export const workerEnded = (engine: Engine, session: Session): Effect.Effect<void> =>
  Effect.suspend(() => {
    markDead(engine, session)
    return Effect.flatMap(Queue.takeAll(session.jobs), (jobs) =>
      Effect.sync(() => {
        for (const job of Chunk.toReadonlyArray(jobs)) {
          if (job._tag !== "Stop" && start(session, [job]).length > 0) settle(engine, session, job, CLOSED)
        }
      }))
  })

/** Queues a job, in the same synchronous step as checking the session is open. */
const submit = (session: Session, job: TryJob | StatementJob): boolean => {
  if (session.state !== "open") return false
  session.pending += 1
  Queue.unsafeOffer(session.jobs, job)
  return true
}

/** A job handle: its outcome, and a way to take it back while it is still queued. */
export interface Submitted {
  readonly job: TryJob | StatementJob
  readonly outcome: Effect.Effect<Settled>
}

const submitted = (session: Session, job: TryJob | StatementJob): Submitted => ({
  job,
  outcome: submit(session, job) ? Deferred.await(job.done) : Effect.succeed(CLOSED)
})

/** Takes a job back if it has not been sent; true when it was taken back. */
export const takeBack = (job: TryJob | StatementJob): boolean => {
  if (job.state !== "queued") return false
  job.state = "dropped"
  return true
}

/** What every new job starts as: queued (it can still be taken back), its outcome to come. */
const queued = () => ({ state: "queued" as const, done: Deferred.unsafeMake<Settled>(FiberId.none) })

/** Queues a try-lock of one key (batched with the others queued on the session). */
export const submitTry = (session: Session, keyText: string, name: string, shared: boolean): Submitted =>
  submitted(session, { _tag: "Try", keyText, name, shared, ...queued() })

/** Queues one statement. */
export const submitStatement = (
  session: Session,
  text: string,
  values: ReadonlyArray<unknown> | undefined,
  timeoutMillis: number
): Submitted => submitted(session, { _tag: "Statement", text, values, timeoutMillis, ...queued() })

/** Runs one bounded statement on the session and waits for its outcome. */
export const statement = (
  engine: Engine,
  session: Session,
  text: string,
  values?: ReadonlyArray<unknown>,
  timeoutMillis?: number
): Effect.Effect<Settled> =>
  Effect.suspend(() => submitStatement(session, text, values, timeoutMillis ?? engine.statementTimeoutMillis).outcome)

const connectError = (cause: unknown) => new LockBackendError({ operation: "connect", cause })

/**
 * Opens one session: connect and setup, together bounded by the connect timeout, then the affinity
 * check. A client that does not become a session is destroyed. Not added to the engine's
 * sessions (see `adopt`); its worker runs in the engine's fiber set.
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
        jobs: yield* Queue.unbounded<Job>(),
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

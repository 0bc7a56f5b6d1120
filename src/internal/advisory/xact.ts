/**
 * `withXactLock`'s machinery: a transaction advisory lock inside `sql.withTransaction`, with a
 * client-side bound on every statement it sends itself.
 *
 * Two things of @effect/sql shape it (PG-FACTS.md): an interrupted statement is cancelled through
 * the pool (`pg_cancel_backend`, which waits for a free connection), and COMMIT/ROLLBACK run
 * uninterruptibly as defects on failure. So the contended path's statements are raced against
 * their bound *disconnected* (giving up never waits for the cancel), and a watchdog (one timer)
 * bounds the first lock statement and the COMMIT or ROLLBACK: on @effect/sql-pg's client it
 * destroys the transaction's connection when one is overdue, so the transaction runs on the
 * caller's fiber; on another SqlClient the transaction runs in a daemon fiber that the caller
 * stops waiting for. Either way a killed or frozen connection ends in `LockBackendError` within
 * the bound instead of hanging the caller.
 */
import type * as SqlClient from "@effect/sql/SqlClient"
import type { SqlError } from "@effect/sql/SqlError"
import * as Cause from "effect/Cause"
import * as Context from "effect/Context"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import type { LockMode } from "../../Lease.js"
import { LockBackendError, LockTimeout } from "../../LockError.js"
import { fiberMillis, monotonicMillis } from "../core/clock.js"
import { checkoutOf, destroyIfStillBusy, isSqlPgClient, sqlPgClientOf } from "../pg/driver.js"
import { sqlStateOf } from "../sql/state.js"
import { detachedWithin, stallSafeTimer } from "../runtime/stallSafe.js"
import { TransactionConnectionTag } from "../sql/tags.js"

/** Default bound on each statement withXactLock sends itself, and on COMMIT/ROLLBACK. */
export const DEFAULT_STATEMENT_TIMEOUT_MS = 5_000
/** Longest single lock wait: interruption and the deadline are checked between slices. */
const XACT_SLICE_MS = 1_000
/** The slice's own statement_timeout: past its lock_timeout, so that only lock_timeout ends a slice. */
const XACT_SLICE_STATEMENT_TIMEOUT_MS = XACT_SLICE_MS + 1_000
/** Savepoint a slice waits in: ROLLBACK TO it undoes a timed-out wait and keeps the transaction usable. */
const XACT_SAVEPOINT = "effect_lock_wait"
/**
 * A slice that ended without the lock: its lock_timeout struck (55P03), or a cancel hit it
 * (57014: a stray cancel, or the slice's own statement_timeout). Both are retried within the deadline.
 */
const SLICE_ENDED = new Set(["55P03", "57014"])

const millisText = (ms: number) => `${Math.max(1, Math.ceil(ms))}ms`

class BodyFailure<E> {
  readonly _tag = "effect-lock/PgAdvisory/BodyFailure"
  constructor(readonly error: E) {}
}

class BodyDefect {
  readonly _tag = "effect-lock/PgAdvisory/BodyDefect"
  constructor(readonly defect: unknown) {}
}

export interface XactRequest {
  readonly name: string
  readonly key: bigint
  readonly mode: LockMode
  readonly timeout: Duration.Duration | undefined
  readonly statementTimeoutMillis: number
}

/**
 * One statement of the machinery, bounded: past `bound` it fails with `LockBackendError`
 * without waiting for the statement's cancellation (see the module comment).
 */
const bounded = <A>(
  statement: Effect.Effect<A, SqlError>,
  request: XactRequest,
  bound: number
): Effect.Effect<A, SqlError | LockBackendError> =>
  Effect.flatMap(
    // Daemons, not children of the caller: an uninterruptible caller's held-back interruption (a
    // guarded body whose lease was lost) would otherwise cut the statement off at once.
    detachedWithin(Effect.disconnect(statement), bound),
    Option.match({
      onNone: () =>
        Effect.fail(
          new LockBackendError({
            operation: "acquire",
            name: request.name,
            cause: new Error(`a statement of the transaction lock got no answer within ${bound} ms`)
          })
        ),
      onSome: Effect.succeed
    })
  )

/**
 * Takes the transaction advisory lock.
 *
 * Uncontended, it is one `pg_try_advisory_xact_lock` and the session's settings are never
 * touched. Contended, it waits in **slices** inside the caller's transaction (so it works behind
 * transaction-mode PgBouncer): with a transaction-local `lock_timeout` of at most
 * `XACT_SLICE_MS` (and a `statement_timeout` covering it, so a pool's shorter one cannot cut the
 * wait into a `LockBackendError`), each slice runs `pg_advisory_xact_lock` in a savepoint; when
 * the slice times out, `ROLLBACK TO SAVEPOINT` undoes it and the next slice starts.
 *
 * Every statement here runs **uninterruptibly**, and interruption is honoured between them. An
 * interruptible statement would be cancelled by @effect/sql-pg through its pool
 * (`pg_cancel_backend`), which needs a free connection: with the pool full it took 5 s and left
 * the wait running, and the transaction's ROLLBACK then queued behind a wait with no end
 * (PG-FACTS.md). A slice always ends by itself, so an interrupt takes effect within one slice.
 *
 * When granted, the savepoint is released (the lock moves to the transaction) and the session's
 * own lock_timeout and statement_timeout are put back for the body.
 *
 * The price: between two slices (one round trip) the waiter is out of the server's lock queue,
 * so a waiter that queued later can be served first. Waits are not FIFO across slices.
 */
const lockInTransaction = (
  sql: SqlClient.SqlClient,
  request: XactRequest,
  progress: Progress
): Effect.Effect<void, LockTimeout | LockBackendError> =>
  Effect.withFiberRuntime((fiber) => {
    const start = fiberMillis(fiber)
    progress.connection = Option.getOrUndefined(Context.getOption(fiber.currentContext, TransactionConnectionTag))?.[0]
    advance(progress, "began")
    // The first statement is bounded by the watchdog of `run` (no race of its own: the
    // uncontended path stays one statement); the contended path's statements bound themselves.
    return Effect.matchEffect(
      // Uninterruptible: sql-pg would cancel an interrupted statement through its pool (above).
      Effect.uninterruptible(sql.unsafe<{ granted: boolean }>(TRY_TEXT[request.mode], [request.key.toString()]).withoutTransform),
      {
        onFailure: (error) => Effect.fail(acquireError(request.name, error)),
        onSuccess: (rows) => {
          progress.tried = true
          return rows[0]?.granted === true ? Effect.void : waitInSlices(sql, request, start)
        }
      }
    )
  })


/** The try-lock statement of each mode, built once. */
const TRY_TEXT: Record<LockMode, string> = {
  exclusive: "select pg_try_advisory_xact_lock($1::bigint) as granted",
  shared: "select pg_try_advisory_xact_lock_shared($1::bigint) as granted"
}

const acquireError = (name: string, cause: SqlError | LockBackendError): LockBackendError =>
  cause instanceof LockBackendError ? cause : new LockBackendError({ operation: "acquire", name, cause })

/** The contended path of `lockInTransaction`: the try found the lock taken at `start`. */
const waitInSlices = (
  sql: SqlClient.SqlClient,
  request: XactRequest,
  start: number
): Effect.Effect<void, LockTimeout | LockBackendError> =>
  Effect.uninterruptibleMask((restore) =>
    Effect.gen(function*() {
      const { key, mode, name, statementTimeoutMillis: bound, timeout } = request
      const shared = mode === "shared" ? "_shared" : ""
      const keyText = key.toString()
      const backendError = (cause: SqlError | LockBackendError) => acquireError(name, cause)
      // Without the client's row transforms: the column names below are read as written.
      const run = <A extends object = never>(text: string, values?: ReadonlyArray<unknown>) =>
        bounded(sql.unsafe<A>(text, values).withoutTransform, request, bound).pipe(Effect.mapError(backendError))
      const timedOut: Effect.Effect<never, LockTimeout> = Effect.flatMap(
        monotonicMillis,
        (now) => new LockTimeout({ name, waited: Duration.millis(now - start) })
      )
      /** Interruption takes effect here, between statements. */
      const checkpoint = restore(Effect.void)

      const millis = timeout === undefined || !Duration.isFinite(timeout) ? undefined : Duration.toMillis(timeout)
      if (millis !== undefined && millis <= 0) return yield* new LockTimeout({ name, waited: Duration.zero })
      const deadline = millis === undefined ? undefined : start + millis
      /** What is left of the caller's timeout, in ms (Infinity without one). */
      const remaining = Effect.map(monotonicMillis, (now) => deadline === undefined ? Infinity : deadline - now)

      yield* checkpoint
      const first = yield* remaining
      if (first <= 0) return yield* timedOut
      // The slices' settings are set outside the savepoint, so ROLLBACK TO keeps them.
      const outerSlice = Math.min(first, XACT_SLICE_MS)
      const previous = yield* run<{ lock_timeout: string; statement_timeout: string }>(
        "select current_setting('lock_timeout') as lock_timeout, current_setting('statement_timeout') as statement_timeout, " +
          "set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)",
        [millisText(outerSlice), millisText(XACT_SLICE_STATEMENT_TIMEOUT_MS)]
      )
      yield* run(`SAVEPOINT ${XACT_SAVEPOINT}`)
      let left = first
      while (true) {
        // A shorter last slice: set inside the savepoint, so the next ROLLBACK TO reverts it.
        if (left < outerSlice) yield* run("select set_config('lock_timeout', $1, true)", [millisText(left)])
        // A slice ends by itself within its statement_timeout; past that plus the bound, the
        // connection is presumed dead or frozen.
        const slice = yield* bounded(
          sql.unsafe(`select pg_advisory_xact_lock${shared}($1::bigint)`, [keyText]),
          request,
          XACT_SLICE_STATEMENT_TIMEOUT_MS + bound
        ).pipe(Effect.either)
        if (slice._tag === "Right") break
        if (slice.left instanceof LockBackendError) return yield* slice.left
        const code = sqlStateOf(slice.left)
        if (code === undefined || !SLICE_ENDED.has(code)) return yield* Effect.fail(backendError(slice.left))
        yield* run(`ROLLBACK TO SAVEPOINT ${XACT_SAVEPOINT}`)
        yield* checkpoint
        left = yield* remaining
        if (left <= 0) return yield* timedOut
      }
      // Granted in the savepoint: RELEASE hands the lock to the transaction. The body's statements
      // run with the session's own lock_timeout and statement_timeout, not the lock wait's.
      yield* run(`RELEASE SAVEPOINT ${XACT_SAVEPOINT}`)
      yield* run("select set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)", [
        previous[0]?.lock_timeout ?? "0",
        previous[0]?.statement_timeout ?? "0"
      ])
    })
  )

/** What the watchdog of `run` watches: plain fields, set by the transaction as it goes. */
interface Progress {
  /** The transaction began (BEGIN answered; the pool's wait for a connection is the pool's to bound). */
  began: boolean
  /** The transaction's connection, once it began. */
  connection: unknown
  /** The first lock statement answered. */
  tried: boolean
  /** The body ended (or the lock failed): the COMMIT or ROLLBACK is on its way. */
  ended: boolean
  /** What the watchdog found overdue, once it did. */
  overdue: string | undefined
  /** The watchdog's hook, called on `began` and `ended`. */
  onChange: (() => void) | undefined
}

const newProgress = (): Progress => ({
  began: false,
  connection: undefined,
  tried: false,
  ended: false,
  overdue: undefined,
  onChange: undefined
})

const advance = (progress: Progress, step: "began" | "ended"): void => {
  progress[step] = true
  progress.onChange?.()
}

/**
 * Watches the transaction's steps with one timer at a time: the first lock statement must answer
 * `bound` ms after BEGIN answered, the COMMIT or ROLLBACK `bound` ms after the body ended. Past
 * either, `onOverdue` is asked to act on what is overdue; it says whether it did, and then that
 * step is recorded as overdue (once). Returns the watchdog's stop.
 */
const watchdog = (
  progress: Progress,
  bound: number,
  onOverdue: (what: string) => boolean,
  onBegan?: () => void
): () => void => {
  let stage: "none" | "first" | "commit" = "none"
  // A real timer, not the Clock's: the statements it bounds run on real time, and a fiber per
  // transaction is what this replaces. Stall-safe: it reads what had arrived before it counts.
  let cancelTimer = () => {}
  const fire = () => {
    if (progress.overdue !== undefined) return
    const what = stage === "first" && !progress.tried
      ? "the transaction lock's first statement"
      : stage === "commit"
      ? "the transaction's COMMIT or ROLLBACK"
      : undefined
    if (what !== undefined && onOverdue(what)) progress.overdue = what
  }
  const arm = (next: "first" | "commit") => {
    cancelTimer()
    stage = next
    cancelTimer = stallSafeTimer(bound, fire)
  }
  progress.onChange = () => {
    if (progress.ended) {
      if (stage !== "commit") arm("commit")
    } else if (progress.began && stage === "none") {
      onBegan?.()
      arm("first")
    }
  }
  progress.onChange()
  return () => {
    cancelTimer()
    progress.onChange = undefined
  }
}

const overdueError = (request: XactRequest, progress: Progress): LockBackendError =>
  new LockBackendError({
    operation: "transaction",
    name: request.name,
    cause: new Error(
      `${progress.overdue} got no answer within ${request.statementTimeoutMillis} ms: the connection is dead or frozen` +
        (progress.tried ? ", and whether the transaction committed is unknown" : "")
    )
  })

/**
 * The transaction: the lock, then `self`, in `sql.withTransaction`. The body's failures and
 * defects are marked so they pass through unchanged (`unmark`); everything else that fails or
 * dies here belongs to the transaction machinery.
 */
const transactionOf = <A, E, R>(
  sql: SqlClient.SqlClient,
  self: Effect.Effect<A, E, R>,
  request: XactRequest,
  progress: Progress
) =>
  sql.withTransaction(
    // "ended" however the lock or the body ends: the COMMIT or ROLLBACK that follows is bounded.
    Effect.onExit(
      Effect.zipRight(lockInTransaction(sql, request, progress), Effect.catchAllCause(self, markBody)),
      () => Effect.sync(() => advance(progress, "ended"))
    )
  )

/** The body's own failures and defect, marked (an interruption passes as it is). */
const markBody = <E>(cause: Cause.Cause<E>): Effect.Effect<never, BodyFailure<E>> => {
  if (Cause.isFailure(cause)) return Effect.failCause(Cause.map(cause, (error) => new BodyFailure(error)))
  const defect = Cause.dieOption(cause)
  return Option.isSome(defect) ? Effect.die(new BodyDefect(defect.value)) : Effect.failCause(cause as Cause.Cause<never>)
}

/**
 * What the caller sees of a failed transaction: the body's own failure or defect unchanged,
 * the lock's errors as they are, and the machinery's (BEGIN, and COMMIT and ROLLBACK, which die
 * in @effect/sql: a killed connection is a defect there) as `LockBackendError`.
 */
const unmark = <E>(name: string, cause: Cause.Cause<unknown>): Effect.Effect<never, E | LockTimeout | LockBackendError> => {
  const failure = Cause.failureOption(cause)
  if (Option.isSome(failure)) {
    const error = failure.value
    if (error instanceof BodyFailure) return Effect.fail(error.error as E)
    if (error instanceof LockTimeout || error instanceof LockBackendError) return Effect.fail(error)
    return Effect.fail(new LockBackendError({ operation: "transaction", name, cause: error }))
  }
  const defect = Cause.dieOption(cause)
  if (Option.isNone(defect)) return Effect.failCause(cause as Cause.Cause<never>)
  return defect.value instanceof BodyDefect
    ? Effect.die(defect.value.defect)
    : Effect.fail(new LockBackendError({ operation: "transaction", name, cause: defect.value }))
}

/**
 * Runs `self` in a transaction holding the lock: the first lock statement must answer within
 * `statementTimeoutMillis` of the transaction's start, and once the body has ended (or the lock
 * failed) the COMMIT or ROLLBACK within the same bound; else the caller gets a `LockBackendError`.
 * An interrupted caller waits for the ROLLBACK within the bound.
 *
 * On `@effect/sql-pg`'s client the transaction runs on the caller's fiber, and an overdue step
 * destroys the transaction's connection: the statement then fails at once (COMMIT and ROLLBACK
 * with a defect, which is mapped), the pool drops the connection, and the server rolls back.
 * On another SqlClient, whose connection the library cannot reach, it runs in a daemon fiber that
 * the caller stops waiting for (`runDetached`).
 */
export const run = <A, E, R>(
  sql: SqlClient.SqlClient,
  self: Effect.Effect<A, E, R>,
  request: XactRequest
): Effect.Effect<A, E | LockTimeout | LockBackendError, R> =>
  isSqlPgClient(sql) ? runOnCaller(sql, self, request) : runDetached(sql, self, request)

const runOnCaller = <A, E, R>(
  sql: SqlClient.SqlClient,
  self: Effect.Effect<A, E, R>,
  request: XactRequest
): Effect.Effect<A, E | LockTimeout | LockBackendError, R> =>
  Effect.suspend(() => {
    const progress = newProgress()
    let client: ReturnType<typeof sqlPgClientOf>
    let checkout: unknown
    const stop = watchdog(
      progress,
      request.statementTimeoutMillis,
      // No answer in time: what the server did is unknown, so the connection is destroyed (the
      // server rolls back, the pool drops it) and the stuck statement fails at once. Only while
      // the statement is still on the wire in this checkout: once answered, the connection may
      // already be back in the pool, and another caller's connection is never destroyed.
      () => client !== undefined && destroyIfStillBusy(client, checkout),
      () => {
        client = sqlPgClientOf(progress.connection)
        checkout = client === undefined ? undefined : checkoutOf(client)
      }
    )
    return Effect.onExit(
      Effect.catchAllCause(transactionOf(sql, self, request, progress), (cause) =>
        // An overdue step's failure says why; an interrupted caller stays interrupted.
        progress.overdue === undefined || Cause.isInterrupted(cause)
          ? unmark<E>(request.name, cause)
          : Effect.fail(overdueError(request, progress))),
      // Always, interrupted or not: a timer left armed could destroy a connection no longer ours.
      () => Effect.sync(stop)
    )
  })

/**
 * `run` on a SqlClient whose connection the library cannot reach: the transaction runs in a
 * daemon fiber, and the caller stops waiting for it once a step is overdue (the daemon is left to
 * finish in the background when the connection finally dies or answers).
 */
const runDetached = <A, E, R>(
  sql: SqlClient.SqlClient,
  self: Effect.Effect<A, E, R>,
  request: XactRequest
): Effect.Effect<A, E | LockTimeout | LockBackendError, R> =>
  Effect.uninterruptibleMask((restore) =>
    Effect.gen(function*() {
      const progress = newProgress()
      const transaction = Effect.catchAllCause(
        transactionOf(sql, self, request, progress),
        (cause) => unmark<E>(request.name, cause)
      )
      // A daemon, not a child: a parent fiber waits for its children when it exits, and a stuck
      // COMMIT/ROLLBACK (uninterruptible in @effect/sql) would hold the caller with it.
      const fiber = yield* Effect.forkDaemon(restore(transaction))
      const done = yield* restore(watch(fiber, progress, request.statementTimeoutMillis)).pipe(
        // Interrupted: the transaction is rolled back; its ROLLBACK gets the same bound.
        Effect.onInterrupt(() => Effect.asVoid(detachedWithin(Fiber.interrupt(fiber), request.statementTimeoutMillis)))
      )
      if (Option.isSome(done)) {
        // As `Fiber.join` would: the body's FiberRef changes carry over to the caller.
        yield* Fiber.inheritAll(fiber)
        return yield* Exit.matchEffect(done.value, { onFailure: Effect.failCause, onSuccess: Effect.succeed })
      }
      yield* Fiber.interruptFork(fiber)
      return yield* overdueError(request, progress)
    })
  )

/**
 * Waits for the transaction's fiber to end (`Some` of its exit), or for a step to be overdue
 * (`None`). One callback-driven wait, no fiber of its own.
 */
const watch = <A, E>(
  fiber: Fiber.RuntimeFiber<A, E>,
  progress: Progress,
  bound: number
): Effect.Effect<Option.Option<Exit.Exit<A, E>>> =>
  Effect.async<Option.Option<Exit.Exit<A, E>>>((resume) => {
    let settled = false
    const settle = (outcome: Option.Option<Exit.Exit<A, E>>) => {
      if (settled) return
      settled = true
      stop()
      resume(Effect.succeed(outcome))
    }
    const observe = (exit: Exit.Exit<A, E>) => settle(Option.some(exit))
    const stopWatchdog = watchdog(progress, bound, () => {
      settle(Option.none())
      return true
    })
    const stop = () => {
      stopWatchdog()
      fiber.removeObserver(observe)
    }
    fiber.addObserver(observe)
    return Effect.sync(stop)
  })

/**
 * The service users call. A lock is a scoped resource: `acquire` it inside a Scope and it is
 * released when the scope closes; `withLock` runs an effect holding it and interrupts that effect
 * the moment the lock is lost. Backends (memory, PostgreSQL) are Layers that provide this service.
 *
 * @since 0.1.0
 */
import * as Cause from "effect/Cause"
import * as Context from "effect/Context"
import type * as Cron from "effect/Cron"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import { dual } from "effect/Function"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Schedule from "effect/Schedule"
import * as Scope from "effect/Scope"
import type { HeldLock, Lease, LockMode } from "./Lease.js"
import type { AcquireRequest, AcquireResult, Grant, LockBackend } from "./LockBackend.js"
import { LockBackendError, LockLost, LockTimeout } from "./LockError.js"
import type { InvalidLockName, LostReason } from "./LockError.js"
import { clockOf, fiberMillis, monotonicMillis, wholeMillis } from "./internal/core/clock.js"
import { addBody, type Held, heldOf, makeRegistry, type Registry, safetyDeadlineOf } from "./internal/core/registry.js"
import * as metrics from "./internal/core/metrics.js"
import * as internalSchedule from "./internal/core/schedule.js"
import { timeoutOption } from "./internal/runtime/stallSafe.js"
import { StallWatch } from "./internal/core/stallWatch.js"
import { isTraced } from "./internal/core/tracing.js"
import { clampTtl, decodeDuration, modeProblem, nameProblem } from "./internal/core/validate.js"

/**
 * Options for one acquisition.
 *
 * - `timeout` bounds the whole wait, session or connection checkout included; absent or infinite
 *   waits until granted or interrupted; zero or negative means a single attempt.
 * - `ttl` is the lease length on lease backends (memory, PgLease): clamped up to the backend's
 *   floor and down to 24 hours; session-bound backends ignore it.
 * - `mode`: `exclusive` (default) or `shared`.
 *
 * Locks are not re-entrant: asking again for a name this process holds waits like any other
 * contender.
 *
 * @since 0.1.0
 * @category models
 */
export interface AcquireOptions {
  readonly timeout?: Duration.DurationInput | undefined
  readonly ttl?: Duration.DurationInput | undefined
  readonly mode?: LockMode | undefined
}

/**
 * @since 0.1.0
 * @category models
 */
export type AcquireError = LockTimeout | LockBackendError | InvalidLockName

/**
 * The service's shape.
 *
 * @since 0.1.0
 * @category models
 */
export interface Service {
  /** The backend's short name (`memory`, `pg-advisory`, `pg-lease`). */
  readonly backend: string
  readonly acquire: (name: string, options?: AcquireOptions) => Effect.Effect<Lease, AcquireError, Scope.Scope>
  readonly tryAcquire: (
    name: string,
    options?: AcquireOptions
  ) => Effect.Effect<Option.Option<Lease>, AcquireError, Scope.Scope>
  /** The locks this process holds through this service right now. */
  readonly inspect: Effect.Effect<ReadonlyArray<HeldLock>>
  /**
   * The store's wall clock (ms since the epoch), when the backend has one (`LockBackend.now`):
   * `schedule` reads occurrence times on it so that replicas agree whatever their own clocks say.
   */
  readonly storeTime?: Effect.Effect<number, LockBackendError> | undefined
}

/**
 * The lock service tag. Provide it with a backend layer (`MemoryBackend.layer`,
 * `PgAdvisory.layer`, `PgLease.layer`).
 *
 * @since 0.1.0
 * @category tags
 */
export class DistributedLock extends Context.Tag("effect-lock/DistributedLock")<DistributedLock, Service>() {}

/** Longest lease accepted; longer requests are clamped (renewal keeps a lease alive anyway). */
const MAX_TTL = Duration.hours(24)
/** How long `tryAcquire` may wait for a session or connection when no timeout is given. */
const DEFAULT_TRY_TIMEOUT = Duration.seconds(5)
/** Bound on one release; past it the backend has already destroyed what it could not prove. */
const RELEASE_TIMEOUT = Duration.seconds(10)

/** A backend parameter the core relies on, checked once when the service is built. */
const checkBackend = (
  backend: Pick<LockBackend, "renewBatchSize" | "maxNameBytes" | "minTtl" | "defaultTtl">
): string | undefined => {
  const { maxNameBytes, renewBatchSize } = backend
  if (!Number.isInteger(renewBatchSize) || renewBatchSize < 1) {
    return `renewBatchSize must be a positive integer, got ${String(renewBatchSize)}`
  }
  if (!Number.isInteger(maxNameBytes) || maxNameBytes < 1) {
    return `maxNameBytes must be a positive integer, got ${String(maxNameBytes)}`
  }
  if (!Duration.isDuration(backend.minTtl) || !Duration.isDuration(backend.defaultTtl)) {
    return "minTtl and defaultTtl must be Durations"
  }
  return undefined
}

/**
 * Options of `make`.
 *
 * - `releaseTimeout`: bound on one release (default 10 s); a caller waits for a release at most
 *   twice this plus a second (it first lets a renewal in flight finish), whatever the backend does.
 *
 * @since 0.1.0
 * @category models
 */
export interface MakeOptions {
  readonly releaseTimeout?: Duration.DurationInput | undefined
}

/**
 * Builds the service over a backend. Starts one background fiber, scoped to the caller, that
 * renews every lease this service holds; it restarts after a defect (logged), so loss detection
 * never stops. Releases run on a runtime the service captures here, never on the caller's fiber.
 * Closing the scope is an ordered shutdown: new acquisitions are refused and waits end; holders
 * are told `LockLost { reason: "shutdown" }`, which interrupts their guarded bodies, and the bodies
 * are awaited (up to 10 s); acquisitions in flight settle; then every lease is given back. A
 * backend whose parameters the core cannot work with (a `renewBatchSize` that is not a positive
 * integer, for example) is a defect in that backend: `make` dies with an
 * `IllegalArgumentException` naming it.
 *
 * @since 0.1.0
 * @category constructors
 */
export const make = <G extends Grant>(backend: LockBackend<G>, options?: MakeOptions): Effect.Effect<Service, never, Scope.Scope> =>
  Effect.gen(function*() {
    const problem = checkBackend(backend)
    if (problem !== undefined) {
      return yield* Effect.die(new Cause.IllegalArgumentException(`effect-lock backend "${backend.backend}": ${problem}`))
    }
    const releaseTimeout = decodeDuration(options?.releaseTimeout) ?? RELEASE_TIMEOUT
    if (!Duration.isFinite(releaseTimeout) || Duration.toMillis(releaseTimeout) <= 0) {
      return yield* Effect.die(new Cause.IllegalArgumentException(`releaseTimeout must be a positive, finite duration, got ${Duration.format(releaseTimeout)}`))
    }
    // Starts the renewal loop on the service's own runtime.
    const registry = yield* makeRegistry(backend, { releaseTimeout })
    // Closing the service tells every holder its lease is gone (renewals stop here) and releases
    // it, rather than leaving bodies running on leases that will silently expire.
    yield* Effect.addFinalizer(() => registry.close)
    const acquire = (name: string, options?: AcquireOptions) =>
      Effect.flatMap(takeLease(backend, registry, "acquire", name, options), (lease) =>
        Option.isSome(lease) ? Effect.succeed(lease.value) : Effect.fail(new LockTimeout({ name, waited: Duration.zero })))
    return {
      backend: backend.backend,
      acquire,
      tryAcquire: (name, options) => takeLease(backend, registry, "try", name, options),
      inspect: registry.snapshot,
      storeTime: backend.now
    }
  })

/**
 * A layer providing `DistributedLock` from an effect that builds a backend.
 *
 * @since 0.1.0
 * @category layers
 */
export const layerBackend = <G extends Grant, E, R>(
  backend: Effect.Effect<LockBackend<G>, E, R>
): Layer.Layer<DistributedLock, E, Exclude<R, Scope.Scope>> =>
  Layer.scoped(DistributedLock, Effect.flatMap(backend, (built) => make(built)))

/** What one `acquire` / `tryAcquire` call asks for, worked out once before its attempts. */
interface Take<G extends Grant> {
  readonly backend: LockBackend<G>
  readonly registry: Registry<G>
  readonly kind: "acquire" | "try"
  readonly name: string
  readonly mode: LockMode
  readonly ttl: Duration.Duration
  readonly ttlMillis: number
  readonly attempt: "once" | "wait"
  readonly deadline: Option.Option<number>
  readonly start: number
  readonly scope: Scope.Scope
  readonly fiber: Fiber.RuntimeFiber<unknown, unknown>
  readonly traced: boolean
}

const closedError = (name: string) =>
  new LockBackendError({ operation: "acquire", name, cause: new Error("the lock service was closed") })

const takeLease = <G extends Grant>(
  backend: LockBackend<G>,
  registry: Registry<G>,
  kind: "acquire" | "try",
  name: string,
  options: AcquireOptions | undefined
): Effect.Effect<Option.Option<Lease>, AcquireError, Scope.Scope> =>
  Effect.withFiberRuntime((fiber) => {
    const invalid = nameProblem(name, backend.maxNameBytes) ?? modeProblem(name, options?.mode)
    if (invalid !== undefined) return Effect.fail(invalid)
    if (registry.isClosed()) return Effect.fail(closedError(name))
    const ttl = clampTtl(decodeDuration(options?.ttl) ?? backend.defaultTtl, backend.minTtl, MAX_TTL)
    const start = fiberMillis(fiber)
    const { attempt, deadline } = plan(kind, decodeDuration(options?.timeout), start)
    const take: Take<G> = {
      backend,
      registry,
      kind,
      name,
      mode: options?.mode ?? "exclusive",
      ttl,
      ttlMillis: Duration.toMillis(ttl),
      attempt,
      deadline,
      start,
      scope: Context.unsafeGet(fiber.currentContext as Context.Context<Scope.Scope>, Scope.Scope),
      fiber,
      traced: isTraced(fiber)
    }
    // Grant and registration of its release are one uninterruptible step; only the backend's
    // explicitly interruptible waits can be interrupted, and those leave no grant behind. Counted
    // in flight until settled: a closing service waits for it before its connections close.
    const taking = registry.taking(Effect.uninterruptibleMask((restore) => attemptOnce(take, restore)))
    return take.traced
      ? Effect.withSpan(taking, kind === "acquire" ? "effect-lock.acquire" : "effect-lock.tryAcquire", {
        captureStackTrace: false,
        attributes: { "lock.name": name, "lock.backend": backend.backend, "lock.mode": take.mode }
      })
      : taking
  })

/** What one attempt learned from the backend's `onLost` before and after its grant was handed out. */
interface AttemptState<G extends Grant> {
  held: Held<G> | undefined
  lostEarly: LostReason | undefined
  discarded: boolean
}

const attemptOnce = <G extends Grant>(
  take: Take<G>,
  restore: <A, E, R>(self: Effect.Effect<A, E, R>) => Effect.Effect<A, E, R>
): Effect.Effect<Option.Option<Lease>, AcquireError> => {
  // Per attempt: a loss reported for a grant that was never handed out concerns only it.
  const state: AttemptState<G> = { held: undefined, lostEarly: undefined, discarded: false }
  const { deadline, registry } = take
  const request: AcquireRequest = {
    name: take.name,
    mode: take.mode,
    attempt: take.attempt,
    ttl: take.ttl,
    deadline,
    interruptible: restore,
    // A wait also ends when the service starts closing (an ordered shutdown does not wait for it).
    waitUntilDeadline: (step) =>
      restore(Effect.raceFirst(
        Option.isNone(deadline)
          ? Effect.asSome(step)
          : Effect.flatMap(monotonicMillis, (now) => timeoutOption(step, wholeMillis(deadline.value - now))),
        Effect.as(registry.closing, Option.none())
      )),
    onLost: (reason) =>
      Effect.suspend(() => {
        if (state.discarded) return Effect.void
        if (state.held === undefined) {
          state.lostEarly = reason
          return Effect.void
        }
        return registry.declareLost(state.held, reason)
      })
  }
  return Effect.flatMap(take.backend.acquire(request), (result) => settle(take, state, result, restore))
}

/** Hands the grant out, or gives it back and decides what next; the checks and the hand-over are one step. */
const settle = <G extends Grant>(
  take: Take<G>,
  state: AttemptState<G>,
  result: AcquireResult<G>,
  restore: <A, E, R>(self: Effect.Effect<A, E, R>) => Effect.Effect<A, E, R>
): Effect.Effect<Option.Option<Lease>, AcquireError> => {
  const { fiber, name, registry } = take
  const now = fiberMillis(fiber)
  if (result._tag === "Busy") return annotated(take, now, result._tag, Effect.succeedNone)
  // A wait the closing service ended is no timeout of the caller's.
  if (result._tag === "TimedOut" && registry.isClosed()) return Effect.fail(closedError(name))
  if (result._tag === "Granted") {
    const grant = result.grant
    const closed = registry.isClosed()
    // A grant whose answer came after its safety deadline, or that was lost before it was
    // handed out, is given back: a holder must never start work on a lease already gone.
    if (
      !closed && state.lostEarly === undefined &&
      now < safetyDeadlineOf(Option.getOrUndefined(grant.validUntil), take.ttlMillis)
    ) {
      const held = registry.register(fiber, { name, mode: take.mode, grant, ttlMillis: take.ttlMillis })
      // Set in the same step as the check above: a loss reported from now on reaches `held`.
      state.held = held
      metrics.unsafe.acquired(held.labels, now - take.start)
      const lease = Option.some(registry.toLease(held))
      const handed = Effect.as(Scope.addFinalizer(take.scope, registry.release(held)), lease)
      return take.traced
        ? annotated(take, now, result._tag, Effect.zipRight(Effect.annotateCurrentSpan("lock.token", String(grant.token)), handed))
        : handed
    }
    state.discarded = true
    const outOfTime = take.attempt === "once" || Option.exists(take.deadline, (at) => now >= at)
    return Effect.zipRight(
      registry.discard(name, grant),
      closed ? Effect.fail(closedError(name)) : outOfTime ? timedOut(take, now) : attemptOnce(take, restore)
    )
  }
  return annotated(take, now, result._tag, timedOut(take, now))
}

/** `self`, after annotating the acquire's span (when there is one) with the wait and its outcome. */
const annotated = <G extends Grant, A, E>(take: Take<G>, now: number, outcome: string, self: Effect.Effect<A, E>) =>
  take.traced
    ? Effect.zipRight(Effect.annotateCurrentSpan({ "lock.wait_ms": now - take.start, "lock.outcome": outcome }), self)
    : self

const timedOut = <G extends Grant>(take: Take<G>, now: number): Effect.Effect<never, LockTimeout> =>
  Effect.suspend(() => {
    metrics.unsafe.timedOut(metrics.labelsOn(take.fiber, metrics.backendLabels(take.backend.backend)))
    return Effect.fail(new LockTimeout({ name: take.name, waited: Duration.millis(Math.max(0, now - take.start)) }))
  })

const plan = (kind: "acquire" | "try", timeout: Duration.Duration | undefined, now: number) => {
  if (kind === "try") {
    const bound = timeout === undefined ? DEFAULT_TRY_TIMEOUT : Duration.max(timeout, Duration.zero)
    return { attempt: "once" as const, deadline: Option.some(now + Duration.toMillis(bound)) }
  }
  if (timeout === undefined || !Duration.isFinite(timeout)) {
    return { attempt: "wait" as const, deadline: Option.none<number>() }
  }
  const millis = Duration.toMillis(timeout)
  return millis <= 0
    ? { attempt: "once" as const, deadline: Option.some(now) }
    : { attempt: "wait" as const, deadline: Option.some(now + millis) }
}

/**
 * Waits for the lock and holds it until the enclosing Scope closes. Interruptible while waiting;
 * an interrupted wait leaves no grant behind.
 *
 * @since 0.1.0
 * @category accessors
 */
export const acquire = (
  name: string,
  options?: AcquireOptions
): Effect.Effect<Lease, AcquireError, DistributedLock | Scope.Scope> =>
  Effect.flatMap(DistributedLock, (lock) => lock.acquire(name, options))

/**
 * Takes the lock only if nobody holds it: `None` when someone does. It never waits for the lock,
 * but may wait up to `timeout` (default 5 s) for a session or connection to try with.
 *
 * @since 0.1.0
 * @category accessors
 */
export const tryAcquire = (
  name: string,
  options?: AcquireOptions
): Effect.Effect<Option.Option<Lease>, AcquireError, DistributedLock | Scope.Scope> =>
  Effect.flatMap(DistributedLock, (lock) => lock.tryAcquire(name, options))

/**
 * The locks this process holds through the current `DistributedLock`.
 *
 * @since 0.1.0
 * @category accessors
 */
export const inspect: Effect.Effect<ReadonlyArray<HeldLock>, never, DistributedLock> = Effect.flatMap(
  DistributedLock,
  (lock) => lock.inspect
)

/**
 * Runs `self` while `lease` is held: if the lease is lost, `self` is interrupted and the result
 * is the `LockLost`. `self` (its finalizers included) has fully stopped when this returns — also
 * when the caller is interrupted — so the release that follows never overlaps the work.
 *
 * @since 0.1.0
 * @category combinators
 */
export const guard = <A, E, R>(lease: Lease, self: Effect.Effect<A, E, R>): Effect.Effect<A, E | LockLost, R> =>
  Effect.uninterruptibleMask((restore) =>
    Effect.withFiberRuntime<A, E | LockLost, R>((parent) => {
      const held = heldOf(lease)
      // A lease already known lost never starts the body.
      if (held?.lostError !== undefined) return Effect.fail(held.lostError)
      // The body and everything it forks are checked each time they resume: after a stall past
      // the lease's safe time, the loss is declared and they stop before their next step.
      const watch = held === undefined ? undefined : new StallWatch(held, parent.id(), clockOf(parent))
      const fork = Effect.fork(restore(self))
      return Effect.gen(function*() {
        const body = yield* (watch === undefined ? fork : Effect.supervised(fork, watch))
        // A shutdown waits for the body to stop before it gives the lease back.
        if (held !== undefined) addBody(held, body)
        let lostWith: LockLost | undefined
        // The body is interrupted and awaited here, so it stops before anyone releases.
        const watcher = yield* Effect.fork(
          restore(Effect.catchAll(lease.lost, (error) => {
            lostWith = error
            return Fiber.interrupt(body)
          }))
        )
        const exit = yield* restore(Fiber.await(body)).pipe(
          // The caller was interrupted: stop the body and wait until it has stopped.
          Effect.onInterrupt(() => Effect.zipRight(Fiber.interrupt(body), Fiber.interrupt(watcher)))
        )
        if (watch !== undefined) watch.active = false
        yield* Fiber.interrupt(watcher)
        if (Exit.isFailure(exit) && Cause.isInterruptedOnly(exit.cause)) {
          // Whoever interrupted the body (the watcher, or the body's own fibers on resuming after
          // the loss), a body stopped by a lost lease ends in LockLost, never a bare interruption.
          const lost = held?.lostError ?? lostWith
          if (lost !== undefined) return yield* Effect.fail(lost)
        }
        return yield* exit
      })
    })
  )

/**
 * Runs an effect holding the lock `name`. If the lease is lost the effect is interrupted and the
 * result is `LockLost` — never a silent double holder. The effect has fully stopped before the
 * release runs, also when the caller is interrupted.
 *
 * @since 0.1.0
 * @category combinators
 */
export const withLock: {
  (
    name: string,
    options?: AcquireOptions
  ): <A, E, R>(self: Effect.Effect<A, E, R>) => Effect.Effect<A, E | AcquireError | LockLost, R | DistributedLock>
  <A, E, R>(
    self: Effect.Effect<A, E, R>,
    name: string,
    options?: AcquireOptions
  ): Effect.Effect<A, E | AcquireError | LockLost, R | DistributedLock>
} = dual(
  (args) => Effect.isEffect(args[0]),
  <A, E, R>(self: Effect.Effect<A, E, R>, name: string, options?: AcquireOptions) =>
    Effect.scoped(Effect.flatMap(acquire(name, options), (lease) => guard(lease, self)))
)

/**
 * Like `withLock`, but never waits for the lock: `None` when someone else holds it (the
 * ShedLock "skip this run" pattern).
 *
 * @since 0.1.0
 * @category combinators
 */
export const tryWithLock: {
  (
    name: string,
    options?: AcquireOptions
  ): <A, E, R>(
    self: Effect.Effect<A, E, R>
  ) => Effect.Effect<Option.Option<A>, E | AcquireError | LockLost, R | DistributedLock>
  <A, E, R>(
    self: Effect.Effect<A, E, R>,
    name: string,
    options?: AcquireOptions
  ): Effect.Effect<Option.Option<A>, E | AcquireError | LockLost, R | DistributedLock>
} = dual(
  (args) => Effect.isEffect(args[0]),
  <A, E, R>(self: Effect.Effect<A, E, R>, name: string, options?: AcquireOptions) =>
    Effect.scoped(
      Effect.flatMap(
        tryAcquire(name, options),
        Option.match({
          onNone: () => Effect.succeedNone,
          onSome: (lease) => Effect.asSome(guard(lease, self))
        })
      )
    )
)

/**
 * Options for `singleton`.
 *
 * - `ttl`: as for `acquire` (the wait itself is unbounded; the lock is always exclusive).
 * - `restartAfter`: pause after the effect succeeds before competing again (default 1 s).
 * - `retryBase` / `retryMax`: capped exponential backoff for backend errors while competing
 *   (default 100 ms doubling up to 10 s).
 *
 * @since 0.1.0
 * @category models
 */
export interface SingletonOptions {
  readonly ttl?: Duration.DurationInput | undefined
  readonly restartAfter?: Duration.DurationInput | undefined
  readonly retryBase?: Duration.DurationInput | undefined
  readonly retryMax?: Duration.DurationInput | undefined
}

class BodyFailed<E> {
  readonly _tag = "effect-lock/internal/BodyFailed"
  constructor(readonly error: E) {}
}

/**
 * Keeps `effect` running on one process of the cluster at a time: the one holding the lock. A
 * holder that loses the lock is interrupted as soon as it learns of the loss (a frozen process
 * learns when it resumes), so fence what the effect writes with its lease's token if two
 * holders must never overlap even then. Each process competes for the
 * lock (no timeout) and runs `effect` holding it. On loss the effect is interrupted and the
 * process competes again; when it succeeds the lock is released and the process competes again
 * after `restartAfter`; when it fails with `E`, the lock is released and `singleton` fails with
 * `E`. Backend errors while competing are logged and retried with capped exponential backoff.
 *
 * @since 0.1.0
 * @category combinators
 */
export const singleton = <A, E, R>(
  name: string,
  effect: Effect.Effect<A, E, R>,
  options?: SingletonOptions
): Effect.Effect<never, E | InvalidLockName, R | DistributedLock> => {
  const restartAfter = decodeDuration(options?.restartAfter) ?? Duration.seconds(1)
  const retryBase = decodeDuration(options?.retryBase) ?? Duration.millis(100)
  const retryMax = decodeDuration(options?.retryMax) ?? Duration.seconds(10)
  const round = withLock(
    Effect.mapError(effect, (error) => new BodyFailed(error)),
    name,
    options?.ttl === undefined ? {} : { ttl: options.ttl }
  )
  const backoff = (failures: number) => Duration.min(retryMax, Duration.times(retryBase, 2 ** Math.min(failures, 30)))
  const loop = (failures: number): Effect.Effect<never, E | InvalidLockName, R | DistributedLock> =>
    round.pipe(
      Effect.matchEffect({
        onSuccess: () => Effect.zipRight(Effect.sleep(restartAfter), loop(0)),
        onFailure: (error) => {
          if (error instanceof BodyFailed) return Effect.fail(error.error as E)
          switch (error._tag) {
            case "InvalidLockName":
              return Effect.fail(error)
            case "LockLost":
              // Competes again at once after one loss; repeated losses back off like errors.
              return Effect.logWarning(`singleton "${name}" lost its lock; competing again`).pipe(
                Effect.zipRight(failures === 0 ? Effect.void : Effect.sleep(backoff(failures - 1))),
                Effect.zipRight(loop(failures + 1))
              )
            default: {
              return Effect.logWarning(`singleton "${name}" could not compete: ${error.message}`).pipe(
                Effect.zipRight(Effect.sleep(backoff(failures))),
                Effect.zipRight(loop(failures + 1))
              )
            }
          }
        }
      })
    )
  return Effect.suspend(() => loop(0))
}

/**
 * Options for `schedule`.
 *
 * - `atLeastFor`: after a job that ends early, the lock stays held until this long after it was
 *   won (never past the next occurrence), and an occurrence is run only if won within this long of
 *   its scheduled time. A replica whose clock is behind (or whose timer fires late) by less than
 *   this finds the occurrence taken and skips it. Default: half the time to the next occurrence,
 *   at most 10 s. `0`: no hold; an occurrence can then be won until the next one is due.
 * - `atMostFor`: a job still running this long after it started is interrupted (its finalizers
 *   run) and the lock is given back; the schedule goes on with the next occurrence. Default: none.
 * - `ttl`: the lease length, as for `acquire`; the lease is renewed while the job runs.
 * - `retryBase` / `retryMax`: backoff between attempts when the lock store fails (default 100 ms
 *   doubling up to 10 s), within the occurrence's claim window.
 *
 * @since 0.1.0
 * @category models
 */
export interface ScheduleOptions {
  readonly atLeastFor?: Duration.DurationInput | undefined
  readonly atMostFor?: Duration.DurationInput | undefined
  readonly ttl?: Duration.DurationInput | undefined
  readonly retryBase?: Duration.DurationInput | undefined
  readonly retryMax?: Duration.DurationInput | undefined
}

/**
 * One occurrence of a scheduled job, as the job sees it.
 *
 * @since 0.1.0
 * @category models
 */
export interface Occurrence {
  readonly name: string
  /**
   * When the occurrence was due, in ms since the epoch, on the clock the replicas compare
   * (the store's where the backend has one): the same number on every replica, so it can key
   * what the job writes.
   */
  readonly scheduledAt: number
  /** The lease held for this occurrence; its token fences the job's writes. */
  readonly lease: Lease
}

/**
 * Runs `job` on the schedule, once per occurrence across every replica that runs the same line.
 *
 * Each replica steps `schedule` on the wall clock; at each occurrence it tries the lock `name`
 * (never waiting for it): the winner runs the job under the lock, the others skip that
 * occurrence. The schedule must be aligned to the wall clock (`Schedule.cron`, a `Cron`,
 * `Schedule.secondOfMinute` …), so that every replica computes the same occurrence times;
 * replicas started at different moments would not agree on `Schedule.spaced`'s. See
 * `ScheduleOptions` for `atLeastFor` (clock skew) and `atMostFor` (hung jobs).
 *
 * A lost lock interrupts the job (logged; the schedule goes on). Errors of the lock store are
 * logged and retried with backoff until the occurrence's claim window closes, then it is skipped
 * (logged); they never fail the schedule. An occurrence that nobody could claim in its window is
 * skipped, never run late: at most once per occurrence. When the job fails with `E`, the lock is
 * given back and `schedule` fails with `E`; otherwise it never returns (a finite schedule returns
 * its last output when it is done).
 *
 * @since 0.1.0
 * @category combinators
 */
export function schedule<E, R>(
  name: string,
  cron: Cron.Cron,
  job: Effect.Effect<unknown, E, R> | ((occurrence: Occurrence) => Effect.Effect<unknown, E, R>),
  options?: ScheduleOptions
): Effect.Effect<never, E | InvalidLockName, R | DistributedLock>
export function schedule<Out, R2, E, R>(
  name: string,
  schedule: Schedule.Schedule<Out, unknown, R2>,
  job: Effect.Effect<unknown, E, R> | ((occurrence: Occurrence) => Effect.Effect<unknown, E, R>),
  options?: ScheduleOptions
): Effect.Effect<Out, E | InvalidLockName, R | R2 | DistributedLock>
export function schedule<E, R>(
  name: string,
  cronOrSchedule: Cron.Cron | Schedule.Schedule<unknown, unknown, unknown>,
  job: Effect.Effect<unknown, E, R> | ((occurrence: Occurrence) => Effect.Effect<unknown, E, R>),
  options?: ScheduleOptions
): Effect.Effect<unknown, E | InvalidLockName, unknown> {
  const steps: Schedule.Schedule<unknown, unknown, unknown> = Schedule.isSchedule(cronOrSchedule)
    ? cronOrSchedule
    : Schedule.cron(cronOrSchedule)
  return Effect.flatMap(DistributedLock, (lock) => internalSchedule.run({ lock, guard }, name, steps, job, options))
}

/**
 * The service users call. A lock is a scoped resource: `acquire` it inside a Scope and it is
 * released when the scope closes; `withLock` runs an effect holding it and interrupts that effect
 * the moment the lock is lost. Backends (memory, PostgreSQL) are Layers that provide this service.
 *
 * @since 0.1.0
 */
import * as Cause from "effect/Cause"
import * as Clock from "effect/Clock"
import * as Context from "effect/Context"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import { dual } from "effect/Function"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import type { HeldLock, Lease, LockMode } from "./Lease.js"
import type { AcquireRequest, Grant, LockBackend } from "./LockBackend.js"
import { LockBackendError, LockLost, LockTimeout } from "./LockError.js"
import type { InvalidLockName, LostReason } from "./LockError.js"
import { type Held, makeRegistry, pollLost, type Registry, safetyDeadlineOf } from "./internal/held.js"
import { monotonicMillis } from "./internal/clock.js"
import * as metrics from "./internal/metrics.js"
import { clampTtl, decodeDuration, validateMode, validateName } from "./internal/validate.js"

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

/**
 * Builds the service over a backend. Starts one background fiber, scoped to the caller, that
 * renews every lease this service holds.
 *
 * @since 0.1.0
 * @category constructors
 */
export const make = <G extends Grant>(backend: LockBackend<G>): Effect.Effect<Service, never, Scope.Scope> =>
  Effect.gen(function*() {
    const registry = yield* makeRegistry(backend, { releaseTimeout: RELEASE_TIMEOUT })
    yield* Effect.forkScoped(registry.run)
    // Closing the service tells every holder its lease is gone (renewals stop here) and releases
    // it, rather than leaving bodies running on leases that will silently expire.
    yield* Effect.addFinalizer(() => registry.close)
    const take = (kind: "acquire" | "try") => (name: string, options?: AcquireOptions) =>
      takeLease(backend, registry, kind, name, options)
    return {
      backend: backend.backend,
      acquire: (name, options) =>
        Effect.flatMap(take("acquire")(name, options), (lease) =>
          Option.match(lease, {
            onNone: () => Effect.fail(new LockTimeout({ name, waited: Duration.zero })),
            onSome: Effect.succeed
          })),
      tryAcquire: take("try"),
      inspect: registry.snapshot
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
  Layer.scoped(DistributedLock, Effect.flatMap(backend, make))

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

const takeLease = <G extends Grant>(
  backend: LockBackend<G>,
  registry: Registry<G>,
  kind: "acquire" | "try",
  rawName: string,
  options: AcquireOptions | undefined
): Effect.Effect<Option.Option<Lease>, AcquireError, Scope.Scope> =>
  Effect.gen(function*() {
    const name = yield* validateName(rawName, backend.maxNameBytes)
    const mode = yield* validateMode(name, options?.mode)
    const ttl = clampTtl(decodeDuration(options?.ttl) ?? backend.defaultTtl, backend.minTtl, MAX_TTL)
    const start = yield* monotonicMillis
    const { attempt, deadline } = plan(kind, decodeDuration(options?.timeout), start)
    const scope = yield* Effect.scope
    if (registry.isClosed()) {
      return yield* new LockBackendError({ operation: "acquire", name, cause: new Error("the lock service was closed") })
    }

    // Grant and registration of its release are one uninterruptible step; only the backend's
    // explicitly interruptible waits can be interrupted, and those leave no grant behind.
    return yield* Effect.uninterruptibleMask((restore) =>
      Effect.gen(function*() {
        while (true) {
          // Per attempt: a loss reported for a grant that was never handed out concerns only it.
          const attemptState: { held?: Held<G>; lostEarly?: LostReason; discarded: boolean } = { discarded: false }
          const request: AcquireRequest = {
            name,
            mode,
            attempt,
            ttl,
            deadline,
            interruptible: restore,
            waitUntilDeadline: (step) =>
              Option.match(deadline, {
                onNone: () => Effect.asSome(restore(step)),
                onSome: (at) =>
                  Effect.flatMap(monotonicMillis, (now) => restore(Effect.timeout(step, Math.max(0, at - now)))).pipe(
                    Effect.map(Option.some),
                    Effect.catchTag("TimeoutException", () => Effect.succeedNone)
                  )
              }),
            onLost: (reason) =>
              Effect.suspend(() => {
                if (attemptState.discarded) return Effect.void
                if (attemptState.held === undefined) {
                  attemptState.lostEarly = reason
                  return Effect.void
                }
                return registry.declareLost(attemptState.held, reason)
              })
          }
          const result = yield* backend.acquire(request)
          const now = yield* monotonicMillis
          yield* Effect.annotateCurrentSpan({ "lock.wait_ms": now - start, "lock.outcome": result._tag })
          if (result._tag === "Busy") return Option.none<Lease>()
          if (result._tag === "Granted") {
            const validUntil = Option.getOrUndefined(result.grant.validUntil)
            const closed = registry.isClosed()
            // A grant whose answer came after its safety deadline, or that was lost before it was
            // handed out, is given back: a holder must never start work on a lease already gone.
            if (closed || attemptState.lostEarly !== undefined || now >= safetyDeadlineOf(validUntil, Duration.toMillis(ttl))) {
              attemptState.discarded = true
              yield* registry.discard(name, result.grant)
              if (closed) {
                return yield* new LockBackendError({ operation: "acquire", name, cause: new Error("the lock service was closed") })
              }
              const outOfTime = attempt === "once" || Option.exists(deadline, (at) => now >= at)
              if (!outOfTime) continue
            } else {
              const registered = yield* registry.register(
                { name, mode, grant: result.grant, ttl, since: yield* Clock.currentTimeMillis },
                yield* Deferred.make<never, LockLost>()
              )
              attemptState.held = registered
              yield* Scope.addFinalizer(scope, registry.release(registered))
              yield* metrics.acquired(backend.backend, now - start)
              yield* Effect.annotateCurrentSpan("lock.token", String(result.grant.token))
              return Option.some(registry.toLease(registered))
            }
          }
          yield* metrics.timedOut(backend.backend)
          return yield* new LockTimeout({ name, waited: Duration.millis(Math.max(0, now - start)) })
        }
      })
    )
  }).pipe(
    Effect.withSpan(kind === "acquire" ? "effect-lock.acquire" : "effect-lock.tryAcquire", {
      captureStackTrace: false,
      attributes: { "lock.name": rawName, "lock.backend": backend.backend, "lock.mode": options?.mode ?? "exclusive" }
    })
  )

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
    Effect.gen(function*() {
      // A lease already known lost never starts the body.
      const known = yield* pollLost(lease)
      if (Option.isSome(known)) return yield* Effect.fail(known.value)
      let lostWith: LockLost | undefined
      const started = yield* Deferred.make<Fiber.RuntimeFiber<A, E>>()
      // The watcher is running before the body starts, so no step of the body precedes it.
      const watcher = yield* Effect.fork(
        restore(
          Effect.catchAll(lease.lost, (error) =>
            Effect.flatMap(Deferred.await(started), (body) => {
              lostWith = error
              // The body is interrupted and awaited here, so it stops before anyone releases.
              return Fiber.interrupt(body)
            }))
        )
      )
      const body = yield* Effect.fork(restore(self))
      yield* Deferred.succeed(started, body)
      const exit = yield* restore(Fiber.await(body)).pipe(
        // The caller was interrupted: stop the body and wait until it has stopped.
        Effect.onInterrupt(() => Effect.zipRight(Fiber.interrupt(body), Fiber.interrupt(watcher)))
      )
      yield* Fiber.interrupt(watcher)
      if (lostWith !== undefined && Exit.isFailure(exit) && Cause.isInterruptedOnly(exit.cause)) {
        return yield* Effect.fail(lostWith)
      }
      return yield* exit
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
 * Keeps `effect` running on exactly one process of the cluster. Each process competes for the
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

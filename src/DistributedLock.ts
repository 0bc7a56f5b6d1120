/**
 * The service users call. A lock is a scoped resource: `acquire` it inside a Scope and it is
 * released when the scope closes; `withLock` runs an effect holding it and interrupts that effect
 * the moment the lock is lost. Backends (memory, PostgreSQL) are Layers that provide this service.
 *
 * @since 0.1.0
 */
import * as Context from "effect/Context"
import type * as Cron from "effect/Cron"
import * as Effect from "effect/Effect"
import { dual } from "effect/Function"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Schedule from "effect/Schedule"
import type * as Scope from "effect/Scope"
import type { HeldLock, Lease } from "./Lease.js"
import type { Grant, LockBackend } from "./LockBackend.js"
import type { LockBackendError, LockLost } from "./LockError.js"
import type { InvalidLockName } from "./LockError.js"
import * as Acquire from "./internal/core/acquire.js"
import { guard as internalGuard } from "./internal/core/guard.js"
import * as internalSchedule from "./internal/core/schedule.js"
import * as internalSingleton from "./internal/core/singleton.js"

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
export interface AcquireOptions extends Acquire.AcquireOptions {}

/**
 * @since 0.1.0
 * @category models
 */
export type AcquireError = Acquire.AcquireError

/**
 * The service's shape.
 *
 * @since 0.1.0
 * @category models
 */
export interface Service extends Acquire.LockService {
  /** The backend's short name (`memory`, `pg-advisory`, `pg-lease`). */
  readonly backend: string
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

/**
 * Options of `make`.
 *
 * - `releaseTimeout`: bound on one release (default 10 s); a caller waits for a release at most
 *   twice this plus a second (it first lets a renewal in flight finish), whatever the backend does.
 *
 * @since 0.1.0
 * @category models
 */
export interface MakeOptions extends Acquire.MakeOptions {}

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
  Effect.map(Acquire.make(backend, options), (core): Service => {
    const service: Service = {
      backend: backend.backend,
      acquire: (name, options) => Effect.flatMap(core.take("acquire", name, options, {}), (lease) => Acquire.granted(name, lease)),
      tryAcquire: (name, options) => core.take("try", name, options, {}),
      inspect: core.inspect,
      storeTime: backend.now
    }
    return Acquire.withTakeIn<AcquireOptions | undefined, Option.Option<Lease>, AcquireError, Service>(
      service,
      (scope, kind, name, options) => core.takeIn(scope, kind, name, options, {})
    )
  })

type TakesIn = Acquire.TakesIn<AcquireOptions | undefined, Option.Option<Lease>>

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
 * when the caller is interrupted — so the release that follows never overlaps the work. Run it
 * inside the lease's scope: on a lease already given back (its scope closed first) it dies with
 * an `IllegalArgumentException` and never starts `self`, which would run without the lock; a
 * guard forked off whose lease's scope closes while `self` runs has `self` interrupted, and the
 * release waits (bounded, 10 s) until it has stopped.
 *
 * @since 0.1.0
 * @category combinators
 */
export const guard = <A, E, R>(lease: Lease, self: Effect.Effect<A, E, R>): Effect.Effect<A, E | LockLost, R> =>
  internalGuard(lease, self)

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
    Effect.flatMap(DistributedLock, (lock) =>
      Acquire.useGrant(lock as TakesIn, () => Effect.asSome(lock.acquire(name, options)), "acquire", name, options, (lease, scope) =>
        Effect.flatMap(Acquire.granted(name, lease), (held) => internalGuard(held, self, scope))))
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
    Effect.flatMap(DistributedLock, (lock) =>
      Acquire.useGrant(lock as TakesIn, () => lock.tryAcquire(name, options), "try", name, options, (lease, scope) =>
        Option.isSome(lease) ? Effect.asSome(internalGuard(lease.value, self, scope)) : Effect.succeedNone))
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
export interface SingletonOptions extends internalSingleton.SingletonOptions {}

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
): Effect.Effect<never, E | InvalidLockName, R | DistributedLock> =>
  internalSingleton.singleton(withLock, name, effect, options)

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
export interface ScheduleOptions extends internalSchedule.ScheduleOptions {}

/**
 * One occurrence of a scheduled job, as the job sees it.
 *
 * @since 0.1.0
 * @category models
 */
export interface Occurrence extends internalSchedule.Occurrence {
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

/**
 * The acquire path every backend shares: a request's options worked out once (name, mode, ttl,
 * deadline), the backend's attempt, and the hand-over of a grant — registered with its release in
 * one uninterruptible step, or given back when it came too late or was lost before it was handed
 * out. `DistributedLock.make` and `DistributedSemaphore.make` are thin services over `make` here;
 * a semaphore's limit and permits travel with its request (`extra`), not beside it.
 */
import * as Cause from "effect/Cause"
import * as Context from "effect/Context"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import type { HeldLock, Lease, LockMode } from "../../Lease.js"
import type { AcquireRequest, AcquireResult, Grant, LockBackend } from "../../LockBackend.js"
import { LockBackendError, LockTimeout } from "../../LockError.js"
import type { InvalidLockName, LostReason } from "../../LockError.js"
import { clockOf, fiberMillis, monotonicMillis, wholeMillis } from "./clock.js"
import * as metrics from "./metrics.js"
import { type Held, makeRegistry, type Registry, safetyDeadlineOf } from "./registry.js"
import { sleepThenReadIO, stallSafeTimer } from "../runtime/stallSafe.js"
import { raceEnd } from "../runtime/raceEnd.js"
import { isTraced } from "./tracing.js"
import { clampTtl, decodeDuration, modeProblem, nameProblem } from "./validate.js"

/** Options for one acquisition (documented on `DistributedLock.AcquireOptions`). */
export interface AcquireOptions {
  readonly timeout?: Duration.DurationInput | undefined
  readonly ttl?: Duration.DurationInput | undefined
  readonly mode?: LockMode | undefined
}

/** What an acquisition can fail with (documented on `DistributedLock.AcquireError`). */
export type AcquireError = LockTimeout | LockBackendError | InvalidLockName

/** The lock service's shape (documented on `DistributedLock.Service`). */
export interface LockService {
  readonly backend: string
  readonly acquire: (name: string, options?: AcquireOptions) => Effect.Effect<Lease, AcquireError, Scope.Scope>
  readonly tryAcquire: (
    name: string,
    options?: AcquireOptions
  ) => Effect.Effect<Option.Option<Lease>, AcquireError, Scope.Scope>
  readonly inspect: Effect.Effect<ReadonlyArray<HeldLock>>
  readonly storeTime?: Effect.Effect<number, LockBackendError> | undefined
}

/**
 * Where a service made by this library keeps its `takeIn` (`withLock`, `withPermits`): a grant
 * whose release goes into a given scope, not the context's. A service made elsewhere (a test
 * double) has none, and `inOwnScope`'s callers fall back to `Effect.scoped`. The key carries the
 * entry's version (bumped whenever `TakeInEntry` changes): a copy of effect-lock of another
 * version in the same process finds no entry of a shape it does not know, and uses `acquire`.
 */
export const TakeIn: unique symbol = Symbol.for("effect-lock/internal/TakeIn/1")

/** The hidden `takeIn` of a service, with the methods it stands for (a wrapper that replaced them is used instead). */
export interface TakeInEntry<O, T, E> {
  readonly take: (scope: Scope.Scope, kind: "acquire" | "try", name: string, options: O) => Effect.Effect<T, E>
  readonly acquire: unknown
  readonly tryAcquire: unknown
}

/** A service with the hidden `takeIn` (options `O`, granting `T`). */
export interface TakesIn<O, T, E = AcquireError> {
  readonly acquire: unknown
  readonly tryAcquire: unknown
  readonly [TakeIn]?: TakeInEntry<O, T, E> | undefined
}

/**
 * `service` with its `takeIn`, not enumerable (a service spread into a wrapper does not carry
 * it), and standing only for the `acquire` and `tryAcquire` it was made with: a wrapper that
 * replaced one (`Object.create`, `Object.assign`, a Proxy, a spy) has its own used.
 */
export const withTakeIn = <O, T, E, S extends { readonly acquire: unknown; readonly tryAcquire: unknown }>(
  service: S,
  take: TakeInEntry<O, T, E>["take"]
): S => {
  const entry: TakeInEntry<O, T, E> = { take, acquire: service.acquire, tryAcquire: service.tryAcquire }
  return Object.defineProperty(service, TakeIn, { value: entry, enumerable: false })
}

/**
 * `use` of what `take` grants in a scope of its own, closed with `use`'s exit (the release runs
 * then): `Effect.scoped` without providing the Scope to every step in between. A context change
 * is about 6 µs of CPU per call on this path (`bench/README.md`); `use` gets the scope to hand on.
 */
export const inOwnScope = <T, A, E1, E2, R>(
  take: (scope: Scope.Scope) => Effect.Effect<T, E1>,
  use: (granted: T, scope: Scope.Scope) => Effect.Effect<A, E2, R>
): Effect.Effect<A, E1 | E2, R> =>
  Effect.acquireUseRelease(
    Scope.make(),
    (scope) => Effect.flatMap(take(scope), (granted) => use(granted, scope)),
    (scope, exit) => Scope.close(scope, exit)
  )

/**
 * `use` of the grant of one request: taken in a scope of its own (`inOwnScope`) when `service`
 * has `takeIn`, else through `viaContext` under `Effect.scoped` (then `use` gets no scope: the
 * context has it). `withLock`, `tryWithLock`, `withPermits` and `tryWithPermits` are this.
 */
export const useGrant = <O, T, E, A, E2, R>(
  service: TakesIn<O, Option.Option<T>, E>,
  viaContext: () => Effect.Effect<Option.Option<T>, E, Scope.Scope>,
  kind: "acquire" | "try",
  name: string,
  options: O,
  use: (granted: Option.Option<T>, scope: Scope.Scope | undefined) => Effect.Effect<A, E2, R>
): Effect.Effect<A, E | E2, R> => {
  const entry = service[TakeIn]
  // Only while the service's own method is the one the entry stands for (no wrapper replaced it).
  const own = entry !== undefined && (kind === "acquire" ? service.acquire === entry.acquire : service.tryAcquire === entry.tryAcquire)
  return own
    ? inOwnScope((scope) => entry.take(scope, kind, name, options), use)
    : Effect.scoped(Effect.flatMap(viaContext(), (granted) => use(granted, undefined)))
}

/** What a waiting acquire granted (`None` is unreachable: a waiting acquire ends granted or timed out). */
export const granted = <T>(name: string, grant: Option.Option<T>): Effect.Effect<T, LockTimeout> =>
  Option.isSome(grant) ? Effect.succeed(grant.value) : Effect.fail(new LockTimeout({ name, waited: Duration.zero }))

/** Options of `make` (documented on `DistributedLock.MakeOptions`). */
export interface MakeOptions {
  readonly releaseTimeout?: Duration.DurationInput | undefined
}

/**
 * A lock store whose requests carry `X` besides the `AcquireRequest` (a `LockBackend` is a
 * `Store<G, {}>`; `DistributedSemaphore` passes its store with the limit and permits asked).
 */
export type Store<G extends Grant, X extends object> = Omit<LockBackend<G>, "acquire"> & {
  readonly acquire: (request: AcquireRequest & X) => Effect.Effect<AcquireResult<G>, LockBackendError>
}

/**
 * The shared acquire path over one backend: `take` is `acquire` (`kind: "acquire"`, `None` never
 * returned) or `tryAcquire`; `extra` is merged into the backend's request (a semaphore's ask).
 */
export interface Acquirer<X extends object> {
  readonly take: (
    kind: "acquire" | "try",
    name: string,
    options: AcquireOptions | undefined,
    extra: X
  ) => Effect.Effect<Option.Option<Lease>, AcquireError, Scope.Scope>
  /** `take` with the release registered in `scope`, not the context's Scope (`TakeIn`). */
  readonly takeIn: (
    scope: Scope.Scope,
    kind: "acquire" | "try",
    name: string,
    options: AcquireOptions | undefined,
    extra: X
  ) => Effect.Effect<Option.Option<Lease>, AcquireError>
  readonly inspect: Effect.Effect<ReadonlyArray<HeldLock>>
}

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
 * Starts the registry (and its renewal loop, on the service's own runtime) over `backend`, and
 * closes it in order when the scope closes. Dies on a backend parameter the core cannot work with.
 */
export const make = <G extends Grant, X extends object = {}>(
  backend: Store<G, X>,
  options?: MakeOptions
): Effect.Effect<Acquirer<X>, never, Scope.Scope> =>
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
    return {
      take: (kind, name, options, extra) => takeLease(backend, registry, kind, name, options, extra, undefined),
      // With a scope given, the context's Scope is never read.
      takeIn: (scope, kind, name, options, extra) =>
        takeLease(backend, registry, kind, name, options, extra, scope) as Effect.Effect<Option.Option<Lease>, AcquireError>,
      inspect: registry.snapshot
    }
  })

/** What one `acquire` / `tryAcquire` call asks for, worked out once before its attempts. */
interface Take<G extends Grant, X extends object> {
  readonly backend: Store<G, X>
  readonly extra: X
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

const takeLease = <G extends Grant, X extends object>(
  backend: Store<G, X>,
  registry: Registry<G>,
  kind: "acquire" | "try",
  name: string,
  options: AcquireOptions | undefined,
  extra: X,
  /** Where the release is registered: the context's Scope when `undefined`. */
  scope: Scope.Scope | undefined
): Effect.Effect<Option.Option<Lease>, AcquireError, Scope.Scope> =>
  Effect.withFiberRuntime((fiber) => {
    const invalid = nameProblem(name, backend.maxNameBytes) ?? modeProblem(name, options?.mode)
    if (invalid !== undefined) return Effect.fail(invalid)
    if (registry.isClosed()) return Effect.fail(closedError(name))
    const ttl = clampTtl(decodeDuration(options?.ttl) ?? backend.defaultTtl, backend.minTtl, MAX_TTL)
    const start = fiberMillis(fiber)
    const { attempt, deadline } = plan(kind, decodeDuration(options?.timeout), start)
    const take: Take<G, X> = {
      backend,
      extra,
      registry,
      kind,
      name,
      mode: options?.mode ?? "exclusive",
      ttl,
      ttlMillis: Duration.toMillis(ttl),
      attempt,
      deadline,
      start,
      scope: scope ?? Context.unsafeGet(fiber.currentContext as Context.Context<Scope.Scope>, Scope.Scope),
      fiber,
      traced: isTraced(fiber)
    }
    // Grant and registration of its release are one uninterruptible step; only the backend's
    // explicitly interruptible waits can be interrupted, and those leave no grant behind. Counted
    // in flight until settled: a closing service waits for it before its connections close.
    const taking = registry.taking((restore) => attemptOnce(take, restore))
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

const attemptOnce = <G extends Grant, X extends object>(
  take: Take<G, X>,
  restore: <A, E, R>(self: Effect.Effect<A, E, R>) => Effect.Effect<A, E, R>
): Effect.Effect<Option.Option<Lease>, AcquireError> => {
  // Per attempt: a loss reported for a grant that was never handed out concerns only it.
  const state: AttemptState<G> = { held: undefined, lostEarly: undefined, discarded: false }
  const { deadline, registry } = take
  // A raw timer only on the live clock: a TestClock (or the user's own Clock) drives deadlines.
  const liveClock = clockOf(take.fiber) === LIVE_CLOCK
  const request: AcquireRequest & X = {
    name: take.name,
    mode: take.mode,
    attempt: take.attempt,
    ttl: take.ttl,
    deadline,
    interruptible: restore,
    // A wait also ends when the service starts closing (an ordered shutdown does not wait for it).
    // One race per wait: the step against one callback-driven end (deadline timer, closing).
    waitUntilDeadline: (step) =>
      Effect.flatMap(monotonicMillis, (now) => {
        const millis = Option.map(deadline, (at) => wholeMillis(at - now))
        return restore(
          liveClock
            // The step runs interruptibly whatever the caller's region (a waiting step grants
            // nothing): a caller in a finalizer still has its deadline and the closing service end the wait.
            ? raceEnd(step, (end) => armEnd(registry, millis, end))
            : Effect.raceFirst(
              Effect.asSome(Effect.interruptible(step)),
              // Interruptible even inside an uninterruptible caller: the losing end must stop at once.
              Effect.interruptible(clockEnd(registry, millis))
            )
        )
      }),
    onLost: (reason) =>
      Effect.suspend(() => {
        if (state.discarded) return Effect.void
        if (state.held === undefined) {
          state.lostEarly = reason
          return Effect.void
        }
        return registry.declareLost(state.held, reason)
      }),
    // A semaphore's ask, spread last: first, it made V8 build this object ~9 µs slower (bench/README.md).
    ...take.extra
  }
  return Effect.flatMap(take.backend.acquire(request), (result) => settle(take, state, result, restore))
}

/**
 * Calls `end` once `millis` have passed on the live clock (stall-safe: an answer that had arrived
 * is read first) or the service starts closing, whichever is first; never without a deadline
 * until closing. Returns the cancel.
 */
const armEnd = (
  registry: Pick<Registry<Grant>, "whenClosing">,
  millis: Option.Option<number>,
  end: () => void
): () => void => {
  if (Option.isNone(millis)) return registry.whenClosing(end)
  const until = performance.now() + millis.value
  let cancelTimer = () => {}
  // libuv fires a timer on its cached whole-millisecond loop clock, up to 1 ms before the
  // monotonic clock reaches the deadline: re-armed for what is left, so that a wait never ends
  // (and `LockTimeout.waited` never reads) short of its timeout.
  const arm = (ms: number) => {
    cancelTimer = stallSafeTimer(ms, () => {
      const left = until - performance.now()
      if (left > 0) arm(wholeMillis(left))
      else end()
    })
  }
  arm(millis.value)
  const unsubscribe = registry.whenClosing(end)
  return () => {
    cancelTimer()
    unsubscribe()
  }
}

/**
 * `None` once `millis` have passed on the fiber's own clock (a TestClock, or the user's Clock:
 * its sleep, a second race, off the production path) or the service starts closing.
 */
const clockEnd = (
  registry: Pick<Registry<Grant>, "whenClosing">,
  millis: Option.Option<number>
): Effect.Effect<Option.Option<never>> => {
  const closing = Effect.async<Option.Option<never>>((resume) => {
    const unsubscribe = registry.whenClosing(() => resume(Effect.succeedNone))
    return Effect.sync(unsubscribe)
  })
  if (Option.isNone(millis)) return closing
  return Effect.raceFirst(Effect.as(sleepThenReadIO(Duration.millis(millis.value)), Option.none()), closing)
}

/** The Clock of the default runtime: a fiber on it runs on real time. */
const LIVE_CLOCK = Effect.runSync(Effect.clock)

/** Hands the grant out, or gives it back and decides what next; the checks and the hand-over are one step. */
const settle = <G extends Grant, X extends object>(
  take: Take<G, X>,
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
const annotated = <A, E>(take: Pick<Take<Grant, object>, "traced" | "start">, now: number, outcome: string, self: Effect.Effect<A, E>) =>
  take.traced
    ? Effect.zipRight(Effect.annotateCurrentSpan({ "lock.wait_ms": now - take.start, "lock.outcome": outcome }), self)
    : self

const timedOut = (
  take: Pick<Take<Grant, object>, "fiber" | "name" | "start" | "deadline"> & { readonly backend: { readonly backend: string } },
  now: number
): Effect.Effect<never, LockTimeout> =>
  Effect.suspend(() => {
    metrics.unsafe.timedOut(metrics.labelsOn(take.fiber, metrics.backendLabels(take.backend.backend)))
    // Timed out means the deadline was reached on the clock that decided it; a reading of this
    // clock a fraction of a millisecond short of it (timers and clocks round differently) still
    // reports the whole timeout.
    const end = Option.match(take.deadline, { onNone: () => now, onSome: (at) => Math.max(now, at) })
    return Effect.fail(new LockTimeout({ name: take.name, waited: Duration.millis(Math.max(0, end - take.start)) }))
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


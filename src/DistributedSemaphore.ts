/**
 * N permits per name across processes: at most `limit` permits of a name are held at once,
 * cluster-wide. Permits are scoped like locks (`acquire` inside a Scope, released when it
 * closes), renewed like leases, carry a fencing token each, and `withPermits` interrupts its body
 * the moment any of its permits is lost. Every backend layer provides this service beside
 * `DistributedLock`: `MemoryBackend`, `PgAdvisory`, `PgLease` and `SqliteLease`.
 *
 * Semaphore names are a namespace of their own: the semaphore `"reports"` and the lock
 * `"reports"` do not exclude each other.
 *
 * @since 0.1.0
 */
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import { dual } from "effect/Function"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import type * as Scope from "effect/Scope"
import * as DistributedLock from "./DistributedLock.js"
import type { FencingToken } from "./FencingToken.js"
import type { Lease } from "./Lease.js"
import type { Grant, LockAndSemaphoreBackend, PermitGrant, SemaphoreBackend } from "./LockBackend.js"
import { HttpStatusAnnotation, LockBackendError, type LockLost } from "./LockError.js"
import * as Acquire from "./internal/core/acquire.js"
import { guard as internalGuard } from "./internal/core/guard.js"
import { heldOf } from "./internal/core/registry.js"

/**
 * The name is in use (held or waited for) with another `limit` than the one asked for. Two
 * limits for one name would be two semaphores under one name; it is refused instead.
 *
 * @since 0.1.0
 * @category errors
 */
export class LimitMismatch extends Schema.TaggedError<LimitMismatch>("effect-lock/LimitMismatch")("LimitMismatch", {
  name: Schema.String,
  /** The limit this request asked for. */
  limit: Schema.Number,
  /** The limit the current holders and waiters use. */
  current: Schema.Number
}, {
  description: "The semaphore is in use with another limit than the one asked for",
  [HttpStatusAnnotation]: 409
}) {
  override get message(): string {
    return `semaphore "${this.name}" is in use with limit ${this.current}; asked with limit ${this.limit}`
  }
}

/**
 * `limit` or `permits` cannot be used: not a positive integer, or more permits than the limit.
 *
 * @since 0.1.0
 * @category errors
 */
export class InvalidPermits extends Schema.TaggedError<InvalidPermits>("effect-lock/InvalidPermits")("InvalidPermits", {
  name: Schema.String,
  reason: Schema.String
}, {
  description: "The permit request cannot be used",
  [HttpStatusAnnotation]: 400
}) {
  override get message(): string {
    return `invalid permit request for semaphore "${this.name}": ${this.reason}`
  }
}

/**
 * Options for one permit request.
 *
 * - `limit` (required): the semaphore's size; every holder and waiter of a name must agree on it.
 * - `permits` (default 1): taken all at once or not at all, `1 <= permits <= limit`.
 * - `timeout`, `ttl`: as for `DistributedLock.acquire`.
 *
 * @since 0.1.0
 * @category models
 */
export interface PermitOptions extends Pick<DistributedLock.AcquireOptions, "timeout" | "ttl"> {
  readonly limit: number
  readonly permits?: number | undefined
}

/**
 * Held permits. Released when the Scope they were acquired in closes. `lost` fails with
 * `LockLost` (carrying the first token) the moment any of them is known lost; `isHeld` is what
 * this process knows.
 *
 * @since 0.1.0
 * @category models
 */
export interface Permits {
  readonly name: string
  readonly permits: number
  readonly limit: number
  /** One fencing token per permit, strictly increasing per name across all grants. */
  readonly tokens: ReadonlyArray<FencingToken>
  readonly lost: Effect.Effect<never, LockLost>
  readonly isHeld: Effect.Effect<boolean>
}

/**
 * @since 0.1.0
 * @category models
 */
export type AcquireError = DistributedLock.AcquireError | LimitMismatch | InvalidPermits

/**
 * The service's shape.
 *
 * @since 0.1.0
 * @category models
 */
export interface Service {
  /** The backend's short name (`memory`, …). */
  readonly backend: string
  readonly acquire: (name: string, options: PermitOptions) => Effect.Effect<Permits, AcquireError, Scope.Scope>
  readonly tryAcquire: (name: string, options: PermitOptions) => Effect.Effect<Option.Option<Permits>, AcquireError, Scope.Scope>
}

/**
 * The semaphore service tag, provided by the backend layers beside `DistributedLock`.
 *
 * @since 0.1.0
 * @category tags
 */
export class DistributedSemaphore
  extends Context.Tag("effect-lock/DistributedSemaphore")<DistributedSemaphore, Service>()
{}

/** What a permit request asks for besides a lock request: it travels in the store's request. */
interface Ask {
  readonly limit: number
  readonly permits: number
}

/** Where `Permits` keep the lease the core made for them, for `withPermits`' guard. */
const LeaseKey: unique symbol = Symbol.for("effect-lock/DistributedSemaphore/Lease")

/**
 * The permit store seen as a lock store, so that the core's acquire path, registry, renewal loop,
 * loss detection, guard and stall watch serve permits exactly as they serve locks. The request's
 * limit and permits travel in the request itself (`Acquire.Store`'s `extra`).
 */
const asLockStore = <P extends PermitGrant>(semaphore: SemaphoreBackend<P>): Acquire.Store<P, Ask> => ({
  backend: semaphore.backend,
  maxNameBytes: semaphore.maxNameBytes,
  defaultTtl: semaphore.defaultTtl,
  minTtl: semaphore.minTtl,
  renewBatchSize: semaphore.renewBatchSize,
  instantRelease: semaphore.instantRelease,
  renew: semaphore.renew,
  acquire: (request) =>
    Effect.flatMap(semaphore.acquire(request), (result) =>
      result._tag === "LimitMismatch"
        // Carried through the core as a backend error, unwrapped again by `take` below.
        ? Effect.fail(
          new LockBackendError({
            operation: "acquire",
            name: request.name,
            cause: new LimitMismatch({ name: request.name, limit: request.limit, current: result.current })
          })
        )
        : Effect.succeed(result))
})

const unwrapMismatch = (error: DistributedLock.AcquireError): DistributedLock.AcquireError | LimitMismatch =>
  error._tag === "LockBackendError" && error.cause instanceof LimitMismatch ? error.cause : error

const isPositiveInteger = (n: unknown): n is number => typeof n === "number" && Number.isSafeInteger(n) && n >= 1

/** Why `options` cannot be used, or `undefined`; callers may be untyped JS. */
const permitsProblem = (name: string, options: PermitOptions | undefined): InvalidPermits | undefined => {
  const limit = options?.limit
  const permits = options?.permits ?? 1
  if (!isPositiveInteger(limit)) {
    return new InvalidPermits({ name: String(name), reason: `limit must be a positive integer, got ${String(limit)}` })
  }
  if (!isPositiveInteger(permits)) {
    return new InvalidPermits({ name: String(name), reason: `permits must be a positive integer, got ${String(permits)}` })
  }
  if (permits > limit) {
    return new InvalidPermits({ name: String(name), reason: `asked for ${permits} permits of a limit of ${limit}` })
  }
  return undefined
}

const toPermits = (lease: Lease, ask: Ask): Permits => {
  const grant = heldOf(lease)?.grant as PermitGrant | undefined
  const permits: Permits & { readonly [LeaseKey]: Lease } = {
    name: lease.name,
    permits: ask.permits,
    limit: ask.limit,
    tokens: grant?.tokens ?? [lease.token],
    lost: lease.lost,
    isHeld: lease.isHeld,
    [LeaseKey]: lease
  }
  return permits
}

const leaseOf = (permits: Permits): Lease | undefined => (permits as Permits & { readonly [LeaseKey]?: Lease })[LeaseKey]

/**
 * Builds the service over a permit store. Like `DistributedLock.make`, it starts one background
 * fiber, scoped to the caller, that renews every lease of permits this service holds, and closing
 * the scope tells every holder its permits are gone and releases them.
 *
 * @since 0.1.0
 * @category constructors
 */
export const make = <P extends PermitGrant>(
  semaphore: SemaphoreBackend<P>
): Effect.Effect<Service, never, Scope.Scope> =>
  Effect.map(Acquire.make(asLockStore(semaphore)), (core): Service => {
    /** One request; its release goes into `scope`, or the context's Scope when `undefined`. */
    const take = (scope: Scope.Scope | undefined, kind: "acquire" | "try", name: string, options: PermitOptions): Effect.Effect<Option.Option<Permits>, AcquireError, Scope.Scope> => {
      const problem = permitsProblem(name, options)
      if (problem !== undefined) return Effect.fail(problem)
      const ask: Ask = { limit: options.limit, permits: options.permits ?? 1 }
      // "shared": what `inspect`, spans and metrics show for a set of permits (others may hold the name too).
      const lockOptions: DistributedLock.AcquireOptions = { timeout: options.timeout, ttl: options.ttl, mode: "shared" }
      return Effect.mapBoth(scope === undefined ? core.take(kind, name, lockOptions, ask) : core.takeIn(scope, kind, name, lockOptions, ask), {
        onFailure: unwrapMismatch,
        onSuccess: (lease) => Option.map(lease, (l) => toPermits(l, ask))
      })
    }
    const service: Service = {
      backend: semaphore.backend,
      acquire: (name, options) => Effect.flatMap(take(undefined, "acquire", name, options), (permits) => Acquire.granted(name, permits)),
      tryAcquire: (name, options) => take(undefined, "try", name, options)
    }
    // With a scope given, the context's Scope is never read.
    return Acquire.withTakeIn<PermitOptions, Option.Option<Permits>, AcquireError, Service>(service, (scope, kind, name, options) =>
      take(scope, kind, name, options) as Effect.Effect<Option.Option<Permits>, AcquireError>)
  })

type TakesIn = Acquire.TakesIn<PermitOptions, Option.Option<Permits>, AcquireError>

/**
 * A layer providing `DistributedLock` and `DistributedSemaphore` from one backend that stores
 * both (built once, so both services share its store, sessions or connections). A backend layer
 * written as `DistributedLock.layerBackend(makeBackend(options))` provides both by calling this
 * instead, once its backend has a `semaphore`.
 *
 * @since 0.1.0
 * @category layers
 */
export const layerBackend = <G extends Grant, P extends PermitGrant, E, R>(
  backend: Effect.Effect<LockAndSemaphoreBackend<G, P>, E, R>
): Layer.Layer<DistributedLock.DistributedLock | DistributedSemaphore, E, Exclude<R, Scope.Scope>> =>
  Layer.scopedContext(
    Effect.gen(function*() {
      const built = yield* backend
      const lock = yield* DistributedLock.make(built)
      const semaphore = yield* make(built.semaphore)
      return Context.make(DistributedLock.DistributedLock, lock).pipe(Context.add(DistributedSemaphore, semaphore))
    })
  )

/**
 * Waits for `permits` (default 1) of the `limit` permits of `name` and holds them until the
 * enclosing Scope closes. Interruptible while waiting; an interrupted wait leaves no permit behind.
 *
 * @since 0.1.0
 * @category accessors
 */
export const acquire = (
  name: string,
  options: PermitOptions
): Effect.Effect<Permits, AcquireError, DistributedSemaphore | Scope.Scope> =>
  Effect.flatMap(DistributedSemaphore, (semaphore) => semaphore.acquire(name, options))

/**
 * Takes the permits only if they are free now and nobody waits ahead: `None` otherwise. It never
 * waits for permits, but may wait up to `timeout` (default 5 s) for a session or connection.
 *
 * @since 0.1.0
 * @category accessors
 */
export const tryAcquire = (
  name: string,
  options: PermitOptions
): Effect.Effect<Option.Option<Permits>, AcquireError, DistributedSemaphore | Scope.Scope> =>
  Effect.flatMap(DistributedSemaphore, (semaphore) => semaphore.tryAcquire(name, options))

/**
 * Runs an effect holding permits of `name`. If any of them is lost the effect is interrupted and
 * the result is `LockLost`. The effect has fully stopped before the permits are released, also
 * when the caller is interrupted.
 *
 * @since 0.1.0
 * @category combinators
 */
export const withPermits: {
  (
    name: string,
    options: PermitOptions
  ): <A, E, R>(self: Effect.Effect<A, E, R>) => Effect.Effect<A, E | AcquireError | LockLost, R | DistributedSemaphore>
  <A, E, R>(
    self: Effect.Effect<A, E, R>,
    name: string,
    options: PermitOptions
  ): Effect.Effect<A, E | AcquireError | LockLost, R | DistributedSemaphore>
} = dual(
  (args) => Effect.isEffect(args[0]),
  <A, E, R>(self: Effect.Effect<A, E, R>, name: string, options: PermitOptions) =>
    Effect.flatMap(DistributedSemaphore, (semaphore) =>
      Acquire.useGrant(semaphore as TakesIn, () => Effect.asSome(semaphore.acquire(name, options)), "acquire", name, options, (permits, scope) =>
        Effect.flatMap(Acquire.granted(name, permits), (held) => guarded(held, self, scope))))
)

/**
 * Like `withPermits`, but never waits for permits: `None` when they are not free now.
 *
 * @since 0.1.0
 * @category combinators
 */
export const tryWithPermits: {
  (
    name: string,
    options: PermitOptions
  ): <A, E, R>(
    self: Effect.Effect<A, E, R>
  ) => Effect.Effect<Option.Option<A>, E | AcquireError | LockLost, R | DistributedSemaphore>
  <A, E, R>(
    self: Effect.Effect<A, E, R>,
    name: string,
    options: PermitOptions
  ): Effect.Effect<Option.Option<A>, E | AcquireError | LockLost, R | DistributedSemaphore>
} = dual(
  (args) => Effect.isEffect(args[0]),
  <A, E, R>(self: Effect.Effect<A, E, R>, name: string, options: PermitOptions) =>
    Effect.flatMap(DistributedSemaphore, (semaphore) =>
      Acquire.useGrant(semaphore as TakesIn, () => semaphore.tryAcquire(name, options), "try", name, options, (permits, scope) =>
        Option.isSome(permits) ? Effect.asSome(guarded(permits.value, self, scope)) : Effect.succeedNone))
)

/** `self` under the core's guard of the permits' lease: interrupted on loss, stopped before release. */
const guarded = <A, E, R>(permits: Permits, self: Effect.Effect<A, E, R>, scope?: Scope.Scope): Effect.Effect<A, E | LockLost, R> => {
  const lease = leaseOf(permits)
  return lease === undefined
    ? Effect.dieMessage("effect-lock: withPermits was given permits this library did not make")
    : internalGuard(lease, self, scope)
}

/**
 * The guarantees every permit store keeps (`DistributedSemaphore` over a `SemaphoreBackend`),
 * written once and run against each backend: the memory backend under TestClock, the lease
 * backends on a real database with short real durations. Each `makeBackend` is one "process" of
 * the cluster (its own store connection, registry and renewals); the store's own view of a
 * semaphore (`state`) is read from the store, never from a process.
 *
 * Nothing here sleeps to synchronise: each step waits, with a bound, for what it needs to see
 * (a waiter queued in the store, a holder holding, a renewal made).
 */
import { describe, expect, it } from "@effect/vitest"
import * as Cause from "effect/Cause"
import * as Clock from "effect/Clock"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import * as DistributedSemaphore from "effect-lock/DistributedSemaphore"
import type { PermitRequest, SemaphoreBackend } from "effect-lock/LockBackend"
import { LockBackendError } from "effect-lock/LockError"
import { timeoutOption } from "effect-lock/internal/runtime/stallSafe"
import {
  expectPlaceWrittenEarly,
  expectDeadlineBeforeExpiry,
  expectToldAtDeadline,
  passOn,
  storeExpiryOn,
  failureOf,
  freshName,
  INTERRUPT_BOUND,
  NO_PLACES,
  PLACE_CASE,
  placeLeftAtWrites,
  TIGHT_YIELD_BUDGET,
  UNINTERRUPTIBLE_INTERRUPT_CASE,
  waitUntil,
  withYieldBudget
} from "./contract.js"
import { yieldTimes } from "./faults.js"
import { monotonicMillis } from "effect-lock/internal/core/clock"
import { safetyDeadlineOf } from "effect-lock/internal/core/registry"
import { occupancy } from "./occupancy.js"
import { seededRandom, somewhen, testSeed } from "./random.js"

/** A semaphore as the store has it right now: live permits held, and the permits each live waiter asks for, in queue order. */
export interface StoreState {
  readonly held: number
  readonly waiting: ReadonlyArray<number>
}

export interface SemaphoreTarget {
  /** Runs tests on the TestClock (`scoped`) or on real time (`scopedLive`). */
  readonly clock: "test" | "live"
  /** Lease length of the permits (at least the backend's floor). */
  readonly ttl: Duration.Duration
  /** Builds the permit store of one "process"; each call is a separate process of the cluster. */
  // biome-ignore: each backend has its own grant type; the suite only passes grants back to it.
  readonly makeBackend: Effect.Effect<SemaphoreBackend<any>, unknown, Scope.Scope>
  /** The semaphore `name` as the store has it (not as a process knows it). */
  readonly state: (name: string) => Effect.Effect<StoreState, unknown>
  /** Takes every permit of `name` away in the store: holders learn it (`revoked`) from the store. */
  readonly revoke: (name: string) => Effect.Effect<void, unknown>
  /** Lets time pass: TestClock.adjust, or a real sleep. */
  readonly advance: (duration: Duration.Duration) => Effect.Effect<void>
  /** Permit requests per fiber in the exclusion test (each a grant and a release). */
  readonly rounds: number
  /**
   * Longest a give-back may take to show in the store (a timed-out waiter's place, an interrupted
   * attempt's permits): well under the place's and the permits' own expiry, so that expiry cannot
   * explain it.
   */
  readonly giveBackBound: Duration.Duration
  /**
   * No store operation in flight in any process `makeBackend` built (for stores whose
   * operations take time: statements on the wire). An acquire interrupted at the wrong moment
   * leaves a statement that may still grant, and its give-back follows it: a check that nothing
   * is left waits for this too, and a test never ends (closing its processes) before it.
   * Absent: always quiet (an in-process store). Per name, so that cases on other names running
   * side by side do not keep it from being quiet.
   */
  readonly quiet?: ((name: string) => Effect.Effect<boolean>) | undefined
  /**
   * Session-bound permits (PgAdvisory's): no ttl, no renewal, no revoking in the store; lost only
   * with their session. The cases about renewals, expiry and revoking do not apply and are
   * skipped, saying why.
   */
  readonly sessionBound?: boolean | undefined
  /**
   * What is left (ms, by the store's clock) of each live waiting place of `name`. Absent where
   * waits do not queue in places of the store: the case about keeping a place is skipped.
   */
  readonly placesLeft?: ((name: string) => Effect.Effect<ReadonlyArray<number>, unknown>) | undefined
  /**
   * When the store lets the earliest live permits of `name` go unless renewed: the store's time in
   * ms since the epoch (this host's wall clock). Absent (TestClock): the moment before the acquire
   * plus its ttl.
   */
  readonly permitsExpireAt?: ((name: string) => Effect.Effect<number, unknown>) | undefined
}

/** What a test can make a wrapped store do, and what it saw. */
interface Faults {
  failRenew: boolean
  hangRenew: boolean
  renewCalls: number
  /** Runs after each of the store's waits ends, before it looks again (a slow wake-up). */
  afterWait: Effect.Effect<void>
  /** The latest grant's `validUntil` (monotonic ms), as the store answered it. */
  validUntil: number | undefined
}

const makeFaults = (): Faults => ({ failRenew: false, hangRenew: false, renewCalls: 0, afterWait: Effect.void, validUntil: undefined })

/** Every token the stores granted, by semaphore name, in the order the grants came back. */
const granted = new Map<string, Array<bigint>>()

/** The store with renewals that fail or hang on demand (a real store cannot do that on demand), recording its grants' tokens. */
// biome-ignore: the grant type is the store's own.
const withFaults = (backend: SemaphoreBackend<any>, faults: Faults): SemaphoreBackend<any> => ({
  ...backend,
  acquire: (request) =>
    Effect.tap(backend.acquire({
      ...request,
      waitUntilDeadline: (step) => Effect.zipLeft(request.waitUntilDeadline(step), Effect.suspend(() => faults.afterWait))
    }), (result) =>
      Effect.sync(() => {
        if (result._tag !== "Granted") return
        faults.validUntil = Option.getOrUndefined(result.grant.validUntil)
        let tokens = granted.get(request.name)
        if (tokens === undefined) granted.set(request.name, tokens = [])
        tokens.push(...result.grant.tokens)
      })),
  renew: (grants) =>
    Effect.gen(function*() {
      faults.renewCalls++
      if (faults.hangRenew) return yield* Effect.never
      if (faults.failRenew) return yield* new LockBackendError({ operation: "renew", cause: new Error("injected: store unreachable") })
      return yield* backend.renew(grants)
    })
})

const LIMIT = 3
const PROCESSES = 3
const FIBERS_PER_PROCESS = 3
/**
 * The ttl of grants in cases not about expiry or renewal (the interruption cases: a grant left
 * behind would outlive every bound here; the order cases: a 3 s lease whose renewals a loaded host
 * starved past its safety margin expired mid-case, and the waiters it held back were served).
 */
const LONG_TTL = Duration.seconds(60)

/** Dies naming the exit of the first of `fibers` that has ended: a waiter that failed would otherwise show only as a place never seen. */
const stillWaiting = (fibers: ReadonlyArray<Fiber.Fiber<unknown, unknown>>): Effect.Effect<void> =>
  Effect.forEach(fibers, (fiber, i) =>
    Effect.flatMap(Fiber.poll(fiber), (done) =>
      Option.isSome(done)
        ? Effect.dieMessage(`waiter ${i + 1} of those watched ended while it should wait: ${Exit.isFailure(done.value) ? Cause.pretty(done.value.cause) : "succeeded"}`)
        : Effect.void), { discard: true })

export const semaphoreContractSuite = (label: string, target: SemaphoreTarget) => {
  const base = target.clock === "test" ? it.scoped : it.scopedLive
  const live = target.clock === "live"
  const ttlMillis = Duration.toMillis(target.ttl)

  const node = (faults: Faults = makeFaults()) =>
    Effect.flatMap(target.makeBackend, (backend) => DistributedSemaphore.make(withFaults(backend, faults)))
  const until = <E, R>(what: string | (() => string), condition: Effect.Effect<boolean, E, R>) => waitUntil(target.clock, what, condition)
  /** Until the store's state of `name` satisfies `holds`; past the bound, the message says what was last read. */
  const stateWhere = (name: string, what: string, holds: (state: StoreState) => boolean, watched: ReadonlyArray<Fiber.Fiber<unknown, unknown>> = []) => {
    let seen = "nothing read yet"
    return until(
      () => `"${name}" ${what} in the store (last read: ${seen})`,
      Effect.zipRight(
        stillWaiting(watched),
        Effect.map(target.state(name), (state) => {
          seen = JSON.stringify(state)
          return holds(state)
        })
      )
    )
  }
  const stateIs = (name: string, expected: StoreState) =>
    stateWhere(name, `is ${JSON.stringify(expected)}`, (state) => JSON.stringify(state) === JSON.stringify(expected))
  /** Until `name`'s live places are `permits` in order; fails at once naming how, if a `watched` waiter ended meanwhile. */
  const waitingAre = (name: string, permits: ReadonlyArray<number>, ...watched: Array<Fiber.Fiber<unknown, unknown>>) =>
    stateWhere(name, `has waiters ${JSON.stringify(permits)}`, (state) => JSON.stringify(state.waiting) === JSON.stringify(permits), watched)
  const heldIs = (name: string, held: number) =>
    until(`"${name}" has ${held} permits held in the store`, Effect.map(target.state(name), (state) => state.held === held))
  /** Until `condition` holds, failing if it took longer than `bound` of Clock time (0 on the TestClock). */
  const within = <E, R>(what: string, bound: Duration.Duration, condition: Effect.Effect<boolean, E, R>) =>
    Effect.gen(function*() {
      const start = yield* Clock.currentTimeMillis
      yield* until(what, condition)
      const took = (yield* Clock.currentTimeMillis) - start
      expect(took, `${what}: took ${took} ms`).toBeLessThanOrEqual(Duration.toMillis(bound))
    })
  /**
   * Nothing of `name` is left in the store and no operation is in flight, on three looks in a row
   * (a fiber forked just before has had turns to reach its statement by then).
   */
  const leftNothing = (name: string) => {
    let streak = 0
    return Effect.flatMap(target.quiet?.(name) ?? Effect.succeed(true), (quiet) =>
      Effect.map(target.state(name), (state) => {
        streak = quiet && state.held === 0 && state.waiting.length === 0 ? streak + 1 : 0
        return streak >= 3
      }))
  }
  /** A pause for sweeps: `n` yields on the TestClock, `n % 6` ms on real time. */
  const pause = (n: number) => (live ? Effect.sleep(Duration.millis(n % 6)) : yieldTimes(n))
  const provide = (service: DistributedSemaphore.Service) => Effect.provideService(DistributedSemaphore.DistributedSemaphore, service)
  /** Holds the permits in a scope of its own, closed by `release`. */
  const hold = (service: DistributedSemaphore.Service, name: string, options: DistributedSemaphore.PermitOptions) =>
    Effect.gen(function*() {
      const scope = yield* Scope.make()
      // Cases about expiry pass the target's ttl; others hold through any stall of a loaded host.
      const permits = yield* Scope.extend(service.acquire(name, { ttl: LONG_TTL, ...options }), scope)
      return { permits, release: Scope.close(scope, Exit.void) }
    })

  // Every case runs twice: as is, and with the runtime switching fibers every few ops (so that
  // step-to-step races happen), as the lock contract does.
  for (const budget of [undefined, TIGHT_YIELD_BUDGET]) {
    const tight = budget === undefined ? <A, E, R>(self: Effect.Effect<A, E, R>) => self : withYieldBudget(budget)
    /** A case: on real time run side by side with the others (each on names of its own), as most of it is waiting. */
    const spec = (name: string, body: () => Effect.Effect<unknown, unknown, Scope.Scope>, timeout?: number, alone?: boolean) =>
      base(name, () => tight(body()), { concurrent: live && alone !== true, ...(timeout === undefined ? {} : { timeout }) })
    /** A case about renewals, expiry or revoking: skipped for session-bound permits, which have none. */
    const leaseSpec = (name: string, body: () => Effect.Effect<unknown, unknown, Scope.Scope>) =>
      target.sessionBound === true ? base.skip(`${name} (session-bound permits: no ttl, no renewal, no revoking)`, body) : spec(name, body)
    /** A case on real time whatever the target's clock (see `UNINTERRUPTIBLE_INTERRUPT_CASE`). */
    const liveSpec = (name: string, body: () => Effect.Effect<unknown, unknown, Scope.Scope>) =>
      it.scopedLive(name, () => tight(body()), { concurrent: live })
    const title = budget === undefined ? "the semaphore contract" : `the semaphore contract, yielding every ${budget} ops`
    cases(`${label}: ${title}`, spec, leaseSpec, liveSpec, budget)
  }

  function cases(
    title: string,
    spec: (name: string, body: () => Effect.Effect<unknown, unknown, Scope.Scope>, timeout?: number, alone?: boolean) => void,
    leaseSpec: (name: string, body: () => Effect.Effect<unknown, unknown, Scope.Scope>) => void,
    liveSpec: (name: string, body: () => Effect.Effect<unknown, unknown, Scope.Scope>) => void,
    budget: number | undefined
  ) {
  describe(title, () => {
      spec(`never more than limit permits held across ${PROCESSES} processes × ${FIBERS_PER_PROCESS} fibers`, () =>
        Effect.gen(function*() {
          const seed = testSeed()
          const random = seededRandom(seed)
          const name = freshName("limit")
          const services = yield* Effect.forEach(Array.from({ length: PROCESSES }), () => node())
          // Steps inside, so other fibers (and on real time other grants) run while they are held.
          const probe = occupancy(LIMIT, Effect.zipRight(yieldTimes(3), live ? Effect.sleep(Duration.millis(2)) : Effect.void))
          const body = probe.body
          const plans = Array.from(
            { length: PROCESSES * FIBERS_PER_PROCESS },
            () => Array.from({ length: target.rounds }, () => 1 + Math.floor(random() * LIMIT))
          )
          yield* Effect.forEach(
            plans,
            (plan, i) =>
              Effect.forEach(
                plan,
                (permits) => body(permits).pipe(DistributedSemaphore.withPermits(name, { limit: LIMIT, permits }), provide(services[i % PROCESSES]!)),
                { discard: true }
              ),
            { concurrency: "unbounded", discard: true }
          )
          const context = `seed ${seed} (re-run with EFFECT_LOCK_TEST_SEED=${seed})`
          expect(probe.violations(), context).toBe(0)
          // The check could fail: every permit was in use at some moment.
          expect(probe.most(), context).toBe(LIMIT)
          // No token was handed out twice (two grants decided on the same state would share some).
          const tokens = granted.get(name) ?? []
          expect(tokens.length, context).toBeGreaterThanOrEqual(plans.flat().reduce((n, permits) => n + permits, 0))
          expect(new Set(tokens).size, context).toBe(tokens.length)
          yield* stateIs(name, { held: 0, waiting: [] })
        }), 60_000)

    spec("each permit carries a fencing token: consecutive within a grant, strictly increasing per name across processes", () =>
      Effect.gen(function*() {
        const [a, b] = [yield* node(), yield* node()]
        const name = freshName("tokens")
        const first = yield* hold(a, name, { limit: 5, permits: 3 })
        const second = yield* hold(b, name, { limit: 5, permits: 2 })
        // Tokens come from a counter per name or per store (memory): consecutive within a grant,
        // increasing across grants, whatever the counter's start.
        const [t] = first.permits.tokens
        expect(first.permits.tokens).toEqual([t!, t! + 1n, t! + 2n])
        expect(second.permits.tokens[0]! > t! + 2n).toBe(true)
        expect(second.permits.tokens).toEqual([second.permits.tokens[0]!, second.permits.tokens[0]! + 1n])
        expect([first.permits.permits, first.permits.limit, second.permits.permits, second.permits.limit]).toEqual([3, 5, 2, 5])
        yield* first.release
        yield* second.release
        let last = second.permits.tokens[1]!
        for (let i = 0; i < 4; i++) {
          const permits = 1 + (i % 3)
          const tokens = yield* Effect.scoped(Effect.map((i % 2 === 0 ? b : a).acquire(name, { limit: 5, permits }), (p) => p.tokens))
          expect(tokens).toHaveLength(permits)
          expect(tokens[0]! > last).toBe(true)
          for (let k = 1; k < tokens.length; k++) expect(tokens[k]).toBe(tokens[k - 1]! + 1n)
          last = tokens[tokens.length - 1]!
        }
        // Another name gets a token too (from its own counter, or the store's one).
        const other = (yield* Effect.scoped(a.acquire(freshName("tokens-other"), { limit: 1 }))).tokens
        expect(other).toHaveLength(1)
        expect(other[0]! > 0n).toBe(true)
      }))

    spec("a name held with one limit refuses another with LimitMismatch; a free name takes any limit", () =>
      Effect.gen(function*() {
        const [a, b] = [yield* node(), yield* node()]
        const name = freshName("mismatch")
        const held = yield* hold(a, name, { limit: 3 })
        yield* heldIs(name, 1)
        const error = yield* failureOf(Effect.scoped(b.acquire(name, { limit: 4 })))
        expect(error).toBeInstanceOf(DistributedSemaphore.LimitMismatch)
        expect(error).toMatchObject({ _tag: "LimitMismatch", name, limit: 4, current: 3 })
        expect(yield* failureOf(Effect.scoped(b.tryAcquire(name, { limit: 2 })))).toMatchObject({ _tag: "LimitMismatch", current: 3 })
        // The same limit is fine.
        expect((yield* Effect.scoped(b.acquire(name, { limit: 3, permits: 2 }))).tokens).toHaveLength(2)
        yield* held.release
        yield* stateIs(name, { held: 0, waiting: [] })
        const fresh = yield* Effect.scoped(b.acquire(name, { limit: 4, permits: 4 }))
        expect(fresh.limit).toBe(4)
      }))

    spec("a waiter alone keeps the limit: with no holder left, another limit is refused until it leaves", () =>
      Effect.gen(function*() {
        const a = yield* node()
        const store = yield* target.makeBackend
        const name = freshName("waiter-limit")
        const holder = yield* hold(a, name, { limit: 1 })
        // A waiter that never looks again: it keeps its place in the store without retrying.
        const request: PermitRequest = {
          name,
          mode: "shared",
          attempt: "wait",
          ttl: target.ttl,
          deadline: Option.none(),
          interruptible: (step) => step,
          waitUntilDeadline: () => Effect.never,
          onLost: () => Effect.void,
          limit: 1,
          permits: 1
        }
        const frozen = yield* Effect.fork(store.acquire(request))
        yield* waitingAre(name, [1])
        yield* holder.release
        yield* stateIs(name, { held: 0, waiting: [1] })
        expect(yield* failureOf(Effect.scoped(a.acquire(name, { limit: 2, timeout: 0 })))).toMatchObject({
          _tag: "LimitMismatch",
          current: 1
        })
        expect(yield* failureOf(Effect.scoped(a.tryAcquire(name, { limit: 3 })))).toMatchObject({ _tag: "LimitMismatch", current: 1 })
        // Leaving gives the place up: the name is free for any limit.
        yield* Fiber.interrupt(frozen)
        yield* stateIs(name, { held: 0, waiting: [] })
        expect((yield* Effect.scoped(a.acquire(name, { limit: 2 }))).limit).toBe(2)
      }))

    spec("releasing 2 of 3 permits wakes the waiters that fit, in order; the next waits for its 3", () =>
      Effect.gen(function*() {
        const [a, b, c] = [yield* node(), yield* node(), yield* node()]
        const name = freshName("wake")
        const two = yield* hold(a, name, { limit: 3, permits: 2 })
        const one = yield* hold(a, name, { limit: 3 })
        const granted: Array<string> = []
        const wait = (service: DistributedSemaphore.Service, who: string, permits: number) =>
          Effect.fork(
            Effect.scoped(
              Effect.zipRight(Effect.tap(service.acquire(name, { limit: 3, permits, ttl: LONG_TTL }), () => Effect.sync(() => granted.push(who))), Effect.never)
            )
          )
        const w1 = yield* wait(b, "w1", 1)
        yield* waitingAre(name, [1], w1)
        const w2 = yield* wait(c, "w2", 1)
        yield* waitingAre(name, [1, 1], w1, w2)
        const w3 = yield* wait(b, "w3", 3)
        yield* waitingAre(name, [1, 1, 3], w1, w2, w3)
        yield* two.release
        yield* until("w1 and w2 hold", Effect.sync(() => granted.length === 2))
        expect([...granted].sort()).toEqual(["w1", "w2"])
        yield* stateIs(name, { held: 3, waiting: [3] })
        // w3 needs every permit: it is served once the three single holders are gone.
        yield* one.release
        yield* Fiber.interrupt(w1)
        yield* stateIs(name, { held: 1, waiting: [3] })
        expect(granted).toHaveLength(2)
        yield* Fiber.interrupt(w2)
        yield* until("w3 holds", Effect.sync(() => granted.length === 3))
        yield* stateIs(name, { held: 3, waiting: [] })
        yield* Fiber.interrupt(w3)
        yield* stateIs(name, { held: 0, waiting: [] })
      }))

    spec("waiters are served in order: a big request is not overtaken by smaller ones behind it, nor by a newcomer", () =>
      Effect.gen(function*() {
        const [a, b] = [yield* node(), yield* node()]
        const name = freshName("fifo")
        const holder = yield* hold(a, name, { limit: 3, permits: 2 })
        const big = yield* Effect.fork(Effect.scoped(Effect.map(b.acquire(name, { limit: 3, permits: 2, ttl: LONG_TTL }), (p) => p.tokens)))
        yield* waitingAre(name, [2])
        // One permit is free, but taking it would overtake the waiter ahead: a newcomer waits.
        expect(yield* Effect.scoped(a.tryAcquire(name, { limit: 3 }))).toEqual(Option.none())
        expect(yield* Effect.scoped(b.tryAcquire(name, { limit: 3 }))).toEqual(Option.none())
        const small = yield* Effect.fork(Effect.scoped(Effect.map(a.acquire(name, { limit: 3, ttl: LONG_TTL }), (p) => p.tokens)))
        // Queued behind the big one, with a permit free: it does not take it.
        yield* waitingAre(name, [2, 1])
        expect(yield* target.state(name)).toEqual({ held: 2, waiting: [2, 1] })
        expect(yield* Fiber.poll(small)).toEqual(Option.none())
        yield* holder.release
        // Both fit once the holder is gone (they may then take their permits in either order).
        const [bigTokens, smallTokens] = [yield* Fiber.join(big), yield* Fiber.join(small)]
        expect([bigTokens.length, smallTokens.length]).toEqual([2, 1])
        yield* stateIs(name, { held: 0, waiting: [] })
      }))

    spec("waiters of equal size are served first in, first out", () =>
      Effect.gen(function*() {
        const [a, b, c, d] = [yield* node(), yield* node(), yield* node(), yield* node()]
        const name = freshName("fifo-equal")
        const holder = yield* hold(a, name, { limit: 2, permits: 2 })
        const order: Array<string> = []
        // Each waiter keeps its permit until the test lets it go, so that the next grant needs a release.
        const letGo = yield* Deferred.make<void>()
        const waiters: Array<Fiber.RuntimeFiber<unknown, unknown>> = []
        for (const [who, service] of [["a", b], ["b", c], ["c", d]] as const) {
          waiters.push(yield* Effect.fork(Effect.scoped(
            Effect.zipRight(
              Effect.tap(service.acquire(name, { limit: 2, permits: 2, ttl: LONG_TTL }), () => Effect.sync(() => order.push(who))),
              Deferred.await(letGo)
            )
          )))
          // Each is queued before the next one arrives.
          yield* waitingAre(name, Array.from({ length: waiters.length }, () => 2), ...waiters)
        }
        yield* holder.release
        yield* until("a holds", Effect.sync(() => order.length === 1))
        yield* stateIs(name, { held: 2, waiting: [2, 2] })
        yield* Deferred.succeed(letGo, void 0)
        yield* Effect.forEach(waiters, Fiber.join, { discard: true })
        expect(order).toEqual(["a", "b", "c"])
        yield* stateIs(name, { held: 0, waiting: [] })
      }))

    spec("a try never overtakes a waiter: with the permits just released and the waiter not yet back, a try finds them busy", () =>
      Effect.gen(function*() {
        // The waiter's next look after a wait is held back: a slow wake-up, its place still queued.
        const back = yield* Effect.makeLatch(false)
        const slow = { ...makeFaults(), afterWait: back.await }
        const [a, b, c] = [yield* node(), yield* node(slow), yield* node()]
        const name = freshName("no-overtake")
        const holder = yield* hold(a, name, { limit: 1 })
        const done = yield* Effect.makeLatch(false)
        const waiter = yield* Effect.fork(Effect.scoped(Effect.flatMap(b.acquire(name, { limit: 1, ttl: LONG_TTL }), (p) => Effect.as(done.await, p.tokens))))
        yield* waitingAre(name, [1])
        yield* holder.release
        yield* heldIs(name, 0)
        expect(yield* Effect.scoped(c.tryAcquire(name, { limit: 1 }))).toEqual(Option.none())
        yield* back.open
        yield* done.open
        expect(yield* Fiber.join(waiter)).toHaveLength(1)
        yield* stateIs(name, { held: 0, waiting: [] })
      }))

    spec("withPermits called from an uninterruptible region (a finalizer) ends with its body", () =>
      Effect.gen(function*() {
        const a = yield* node()
        const name = freshName("uninterruptible-permits")
        const inFinalizer = Effect.scoped(Effect.addFinalizer(() =>
          Effect.orDie(provide(a)(DistributedSemaphore.withPermits(Effect.void, name, { limit: 2 })))))
        // Disconnected: one that hangs fails here at the bound instead of holding the case.
        const ended = yield* timeoutOption(Effect.disconnect(inFinalizer), Duration.seconds(live ? 5 : 60))
        expect(Option.isSome(ended), "withPermits in a finalizer ended within 5 s").toBe(true)
        yield* stateIs(name, { held: 0, waiting: [] })
      }))

    liveSpec(UNINTERRUPTIBLE_INTERRUPT_CASE, () =>
      Effect.gen(function*() {
        const [a, b, c] = [yield* node(), yield* node(), yield* node()]
        const name = freshName("uninterruptible-interrupted")
        // LONG_TTL (60 s): neither the holder's release nor its expiry can end the wait within INTERRUPT_BOUND.
        const holder = yield* hold(a, name, { limit: 1 })
        // No timeout: only the interrupt (or the waiter's process closing) can end this wait.
        const waiter = yield* Effect.fork(Effect.uninterruptible(Effect.scoped(b.acquire(name, { limit: 1, ttl: LONG_TTL }))))
        // On real time whatever the target's clock (`waitingAre` waits on the target's).
        yield* waitUntil("live", `"${name}" has the waiter queued in the store`,
          Effect.zipRight(stillWaiting([waiter]), Effect.map(target.state(name), (state) => state.held === 1 && state.waiting.length === 1)))
        const started = Date.now()
        // Stall-safe (the library's own timeout): an interrupt that returned is read before the bound is judged.
        const ended = yield* timeoutOption(Fiber.interrupt(waiter), INTERRUPT_BOUND)
        const took = Date.now() - started
        if (Option.isNone(ended)) {
          return expect.fail(`the interrupt of the waiting uninterruptible acquire did not return within ${Duration.format(INTERRUPT_BOUND)}`)
        }
        expect(Exit.isInterrupted(ended.value), `the waiter's exit after ${took} ms: ${ended.value._tag}`).toBe(true)
        // Its place given up rather than left to expire (5 s on the lease stores): within the
        // store's give-back bound, or, an in-process store's, by the time the interrupt returned.
        // The holder's permit is untouched.
        const placeGone = Effect.map(target.state(name), (state) => state.held === 1 && state.waiting.length === 0)
        if (live) yield* within("the waiter's place is given up", target.giveBackBound, placeGone)
        else expect(yield* target.state(name)).toEqual({ held: 1, waiting: [] })
        expect(yield* Effect.scoped(c.tryAcquire(name, { limit: 1 }))).toEqual(Option.none())
        yield* holder.release
        // No waiter of `b` ahead of it (a try never overtakes a waiter): a try right after the release gets the permit.
        expect(Option.isSome(yield* Effect.scoped(c.tryAcquire(name, { limit: 1 })))).toBe(true)
        yield* waitUntil("live", `nothing is left of "${name}"`, leftNothing(name))
      }))

    spec("closing a process ends its waits, also without a timeout: the waiter fails at once and the process closes", () =>
      Effect.gen(function*() {
        const a = yield* node()
        const name = freshName("close-ends-wait")
        const holder = yield* hold(a, name, { limit: 1 })
        const bScope = yield* Scope.make()
        const b = yield* Scope.extend(node(), bScope)
        const waiter = yield* Effect.fork(Effect.scoped(b.acquire(name, { limit: 1, ttl: LONG_TTL })))
        yield* waitingAre(name, [1], waiter)
        // Well under a close's own 10 s bound on acquisitions in flight; disconnected, so that a
        // close (uninterruptible) that hangs fails here instead of holding the case.
        const closed = yield* timeoutOption(Effect.disconnect(Scope.close(bScope, Exit.void)), Duration.seconds(live ? 5 : 60))
        expect(Option.isSome(closed), "the waiter's process closed within 5 s").toBe(true)
        const error = yield* failureOf(Fiber.join(waiter))
        expect(error).toMatchObject({ _tag: "LockBackendError" })
        yield* holder.release
        yield* stateIs(name, { held: 0, waiting: [] })
      }))

    if (target.placesLeft === undefined) {
      base.skip(`${PLACE_CASE}${NO_PLACES}`, () => Effect.void)
    } else {
      const placesLeft = target.placesLeft
      spec(PLACE_CASE, () =>
        Effect.gen(function*() {
          const [a, b] = [yield* node(), yield* node()]
          const name = freshName("place-kept")
          const holder = yield* hold(a, name, { limit: 1 })
          const waiter = yield* Effect.fork(Effect.scoped(b.acquire(name, { limit: 1, ttl: LONG_TTL, timeout: Duration.seconds(30) })))
          const atWrites = yield* placeLeftAtWrites(placesLeft, name)
          yield* Fiber.interrupt(waiter)
          yield* holder.release
          yield* stateIs(name, { held: 0, waiting: [] })
          expectPlaceWrittenEarly(atWrites)
        }))
    }

    spec("a timed-out wait fails with LockTimeout and gives its place up at once: the waiter behind it is served", () =>
      Effect.gen(function*() {
        const [a, b, c] = [yield* node(), yield* node(), yield* node()]
        const name = freshName("timeout")
        const holder = yield* hold(a, name, { limit: 2 })
        // The small waiter's process has its connection open before the big one's timeout runs.
        yield* Effect.scoped(c.tryAcquire(freshName("warm"), { limit: 1 }))
        // 3 s: both must be seen queued before it runs out. With 1 s, on a loaded machine in a fresh
        // clone, the big wait timed out before the small one's place was seen ([2, 1] never came).
        const big = yield* Effect.fork(Effect.scoped(b.acquire(name, { limit: 2, permits: 2, timeout: Duration.seconds(3) })))
        yield* waitingAre(name, [2])
        const small = yield* Effect.fork(Effect.scoped(Effect.zipRight(c.acquire(name, { limit: 2, ttl: LONG_TTL }), Effect.never)))
        yield* waitingAre(name, [2, 1])
        yield* target.advance(Duration.millis(3_100))
        const error = yield* failureOf(Fiber.join(big))
        expect(error).toMatchObject({ _tag: "LockTimeout", name })
        // The place was given up, not left to expire: the single permit free goes to the waiter behind.
        yield* within("the waiter behind is served", target.giveBackBound, Effect.map(target.state(name), (s) => s.held === 2 && s.waiting.length === 0))
        yield* Fiber.interrupt(small)
        yield* holder.release
        yield* stateIs(name, { held: 0, waiting: [] })
      }))

    spec("an interrupted wait leaves no permit and no place behind, also when it is woken meanwhile", () =>
        Effect.gen(function*() {
          const [a, b, c] = [yield* node(), yield* node(), yield* node()]
          const name = freshName("interrupted")
          const sweeps = live ? 12 : 60
          for (let at = 0; at < sweeps; at++) {
            const holder = yield* hold(a, name, { limit: 2, permits: 2 })
            const first = yield* Effect.fork(Effect.scoped(Effect.zipRight(b.acquire(name, { limit: 2, permits: 2, ttl: LONG_TTL }), Effect.never)))
            yield* waitingAre(name, [2])
            const second = yield* Effect.fork(Effect.scoped(c.acquire(name, { limit: 2, ttl: LONG_TTL })))
            yield* waitingAre(name, [2, 1])
            // The release wakes `first`; it is interrupted a sweep later — before, while or after it takes its permits.
            yield* Effect.fork(holder.release)
            yield* pause(at)
            yield* Fiber.interrupt(first)
            // Whatever happened to `first`, its permits reach `second`, and nothing stays behind.
            yield* within(
              `the second waiter is served (interrupted after ${at})`,
              target.giveBackBound,
              Effect.map(Fiber.poll(second), Option.isSome)
            )
            expect((yield* Fiber.join(second)).permits).toBe(1)
            yield* within(`nothing is left (interrupted after ${at})`, target.giveBackBound, leftNothing(name))
          }
          // Uncontended: interrupted at any point of its grant, an acquire leaves nothing.
          for (let at = 0; at < sweeps; at++) {
            const free = freshName("interrupted-free")
            const taker = yield* Effect.fork(Effect.scoped(Effect.zipRight(a.acquire(free, { limit: 2, ttl: LONG_TTL }), Effect.never)))
            yield* pause(at)
            yield* Fiber.interrupt(taker)
            yield* within(`nothing is left of "${free}"`, target.giveBackBound, leftNothing(free))
          }
        }), 60_000)

    // Issue 35: an interrupt returns only once the acquire has let go (as `acquireRelease` makes
    // acquisition uninterruptible): nothing of it is held, queued or in flight at the store.
    // Alone, not beside the other cases: 60 busy rounds would starve their waits on 2 cores.
    if (budget !== undefined) {
      spec("an interrupted permit acquire has let go when the interrupt returns: another process's tryAcquire of every permit succeeds at once", () =>
        Effect.gen(function*() {
          const seed = testSeed()
          const random = seededRandom(seed)
          const [a, b, c] = [yield* node(), yield* node(), yield* node()]
          const moment = () => somewhen(random, live)
          const kinds = ["acquire, free", "acquire behind a holder", "tryAcquire"] as const
          for (let round = 0; round < 20; round++) {
            for (const kind of kinds) {
              const name = freshName("interrupted-let-go")
              const permits = 1 + Math.floor(random() * 2)
              const holder = kind === "acquire behind a holder" ? yield* hold(c, name, { limit: 2, permits: 2 }) : undefined
              const taking: Effect.Effect<unknown, unknown, Scope.Scope> = kind === "tryAcquire"
                ? a.tryAcquire(name, { limit: 2, permits, ttl: LONG_TTL })
                : a.acquire(name, { limit: 2, permits, ttl: LONG_TTL })
              const taker = yield* Effect.fork(Effect.scoped(Effect.zipRight(taking, Effect.never)))
              // The holder lets go at a random moment of its own, before or after the interrupt.
              const released = holder === undefined ? undefined : yield* Effect.fork(Effect.zipRight(moment(), holder.release))
              yield* moment()
              yield* Fiber.interrupt(taker)
              if (released !== undefined) yield* Fiber.join(released)
              const got = yield* Effect.scoped(Effect.map(b.tryAcquire(name, { limit: 2, permits: 2 }), Option.isSome))
              expect(got, `${kind} of ${permits}, round ${round}: refused right after the interrupt returned; seed ${seed} (re-run with EFFECT_LOCK_TEST_SEED=${seed})`).toBe(true)
            }
          }
        }), 60_000, true)
    }

    leaseSpec("permits taken away in the store interrupt the withPermits body with LockLost carrying the first token", () =>
      Effect.gen(function*() {
        const service = yield* node()
        const name = freshName("lost")
        const started = yield* Deferred.make<ReadonlyArray<bigint>>()
        let finalized = false
        const body = Effect.gen(function*() {
          const permits = yield* Effect.scoped(DistributedSemaphore.acquire(freshName("lost-other"), { limit: 1 }))
          yield* Deferred.succeed(started, permits.tokens)
          yield* Effect.never
        }).pipe(Effect.ensuring(Effect.sync(() => (finalized = true))))
        const run = yield* Effect.fork(body.pipe(DistributedSemaphore.withPermits(name, { limit: 4, permits: 2, ttl: target.ttl }), provide(service)))
        yield* Deferred.await(started)
        yield* heldIs(name, 2)
        yield* target.revoke(name)
        // Lease stores tell at the next renewal (ttl/3).
        yield* target.advance(Duration.millis(ttlMillis / 2))
        const error = yield* failureOf(Fiber.join(run))
        expect(error).toMatchObject({ _tag: "LockLost", name, reason: "revoked" })
        expect(error._tag === "LockLost" && error.token > 0n).toBe(true)
        expect(finalized).toBe(true)
      }))

    leaseSpec("renewal keeps permits far past their ttl: nobody else gets them meanwhile", () =>
      Effect.gen(function*() {
        const faults = makeFaults()
        const [a, b] = [yield* node(faults), yield* node()]
        const name = freshName("renewed")
        const held = yield* a.acquire(name, { limit: 2, permits: 2, ttl: target.ttl })
        // Twice the ttl, as the lock's case: the permits outlive it only if renewed.
        for (let i = 0; i < 4; i++) {
          const before = faults.renewCalls
          yield* target.advance(Duration.millis(ttlMillis / 2))
          yield* until("a renewal reached the store", Effect.sync(() => faults.renewCalls > before))
        }
        expect(yield* held.isHeld).toBe(true)
        expect(yield* target.state(name)).toEqual({ held: 2, waiting: [] })
        expect(yield* Effect.scoped(b.tryAcquire(name, { limit: 2 }))).toEqual(Option.none())
      }))

    leaseSpec("a holder whose renewals fail is told (renewal-failed) before the store could let anyone else in: its deadline is before the store's expiry, and it is told at that deadline as soon as the process runs", () =>
      Effect.gen(function*() {
        const faults = makeFaults()
        const a = yield* node(faults)
        const name = freshName("margin")
        // The store counts the permit's ttl from its grant, which comes after this.
        const askedAt = yield* monotonicMillis
        const held = yield* a.acquire(name, { limit: 1, ttl: target.ttl })
        faults.failRenew = true
        // The moment the library gives the permit up on this process's monotonic clock.
        const deadline = safetyDeadlineOf(faults.validUntil, ttlMillis)
        const permitsExpireAt = target.permitsExpireAt
        expectDeadlineBeforeExpiry(deadline, yield* storeExpiryOn(permitsExpireAt && permitsExpireAt(name), askedAt + ttlMillis))
        yield* expectToldAtDeadline(deadline, failureOf(held.lost), passOn(target, ttlMillis * 0.9))
        expect(yield* failureOf(held.lost)).toMatchObject({ _tag: "LockLost", reason: "renewal-failed" })
      }))

    leaseSpec("a holder taken over after its permits expired can neither renew nor release the new holder's", () =>
      Effect.gen(function*() {
        const faults = makeFaults()
        const [a, b, c] = [yield* node(faults), yield* node(), yield* node()]
        const name = freshName("takeover")
        faults.hangRenew = true
        const stale = yield* hold(a, name, { limit: 1, ttl: target.ttl })
        const takeover = yield* Effect.fork(b.acquire(name, { limit: 1, ttl: target.ttl }))
        yield* target.advance(Duration.millis(ttlMillis * 1.5))
        const fresh = yield* Fiber.join(takeover)
        expect(fresh.tokens[0]! > stale.permits.tokens[0]!).toBe(true)
        // The stale holder's scope closes: its release must not touch the new holder's permit.
        yield* stale.release
        expect(yield* fresh.isHeld).toBe(true)
        expect(yield* target.state(name)).toEqual({ held: 1, waiting: [] })
        expect(yield* Effect.scoped(c.tryAcquire(name, { limit: 1 }))).toEqual(Option.none())
      }))
  })
  }
}

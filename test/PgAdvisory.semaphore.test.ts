/**
 * DistributedSemaphore on PgAdvisory, against the real server: several layers ("processes") of
 * one database, permits as session locks on the layers' own sessions. Every wait below waits for
 * something observable (a Deferred, a row of pg_locks), with a bound.
 */
import { afterAll, describe, expect, it } from "@effect/vitest"
import { Context, Deferred, Effect, Exit, Fiber, Layer, Option, Schedule, Scope } from "effect"
import pg from "pg"
import * as DistributedLock from "../src/DistributedLock.js"
import * as DistributedSemaphore from "../src/DistributedSemaphore.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import * as engine from "../src/internal/advisory/engine.js"
import * as optionsOf from "../src/internal/advisory/options.js"
import { markerKeyOf, permitKeysOf, slotKeyOf } from "../src/internal/advisory/permits.js"
import { TIGHT_YIELD_BUDGET, withYieldBudget } from "./support/contract.js"
import { yieldTimes } from "./support/faults.js"
import { frozen } from "./support/freeze.js"
import { countSessions, HARNESS_APPLICATION_NAME, terminateBackends, useTestDatabase, withClient } from "./support/pg.js"
import { seededRandom, testSeed } from "./support/random.js"
import { eventually as pollUntil } from "./support/eventually.js"
import { occupancy } from "./support/occupancy.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("pg_advisory_semaphore")

/** `n` consecutive tokens from `from`: a grant's permits' tokens. */
const consecutive = (from: bigint, n: number) => Array.from({ length: n }, (_, i) => from + BigInt(i))

type Services = Context.Context<DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore>

/** One "process": a PgAdvisory layer living as long as the test's scope. */
const node = (applicationName: string, options?: Omit<PgAdvisory.Options, "url" | "applicationName">) =>
  Layer.build(PgAdvisory.layer({ url: db.url, applicationName, ...options }))

/**
 * A layer whose waiters' fallback re-try comes only after a minute: a waiter it serves within a
 * second was woken by a notification or a local release, never by the fallback.
 */
const nodeWithoutFallback = (applicationName: string) =>
  Layer.build(
    DistributedSemaphore.layerBackend(
      Effect.flatMap(optionsOf.resolve({ url: db.url, applicationName }), (options) =>
        engine.make({ ...options, permitRetryMillis: 60_000 }))
    )
  )

/** Permit attempt statements each application name sent (the library's own driver, observed). */
const attemptsSent = new Map<string, number>()
class AttemptCounter extends pg.Client {
  override query(...args: Array<any>): any {
    const text: unknown = typeof args[0] === "string" ? args[0] : args[0]?.text
    // The attempt statement is the one that decides a request's verdict.
    if (typeof text === "string" && text.includes(" as verdict ")) {
      const app = String((this as unknown as { connectionParameters: { application_name?: string } }).connectionParameters.application_name)
      attemptsSent.set(app, (attemptsSent.get(app) ?? 0) + 1)
    }
    return (super.query as any)(...args)
  }
}

/** A layer whose attempt statements are counted in `attemptsSent`; by default `nodeWithoutFallback`'s. */
const countedNode = (applicationName: string, permitRetryMillis = 60_000) =>
  Layer.build(
    DistributedSemaphore.layerBackend(
      Effect.flatMap(optionsOf.resolve({ url: db.url, applicationName }), (options) =>
        engine.makeWith({ ...options, permitRetryMillis }, { ...pg, Client: AttemptCounter } as unknown as typeof pg))
    )
  )

const semaphoreOf = (services: Services) => Context.get(services, DistributedSemaphore.DistributedSemaphore)
const lockOf = (services: Services) => Context.get(services, DistributedLock.DistributedLock)

// One inspection session for the whole file: polling pg_locks must not open a connection per poll.
let inspector: pg.Client | undefined
afterAll(async () => {
  await inspector?.end().catch(() => {})
})

interface HeldKey {
  readonly key: bigint
  readonly mode: string
  readonly granted: boolean
}

/** Advisory locks (granted or awaited) of the sessions with this application_name, by 64-bit key. */
const locksOf = (applicationName: string): Effect.Effect<ReadonlyArray<HeldKey>> =>
  Effect.promise(async () => {
    if (inspector === undefined) {
      const client = new pg.Client({ connectionString: db.url, application_name: HARNESS_APPLICATION_NAME })
      client.on("error", () => {})
      await client.connect()
      inspector = client
    }
    const result = await inspector.query<{ classid: string; objid: string; mode: string; granted: boolean }>(
      `select l.classid::int8::text as classid, l.objid::int8::text as objid, l.mode, l.granted
       from pg_locks l join pg_stat_activity a on a.pid = l.pid
       where l.locktype = 'advisory' and l.objsubid = 1 and a.application_name = $1
         and l.database = (select oid from pg_database where datname = current_database())`,
      [applicationName]
    )
    return result.rows.map((row) => ({
      key: BigInt.asIntN(64, (BigInt(row.classid) << 32n) | BigInt(row.objid)),
      mode: row.mode,
      granted: row.granted
    }))
  })

const eventually = <A>(what: string, read: Effect.Effect<A>, check: (a: A) => boolean, ms = 5_000): Effect.Effect<A> =>
  pollUntil(what, read, check, ms)

/** The backend pids of `applicationName`'s sessions that hold the advisory lock `key` (granted). */
const pidsHolding = (applicationName: string, key: bigint): Effect.Effect<ReadonlyArray<number>> =>
  Effect.promise(() =>
    withClient(db.url, async (client) =>
      (await client.query<{ pid: number }>(
        `select l.pid from pg_locks l join pg_stat_activity a on a.pid = l.pid
         where l.locktype = 'advisory' and l.objsubid = 1 and l.granted and a.application_name = $1
           and ((l.classid::int8 << 32) | l.objid::int8) = $2::int8`,
        [applicationName, key.toString()]
      )).rows.map((row) => row.pid)
    )
  )

/** Whether the server backend `pid` still exists. */
const backendAlive = (pid: number): Effect.Effect<boolean> =>
  Effect.promise(() =>
    withClient(db.url, async (client) =>
      (await client.query("select 1 from pg_stat_activity where pid = $1", [pid])).rowCount === 1
    )
  )

/** Until `applicationName` waits registered for the semaphore `name`: it holds the semaphore's interest key. */
const registered = (applicationName: string, name: string) => {
  const interest = BigInt(permitKeysOf(name, "").interestKey)
  return eventually(
    `${applicationName} waits registered for "${name}"`,
    locksOf(applicationName),
    (rows) => rows.some((row) => row.key === interest && row.granted)
  )
}

/** The waiters in the fencing row's queue of the semaphore `name`, first come first: waiter key and permits. */
const queueOf = (name: string): Effect.Effect<ReadonlyArray<{ readonly key: bigint; readonly permits: number }>> =>
  Effect.promise(() =>
    withClient(db.url, async (client) => {
      const result = await client.query<{ k: string; p: number }>(
        `select q.e->>'k' as k, (q.e->>'p')::int as p from effect_lock_fencing f,
           jsonb_array_elements(f.permit_queue) with ordinality as q(e, pos) where f.key = $1::bigint order by q.pos`,
        [permitKeysOf(name, "").keyText]
      )
      return result.rows.map((row) => ({ key: BigInt(row.k), permits: row.p }))
    })
  )

/** Slot keys of `name` that `applicationName` holds. */
const slotsHeld = (applicationName: string, name: string, limit: number) => {
  const keys = permitKeysOf(name, "")
  const slots = new Set(Array.from({ length: limit }, (_, i) => slotKeyOf(keys, i)))
  return Effect.map(locksOf(applicationName), (rows) => rows.filter((row) => slots.has(row.key)).length)
}

/** Holds permits in a fiber until `release` is completed (or the fiber is interrupted). */
const holdUntil = (
  semaphore: DistributedSemaphore.Service,
  name: string,
  options: DistributedSemaphore.PermitOptions,
  release: Deferred.Deferred<void>
): Effect.Effect<{ readonly permits: DistributedSemaphore.Permits; readonly fiber: Fiber.RuntimeFiber<void, unknown> }, never, Scope.Scope> =>
  Effect.gen(function*() {
    const got = yield* Deferred.make<DistributedSemaphore.Permits, unknown>()
    const fiber = yield* Effect.forkScoped(
      Effect.scoped(
        Effect.flatMap(semaphore.acquire(name, options), (permits) =>
          Effect.zipRight(Deferred.succeed(got, permits), Deferred.await(release)))
      ).pipe(Effect.tapError((error) => Deferred.fail(got, error)))
    )
    return { permits: yield* Deferred.await(got).pipe(Effect.orDie), fiber }
  })


const LIMIT = 3
const LAYERS = 3
const FIBERS_PER_LAYER = 4
const ROUNDS = 6

describe("DistributedSemaphore on PgAdvisory", () => {
  it.scopedLive("PgAdvisory.layer provides both services over the same sessions; semaphore names do not exclude lock names", () =>
    Effect.gen(function*() {
      const app = "sem-both"
      const services = yield* node(app, { maxSessions: 2 })
      const other = yield* node("sem-both-other")
      const lease = yield* lockOf(services).acquire("reports")
      const permits = yield* semaphoreOf(services).acquire("reports", { limit: 1 })
      expect(permits).toMatchObject({ name: "reports", permits: 1, limit: 1 })
      expect(semaphoreOf(services).backend).toBe("pg-advisory")
      // Both are really held: another process gets neither.
      expect(yield* lockOf(other).tryAcquire("reports")).toEqual(Option.none())
      expect(yield* semaphoreOf(other).tryAcquire("reports", { limit: 1 })).toEqual(Option.none())
      expect(yield* lease.isHeld).toBe(true)
      expect(yield* Effect.promise(() => countSessions(db.url, app))).toBeLessThanOrEqual(2)
    }))

  it.scopedLive("a limit above 1024 is refused before any statement: the session and its locks are untouched", () =>
    Effect.gen(function*() {
      const app = "sem-huge"
      const services = yield* node(app)
      const lease = yield* lockOf(services).acquire("kept")
      const permits = yield* semaphoreOf(services).acquire("kept-permits", { limit: 2 })
      const error = yield* Effect.flip(Effect.scoped(semaphoreOf(services).acquire("huge", { limit: 1_025 })))
      expect(error).toMatchObject({ _tag: "LockBackendError", name: "huge" })
      expect(String((error as { cause?: unknown }).cause)).toMatch(/at most 1024/)
      expect([yield* lease.isHeld, yield* permits.isHeld]).toEqual([true, true])
      // Same backend session, still holding the lock and the permit's slot and marker.
      expect((yield* locksOf(app)).length).toBe(3)
      expect((yield* Effect.scoped(semaphoreOf(services).acquire("huge", { limit: 1_024 }))).limit).toBe(1_024)
    }))

  for (const budget of [undefined, TIGHT_YIELD_BUDGET]) {
    const label = budget === undefined ? "" : ` (runtime switching fibers every ${budget} ops)`
    it.scopedLive(`never more than limit permits held across ${LAYERS} layers × ${FIBERS_PER_LAYER} fibers${label}`, () =>
      Effect.gen(function*() {
        const seed = testSeed()
        const random = seededRandom(seed)
        const apps = Array.from({ length: LAYERS }, (_, i) => `sem-limit-${budget ?? "default"}-${i}`)
        const services = yield* Effect.forEach(apps, (app) => node(app))
        // Held until every permit is in use, at most 20 ms: requests take 1 or 2 permits, so the limit
        // is reached only by two holders at once, and a grant across layers can take longer than a
        // short body on a loaded machine (a fixed 2 ms body saw at most 2 of 3 there).
        const untilFull = Effect.sleep("1 millis").pipe(
          Effect.repeat({ while: () => probe.held() < LIMIT }),
          Effect.timeoutOption("20 millis")
        )
        const probe = occupancy(LIMIT, Effect.zipRight(yieldTimes(3), untilFull))
        const plans = Array.from(
          { length: LAYERS * FIBERS_PER_LAYER },
          () => Array.from({ length: ROUNDS }, () => 1 + Math.floor(random() * 2))
        )
        const worker = (plan: ReadonlyArray<number>, i: number) =>
          Effect.forEach(plan, (permits) =>
            probe.body(permits).pipe(
              DistributedSemaphore.withPermits("pool", { limit: LIMIT, permits }),
              Effect.provideService(DistributedSemaphore.DistributedSemaphore, semaphoreOf(services[i % LAYERS]!))
            ), { discard: true })
        const run = Effect.forEach(plans, worker, { concurrency: "unbounded", discard: true })
        yield* budget === undefined ? run : withYieldBudget(budget)(run)
        const context = `seed ${seed} (re-run with EFFECT_LOCK_TEST_SEED=${seed})`
        expect(probe.violations(), context).toBe(0)
        // The check could fail: the permits were all in use at some moment.
        expect(probe.most(), context).toBe(LIMIT)
        // Every release and every waiter's unregistration finished before its withPermits returned.
        for (const app of apps) expect(yield* locksOf(app)).toEqual([])
      }))
  }

  it.scopedLive("requests with two limits racing for one name across layers never make two semaphores of it", () =>
    Effect.gen(function*() {
      const apps = Array.from({ length: LAYERS }, (_, i) => `sem-race-${i}`)
      const services = yield* Effect.forEach(apps, (app) => node(app))
      let inside = 0
      let insideLimit = 0
      let violations = 0
      let mismatches = 0
      const grantedLimits = new Set<number>()
      const body = (limit: number) =>
        Effect.acquireUseRelease(
          Effect.sync(() => {
            if (inside > 0 && insideLimit !== limit) violations++
            inside += 1
            insideLimit = limit
            grantedLimits.add(limit)
            if (inside > limit) violations++
          }),
          () => Effect.sleep("2 millis"),
          () => Effect.sync(() => (inside -= 1))
        )
      const worker = (i: number) => {
        const limit = 2 + (i % 2)
        const once = body(limit).pipe(
          DistributedSemaphore.withPermits("raced", { limit }),
          Effect.provideService(DistributedSemaphore.DistributedSemaphore, semaphoreOf(services[i % LAYERS]!)),
          // In use with the other limit: count it and ask again a moment later (a retry's backoff),
          // until this round is granted.
          Effect.tapError((error) => Effect.sync(() => error._tag === "LimitMismatch" && mismatches++)),
          Effect.retry({ while: (error) => error._tag === "LimitMismatch", schedule: Schedule.spaced("5 millis") })
        )
        return Effect.repeatN(once, ROUNDS - 1)
      }
      yield* Effect.forEach(Array.from({ length: LAYERS * FIBERS_PER_LAYER }, (_, i) => i), worker, {
        concurrency: "unbounded",
        discard: true
      })
      expect(violations).toBe(0)
      // The check could fail: both limits were granted, and requests were refused for the other one.
      expect([...grantedLimits].sort()).toEqual([2, 3])
      expect(mismatches).toBeGreaterThan(0)
      for (const app of apps) expect(yield* locksOf(app)).toEqual([])
    }))

  it.scopedLive("each permit carries a fencing token, strictly increasing per name across grants, layers and limits", () =>
    Effect.gen(function*() {
      const [a, b] = [semaphoreOf(yield* node("sem-tokens-a")), semaphoreOf(yield* node("sem-tokens-b"))]
      const first = yield* Effect.scoped(a.acquire("tokens", { limit: 5, permits: 3 }))
      expect(first.tokens).toEqual(consecutive(first.tokens[0]!, 3))
      const release = yield* Deferred.make<void>()
      const held = yield* holdUntil(a, "tokens", { limit: 5, permits: 2 }, release)
      const second = yield* Effect.scoped(b.acquire("tokens", { limit: 5, permits: 3 }))
      expect(held.permits.tokens).toEqual(consecutive(held.permits.tokens[0]!, 2))
      expect(held.permits.tokens[0]! > first.tokens[2]!).toBe(true)
      expect(second.tokens).toEqual(consecutive(second.tokens[0]!, 3))
      expect(second.tokens[0]! > held.permits.tokens[1]!).toBe(true)
      yield* Deferred.succeed(release, void 0)
      yield* Fiber.join(held.fiber)
      // The name is free: it takes another limit, and its tokens go on increasing.
      const resized = yield* Effect.scoped(b.acquire("tokens", { limit: 1 }))
      expect(resized).toMatchObject({ limit: 1 })
      expect(resized.tokens[0]! > second.tokens[2]!).toBe(true)
      expect((yield* Effect.scoped(a.acquire("other-name", { limit: 2 }))).tokens).toHaveLength(1)
    }))

  it.scopedLive("asking with another limit than the holders' is LimitMismatch, here and in another layer; a free name takes any limit", () =>
    Effect.gen(function*() {
      const [a, b] = [semaphoreOf(yield* node("sem-sized-a")), semaphoreOf(yield* node("sem-sized-b"))]
      const release = yield* Deferred.make<void>()
      const held = yield* holdUntil(a, "sized", { limit: 3 }, release)
      const error = yield* Effect.flip(Effect.scoped(b.acquire("sized", { limit: 4 })))
      expect(error).toBeInstanceOf(DistributedSemaphore.LimitMismatch)
      expect(error).toMatchObject({ _tag: "LimitMismatch", name: "sized", limit: 4, current: 3 })
      expect(yield* Effect.flip(Effect.scoped(b.tryAcquire("sized", { limit: 2 })))).toMatchObject({ current: 3 })
      // The holder's own layer too (its session's own marker does not conflict with its own probe).
      expect(yield* Effect.flip(Effect.scoped(a.acquire("sized", { limit: 4, timeout: 0 })))).toMatchObject({
        _tag: "LimitMismatch",
        current: 3
      })
      // The same limit is fine, in both layers.
      expect((yield* Effect.scoped(b.acquire("sized", { limit: 3, permits: 2 }))).permits).toBe(2)
      yield* Deferred.succeed(release, void 0)
      yield* Fiber.join(held.fiber)
      const resized = yield* holdUntil(b, "sized", { limit: 4 }, yield* Deferred.make<void>())
      expect(resized.permits.limit).toBe(4)
      expect(yield* Effect.flip(Effect.scoped(a.acquire("sized", { limit: 3 })))).toMatchObject({ current: 4 })
    }))

  it.scopedLive("a waiter alone fixes the limit; an interrupted waiter leaves no lock behind", () =>
    Effect.gen(function*() {
      const name = "waiter-sized"
      const keys = permitKeysOf(name, "")
      // An outside session holds the only slot of limit 1, so the waiter below is the name's only user.
      const outside = new pg.Client({ connectionString: db.url, application_name: HARNESS_APPLICATION_NAME })
      outside.on("error", () => {})
      yield* Effect.acquireRelease(Effect.promise(() => outside.connect()), () => Effect.promise(() => outside.end()))
      yield* Effect.promise(() => outside.query("select pg_advisory_lock($1::bigint)", [slotKeyOf(keys, 0).toString()]))
      const [w, c] = [semaphoreOf(yield* node("sem-waiter-w")), semaphoreOf(yield* node("sem-waiter-c"))]
      const waiter = yield* Effect.fork(Effect.scoped(w.acquire(name, { limit: 1 })))
      yield* registered("sem-waiter-w", name)
      // Its place in the fencing row's queue: its own waiter key, for 1 permit.
      const queue = yield* eventually(`"${name}" has a waiter in its queue`, queueOf(name), (entries) => entries.length === 1)
      expect(queue[0]!.permits).toBe(1)
      // Registered: its marker, interest and waiter key, nothing else (no slot).
      const rows = yield* locksOf("sem-waiter-w")
      expect(rows.map((row) => row.key).sort()).toEqual([markerKeyOf(keys, 1), BigInt(keys.interestKey), queue[0]!.key].sort())
      expect(yield* Effect.flip(Effect.scoped(c.acquire(name, { limit: 2, timeout: 0 })))).toMatchObject({
        _tag: "LimitMismatch",
        limit: 2,
        current: 1
      })
      expect(yield* Effect.flip(Effect.scoped(w.tryAcquire(name, { limit: 2 })))).toMatchObject({ current: 1 })
      yield* Fiber.interrupt(waiter)
      // Its unregistration finished within the interruption.
      expect(yield* locksOf("sem-waiter-w")).toEqual([])
      // Nobody uses limit 1 any more: the name takes limit 2 (slot 0 is still the outside session's).
      const resized = yield* Effect.scoped(c.acquire(name, { limit: 2 }))
      expect(resized.limit).toBe(2)
      expect(yield* Effect.scoped(c.tryAcquire(name, { limit: 2, permits: 2 }))).toEqual(Option.none())
    }))

  it.scopedLive("a release in one layer wakes a waiter in another at once, far under the fallback re-try", () =>
    Effect.gen(function*() {
      const holder = semaphoreOf(yield* node("sem-wake-holder"))
      const waiterApp = "sem-wake-waiter"
      const waiter = semaphoreOf(yield* nodeWithoutFallback(waiterApp))
      const handoffs: Array<number> = []
      for (let round = 0; round < 3; round++) {
        const release = yield* Deferred.make<void>()
        const held = yield* holdUntil(holder, "handoff", { limit: 1 }, release)
        const waiting = yield* Effect.fork(Effect.scoped(waiter.acquire("handoff", { limit: 1, timeout: "10 seconds" })))
        yield* registered(waiterApp, "handoff")
        const releasedAt = Date.now()
        yield* Deferred.succeed(release, void 0)
        yield* Fiber.join(held.fiber)
        const got = yield* Fiber.join(waiting)
        handoffs.push(Date.now() - releasedAt)
        expect(got.tokens[0]).toBeGreaterThan(held.permits.tokens[0]!)
      }
      // The waiter's fallback re-try comes after 60 s: only the release notification can explain this.
      expect(Math.max(...handoffs), `handoffs ${handoffs.join(", ")} ms`).toBeLessThan(1_000)
    }))

  it.scopedLive("a release wakes only the head waiter that now fits: the waiters behind it make no attempt until their turn", () =>
    Effect.gen(function*() {
      const holder = semaphoreOf(yield* node("sem-head-holder"))
      const apps = Array.from({ length: 4 }, (_, i) => `sem-head-w${i}`)
      const services = yield* Effect.forEach(apps, (app) => Effect.map(countedNode(app), semaphoreOf))
      const release = yield* Deferred.make<void>()
      const held = yield* holdUntil(holder, "head", { limit: 1 }, release)
      const served: Array<string> = []
      const letGo = yield* Effect.forEach(apps, () => Deferred.make<void>())
      const fibers: Array<Fiber.RuntimeFiber<unknown, unknown>> = []
      for (let i = 0; i < apps.length; i++) {
        fibers.push(yield* Effect.fork(Effect.scoped(Effect.zipRight(
          Effect.tap(services[i]!.acquire("head", { limit: 1, timeout: "20 seconds" }), () => Effect.sync(() => served.push(apps[i]!))),
          Deferred.await(letGo[i]!)
        ))))
        // Each is in the queue before the next one comes.
        yield* registered(apps[i]!, "head")
      }
      const before = apps.map((app) => attemptsSent.get(app) ?? 0)
      yield* Deferred.succeed(release, void 0)
      yield* Fiber.join(held.fiber)
      for (let i = 0; i < apps.length; i++) {
        yield* eventually(`${apps[i]} holds`, Effect.sync(() => served.length), (n) => n === i + 1)
        yield* Deferred.succeed(letGo[i]!, void 0)
      }
      yield* Effect.forEach(fibers, Fiber.join, { discard: true })
      expect(served).toEqual(apps)
      // Each waiter tried once more, when its turn came: no release woke a waiter that did not fit.
      expect(apps.map((app, i) => (attemptsSent.get(app) ?? 0) - before[i]!)).toEqual([1, 1, 1, 1])
    }))

  it.scopedLive("a waiter's re-try with too few permits free wakes nobody behind it: its own place counts first", () =>
    Effect.gen(function*() {
      const name = "own-place"
      const holder = semaphoreOf(yield* node("sem-own-holder"))
      const [meApp, behindApp] = ["sem-own-me", "sem-own-behind"]
      // Its fallback re-try every ~50 ms: many re-tries of a registered waiter in little time.
      const me = semaphoreOf(yield* countedNode(meApp, 50))
      const behind = semaphoreOf(yield* countedNode(behindApp))
      const releases = yield* Effect.forEach([0, 1, 2], () => Deferred.make<void>())
      const holds = yield* Effect.forEach(releases, (release) => holdUntil(holder, name, { limit: 3 }, release))
      const meWaiting = yield* Effect.fork(Effect.scoped(me.acquire(name, { limit: 3, permits: 2, timeout: "30 seconds" })))
      yield* registered(meApp, name)
      const behindWaiting = yield* Effect.fork(Effect.scoped(behind.acquire(name, { limit: 3, timeout: "30 seconds" })))
      yield* registered(behindApp, name)
      expect((yield* queueOf(name)).map((entry) => entry.permits)).toEqual([2, 1])
      // One permit free: too few for the head (2), and the waiter behind it waits for the head.
      yield* Deferred.succeed(releases[0]!, void 0)
      yield* Fiber.join(holds[0]!.fiber)
      const behindBefore = attemptsSent.get(behindApp) ?? 0
      const meBefore = attemptsSent.get(meApp) ?? 0
      yield* eventually(
        `${meApp} re-tried 5 times with one permit free`,
        Effect.sync(() => (attemptsSent.get(meApp) ?? 0) - meBefore),
        (n) => n >= 5
      )
      // None of those re-tries woke the waiter behind (it would have tried, and found itself behind the head again).
      expect((attemptsSent.get(behindApp) ?? 0) - behindBefore).toBe(0)
      // Two permits free: exactly the head's; the waiter behind still waits for it.
      yield* Deferred.succeed(releases[1]!, void 0)
      const first = yield* Fiber.join(meWaiting)
      expect(first.tokens).toHaveLength(2)
      expect(Option.isNone(yield* Fiber.poll(behindWaiting))).toBe(true)
      // (Released together, both would fit at once and could take their permits in either order.)
      yield* Deferred.succeed(releases[2]!, void 0)
      const second = yield* Fiber.join(behindWaiting)
      expect(second.tokens[0]!).toBeGreaterThan(first.tokens[1]!)
    }))

  it.scopedLive("a waiter registering again after its home session died takes a fresh waiter key: the old backend, frozen with the old key, costs the new session nothing", () =>
    Effect.gen(function*() {
      const name = "rekey"
      const app = "sem-rekey-b"
      const holder = semaphoreOf(yield* node("sem-rekey-a"))
      const b = semaphoreOf(yield* node(app))
      const release = yield* Deferred.make<void>()
      const held = yield* holdUntil(holder, name, { limit: 1 }, release)
      const waiting = yield* Effect.fork(Effect.scoped(b.acquire(name, { limit: 1, timeout: "30 seconds" })))
      // Waiter keys in decimal (readable in a timeout's message).
      const queueKeys = Effect.map(queueOf(name), (entries) => entries.map((entry) => entry.key.toString()))
      const [oldKey] = yield* eventually(`"${name}" has b's waiter in its queue`, queueKeys, (keys) => keys.length === 1)
      const [home] = yield* eventually(`b's home session holds its waiter key`, pidsHolding(app, BigInt(oldKey!)), (pids) => pids.length === 1)
      // Frozen: b's heartbeat destroys the session on its side, while the backend lives on with the old waiter key.
      const freezeScope = yield* Scope.make()
      yield* Effect.addFinalizer(() => Scope.close(freezeScope, Exit.void))
      yield* frozen([home!]).pipe(Scope.extend(freezeScope))
      // Registered again on a new home session, behind its old entry (live to the server while the frozen backend holds its key).
      const queue = yield* eventually(`b's waiter registered again`, queueKeys, (keys) => keys.length === 2, 10_000)
      expect(queue[0]).toBe(oldKey)
      expect(queue[1]).not.toBe(oldKey)
      const [newHome] = yield* eventually(`b's new home session holds its new waiter key`, pidsHolding(app, BigInt(queue[1]!)), (pids) => pids.length === 1)
      expect(newHome).not.toBe(home)
      // Another permit of b, on that same new home session: it must outlive everything below.
      const other = yield* b.acquire("rekey-other", { limit: 1 })
      expect(yield* pidsHolding(app, slotKeyOf(permitKeysOf("rekey-other", ""), 0))).toEqual([newHome])
      yield* Scope.close(freezeScope, Exit.void)
      // The thawed backend finds its client gone and exits, its old waiter key with it.
      yield* eventually(`the thawed backend ${home} exited`, backendAlive(home!), (alive) => !alive)
      yield* Deferred.succeed(release, void 0)
      yield* Fiber.join(held.fiber)
      const got = yield* Fiber.join(waiting)
      expect(got.tokens[0]!).toBeGreaterThan(held.permits.tokens[0]!)
      expect(yield* other.isHeld).toBe(true)
      expect(yield* pidsHolding(app, slotKeyOf(permitKeysOf("rekey-other", ""), 0))).toEqual([newHome])
    }))

  it.scopedLive("a release in the same layer wakes its waiter at once too", () =>
    Effect.gen(function*() {
      const app = "sem-wake-local"
      const semaphore = semaphoreOf(yield* nodeWithoutFallback(app))
      const release = yield* Deferred.make<void>()
      const held = yield* holdUntil(semaphore, "local-handoff", { limit: 2, permits: 2 }, release)
      const waiting = yield* Effect.fork(Effect.scoped(semaphore.acquire("local-handoff", { limit: 2, timeout: "10 seconds" })))
      yield* registered(app, "local-handoff")
      const releasedAt = Date.now()
      yield* Deferred.succeed(release, void 0)
      yield* Fiber.join(held.fiber)
      const got = yield* Fiber.join(waiting)
      expect(Date.now() - releasedAt).toBeLessThan(1_000)
      expect(got.tokens).toHaveLength(1)
      expect(got.tokens[0]! > held.permits.tokens[1]!).toBe(true)
    }))

  it.scopedLive("holders in one layer hold distinct slots (a session is granted its own lock again, so its slots are skipped)", () =>
    Effect.gen(function*() {
      const app = "sem-local"
      const [a, b] = [semaphoreOf(yield* node(app)), semaphoreOf(yield* node("sem-local-other"))]
      const first = yield* a.acquire("local", { limit: 2 })
      const second = yield* a.acquire("local", { limit: 2 })
      expect(second.tokens[0]! > first.tokens[0]!).toBe(true)
      expect(yield* slotsHeld(app, "local", 2)).toBe(2)
      expect(yield* Effect.scoped(b.tryAcquire("local", { limit: 2 }))).toEqual(Option.none())
      expect(yield* Effect.scoped(a.tryAcquire("local", { limit: 2 }))).toEqual(Option.none())
    }))

  it.scopedLive("permits are taken all or none: a request that does not fit takes no slot", () =>
    Effect.gen(function*() {
      const [a, b] = [semaphoreOf(yield* node("sem-all-a")), semaphoreOf(yield* node("sem-all-b"))]
      yield* holdUntil(a, "all-or-none", { limit: 3, permits: 2 }, yield* Deferred.make<void>())
      expect(yield* slotsHeld("sem-all-a", "all-or-none", 3)).toBe(2)
      // One slot is free, two are asked: none is taken (the one found free was given back at once).
      expect(yield* Effect.scoped(b.tryAcquire("all-or-none", { limit: 3, permits: 2 }))).toEqual(Option.none())
      expect(yield* locksOf("sem-all-b")).toEqual([])
      const one = yield* b.acquire("all-or-none", { limit: 3 })
      expect(one.permits).toBe(1)
      expect(yield* slotsHeld("sem-all-b", "all-or-none", 3)).toBe(1)
    }))

  it.scopedLive("a timeout, and an interruption at any point of the wait, leave no lock behind", () =>
    Effect.gen(function*() {
      const app = "sem-cancel"
      const holder = semaphoreOf(yield* node("sem-cancel-holder"))
      const semaphore = semaphoreOf(yield* node(app))
      const release = yield* Deferred.make<void>()
      const held = yield* holdUntil(holder, "cancel", { limit: 2, permits: 2 }, release)
      const timedOut = yield* Effect.flip(Effect.scoped(semaphore.acquire("cancel", { limit: 2, timeout: "300 millis" })))
      expect(timedOut).toMatchObject({ _tag: "LockTimeout", name: "cancel" })
      expect(yield* locksOf(app)).toEqual([])
      // Interrupted after 0..39 yields: before, while or after its attempts' statements.
      for (let at = 0; at < 40; at++) {
        const waiting = yield* Effect.fork(Effect.scoped(semaphore.acquire("cancel", { limit: 2 })))
        yield* yieldTimes(at)
        yield* Fiber.interrupt(waiting)
        expect(yield* locksOf(app), `interrupted after ${at} yields`).toEqual([])
      }
      // And one interrupted while registered at the server.
      const waiting = yield* Effect.fork(Effect.scoped(semaphore.acquire("cancel", { limit: 2 })))
      yield* registered(app, "cancel")
      yield* Fiber.interrupt(waiting)
      expect(yield* locksOf(app)).toEqual([])
      // The holder kept its permits throughout; once it lets go, the name is free.
      expect(yield* slotsHeld("sem-cancel-holder", "cancel", 2)).toBe(2)
      yield* Deferred.succeed(release, void 0)
      yield* Fiber.join(held.fiber)
      expect((yield* Effect.scoped(semaphore.acquire("cancel", { limit: 2, permits: 2 }))).permits).toBe(2)
    }))

  it.scopedLive("an attempt interrupted while the statement that grants it is in flight gives its permits back", () =>
    Effect.gen(function*() {
      const app = "sem-cancel-grant"
      const semaphore = semaphoreOf(yield* node(app))
      let grantedInFlight = 0
      for (let at = 0; at < 60; at++) {
        const waiting = yield* Effect.fork(Effect.scoped(semaphore.acquire(`free-${at % 3}`, { limit: 2, permits: 2 })))
        yield* yieldTimes(at % 30)
        // Still running: its statement may be on its way, or answered and not yet handed over.
        if ((yield* Fiber.poll(waiting))._tag === "None") grantedInFlight++
        yield* Fiber.interrupt(waiting)
        expect(yield* locksOf(app), `interrupted after ${at % 30} yields`).toEqual([])
      }
      // The check could fail: most interruptions came before the grant was handed over.
      expect(grantedInFlight).toBeGreaterThan(30)
    }))

  it.scopedLive("a killed session interrupts withPermits with LockLost connection-lost carrying the first token", () =>
    Effect.gen(function*() {
      const app = "sem-killed"
      const semaphore = semaphoreOf(yield* node(app))
      const started = yield* Deferred.make<void>()
      let finalized = false
      const body = Effect.zipRight(Deferred.succeed(started, void 0), Effect.never).pipe(
        Effect.ensuring(Effect.sync(() => (finalized = true)))
      )
      const run = yield* Effect.fork(
        body.pipe(
          DistributedSemaphore.withPermits("killed", { limit: 3, permits: 2 }),
          Effect.provideService(DistributedSemaphore.DistributedSemaphore, semaphore)
        )
      )
      yield* Deferred.await(started)
      expect(yield* slotsHeld(app, "killed", 3)).toBe(2)
      expect(yield* Effect.promise(() => terminateBackends(db.url, app))).toBeGreaterThan(0)
      const exit = yield* Fiber.await(run)
      expect(Exit.isFailure(exit)).toBe(true)
      const lost = yield* Effect.flip(exit)
      expect(lost).toMatchObject({ _tag: "LockLost", name: "killed", reason: "connection-lost" })
      const lostToken = (lost as { readonly token: bigint }).token
      expect(finalized).toBe(true)
      // The server dropped them with the session: another layer gets all three.
      const other = semaphoreOf(yield* node("sem-killed-other"))
      const after = (yield* Effect.scoped(other.acquire("killed", { limit: 3, permits: 3, timeout: "5 seconds" }))).tokens
      expect(after).toEqual(consecutive(after[0]!, 3))
      // Above both of the killed holder's (its first, and the one after it).
      expect(after[0]! > lostToken + 1n).toBe(true)
    }))

  it.scopedLive("a fencing table from before semaphores gets their column; with createTables: false semaphores refuse, naming migration(), and locks still work", () =>
    Effect.gen(function*() {
      // The table as older versions made it: no permit_limit column.
      const oldTable = (table: string) =>
        Effect.promise(() =>
          withClient(db.url, (client) =>
            client.query(`create table ${table} (key bigint primary key, name text not null, token bigint not null)`)
          )
        )
      yield* oldTable("fencing_upgraded")
      const upgraded = yield* node("sem-upgraded", { fencingTable: "fencing_upgraded" })
      expect((yield* Effect.scoped(semaphoreOf(upgraded).acquire("upgrade", { limit: 2 }))).tokens).toHaveLength(1)
      yield* oldTable("fencing_kept")
      const kept = yield* node("sem-kept", { fencingTable: "fencing_kept", createTables: false })
      const refused = yield* Effect.flip(Effect.scoped(semaphoreOf(kept).acquire("upgrade", { limit: 2 })))
      expect(refused).toMatchObject({ _tag: "LockBackendError" })
      expect(String((refused as { cause?: unknown }).cause)).toMatch(/permit_limit.*PgAdvisory\.migration\(\)/)
      expect((yield* Effect.scoped(lockOf(kept).acquire("still-a-lock"))).token > 0n).toBe(true)
      // migration() upgrades it in place (and is idempotent); a layer built afterwards serves permits.
      const migration = PgAdvisory.migration({ fencingTable: "fencing_kept" })
      yield* Effect.promise(() => withClient(db.url, async (client) => {
        await client.query(migration)
        await client.query(migration)
      }))
      const migrated = yield* node("sem-migrated", { fencingTable: "fencing_kept", createTables: false })
      expect((yield* Effect.scoped(semaphoreOf(migrated).acquire("upgrade", { limit: 2 }))).tokens).toHaveLength(1)
    }))
})

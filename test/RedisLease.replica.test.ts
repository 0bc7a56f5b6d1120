/**
 * RedisLease's opt-in WAIT (`waitForReplicas`) against a real primary and replica: two
 * redis-servers of this file (free loopback ports, own directories), the second started with
 * `--replicaof` the first. A grant counts only once the replicas acknowledged it; with fewer it
 * fails and is given back at once (not left to its ttl); a renewal the replica does not
 * acknowledge does not extend the holder's lease, which is then lost on time.
 * Skipped without redis-server on the PATH (REDIS_URL does not matter: it needs servers of its own).
 */
import { describe, expect, it } from "@effect/vitest"
import { Duration, Effect, Either, Exit, Fiber, Option, Scope } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as DistributedSemaphore from "effect-lock/DistributedSemaphore"
import * as RedisLease from "effect-lock/RedisLease"
import * as Keys from "effect-lock/internal/redis/keys"
import { freeLoopbackPort } from "../tools/embeddedPostgres.js"
import { Redis } from "ioredis"
import { afterAll, beforeAll } from "vitest"
import { freshName } from "./support/contract.js"
import { waitFor } from "./support/eventually.js"
import { frozen } from "./support/freeze.js"
import { noRedisServer, startRedisServer, type TestRedis } from "./support/redis.js"

const skip = noRedisServer()

let primary: TestRedis | undefined
let replica: TestRedis | undefined
let inspectors: Array<Redis> = []

beforeAll(async () => {
  if (skip) return
  const port = await freeLoopbackPort()
  // Started together: the replica retries its primary until it answers.
  const started = await Promise.allSettled([
    // No 5 s wait before the first (diskless) sync to the replica.
    startRedisServer({ port, args: ["--repl-diskless-sync-delay", "0"] }),
    startRedisServer({ args: ["--replicaof", "127.0.0.1", `${port}`] })
  ])
  primary = started[0].status === "fulfilled" ? started[0].value : undefined
  replica = started[1].status === "fulfilled" ? started[1].value : undefined
  for (const s of started) if (s.status === "rejected") throw s.reason
}, 20_000)

// The finalizer of both servers: whatever happened, this file's servers are stopped.
afterAll(async () => {
  await Promise.all(inspectors.map((client) => client.quit().catch(() => client.disconnect())))
  inspectors = []
  await Promise.all([replica?.stop(), primary?.stop()])
})

const clientOf = (url: string): Redis => {
  const client = new Redis(url, { maxRetriesPerRequest: 1 })
  client.on("error", () => {})
  inspectors.push(client)
  return client
}

const TTL = Duration.seconds(1)

const processOn = (options?: RedisLease.Options) =>
  Effect.flatMap(RedisLease.makeBackend({ url: primary!.url, ttl: TTL, ...options }), (backend) => DistributedLock.make(backend))

/**
 * The replica is attached and streaming, as both ends see it: `master_link_status:up` on the
 * replica, and `state=online` on the primary. WAIT counts only replicas the primary has online;
 * right after the first sync a loaded run saw the replica's end up and WAIT answer 0 of 1 in 1 s.
 */
const replicaUp = Effect.promise(() => Promise.all([clientOf(replica!.url).info("replication"), clientOf(primary!.url).info("replication")])).pipe(
  Effect.map(([onReplica, onPrimary]) => onReplica.includes("master_link_status:up") && onPrimary.includes("state=online"))
)

describe.skipIf(skip)("RedisLease with a replica and WAIT", () => {
  it.scopedLive("a grant counts once the replica acknowledged it: the replica holds the lease when acquire returns", () =>
    Effect.gen(function*() {
      yield* waitFor("the replica is attached", replicaUp, Duration.seconds(10))
      const a = yield* processOn({ waitForReplicas: { count: 1 } })
      const name = freshName("redis-wait")
      const lease = yield* a.acquire(name)
      // No wait here: WAIT returned only after the replica had processed the grant.
      const onReplica = yield* Effect.promise(() => clientOf(replica!.url).hget(Keys.lockKeys(Keys.DEFAULT_PREFIX, name).lease, "token"))
      expect(onReplica).toBe(String(lease.token))
    }), 20_000)

  it.scopedLive("fewer replicas than asked for: acquire fails with LockBackendError naming WAIT, and the grant is given back at once", () =>
    Effect.gen(function*() {
      yield* waitFor("the replica is attached", replicaUp, Duration.seconds(10))
      const ttl = Duration.seconds(10)
      const a = yield* processOn({ ttl, waitForReplicas: { count: 2, timeout: Duration.millis(100) } })
      const b = yield* processOn({ ttl })
      const name = freshName("redis-wait-2")
      const error = yield* Effect.flip(Effect.scoped(a.acquire(name, { timeout: Duration.seconds(2) })))
      expect(error._tag).toBe("LockBackendError")
      expect(String(error.message)).toContain("WAIT: 1 of 2 replicas")
      // Given back, not left to run out (10 s): another process gets it within 2 s.
      yield* waitFor("another process gets the name", Effect.scoped(Effect.map(b.tryAcquire(name), Option.isSome)), Duration.seconds(2))
    }), 20_000)

  it.scopedLive("a waiter that waits for replicas is woken, never handed the lease by a release: its grant comes from its own acquire, which WAITs (here for 2 replicas of 1, so it fails)", () =>
    Effect.gen(function*() {
      yield* waitFor("the replica is attached", replicaUp, Duration.seconds(10))
      const ttl = Duration.seconds(10)
      // The holder waits for no replica; the waiter for two, of which there is one.
      const holder = yield* processOn({ ttl })
      const waiter = yield* processOn({ ttl, waitForReplicas: { count: 2, timeout: Duration.millis(100) } })
      const name = freshName("redis-wait-handover")
      const keys = Keys.lockKeys(Keys.DEFAULT_PREFIX, name)
      const holderScope = yield* Scope.make()
      yield* Scope.extend(holder.acquire(name), holderScope)
      const waiting = yield* Effect.fork(Effect.either(Effect.scoped(waiter.acquire(name, { timeout: Duration.seconds(5) }))))
      const inspector = clientOf(primary!.url)
      yield* waitFor("the waiter's place", Effect.map(Effect.promise(() => inspector.zcard(keys.queue)), (n) => n === 1), Duration.seconds(5))
      // Its place records no ttl: a release cannot hand it a lease.
      const [place] = yield* Effect.promise(() => inspector.hvals(keys.places))
      expect(JSON.parse(place!)).not.toHaveProperty("ttl")
      yield* Scope.close(holderScope, Exit.void)
      const outcome = yield* Fiber.join(waiting).pipe(Effect.timeout(Duration.seconds(5)))
      // Granted by its own acquire, which WAITed: 1 of 2 replicas fails it.
      if (Either.isRight(outcome)) return yield* Effect.dieMessage("expected the waiter's grant to fail its WAIT")
      expect(outcome.left._tag).toBe("LockBackendError")
      expect(String(outcome.left.message)).toContain("WAIT: 1 of 2 replicas")
    }), 20_000)

  it.scopedLive("permits too: fewer replicas than asked for fail the grant, which is given back at once", () =>
    Effect.gen(function*() {
      yield* waitFor("the replica is attached", replicaUp, Duration.seconds(10))
      const ttl = Duration.seconds(10)
      const semaphoreOn = (options?: RedisLease.Options) =>
        Effect.flatMap(RedisLease.makeBackend({ url: primary!.url, ttl, ...options }), (backend) => DistributedSemaphore.make(backend.semaphore))
      const a = yield* semaphoreOn({ waitForReplicas: { count: 2, timeout: Duration.millis(100) } })
      const b = yield* semaphoreOn()
      const name = freshName("redis-wait-permits")
      const error = yield* Effect.flip(Effect.scoped(a.acquire(name, { limit: 1, timeout: Duration.seconds(2) })))
      expect(error._tag).toBe("LockBackendError")
      expect(String(error.message)).toContain("WAIT: 1 of 2 replicas")
      // Given back, not left to run out (10 s): the one permit is free again within 2 s.
      yield* waitFor("another process gets the permit", Effect.scoped(Effect.map(b.tryAcquire(name, { limit: 1 }), Option.isSome)), Duration.seconds(2))
    }), 20_000)

  it.scopedLive("a frozen replica: the holder's renewals are not acknowledged and it is told LockLost before the lease ran out; new grants fail", () =>
    Effect.gen(function*() {
      yield* waitFor("the replica is attached", replicaUp, Duration.seconds(10))
      const a = yield* processOn({ waitForReplicas: { count: 1, timeout: Duration.millis(150) } })
      const name = freshName("redis-wait-frozen")
      const lease = yield* a.acquire(name)
      const leaseKey = Keys.lockKeys(Keys.DEFAULT_PREFIX, name).lease
      const guarded = yield* Effect.fork(DistributedLock.guard(lease, Effect.never))
      const freeze = yield* Scope.make()
      // Dangerous: SIGSTOP of this file's own replica; `frozen` continues it on every path.
      yield* frozen([replica!.pid()!]).pipe(Scope.extend(freeze))
      const error = yield* Effect.flip(Fiber.join(guarded))
      const lostAt = Date.now()
      expect(error).toMatchObject({ _tag: "LockLost", name, token: lease.token, reason: "renewal-failed" })
      // The primary's expiry (renewals still ran there, unacknowledged) is later than the loss;
      // the holder's own release may have cleared it since (null).
      const expires = yield* Effect.promise(() => clientOf(primary!.url).hget(leaseKey, "expires"))
      expect(expires === null || Number(expires) > lostAt).toBe(true)
      const refused = yield* Effect.either(Effect.scoped(a.tryAcquire(freshName("redis-wait-frozen-2"))))
      expect(Either.isLeft(refused) && refused.left._tag === "LockBackendError").toBe(true)
      yield* Scope.close(freeze, Exit.void)
    }), 20_000)

  it.scopedLive("waitForReplicas is checked when the layer is built", () =>
    Effect.gen(function*() {
      const url = primary!.url
      const zero = yield* Effect.flip(RedisLease.makeBackend({ url, waitForReplicas: { count: 0 } }))
      expect(zero.message).toContain("waitForReplicas.count")
      const long = yield* Effect.flip(
        RedisLease.makeBackend({ url, statementTimeout: Duration.seconds(1), waitForReplicas: { count: 1, timeout: Duration.seconds(1) } })
      )
      expect(long.message).toContain("shorter than statementTimeout")
    }))
})

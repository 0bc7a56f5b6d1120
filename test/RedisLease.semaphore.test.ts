/**
 * RedisLease's semaphores beyond the semaphore contract (RedisLease.contract.test.ts), on a real
 * redis-server (started on a free loopback port, or REDIS_URL): an idle semaphore leaves no key
 * once its last lease and place have run out, released or abandoned, and its next grant's tokens are larger
 * than every token it handed out — also for a grant of more permits than the µs the key's last
 * lease lasted; one layer provides both services, a lock and a semaphore of one name apart in
 * one hash slot; the operator's view of a semaphore. Without a server the file skips and says why.
 */
import { expect, it } from "@effect/vitest"
import { Context, Duration, Effect, Fiber, Layer, Option } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as DistributedSemaphore from "effect-lock/DistributedSemaphore"
import * as Keys from "effect-lock/internal/redis/keys"
import * as PermitScripts from "effect-lock/internal/redis/permitScripts"
import * as RedisLease from "effect-lock/RedisLease"
import { freshName, HOLD_THROUGH } from "./support/contract.js"
import { waitFor } from "./support/eventually.js"
import { describeWithRedis, useInspector, useRedis } from "./support/redis.js"

// First, so that its afterAll (stopping the server) runs after every layer and client is closed.
const redis = useRedis()

const { inspector, keysOf } = useInspector(redis)

const TTL = Duration.seconds(1)

/** A process: a semaphore service on its own RedisLease backend, closed with the test's scope. */
const node = () =>
  Effect.flatMap(Effect.suspend(() => RedisLease.makeBackend({ url: redis.url(), ttl: TTL })), (backend) =>
    DistributedSemaphore.make(backend.semaphore))

const noKeyLeft = (name: string) =>
  waitFor(`every key of the idle semaphore "${name}" expired`, Effect.map(keysOf(name), (keys) => keys.length === 0), Duration.seconds(10))

/** The tokens of a grant of `permits` of `name`, released at once. */
const tokensOf = (service: DistributedSemaphore.Service, name: string, limit: number, permits = 1) =>
  Effect.scoped(Effect.map(service.acquire(name, { limit, permits, ttl: TTL, timeout: Duration.seconds(5) }), (p) => p.tokens))

/**
 * A grant made by a process that dies at once (never renews, never releases): the acquire
 * script run directly, as the layer sends it. Its first token.
 */
const abandonedGrant = (name: string, limit: number, permits: number): Effect.Effect<bigint> =>
  Effect.map(abandonedAttempt(name, limit, permits, false), (reply) => {
    if (reply[0] === null) throw new Error(`not granted: ${JSON.stringify(reply)}`)
    return BigInt(reply[0])
  })

/** An attempt of a process that dies at once: granted, or (`takePlace`) a place lasting 1 s that nobody keeps. */
const abandonedAttempt = (name: string, limit: number, permits: number, takePlace: boolean) =>
  Effect.promise(async () => {
    const reply = await inspector().eval(
      PermitScripts.acquire,
      1,
      Keys.semKey(Keys.DEFAULT_PREFIX, name),
      name,
      crypto.randomUUID(),
      crypto.randomUUID(),
      limit,
      permits,
      Duration.toMillis(TTL),
      1_000,
      "dead-process",
      "nowhere",
      0,
      takePlace ? "1" : "0"
    ) as [string | null, number | null, number | null]
    return reply
  })

describeWithRedis("RedisLease semaphores", () => {
  it.scopedLive("a released semaphore leaves no key within a ttl, and its next grant's tokens are larger", () =>
    Effect.gen(function*() {
      const a = yield* node()
      const name = freshName("redis-sem-idle")
      const first = yield* tokensOf(a, name, 3, 2)
      expect(first[1]).toBe(first[0]! + 1n)
      yield* noKeyLeft(name)
      const second = yield* tokensOf(a, name, 3, 3)
      expect(second[0]! > first[1]!).toBe(true)
      yield* noKeyLeft(name)
    }))

  it.scopedLive("permits and a place abandoned by dead processes run out: no key is left, and the next grant is larger", () =>
    Effect.gen(function*() {
      const a = yield* node()
      const name = freshName("redis-sem-dead")
      const dead = yield* abandonedGrant(name, 2, 2)
      const place = yield* abandonedAttempt(name, 2, 1, true)
      expect(place[0]).toBe(null)
      expect((yield* RedisLease.semaphores(inspector(), name))[0]?.waiting).toHaveLength(1)
      // Held until the dead process's lease runs out: nobody gets a permit meanwhile.
      expect(yield* Effect.scoped(a.tryAcquire(name, { limit: 2 }))).toEqual(Option.none())
      yield* noKeyLeft(name)
      const next = yield* tokensOf(a, name, 2)
      expect(next[0]! > dead + 1n).toBe(true)
    }))

  it.scopedLive("a grant of more permits than its lease's µs keeps the key until the server's clock is past its last token", () =>
    Effect.gen(function*() {
      const a = yield* node()
      const name = freshName("redis-sem-floor")
      // 2,000,000 tokens: the last is ~2 s of server µs ahead, past the 1 s lease.
      const permits = 2_000_000
      const first = yield* abandonedGrant(name, permits, permits)
      const last = first + BigInt(permits - 1)
      yield* noKeyLeft(name)
      const next = yield* tokensOf(a, name, 1)
      expect(next[0]! > last).toBe(true)
    }))

  it.scopedLive("one layer provides both services; a lock and a semaphore of one name are apart, in one hash slot", () =>
    Effect.gen(function*() {
      const services = yield* Layer.build(RedisLease.layer({ url: redis.url(), ttl: TTL }))
      const lock = Context.get(services, DistributedLock.DistributedLock)
      const semaphore = Context.get(services, DistributedSemaphore.DistributedSemaphore)
      expect([lock.backend, semaphore.backend]).toEqual(["redis-lease", "redis-lease"])
      const name = freshName("redis-sem-both")
      const lease = yield* lock.acquire(name)
      const permits = yield* semaphore.acquire(name, { limit: 1 })
      expect(permits.tokens[0]).not.toBe(lease.token)
      expect(yield* Effect.scoped(lock.tryAcquire(name))).toEqual(Option.none())
      expect(yield* Effect.scoped(semaphore.tryAcquire(name, { limit: 1 }))).toEqual(Option.none())
      const keys = yield* keysOf(name)
      expect(keys).toContain(Keys.semKey(Keys.DEFAULT_PREFIX, name))
      const slots = yield* Effect.forEach(keys, (key) => Effect.promise(() => inspector().call("cluster", ["keyslot", key]).catch(() => undefined)))
      const tags = new Set(keys.map((key) => key.slice(key.indexOf("{"), key.indexOf("}") + 1)))
      expect(tags.size).toBe(1)
      // CLUSTER KEYSLOT answers also on a server without cluster mode (Redis ≥ 3).
      if (slots.every((slot) => slot !== undefined)) expect(new Set(slots).size).toBe(1)
    }))

  it.scopedLive("the operator sees the limit, the holders with their tokens and the waiters in order; revokePermits takes the permits", () =>
    Effect.gen(function*() {
      const [a, b] = [yield* node(), yield* node()]
      const name = freshName("redis-sem-inspect")
      const held = yield* a.acquire(name, { limit: 3, permits: 2, ttl: HOLD_THROUGH })
      const waiter = yield* Effect.fork(Effect.scoped(b.acquire(name, { limit: 3, permits: 2 })))
      yield* waitFor(
        "the waiter's place",
        Effect.map(RedisLease.semaphores(inspector(), name), (found) => found[0]?.waiting.length === 1),
        Duration.seconds(5)
      )
      const [seen] = yield* RedisLease.semaphores(inspector(), name)
      expect(seen).toMatchObject({ name, limit: 3, waiting: [{ permits: 2 }] })
      expect(seen!.holders.map((h) => h.tokens)).toEqual([held.tokens])
      expect(seen!.holders[0]).toMatchObject({ permits: 2, application: "effect-lock" })
      expect(yield* RedisLease.revokePermits(inspector(), name)).toBe(true)
      // The waiter now fits and is woken: it takes its permits.
      const granted = yield* Fiber.join(waiter)
      expect(granted.tokens[0]! > held.tokens[1]!).toBe(true)
      expect(yield* RedisLease.revokePermits(inspector(), freshName("redis-sem-none"))).toBe(false)
      expect(yield* RedisLease.semaphores(inspector(), freshName("redis-sem-none"))).toEqual([])
    }))
})

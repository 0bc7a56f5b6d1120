/**
 * RedisLease runs the backend contract suite and the semaphore contract suite (each twice: as
 * scheduled, and with the runtime switching fibers every 12 ops) and its event-loop stall cases,
 * against a real redis-server (started on a free loopback port, or REDIS_URL). Each backend built
 * here is one "process" with its own connections; the store's view is read on a client of the
 * file's own. Without a server, the file skips and says why.
 */
import { Duration, Effect } from "effect"
import * as Keys from "effect-lock/internal/redis/keys"
import * as Make from "effect-lock/internal/redis/make"
import * as RedisLease from "effect-lock/RedisLease"
import { Redis } from "ioredis"
import { afterAll } from "vitest"
import { contractSuite, LIVE_CONTRACT_TTL } from "./support/contract.js"
import { laneInFlight } from "./support/laneInFlight.js"
import { describeWithRedis, useRedis } from "./support/redis.js"
import { semaphoreContractSuite, type StoreState } from "./support/semaphoreContract.js"

// First, so that its afterAll (stopping the server) runs after every layer and client is closed.
const redis = useRedis()


/** The file's own client, for reading the store and the operator's revoke. */
let client: Redis | undefined
const inspector = (): Redis => (client ??= new Redis(redis.url(), { lazyConnect: true, maxRetriesPerRequest: 1 }))
afterAll(async () => {
  await client?.quit().catch(() => client?.disconnect())
})

/**
 * Each live place's time left (server ms) in `key`: the lock's places hash ("$": one JSON entry
 * per field), or the semaphore hash's `waiters` field (a JSON array).
 */
const placesLeft = (key: string, field: "$" | "waiters"): Effect.Effect<ReadonlyArray<number>> =>
  Effect.promise(async () => {
    const client = inspector()
    const [time, entries] = await Promise.all([
      client.time(),
      field === "$"
        ? client.hvals(key).then((values) => values.map((raw) => JSON.parse(raw) as { readonly expires: number }))
        : client.hget(key, field).then((raw) => {
          const parsed: unknown = raw === null ? [] : JSON.parse(raw)
          // Lua's cjson encodes an empty table as an object (`{}`): no places.
          return Array.isArray(parsed) ? parsed as Array<{ readonly expires: number }> : []
        })
    ])
    const nowMs = Number(time[0]) * 1000 + Math.floor(Number(time[1]) / 1000)
    return entries.map((entry) => entry.expires - nowMs).filter((left) => left > 0)
  })

describeWithRedis("RedisLease contract", () => {
  contractSuite("RedisLease", {
    clock: "live",
    ttl: LIVE_CONTRACT_TTL,
    makeBackend: Effect.suspend(() => RedisLease.makeBackend({ url: redis.url(), ttl: LIVE_CONTRACT_TTL })),
    // Live holders counted from Redis itself, not from a process.
    storeHolders: (name) => Effect.suspend(() => Effect.map(RedisLease.holders(inspector(), name), (held) => held.length)),
    // The live lease's expiry by the server's clock.
    leaseExpiresAt: (name) => Effect.suspend(() => Effect.map(RedisLease.holders(inspector(), name), (held) => held[0]!.expiresAt)),
    advance: (duration) => Effect.sleep(duration),
    // The operator's revoke, on a client of its own.
    revoke: (name) => Effect.suspend(() => Effect.asVoid(RedisLease.revoke(inspector(), name))),
    placesLeft: (name) => placesLeft(Keys.lockKeys(Keys.DEFAULT_PREFIX, name).places, "$"),
    maxNameBytes: RedisLease.defaults.maxNameBytes,
    minTtl: RedisLease.defaults.minTtl
  })
})

/** The semaphore contract's processes' commands in flight, by name. */
const { counted, quiet } = laneInFlight()

/** The semaphore `name` as the server has it (its live entries, by its clock): permits held, places in order. */
const stateOf = (name: string): Effect.Effect<StoreState, unknown> =>
  Effect.suspend(() =>
    Effect.map(RedisLease.semaphores(inspector(), name), (found): StoreState => {
      const semaphore = found[0]
      if (semaphore === undefined) return { held: 0, waiting: [] }
      return { held: semaphore.holders.reduce((sum, h) => sum + h.permits, 0), waiting: semaphore.waiting.map((w) => w.permits) }
    })
  )

describeWithRedis("RedisLease semaphore contract", () => {
  semaphoreContractSuite("RedisLease", {
    clock: "live",
    ttl: LIVE_CONTRACT_TTL,
    makeBackend: Effect.suspend(() =>
      Effect.map(Make.makeBackend({ url: redis.url(), ttl: LIVE_CONTRACT_TTL, pollInterval: Duration.millis(100) }, counted), (b) => b.semaphore)
    ),
    state: stateOf,
    placesLeft: (name) => placesLeft(Keys.semKey(Keys.DEFAULT_PREFIX, name), "waiters"),
    // The earliest live permits' expiry by the server's clock.
    permitsExpireAt: (name) => Effect.suspend(() => Effect.map(RedisLease.semaphores(inspector(), name), (found) => Math.min(...found[0]!.holders.map((h) => h.expiresAt)))),
    // The operator's revoke, on a client of its own.
    revoke: (name) => Effect.suspend(() => Effect.asVoid(RedisLease.revokePermits(inspector(), name))),
    advance: (duration) => Effect.sleep(duration),
    rounds: 6,
    // A place lasts 5 s and the interruption tests' permits 60 s: a give-back within 2.5 s is one.
    giveBackBound: Duration.millis(2_500),
    quiet
  })
})

/**
 * RedisLease runs the backend contract suite (twice: as scheduled, and with the runtime switching
 * fibers every 12 ops) and its event-loop stall cases, against a real redis-server (started on a
 * free loopback port, or REDIS_URL). Without one, the file skips and says why.
 */
import { Duration, Effect } from "effect"
import * as RedisLease from "effect-lock/RedisLease"
import { Redis } from "ioredis"
import { afterAll } from "vitest"
import { contractSuite } from "./support/contract.js"
import { describeWithRedis, useRedis } from "./support/redis.js"

// First, so that its afterAll (stopping the server) runs after every layer and client is closed.
const redis = useRedis()

const CONTRACT_TTL = Duration.seconds(2)

/** The file's own client, for reading the store and the operator's revoke. */
let client: Redis | undefined
const inspector = (): Redis => (client ??= new Redis(redis.url(), { lazyConnect: true, maxRetriesPerRequest: 1 }))
afterAll(async () => {
  await client?.quit().catch(() => client?.disconnect())
})

describeWithRedis("RedisLease contract", () => {
  contractSuite("RedisLease", {
    clock: "live",
    ttl: CONTRACT_TTL,
    makeBackend: Effect.suspend(() => RedisLease.makeBackend({ url: redis.url(), ttl: CONTRACT_TTL })),
    // Live holders counted from Redis itself, not from a process.
    storeHolders: (name) => Effect.suspend(() => Effect.map(RedisLease.holders(inspector(), name), (held) => held.length)),
    advance: (duration) => Effect.sleep(duration),
    // The operator's revoke, on a client of its own.
    revoke: (name) => Effect.suspend(() => Effect.asVoid(RedisLease.revoke(inspector(), name))),
    maxNameBytes: RedisLease.defaults.maxNameBytes,
    minTtl: RedisLease.defaults.minTtl
  })
})

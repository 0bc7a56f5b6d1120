/**
 * Scenario 4 — the peers on scenarios 1 and 2: `advisory-lock` (PostgreSQL session advisory
 * locks, a connection per lock) and `effect-distributed-lock` (an Effect semaphore on Redis).
 * Each peer is measured interleaved with the floor of its own store — raw pg advisory locks,
 * raw Redis `SET NX PX` + compare-and-delete — so its ratio compares with effect-lock's ratios
 * to its floors in scenarios 1 and 2 (the side-by-side table at the top of the report).
 */
import * as Effect from "effect/Effect"
import * as Crypto from "node:crypto"
import type { Context, Scenario } from "../lib/context.js"
import {
  CONTENDERS,
  effectContender,
  measureHandoff,
  promiseContender,
  Recorder,
  renderHandoff,
  type HandoffRound,
  type HandoffRow,
  type HandoffSpec
} from "../lib/handoff.js"
import { effectLoop, promiseLoop, type ThroughputSample } from "../lib/loops.js"
import { createDatabase, type Database } from "../lib/postgres.js"
import { startRedis, type RedisStart } from "../lib/redis.js"
import type { Target } from "../lib/report.js"
import { lengthOf, type Subject } from "../lib/rounds.js"
import { measureThroughput, renderThroughput, type ThroughputRow, type ThroughputSpec } from "../lib/throughput.js"
import * as AdvisoryLock from "../peers/advisoryLock.js"
import * as Edl from "../peers/effectDistributedLock.js"
import { HANDOFF_EXPLANATION, rawHandoff } from "./handoff.js"
import { CONCURRENCIES, rawAdvisoryLock } from "./uncontended.js"

const range = (n: number): Array<number> => Array.from({ length: n }, (_, i) => i)

/** Compare-and-delete: the canonical owner-scoped release of a Redis lock. */
const DELETE_IF_OWNER = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"

const unavailable = (id: string, reason: string): Subject<never> => ({
  id,
  open: () => Promise.reject(new Error(reason))
})

// ---------------------------------------------------------------- advisory-lock

const advisoryLockThroughput = (database: Database, concurrency: number, durationMs: number): Subject<ThroughputSample> => ({
  id: `advisory-lock-${concurrency}`,
  open: async () => {
    const factory = await AdvisoryLock.load()
    const mutexes = range(concurrency).map((w) => factory(database.url)(`peer-advisory-lock-c${concurrency}-w${w}`))
    return {
      run: (round) =>
        promiseLoop(concurrency, lengthOf(round, durationMs), async (w) => {
          const unlock = await mutexes[w]!.lock()
          await unlock()
        }),
      close: async () => {}
    }
  }
})

const advisoryLockHandoff = (database: Database, durationMs: number): Subject<HandoffRound> => ({
  id: "advisory-lock-handoff",
  open: async () => {
    const factory = await AdvisoryLock.load()
    // One mutex object per contender, as 8 processes would each create their own.
    const mutexes = range(CONTENDERS).map(() => factory(database.url)("peer-handoff-advisory-lock"))
    return {
      run: async (round) => {
        const recorder = new Recorder(CONTENDERS, lengthOf(round, durationMs))
        await Promise.all(mutexes.map((mutex, who) => promiseContender(recorder, who, () => mutex.lock())))
        return recorder.finish()
      },
      close: async () => {}
    }
  }
})

// ---------------------------------------------------------------- Redis

type Redis = Readonly<{ url: string; loaded: Edl.Loaded }>

const connectRedis = (redis: Redis): Edl.RedisClient => new redis.loaded.Redis(redis.url, { maxRetriesPerRequest: 1 })

const rawRedisThroughput = (redis: Redis, concurrency: number, durationMs: number): Subject<ThroughputSample> => ({
  id: `raw-redis-${concurrency}`,
  open: async () => {
    const client = connectRedis(redis)
    const keys = range(concurrency).map((w) => `bench-raw:c${concurrency}-w${w}`)
    return {
      run: (round) =>
        promiseLoop(concurrency, lengthOf(round, durationMs), async (w) => {
          const token = Crypto.randomUUID()
          if ((await client.set(keys[w]!, token, "PX", 30_000, "NX")) !== "OK") throw new Error(`raw redis lock ${keys[w]} was not free`)
          await client.eval(DELETE_IF_OWNER, 1, keys[w]!, token)
        }),
      close: async () => {
        await client.quit().catch(() => client.disconnect())
      }
    }
  }
})

const edlThroughput = (redis: Redis, concurrency: number, durationMs: number, push: boolean): Subject<ThroughputSample> => {
  const id = `edl-${push ? "push" : "poll"}-${concurrency}`
  return {
    id,
    open: async () => {
      const client = connectRedis(redis)
      const { DistributedSemaphore, RedisBacking } = redis.loaded.module
      const semaphores = await Effect.runPromise(
        Effect.forEach(range(concurrency), (w) => DistributedSemaphore.make(`c${concurrency}-w${w}`, { limit: 1 })).pipe(
          Effect.provide(RedisBacking.layer(client, { keyPrefix: `bench-${id}:`, pushBasedAcquireEnabled: push }))
        )
      )
      return {
        run: (round) => Effect.runPromise(effectLoop(concurrency, lengthOf(round, durationMs), (w) => Effect.scoped(semaphores[w]!.take(1)))),
        close: async () => {
          await client.quit().catch(() => client.disconnect())
        }
      }
    }
  }
}

const edlHandoff = (redis: Redis, durationMs: number, push: boolean): Subject<HandoffRound> => {
  const id = `edl-${push ? "push" : "poll"}-handoff`
  return {
    id,
    open: async () => {
      const { DistributedSemaphore, RedisBacking } = redis.loaded.module
      // Eight clients and layers: eight "processes" on one key.
      const clients = range(CONTENDERS).map(() => connectRedis(redis))
      const semaphores = await Promise.all(clients.map((client) =>
        Effect.runPromise(
          DistributedSemaphore.make("handoff", { limit: 1 }).pipe(
            Effect.provide(RedisBacking.layer(client, { keyPrefix: `bench-${id}:`, pushBasedAcquireEnabled: push }))
          )
        )
      ))
      return {
        run: async (round) => {
          const recorder = new Recorder(CONTENDERS, lengthOf(round, durationMs))
          await Promise.all(semaphores.map((semaphore, who) => Effect.runPromise(effectContender(recorder, who, semaphore.take(1)))))
          return recorder.finish()
        },
        close: async () => {
          await Promise.all(clients.map((client) => client.quit().catch(() => client.disconnect())))
        }
      }
    }
  }
}

// ---------------------------------------------------------------- scenario

export interface PeersResult {
  readonly redis: string
  readonly uncontended: ReadonlyArray<{ readonly concurrency: number; readonly rows: ReadonlyArray<ThroughputRow> }>
  readonly handoff: ReadonlyArray<HandoffRow>
  readonly meta: Record<string, string>
}

const throughputSpecs = (database: Database, redis: Redis | string, c: number, ms: number): Array<ThroughputSpec> => {
  const redisSubject = (id: string, make: (r: Redis) => Subject<ThroughputSample>) =>
    typeof redis === "string" ? unavailable(`${id}-${c}`, redis) : make(redis)
  return [
    { block: "pg", id: "raw-advisory-lock", label: "raw pg: lock + unlock", connections: `${c}`, concurrency: c, subject: rawAdvisoryLock(database, c, ms) },
    { block: "pg", id: "advisory-lock", label: "advisory-lock (connection per lock)", connections: `${c} (a new one per cycle)`, concurrency: c, baseline: "raw-advisory-lock", subject: advisoryLockThroughput(database, c, ms) },
    { block: "redis", id: "raw-redis", label: "raw Redis: SET NX PX + compare-and-delete", connections: "1", concurrency: c, subject: redisSubject("raw-redis", (r) => rawRedisThroughput(r, c, ms)) },
    { block: "redis", id: "edl-push", label: "effect-distributed-lock (defaults: pub/sub on)", connections: "1 + a subscriber per take", concurrency: c, baseline: "raw-redis", subject: redisSubject("edl-push", (r) => edlThroughput(r, c, ms, true)) },
    { block: "redis", id: "edl-poll", label: "effect-distributed-lock (pub/sub off)", connections: "1", concurrency: c, baseline: "raw-redis", subject: redisSubject("edl-poll", (r) => edlThroughput(r, c, ms, false)) }
  ]
}

const handoffSpecs = (database: Database, redis: Redis | string, ms: number): Array<HandoffSpec> => {
  const redisSubject = (id: string, make: (r: Redis) => Subject<HandoffRound>) => (typeof redis === "string" ? unavailable(id, redis) : make(redis))
  return [
    { id: "raw", label: "raw pg: waiters blocked in pg_advisory_lock", setup: "8 connections", subject: rawHandoff(database, ms, false) },
    { id: "advisory-lock", label: "advisory-lock", setup: "8 mutex objects", baseline: "raw", subject: advisoryLockHandoff(database, ms) },
    { id: "edl-push", label: "effect-distributed-lock (pub/sub on)", setup: "8 clients + layers", baseline: "raw", subject: redisSubject("edl-push-handoff", (r) => edlHandoff(r, ms, true)) },
    { id: "edl-poll", label: "effect-distributed-lock (pub/sub off, 100 ms poll)", setup: "8 clients + layers", baseline: "raw", subject: redisSubject("edl-poll-handoff", (r) => edlHandoff(r, ms, false)) }
  ]
}

const run = async (context: Context): Promise<PeersResult> => {
  const started: RedisStart = await startRedis(context.log)
  let redis: Redis | string
  if (started._tag === "Started") {
    try {
      redis = { url: started.server.url, loaded: await Edl.load() }
    } catch (error) {
      redis = `effect-distributed-lock could not be loaded: ${error instanceof Error ? error.message : String(error)}`
    }
  } else {
    redis = started.reason
    context.log(`Redis rows skipped: ${started.reason}`)
  }
  const database = await createDatabase(context.adminUrl, "peers")
  try {
    const uncontended: Array<PeersResult["uncontended"][number]> = []
    for (const c of CONCURRENCIES) {
      uncontended.push({ concurrency: c, rows: await measureThroughput(context, `peers uncontended c=${c}`, throughputSpecs(database, redis, c, context.settings.throughputMs)) })
    }
    const handoff = await measureHandoff(context, "peers handoff", handoffSpecs(database, redis, context.settings.handoffMs))
    const redisVersion = started._tag === "Started" ? `redis-server ${started.server.version}` : `Redis unavailable: ${started.reason}`
    return { redis: redisVersion, uncontended, handoff, meta: { redis: redisVersion } }
  } finally {
    await database.drop()
    if (started._tag === "Started") await started.server.stop()
  }
}

const render = (result: PeersResult): string =>
  [
    `Redis: ${result.redis}, loopback, persistence off. Peer versions are listed at the top of this report.`,
    "",
    "**Uncontended cycles/s.** Same method as scenario 1. `advisory-lock` opens a new connection for every `lock()` " +
    "(and ends it on unlock), so its row is divided by raw pg lock + unlock on a kept connection. " +
    "`effect-distributed-lock` cycles are `Effect.scoped(semaphore.take(1))` on a per-worker key with `limit: 1`; " +
    "with pub/sub on (its default) every take also races a subscription on a duplicated Redis connection. Its rows " +
    "are divided by raw Redis `SET key token NX PX` + a compare-and-delete `EVAL` on one ioredis client.",
    "",
    ...result.uncontended.flatMap((level) => [`### ${level.concurrency} concurrent ${level.concurrency === 1 ? "worker" : "workers"}`, "", renderThroughput(level.rows), ""]),
    "**Handoff and fairness.** Same method as scenario 2, with its own raw pg floor measured in these rounds; every " +
    "row is divided by it (for the Redis peer that is a cross-store comparison: Redis has no server-side wait queue " +
    "to measure as a floor).",
    "",
    HANDOFF_EXPLANATION,
    "",
    renderHandoff(result.handoff)
  ].join("\n")

const targets = (): ReadonlyArray<Target> => []

export const scenario: Scenario<PeersResult> = {
  name: "peers",
  title: "4. Peers: advisory-lock and effect-distributed-lock",
  run,
  render,
  targets
}

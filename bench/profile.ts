/**
 * `npx tsx --import ./bench/lib/built.mjs bench/profile.ts [--seconds=S] [--only=<pair>[,<pair>]] [--allocations]`
 * (pairs: pg-advisory, pg-lease, xact, xact-16, pg-lease-16, memory, handoff-advisory,
 * handoff-lease, redis, redis-16, redis-effect, redis-effect-16, handoff-redis; default all)
 *
 * Where a lock cycle's time goes. Each subject (a backend's uncontended loop by one worker, or by
 * 16 for the `-16` pairs — PgLease on its default 4 lock connections, as the bench judges it: its
 * statements batched — or a handoff between 8 contenders) runs for S seconds (default 5) with
 * V8's CPU profiler on, started after the subject is opened and warmed up, so the profile holds
 * the loop only. For every subject it prints, per cycle: wall time, the CPU this process spent
 * (profile samples that are not idle), and that CPU split by where it ran — the driver (the
 * column "pg driver": node-postgres, or ioredis for the Redis pairs), Effect's runtime,
 * effect-lock's own code, Node's internals, the garbage collector. Wall time not spent on CPU
 * here is time waiting: for the server, for the network, or for a timer or scheduler hop.
 *
 * Each subject runs next to its raw floor (the same statements sent by raw node-postgres; for
 * Redis, the library's own Lua scripts sent by raw ioredis as EVALSHA — the subjects of the
 * bench's `redis` scenario), so the difference is the library's. The PostgreSQL pairs run on a
 * scratch database, the Redis pairs on one Redis (`startRedis`: EFFECT_LOCK_REDIS_URL /
 * REDIS_URL, else an own `redis-server`), each started only when a pair of it is selected;
 * without a Redis the Redis pairs are skipped, with the reason. The `.cpuprofile` files go to
 * `bench/results/profiles/` (git-ignored), for Chrome DevTools or `npx speedscope`.
 *
 * With `--allocations` it samples allocations instead (V8's sampling heap profiler, objects freed
 * by either collector included): bytes allocated per cycle, by the same places, and the functions
 * that allocated most.
 */
import { INSTALL_HINT, redisAvailable, startRedis } from "../tools/redisServer.js"
import { pgAdvisoryHandoff, pgLeaseHandoff, rawHandoff } from "./scenarios/handoff.js"
import { handoffSpecs as redisHandoffSpecs, own as ownRedis } from "./scenarios/redis.js"
import { own } from "./scenarios/uncontended.js"
import { type Database, runMain, withScratchDatabase } from "./lib/postgres.js"
import { allocations, OUT_DIR, print, printAllocations, profiled } from "./lib/profiling.js"
import type { Subject } from "./lib/rounds.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const seconds = Number(arg("seconds") ?? "5")
const only = arg("only")?.split(",")
/** `--allocations`: bytes allocated per cycle (V8's sampling heap profiler) instead of CPU. */
const countAllocations = process.argv.includes("--allocations")

/** A subject and its raw floor, built on `On` (the scratch database, or the Redis URL). */
interface Pair<On = Database> {
  readonly name: string
  readonly subject: (on: On, ms: number) => Subject<unknown>
  readonly floor: (on: On, ms: number) => Subject<unknown>
  readonly cycles: (result: unknown) => number
}

const throughput = (result: unknown) => (result as { readonly cycles: number }).cycles
const grants = (result: unknown) => (result as { readonly grants: number }).grants

const PAIRS: ReadonlyArray<Pair> = [
  { name: "pg-advisory", subject: (db, ms) => own("pgAdvisorySubject", db, 1, ms), floor: (db, ms) => own("rawAdvisoryFenced", db, 1, 1, ms), cycles: throughput },
  { name: "pg-lease", subject: (db, ms) => own("pgLeaseSubject", db, 1, ms), floor: (db, ms) => own("rawLease", db, 1, ms), cycles: throughput },
  { name: "xact", subject: (db, ms) => own("xactSubject", db, 1, ms), floor: (db, ms) => own("rawXactLibrary", db, 1, ms), cycles: throughput },
  { name: "xact-16", subject: (db, ms) => own("xactSubject", db, 16, ms), floor: (db, ms) => own("sqlXactSubject", db, 16, ms), cycles: throughput },
  { name: "pg-lease-16", subject: (db, ms) => own("pgLeaseSubject", db, 16, ms), floor: (db, ms) => own("rawLease", db, 16, ms), cycles: throughput },
  { name: "memory", subject: (_, ms) => own("memorySubject", undefined, 1, ms), floor: (_, ms) => own("semaphoreSubject", undefined, 1, ms), cycles: throughput },
  { name: "handoff-advisory", subject: (db, ms) => pgAdvisoryHandoff(db, ms, 8), floor: (db, ms) => rawHandoff(db, ms, true), cycles: grants },
  { name: "handoff-lease", subject: (db, ms) => pgLeaseHandoff(db, ms, true), floor: (db, ms) => rawHandoff(db, ms, true), cycles: grants }
]

/** The Redis handoff rows of `scenarios/redis.ts`, by id ("raw" or "redis-lease-8"). */
const redisHandoff = (url: string, ms: number, id: "raw" | "redis-lease-8"): Subject<unknown> => {
  const spec = redisHandoffSpecs({ url }, ms, true).find((s) => s.id === id)
  if (spec === undefined) throw new Error(`scenarios/redis.ts has no handoff row ${id}`)
  return spec.subject
}

const REDIS_PAIRS: ReadonlyArray<Pair<string>> = [
  { name: "redis", subject: (url, ms) => ownRedis("redisLeaseSubject", url, 1, ms), floor: (url, ms) => ownRedis("rawRedisLease", url, 1, ms), cycles: throughput },
  { name: "redis-16", subject: (url, ms) => ownRedis("redisLeaseSubject", url, 16, ms), floor: (url, ms) => ownRedis("rawRedisLease", url, 16, ms), cycles: throughput },
  // The Effect floor (the raw row's two calls in Effect.scoped(acquireRelease), no lock logic) against raw.
  { name: "redis-effect", subject: (url, ms) => ownRedis("effectRedisFloor", url, 1, ms), floor: (url, ms) => ownRedis("rawRedisLease", url, 1, ms), cycles: throughput },
  { name: "redis-effect-16", subject: (url, ms) => ownRedis("effectRedisFloor", url, 16, ms), floor: (url, ms) => ownRedis("rawRedisLease", url, 16, ms), cycles: throughput },
  { name: "handoff-redis", subject: (url, ms) => redisHandoff(url, ms, "redis-lease-8"), floor: (url, ms) => redisHandoff(url, ms, "raw"), cycles: grants }
]

const selected = <On>(pairs: ReadonlyArray<Pair<On>>): ReadonlyArray<Pair<On>> => pairs.filter((pair) => only === undefined || only.includes(pair.name))

const profilePairs = async <On>(pairs: ReadonlyArray<Pair<On>>, on: On): Promise<void> => {
  const ms = seconds * 1000
  for (const pair of pairs) {
    if (countAllocations) {
      printAllocations(`${pair.name}, raw floor`, await allocations(pair.floor(on, ms), pair.cycles))
      printAllocations(`${pair.name}, effect-lock`, await allocations(pair.subject(on, ms), pair.cycles))
      continue
    }
    print(`${pair.name}, raw floor`, (await profiled(pair.floor(on, ms), pair.cycles))[0]!)
    print(`${pair.name}, effect-lock`, (await profiled(pair.subject(on, ms), pair.cycles))[0]!)
  }
}

runMain(async () => {
  const pgPairs = selected(PAIRS)
  const redisPairs = selected(REDIS_PAIRS)
  if (pgPairs.length > 0) await withScratchDatabase("profile", (database) => profilePairs(pgPairs, database))
  if (redisPairs.length > 0) {
    if (!redisAvailable()) {
      console.log(`\nRedis pairs (${redisPairs.map((pair) => pair.name).join(", ")}) skipped: ${INSTALL_HINT}`)
    } else {
      const server = await startRedis()
      try {
        await profilePairs(redisPairs, server.url)
      } finally {
        await server.stop()
      }
    }
  }
  console.log(`\nprofiles written to ${OUT_DIR}`)
})

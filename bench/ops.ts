/**
 * `npx tsx bench/ops.ts [--cycles=N]`
 *
 * How much Effect work one lock cycle is: the Effect operations run and the fibers started on the
 * caller's fiber (and its children) per `Effect.scoped(DistributedLock.acquire(name))`, counted by
 * a supervisor with op supervision on, one worker, after a warm-up; and for a handoff, per grant
 * between 8 contenders on 8 PgAdvisory layers (acquire, hold 1 ms, release). Work the layers do on
 * their own runtimes is not counted (`Owner`: no supervisor of the caller's reaches it); the
 * resumptions line counts every fiber's resumptions, so background rounds per cycle show there.
 */
import { SqlClient } from "@effect/sql"
import pg from "pg"
import { PgClient } from "@effect/sql-pg"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as ManagedRuntime from "effect/ManagedRuntime"
import * as Redacted from "effect/Redacted"
import * as RuntimeFlags from "effect/RuntimeFlags"
import * as RuntimeFlagsPatch from "effect/RuntimeFlagsPatch"
import * as Supervisor from "effect/Supervisor"
import * as DistributedLock from "../src/DistributedLock.js"
import * as MemoryBackend from "../src/MemoryBackend.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import * as PgLease from "../src/PgLease.js"
import * as RedisLease from "../src/RedisLease.js"
import { INSTALL_HINT, redisAvailable, startRedis } from "../tools/redisServer.js"
import { runMain, withScratchDatabase } from "./lib/postgres.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const cycles = Number(arg("cycles") ?? "2000")

class Counting extends Supervisor.AbstractSupervisor<void> {
  ops = 0
  fibers = 0
  override value = Effect.void
  override onStart() {
    this.fibers++
  }
  override onEffect() {
    this.ops++
  }
}

/** Every fiber's resumptions (any runtime), counted while `counting` is on. */
const resumptions = (() => {
  const proto = Object.getPrototypeOf(Effect.runFork(Effect.void)) as { evaluateEffect: (...args: Array<unknown>) => unknown }
  const original = proto.evaluateEffect
  const state = { counting: false, count: 0 }
  proto.evaluateEffect = function(this: unknown, ...args: Array<unknown>) {
    if (state.counting) state.count++
    return original.apply(this, args)
  }
  return state
})()

const counted = <A, E, R>(self: Effect.Effect<A, E, R>, supervisor: Counting) =>
  Effect.withRuntimeFlagsPatch(Effect.supervised(self, supervisor), RuntimeFlagsPatch.enable(RuntimeFlags.OpSupervision))

const perCycle = async <S>(
  label: string,
  layer: Layer.Layer<S, unknown>,
  cycle: Effect.Effect<unknown, unknown, S> = Effect.scoped(DistributedLock.acquire(`ops-${label}`)) as never
) => {
  const runtime = ManagedRuntime.make(layer)
  try {
    await runtime.runPromise(Effect.repeatN(cycle, 300))
    const supervisor = new Counting()
    resumptions.count = 0
    resumptions.counting = true
    await runtime.runPromise(counted(Effect.repeatN(cycle, cycles - 1), supervisor))
    resumptions.counting = false
    console.log(
      `${label.padEnd(22)} ${(supervisor.ops / cycles).toFixed(0).padStart(4)} Effect ops, ` +
        `${(supervisor.fibers / cycles).toFixed(2)} fibers started, ${(resumptions.count / cycles).toFixed(2)} fiber resumptions per cycle`
    )
  } finally {
    await runtime.dispose()
  }
}

/** The database's committed transactions so far (`pg_stat_database`), on a connection of its own. */
const xactCommits = async (url: string) => {
  const client = new pg.Client({ connectionString: url })
  await client.connect()
  return {
    read: async () =>
      Number((await client.query<{ n: string }>("select xact_commit::text as n from pg_stat_database where datname = current_database()")).rows[0]!.n),
    close: () => client.end()
  }
}

/** 8 contenders on `layers` layers (8: one each, as 8 processes; 1: 8 fibers of one layer). */
const handoff = async (
  label: string,
  layer: (i: number) => Layer.Layer<DistributedLock.DistributedLock, unknown>,
  layers = 8,
  /** A PostgreSQL database: its committed transactions per grant are printed too (everything the layers sent). */
  database?: { readonly url: string }
) => {
  const runtimes = Array.from({ length: layers }, (_, i) => ManagedRuntime.make(layer(i)))
  const contenders = Array.from({ length: 8 }, (_, i) => runtimes[i % layers]!)
  try {
    let grants = 0
    const contender = (ms: number) =>
      Effect.gen(function*() {
        const end = Date.now() + ms
        while (Date.now() < end) {
          yield* Effect.scoped(Effect.zipRight(DistributedLock.acquire("ops-handoff"), Effect.sleep("1 millis")))
          grants++
        }
      })
    await Promise.all(contenders.map((runtime) => runtime.runPromise(contender(1_000))))
    grants = 0
    const commits = database === undefined ? undefined : await xactCommits(database.url)
    const before = await commits?.read()
    const supervisor = new Counting()
    resumptions.count = 0
    resumptions.counting = true
    await Promise.all(contenders.map((runtime) => runtime.runPromise(counted(contender(3_000), supervisor))))
    resumptions.counting = false
    console.log(
      `${`${label} handoff ${layers === 8 ? "× 8" : `${layers}×8`}`.padEnd(22)} ${(supervisor.ops / grants).toFixed(0).padStart(4)} Effect ops, ` +
        `${(supervisor.fibers / grants).toFixed(2)} fibers started, ${(resumptions.count / grants).toFixed(2)} fiber resumptions (every runtime's)` +
        (commits === undefined ? "" : `, ${(((await commits.read()) - before!) / grants).toFixed(2)} transactions`) +
        ` per grant (${grants} grants)`
    )
    await commits?.close()
  } finally {
    await Promise.all(runtimes.map((runtime) => runtime.dispose()))
  }
}

runMain(() =>
  withScratchDatabase("ops", async (database) => {
    await perCycle("MemoryBackend", MemoryBackend.layer())
    await perCycle("PgAdvisory", PgAdvisory.layer({ url: database.url, applicationName: "bench-ops" }))
    await perCycle(
      "PgLease",
      Layer.provide(PgLease.layer({ connections: 1 }), PgClient.layer({ url: Redacted.make(database.url), maxConnections: 1 }))
    )
    const pool = PgClient.layer({ url: Redacted.make(database.url), maxConnections: 1 })
    await perCycle(
      "sql withTransaction",
      pool,
      Effect.flatMap(SqlClient.SqlClient, (sql) =>
        sql.withTransaction(sql`select pg_try_advisory_xact_lock(${"1"}::bigint) as granted`.withoutTransform))
    )
    await perCycle("withXactLock", pool, PgAdvisory.withXactLock(Effect.void, "ops-xact"))
    await handoff("PgAdvisory", (i) => PgAdvisory.layer({ url: database.url, applicationName: `bench-ops-${i}` }))
    await handoff("PgAdvisory", () => PgAdvisory.layer({ url: database.url, applicationName: "bench-ops-one" }), 1)
    await handoff("PgLease", (i) =>
      Layer.provide(
        PgLease.layer({ connections: 2, listen: true }),
        PgClient.layer({ url: Redacted.make(database.url), maxConnections: 2, applicationName: `bench-ops-lease-${i}` })
      ), 8, database)
    if (!redisAvailable()) return console.log(`RedisLease handoff skipped: ${INSTALL_HINT}`)
    const redis = await startRedis()
    try {
      await perCycle("RedisLease", RedisLease.layer({ url: redis.url, prefix: "bench-ops:" }))
      // The least an Effect program taking a lease does: two async calls in a scoped acquireRelease.
      await perCycle("Effect floor", Layer.empty, Effect.scoped(Effect.acquireRelease(Effect.promise(() => Promise.resolve(1)), () => Effect.promise(() => Promise.resolve()))))
      await handoff("RedisLease", () => RedisLease.layer({ url: redis.url, prefix: "bench-ops:" }))
    } finally {
      await redis.stop()
    }
  })
)

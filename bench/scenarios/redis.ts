/**
 * Scenario 9 — RedisLease (issue 36): against raw ioredis sending the library's own Lua scripts
 * (the texts of `src/internal/redis/scripts.ts`, as EVALSHA, with the same keys and arguments),
 * and beside two Redis peers on the same server.
 *
 * - uncontended acquire + release of per-worker names by 1 and 16 workers: `RedisLease.layer`
 *   (its lock commands go on ONE connection) beside one raw ioredis client sending the acquire
 *   and release scripts in a loop; each row in a process of its own, interleaved in rounds;
 * - handoff and longest wait: 8 contenders on one name (acquire → hold 1 ms → release), 8
 *   layers against 8 raw waiters that each subscribe to the wake channel, hold the lease when
 *   the release script says it handed it to their place, and retry the acquire script when
 *   their place is only woken;
 * - peers (information only): effect-distributed-lock and redlock, an uncontended loop each,
 *   against a raw `SET NX PX` + compare-and-delete floor.
 *
 * Without a Redis (no `redis-server` on the PATH and neither EFFECT_LOCK_REDIS_URL nor
 * REDIS_URL) every row is skipped with the reason, and the targets are n/a.
 */
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { Redis } from "ioredis"
import * as Crypto from "node:crypto"
import * as Os from "node:os"
import * as Keys from "../../src/internal/redis/keys.js"
import * as Scripts from "../../src/internal/redis/scripts.js"
import * as RedisLease from "../../src/RedisLease.js"
import { redactRedisUrl, startRedis, type RedisServer } from "../../tools/redisServer.js"
import type { Context, Scenario } from "../lib/context.js"
import {
  CONTENDERS,
  HOLD_MS,
  measureHandoff,
  promiseContender,
  Recorder,
  renderHandoff,
  type HandoffRound,
  type HandoffRow,
  type HandoffSpec
} from "../lib/handoff.js"
import { isolated, isolatedRounds } from "../lib/isolated.js"
import { effectLoop, promiseLoop, type ThroughputSample } from "../lib/loops.js"
import * as Report from "../lib/report.js"
import type { Target } from "../lib/report.js"
import { lengthOf, reasonOf, type Subject } from "../lib/rounds.js"
import { openRuntime } from "../lib/runtime.js"
import { measureThroughput, ratioOf, renderThroughput, type ThroughputRow, type ThroughputSpec } from "../lib/throughput.js"
import * as Edl from "../peers/effectDistributedLock.js"
import { lockHandoff } from "./handoff.js"
import { CONCURRENCIES, IN_PROCESS, lockCycle } from "./uncontended.js"

const range = (n: number): Array<number> => Array.from({ length: n }, (_, i) => i)
const workerNames = (prefix: string, concurrency: number) => range(concurrency).map((w) => `${prefix}-c${concurrency}-w${w}`)

/** Lease length of every row: the library's default, so no renewal falls into a round. */
const TTL_MS = 30_000
/** How long a waiting place lasts unless its waiter retries: the library's (5 s). */
const PLACE_MS = 5_000
/** The raw waiter's retry when no wake-up came: the library's default poll interval. */
const RAW_POLL_MS = 500

/** Compare-and-delete: the canonical owner-scoped release of a `SET NX PX` lock. */
const DELETE_IF_OWNER = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"

const connect = (url: string, name: string): Redis => new Redis(url, { maxRetriesPerRequest: 1, connectionName: name })

const quit = async (client: Redis): Promise<void> => {
  await client.quit().catch(() => client.disconnect())
}

/** Loads a script and answers its sha1 (EVALSHA from then on, as the library does). */
const load = async (client: Redis, text: string): Promise<string> => String(await client.script("LOAD", text))

/** The raw side of RedisLease's scripts under `prefix`: acquire and release of one name by one owner. */
const rawScripts = async (client: Redis, prefix: string) => {
  const acquireSha = await load(client, Scripts.acquire)
  const releaseSha = await load(client, Scripts.release)
  const channel = Keys.channelOf(prefix)
  const host = Os.hostname()
  return {
    channel,
    keysOf: (name: string) => Keys.keyList(Keys.lockKeys(prefix, name)),
    /** One attempt: the token, or the wait (ms) the script advises. Arguments in `Scripts.acquire`'s order. */
    acquire: async (keys: ReadonlyArray<string>, name: string, owner: string, waiter: string): Promise<{ token: string | null; wait: number | null; handed: boolean }> => {
      const answer = (await client.evalsha(
        acquireSha, keys.length, ...keys,
        name, owner, waiter, "exclusive", TTL_MS, PLACE_MS, "bench-raw-redis", host, process.pid, "1"
      )) as [string | null, number | null, number | null]
      // Handed: the lease a release handed to `waiter`'s place, whose owner is the place.
      return { token: answer[0] ?? null, wait: answer[1] ?? null, handed: answer[2] === 1 }
    },
    release: async (keys: ReadonlyArray<string>, name: string, owner: string, waiter: string): Promise<void> => {
      await client.evalsha(releaseSha, keys.length, ...keys, name, owner, waiter, channel)
    }
  }
}

/** One uncontended acquire of `name` by a new owner and place, which must be granted; its owner, for the release. */
const grantedOwner = async (raw: Awaited<ReturnType<typeof rawScripts>>, keys: ReadonlyArray<string>, name: string, row: string) => {
  const owner = Crypto.randomUUID()
  const granted = await raw.acquire(keys, name, owner, Crypto.randomUUID())
  if (granted.token === null) throw new Error(`${row}: ${name} was not granted`)
  return owner
}

// ---------------------------------------------------------------- uncontended

/** Raw ioredis on one connection: `Scripts.acquire` then `Scripts.release`, same keys and arguments. */
const rawRedisLease = (url: string, concurrency: number, durationMs: number): Subject<ThroughputSample> => ({
  id: `raw-redis-lease-${concurrency}`,
  open: async () => {
    const client = connect(url, `bench-raw-redis-lease-${concurrency}`)
    const prefix = `bench-raw-${concurrency}:`
    const raw = await rawScripts(client, prefix)
    const names = workerNames("raw", concurrency)
    const keys = names.map(raw.keysOf)
    return {
      run: (round) =>
        promiseLoop(concurrency, lengthOf(round, durationMs), async (w) => {
          const owner = await grantedOwner(raw, keys[w]!, names[w]!, "raw redis lease")
          // No place to name: a granted holder's release sends none, as RedisLease's (checked with INFO commandstats).
          await raw.release(keys[w]!, names[w]!, owner, "")
        }),
      close: () => quit(client)
    }
  }
})

/**
 * The least an Effect program that takes and gives back a lease can do: the raw row's two script
 * calls as `Effect.scoped(Effect.acquireRelease(...))`, on the same fibers' loop as the library's
 * row. What it costs against the raw row is Effect's, whichever lock library runs in it.
 */
const effectRedisFloor = (url: string, concurrency: number, durationMs: number): Subject<ThroughputSample> => ({
  id: `effect-redis-floor-${concurrency}`,
  open: async () => {
    const client = connect(url, `bench-effect-redis-floor-${concurrency}`)
    const prefix = `bench-effect-floor-${concurrency}:`
    const raw = await rawScripts(client, prefix)
    const names = workerNames("floor", concurrency)
    const keys = names.map(raw.keysOf)
    const runtime = await openRuntime(Layer.empty)
    const cycle = (w: number) =>
      Effect.scoped(Effect.acquireRelease(
        Effect.promise(() => grantedOwner(raw, keys[w]!, names[w]!, "effect floor")),
        // No place to name, as the raw row's release.
        (owner) => Effect.promise(() => raw.release(keys[w]!, names[w]!, owner, ""))
      ))
    return {
      run: (round) => runtime.run(effectLoop(concurrency, lengthOf(round, durationMs), cycle)),
      close: async () => {
        await runtime.close()
        await quit(client)
      }
    }
  }
})

/** `DistributedLock.acquire` + scope close (or `withLock`) on `RedisLease.layer`. */
const redisLeaseSubject = (url: string, concurrency: number, durationMs: number, form: "acquire" | "withLock" = "acquire"): Subject<ThroughputSample> => {
  const id = form === "acquire" ? `redis-lease-${concurrency}` : `redis-lease-withlock-${concurrency}`
  const names = workerNames(form === "acquire" ? "lease" : "lease-withlock", concurrency)
  return {
    id,
    open: async () => {
      const runtime = await openRuntime(RedisLease.layer({ url, prefix: `bench-${id}:`, applicationName: `bench-${id}` }))
      return {
        run: (round) => runtime.run(effectLoop(concurrency, lengthOf(round, durationMs), (w) => lockCycle(form, names[w]!))),
        close: runtime.close
      }
    }
  }
}

/** Raw `SET key token NX PX` + compare-and-delete on one connection: the floor the peers are divided by. */
const rawSetNx = (url: string, concurrency: number, durationMs: number): Subject<ThroughputSample> => ({
  id: `raw-setnx-${concurrency}`,
  open: async () => {
    const client = connect(url, `bench-raw-setnx-${concurrency}`)
    const keys = workerNames("bench-setnx", concurrency)
    return {
      run: (round) =>
        promiseLoop(concurrency, lengthOf(round, durationMs), async (w) => {
          const token = Crypto.randomUUID()
          if ((await client.set(keys[w]!, token, "PX", TTL_MS, "NX")) !== "OK") throw new Error(`raw lock ${keys[w]} was not free`)
          await client.eval(DELETE_IF_OWNER, 1, keys[w]!, token)
        }),
      close: () => quit(client)
    }
  }
})

/** effect-distributed-lock: `Effect.scoped(semaphore.take(1))` on a per-worker key, `limit: 1`, its defaults otherwise. */
const edlSubject = (url: string, concurrency: number, durationMs: number): Subject<ThroughputSample> => ({
  id: `edl-${concurrency}`,
  open: async () => {
    const loaded = await Edl.load()
    const client = new loaded.Redis(url, { maxRetriesPerRequest: 1 })
    const { DistributedSemaphore, RedisBacking } = loaded.module
    const semaphores = await Effect.runPromise(
      Effect.forEach(range(concurrency), (w) => DistributedSemaphore.make(`c${concurrency}-w${w}`, { limit: 1 })).pipe(
        Effect.provide(RedisBacking.layer(client, { keyPrefix: `bench-edl-${concurrency}:` }))
      )
    )
    return {
      run: (round) => Effect.runPromise(effectLoop(concurrency, lengthOf(round, durationMs), (w) => Effect.scoped(semaphores[w]!.take(1)))),
      close: async () => {
        await client.quit().catch(() => client.disconnect())
      }
    }
  }
})

/** The part of redlock (v5) used here: `new Redlock(clients, settings)`, `acquire(resources, ms)`, `lock.release()`. */
interface RedlockLock {
  readonly release: () => Promise<unknown>
}
interface RedlockInstance {
  readonly acquire: (resources: Array<string>, duration: number) => Promise<RedlockLock>
}
type RedlockConstructor = new (clients: Iterable<unknown>, settings?: { readonly retryCount?: number }) => RedlockInstance

const loadRedlock = async (): Promise<RedlockConstructor> => {
  // A computed specifier: resolved at run time from bench/scenarios, so it finds bench/node_modules.
  const name = "redlock"
  const module = (await import(name)) as { default?: unknown; Redlock?: unknown }
  const Redlock = (module.default ?? module.Redlock) as RedlockConstructor | undefined
  if (typeof Redlock !== "function") throw new Error("redlock did not load as expected")
  return Redlock
}

/** redlock on one server (one client): acquire + release of a per-worker resource. */
const redlockSubject = (url: string, concurrency: number, durationMs: number): Subject<ThroughputSample> => ({
  id: `redlock-${concurrency}`,
  open: async () => {
    const Redlock = await loadRedlock()
    const client = connect(url, `bench-redlock-${concurrency}`)
    // Uncontended: a retry would only hide a failure, so none.
    const redlock = new Redlock([client], { retryCount: 0 })
    const keys = workerNames("bench-redlock", concurrency)
    return {
      run: (round) =>
        promiseLoop(concurrency, lengthOf(round, durationMs), async (w) => {
          const lock = await redlock.acquire([keys[w]!], TTL_MS)
          await lock.release()
        }),
      close: () => quit(client)
    }
  }
})

/** What the child process of `isolated.ts` can build (the first argument is the unused database). */
export const FACTORIES = {
  rawRedisLease: (_: unknown, url: string, c: number, ms: number) => rawRedisLease(url, c, ms),
  redisLeaseSubject: (_: unknown, url: string, c: number, ms: number) => redisLeaseSubject(url, c, ms),
  effectRedisFloor: (_: unknown, url: string, c: number, ms: number) => effectRedisFloor(url, c, ms),
  redisLeaseWithLockSubject: (_: unknown, url: string, c: number, ms: number) => redisLeaseSubject(url, c, ms, "withLock"),
  rawSetNx: (_: unknown, url: string, c: number, ms: number) => rawSetNx(url, c, ms),
  edlSubject: (_: unknown, url: string, c: number, ms: number) => edlSubject(url, c, ms),
  redlockSubject: (_: unknown, url: string, c: number, ms: number) => redlockSubject(url, c, ms)
}

/** The row of `FACTORIES[factory]` in a process of its own (see `uncontended.ts`), unless BENCH_IN_PROCESS=1. Also `bench/profile.ts`'s. */
export const own = (factory: keyof typeof FACTORIES, url: string, c: number, ms: number): Subject<ThroughputSample> => {
  const local = FACTORIES[factory](undefined, url, c, ms)
  return IN_PROCESS ? local : isolated(local, { module: import.meta.url, factory, database: undefined, args: [url, c, ms] })
}

const unavailable = <R>(id: string, reason: string): Subject<R> => ({ id, open: () => Promise.reject(new Error(reason)) })

const throughputSpecs = (redis: string | { readonly url: string }, c: number, ms: number): Array<ThroughputSpec> => {
  const subject = (factory: keyof typeof FACTORIES, id: string) =>
    typeof redis === "string" ? unavailable<ThroughputSample>(`${id}-${c}`, redis) : own(factory, redis.url, c, ms)
  return [
    { block: "lease", id: "raw-redis-lease", label: "raw ioredis: RedisLease's scripts (EVALSHA)", connections: "1", concurrency: c, subject: subject("rawRedisLease", "raw-redis-lease") },
    // Information: what any Effect program pays on these scripts (the library's row stays judged against raw ioredis).
    { block: "lease", id: "effect-redis-floor", label: "Effect.scoped(acquireRelease) of RedisLease's scripts on raw ioredis", connections: "1", concurrency: c, baseline: "raw-redis-lease", subject: subject("effectRedisFloor", "effect-redis-floor") },
    { block: "lease", id: "redis-lease", label: "RedisLease.layer", connections: "1 (+ renewal, subscriber)", concurrency: c, baseline: "raw-redis-lease", subject: subject("redisLeaseSubject", "redis-lease") },
    // Information: the guarded form (`withLock(Effect.void, name)`) on the same layer.
    { block: "lease", id: "redis-lease-withlock", label: "RedisLease.layer, withLock (information)", connections: "1 (+ renewal, subscriber)", concurrency: c, baseline: "raw-redis-lease", subject: subject("redisLeaseWithLockSubject", "redis-lease-withlock") },
    { block: "peers", id: "raw-setnx", label: "raw ioredis: SET NX PX + compare-and-delete", connections: "1", concurrency: c, subject: subject("rawSetNx", "raw-setnx") },
    { block: "peers", id: "edl", label: "effect-distributed-lock (defaults: pub/sub on)", connections: "1 + a subscriber per take", concurrency: c, baseline: "raw-setnx", subject: subject("edlSubject", "edl") },
    { block: "peers", id: "redlock", label: "redlock (1 server, retryCount 0)", connections: "1", concurrency: c, baseline: "raw-setnx", subject: subject("redlockSubject", "redlock") }
  ]
}

// ---------------------------------------------------------------- handoff

/**
 * The raw floor of a Redis handoff: 8 contenders, each with a command connection and a
 * subscriber on the wake channel (as each RedisLease layer has). A contender runs the acquire
 * script with a waiter id; not granted, it waits for the wake-up naming that id (or the
 * script's advised wait, at most the library's poll interval) and runs it again, or holds the
 * lease at once when the wake-up says a release handed it over. Release: the release script,
 * which hands the lease to the waiter at the head (or wakes it) and publishes that.
 */
const rawHandoff = (url: string, durationMs: number): Subject<HandoffRound> => ({
  id: "raw-redis-handoff",
  open: async () => {
    const prefix = "bench-raw-handoff:"
    const name = "handoff"
    const clients = range(CONTENDERS).map((i) => connect(url, `bench-raw-handoff-${i}`))
    const subscribers = range(CONTENDERS).map((i) => connect(url, `bench-raw-handoff-sub-${i}`))
    const close = async () => {
      await Promise.all([...clients, ...subscribers].map(quit))
    }
    try {
      const raws = await Promise.all(clients.map((client) => rawScripts(client, prefix)))
      const channel = raws[0]!.channel
      const keys = raws[0]!.keysOf(name)
      // Acknowledged before the first try, as the library's subscription is.
      await Promise.all(subscribers.map((s) => s.subscribe(channel)))
      const contenders = range(CONTENDERS).map((who) => {
        const raw = raws[who]!
        let waiter = ""
        let woken = false
        let wake: (() => void) | undefined
        let handed = false
        subscribers[who]!.on("message", (_channel: string, message: string) => {
          if (waiter === "") return
          // The release handed this place the lease (`h<place>:<token>:<expiry>`): held, no command.
          if (message.startsWith(`h${waiter}:`)) handed = true
          else if (message !== `w${waiter}`) return
          woken = true
          wake?.()
        })
        return async (): Promise<() => Promise<void>> => {
          let owner: string = Crypto.randomUUID()
          // Set before the first try: a wake-up that arrives before the answer is not lost.
          waiter = Crypto.randomUUID()
          woken = false
          handed = false
          for (;;) {
            if (handed) {
              owner = waiter
              break
            }
            const granted = await raw.acquire(keys, name, owner, waiter)
            if (granted.token !== null) {
              if (granted.handed) owner = waiter
              break
            }
            if (!woken) {
              await new Promise<void>((resolve) => {
                const timer = setTimeout(resolve, Math.max(1, Math.min(granted.wait ?? RAW_POLL_MS, RAW_POLL_MS)))
                wake = () => {
                  clearTimeout(timer)
                  resolve()
                }
              })
              wake = undefined
            }
            woken = false
          }
          const mine = waiter
          waiter = ""
          return () => raw.release(keys, name, owner, mine)
        }
      })
      return {
        run: async (round) => {
          const recorder = new Recorder(CONTENDERS, lengthOf(round, durationMs))
          await Promise.all(contenders.map((acquire, who) => promiseContender(recorder, who, acquire)))
          return recorder.finish()
        },
        close
      }
    } catch (error) {
      await close()
      throw error
    }
  }
})

const redisLeaseHandoff = (url: string, ms: number): Subject<HandoffRound> =>
  lockHandoff("redis-lease-8", CONTENDERS, (i) => RedisLease.layer({ url, prefix: "bench-lease-handoff:", applicationName: `bench-handoff-${i}` }), ms)

/** The handoff rows' subjects by name, for the child process that measures each (`isolated.ts`). */
export const HANDOFF_FACTORIES = {
  rawHandoff: (_: unknown, url: string, ms: number) => rawHandoff(url, ms),
  redisLeaseHandoff: (_: unknown, url: string, ms: number) => redisLeaseHandoff(url, ms)
}

/** A handoff row in a process of its own, as scenario 2's (unless BENCH_IN_PROCESS=1, or `local` for `bench/profile.ts`). */
const ownHandoff = (factory: keyof typeof HANDOFF_FACTORIES, url: string, ms: number, local: boolean): Subject<HandoffRound> => {
  const subject = HANDOFF_FACTORIES[factory](undefined, url, ms)
  return IN_PROCESS || local ? subject : isolatedRounds(subject, { module: import.meta.url, table: "HANDOFF_FACTORIES", factory, database: undefined, args: [url, ms] })
}

/**
 * The handoff rows (ids "raw" and "redis-lease-8"), each in a process of its own; `bench/profile.ts`
 * profiles their subjects in its own process (`inProcess`).
 */
export const handoffSpecs = (redis: string | { readonly url: string }, ms: number, inProcess = false): Array<HandoffSpec> => [
  {
    id: "raw",
    label: "raw ioredis: RedisLease's scripts, waiters woken on the channel",
    setup: "8 connections + 8 subscribers",
    subject: typeof redis === "string" ? unavailable("raw-redis-handoff", redis) : ownHandoff("rawHandoff", redis.url, ms, inProcess)
  },
  {
    id: "redis-lease-8",
    label: "RedisLease.layer",
    setup: "8 layers (\"processes\")",
    baseline: "raw",
    subject: typeof redis === "string" ? unavailable("redis-lease-handoff", redis) : ownHandoff("redisLeaseHandoff", redis.url, ms, inProcess)
  }
]

// ---------------------------------------------------------------- scenario

export interface RedisResult {
  readonly redis: string
  readonly uncontended: ReadonlyArray<{ readonly concurrency: number; readonly rows: ReadonlyArray<ThroughputRow> }>
  readonly handoff: ReadonlyArray<HandoffRow>
  readonly meta: Record<string, string>
}

const serverVersion = async (url: string): Promise<string> => {
  const client = connect(url, "bench-redis-info")
  try {
    const info = String(await client.info("server"))
    return info.match(/redis_version:([^\r\n]+)/)?.[1] ?? "?"
  } finally {
    await quit(client)
  }
}

const run = async (context: Context): Promise<RedisResult> => {
  let server: RedisServer | undefined
  let redis: string | { readonly url: string }
  let described: string
  try {
    server = await startRedis()
    redis = { url: server.url }
    described = `redis-server ${await serverVersion(server.url)} (${server.embedded ? "own, loopback, persistence off" : redactRedisUrl(server.url)})`
  } catch (error) {
    redis = `no Redis: ${reasonOf(error)}`
    described = `Redis unavailable: ${reasonOf(error)}`
    context.log(`scenario redis: every row skipped: ${reasonOf(error)}`)
  }
  try {
    if (typeof redis !== "string" && server?.embedded === false) {
      // A server of the environment: only the bench's own prefixes are ever written.
      context.log(`scenario redis: using ${redactRedisUrl(redis.url)} (keys under bench-*)`)
    }
    const uncontended: Array<RedisResult["uncontended"][number]> = []
    for (const c of CONCURRENCIES) {
      uncontended.push({ concurrency: c, rows: await measureThroughput(context, `redis uncontended c=${c}`, throughputSpecs(redis, c, context.settings.throughputMs)) })
    }
    const handoff = await measureHandoff(context, "redis handoff", handoffSpecs(redis, context.settings.handoffMs))
    return { redis: described, uncontended, handoff, meta: { redis: described } }
  } finally {
    await server?.stop()
  }
}

const render = (result: RedisResult): string =>
  [
    `Redis: ${result.redis}. Peer versions are listed at the top of this report.`,
    "",
    "**Uncontended cycles/s.** Same method as scenario 1 (each row in a process of its own, interleaved rounds, " +
    "medians). *raw ioredis: RedisLease's scripts* sends the acquire and release scripts of " +
    "`src/internal/redis/scripts.ts` as EVALSHA on one ioredis connection, with the keys and arguments RedisLease " +
    "sends (a new owner and waiting place id per cycle, exclusive, ttl 30 s, place 5 s); `RedisLease.layer` sends its " +
    "lock commands on one connection as well. *Effect.scoped(acquireRelease) of RedisLease's scripts*, information " +
    "only: the raw row's two calls as a user would write them in Effect (`Effect.promise` around each, in " +
    "`Effect.scoped(Effect.acquireRelease(...))`, on the library row's fiber loop): what any Effect program pays on them. " +
    "*RedisLease.layer, withLock*, information only: the same layer, each cycle `DistributedLock.withLock(Effect.void, " +
    "name)`: the guarded form, whose body runs in a fiber of its own. " +
    "The peers, information only, are divided by raw `SET key token NX PX` + " +
    "a compare-and-delete `EVAL` on one connection: effect-distributed-lock's `Effect.scoped(semaphore.take(1))` " +
    "(`limit: 1`, its defaults) and redlock's `acquire([key], 30 s)` + `release()` on a single server.",
    "",
    ...result.uncontended.flatMap((level) => [`### ${level.concurrency} concurrent ${level.concurrency === 1 ? "worker" : "workers"}`, "", renderThroughput(level.rows), ""]),
    "**Handoff and longest wait.** Same method as scenario 2 " +
    `(${CONTENDERS} contenders, hold ${HOLD_MS} ms). RedisLease: ${CONTENDERS} layers on one name, waiters in its ` +
    "server-side queue; the release script hands the lease to the waiter at the head and says so on the wake " +
    "channel. Raw: 8 ioredis connections sending the same scripts, each with a subscriber on the channel; a waiter " +
    "holds the lease when the message naming its place says it was handed over, and retries the acquire script " +
    `when it was only woken (or after the script's advised wait, at most ${RAW_POLL_MS} ms).`,
    "",
    renderHandoff(result.handoff)
  ].join("\n")

const findRow = <R extends { readonly id: string }>(rows: ReadonlyArray<R>, id: string) => rows.find((r) => r.id === id)

/** The targets: ≥ 0.8× raw at 1 and 16 workers, handoff p50 ≤ 1.5× raw, longest wait ≤ 2× raw. */
const targets = (result: RedisResult): ReadonlyArray<Target> => {
  const out: Array<Target> = []
  for (const level of result.uncontended) {
    const row = findRow(level.rows, "redis-lease")
    const base = findRow(level.rows, "raw-redis-lease")
    const ratio = ratioOf(row)
    const target = "uncontended ≥ 0.8× raw ioredis sending its scripts"
    const subject = `RedisLease.layer, ${level.concurrency} ${level.concurrency === 1 ? "worker" : "workers"}`
    if (row?.result._tag !== "Measured" || base?.result._tag !== "Measured" || ratio === undefined) {
      out.push({ target, subject, status: "N/A", detail: row?.result._tag === "Skipped" ? row.result.reason : "not measured" })
    } else {
      out.push({
        target,
        subject,
        status: ratio >= 0.8 ? "PASS" : "MISS",
        detail: `${Report.rate(row.result.cyclesPerSecond.median)}/s vs ${Report.rate(base.result.cyclesPerSecond.median)}/s = ${Report.ratio(ratio)}`
      })
    }
  }
  const lease = findRow(result.handoff, "redis-lease-8")
  const raw = findRow(result.handoff, "raw")
  const subject = "RedisLease.layer, 8 layers"
  if (lease?.result._tag !== "Measured" || raw?.result._tag !== "Measured") {
    const detail = lease?.result._tag === "Skipped" ? lease.result.reason : raw?.result._tag === "Skipped" ? `raw: ${raw.result.reason}` : "not measured"
    out.push({ target: "handoff p50 ≤ 1.5× raw", subject, status: "N/A", detail })
    out.push({ target: "longest wait ≤ 2× raw", subject, status: "N/A", detail })
    return out
  }
  const p50 = lease.result.p50Ms.median
  const rawP50 = raw.result.p50Ms.median
  out.push({
    target: "handoff p50 ≤ 1.5× raw",
    subject,
    status: p50 <= 1.5 * rawP50 ? "PASS" : "MISS",
    detail: `p50 ${Report.ms(p50)} ms (rounds ${Report.range(lease.result.p50Ms, Report.ms)}) vs raw ${Report.ms(rawP50)} ms = ${Report.ratio(p50 / rawP50)}`
  })
  const longest = lease.result.longestWaitMs.median
  const rawLongest = raw.result.longestWaitMs.median
  out.push({
    target: "longest wait ≤ 2× raw",
    subject,
    status: longest <= 2 * rawLongest ? "PASS" : "MISS",
    detail: `longest wait ${Report.ms(longest)} ms (worst round ${Report.ms(lease.result.longestWaitMs.max)}) vs raw ${Report.ms(rawLongest)} ms = ` +
      `${Report.ratio(longest / rawLongest)}; acquisitions per contender ${lease.result.acquisitionsMin}–${lease.result.acquisitionsMax}`
  })
  return out
}

export const scenario: Scenario<RedisResult> = {
  name: "redis",
  title: "9. RedisLease: against raw ioredis, and beside effect-distributed-lock and redlock",
  run,
  render,
  targets
}

/**
 * `effect-lock inspect` on Redis, on a real redis-server (a free loopback port, or REDIS_URL):
 * a held lock with a waiter, a shared holder and a semaphore with a holder and a waiter show in
 * the JSON and table reports; an unreachable server, a missing ioredis and a bad prefix are one
 * line each. Without a server the file skips and says why.
 */
import { expect, it } from "@effect/vitest"
import { Context, Effect, Either, Layer, Redacted } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as DistributedSemaphore from "effect-lock/DistributedSemaphore"
import * as Keys from "effect-lock/internal/redis/keys"
import * as Scripts from "effect-lock/internal/redis/scripts"
import * as RedisLease from "effect-lock/RedisLease"
import { Redis } from "ioredis"
import { afterAll, vi } from "vitest"
import { main, parseArgs } from "../src/bin/inspect.js"
import { eventually } from "./support/eventually.js"
import { describeWithRedis, useRedis } from "./support/redis.js"
import { runCli } from "./support/cli.js"

// First, so that its afterAll (stopping the server) runs after every layer and client is closed.
const redis = useRedis()

// A prefix of this run's own: on a shared REDIS_URL server, other runs' keys stay out of the report.
const PREFIX = `cli-test-${process.pid}:`

let client: Redis | undefined
const inspector = (): Redis => (client ??= new Redis(redis.url(), { lazyConnect: true, maxRetriesPerRequest: 1 }))
afterAll(async () => {
  await client?.quit().catch(() => client?.disconnect())
})

const cli = runCli

/** `main` in process, with stderr captured. */
const inProcess = (args: ReadonlyArray<string>, deps?: Parameters<typeof main>[2]) =>
  Effect.gen(function*() {
    const errors: Array<string> = []
    const spy = vi.spyOn(console, "error").mockImplementation((...line: Array<unknown>) => {
      errors.push(line.join(" "))
    })
    const code = yield* main(args, {}, deps).pipe(Effect.ensuring(Effect.sync(() => spy.mockRestore())))
    return { code, stderr: errors.join("\n") }
  })

describeWithRedis("effect-lock inspect on Redis", () => {
  it.scoped("lists holders, waiters, shared holders and semaphores as JSON and as a table", () =>
    Effect.gen(function*() {
      const context = yield* Layer.build(RedisLease.layer({ url: redis.url(), prefix: PREFIX, applicationName: "cli-redis-app" }))
      const locks = Context.get(context, DistributedLock.DistributedLock)
      const semaphore = Context.get(context, DistributedSemaphore.DistributedSemaphore)

      const held = yield* locks.acquire("cli/held")
      yield* Effect.forkScoped(Effect.scoped(locks.acquire("cli/held")))
      const shared = yield* locks.acquire("cli/shared", { mode: "shared" })
      const permits = yield* semaphore.acquire("cli/sem", { limit: 2, permits: 2 })
      yield* Effect.forkScoped(Effect.scoped(semaphore.acquire("cli/sem", { limit: 2, permits: 1 })))

      // The waiters are queued once the listing shows them: then the CLI must show them too.
      yield* eventually(
        "both waiters queued",
        RedisLease.listHolders(inspector(), { prefix: PREFIX }),
        (listing) =>
          listing.locks.some((lock) => lock.name === "cli/held" && lock.waiting.exclusive === 1) &&
          listing.semaphores.some((sem) => sem.name === "cli/sem" && sem.waiting.length === 1),
        10_000
      )

      const [json, text] = yield* Effect.all([
        cli(["inspect", "--url", redis.url(), "--prefix", PREFIX, "--json"]),
        cli(["inspect", `--url=${redis.url()}`, `--prefix=${PREFIX}`])
      ], { concurrency: "unbounded" })

      expect(json.stderr).toBe("")
      expect(json.code).toBe(0)
      const parsed = JSON.parse(json.stdout)
      expect(new Date(parsed.serverTime).getTime()).toBeGreaterThan(Date.now() - 60_000)
      expect(parsed.redis.prefix).toBe(PREFIX)
      expect(parsed.redis.truncated).toBe(false)
      expect(parsed.redis.leases).toEqual([
        {
          name: "cli/held",
          tag: expect.any(String),
          holders: [expect.objectContaining({
            token: held.token.toString(),
            mode: "exclusive",
            application: "cli-redis-app",
            pid: process.pid
          })],
          waiting: { exclusive: 1, shared: 0, since: expect.any(String) }
        },
        {
          name: "cli/shared",
          tag: expect.any(String),
          holders: [expect.objectContaining({ token: shared.token.toString(), mode: "shared", application: "cli-redis-app" })],
          waiting: { exclusive: 0, shared: 0, since: null }
        }
      ])
      expect(parsed.redis.semaphores).toEqual([
        expect.objectContaining({
          name: "cli/sem",
          limit: 2,
          held: 2,
          holders: [expect.objectContaining({ permits: 2, tokens: permits.tokens.map(String), pid: process.pid })],
          waiting: [{ permits: 1, since: expect.any(String) }]
        })
      ])

      expect(text.stderr).toBe("")
      expect(text.code).toBe(0)
      expect(text.stdout).toContain(`(prefix ${JSON.stringify(PREFIX)}): 2 held, 1 waiting`)
      expect(text.stdout).toMatch(
        new RegExp(`cli/held\\s+${held.token}\\s+exclusive\\s+cli-redis-app\\s+\\S+\\s+${process.pid}\\s.*1 exclusive`)
      )
      expect(text.stdout).toMatch(new RegExp(`cli/shared\\s+${shared.token}\\s+shared\\s+cli-redis-app\\s`))
      expect(text.stdout).toContain("Semaphores: 1 in use")
      expect(text.stdout).toMatch(/cli\/sem\s+2\s+2 \(1 holder\)\s+1 \(1 permit\)/)
    }), { timeout: 20_000 })

  it.live("a name only waited for, whose lease hash is gone, shows as its tag", () =>
    Effect.gen(function*() {
      const prefix = `${PREFIX}orphan:`
      const name = "cli/orphan"
      const keys = Keys.lockKeys(prefix, name)
      const attempt = (owner: string) =>
        Effect.promise(() =>
          inspector().eval(Scripts.acquire, 4, ...Keys.keyList(keys), name, owner, `${owner}-place`, "exclusive", 30_000, 30_000, "raw", "h", 1, "1")
        )
      // A holder and a waiter that then die (scripts sent by hand): the waiter's place stays.
      yield* attempt("a")
      yield* attempt("b")
      // As if the lease hash had run out before the place: the readable name is gone with it.
      yield* Effect.promise(() => inspector().del(keys.lease))
      const listing = yield* RedisLease.listHolders(inspector(), { prefix })
      expect(listing.locks).toEqual([{
        name: `{${Keys.tagOf(name)}}`,
        tag: Keys.tagOf(name),
        named: false,
        holders: [],
        waiting: { exclusive: 1, shared: 0, since: expect.any(Number) }
      }])
      yield* Effect.promise(() => inspector().del(keys.queue, keys.places))
    }))

  it.live("an unreachable server is one line on stderr and exit 1", () =>
    Effect.gen(function*() {
      // Port 1 on loopback: nothing listens there, the connection is refused at once.
      const run = yield* cli(["inspect", "--url", "redis://:s3cret@127.0.0.1:1"])
      expect(run.code).toBe(1)
      expect(run.stdout).toBe("")
      expect(run.stderr.trimEnd().split("\n")).toHaveLength(1)
      expect(run.stderr).toContain("cannot connect to redis://:***@127.0.0.1:1")
      expect(run.stderr).toContain("ECONNREFUSED")
      expect(run.stderr).not.toContain("s3cret")
    }))
})

it.effect("without ioredis, a Redis URL says what to install and exits 1", () =>
  Effect.gen(function*() {
    const run = yield* inProcess(["inspect", "--url", "redis://127.0.0.1:1"], {
      importIoredis: () => Promise.reject(new Error("Cannot find package 'ioredis'"))
    })
    expect(run.code).toBe(1)
    expect(run.stderr.split("\n")).toHaveLength(1)
    expect(run.stderr).toContain("npm install ioredis")
  }))

it.effect("without @effect/sql-pg, a postgres URL says what to install and exits 1", () =>
  Effect.gen(function*() {
    const run = yield* inProcess(["inspect", "--url", "postgres://127.0.0.1:1/d"], {
      importPg: () => Promise.reject(new Error("Cannot find package '@effect/sql-pg'"))
    })
    expect(run.code).toBe(1)
    expect(run.stderr.split("\n")).toHaveLength(1)
    expect(run.stderr).toContain("npm install @effect/sql@0.52 @effect/sql-pg@0.53")
  }))

it.effect("Redis usage errors exit 2", () =>
  Effect.gen(function*() {
    const cases: ReadonlyArray<[ReadonlyArray<string>, string]> = [
      [["inspect", "--url", "redis://h:6379", "--prefix", "a{b}:"], "--prefix: prefix \"a{b}:\" must not contain"],
      [["inspect", "--url", "redis://h:6379", "--lease-table", "t"], "--lease-table applies to PostgreSQL URLs only"],
      [["inspect", "--url", "postgres://h/d", "--prefix", "p:"], "--prefix applies to Redis URLs only"]
    ]
    for (const [args, message] of cases) {
      const run = yield* inProcess(args)
      expect(run.code, args.join(" ")).toBe(2)
      expect(run.stderr).toContain(message)
    }
  }))

it("takes the Redis URL from EFFECT_LOCK_REDIS_URL, then REDIS_URL, only without DATABASE_URL", () => {
  const pick = (env: Record<string, string>) => {
    const parsed = parseArgs(["inspect"], env)
    if (Either.isLeft(parsed) || parsed.right._tag === "Help") throw new Error("expected an inspect command")
    return `${parsed.right._tag} ${Redacted.value(parsed.right.url)}`
  }
  const [pg, mine, plain] = ["postgres://h/d", "redis://mine:1", "rediss://plain:2"]
  expect(pick({ DATABASE_URL: pg, EFFECT_LOCK_REDIS_URL: mine, REDIS_URL: plain })).toBe(`Inspect ${pg}`)
  expect(pick({ EFFECT_LOCK_REDIS_URL: mine, REDIS_URL: plain })).toBe(`InspectRedis ${mine}`)
  expect(pick({ REDIS_URL: plain })).toBe(`InspectRedis ${plain}`)
})

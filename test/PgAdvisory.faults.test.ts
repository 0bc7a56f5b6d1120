/**
 * PgAdvisory under faults a real deployment brings: event-loop stalls, a frozen server process,
 * a killed or frozen wait session, a database restart. Real server, real stalls, real signals.
 */
import { SqlClient } from "@effect/sql"
import { describe, expect, it } from "@effect/vitest"
import { Cause, Context, Deferred, Effect, Either, Exit, Fiber, Layer, Metric, Option, Scope } from "effect"
import * as DistributedLock from "../src/DistributedLock.js"
import * as LockMetrics from "../src/LockMetrics.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import { spawn } from "node:child_process"
import * as Readline from "node:readline"
import { startEmbedded } from "../tools/embeddedPostgres.js"
import { frozen } from "./support/freeze.js"
import { PgTest, useTestDatabase, withClient } from "./support/pg.js"
import { eventually as pollUntil } from "./support/eventually.js"
import { blockThread } from "../tools/blockThread.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("pg_advisory_faults")

const service = (url: string, applicationName: string, options?: Omit<PgAdvisory.Options, "url" | "applicationName">) =>
  Layer.build(PgAdvisory.layer({ url, applicationName, ...options })).pipe(
    Effect.map(Context.get(DistributedLock.DistributedLock))
  )

interface Backend {
  readonly pid: number
  readonly granted: boolean | null
  readonly waitEvent: string | null
  readonly queryStart: number
}

/** The server backends of one application, with their advisory-lock state. */
const backendsOf = (applicationName: string, url = db.url): Effect.Effect<ReadonlyArray<Backend>> =>
  Effect.promise(() =>
    withClient(url, async (client) =>
      (await client.query<Backend>(
        `select a.pid, bool_and(l.granted) as "granted", a.wait_event_type || ':' || a.wait_event as "waitEvent",
                (extract(epoch from a.query_start) * 1000)::float8 as "queryStart"
         from pg_stat_activity a
         left join pg_locks l on l.pid = a.pid and l.locktype = 'advisory'
         where a.datname = current_database() and a.application_name = $1
         group by a.pid, a.wait_event_type, a.wait_event, a.query_start`,
        [applicationName]
      )).rows
    )
  )

/** Advisory locks granted to an application's sessions. */
const grantedCount = (applicationName: string, url = db.url): Effect.Effect<number> =>
  Effect.promise(() =>
    withClient(url, async (client) =>
      (await client.query<{ n: number }>(
        `select count(*)::int as n from pg_locks l join pg_stat_activity a on a.pid = l.pid
         where l.locktype = 'advisory' and l.granted and a.application_name = $1`,
        [applicationName]
      )).rows[0]?.n ?? 0
    )
  )

const eventually = <A>(read: Effect.Effect<A>, check: (a: A) => boolean, ms: number, what: string): Effect.Effect<A> =>
  pollUntil(what, read, check, ms)

/** Blocks the event loop, as a GC pause or a throttled container does (the thread parked, no CPU spent). */
const busyLoop = blockThread

/**
 * Stalls run back to back, one event-loop turn apart, each in the check phase (`setImmediate`),
 * as a long computation after I/O would: the next turn starts with the timers that came due
 * during the stall, before the poll phase reads the sockets. (A stall inside a timer callback
 * does not show the hazard: Node compares the other timers of that phase with the time read
 * before the stall.)
 */
const stalls = (durations: ReadonlyArray<number>): Effect.Effect<void> =>
  Effect.async<void>((resume) => {
    const next = (i: number) => {
      if (i >= durations.length) return resume(Effect.void)
      setImmediate(() => {
        busyLoop(durations[i]!)
        next(i + 1)
      })
    }
    next(0)
  })

const destroyedSessions = Effect.map(
  Metric.value(Metric.tagged(LockMetrics.destroyedSessions, "backend", "pg-advisory")),
  (state) => state.count
)

/** Holds `name` in a guarded body until the body is interrupted; the result says how it ended. */
const holdUntilLost = (lock: DistributedLock.Service, name: string) =>
  Effect.gen(function*() {
    const holding = yield* Deferred.make<{ readonly token: bigint }>()
    const running = yield* Effect.fork(
      DistributedLock.withLock(
        Effect.flatMap(DistributedLock.inspect, ([held]) => Effect.zipRight(Deferred.succeed(holding, held!), Effect.never)),
        name
      ).pipe(Effect.provideService(DistributedLock.DistributedLock, lock), Effect.either)
    )
    return { lease: yield* Deferred.await(holding), running }
  })

/**
 * A TCP proxy in its own OS process (so this process's stalls do not stall it) that delays every
 * answer from the server by `delayMillis`: heartbeats are then in flight most of the time, and a
 * stall almost always begins while one waits for its answer, which arrives during the stall.
 */
const latencyProxy = (target: string, delayMillis: number): Effect.Effect<string, never, Scope.Scope> =>
  Effect.acquireRelease(
    Effect.promise(() => {
      const upstream = new URL(target)
      const script = `
        const net = require("node:net")
        const server = net.createServer((client) => {
          const upstream = net.connect(${Number(upstream.port)}, ${JSON.stringify(upstream.hostname)})
          const end = () => { client.destroy(); upstream.destroy() }
          client.on("data", (chunk) => upstream.write(chunk))
          upstream.on("data", (chunk) => setTimeout(() => client.write(chunk), ${delayMillis}))
          client.on("close", end).on("error", end)
          upstream.on("close", () => setTimeout(end, ${delayMillis})).on("error", end)
        })
        server.listen(0, "127.0.0.1", () => console.log(server.address().port))
        process.stdin.on("end", () => process.exit(0)).resume()
      `
      const child = spawn(process.execPath, ["--input-type=commonjs", "-e", script], { stdio: ["pipe", "pipe", "inherit"] })
      return new Promise<{ readonly url: string; readonly child: typeof child }>((resolve) => {
        Readline.createInterface({ input: child.stdout }).once("line", (port) => {
          const url = new URL(target)
          url.port = port.trim()
          resolve({ url: url.toString(), child })
        })
      })
    }),
    ({ child }) => Effect.sync(() => child.kill("SIGKILL"))
  ).pipe(Effect.map(({ url }) => url))

describe("PgAdvisory under event-loop stalls", () => {
  it.scopedLive("three 1.5 s stalls back to back, then a 2.5 s stall, lose none of 20 locks of a live process", () =>
    Effect.gen(function*() {
      const app = "adv-stall"
      const url = yield* latencyProxy(db.url, 200)
      // Heartbeats every 50 ms with the default 1 s timeout; each answer takes 200 ms to come back.
      const lock = yield* service(url, app, { heartbeatInterval: "50 millis" })
      const leases = yield* Effect.forEach(
        Array.from({ length: 20 }, (_, i) => `stall-${i}`),
        (name) => lock.acquire(name),
        { concurrency: 20 }
      )
      const destroyedBefore = yield* destroyedSessions
      // A heartbeat is in flight as each stall begins: its answer arrives during the stall and
      // sits in the socket buffer while its 1 s timeout timer comes due.
      yield* stalls([1_500, 1_500, 1_500])
      yield* stalls([2_500])
      const stalledUntil = Date.now()
      // Observable: a heartbeat sent after the stalls was answered on every session of the
      // process, so every bound armed during the stalls has been decided by now.
      yield* eventually(
        backendsOf(app),
        (rows) => rows.length > 0 && rows.every((row) => row.queryStart > stalledUntil + 300),
        5_000,
        "a heartbeat after the stalls"
      )
      const held = yield* Effect.forEach(leases, (lease) => lease.isHeld)
      expect(held.filter((h) => !h)).toHaveLength(0)
      expect(yield* destroyedSessions).toBe(destroyedBefore)
      expect(yield* grantedCount(app)).toBe(20)
    }), 60_000)
})

describe("PgAdvisory with a frozen or restarted server", () => {
  it.scopedLive("a frozen holder backend (SIGSTOP) fails the holder with LockLost within 4 s; after SIGCONT nothing is held", () =>
    Effect.gen(function*() {
      const app = "adv-frozen-holder"
      const lock = yield* service(db.url, app)
      const { lease, running } = yield* holdUntilLost(lock, "frozen-holder")
      const pids = (yield* backendsOf(app)).map((row) => row.pid)
      expect(pids.length).toBeGreaterThan(0)
      const freezeScope = yield* Scope.make()
      const frozenAt = Date.now()
      yield* frozen(pids).pipe(Scope.extend(freezeScope))
      const result = yield* Fiber.join(running)
      const noticedIn = Date.now() - frozenAt
      // The promised bound: heartbeat interval (500 ms) + heartbeat timeout (1 s) + two loop turns;
      // 4 s is the limit on a loaded machine.
      expect(noticedIn).toBeLessThan(4_000)
      expect(Either.getLeft(result).pipe(Option.getOrUndefined)).toMatchObject({
        _tag: "LockLost",
        name: "frozen-holder",
        token: lease.token,
        reason: "connection-lost"
      })
      yield* Scope.close(freezeScope, Exit.void)
      // The thawed backend finds its client gone and exits, dropping the lock.
      yield* eventually(grantedCount(app), (n) => n === 0, 5_000, "the frozen holder's lock dropped after SIGCONT")
      // The same layer serves new acquisitions.
      const again = yield* Effect.scoped(Effect.map(lock.acquire("frozen-holder", { timeout: "5 seconds" }), (l) => l.token))
      expect(again).toBeGreaterThan(lease.token)
    }))

  it.scopedLive("a waiter whose wait session is killed queues again at once and gets the lock on release", () =>
    Effect.gen(function*() {
      const a = yield* service(db.url, "adv-kill-wait-a")
      const b = yield* service(db.url, "adv-kill-wait-b")
      const held = yield* Scope.make()
      const first = yield* a.acquire("kill-wait").pipe(Scope.extend(held))
      const waiter = yield* Effect.fork(Effect.scoped(Effect.map(b.acquire("kill-wait"), (l) => l.token)))
      const [waiting] = yield* eventually(
        backendsOf("adv-kill-wait-b"),
        (rows) => rows.some((row) => row.granted === false),
        3_000,
        "b waiting at the server"
      ).pipe(Effect.map((rows) => rows.filter((row) => row.granted === false)))
      const killedAt = Date.now()
      yield* Effect.promise(() =>
        withClient(db.url, (client) => client.query("select pg_terminate_backend($1)", [waiting!.pid]))
      )
      yield* eventually(
        backendsOf("adv-kill-wait-b"),
        (rows) => rows.some((row) => row.granted === false && row.pid !== waiting!.pid),
        3_000,
        "b waiting again on another session"
      )
      expect(Date.now() - killedAt).toBeLessThan(3_000)
      yield* Scope.close(held, Exit.void)
      const token = yield* Fiber.join(waiter).pipe(Effect.timeoutFail({ duration: "5 seconds", onTimeout: () => "no grant" }))
      expect(token).toBeGreaterThan(first.token)
    }))

  it.scopedLive("a waiter whose wait session's backend is frozen notices within one wait slice and queues again", () =>
    Effect.gen(function*() {
      const a = yield* service(db.url, "adv-freeze-wait-a")
      const b = yield* service(db.url, "adv-freeze-wait-b")
      const held = yield* Scope.make()
      const first = yield* a.acquire("freeze-wait").pipe(Scope.extend(held))
      const waiter = yield* Effect.fork(Effect.scoped(Effect.map(b.acquire("freeze-wait"), (l) => l.token)))
      const [waiting] = yield* eventually(
        backendsOf("adv-freeze-wait-b"),
        (rows) => rows.some((row) => row.granted === false),
        3_000,
        "b waiting at the server"
      ).pipe(Effect.map((rows) => rows.filter((row) => row.granted === false)))
      const destroyedBefore = yield* destroyedSessions
      const freezeScope = yield* Scope.make()
      const frozenAt = Date.now()
      yield* frozen([waiting!.pid]).pipe(Scope.extend(freezeScope))
      yield* eventually(
        backendsOf("adv-freeze-wait-b"),
        (rows) => rows.some((row) => row.granted === false && row.pid !== waiting!.pid),
        6_000,
        "b waiting again on another session"
      )
      // The promised bound: one wait slice (2 s) + the heartbeat timeout (1 s) + two loop turns.
      expect(Date.now() - frozenAt).toBeLessThan(5_000)
      expect(yield* destroyedSessions).toBe(destroyedBefore + 1)
      // Thawed, the old backend finds its client gone and leaves the server's queue.
      yield* Scope.close(freezeScope, Exit.void)
      yield* Scope.close(held, Exit.void)
      const token = yield* Fiber.join(waiter).pipe(Effect.timeoutFail({ duration: "5 seconds", onTimeout: () => "no grant" }))
      expect(token).toBeGreaterThan(first.token)
    }))

  it.scopedLive("a database restart fails advisory holders with LockLost, and the same layer serves new acquisitions", () =>
    Effect.gen(function*() {
      const server = yield* Effect.acquireRelease(Effect.promise(() => startEmbedded()), (s) => Effect.promise(() => s.stop()))
      const restart = server.restart
      if (restart === undefined) return yield* Effect.dieMessage("the embedded server cannot restart")
      const lock = yield* service(server.url, "adv-restart")
      const { lease, running } = yield* holdUntilLost(lock, "restart")
      yield* Effect.promise(() => restart({ downMillis: 1_000 }))
      const result = yield* Fiber.join(running)
      expect(Either.getLeft(result).pipe(Option.getOrUndefined)).toMatchObject({
        _tag: "LockLost",
        token: lease.token,
        reason: "connection-lost"
      })
      const again = yield* Effect.scoped(Effect.map(lock.acquire("restart", { timeout: "10 seconds" }), (l) => l.token))
      expect(again).toBeGreaterThan(lease.token)
      const other = yield* Effect.scoped(Effect.map(lock.tryAcquire("after-restart"), Option.isSome))
      expect(other).toBe(true)
    }), 60_000)
})

/**
 * The test database's SqlClient as another SqlClient would be: the same client, but not
 * recognisable as @effect/sql-pg's, so withXactLock cannot reach its connections.
 */
const foreignSqlClient = Layer.effect(
  SqlClient.SqlClient,
  Effect.map(SqlClient.SqlClient, (sql) =>
    new Proxy(sql, {
      get: (target, key) => key === "~@effect/sql-pg/PgClient" ? undefined : Reflect.get(target, key, target)
    }))
).pipe(Layer.provide(PgTest.layer(db)))

describe("PgAdvisory.withXactLock with a frozen connection", () => {
  for (
    const [client, layer] of [
      ["@effect/sql-pg's client (the connection is destroyed)", PgTest.layer(db)],
      ["another SqlClient (the transaction runs in a daemon fiber)", foreignSqlClient]
    ] as const
  ) {
    it.scopedLive(`on ${client}: a connection frozen at COMMIT ends in LockBackendError within the statement timeout`, () =>
      Effect.gen(function*() {
        const freezeScope = yield* Scope.make()
        const bodyEnded = { at: 0 }
        const exit = yield* Effect.exit(
          PgAdvisory.withXactLock(
            Effect.gen(function*() {
              const sql = yield* SqlClient.SqlClient
              const [row] = yield* sql<{ pid: number }>`select pg_backend_pid() as pid`
              // The transaction's own backend stops: the COMMIT that follows gets no answer.
              yield* frozen([row!.pid]).pipe(Scope.extend(freezeScope))
              bodyEnded.at = Date.now()
            }),
            "xact-frozen-commit",
            { statementTimeout: "1 second" }
          )
        )
        const waited = Date.now() - bodyEnded.at
        yield* Scope.close(freezeScope, Exit.void)
        expect(Exit.isFailure(exit)).toBe(true)
        const error = Exit.isFailure(exit) ? Option.getOrUndefined(Cause.failureOption(exit.cause)) : undefined
        expect(error).toMatchObject({ _tag: "LockBackendError", operation: "transaction" })
        expect(String((error as { cause?: unknown } | undefined)?.cause)).toContain("COMMIT or ROLLBACK got no answer within 1000 ms")
        // The promised bound: the statement timeout (1 s) plus two event-loop turns.
        expect(waited).toBeLessThan(2_500)
        // The pool is still usable: the frozen connection was dropped (or is left to the daemon).
        const sql = yield* SqlClient.SqlClient
        expect(yield* sql<{ one: number }>`select 1 as one`).toEqual([{ one: 1 }])
      }).pipe(Effect.provide(layer)))
  }

  it.scopedLive("a connection frozen in a contended wait ends in LockBackendError within a slice plus the statement timeout", () =>
    Effect.gen(function*() {
      const name = "xact-frozen-wait"
      const holding = yield* Deferred.make<void>()
      const release = yield* Deferred.make<void>()
      const holder = yield* Effect.fork(
        PgAdvisory.withXactLock(Effect.zipRight(Deferred.succeed(holding, undefined), Deferred.await(release)), name)
      )
      yield* Deferred.await(holding)
      const waiter = yield* Effect.fork(
        Effect.exit(PgAdvisory.withXactLock(Effect.void, name, { statementTimeout: "1 second" }))
      )
      const key = PgAdvisory.keyOf(name)
      const unsigned = BigInt.asUintN(64, key)
      const pid = yield* eventually(
        Effect.promise(() =>
          withClient(db.url, async (client) =>
            (await client.query<{ pid: number }>(
              "select pid from pg_locks where locktype = 'advisory' and not granted and classid = $1 and objid = $2",
              [String(unsigned >> 32n), String(unsigned & 0xffffffffn)]
            )).rows[0]?.pid
          )
        ),
        (found) => found !== undefined,
        3_000,
        "the waiter queued at the server"
      )
      const freezeScope = yield* Scope.make()
      const frozenAt = Date.now()
      yield* frozen([pid!]).pipe(Scope.extend(freezeScope))
      const exit = yield* Fiber.join(waiter)
      const waited = Date.now() - frozenAt
      yield* Scope.close(freezeScope, Exit.void)
      yield* Deferred.succeed(release, undefined)
      yield* Fiber.join(holder)
      const error = Exit.isFailure(exit) ? Option.getOrUndefined(Cause.failureOption(exit.cause)) : undefined
      expect(error).toMatchObject({ _tag: "LockBackendError" })
      // The promised bound: a slice's statement_timeout (2 s) plus the statement timeout (1 s)
      // for the slice, then the statement timeout again for the ROLLBACK, plus loop turns.
      expect(waited).toBeLessThan(5_500)
    }).pipe(Effect.provide(PgTest.layer(db))))
})

import { SqlClient } from "@effect/sql"
import { afterAll, describe, expect, it, layer } from "@effect/vitest"
import { Cause, Config, ConfigProvider, Context, Deferred, Duration, Effect, Either, Exit, Fiber, Layer, Logger, Option, Scope } from "effect"
import * as DistributedLock from "../src/DistributedLock.js"
import type { FencingToken } from "../src/FencingToken.js"
import { LockBackendError, LockLost, LockTimeout, UnsafeConnectionPooling } from "../src/LockError.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import * as Net from "node:net"
import pg from "pg"
import {
  advisoryLocks,
  type AdvisoryLockRow,
  countSessions,
  HARNESS_APPLICATION_NAME,
  PgTest,
  terminateBackends,
  useTestDatabase,
  withClient
} from "./support/pg.js"
import { describeWithPgBouncer, startPgBouncer } from "./support/pgbouncer.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("pg_advisory")

/** A PgAdvisory service whose layer lives as long as the surrounding scope. */
const service = (applicationName: string, options?: Omit<PgAdvisory.Options, "url" | "applicationName">) =>
  Layer.build(PgAdvisory.layer({ url: db.url, applicationName, ...options })).pipe(
    Effect.map(Context.get(DistributedLock.DistributedLock))
  )

// One inspection session for the whole file: polling pg_locks must not open a connection per poll.
let inspector: pg.Client | undefined
afterAll(async () => {
  await inspector?.end().catch(() => {})
})

/** Advisory locks (granted or awaited) of the sessions with this application_name. */
const locksOf = (applicationName: string): Effect.Effect<ReadonlyArray<AdvisoryLockRow>> =>
  Effect.promise(async () => {
    if (inspector === undefined) {
      const client = new pg.Client({ connectionString: db.url, application_name: HARNESS_APPLICATION_NAME })
      client.on("error", () => {})
      await client.connect()
      inspector = client
    }
    const result = await inspector.query<AdvisoryLockRow>(
      `select l.pid, a.application_name, l.classid, l.objid, l.objsubid, l.granted, l.mode, a.state, a.query
       from pg_locks l join pg_stat_activity a on a.pid = l.pid
       where l.locktype = 'advisory' and l.database = (select oid from pg_database where datname = current_database())
         and a.application_name = $1`,
      [applicationName]
    )
    return result.rows
  })

const sessionsOf = (applicationName: string) => Effect.promise(() => countSessions(db.url, applicationName))

/** Polls until `check` holds (or fails the test after `ms`). */
const eventually = <A>(read: Effect.Effect<A>, check: (a: A) => boolean, ms = 3_000): Effect.Effect<A> =>
  Effect.gen(function*() {
    const deadline = Date.now() + ms
    for (;;) {
      const value = yield* read
      if (check(value)) return value
      if (Date.now() > deadline) {
        return yield* Effect.dieMessage(`condition not met within ${ms} ms: ${JSON.stringify(value)}`)
      }
      yield* Effect.sleep(Duration.millis(10))
    }
  })

/** Waits until `applicationName` has a lock request queued (not granted) at the server. */
const blockedAtServer = (applicationName: string) =>
  eventually(locksOf(applicationName), (rows) => rows.some((row) => !row.granted))

/**
 * A TCP proxy in front of the test server whose `freeze` silently stops forwarding on the
 * connections open at that moment, like a network partition (no FIN, no RST).
 */
const startProxy = (target: string) =>
  new Promise<{ readonly url: string; readonly freeze: () => void; readonly close: () => Promise<void> }>((resolve) => {
    const upstream = new URL(target)
    const pairs: Array<{ frozen: boolean; readonly sockets: readonly [Net.Socket, Net.Socket] }> = []
    const server = Net.createServer((client) => {
      const server = Net.connect({ host: upstream.hostname, port: Number(upstream.port) })
      const pair = { frozen: false, sockets: [client, server] as const }
      pairs.push(pair)
      client.on("data", (chunk) => pair.frozen || server.write(chunk))
      server.on("data", (chunk) => pair.frozen || client.write(chunk))
      const end = () => {
        if (pair.frozen) return
        client.destroy()
        server.destroy()
      }
      client.on("close", end).on("error", end)
      server.on("close", end).on("error", end)
    })
    server.listen(0, "127.0.0.1", () => {
      const address = server.address() as Net.AddressInfo
      const url = new URL(target)
      url.port = String(address.port)
      resolve({
        url: url.toString(),
        freeze: () => pairs.forEach((pair) => (pair.frozen = true)),
        close: () =>
          new Promise<void>((done) => {
            for (const pair of pairs) pair.sockets.forEach((socket) => socket.destroy())
            server.close(() => done())
          })
      })
    })
  })

const withService = (svc: DistributedLock.Service) =>
  Effect.provideService(DistributedLock.DistributedLock, svc)

const keyParts = (key: bigint) => {
  const unsigned = BigInt.asUintN(64, key)
  return { classid: Number(unsigned >> 32n), objid: Number(unsigned & 0xffffffffn) }
}

const percentile = (values: ReadonlyArray<number>, p: number) => {
  const sorted = [...values].sort((a, b) => a - b)
  return sorted[Math.min(sorted.length - 1, Math.floor((sorted.length - 1) * p))]!
}

describe("PgAdvisory.layer", () => {
  it.scopedLive("grants session advisory locks on the name's key, visible to operators by application name", () =>
    Effect.gen(function*() {
      const lock = yield* service("adv-basic")
      const lease = yield* lock.acquire("nightly-cleanup")
      expect(lease.mode).toBe("exclusive")
      expect(lease.token).toBeGreaterThan(0n)
      const rows = yield* locksOf("adv-basic")
      expect(rows).toEqual([
        expect.objectContaining({ ...keyParts(PgAdvisory.keyOf("nightly-cleanup")), objsubid: 1, granted: true, mode: "ExclusiveLock" })
      ])
      const shared = yield* lock.acquire("report", { mode: "shared" })
      expect(shared.mode).toBe("shared")
      expect(yield* locksOf("adv-basic")).toContainEqual(
        expect.objectContaining({ ...keyParts(PgAdvisory.keyOf("report")), granted: true, mode: "ShareLock" })
      )
      expect(PgAdvisory.keyOf("report", "billing")).not.toBe(PgAdvisory.keyOf("report"))
    }))

  it.scopedLive("layerConfig reads its options from configuration", () =>
    Effect.gen(function*() {
      const lock = yield* Layer.build(
        PgAdvisory.layerConfig({
          url: Config.redacted("LOCK_DATABASE_URL"),
          applicationName: Config.string("LOCK_APPLICATION_NAME"),
          maxSessions: Config.integer("LOCK_MAX_SESSIONS")
        })
      ).pipe(
        Effect.map(Context.get(DistributedLock.DistributedLock)),
        Effect.withConfigProvider(
          ConfigProvider.fromMap(
            new Map([["LOCK_DATABASE_URL", db.url], ["LOCK_APPLICATION_NAME", "adv-config"], ["LOCK_MAX_SESSIONS", "2"]])
          )
        )
      )
      yield* lock.acquire("configured")
      expect((yield* locksOf("adv-config")).length).toBe(1)
    }))

  it.live("an unreachable server fails the layer with LockBackendError", () =>
    Effect.gen(function*() {
      const unreachable = new URL(db.url)
      unreachable.port = "1"
      const error = yield* Effect.flip(
        Effect.scoped(Layer.build(PgAdvisory.layer({ url: unreachable.toString(), connectTimeout: "2 seconds" })))
      )
      expect(error).toBeInstanceOf(LockBackendError)
      expect(error).toMatchObject({ operation: "connect" })
    }))

  it.scopedLive("a lock name longer than 1024 UTF-8 bytes is refused", () =>
    Effect.gen(function*() {
      const lock = yield* service("adv-names")
      const error = yield* Effect.flip(lock.acquire("x".repeat(1025)))
      expect(error._tag).toBe("InvalidLockName")
      const lease = yield* lock.acquire("é".repeat(512))
      expect(lease.token).toBeGreaterThan(0n)
    }))

  it.scopedLive("locks are not re-entrant: the same name twice in one process waits; shared holders coexist", () =>
    Effect.gen(function*() {
      const lock = yield* service("adv-local")
      const scope = yield* Scope.make()
      yield* lock.acquire("job").pipe(Scope.extend(scope))

      expect(Option.isNone(yield* Effect.scoped(lock.tryAcquire("job")))).toBe(true)
      const timedOut = yield* Effect.flip(Effect.scoped(lock.acquire("job", { timeout: "150 millis" })))
      expect(timedOut).toBeInstanceOf(LockTimeout)
      // Exclusive excludes shared, locally too.
      expect(Option.isNone(yield* Effect.scoped(lock.tryAcquire("job", { mode: "shared" })))).toBe(true)

      // A second local request is woken as soon as the first holder releases.
      const waiter = yield* Effect.fork(Effect.scoped(Effect.zipRight(lock.acquire("job"), Effect.sync(() => Date.now()))))
      yield* Effect.sleep(Duration.millis(50))
      const releasedAt = Date.now()
      yield* Scope.close(scope, Exit.void)
      const grantedAt = yield* Fiber.join(waiter)
      // Woken by the local release, not by the 1 s fallback retry (generous: CI machines are busy).
      expect(grantedAt - releasedAt).toBeLessThan(800)

      // Shared holders coexist (in this process and across layers); exclusive waits for them.
      const other = yield* service("adv-local-2")
      const s1 = yield* lock.acquire("catalog", { mode: "shared" })
      const s2 = yield* lock.acquire("catalog", { mode: "shared" })
      const s3 = yield* other.acquire("catalog", { mode: "shared" })
      expect(new Set([s1.token, s2.token, s3.token]).size).toBe(3)
      expect(Option.isNone(yield* Effect.scoped(lock.tryAcquire("catalog")))).toBe(true)
      expect(Option.isNone(yield* Effect.scoped(other.tryAcquire("catalog")))).toBe(true)
    }))

  it.scopedLive("a waiter in another process gets the lock within a few ms of the release", () =>
    Effect.gen(function*() {
      const a = yield* service("adv-handoff-a")
      const b = yield* service("adv-handoff-b")
      const handoffs: Array<number> = []
      for (let round = 0; round < 20; round++) {
        const [holder, waiterApp, waiter] = round % 2 === 0 ? [a, "adv-handoff-b", b] : [b, "adv-handoff-a", a]
        const held = yield* Scope.make()
        yield* holder.acquire("handoff").pipe(Scope.extend(held))
        const waiting = yield* Effect.fork(Effect.scoped(Effect.zipRight(waiter.acquire("handoff"), Effect.sync(() => performance.now()))))
        yield* blockedAtServer(waiterApp)
        const releasedAt = performance.now()
        yield* Scope.close(held, Exit.void)
        handoffs.push((yield* Fiber.join(waiting)) - releasedAt)
      }
      console.log(
        `[PgAdvisory] cross-session handoff over ${handoffs.length} rounds: p50 ${percentile(handoffs, 0.5).toFixed(2)} ms, ` +
          `max ${Math.max(...handoffs).toFixed(2)} ms (release start → waiter holds the lock, fencing bump included)`
      )
      // Generous bounds for a loaded CI machine (one durable commit per grant); the benchmark
      // measures the real figure. A poll-driven wake-up would sit near its interval instead.
      expect(percentile(handoffs, 0.5)).toBeLessThan(100)
      expect(percentile(handoffs, 0.9)).toBeLessThan(500)
    }))

  it.scopedLive("with every wait session in use, a waiter is woken by the release notification, not a poll", () =>
    Effect.gen(function*() {
      const a = yield* service("adv-notify-a")
      // One session: it holds locks, so it never blocks in a wait; contended waits use notifications.
      const b = yield* service("adv-notify-b", { maxSessions: 1 })
      yield* b.acquire("already-held-by-b")
      const waits: Array<number> = []
      for (let round = 0; round < 5; round++) {
        const held = yield* Scope.make()
        yield* a.acquire("notified").pipe(Scope.extend(held))
        const waiting = yield* Effect.fork(Effect.scoped(Effect.zipRight(b.acquire("notified"), Effect.sync(() => performance.now()))))
        yield* Effect.sleep(Duration.millis(50))
        const releasedAt = performance.now()
        yield* Scope.close(held, Exit.void)
        waits.push((yield* Fiber.join(waiting)) - releasedAt)
      }
      // The fallback re-try runs every second: a notified waiter is well inside that.
      expect(percentile(waits, 0.5)).toBeLessThan(250)
      expect(yield* sessionsOf("adv-notify-b")).toBe(1)
    }))

  it.scopedLive("timeout bounds the wait: LockTimeout, and nothing is left queued at the server", () =>
    Effect.gen(function*() {
      const a = yield* service("adv-timeout-a")
      const b = yield* service("adv-timeout-b")
      yield* a.acquire("busy")
      const started = Date.now()
      const error = yield* Effect.flip(Effect.scoped(b.acquire("busy", { timeout: "300 millis" })))
      const waited = Date.now() - started
      expect(error).toBeInstanceOf(LockTimeout)
      expect(waited).toBeGreaterThanOrEqual(290)
      expect(waited).toBeLessThan(2_000)
      expect(yield* locksOf("adv-timeout-b")).toEqual([])
      // timeout <= 0 is a single attempt.
      const once = yield* Effect.flip(Effect.scoped(b.acquire("busy", { timeout: 0 })))
      expect(once).toBeInstanceOf(LockTimeout)
      expect(Option.isNone(yield* Effect.scoped(b.tryAcquire("busy")))).toBe(true)
    }))

  it.scopedLive("an interrupted wait is cancelled at the server promptly and leaves nothing behind", () =>
    Effect.gen(function*() {
      const a = yield* service("adv-cancel-a")
      const b = yield* service("adv-cancel-b")
      yield* a.acquire("contended")
      const latencies: Array<number> = []
      for (let round = 0; round < 10; round++) {
        const waiter = yield* Effect.fork(Effect.scoped(b.acquire("contended")))
        yield* blockedAtServer("adv-cancel-b")
        const started = performance.now()
        yield* Fiber.interrupt(waiter)
        latencies.push(performance.now() - started)
        // Cancelled and proven clean before the interrupt returned: no grant, no queued request.
        expect(yield* locksOf("adv-cancel-b")).toEqual([])
      }
      console.log(
        `[PgAdvisory] interrupting a blocked wait: p50 ${percentile(latencies, 0.5).toFixed(2)} ms, ` +
          `max ${Math.max(...latencies).toFixed(2)} ms (CancelRequest + outcome + unlock_all)`
      )
      expect(percentile(latencies, 0.5)).toBeLessThan(100)
      // Bounded even at worst: a wait whose outcome does not arrive in time destroys its session.
      expect(Math.max(...latencies)).toBeLessThan(3_000)
      expect(yield* sessionsOf("adv-cancel-b")).toBeLessThanOrEqual(4)
    }))

  it.scopedLive("1,000 locks held at once by one layer use at most maxSessions sessions", () =>
    Effect.gen(function*() {
      const lock = yield* service("adv-many", { maxSessions: 4 })
      const leases = yield* Effect.forEach(
        Array.from({ length: 1_000 }, (_, i) => `many-${i}`),
        (name) => lock.acquire(name),
        { concurrency: 64 }
      )
      expect(leases.length).toBe(1_000)
      expect((yield* locksOf("adv-many")).filter((row) => row.granted).length).toBe(1_000)
      expect(yield* sessionsOf("adv-many")).toBeLessThanOrEqual(4)
      expect((yield* lock.inspect).length).toBe(1_000)
    }))

  it.scopedLive("fencing tokens strictly increase across layers and across a layer rebuild", () =>
    Effect.gen(function*() {
      const tokens: Array<FencingToken> = []
      const take = (lock: DistributedLock.Service) =>
        Effect.scoped(Effect.map(lock.acquire("fenced"), (lease) => tokens.push(lease.token)))
      yield* Effect.scoped(
        Effect.gen(function*() {
          const a = yield* service("adv-fence-a")
          const b = yield* service("adv-fence-b")
          for (let i = 0; i < 5; i++) {
            yield* take(a)
            yield* take(b)
          }
        })
      )
      // A new layer (a restarted process) continues from the stored counter.
      yield* Effect.scoped(Effect.flatMap(service("adv-fence-c"), take))
      expect(tokens.length).toBe(11)
      for (let i = 1; i < tokens.length; i++) expect(tokens[i]!).toBeGreaterThan(tokens[i - 1]!)
    }))

  it.scopedLive("layers built concurrently create the fencing table once, without catalog conflicts", () =>
    Effect.gen(function*() {
      const locks = yield* Effect.forEach(
        Array.from({ length: 6 }, (_, i) => i),
        (i) => service(`adv-ddl-${i}`, { maxSessions: 1, fencingTable: "adv_fencing_race" }),
        { concurrency: "unbounded" }
      )
      const tokens = yield* Effect.forEach(locks, (lock) => Effect.scoped(Effect.map(lock.acquire("ddl"), (l) => l.token)))
      expect(tokens).toEqual([1n, 2n, 3n, 4n, 5n, 6n])
      const [{ n }] = yield* Effect.promise(() =>
        withClient(db.url, async (client) =>
          (await client.query<{ n: number }>("select count(*)::int as n from adv_fencing_race where name = 'ddl'")).rows)
      )
      expect(n).toBe(1)
    }))

  it.scopedLive("terminating the holder's backend interrupts withLock with LockLost, and others acquire within 2 s", () =>
    Effect.gen(function*() {
      const a = yield* service("adv-term-a")
      const b = yield* service("adv-term-b")
      const holding = yield* Deferred.make<FencingToken>()
      const interrupted = yield* Deferred.make<void>()
      const body = Effect.gen(function*() {
        const [held] = yield* DistributedLock.inspect
        yield* Deferred.succeed(holding, held!.token)
        return yield* Effect.never
      }).pipe(Effect.onInterrupt(() => Deferred.succeed(interrupted, undefined)))
      const running = yield* Effect.fork(DistributedLock.withLock(body, "victim").pipe(withService(a), Effect.either))
      const token = yield* Deferred.await(holding)

      const killedAt = Date.now()
      expect(yield* Effect.promise(() => terminateBackends(db.url, "adv-term-a"))).toBeGreaterThan(0)
      const result = yield* Fiber.join(running)
      const noticedIn = Date.now() - killedAt
      expect(yield* Deferred.isDone(interrupted)).toBe(true)
      expect(Either.isLeft(result)).toBe(true)
      const error = Either.getLeft(result).pipe(Option.getOrThrow)
      expect(error).toBeInstanceOf(LockLost)
      expect(error).toMatchObject({ name: "victim", token, reason: "connection-lost" })
      expect(noticedIn).toBeLessThan(2_000)

      const lease = yield* b.acquire("victim", { timeout: "2 seconds" })
      expect(Date.now() - killedAt).toBeLessThan(2_000)
      expect(lease.token).toBeGreaterThan(token)
      // The layer whose sessions were killed recovers by opening new ones.
      const again = yield* Effect.scoped(a.acquire("after-termination", { timeout: "5 seconds" }))
      expect(again.token).toBeGreaterThan(0n)
    }))

  const logged: Array<{ readonly level: string; readonly message: unknown }> = []
  const recordingLogger = Logger.make(({ logLevel, message }) => {
    logged.push({ level: logLevel.label, message: Array.isArray(message) ? message[0] : message })
  })
  it.scopedLive("a silent network drop under a held lock is noticed by the heartbeat: LockLost within 2 s", () =>
    Effect.gen(function*() {
      const proxy = yield* Effect.acquireRelease(Effect.promise(() => startProxy(db.url)), (p) => Effect.promise(p.close))
      const lock = yield* Layer.build(PgAdvisory.layer({ url: proxy.url, applicationName: "adv-drop" })).pipe(
        Effect.map(Context.get(DistributedLock.DistributedLock))
      )
      const holding = yield* Deferred.make<void>()
      const running = yield* Effect.fork(
        DistributedLock.withLock(Effect.zipRight(Deferred.succeed(holding, undefined), Effect.never), "dropped").pipe(
          withService(lock),
          Effect.either
        )
      )
      yield* Deferred.await(holding)
      // Packets stop flowing both ways; no FIN, no RST: only a heartbeat can tell.
      const droppedAt = Date.now()
      proxy.freeze()
      const result = yield* Fiber.join(running)
      expect(Date.now() - droppedAt).toBeLessThan(2_000)
      expect(Either.getLeft(result).pipe(Option.getOrUndefined)).toMatchObject({ _tag: "LockLost", reason: "connection-lost" })
      // The destroyed session and the lost lease are each logged once, at warning level.
      const warnings = logged.filter((entry) => entry.level === "WARN").map((entry) => String(entry.message))
      expect(warnings.filter((m) => m.startsWith("destroyed a lock session"))).toHaveLength(1)
      expect(warnings.filter((m) => m.startsWith(`lost lock "dropped"`))).toHaveLength(1)
    }).pipe(Effect.provide(Logger.replace(Logger.defaultLogger, recordingLogger))))

  layer(PgTest.layer(db, { maxConnections: 4 }), { excludeTestServices: true })("with the app's own work pool", (it) => {
    it.scoped("lock sessions never come from the work pool: 200 bodies on a 4-connection pool all complete", () =>
      Effect.gen(function*() {
        const sql = yield* SqlClient.SqlClient
        const lock = yield* service("adv-starve")
        let completed = 0
        yield* Effect.forEach(
          Array.from({ length: 200 }, (_, i) => i),
          (i) =>
            DistributedLock.withLock(
              Effect.zipRight(sql`select pg_sleep(0.002)`, Effect.sync(() => completed++)),
              // Half on distinct names, half contending on five names.
              i % 2 === 0 ? `starve-${i}` : `starve-shared-${i % 5}`,
              { timeout: "20 seconds" }
            ).pipe(withService(lock)),
          { concurrency: "unbounded", discard: true }
        )
        expect(completed).toBe(200)
        expect(yield* sessionsOf("adv-starve")).toBeLessThanOrEqual(4)
      }))

    it.scoped("find-then-create from 6 pods on one key creates exactly one row", () =>
      Effect.gen(function*() {
        const sql = yield* SqlClient.SqlClient
        yield* sql`create table adv_widgets (name text not null, created_by int not null)`
        const pods = yield* Effect.forEach(Array.from({ length: 6 }, (_, i) => i), (i) =>
          service(`adv-pod-${i}`, { maxSessions: 2 }).pipe(Effect.map((lock) => [i, lock] as const)))
        const findOrCreate = (pod: number, name: string) =>
          Effect.gen(function*() {
            const found = yield* sql`select 1 from adv_widgets where name = ${name}`
            if (found.length > 0) return
            yield* Effect.sleep(Duration.millis(20)) // the gap a duplicate needs
            yield* sql`insert into adv_widgets (name, created_by) values (${name}, ${pod})`
          })
        for (const name of ["widget-a", "widget-b", "widget-c"]) {
          yield* Effect.forEach(
            pods,
            ([pod, lock]) => DistributedLock.withLock(findOrCreate(pod, name), `create:${name}`).pipe(withService(lock)),
            { concurrency: "unbounded", discard: true }
          )
        }
        const rows = yield* sql<{ name: string; n: number }>`select name, count(*)::int as n from adv_widgets group by name order by name`
        expect(rows).toEqual([{ name: "widget-a", n: 1 }, { name: "widget-b", n: 1 }, { name: "widget-c", n: 1 }])
      }))
  })

  it.scopedLive("interruption fuzz: 1,000 acquires interrupted at random moments leave no lock and no extra session", () =>
    Effect.gen(function*() {
      const a = yield* service("adv-fuzz-a", { maxSessions: 4 })
      const b = yield* service("adv-fuzz-b", { maxSessions: 4 })
      const names = Array.from({ length: 8 }, (_, i) => `fuzz-${i}`)
      const outcomes = { held: 0, interrupted: 0, timedOut: 0 }
      const random = (max: number) => Math.random() * max
      const round = (i: number) =>
        Effect.gen(function*() {
          const lock = i % 2 === 0 ? a : b
          const name = names[Math.floor(random(names.length))]!
          const mode = Math.random() < 0.2 ? "shared" as const : "exclusive" as const
          const timeout = Math.random() < 0.2 ? Duration.millis(random(10)) : undefined
          const acquired = yield* Deferred.make<void>()
          const attempt = Effect.scoped(
            Effect.gen(function*() {
              yield* lock.acquire(name, { mode, timeout })
              outcomes.held++
              yield* Deferred.succeed(acquired, undefined)
              yield* Effect.sleep(Duration.millis(random(3)))
            })
          ).pipe(Effect.catchTag("LockTimeout", () => Effect.sync(() => outcomes.timedOut++)))
          const fiber = yield* Effect.fork(attempt)
          if (i % 3 === 0) {
            // Racing the release: interrupt around the moment the body ends and the lock is given back.
            yield* Effect.raceFirst(Deferred.await(acquired), Fiber.await(fiber))
            yield* Effect.sleep(Duration.millis(random(4)))
          } else {
            // Anywhere in the acquisition: queued locally, in the try-lock, blocked at the server, granted.
            yield* Effect.sleep(Duration.millis(random(15)))
          }
          const exit = yield* Fiber.interrupt(fiber)
          if (Exit.isFailure(exit) && Cause.isInterruptedOnly(exit.cause)) outcomes.interrupted++
          else if (Exit.isFailure(exit)) return yield* Effect.failCause(exit.cause)
        })
      // Meanwhile, sample the design's invariant: a session blocked in a lock wait holds no lock
      // (otherwise a release could queue behind the wait, and two processes could deadlock).
      const violations: Array<AdvisoryLockRow> = []
      let samples = 0
      const sampler = yield* Effect.fork(
        Effect.forever(
          Effect.gen(function*() {
            const rows = [...(yield* locksOf("adv-fuzz-a")), ...(yield* locksOf("adv-fuzz-b"))]
            const blocked = new Set(rows.filter((row) => !row.granted).map((row) => row.pid))
            violations.push(...rows.filter((row) => row.granted && blocked.has(row.pid)))
            samples++
            yield* Effect.sleep(Duration.millis(5))
          })
        )
      )
      const started = Date.now()
      yield* Effect.forEach(Array.from({ length: 1_000 }, (_, i) => i), round, { concurrency: 16, discard: true })
      yield* Fiber.interrupt(sampler)
      expect(samples).toBeGreaterThan(10)
      expect(violations).toEqual([])
      console.log(`[PgAdvisory] interruption fuzz: ${JSON.stringify(outcomes)} in ${Date.now() - started} ms`)
      expect(outcomes.interrupted).toBeGreaterThan(100)
      expect(outcomes.held).toBeGreaterThan(100)

      const leftover = yield* eventually(
        Effect.zipWith(locksOf("adv-fuzz-a"), locksOf("adv-fuzz-b"), (x, y) => [...x, ...y]),
        (rows) => rows.length === 0
      )
      expect(leftover).toEqual([])
      expect(yield* sessionsOf("adv-fuzz-a")).toBeLessThanOrEqual(4)
      expect(yield* sessionsOf("adv-fuzz-b")).toBeLessThanOrEqual(4)
      // Both layers still work.
      for (const lock of [a, b]) {
        for (const name of names) yield* Effect.scoped(lock.acquire(name, { timeout: "2 seconds" }))
      }
    }))
})

describeWithPgBouncer("PgAdvisory.layer behind PgBouncer", () => {
  const bouncer = (poolMode: "session" | "transaction") =>
    Effect.acquireRelease(
      Effect.promise(() => startPgBouncer({ targetUrl: db.url, poolMode, defaultPoolSize: 10 })),
      (running) => Effect.promise(() => running.stop())
    )

  it.scopedLive("transaction pooling: building the layer fails with UnsafeConnectionPooling", () =>
    Effect.gen(function*() {
      const pooler = yield* bouncer("transaction")
      const exit = yield* Effect.exit(Layer.build(PgAdvisory.layer({ url: pooler.url, applicationName: "adv-bouncer-tx" })))
      expect(Exit.isFailure(exit)).toBe(true)
      const error = Exit.isFailure(exit) ? Cause.failureOption(exit.cause).pipe(Option.getOrUndefined) : undefined
      expect(error).toBeInstanceOf(UnsafeConnectionPooling)
      expect(error?.message).toMatch(/session affinity/)
      expect(error?.message).toMatch(/pool_mode=transaction/)
      expect(yield* locksOf("adv-bouncer-tx")).toEqual([])
    }))

  it.scopedLive("session pooling: locks, waits and cancelled waits work", () =>
    Effect.gen(function*() {
      const pooler = yield* bouncer("session")
      const lock = yield* Layer.build(PgAdvisory.layer({ url: pooler.url, applicationName: "adv-bouncer-s", maxSessions: 2 })).pipe(
        Effect.map(Context.get(DistributedLock.DistributedLock))
      )
      const direct = yield* service("adv-bouncer-direct")
      const held = yield* Scope.make()
      yield* direct.acquire("pooled").pipe(Scope.extend(held))
      // A wait through the pooler, cancelled at the server when interrupted.
      const cancelled = yield* Effect.fork(Effect.scoped(lock.acquire("pooled")))
      yield* blockedAtServer("adv-bouncer-s")
      yield* Fiber.interrupt(cancelled)
      expect(yield* locksOf("adv-bouncer-s")).toEqual([])
      // A wait through the pooler, granted on release.
      const waiting = yield* Effect.fork(Effect.scoped(Effect.map(lock.acquire("pooled"), (lease) => lease.token)))
      yield* blockedAtServer("adv-bouncer-s")
      yield* Scope.close(held, Exit.void)
      expect(yield* Fiber.join(waiting)).toBeGreaterThan(0n)
    }))
})

describe("PgAdvisory.withXactLock", () => {
  const holdFor = (name: string, started: Deferred.Deferred<void>, release: Deferred.Deferred<void>) =>
    PgAdvisory.withXactLock(Effect.zipRight(Deferred.succeed(started, undefined), Deferred.await(release)), name)

  const xactLocks = Effect.promise(() => advisoryLocks(db.url))

  layer(PgTest.layer(db), { excludeTestServices: true })("on the app's SqlClient", (it) => {
    it.effect("excludes a concurrent holder, and a timeout gives LockTimeout", () =>
      Effect.gen(function*() {
        const started = yield* Deferred.make<void>()
        const release = yield* Deferred.make<void>()
        const holder = yield* Effect.fork(holdFor("xact-excl", started, release))
        yield* Deferred.await(started)

        const begun = Date.now()
        const error = yield* Effect.flip(PgAdvisory.withXactLock(Effect.void, "xact-excl", { timeout: "200 millis" }))
        expect(error).toBeInstanceOf(LockTimeout)
        expect(Date.now() - begun).toBeGreaterThanOrEqual(190)
        const once = yield* Effect.flip(PgAdvisory.withXactLock(Effect.void, "xact-excl", { timeout: 0 }))
        expect(once).toMatchObject({ _tag: "LockTimeout", waited: Duration.zero })

        // A waiter without timeout gets it once the holder commits.
        const order: Array<string> = []
        const waiter = yield* Effect.fork(PgAdvisory.withXactLock(Effect.sync(() => order.push("waiter")), "xact-excl"))
        yield* Effect.sleep(Duration.millis(50))
        order.push("holder commits")
        yield* Deferred.succeed(release, undefined)
        yield* Fiber.join(holder)
        yield* Fiber.join(waiter)
        expect(order).toEqual(["holder commits", "waiter"])
        // The session-lock layer excludes it too: same key.
        expect(PgAdvisory.keyOf("xact-excl")).toBe(PgAdvisory.keyOf("xact-excl", ""))
      }))

    it.effect("shared transaction locks coexist and exclude exclusive ones", () =>
      Effect.gen(function*() {
        const started = yield* Deferred.make<void>()
        const release = yield* Deferred.make<void>()
        const holder = yield* Effect.fork(
          PgAdvisory.withXactLock(Effect.zipRight(Deferred.succeed(started, undefined), Deferred.await(release)), "xact-shared", { mode: "shared" })
        )
        yield* Deferred.await(started)
        yield* PgAdvisory.withXactLock(Effect.void, "xact-shared", { mode: "shared", timeout: 0 })
        const error = yield* Effect.flip(PgAdvisory.withXactLock(Effect.void, "xact-shared", { timeout: 0 }))
        expect(error).toBeInstanceOf(LockTimeout)
        yield* Deferred.succeed(release, undefined)
        yield* Fiber.join(holder)
      }))

    it.effect("released on commit, on the body's failure and on interruption", () =>
      Effect.gen(function*() {
        yield* PgAdvisory.withXactLock(Effect.void, "xact-release")
        yield* PgAdvisory.withXactLock(Effect.void, "xact-release", { timeout: 0 })

        const failure = yield* Effect.flip(PgAdvisory.withXactLock(Effect.fail("boom" as const), "xact-release"))
        expect(failure).toBe("boom")
        yield* PgAdvisory.withXactLock(Effect.void, "xact-release", { timeout: 0 })

        const started = yield* Deferred.make<void>()
        const fiber = yield* Effect.fork(PgAdvisory.withXactLock(Effect.zipRight(Deferred.succeed(started, undefined), Effect.never), "xact-release"))
        yield* Deferred.await(started)
        yield* Fiber.interrupt(fiber)
        yield* PgAdvisory.withXactLock(Effect.void, "xact-release", { timeout: 0 })
        expect(yield* xactLocks).toEqual([])

        // The body's own defects pass through unchanged.
        const defect = yield* Effect.exit(PgAdvisory.withXactLock(Effect.dieMessage("body defect"), "xact-release"))
        expect(Exit.isFailure(defect) && Cause.pretty(defect.cause)).toMatch(/body defect/)
        expect(Exit.isFailure(defect) && Cause.failureOption(defect.cause)._tag).toBe("None")
      }))

    it.effect("the body's SQL runs in the lock's transaction: a failure rolls its insert back", () =>
      Effect.gen(function*() {
        const sql = yield* SqlClient.SqlClient
        yield* sql`create table xact_items (id int primary key)`
        yield* PgAdvisory.withXactLock(sql`insert into xact_items values (1)`, "xact-items")
        const failed = yield* Effect.flip(
          PgAdvisory.withXactLock(Effect.zipRight(sql`insert into xact_items values (2)`, Effect.fail("rollback")), "xact-items")
        )
        expect(failed).toBe("rollback")
        const rows = yield* sql<{ id: number }>`select id from xact_items order by id`
        expect(rows).toEqual([{ id: 1 }])
        // The lock is held in the body's transaction.
        const inside = yield* PgAdvisory.withXactLock(
          sql<{ n: number }>`select count(*)::int as n from pg_locks where locktype = 'advisory' and pid = pg_backend_pid()`,
          "xact-items"
        )
        expect(inside).toEqual([{ n: 1 }])
      }))

    it.effect("a connection killed inside the transaction is a LockBackendError, not a defect", () =>
      Effect.gen(function*() {
        const sql = yield* SqlClient.SqlClient
        const exit = yield* Effect.exit(
          PgAdvisory.withXactLock(
            Effect.gen(function*() {
              const [{ pid }] = yield* sql<{ pid: number }>`select pg_backend_pid() as pid`
              yield* Effect.promise(() => withClient(db.url, (client) => client.query("select pg_terminate_backend($1)", [pid])))
              yield* Effect.sleep(Duration.millis(50))
            }),
            "xact-killed"
          )
        )
        expect(Exit.isFailure(exit)).toBe(true)
        const error = Exit.isFailure(exit) ? Cause.failureOption(exit.cause).pipe(Option.getOrUndefined) : undefined
        expect(error).toBeInstanceOf(LockBackendError)
        expect(error).toMatchObject({ operation: "transaction", name: "xact-killed" })
        // The pool recovers.
        yield* PgAdvisory.withXactLock(Effect.void, "xact-killed", { timeout: "2 seconds" })
      }))

    it.effect("invalid names are refused before any SQL", () =>
      Effect.gen(function*() {
        const error = yield* Effect.flip(PgAdvisory.withXactLock(Effect.void, ""))
        expect(error._tag).toBe("InvalidLockName")
      }))
  })

  layer(PgTest.layer(() => `${db.url}?options=${encodeURIComponent("-c lock_timeout=4321")}`), {
    excludeTestServices: true
  })("on a pool whose sessions set their own lock_timeout", (it) => {
    it.effect("the lock wait uses the given timeout, the body sees the session's own lock_timeout", () =>
      Effect.gen(function*() {
        const sql = yield* SqlClient.SqlClient
        const inside = yield* PgAdvisory.withXactLock(sql<{ lock_timeout: string }>`show lock_timeout`, "xact-setting", {
          timeout: "150 millis"
        })
        expect(inside).toEqual([{ lock_timeout: "4321ms" }])
        const outside = yield* sql<{ lock_timeout: string }>`show lock_timeout`
        expect(outside).toEqual([{ lock_timeout: "4321ms" }])

        const started = yield* Deferred.make<void>()
        const release = yield* Deferred.make<void>()
        const holder = yield* Effect.fork(holdFor("xact-setting", started, release))
        yield* Deferred.await(started)
        const begun = Date.now()
        const error = yield* Effect.flip(PgAdvisory.withXactLock(Effect.void, "xact-setting", { timeout: "150 millis" }))
        expect(error).toBeInstanceOf(LockTimeout)
        expect(Date.now() - begun).toBeLessThan(2_000)
        yield* Deferred.succeed(release, undefined)
        yield* Fiber.join(holder)
      }))
  })
})

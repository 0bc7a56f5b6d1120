/**
 * RedisLease under faults a real deployment brings, as PgAdvisory's fault tests: a frozen server
 * (SIGSTOP) past the ttl, a crash-restart with AOF and a restart without persistence, CLIENT KILL
 * of the holder's connections, a release Redis refuses (repeated in the background until it
 * answers), an event-loop stall of the application. Each test starts a
 * redis-server of its own (free loopback port, own directory) and stops it in its finalizer:
 * these tests freeze, kill and restart it, which must never touch a server another file uses.
 * Skipped without redis-server on the PATH (REDIS_URL does not matter: they need servers of their own).
 */
import { describe, expect, it } from "@effect/vitest"
import { Deferred, Duration, Effect, Either, Exit, Fiber, Option, Scope } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import type * as Lease from "effect-lock/Lease"
import * as RedisLease from "effect-lock/RedisLease"
import * as Keys from "effect-lock/internal/redis/keys"
import { Redis } from "ioredis"
import { freshName, HOLD_THROUGH, stall, untilFree } from "./support/contract.js"
import { eventually, waitFor } from "./support/eventually.js"
import { frozen } from "./support/freeze.js"
import { noRedisServer, type ServerOptions, startRedisServer, type TestRedis } from "./support/redis.js"

const TTL = Duration.seconds(1)
const TTL_MS = Duration.toMillis(TTL)

const skip = noRedisServer()

/** A redis-server of this test alone, stopped (and its directory deleted) when the test's scope closes. */
const ownServer = (options?: ServerOptions): Effect.Effect<TestRedis, never, Scope.Scope> =>
  Effect.acquireRelease(Effect.promise(() => startRedisServer(options)), (server) => Effect.promise(() => server.stop()))

/** A plain client of the test on `url`, closed with the scope. */
const clientOf = (url: string): Effect.Effect<Redis, never, Scope.Scope> =>
  Effect.acquireRelease(
    Effect.sync(() => {
      const client = new Redis(url, { maxRetriesPerRequest: 1, lazyConnect: true })
      client.on("error", () => {})
      return client
    }),
    (client) => Effect.promise(() => client.quit().then(() => undefined, () => client.disconnect()))
  )

/** A process: a lock service on its own RedisLease layer (named `application`), closed with the scope. */
const processOn = (url: string, application: string, options?: RedisLease.Options) =>
  Effect.flatMap(RedisLease.makeBackend({ url, ttl: TTL, applicationName: application, ...options }), (backend) => DistributedLock.make(backend))

const command = <A = unknown>(client: Redis, name: string, ...args: Array<string | number>): Effect.Effect<A> =>
  Effect.promise(() => client.call(name, args) as Promise<A>)

/**
 * Holds `name` in a guarded body until it is interrupted: the lease, the wall-clock time
 * (Date.now, the clock redis-server's TIME reads) at which the body was interrupted, and the
 * fiber whose result says how it ended.
 */
const holdUntilLost = (lock: DistributedLock.Service, name: string) =>
  Effect.gen(function*() {
    const holding = yield* Deferred.make<Lease.Lease>()
    const stoppedAt = { at: 0 }
    const running = yield* Effect.forkScoped(
      Effect.scoped(Effect.flatMap(lock.acquire(name), (lease) =>
        Effect.zipRight(
          Deferred.succeed(holding, lease),
          DistributedLock.guard(lease, Effect.never.pipe(Effect.onInterrupt(() => Effect.sync(() => void (stoppedAt.at = Date.now())))))
        ))).pipe(Effect.either)
    )
    return { lease: yield* Deferred.await(holding), stoppedAt, running }
  })

/**
 * What the server decided about `name`'s exclusive lease: every `expires` its scripts wrote into
 * the lease hash (grant and renewals), seen through MONITOR (which shows the commands a script
 * runs, as the server ran them). The largest is when the lease ran out on the server.
 */
const serverExpiries = (url: string, name: string) =>
  Effect.gen(function*() {
    const leaseKey = Keys.lockKeys(Keys.DEFAULT_PREFIX, name).lease
    const expiries: Array<number> = []
    const client = yield* clientOf(url)
    const monitor = yield* Effect.promise(() => client.monitor())
    yield* Effect.addFinalizer(() => Effect.sync(() => monitor.disconnect()))
    monitor.on("error", () => {})
    monitor.on("monitor", (_time: string, args: ReadonlyArray<string>) => {
      if (args[0]?.toLowerCase() !== "hset" || args[1] !== leaseKey) return
      for (let i = 2; i + 1 < args.length; i += 2) if (args[i] === "expires") expiries.push(Number(args[i + 1]))
    })
    return { latest: () => (expiries.length === 0 ? undefined : Math.max(...expiries)), count: () => expiries.length }
  })

const tokenOf = (lock: DistributedLock.Service, name: string) =>
  Effect.scoped(Effect.map(lock.acquire(name, { timeout: Duration.seconds(5) }), (lease) => lease.token))

/** The connections of the layer named `application` (`<application>:<role>`), from CLIENT LIST. */
const connectionsOf = (client: Redis, application: string) =>
  Effect.map(command<string>(client, "client", "list"), (list) =>
    list.split("\n").flatMap((line) => {
      const id = /(?:^| )id=(\d+)/.exec(line)?.[1]
      const name = /(?:^| )name=(\S*)/.exec(line)?.[1]
      return id !== undefined && name !== undefined && name.startsWith(`${application}:`) ? [{ id, name }] : []
    }))

/** CLIENT KILL of every connection of the layer named `application`: the names it killed. */
const killConnections = (client: Redis, application: string) =>
  Effect.flatMap(connectionsOf(client, application), (connections) =>
    Effect.as(
      // Dangerous only to that layer: CLIENT KILL by id, on this test's own server.
      Effect.forEach(connections, ({ id }) => Effect.ignore(command(client, "client", "kill", "id", id)), { discard: true }),
      connections
    ))

describe.skipIf(skip)("RedisLease under faults", () => {
  it.scopedLive("a frozen server (SIGSTOP) past the ttl: LockLost before the lease ran out on the server; after SIGCONT another layer gets a larger token", () =>
    Effect.gen(function*() {
      const server = yield* ownServer()
      const name = freshName("redis-sigstop")
      const server$ = yield* serverExpiries(server.url, name)
      const a = yield* processOn(server.url, "faults-stop-a")
      const b = yield* processOn(server.url, "faults-stop-b")
      const { lease, running, stoppedAt } = yield* holdUntilLost(a, name)
      yield* waitFor("the grant seen by MONITOR", Effect.sync(() => server$.count() > 0), Duration.seconds(5))
      const freeze = yield* Scope.make()
      // Dangerous: SIGSTOP of this test's own server; `frozen` continues it on every path.
      yield* frozen([server.pid()!]).pipe(Scope.extend(freeze))
      const frozenAt = Date.now()
      // The body is interrupted while the server is frozen (its release then waits for the server).
      yield* waitFor("the holder's body was interrupted", Effect.sync(() => stoppedAt.at > 0), Duration.seconds(3))
      // Past the ttl: whatever expiry the server last wrote (≤ the freeze + ttl) has gone by.
      yield* waitFor("the ttl ran out since the freeze", Effect.sync(() => Date.now() > frozenAt + TTL_MS + 50), Duration.seconds(5))
      yield* Scope.close(freeze, Exit.void)
      const result = yield* Fiber.join(running)
      expect(Either.getLeft(result).pipe(Option.getOrUndefined)).toMatchObject({ _tag: "LockLost", name, token: lease.token })
      // Renewals queued during the freeze reach the server after the expiry: they write nothing.
      const taken = yield* b.acquire(name, { timeout: Duration.seconds(5) })
      expect(taken.token > lease.token).toBe(true)
      const expiredAt = server$.latest()!
      // Measured against the server's own decision (Date.now and TIME read the same clock).
      expect(stoppedAt.at).toBeGreaterThan(0)
      expect(stoppedAt.at).toBeLessThan(expiredAt)
      const held = yield* RedisLease.holders(yield* clientOf(server.url), name)
      expect(held.map((h) => h.token)).toEqual([taken.token])
    }), 20_000)

  it.scopedLive("a crash (SIGKILL) and restart with AOF (appendfsync always): the lease and the name's last token survive — the holder keeps its lease, tokens go on from max(last + 1, server µs)", () =>
    Effect.gen(function*() {
      const server = yield* ownServer({ aof: true })
      const inspector = yield* clientOf(server.url)
      const ttl = Duration.seconds(2)
      const a = yield* processOn(server.url, "faults-aof-a", { ttl })
      const b = yield* processOn(server.url, "faults-aof-b", { ttl })
      const name = freshName("redis-aof")
      const tokens = [yield* tokenOf(b, name), yield* tokenOf(b, name)]
      const { lease, running } = yield* holdUntilLost(a, name)
      tokens.push(lease.token)
      // Dangerous: SIGKILL of this test's own server; every write acknowledged was fsync'ed first.
      yield* Effect.promise(() => server.restart!("SIGKILL"))
      const restartedAt = Date.now()
      const leaseKey = Keys.lockKeys(Keys.DEFAULT_PREFIX, name).lease
      // The lease hash came back with the AOF: the holder and the name's last token.
      expect(yield* command<Array<string | null>>(inspector, "hmget", leaseKey, "token", "last")).toEqual([String(lease.token), String(lease.token)])
      // The holder's renewals go on after reconnecting: an expiry written after the restart
      // (every one written before it is ≤ the kill + ttl).
      yield* waitFor(
        "a renewal after the restart",
        Effect.map(command<string | null>(inspector, "hget", leaseKey, "expires"), (e) => e !== null && Number(e) >= restartedAt + Duration.toMillis(ttl)),
        Duration.seconds(3)
      )
      expect(yield* lease.isHeld).toBe(true)
      expect(Option.isNone(yield* Effect.scoped(b.tryAcquire(name)))).toBe(true)
      expect(running.unsafePoll()).toBeNull()
      yield* Fiber.interrupt(running)
      tokens.push(yield* tokenOf(b, name))
      for (let i = 1; i < tokens.length; i++) expect(tokens[i]! > tokens[i - 1]!).toBe(true)
    }), 20_000)

  it.scopedLive("a restart without persistence loses every key — the holder learns at its next renewal; tokens still increase, from the server's µs floor", () =>
    Effect.gen(function*() {
      const server = yield* ownServer()
      const a = yield* processOn(server.url, "faults-nopersist-a")
      const b = yield* processOn(server.url, "faults-nopersist-b")
      const name = freshName("redis-nopersist")
      const tokens = [yield* tokenOf(b, name), yield* tokenOf(b, name)]
      const { lease, running } = yield* holdUntilLost(a, name)
      tokens.push(lease.token)
      // Dangerous: restarts this test's own server, which forgets every key (the holder's lease too).
      yield* Effect.promise(() => server.restart!())
      // No lease on the server any more: the next renewal answers "expired" (or cannot renew in time).
      const result = yield* Fiber.join(running)
      expect(Either.getLeft(result).pipe(Option.getOrUndefined)).toMatchObject({ _tag: "LockLost", name, token: lease.token })
      // The name's `last` is gone with it: the token comes from the server's clock in µs, which
      // has moved past every token granted before (each ≤ the µs of its grant, plus ones per µs).
      tokens.push(yield* tokenOf(b, name).pipe(Effect.retry({ times: 20 })))
      for (let i = 1; i < tokens.length; i++) expect(tokens[i]! > tokens[i - 1]!).toBe(true)
    }), 20_000)

  it.scopedLive("CLIENT KILL of the holder's connections: they reconnect and the holder keeps its lease; never two holders", () =>
    Effect.gen(function*() {
      const server = yield* ownServer()
      const inspector = yield* clientOf(server.url)
      const a = yield* processOn(server.url, "faults-kill-a")
      const b = yield* processOn(server.url, "faults-kill-b")
      const name = freshName("redis-kill")
      const { lease, running, stoppedAt } = yield* holdUntilLost(a, name)
      // Another process tries all along; it must never be granted while the holder holds.
      const grants: Array<{ readonly at: number; readonly token: bigint }> = []
      const contender = yield* Effect.forkScoped(Effect.forever(Effect.zipRight(
        Effect.scoped(Effect.flatMap(Effect.either(b.tryAcquire(name)), (got) =>
          Effect.sync(() => {
            if (Either.isRight(got) && Option.isSome(got.right)) grants.push({ at: Date.now(), token: got.right.value.token })
          }))),
        Effect.sleep(Duration.millis(20))
      )))
      yield* waitFor("the renewal connection is open", Effect.map(connectionsOf(inspector, "faults-kill-a"), (c) => c.some((x) => x.name.endsWith(":renewals"))), Duration.seconds(3))
      const leaseKey = Keys.lockKeys(Keys.DEFAULT_PREFIX, name).lease
      const expiresNow = Effect.map(command<string | null>(inspector, "hget", leaseKey, "expires"), Number)
      // Three rounds over more than a ttl: each kills all of the holder's connections and waits
      // until its renewal connection is back (a new id) and a renewal landed through it.
      for (let round = 0; round < 3; round++) {
        const killed = yield* killConnections(inspector, "faults-kill-a")
        // Read after the kill: no renewal can land before the renewal connection is back.
        const before = yield* expiresNow
        const old = new Set(killed.map((c) => c.id))
        yield* waitFor(
          "the holder's renewal connection reconnected",
          Effect.map(connectionsOf(inspector, "faults-kill-a"), (c) => c.some((x) => x.name.endsWith(":renewals") && !old.has(x.id))),
          Duration.seconds(3)
        )
        yield* waitFor("a renewal landed through the new connection", Effect.map(expiresNow, (e) => e > before), Duration.seconds(3))
      }
      yield* Fiber.interrupt(contender)
      // The invariant: a grant to the contender only after the holder was told it lost.
      for (const grant of grants) expect(stoppedAt.at > 0 && grant.at >= stoppedAt.at).toBe(true)
      // And here: the holder kept its lease through the kills (renewal reconnected within the bound).
      expect(yield* lease.isHeld).toBe(true)
      expect(running.unsafePoll()).toBeNull()
      expect(grants).toEqual([])
      const held = yield* RedisLease.holders(inspector, name)
      expect(held.map((h) => h.token)).toEqual([lease.token])
    }), 20_000)

  it.scopedLive("CLIENT KILL of the renewal connection when it cannot come back (AUTH now required): LockLost before the server's expiry, then the next holder", () =>
    Effect.gen(function*() {
      const server = yield* ownServer()
      const inspector = yield* clientOf(server.url)
      const a = yield* processOn(server.url, "faults-noauth-a")
      const b = yield* processOn(server.url, "faults-noauth-b")
      const name = freshName("redis-noauth")
      // b's connections are open (and authenticated) before the password is set.
      yield* tokenOf(b, freshName("redis-noauth-warm"))
      const { lease, running, stoppedAt } = yield* holdUntilLost(a, name)
      yield* waitFor("the renewal connection is open", Effect.map(connectionsOf(inspector, "faults-noauth-a"), (c) => c.some((x) => x.name.endsWith(":renewals"))), Duration.seconds(3))
      // Dangerous: a password on this test's own server; connections already open stay authenticated.
      yield* command(inspector, "config", "set", "requirepass", "fault-test")
      // CLIENT KILL of the holder's renewal connection alone, on this test's own server.
      const killed = yield* Effect.flatMap(connectionsOf(inspector, "faults-noauth-a"), (c) =>
        Effect.forEach(c.filter((x) => x.name.endsWith(":renewals")), ({ id }) => command(inspector, "client", "kill", "id", id)))
      expect(killed.length).toBe(1)
      // No renewal can land any more: the lease hash holds the server's final expiry.
      const expires = Number(yield* command<string>(inspector, "hget", Keys.lockKeys(Keys.DEFAULT_PREFIX, name).lease, "expires"))
      const result = yield* Fiber.join(running)
      expect(Either.getLeft(result).pipe(Option.getOrUndefined)).toMatchObject({ _tag: "LockLost", name, token: lease.token })
      expect(stoppedAt.at).toBeLessThan(expires)
      const taken = yield* b.acquire(name, { timeout: Duration.seconds(5) })
      expect(taken.token > lease.token).toBe(true)
      yield* command(inspector, "config", "set", "requirepass", "")
    }), 20_000)

  it.scopedLive("a release Redis refuses (the holder's command connection killed and AUTH now required) is repeated in the background: the lease is free soon after Redis answers again, not at its 30 s ttl", () =>
    Effect.gen(function*() {
      const server = yield* ownServer()
      const inspector = yield* clientOf(server.url)
      const a = yield* processOn(server.url, "faults-release-a", { ttl: HOLD_THROUGH, statementTimeout: Duration.millis(500) })
      const b = yield* processOn(server.url, "faults-release-b")
      const name = freshName("redis-release")
      // b's connections are open (and authenticated) before the password is set.
      yield* tokenOf(b, freshName("redis-release-warm"))
      const scope = yield* Scope.make()
      yield* Scope.extend(a.acquire(name), scope)
      // Dangerous: a password on this test's own server; connections already open stay authenticated.
      yield* command(inspector, "config", "set", "requirepass", "fault-test")
      // CLIENT KILL of the holder's command connection alone, on this test's own server: it comes back unauthenticated.
      const killed = yield* Effect.flatMap(connectionsOf(inspector, "faults-release-a"), (c) =>
        Effect.forEach(c.filter((x) => x.name.endsWith(":commands")), ({ id }) => command(inspector, "client", "kill", "id", id)))
      expect(killed.length).toBe(1)
      // The release is refused (NOAUTH) or unanswered within its bound: told failed, the lease still held.
      yield* Scope.close(scope, Exit.void)
      expect(yield* Effect.scoped(b.tryAcquire(name))).toMatchObject({ _tag: "None" })
      yield* command(inspector, "config", "set", "requirepass", "")
      const answeredAt = performance.now()
      yield* untilFree(b, name, Duration.seconds(8))
      expect(performance.now() - answeredAt).toBeLessThan(8_000)
    }), 20_000)

  it.scopedLive("an event-loop stall past the lease's safe time: LockLost before the body's next step; the server let the lease run out and the next holder's lease is left alone", () =>
    Effect.gen(function*() {
      const server = yield* ownServer()
      const name = freshName("redis-stall")
      const server$ = yield* serverExpiries(server.url, name)
      const a = yield* processOn(server.url, "faults-stall-a")
      const b = yield* processOn(server.url, "faults-stall-b")
      const steps: Array<number> = []
      const lease = yield* a.acquire(name)
      const body = yield* Effect.fork(DistributedLock.guard(
        lease,
        Effect.forever(Effect.zipRight(Effect.sync(() => steps.push(Date.now())), Effect.sleep(Duration.millis(5))))
      ))
      yield* waitFor("the body ran a few steps", Effect.sync(() => steps.length >= 3), Duration.seconds(3))
      // Blocks this whole process (both layers) for 2.5 s: past the 1 s lease's safe time.
      yield* stall(2_500)
      const stallEnded = Date.now()
      const error = yield* Effect.flip(Fiber.join(body))
      expect(error).toMatchObject({ _tag: "LockLost", name, token: lease.token })
      // Not one step of the body after the stall.
      expect(steps.filter((t) => t >= stallEnded)).toEqual([])
      // The server had let it run out during the stall.
      expect(server$.latest()!).toBeLessThan(stallEnded)
      const taken = yield* b.acquire(name, { timeout: Duration.seconds(5) })
      expect(taken.token > lease.token).toBe(true)
      // The stalled holder's late renewal and release (owner-checked) leave the new lease alone.
      const inspector = yield* clientOf(server.url)
      yield* eventually("only the new holder", RedisLease.holders(inspector, name), (held) => held.length === 1, 2_000)
      expect((yield* RedisLease.holders(inspector, name)).map((h) => h.token)).toEqual([taken.token])
    }), 20_000)
})

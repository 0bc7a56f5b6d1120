/**
 * PgLease's own connections, over the node-postgres edge both PostgreSQL backends share: the
 * statement bound (stall-safe, and destroying the connection it gives up on), the pool's order
 * and its slots, the bound on opening a connection (connect and setup), and prepared statements
 * with their fallback when the server lost them — what a transaction pooler that moves statements
 * between server connections does. The loss is made on demand here: `deallocate all` on the
 * connection drops what node-pg believes is prepared.
 */
import { describe, expect, it } from "@effect/vitest"
import { Duration, Effect, Fiber, Layer } from "effect"
import * as PgAdvisory from "effect-lock/PgAdvisory"
import * as Driver from "effect-lock/internal/pg/pool"
import * as PgDriver from "effect-lock/internal/pg/driver"
import * as Net from "node:net"
import pg from "pg"
import { useTestDatabase, withClient } from "./support/pg.js"
import { waitFor } from "./support/eventually.js"
import { blockThread } from "../tools/blockThread.js"

const db = useTestDatabase("lease_driver")

const BOUND_MS = 5_000
/** A short bound, for statements that are to pass it. */
const SHORT_MS = 150

/** Blocks the event loop: nothing is read from any socket meanwhile. */
const stall = (millis: number) => {
  // The point is that the loop cannot turn (the thread parked: tools/blockThread).
  blockThread(millis)
}

/** Until `check` holds, within the bound (the shared poll loop). */
const eventually = (check: () => Promise<boolean>, withinMillis = BOUND_MS) =>
  waitFor("the condition", Effect.promise(check), Duration.millis(withinMillis))

const backendAlive = (pid: number) =>
  withClient(db.url, async (client) =>
    (await client.query<{ n: number }>("select count(*)::int as n from pg_stat_activity where pid = $1", [pid])).rows[0]!.n > 0)

/** A pool of own connections to the test database, closed with the scope. */
const poolOf = (size: number) =>
  Effect.acquireRelease(
    Effect.map(Driver.load, (driver) => Driver.makePool(driver, { connectionString: db.url }, size)),
    (pool) => Effect.sync(pool.close)
  )

const pidOn = (pool: Driver.Pool) =>
  Effect.map(pool.statement<{ pid: number }>("select pg_backend_pid() as pid", [], BOUND_MS), (rows) => rows[0]!.pid)

/**
 * A server that logs every client in (AuthenticationOk, ReadyForQuery) and then never answers
 * anything: a frozen backend behind a live socket.
 */
const silentServer = Effect.acquireRelease(
  Effect.async<
    { readonly port: number; readonly open: () => number; readonly server: Net.Server; readonly sockets: Set<Net.Socket> }
  >((resume) => {
    const sockets = new Set<Net.Socket>()
    const server = Net.createServer((socket) => {
      sockets.add(socket)
      socket.on("close", () => sockets.delete(socket))
      socket.on("error", () => {})
      socket.once("data", () => {
        const authenticationOk = Buffer.from([0x52, 0, 0, 0, 8, 0, 0, 0, 0])
        const readyForQuery = Buffer.from([0x5a, 0, 0, 0, 5, 0x49])
        socket.write(Buffer.concat([authenticationOk, readyForQuery]))
      })
    })
    server.listen(0, "127.0.0.1", () =>
      resume(Effect.succeed({ port: (server.address() as Net.AddressInfo).port, open: () => sockets.size, server, sockets })))
  }),
  ({ server, sockets }) =>
    Effect.async<void>((resume) => {
      for (const socket of sockets) socket.destroy()
      server.close(() => resume(Effect.void))
    })
)

describe("PgLease's own connections", () => {
  it.scopedLive("a statement answered during an event-loop stall longer than its bound is not failed for the stall", () =>
    Effect.gen(function*() {
      const pool = yield* poolOf(1)
      // An open, idle connection: the next statement is written to its socket at once.
      yield* pidOn(pool)
      const order: Array<string> = []
      setTimeout(() => order.push("plain timer"), SHORT_MS)
      const fiber = Effect.runFork(
        Effect.tap(pool.statement<{ v: number }>("select 2 as v", [], SHORT_MS), () => Effect.sync(() => order.push("answer")))
      )
      // The answer arrives while the loop is blocked, and the bound passes meanwhile.
      stall(SHORT_MS * 4)
      expect(yield* Fiber.join(fiber)).toEqual([{ v: 2 }])
      // Control: a plain timer of the same length ran before the answer was read.
      expect(order).toEqual(["plain timer", "answer"])
    }))

  it.scopedLive("a statement past its bound fails with StatementTimeout, its connection destroyed and the next statement on a fresh one", () =>
    Effect.gen(function*() {
      const pool = yield* poolOf(1)
      const first = yield* pidOn(pool)
      const error = yield* Effect.flip(pool.statement("select pg_sleep(30)", [], SHORT_MS))
      expect(error).toBeInstanceOf(Driver.StatementTimeout)
      const second = yield* pidOn(pool)
      expect(second).not.toBe(first)
      expect(pool.size()).toBe(1)
      // The server noticed the closed socket (client_connection_check_interval) and ended the backend.
      yield* eventually(async () => !(await backendAlive(first)))
    }))

  it.scopedLive("interrupting a statement in flight destroys its connection: nobody reads it, so it is never reused", () =>
    Effect.gen(function*() {
      const pool = yield* poolOf(1)
      const first = yield* pidOn(pool)
      // Sent at once on the idle connection, then interrupted while the server sleeps.
      const fiber = Effect.runFork(pool.statement("select pg_sleep(30)", [], BOUND_MS))
      yield* Fiber.interrupt(fiber)
      expect(yield* pidOn(pool)).not.toBe(first)
      yield* eventually(async () => !(await backendAlive(first)))
    }))

  it.scopedLive("statements waiting for a connection get it in arrival order; one that waits past its bound leaves the queue, the busy connection untouched", () =>
    Effect.gen(function*() {
      const pool = yield* poolOf(1)
      const order: Array<string> = []
      const run = (label: string) => Effect.runFork(Effect.tap(pidOn(pool), () => Effect.sync(() => order.push(label))))
      // Takes the only slot (started synchronously, so before the others ask).
      const busy = Effect.runFork(pool.statement<{ pid: number }>("select pg_sleep(0.4), pg_backend_pid() as pid", [], BOUND_MS))
      const first = run("first")
      const impatient = Effect.runFork(pool.statement("select 1", [], SHORT_MS))
      const second = run("second")
      expect(yield* Effect.flip(Fiber.join(impatient))).toBeInstanceOf(Driver.StatementTimeout)
      const busyPid = (yield* Fiber.join(busy))[0]!.pid
      expect(yield* Fiber.join(first)).toBe(busyPid)
      expect(yield* Fiber.join(second)).toBe(busyPid)
      expect(order).toEqual(["first", "second"])
      expect(pool.size()).toBe(1)
    }))

  it.scopedLive("an idle pool sends a lone statement as its batch's statement when the batch is the cheaper one alone (alone), falling back to its own where the batch decides nothing; without alone, as its own", () =>
    Effect.gen(function*() {
      const pool = yield* poolOf(1)
      // The batch decides members whose parameter is "decide" (one row each, idx 1-based), none other.
      const spec = (alone: boolean) => ({
        key: (params: ReadonlyArray<unknown>) => String(params[0]),
        text: "select i::int as idx, 'batch' as sent from unnest($1::text[]) with ordinality as t(v, i) where v = 'decide'",
        max: 8,
        alone,
        encode: (members: ReadonlyArray<ReadonlyArray<unknown>>) => [members.map((p) => p[0])],
        split: (rows: ReadonlyArray<Record<string, unknown>>, members: number) => {
          const own: Array<ReadonlyArray<Record<string, unknown>> | undefined> = new Array(members).fill(undefined)
          for (const row of rows) own[Number(row["idx"]) - 1] = [row]
          return own
        }
      })
      const send = (value: string, alone: boolean) =>
        Effect.async<string, unknown>((resume) => {
          pool.statementNow("select 'own' as sent, $1::text as v", [value], BOUND_MS, (error, rows) =>
            resume(error === undefined ? Effect.succeed(String((rows as ReadonlyArray<{ sent: string }>)[0]!.sent)) : Effect.fail(error)), spec(alone))
        })
      expect(yield* send("decide", true)).toBe("batch")
      expect(yield* send("other", true)).toBe("own")
      expect(yield* send("decide", false)).toBe("own")
      // Only statements standing for two or more count as batches.
      expect(pool.batches()).toBe(0)
    }))

  it.scopedLive("closing the pool fails the statements waiting for a connection, and any later one", () =>
    Effect.gen(function*() {
      const pool = yield* poolOf(1)
      const busy = Effect.runFork(pool.statement("select pg_sleep(0.2)", [], BOUND_MS))
      const waiting = Effect.runFork(pool.statement("select 1", [], BOUND_MS))
      pool.close()
      expect(String(yield* Effect.flip(Fiber.join(waiting)))).toMatch(/closed/)
      yield* Fiber.await(busy)
      expect(pool.size()).toBe(0)
      expect(String(yield* Effect.flip(pool.statement("select 1", [], BOUND_MS)))).toMatch(/closed/)
    }))

  it.scopedLive("a pooled connection whose setup gets no answer is destroyed at the connect timeout and frees its slot", () =>
    Effect.gen(function*() {
      const server = yield* silentServer
      const driver = yield* Driver.load
      const pool = Driver.makePool(driver, {
        host: "127.0.0.1",
        port: server.port,
        user: "nobody",
        database: "nothing",
        connectionTimeoutMillis: 300
      }, 1)
      yield* Effect.addFinalizer(() => Effect.sync(pool.close))
      const started = performance.now()
      const error = yield* Effect.flip(pool.statement("select 1", [], BOUND_MS))
      // The connect timeout, not the statement's much longer bound.
      expect(error).toBeInstanceOf(Driver.StatementTimeout)
      expect(performance.now() - started).toBeLessThan(BOUND_MS / 2)
      expect(pool.size()).toBe(0)
      yield* eventually(async () => server.open() === 0)
    }))

  it.scopedLive("a PgAdvisory session whose setup gets no answer fails the layer at connectTimeout, its socket closed", () =>
    Effect.gen(function*() {
      const server = yield* silentServer
      const started = performance.now()
      const error = yield* Effect.flip(Effect.scoped(Layer.build(PgAdvisory.layer({
        url: `postgres://nobody@127.0.0.1:${server.port}/nothing`,
        connectTimeout: "300 millis"
      }))))
      expect(error).toMatchObject({ _tag: "LockBackendError", operation: "connect" })
      expect(performance.now() - started).toBeLessThan(BOUND_MS / 2)
      yield* eventually(async () => server.open() === 0)
    }))

  it.live("send parameterised statements prepared, and fall back to unnamed ones when the server lost them", () =>
    Effect.gen(function*() {
      const driver = yield* Driver.load
      // One connection, so every statement below runs on the same session.
      const pool = Driver.makePool(driver, { connectionString: db.url }, 1)
      try {
        const prepared = () =>
          pool.statement<{ n: number }>("select count(*)::int as n from pg_prepared_statements where name like 'effect_lock_%'", [], BOUND_MS)
        expect(yield* pool.statement<{ v: number }>("select $1::int as v", [7], BOUND_MS)).toEqual([{ v: 7 }])
        expect(yield* prepared()).toEqual([{ n: 1 }])
        // Gone at the server, still "prepared" for node-pg: the next bind is refused with 26000.
        yield* pool.statement("deallocate all", [], BOUND_MS)
        expect(yield* pool.statement<{ v: number }>("select $1::int as v", [8], BOUND_MS)).toEqual([{ v: 8 }])
        expect(yield* pool.statement<{ v: number }>("select $1::int as v", [9], BOUND_MS)).toEqual([{ v: 9 }])
        // Unnamed from then on: nothing prepared again.
        expect(yield* prepared()).toEqual([{ n: 0 }])
      } finally {
        pool.close()
      }
    }))
})

describe("withXactLock's bound on an @effect/sql-pg connection (destroyIfStillBusy)", () => {
  it.live("destroys a pool connection only in the checkout it was given and only with a statement on the wire", () =>
    Effect.promise(async () => {
      // One connection: every checkout below is of the same client, as a pool hands it on.
      const pool = new pg.Pool({ connectionString: db.url, max: 1 })
      pool.on("error", () => {})
      try {
        const first = await pool.connect()
        const ours = PgDriver.checkoutOf(first)
        // Idle in our checkout: the statement answered, nothing to bound.
        await first.query("select 1")
        expect(PgDriver.destroyIfStillBusy(first, ours)).toBe(false)
        first.release()
        // Handed to another caller, with a statement of theirs on the wire: never destroyed.
        const second = await pool.connect()
        expect(second).toBe(first)
        const theirs = second.query<{ v: number }>("select pg_sleep(0.05), 7 as v")
        expect(PgDriver.destroyIfStillBusy(second, ours)).toBe(false)
        expect((await theirs).rows[0]?.v).toBe(7)
        // In its own checkout with a statement on the wire: destroyed, the statement fails at once.
        const stuck = second.query("select pg_sleep(10)")
        const started = performance.now()
        expect(PgDriver.destroyIfStillBusy(second, PgDriver.checkoutOf(second))).toBe(true)
        await expect(stuck).rejects.toThrow()
        expect(performance.now() - started).toBeLessThan(1_000)
        second.release()
      } finally {
        await pool.end()
      }
    }))
})

/**
 * A blocking wait's fencing bump is bounded at the server (issue 34, point 4). A wait slice sets
 * its own `lock_timeout` for the lock wait, then sets one for the bump; `SET LOCAL lock_timeout TO
 * DEFAULT` was the role's or server's value (0 here: no limit), not the session's, so a bump
 * blocked on the fencing row waited until the client-side bound destroyed the session. Now the
 * bump ends in 55P03 within the slice's bound, the session is proven clean and waits again, and
 * the lock is granted, on the same session, once the row is free.
 */
import { expect, it } from "@effect/vitest"
import { Deferred, Duration, Effect, Fiber } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as PgAdvisory from "effect-lock/PgAdvisory"
import pg from "pg"
import * as engine from "../src/internal/advisory/engine.js"
import * as optionsOf from "../src/internal/advisory/options.js"
import { freshName } from "./support/contract.js"
import { waitFor } from "./support/eventually.js"
import { useTestDatabase, withClient } from "./support/pg.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("pg_advisory_lock_timeout")

const WAITER_APP = "adv-lock-timeout-waiter"

/** The waiter's driver, observed: clients it opened, and the SQLSTATEs its statements failed with. */
let clientsOpened = 0
const failures: Array<string> = []
class ObservedClient extends pg.Client {
  constructor(config?: string | pg.ClientConfig) {
    super(config)
    clientsOpened++
  }
  override query(...args: Array<any>): any {
    const last = args.length - 1
    const callback = args[last]
    if (typeof callback !== "function") return (super.query as any)(...args)
    args[last] = (error: { code?: string } | null, result: unknown) => {
      if (error?.code !== undefined) failures.push(error.code)
      callback(error, result)
    }
    return (super.query as any)(...args)
  }
}
const observedPg = { ...pg, Client: ObservedClient } as unknown as typeof pg

const keyParts = (name: string) => {
  const key = BigInt.asUintN(64, PgAdvisory.keyOf(name))
  return [String(key >> 32n), String(key & 0xffffffffn)]
}

/** Requests of `name` waiting at the server (not granted in pg_locks). */
const waitingAtServer = (name: string) =>
  Effect.promise(() =>
    withClient(db.url, async (client) => {
      const result = await client.query<{ n: number }>(
        `select count(*)::int as n from pg_locks where locktype = 'advisory' and not granted and objsubid = 1
           and classid = $1 and objid = $2 and database = (select oid from pg_database where datname = current_database())`,
        keyParts(name)
      )
      return result.rows[0]!.n
    })
  )

const waiterPids = Effect.promise(() =>
  withClient(db.url, async (client) => {
    const result = await client.query<{ pid: number }>(
      "select pid from pg_stat_activity where datname = current_database() and application_name = $1 order by pid",
      [WAITER_APP]
    )
    return result.rows.map((row) => row.pid)
  })
)

it.scopedLive("a granted wait whose fencing bump is blocked by a row lock ends in 55P03 and waits again on the same session", () =>
  Effect.gen(function*() {
    const holder = yield* DistributedLock.make(yield* PgAdvisory.makeBackend({ url: db.url, applicationName: "adv-lock-timeout-holder" }))
    const waiterOptions = yield* optionsOf.resolve({ url: db.url, applicationName: WAITER_APP })
    const waiter = yield* DistributedLock.make(yield* engine.makeWith(waiterOptions, observedPg))
    const name = freshName("lock-timeout")

    const letGo = yield* Deferred.make<void>()
    const held = yield* Deferred.make<bigint>()
    const holding = yield* Effect.fork(Effect.scoped(Effect.gen(function*() {
      const lease = yield* holder.acquire(name)
      yield* Deferred.succeed(held, lease.token)
      yield* Deferred.await(letGo)
    })))
    const holderToken = yield* Deferred.await(held)
    let grantedAt = 0
    const waiting = yield* Effect.fork(Effect.scoped(Effect.map(waiter.acquire(name), (lease) => {
      grantedAt = Date.now()
      return lease.token
    })))
    // Queued at the server: the waiter's wait session is in a blocking wait slice.
    yield* waitFor("the waiter queues at the server", Effect.map(waitingAtServer(name), (n) => n > 0), Duration.seconds(10))
    const pidsBefore = yield* waiterPids
    const openedBefore = clientsOpened

    // Another transaction holds the fencing row while the lock is handed over: the waiter's slice
    // is granted, and its bump waits for the row. Held until that bump ended in 55P03, at most
    // 6 s: past a whole slice plus the heartbeat timeout (2 s + 1 s), where before the fix the
    // watchdog destroyed the session instead.
    const blocker = yield* Effect.acquireRelease(
      Effect.promise(async () => {
        const client = new pg.Client({ connectionString: db.url })
        await client.connect()
        await client.query("begin")
        await client.query("select 1 from effect_lock_fencing where key = $1 for update", [PgAdvisory.keyOf(name).toString()])
        return client
      }),
      (client) => Effect.promise(() => client.end())
    )
    yield* Deferred.succeed(letGo, undefined)
    yield* Fiber.join(holding)
    yield* waitFor("the blocked bump ends in 55P03", Effect.sync(() => failures.includes("55P03")), Duration.seconds(6))
    const committedAt = Date.now()
    yield* Effect.promise(() => blocker.query("commit"))
    const token = yield* Fiber.join(waiting)

    // The bump ended at the server's lock_timeout, not at the client's bound: 55P03, retried.
    expect(failures.filter((code) => code === "55P03").length).toBeGreaterThan(0)
    // Granted once the row was free, with a larger token (a value the aborted slice drew from the
    // sequence is skipped, never handed out: sequences are not rolled back).
    expect(grantedAt).toBeGreaterThanOrEqual(committedAt)
    expect(token > holderToken).toBe(true)
    // The same sessions throughout: none was destroyed, none opened.
    expect(clientsOpened).toBe(openedBefore)
    expect(yield* waiterPids).toEqual(pidsBefore)
  }), 30_000)

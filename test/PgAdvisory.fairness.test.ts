/**
 * PgAdvisory keeps PostgreSQL's own queue order across processes: a process's local shared
 * holders do not let later shared requests jump a remote exclusive waiter.
 */
import { describe, expect, it } from "@effect/vitest"
import { Context, Deferred, Duration, Effect, Fiber, Layer } from "effect"
import * as DistributedLock from "../src/DistributedLock.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import { useTestDatabase, withClient } from "./support/pg.js"
import { eventually as pollUntil } from "./support/eventually.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("pg_advisory_fairness")

const service = (applicationName: string) =>
  Layer.build(PgAdvisory.layer({ url: db.url, applicationName })).pipe(Effect.map(Context.get(DistributedLock.DistributedLock)))

/** Advisory lock requests of one application at the server: granted and waiting. */
const requestsOf = (applicationName: string) =>
  Effect.promise(() =>
    withClient(db.url, async (client) =>
      (await client.query<{ granted: boolean; mode: string }>(
        `select l.granted, l.mode from pg_locks l join pg_stat_activity a on a.pid = l.pid
         where l.locktype = 'advisory' and a.application_name = $1`,
        [applicationName]
      )).rows
    )
  )

const eventually = <A>(read: Effect.Effect<A>, check: (a: A) => boolean, ms: number, what: string): Effect.Effect<A> =>
  pollUntil(what, read, check, ms)

describe("PgAdvisory shared locks across processes", () => {
  it.scopedLive("a remote exclusive waiter is granted while another process keeps a stream of overlapping shared holders", () =>
    Effect.gen(function*() {
      const a = yield* service("adv-fair-a")
      const b = yield* service("adv-fair-b")
      const name = "fair-shared"
      const stop = yield* Deferred.make<void>()
      let sharedGrants = 0
      // Four holders, each holding 40 ms at a time and asking again at once: at every moment one
      // of them holds the lock, so the process's shared grant would never end by itself.
      const holder = (offset: number) =>
        Effect.gen(function*() {
          yield* Effect.sleep(Duration.millis(offset))
          while (!(yield* Deferred.isDone(stop))) {
            yield* Effect.scoped(
              Effect.zipRight(a.acquire(name, { mode: "shared" }), Effect.sync(() => sharedGrants++)).pipe(
                Effect.zipRight(Effect.sleep(Duration.millis(40)))
              )
            )
          }
        })
      const holders = yield* Effect.forEach([0, 10, 20, 30], (offset) => Effect.fork(holder(offset)))
      yield* eventually(requestsOf("adv-fair-a"), (rows) => rows.some((row) => row.granted), 3_000, "a holds it shared")
      const grantsBefore = sharedGrants

      const askedAt = Date.now()
      const exclusive = yield* Effect.fork(
        Effect.scoped(Effect.map(b.acquire(name, { timeout: "10 seconds" }), () => Date.now() - askedAt))
      )
      const waited = yield* Fiber.join(exclusive)
      // The bound: the shared holders present when the exclusive request queued finish their
      // 40 ms, then the server hands over; 2 s leaves room for a loaded machine. Before the fix
      // the process joined new shared holders to its grant for ever and this timed out.
      expect(waited).toBeLessThan(2_000)
      // The stream went on before and after: shared holders were not starved either.
      yield* eventually(Effect.sync(() => sharedGrants), (n) => n > grantsBefore + 4, 3_000, "shared holders resume")
      yield* Deferred.succeed(stop, undefined)
      yield* Fiber.joinAll(holders)
    }), 30_000)
})

/**
 * DistributedSemaphore on PgAdvisory across OS processes: the bound is checked at the database,
 * from intervals the holders stamp with the server's clock while they hold their permits.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { Context, Duration, Effect, Fiber, Layer } from "effect"
import * as DistributedSemaphore from "../src/DistributedSemaphore.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import { permitKeysOf } from "../src/internal/advisory/permits.js"
import { useTestDatabase, withClient } from "./support/pg.js"
import { type LineWorker, startingWith, startLineWorker } from "./support/workers.js"
import { waitFor } from "./support/eventually.js"

// First, so that its afterAll (leak check, drop) runs after every worker and layer has stopped.
const db = useTestDatabase("pg_advisory_semaphore_process")

const WORKERS = 4
const FIBERS = 2
const ROUNDS = 8
const HOLD_MS = 10
const LIMIT = 3

/** Starts test/fixtures/advisory-semaphore-worker.ts in its own Node process. */
const startWorker = (applicationName: string): LineWorker => startLineWorker("test/fixtures/advisory-semaphore-worker.ts", [db.url, applicationName])

/**
 * Most permits ever inside at once in a run, from the server's stamps: +permits at `entered`,
 * −permits at `left_at`, summed in time order (at equal times leaving counts first, so a
 * hand-over within one microsecond is not mistaken for an overlap).
 */
const mostInside = (runId: string) =>
  withClient(db.url, async (client) =>
    (await client.query<{ most: number; holdings: number }>(
      `select coalesce(max(s), 0)::int as most, (select count(*) from sem_log where run_id = $1)::int as holdings from (
         select sum(d) over (order by t, d rows unbounded preceding) as s from (
           select entered as t, permits as d from sem_log where run_id = $1
           union all select left_at, -permits from sem_log where run_id = $1) as e) as x`,
      [runId]
    )).rows[0]!)

describe("DistributedSemaphore on PgAdvisory across OS processes", () => {
  let workers: ReadonlyArray<LineWorker> = []

  // The workers start once (a Node process with tsx takes seconds on a busy machine) and run each
  // phase together, so that their holdings overlap as much as they can.
  beforeAll(async () => {
    await withClient(db.url, (client) =>
      client.query(
        `create table sem_log (id serial primary key, run_id text not null, worker text not null, fiber int not null,
           permits int not null, entered timestamptz not null, left_at timestamptz)`
      ))
    workers = Array.from({ length: WORKERS }, (_, i) => startWorker(`sem-proc-${i}`))
    await Promise.all(workers.map((w) => w.ready))
  }, 60_000)

  afterAll(async () => {
    await Promise.all(workers.map((w) => w.kill()))
  })

  const runEverywhere = (mode: "sem" | "nosem", runId: string) =>
    Effect.promise(async () => {
      await Promise.all(workers.map((w) => w.command(`run ${mode} ${runId} ${LIMIT} ${FIBERS} ${ROUNDS} ${HOLD_MS}`, startingWith("done"))))
      return mostInside(runId)
    })

  it.live(`never more than ${LIMIT} permits held at once across ${WORKERS} processes × ${FIBERS} fibers, by the server's clock`, () =>
    Effect.gen(function*() {
      const { holdings, most } = yield* runEverywhere("sem", "guarded")
      expect(holdings).toBe(WORKERS * FIBERS * ROUNDS)
      expect(most).toBeLessThanOrEqual(LIMIT)
      // The check could fail: the permits were all in use at some moment.
      expect(most).toBe(LIMIT)
      // Every permit was given back: the workers' sessions hold no advisory lock now.
      const left = yield* Effect.promise(() =>
        withClient(db.url, async (client) =>
          (await client.query<{ n: number }>(
            `select count(*)::int as n from pg_locks l join pg_stat_activity a on a.pid = l.pid
             where l.locktype = 'advisory' and a.application_name like 'sem-proc-%'`
          )).rows[0]!.n)
      )
      expect(left).toBe(0)
    }))

  it.live("the same workload without the semaphore has more inside at once (so the test above can fail)", () =>
    Effect.gen(function*() {
      const { most } = yield* runEverywhere("nosem", "unguarded")
      expect(most).toBeGreaterThan(LIMIT)
    }))

  it.scopedLive("a holder killed with SIGKILL notifies nobody: a waiter in another process still gets its permits within 3 s", () =>
    Effect.gen(function*() {
      const holder = workers[WORKERS - 1]!
      const token = BigInt((yield* Effect.promise(() => holder.command("hold crashed 2 2", startingWith("holding ")))).split(" ")[1]!)
      const semaphore = yield* Layer.build(PgAdvisory.layer({ url: db.url, applicationName: "sem-proc-survivor" })).pipe(
        Effect.map(Context.get(DistributedSemaphore.DistributedSemaphore))
      )
      const waiting = yield* Effect.fork(Effect.scoped(semaphore.acquire("crashed", { limit: 2, permits: 2, timeout: "10 seconds" })))
      // Until the survivor waits registered (its interest key is held): then only a re-try can wake it.
      const interest = BigInt(permitKeysOf("crashed", "").interestKey)
      yield* waitFor("the survivor waits registered", Effect.promise(() => holdsKey("sem-proc-survivor", interest)), Duration.seconds(5))
      const killedAt = Date.now()
      yield* Effect.promise(() => holder.kill())
      const permits = yield* Fiber.join(waiting)
      expect(Date.now() - killedAt).toBeLessThan(3_000)
      expect(permits.tokens[0]).toBeGreaterThan(token)
    }))
})

/** Whether a session of `applicationName` holds the advisory lock `key`. */
const holdsKey = (applicationName: string, key: bigint) =>
  withClient(db.url, async (client) => {
    const unsigned = BigInt.asUintN(64, key)
    const result = await client.query<{ n: number }>(
      `select count(*)::int as n from pg_locks l join pg_stat_activity a on a.pid = l.pid
       where l.locktype = 'advisory' and l.objsubid = 1 and l.granted and a.application_name = $1
         and l.classid = $2::int8::oid and l.objid = $3::int8::oid`,
      [applicationName, (unsigned >> 32n).toString(), (unsigned & 0xffffffffn).toString()]
    )
    return (result.rows[0]?.n ?? 0) > 0
  })

import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { Context, Effect, Fiber, Layer } from "effect"
import * as DistributedLock from "../src/DistributedLock.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import { waitUntil } from "./support/contract.js"
import { advisoryLocks, useTestDatabase, withClient } from "./support/pg.js"
import { type LineWorker, startingWith, startLineWorker } from "./support/workers.js"

// First, so that its afterAll (leak check, drop) runs after every worker and layer has stopped.
const db = useTestDatabase("pg_advisory_process")

const WORKERS = 4
const ITERATIONS = 50
const GAP_MS = 2

/** Starts test/fixtures/advisory-worker.ts in its own Node process. */
const startWorker = (applicationName: string): LineWorker => startLineWorker("test/fixtures/advisory-worker.ts", [db.url, applicationName])

const counter = () =>
  withClient(db.url, async (client) => (await client.query<{ value: number }>("select value from adv_counter where id = 1")).rows[0]!.value)

describe("PgAdvisory across OS processes", () => {
  let workers: ReadonlyArray<LineWorker> = []

  // The workers start once (a Node process with tsx takes seconds on a busy machine) and run
  // every phase together, so that their critical sections overlap as much as they can.
  beforeAll(async () => {
    await withClient(db.url, (client) => client.query("create table adv_counter (id int primary key, value int not null)"))
    workers = Array.from({ length: WORKERS }, (_, i) => startWorker(`adv-proc-${i}`))
    await Promise.all(workers.map((w) => w.ready))
  }, 60_000)

  afterAll(async () => {
    await Promise.all(workers.map((w) => w.kill()))
  })

  const incrementEverywhere = (mode: "lock" | "nolock") =>
    Effect.promise(async () => {
      await withClient(db.url, (client) => client.query("insert into adv_counter values (1, 0) on conflict (id) do update set value = 0"))
      await Promise.all(workers.map((w) => w.command(`run ${mode} ${ITERATIONS} ${GAP_MS}`, startingWith("done"))))
      return counter()
    })

  it.live(`${WORKERS} processes × ${ITERATIONS} read-modify-writes inside withLock end at exactly ${WORKERS * ITERATIONS}`, () =>
    Effect.gen(function*() {
      expect(yield* incrementEverywhere("lock")).toBe(WORKERS * ITERATIONS)
    }))

  it.live("the same workload without the lock loses updates (so the test above can fail)", () =>
    Effect.gen(function*() {
      expect(yield* incrementEverywhere("nolock")).toBeLessThan(WORKERS * ITERATIONS)
    }))

  it.scopedLive("a holder killed with SIGKILL frees the lock for another process within 2 s", () =>
    Effect.gen(function*() {
      const holder = workers[WORKERS - 1]!
      const token = BigInt((yield* Effect.promise(() => holder.command("hold crash-job", startingWith("holding ")))).split(" ")[1]!)
      const lock = yield* Layer.build(PgAdvisory.layer({ url: db.url, applicationName: "adv-proc-survivor" })).pipe(
        Effect.map(Context.get(DistributedLock.DistributedLock))
      )
      const waiting = yield* Effect.fork(lock.acquire("crash-job", { timeout: "10 seconds" }))
      // The survivor's wait is queued at the server before the holder dies.
      yield* waitUntil(
        "live",
        "the survivor's wait is queued in pg_locks",
        Effect.promise(async () => (await advisoryLocks(db.url)).some((row) => !row.granted && row.application_name === "adv-proc-survivor"))
      )
      const killedAt = Date.now()
      yield* Effect.promise(() => holder.kill())
      const lease = yield* Fiber.join(waiting)
      expect(Date.now() - killedAt).toBeLessThan(2_000)
      expect(lease.token).toBeGreaterThan(token)
    }))
})

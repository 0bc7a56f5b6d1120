/**
 * SqliteLease across OS processes on one database file (test/fixtures/sqlite-worker.ts): mutual
 * exclusion under real concurrency, and the takeover of a holder killed with SIGKILL.
 */
import { describe, expect, it } from "@effect/vitest"
import { Duration, Effect, Fiber } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as SqliteLease from "effect-lock/SqliteLease"
import { useSqliteFile } from "./fixtures/sqlite-db.js"
import { freshName } from "./support/contract.js"
import { type LineWorker, startingWith, startLineWorker } from "./support/workers.js"

const file = useSqliteFile("sqlite-process")
const NOW = "cast(round(unixepoch('subsec') * 1000) as integer)"

/** Starts test/fixtures/sqlite-worker.ts on the database file and waits until it is ready. */
const startWorker = async (filename: string): Promise<LineWorker> => {
  const worker = startLineWorker("test/fixtures/sqlite-worker.ts", [filename])
  await worker.ready
  return worker
}

const workers = (n: number) =>
  Effect.acquireRelease(
    Effect.promise(() => Promise.all(Array.from({ length: n }, () => startWorker(file.path)))),
    (all) => Effect.promise(() => Promise.all(all.map((w) => w.kill())))
  )

describe("SqliteLease across processes", () => {
  it.scopedLive("four processes never overlap inside withLock: 4 × 50 read-modify-writes end at exactly 200", () =>
    Effect.gen(function*() {
      file.query("create table if not exists worker_counter (id integer primary key, value integer not null)")
      file.query("insert into worker_counter values (1, 0) on conflict (id) do update set value = 0")
      const all = yield* workers(4)
      const counter = () => Number(file.query<{ value: number }>("select value from worker_counter where id = 1")[0]!.value)
      const phase = (mode: "lock" | "nolock") =>
        Effect.promise(async () => {
          const started = Date.now()
          await Promise.all(all.map((w) => w.command(`run ${mode} 50 3`, startingWith(`done ${mode}`))))
          return Date.now() - started
        })
      const unlockedMs = yield* phase("nolock")
      const withoutLock = counter()
      file.query("update worker_counter set value = 0 where id = 1")
      const lockedMs = yield* phase("lock")
      const withLock = counter()
      console.log(`SqliteLease 4 processes × 50: without lock ${withoutLock} in ${unlockedMs} ms, with lock ${withLock} in ${lockedMs} ms`)
      expect(withoutLock).toBeLessThan(200)
      expect(withLock).toBe(200)
      const codes = yield* Effect.promise(() => Promise.all(all.map((w) => w.exit())))
      expect(codes).toEqual([0, 0, 0, 0])
    }), { timeout: 90_000 })

  it.scopedLive("a holder killed with SIGKILL is taken over once its ttl ran out, with a higher token", () =>
    Effect.gen(function*() {
      const [holder] = yield* workers(1)
      const name = freshName("killed")
      const ttlMs = 1_500
      const acquired = yield* Effect.promise(() => holder!.command(`acquire ${name} ${ttlMs}`, startingWith(`acquired ${name}`)))
      const token = BigInt(acquired.split(" ")[2]!)
      const service = yield* Effect.flatMap(
        SqliteLease.makeBackend({ filename: file.path, pollInterval: Duration.millis(50) }),
        DistributedLock.make
      )
      const waiter = yield* Effect.fork(Effect.map(service.acquire(name), (lease) => ({ token: lease.token, at: performance.now() })))
      yield* Effect.promise(() => holder!.kill())
      const killedAt = performance.now()
      // What the dead holder's lease had left by the database's clock when it died (renewed until then).
      const [row] = file.query<{ left: number }>(`select expires_at - ${NOW} as left from effect_lock_leases where name = ?1`, name)
      const granted = yield* Fiber.join(waiter)
      const after = granted.at - killedAt
      console.log(`SqliteLease: holder killed with ${row!.left} ms of its ${ttlMs} ms lease left; taken over ${after.toFixed(0)} ms after the kill`)
      expect(granted.token > token).toBe(true)
      // Not before the lease ran out in the table, and soon after (a waiter polls every 25–50 ms,
      // and retries when the holder's lease runs out; the margin is for a loaded machine).
      expect(after).toBeGreaterThanOrEqual(row!.left - 20)
      expect(after).toBeLessThan(row!.left + 1_000)
    }).pipe(Effect.scoped), { timeout: 30_000 })
})

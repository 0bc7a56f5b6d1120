/**
 * DistributedSemaphore on SqliteLease, on a real database file: the semaphore contract (each
 * backend built here is one "process" with its own connection and wake-up hub, as a separate OS
 * process would have; waiters of other processes poll), then what only this backend promises:
 * both services from one layer, and a waiter of the releasing process woken at once.
 */
import * as SqliteClient from "@effect/sql-sqlite-node/SqliteClient"
import { describe, expect, it } from "@effect/vitest"
import { Context, Duration, Effect, Exit, Fiber, Layer, Option, Scope } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as DistributedSemaphore from "effect-lock/DistributedSemaphore"
import type { SemaphoreBackend } from "effect-lock/LockBackend"
import * as Make from "effect-lock/internal/lease/sqlite/make"
import * as SqliteLease from "effect-lock/SqliteLease"
import { useSqliteFile } from "./fixtures/sqlite-db.js"
import { freshName, LIVE_CONTRACT_TTL } from "./support/contract.js"
import { semaphoreContractSuite, type StoreState } from "./support/semaphoreContract.js"
import { waitFor } from "./support/eventually.js"
import { laneInFlight } from "./support/laneInFlight.js"

const file = useSqliteFile("sqlite-sem")
const NOW = "cast(round(unixepoch('subsec') * 1000) as integer)"

/** The semaphore `name` as the file has it, by the database's clock: live permits held, live places in order. */
const stateOf = (name: string): StoreState => {
  const exists = file.query<{ n: number }>("select count(*) as n from sqlite_schema where type = 'table' and name = 'effect_lock_leases_sem'")
  if (Number(exists[0]?.n ?? 0) === 0) return { held: 0, waiting: [] }
  const [row] = file.query<{ held: number; waiting: string }>(
    `select
       coalesce((select sum(json_extract(j.value, '$.permits')) from json_each(s.holders) j
         where json_extract(j.value, '$.expires') > ${NOW}), 0) as held,
       (select json_group_array(json_extract(j.value, '$.permits')) from json_each(s.waiters) j
         where json_extract(j.value, '$.expires') > ${NOW}) as waiting
     from effect_lock_leases_sem s where s.name = ?1`,
    name
  )
  return row === undefined ? { held: 0, waiting: [] } : { held: Number(row.held), waiting: (JSON.parse(row.waiting) as Array<number>).map(Number) }
}

/** The contract's processes' statements in flight, by name. */
const { counted, quiet } = laneInFlight()

/** How often each permit request of a name entered a wait (a failed attempt behind it). */
const waits = new Map<string, number>()
const watched = <P extends SqliteLease.SqliteLeasePermitGrant>(store: SemaphoreBackend<P>): SemaphoreBackend<P> => ({
  ...store,
  acquire: (request) =>
    store.acquire({
      ...request,
      waitUntilDeadline: (step) =>
        Effect.zipRight(Effect.sync(() => waits.set(request.name, (waits.get(request.name) ?? 0) + 1)), request.waitUntilDeadline(step))
    })
})

semaphoreContractSuite("SqliteLease", {
  clock: "live",
  ttl: LIVE_CONTRACT_TTL,
  makeBackend: Effect.suspend(() =>
    Effect.map(
      Make.makeBackend({ filename: file.path, ttl: LIVE_CONTRACT_TTL, pollInterval: Duration.millis(20) }, counted),
      (backend) => backend.semaphore
    )
  ),
  state: (name) => Effect.sync(() => stateOf(name)),
  placesLeft: (name) => Effect.sync(() => file.permitPlacesLeft(name)),
  // The earliest live permits' expiry by the database's clock, from the operator's listing.
  permitsExpireAt: (name) =>
    Effect.provide(Effect.map(SqliteLease.semaphores({ name }), (found) => Math.min(...found[0]!.holders.map((h) => h.expiresAt))), SqliteClient.layer({ filename: file.path })),
  revoke: (name) => Effect.asVoid(SqliteLease.revokePermits(name).pipe(Effect.provide(SqliteClient.layer({ filename: file.path })))),
  advance: (duration) => Effect.sleep(duration),
  rounds: 6,
  // A place lasts 5 s and the interruption tests' permits 60 s: a give-back within 2.5 s is one.
  giveBackBound: Duration.millis(2_500),
  quiet
})

describe("SqliteLease semaphores", () => {
  it.scopedLive("SqliteLease.layer provides both services from one backend; a semaphore and a lock of one name are apart", () =>
    Effect.gen(function*() {
      const services = yield* Layer.build(SqliteLease.layer({ filename: file.path, ttl: LIVE_CONTRACT_TTL }))
      const lock = Context.get(services, DistributedLock.DistributedLock)
      const semaphore = Context.get(services, DistributedSemaphore.DistributedSemaphore)
      expect([lock.backend, semaphore.backend]).toEqual(["sqlite-lease", "sqlite-lease"])
      const name = freshName("same-name")
      const lease = yield* lock.acquire(name)
      const permits = yield* semaphore.acquire(name, { limit: 2, permits: 2 })
      // Neither excludes the other; a grant's permits have consecutive tokens.
      expect(permits.tokens).toEqual([permits.tokens[0], permits.tokens[0]! + 1n])
      expect(lease.token > 0n).toBe(true)
      expect(yield* Effect.scoped(lock.tryAcquire(name))).toEqual(Option.none())
      expect(yield* Effect.scoped(semaphore.tryAcquire(name, { limit: 2 }))).toEqual(Option.none())
      const stored = yield* SqliteLease.semaphores({ name }).pipe(Effect.provide(SqliteClient.layer({ filename: file.path })))
      expect(stored).toMatchObject([{ name, limit: 2, holders: [{ permits: 2, tokens: permits.tokens }], waiting: [] }])
      // The migration creates the semaphore table with the others.
      expect(SqliteLease.migration()).toContain(`"effect_lock_leases_sem"`)
    }))

  it.scopedLive("a waiter in the releasing process is woken by the release at once, not by its poll", () =>
    Effect.gen(function*() {
      // A poll interval of 10 s: only the release's own wake-up (or the 1.5 s refresh of a place) makes it look again.
      const backend = yield* Make.makeBackend({ filename: file.path, ttl: Duration.seconds(30), pollInterval: Duration.seconds(10) })
      const service = yield* DistributedSemaphore.make(watched(backend.semaphore))
      const latencies: Array<number> = []
      for (let round = 0; round < 5; round++) {
        const name = freshName("local-wake")
        const holder = yield* Scope.make()
        yield* Scope.extend(service.acquire(name, { limit: 3, permits: 3 }), holder)
        const waiter = yield* Effect.fork(Effect.scoped(Effect.map(service.acquire(name, { limit: 3, permits: 2 }), () => performance.now())))
        yield* waitFor("the waiter in its long wait", Effect.sync(() => (waits.get(name) ?? 0) >= 2 && stateOf(name).waiting.length === 1), Duration.seconds(5))
        const releasedAt = performance.now()
        yield* Scope.close(holder, Exit.void)
        latencies.push((yield* Fiber.join(waiter)) - releasedAt)
      }
      console.log(`SqliteLease semaphore: same-process handoff ${latencies.map((l) => l.toFixed(1)).join(", ")} ms (poll interval 10 s)`)
      for (const latency of latencies) expect(latency).toBeLessThan(300)
    }), { timeout: 30_000 })
})

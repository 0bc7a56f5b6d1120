/**
 * SqliteLease keeps only the rows of names in use (issue 35): tokens come from the file's one
 * counter (`effect_lock_tokens`), so the sweep deletes the rows of idle names, and a name locked
 * again still gets a larger token. Then the rolling upgrade: the previous version's statements
 * (test/fixtures/sqlite-previous.ts, frozen at a6666d2: per-name tokens, rows never deleted) run
 * beside this version on the same file, and no name is ever granted a token not above its last.
 */
import { describe, expect, it } from "@effect/vitest"
import { Duration, Effect, Exit, Fiber, Option, Scope } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as DistributedSemaphore from "effect-lock/DistributedSemaphore"
import type { Lane } from "effect-lock/internal/lease/lane"
import * as Make from "effect-lock/internal/lease/sqlite/make"
import type { AcquireRequest } from "effect-lock/LockBackend"
import * as SqliteLease from "effect-lock/SqliteLease"
import * as Path from "node:path"
import * as Previous from "./fixtures/sqlite-previous.js"
import { openRaw, useSqliteFile } from "./fixtures/sqlite-db.js"
import { freshName, HOLD_THROUGH } from "./support/contract.js"
import { waitFor } from "./support/eventually.js"
import { withRun } from "./support/laneRun.js"

const file = useSqliteFile("sqlite-names")
const TTL = Duration.seconds(2)
const SWEEP = "200 millis"
const NOW = "cast(round(unixepoch('subsec') * 1000) as integer)"

/** Sweep statements answered, by kind, of every backend built here. */
const sweeps = { locks: 0, permits: 0 }
const countSweeps = (lane: Lane): Lane =>
  withRun(lane, <A extends object>(...[operation, name, text, params, bound]: Parameters<Lane["run"]>) =>
    Effect.tap(lane.run<A>(operation, name, text, params, bound), () =>
      Effect.sync(() => {
        if (operation === "sweep") sweeps[text.includes("'sem-sweep'") ? "permits" : "locks"]++
      })))
/** Waits until both kinds have been swept `rounds` more times than now. */
const sweptAgain = (rounds: number) =>
  Effect.suspend(() => {
    const { locks, permits } = sweeps
    return waitFor(
      `${rounds} more sweeps`,
      Effect.sync(() => sweeps.locks >= locks + rounds && sweeps.permits >= permits + rounds),
      Duration.seconds(10)
    )
  })

/** One "process": a backend of its own on `filename` (the test file by default), sweeping every 200 ms. */
const backendOn = (filename?: string, options?: SqliteLease.Options) =>
  Make.makeBackend({ ttl: TTL, pollInterval: Duration.millis(50), sweepInterval: SWEEP, ...options, filename: filename ?? file.path }, countSweeps)
const servicesOn = (filename?: string, options?: SqliteLease.Options) =>
  Effect.gen(function*() {
    const backend = yield* backendOn(filename, options)
    return {
      backend,
      lock: yield* DistributedLock.make(backend),
      semaphore: yield* DistributedSemaphore.make(backend.semaphore)
    }
  })

/** Rows of the names starting with `prefix` in the lease, queue and semaphore tables of `query`'s file. */
const rowsOf = (prefix: string, query: <A>(text: string, ...params: ReadonlyArray<unknown>) => ReadonlyArray<A> = file.query) =>
  Number(
    query<{ n: number }>(
      `select (select count(*) from effect_lock_leases where substr(name, 1, length(?1)) = ?1)
        + (select count(*) from effect_lock_leases_queue where substr(name, 1, length(?1)) = ?1)
        + (select count(*) from effect_lock_leases_sem where substr(name, 1, length(?1)) = ?1) as n`,
      prefix
    )[0]?.n
  )

/** Per name, the last token granted: each new one must be larger (a block of permits: consecutive, the first larger). */
const tokenLog = () => {
  const last = new Map<string, bigint>()
  const grant = (name: string, tokens: ReadonlyArray<bigint>) => {
    expect(tokens.length).toBeGreaterThan(0)
    for (let i = 1; i < tokens.length; i++) expect(tokens[i], `${name}: tokens of one grant are consecutive`).toBe(tokens[i - 1]! + 1n)
    const before = last.get(name)
    if (before !== undefined) expect(tokens[0]! > before, `${name}: token ${tokens[0]} after ${before}`).toBe(true)
    last.set(name, tokens[tokens.length - 1]!)
  }
  return { last, grant }
}

const request = (name: string, mode: "exclusive" | "shared" = "exclusive"): AcquireRequest => ({
  name,
  mode,
  attempt: "once",
  ttl: TTL,
  deadline: Option.none(),
  interruptible: (step) => step,
  waitUntilDeadline: (step) => Effect.map(step, Option.some),
  onLost: () => Effect.void
})

describe("SqliteLease names", () => {
  it.scopedLive("idle names leave no rows once swept, and a name locked again gets a larger token", () =>
    Effect.gen(function*() {
      const { lock, semaphore } = yield* servicesOn()
      const prefix = freshName("idle") + "/"
      const lockLog = tokenLog()
      const semLog = tokenLog()
      const lockNames = Array.from({ length: 200 }, (_, i) => `${prefix}lock-${i}`)
      const semNames = Array.from({ length: 50 }, (_, i) => `${prefix}sem-${i}`)
      // Every fourth lock shared: its holder has a row in the queue table too, until its release.
      yield* Effect.forEach(lockNames, (name, i) =>
        Effect.scoped(Effect.map(lock.acquire(name, { mode: i % 4 === 0 ? "shared" : "exclusive" }), (l) => lockLog.grant(name, [l.token]))), {
        concurrency: 8,
        discard: true
      })
      yield* Effect.forEach(semNames, (name) =>
        Effect.scoped(Effect.map(semaphore.acquire(name, { limit: 3, permits: 2 }), (p) => semLog.grant(name, p.tokens))), {
        concurrency: 8,
        discard: true
      })
      expect(rowsOf(prefix)).toBeGreaterThan(0)
      // Swept within a sweep interval or so (bounded generously for a loaded machine).
      yield* waitFor("no rows left of the idle names", Effect.sync(() => rowsOf(prefix) === 0), Duration.seconds(5))
      // The same names again: each above its last token.
      yield* Effect.forEach(lockNames.filter((_, i) => i % 5 === 0), (name, i) =>
        Effect.scoped(Effect.map(lock.acquire(name, { mode: i % 2 === 0 ? "shared" : "exclusive" }), (l) => lockLog.grant(name, [l.token]))), {
        discard: true
      })
      yield* Effect.forEach(semNames.filter((_, i) => i % 5 === 0), (name) =>
        Effect.scoped(Effect.map(semaphore.acquire(name, { limit: 3, permits: 3 }), (p) => semLog.grant(name, p.tokens))), { discard: true })
      yield* waitFor("no rows left after the second round", Effect.sync(() => rowsOf(prefix) === 0), Duration.seconds(5))
    }), { timeout: 30_000 })

  it.scopedLive("a held name and a waited-for name keep their rows through several sweeps; a dead holder's lease goes once expired", () =>
    Effect.gen(function*() {
      const a = yield* servicesOn()
      const b = yield* servicesOn()
      const prefix = freshName("kept") + "/"
      const [held, waited, sem, semWaited] = ["held", "waited", "sem", "sem-waited"].map((n) => `${prefix}${n}`)
      const scope = yield* Scope.make()
      // Held through several sweeps: long leases, which starved renewals cannot lose meanwhile.
      yield* Scope.extend(a.lock.acquire(held!, { ttl: HOLD_THROUGH }), scope)
      yield* Scope.extend(a.lock.acquire(waited!, { ttl: HOLD_THROUGH }), scope)
      yield* Scope.extend(a.semaphore.acquire(sem!, { limit: 2, permits: 1, ttl: HOLD_THROUGH }), scope)
      yield* Scope.extend(a.semaphore.acquire(semWaited!, { limit: 2, permits: 2, ttl: HOLD_THROUGH }), scope)
      // Waiters of another process: a place in the queue, an entry in `waiters`.
      const lockWaiter = yield* Effect.fork(Effect.scoped(b.lock.acquire(waited!)))
      const semWaiter = yield* Effect.fork(Effect.scoped(b.semaphore.acquire(semWaited!, { limit: 2, permits: 1 })))
      yield* waitFor("the waiters' places", Effect.sync(() => file.livePlaces(waited!) === 1 && semWaiting(semWaited!) === 1), Duration.seconds(5))
      // Dead holders: granted through the backend, never renewed nor released (a process that died).
      const deadTtl = Duration.seconds(3)
      const deadExclusive = `${prefix}dead-exclusive`
      const deadShared = `${prefix}dead-shared`
      const granted = (result: { readonly _tag: string }) => expect(result._tag).toBe("Granted")
      granted(yield* b.backend.acquire({ ...request(deadExclusive), ttl: deadTtl }))
      granted(yield* b.backend.acquire({ ...request(deadShared, "shared"), ttl: deadTtl }))
      const grantedAt = Date.now()

      yield* sweptAgain(4)
      const present = (name: string) =>
        Number(file.query<{ n: number }>(`select count(*) as n from effect_lock_leases where name = ?1`, name)[0]?.n) +
        Number(file.query<{ n: number }>(`select count(*) as n from effect_lock_leases_sem where name = ?1`, name)[0]?.n)
      expect([held, waited, sem, semWaited].map((n) => present(n!))).toEqual([1, 1, 1, 1])
      expect(file.livePlaces(waited!)).toBe(1)
      expect(semWaiting(semWaited!)).toBe(1)
      // Not yet expired (3 s), so still there: the dead holders' rows (and the shared one's queue row).
      if (Date.now() - grantedAt < 2_500) {
        expect([present(deadExclusive), present(deadShared), queueRows(deadShared)]).toEqual([1, 1, 1])
      }
      // Once expired, swept: the lease rows and the shared holder's queue row.
      yield* waitFor(
        "the dead holders' rows swept",
        Effect.sync(() => present(deadExclusive) + present(deadShared) + queueRows(deadShared) === 0),
        Duration.seconds(8)
      )
      expect(Date.now() - grantedAt).toBeGreaterThanOrEqual(Duration.toMillis(deadTtl) - 100)
      // The live ones are still there.
      expect([held, waited, sem, semWaited].map((n) => present(n!))).toEqual([1, 1, 1, 1])
      // A new holder of the dead one's name: a larger token than it had.
      const again = yield* Effect.scoped(Effect.map(a.lock.acquire(deadExclusive), (l) => l.token))
      expect(again > 0n).toBe(true)
      yield* Scope.close(scope, Exit.void)
      yield* Fiber.join(lockWaiter)
      yield* Fiber.join(semWaiter)
      yield* waitFor("every row of the test swept", Effect.sync(() => rowsOf(prefix) === 0), Duration.seconds(5))
    }), { timeout: 40_000 })

  it.scopedLive("tokens strictly increase per name across sweeps: exclusive, shared and permits (consecutive within a grant)", () =>
    Effect.gen(function*() {
      const a = yield* servicesOn()
      const b = yield* servicesOn(undefined, { sweepInterval: 0 })
      const prefix = freshName("rounds") + "/"
      const names = Array.from({ length: 10 }, (_, i) => `${prefix}${i}`)
      const locks = tokenLog()
      const permits = tokenLog()
      for (let round = 0; round < 4; round++) {
        for (const [i, name] of names.entries()) {
          const p = (i + round) % 2 === 0 ? a : b
          const q = p === a ? b : a
          locks.grant(name, [yield* Effect.scoped(Effect.map(p.lock.acquire(name), (l) => l.token))])
          // Two shared holders at once (one per process): distinct tokens, both above the last.
          const shared = yield* Effect.scoped(Effect.gen(function*() {
            const first = yield* p.lock.acquire(name, { mode: "shared" })
            const second = yield* q.lock.acquire(name, { mode: "shared" })
            return [first.token, second.token]
          }))
          locks.grant(name, [shared[0]!])
          locks.grant(name, [shared[1]!])
          permits.grant(name, yield* Effect.scoped(Effect.map(q.semaphore.acquire(name, { limit: 4, permits: 1 + ((i + round) % 4) }), (g) => g.tokens)))
          permits.grant(name, yield* Effect.scoped(Effect.map(p.semaphore.acquire(name, { limit: 4, permits: 2 }), (g) => g.tokens)))
        }
        // A sweep between rounds: every row of these names gone before the next.
        yield* waitFor(`round ${round}: rows swept`, Effect.sync(() => rowsOf(prefix) === 0), Duration.seconds(5))
      }
      expect(locks.last.size).toBe(10)
      expect(permits.last.size).toBe(10)
    }), { timeout: 60_000 })
})

describe("SqliteLease beside the previous version on one file (rolling upgrade)", () => {
  it.scopedLive("every name's tokens increase: old grants on rows still there go on, old grants of swept names are refused", () =>
    Effect.gen(function*() {
      const path = Path.join(file.dir, "upgrade.db")
      // The previous version's process: its own connection, its statements (frozen), parameters as its dialect bound them.
      const raw = openRaw(path)
      yield* Effect.addFinalizer(() => Effect.sync(() => raw.close()))
      const query = <A>(text: string, ...params: ReadonlyArray<unknown>): ReadonlyArray<A> => {
        const statement = raw.prepare(text)
        const bound = params.length === 0 ? [] : [Object.fromEntries(params.map((p, i) => [String(i + 1), p]))]
        return (statement.reader ? statement.all(...bound) : (statement.run(...bound), [])) as ReadonlyArray<A>
      }
      for (const statement of Previous.createTable) raw.exec(statement)
      // A file the previous version wrote: per-name tokens up to 10^6.
      const names = Array.from({ length: 20 }, (_, i) => `up-${i}`)
      const locks = tokenLog()
      const permits = tokenLog()
      names.forEach((name, i) => {
        query(`insert into effect_lock_leases (name, token) values (?1, ?2)`, name, 1_000_000 - i)
        query(`insert into effect_lock_leases_sem (name, permit_limit, token) values (?1, 2, ?2)`, name, 1_000_000 - i)
        locks.last.set(name, BigInt(1_000_000 - i))
        permits.last.set(name, BigInt(1_000_000 - i))
      })
      const count = (text: string, name: string) => Number(query<{ n: number }>(text, name)[0]?.n ?? 0)
      const lockRow = (name: string) => count(`select count(*) as n from effect_lock_leases where name = ?1`, name) > 0
      const semRow = (name: string) => count(`select count(*) as n from effect_lock_leases_sem where name = ?1`, name) > 0
      const outcomes = { granted: 0, refused: 0 }
      let ids = 0
      /** One old-version grant and release; refused (an error) exactly when the name has no row. */
      const oldLock = (name: string) => {
        const owner = `old-${ids++}`
        const hadRow = lockRow(name)
        try {
          const [row] = query<{ token: string | null }>(Previous.acquire, name, owner, `w-${owner}`, "exclusive", 2_000, 5_000, "old", "host", 1, 0)
          expect(row?.token, `old grant of ${name}`).toEqual(expect.any(String))
          locks.grant(name, [BigInt(row!.token!)])
          outcomes.granted++
          query(Previous.release, name, owner, `w-${owner}`)
          expect(hadRow, `old grant of ${name} without a row`).toBe(true)
        } catch (error) {
          expect(String(error)).toMatch(/older effect-lock version/)
          expect(hadRow, `old grant of ${name} with a row refused`).toBe(false)
          outcomes.refused++
        }
      }
      const oldPermits = (name: string, permits_: number) => {
        const owner = `old-${ids++}`
        const hadRow = semRow(name)
        try {
          const [row] = query<{ token: string | null }>(
            Previous.permitAcquire, name, owner, `w-${owner}`, 2, permits_, 2_000, 5_000, "old", "host", 1, 0)
          expect(row?.token, `old permits of ${name}`).toEqual(expect.any(String))
          const first = BigInt(row!.token!)
          permits.grant(name, Array.from({ length: permits_ }, (_, k) => first + BigInt(k)))
          outcomes.granted++
          query(Previous.permitRelease, name, owner, null)
          expect(hadRow, `old permits of ${name} without a row`).toBe(true)
        } catch (error) {
          expect(String(error)).toMatch(/older effect-lock version/)
          expect(hadRow, `old permits of ${name} with a row refused`).toBe(false)
          outcomes.refused++
        }
      }
      const left = () => rowsOf("up-", query)

      // The previous version alone first.
      for (const name of names) oldLock(name)
      for (const name of names) oldPermits(name, 1)
      // The new version joins: its layer raises the counter to the file's tokens.
      const fresh = yield* servicesOn(path)
      const counter = () => Number(query<{ value: number }>(`select value from effect_lock_tokens where id = 1`)[0]?.value)
      expect(counter()).toBeGreaterThanOrEqual(1_000_001)
      const newLock = (name: string, mode: "exclusive" | "shared") =>
        Effect.scoped(Effect.map(fresh.lock.acquire(name, { mode }), (l) => locks.grant(name, [l.token])))
      const newPermits = (name: string, n: number) =>
        Effect.scoped(Effect.map(fresh.semaphore.acquire(name, { limit: 2, permits: n }), (g) => permits.grant(name, g.tokens)))

      for (let round = 0; round < 4; round++) {
        for (const [i, name] of names.entries()) {
          // Old first (round 0: the rows are there; later: swept, so refused), then interleaved.
          oldLock(name)
          oldPermits(name, 1 + (i % 2))
          yield* newLock(name, i % 2 === 0 ? "exclusive" : "shared")
          yield* newPermits(name, 1 + ((i + round) % 2))
          oldLock(name)
          oldPermits(name, 2)
          yield* newLock(name, "exclusive")
          if (round === 1 && i === 0) {
            // An old process restarting: its creation statements change nothing of this version's.
            for (const statement of Previous.createTable) raw.exec(statement)
          }
        }
        // Sweeps in between: every row of these names goes.
        yield* waitFor(`round ${round}: rows swept`, Effect.sync(() => left() === 0), Duration.seconds(5))
        if (round === 2) {
          // An old waiting request makes a row of a swept name (its token would be 0): it starts at the counter,
          // so its later old grants are above every token the name had.
          const waiter = `old-${ids++}`
          query(Previous.permitAcquire, names[3]!, waiter, waiter, 2, 3, 2_000, 5_000, "old", "host", 1, 1)
          expect(Number(query<{ token: number }>(`select token from effect_lock_leases_sem where name = ?1`, names[3]!)[0]?.token))
            .toBeGreaterThanOrEqual(Number(permits.last.get(names[3]!)))
          query(Previous.permitRelease, names[3]!, null, waiter)
          oldPermits(names[3]!, 2)
          yield* newPermits(names[3]!, 1)
        }
      }
      // Both kinds of old outcome were met: grants on rows still there, refusals of swept names.
      expect(outcomes.granted).toBeGreaterThan(names.length * 2)
      // Rounds 1-3 begin with every name swept (bar the one the waiting request brought back).
      expect(outcomes.refused).toBeGreaterThanOrEqual(names.length * 2 * 3 - 1)
      yield* waitFor("rows swept at the end", Effect.sync(() => left() === 0), Duration.seconds(5))
    }), { timeout: 60_000 })
})

const semWaiting = (name: string) =>
  Number(
    file.query<{ n: number }>(
      `select count(*) as n from effect_lock_leases_sem s, json_each(s.waiters) j where s.name = ?1 and json_extract(j.value, '$.expires') > ${NOW}`,
      name
    )[0]?.n ?? 0
  )
const queueRows = (name: string) =>
  Number(file.query<{ n: number }>(`select count(*) as n from effect_lock_leases_queue where name = ?1`, name)[0]?.n ?? 0)

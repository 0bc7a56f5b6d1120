/**
 * Issue 35 on PostgreSQL: one token sequence per database, and no row kept for an idle name.
 *
 * - PgLease and PgAdvisory sweep the rows of names nobody holds or waits for (lease, queue,
 *   semaphore and fencing tables) within their sweep interval, keep the rows of held and waited
 *   names (which the operator functions still list), and every name's next grant still gets a
 *   larger token;
 * - a grant between its draw and its insert keeps its name's row from the sweep (the guard);
 * - a rolling upgrade: the previous version's statements (frozen, `fixtures/pg-previous.ts`),
 *   which count tokens per name, run beside the new layers on tables whose per-name tokens reach
 *   10⁶, with sweeps in between: no name is ever granted a token not larger than its last;
 * - tokens stay larger after an immediate-mode stop of the server (a crash: WAL replay).
 */
import { PgClient } from "@effect/sql-pg"
import { afterAll, describe, expect, it } from "@effect/vitest"
import { Context, Duration, Effect, Exit, Fiber, Layer, Option, Redacted, Scope } from "effect"
import pg from "pg"
import * as DistributedLock from "../src/DistributedLock.js"
import * as DistributedSemaphore from "../src/DistributedSemaphore.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import * as PgLease from "../src/PgLease.js"
import * as LeaseSql from "../src/internal/lease/pg/sql.js"
import * as Tokens from "../src/internal/sql/tokens.js"
import { startEmbedded } from "../tools/embeddedPostgres.js"
import * as Previous from "./fixtures/pg-previous.js"
import { eventually, waitFor } from "./support/eventually.js"
import { useTestDatabase, withClient } from "./support/pg.js"
import { seededRandom, testSeed } from "./support/random.js"

const db = useTestDatabase("pg_tokens")
const SWEEP = Duration.millis(200)
/** An idle name's rows must be gone within this (the sweep's interval, several times over). */
const SWEPT_WITHIN = Duration.seconds(5)
/**
 * The kept names' waiters wait through the whole case (hundreds of grants and several sweeps), so
 * their bound is the case's own less a margin: a shorter one ran out on a loaded CI host.
 */
const WAITER_BOUND = Duration.seconds(50)

const query = <R extends pg.QueryResultRow>(text: string, values: ReadonlyArray<unknown> = [], url = db.url) =>
  Effect.promise(() => withClient(url, (client) => client.query<R>(text, [...values]).then((r) => r.rows)))

const count = (table: string, where: string, values: ReadonlyArray<unknown> = [], url = db.url) =>
  Effect.map(query<{ n: string }>(`select count(*)::text as n from ${table} where ${where}`, values, url), ([row]) => Number(row!.n))

/** Every name's next grant is larger than its first (a lock's token; a semaphore's 2 permits, consecutive, past the first grant's). */
const expectLargerNext = (
  lock: DistributedLock.Service,
  semaphore: DistributedSemaphore.Service,
  first: ReadonlyMap<string, bigint>,
  firstPermits: ReadonlyMap<string, ReadonlyArray<bigint>>
) =>
  Effect.gen(function*() {
    for (const [name, token] of first) {
      const next = yield* Effect.scoped(Effect.map(lock.acquire(name), (lease) => lease.token))
      expect(next > token).toBe(true)
    }
    for (const [name, tokens] of firstPermits) {
      const next = yield* Effect.scoped(Effect.map(semaphore.acquire(`sem-${name}`, { limit: 3, permits: 2 }), (p) => p.tokens))
      expect(next[0]! > tokens[1]!).toBe(true)
      expect(next[1]).toBe(next[0]! + 1n)
    }
  })

/** Until `check`'s value satisfies `ok`, bounded. */
const until = <A>(what: string, check: Effect.Effect<A>, ok: (a: A) => boolean, bound: Duration.DurationInput) =>
  waitFor(what, Effect.map(check, ok), bound)

/** PgLease's services on a pool of their own (as another process), on `url`. */
const leaseOn = (options: PgLease.Options, url = db.url) =>
  Effect.gen(function*() {
    const sql = yield* Layer.build(PgClient.layer({ url: Redacted.make(url), maxConnections: 4, applicationName: "pg-tokens" }))
    return yield* Layer.build(Layer.provide(PgLease.layer({ ttl: Duration.seconds(3), sweepInterval: SWEEP, ...options }), Layer.succeedContext(sql)))
  })

const advisoryOn = (options: Omit<PgAdvisory.Options, "url">, url = db.url) =>
  Layer.build(PgAdvisory.layer({ url, applicationName: "pg-tokens", sweepInterval: SWEEP, ...options }))

const lockOf = (services: Context.Context<DistributedLock.DistributedLock>) => Context.get(services, DistributedLock.DistributedLock)
const semaphoreOf = (services: Context.Context<DistributedSemaphore.DistributedSemaphore>) =>
  Context.get(services, DistributedSemaphore.DistributedSemaphore)

/** The last token each name got; fails the test when a name gets one not larger. */
const tokenBook = () => {
  const last = new Map<string, bigint>()
  return {
    record: (name: string, token: bigint, who: string) => {
      const before = last.get(name)
      if (before !== undefined && token <= before) throw new Error(`${name}: ${who} granted ${token}, not above its last token ${before}`)
      last.set(name, token)
    },
    last: (name: string) => last.get(name)
  }
}

// Side by side: each test has tables (and advisory names) of its own, and mostly waits for sweeps.
describe.concurrent("PostgreSQL: one token sequence, no row for an idle name", () => {
  it.scopedLive("PgLease: idle names leave no row (lease, queue, semaphore tables); held and waited names keep theirs; next grants get larger tokens", () =>
    Effect.gen(function*() {
      const table = "pg_tokens_idle"
      const services = yield* leaseOn({ table })
      const lock = lockOf(services)
      const semaphore = semaphoreOf(services)
      const names = Array.from({ length: 300 }, (_, i) => `idle-${i}`)
      const first = new Map<string, bigint>()
      yield* Effect.forEach(names, (name) =>
        Effect.scoped(Effect.map(lock.acquire(name), (lease) => first.set(name, lease.token))), { concurrency: 16, discard: true })
      const firstPermits = new Map<string, ReadonlyArray<bigint>>()
      yield* Effect.forEach(names.slice(0, 100), (name) =>
        Effect.scoped(Effect.map(semaphore.acquire(`sem-${name}`, { limit: 3, permits: 2 }), (p) => firstPermits.set(name, p.tokens))), {
        concurrency: 16,
        discard: true
      })
      // One held name, and one waiter on it (its place is a queue row). A long lease: the case is
      // about the sweep, and a 3 s lease's renewals starved on a loaded host (a CI run) lost it.
      const holder = yield* Scope.make()
      const held = yield* Scope.extend(lock.acquire("kept-held", { ttl: Duration.seconds(60) }), holder)
      const waiter = yield* Effect.fork(Effect.scoped(lock.acquire("kept-held", { timeout: WAITER_BOUND })))
      yield* until(
        "the waiter's place",
        count(`${table}_queue`, "name = 'kept-held' and token is null"),
        (n) => n === 1,
        Duration.seconds(5)
      )

      yield* until(
        "every idle name's rows swept",
        Effect.all([
          count(table, "name like 'idle-%'"),
          count(`${table}_sem`, "name like 'sem-idle-%'"),
          count(`${table}_queue`, "name like 'idle-%' or name like 'sem-idle-%'")
        ]),
        (rows) => rows.every((n) => n === 0),
        SWEPT_WITHIN
      )
      // Three more sweeps, each seen deleting a probe name's row: the held name and its waiter stay, and are listed.
      for (let i = 0; i < 3; i++) {
        yield* Effect.scoped(lock.acquire(`probe-${i}`))
        yield* until(`a sweep deleting probe-${i}`, count(table, "name = $1", [`probe-${i}`]), (n) => n === 0, SWEPT_WITHIN)
        expect(yield* count(table, "name = 'kept-held'")).toBe(1)
        expect(yield* count(`${table}_queue`, "name = 'kept-held' and token is null")).toBe(1)
      }
      const sqlEnv = yield* Layer.build(PgClient.layer({ url: Redacted.make(db.url) }))
      const listed = yield* Effect.provide(PgLease.holders({ table }), sqlEnv)
      expect(listed.map((l) => l.name)).toEqual(["kept-held"])
      // Listed with its waiter. Bounded, not at once: a place is refreshed only below half of its
      // 5 s, so a waiter whose retry a loaded host held back about a second lets it lapse until
      // its next retry takes it again (a CI run read null here once).
      yield* until(
        "the held name listed with a live waiter",
        Effect.orDie(Effect.provide(PgLease.holders({ table }), sqlEnv)),
        (again) => again.length === 1 && again[0]!.waitingSince !== null,
        Duration.seconds(5)
      )

      // Every idle name's next grant is larger than its first, though its row was deleted.
      yield* expectLargerNext(lock, semaphore, first, firstPermits)
      yield* Scope.close(holder, Exit.void)
      expect(Exit.isSuccess(yield* Fiber.await(waiter))).toBe(true)
      expect(held.token > 0n).toBe(true)
    }), { timeout: 60_000 })

  it.scopedLive("PgAdvisory: idle lock and semaphore names leave no fencing row; held and waited ones keep theirs; next grants get larger tokens", () =>
    Effect.gen(function*() {
      const fencingTable = "pg_tokens_fencing"
      const services = yield* advisoryOn({ fencingTable, maxSessions: 2 })
      const other = yield* advisoryOn({ fencingTable, maxSessions: 2, sweepInterval: 0 })
      const lock = lockOf(services)
      const names = Array.from({ length: 300 }, (_, i) => `idle-${i}`)
      const first = new Map<string, bigint>()
      yield* Effect.forEach(names, (name) =>
        Effect.scoped(Effect.map(lock.acquire(name), (lease) => first.set(name, lease.token))), { concurrency: 16, discard: true })
      const holder = yield* Scope.make()
      yield* Scope.extend(lock.acquire("kept-held"), holder)
      // Another process's waiter: it waits at the server (a pg_locks entry, not granted).
      const waiter = yield* Effect.fork(Effect.scoped(lockOf(other).acquire("kept-held", { timeout: WAITER_BOUND })))
      yield* until(
        "the other process waiting at the server",
        count("pg_locks", "locktype = 'advisory' and not granted"),
        (n) => n >= 1,
        Duration.seconds(5)
      )
      // Semaphores: 100 names taken once (2 of 3 permits), one held, one with a waiter.
      const semaphore = semaphoreOf(services)
      const firstPermits = new Map<string, ReadonlyArray<bigint>>()
      yield* Effect.forEach(names.slice(0, 100), (name) =>
        Effect.scoped(Effect.map(semaphore.acquire(`sem-${name}`, { limit: 3, permits: 2 }), (p) => firstPermits.set(name, p.tokens))), {
        concurrency: 16,
        discard: true
      })
      yield* Scope.extend(semaphore.acquire("sem-kept-held", { limit: 3, permits: 2 }), holder)
      yield* Scope.extend(semaphore.acquire("sem-kept-waited", { limit: 1 }), holder)
      const semWaiter = yield* Effect.fork(Effect.scoped(semaphoreOf(other).acquire("sem-kept-waited", { limit: 1, timeout: WAITER_BOUND })))
      yield* until("the semaphore waiter queued", count(fencingTable, "name = 'sem-kept-waited' and permit_queue is not null"), (n) => n === 1, Duration.seconds(5))

      yield* until("every idle name's fencing row swept", count(fencingTable, "name like 'idle-%' or name like 'sem-idle-%'"), (n) => n === 0, SWEPT_WITHIN)
      // Another sweep later (a probe name's row seen going): the held and waited names keep their rows.
      yield* Effect.scoped(lock.acquire("probe"))
      yield* until("a sweep deleting the probe's row", count(fencingTable, "name = 'probe'"), (n) => n === 0, SWEPT_WITHIN)
      expect(yield* count(fencingTable, "name in ('kept-held', 'sem-kept-held', 'sem-kept-waited')")).toBe(3)
      yield* expectLargerNext(lock, semaphore, first, firstPermits)
      yield* Scope.close(holder, Exit.void)
      expect(Exit.isSuccess(yield* Fiber.await(waiter))).toBe(true)
      expect(Exit.isSuccess(yield* Fiber.await(semWaiter))).toBe(true)
    }), { timeout: 60_000 })

  it.scopedLive("first use by 8 layers at once, while the first ones already grant: the token sequence's install neither deadlocks nor fails a grant", () =>
    Effect.gen(function*() {
      // Each round a fresh table: the layers that finish their install first grant (lease table,
      // then sequence) while the others install (the same two locks): before the install took the
      // table's lock first, they deadlocked and the create-table statement ran out of its bound.
      for (let round = 0; round < 3; round++) {
        const table = `pg_tokens_first_use_${round}`
        const locks = yield* Effect.forEach(Array.from({ length: 8 }), () => Effect.map(leaseOn({ table, sweepInterval: 0 }), lockOf), {
          concurrency: "unbounded"
        })
        const failures: Array<unknown> = []
        yield* Effect.forEach(locks, (lock, i) =>
          Effect.forEach(Array.from({ length: 10 }), () =>
            Effect.scoped(lock.acquire(`first-use-${i % 2}`, { timeout: Duration.seconds(10) })).pipe(
              Effect.catchAll((error) => Effect.sync(() => failures.push(error)))
            ), { discard: true }), { concurrency: "unbounded", discard: true })
        expect(failures).toEqual([])
      }
    }), { timeout: 60_000 })

  it.scopedLive("the sweep skips a name whose grant is between its token's draw and its insert (the guard), and deletes it after", () =>
    Effect.gen(function*() {
      const table = "pg_tokens_guard"
      const tables = LeaseSql.parseTables(table)
      if (typeof tables === "string") throw new Error(tables)
      const lock = lockOf(yield* leaseOn({ table, sweepInterval: 0 }))
      yield* Effect.scoped(lock.acquire("drawing"))
      yield* Effect.scoped(lock.acquire("idle"))
      const client = new pg.Client({ connectionString: db.url })
      yield* Effect.acquireRelease(Effect.promise(() => client.connect()), () => Effect.promise(() => client.end()))
      // A grant of "drawing" paused right after its draw: it holds the name's guard (shared).
      yield* Effect.promise(() => client.query("begin"))
      yield* Effect.promise(() => client.query(`select ${Tokens.holdGuard(Tokens.sweepGuardNamespace(tables.leases), "$1::text")}`, ["drawing"]))
      yield* Effect.promise(() => client.query(`select ${Tokens.draw(Tokens.tokenSequence(tables.leases))}`))
      const [{ swept }] = yield* query<{ swept: number }>(LeaseSql.sweep(tables), [1_000])
      expect(swept).toBe(1)
      expect(yield* count(table, "name = 'drawing'")).toBe(1)
      expect(yield* count(table, "name = 'idle'")).toBe(0)
      yield* Effect.promise(() => client.query("commit"))
      const [again] = yield* query<{ swept: number }>(LeaseSql.sweep(tables), [1_000])
      expect(again!.swept).toBe(1)
      expect(yield* count(table, "true")).toBe(0)
    }))

  it.scopedLive("rolling upgrade: the previous version's per-name counters (up to 10⁶) beside the new layers, with sweeps: every name's tokens strictly increase", () =>
    Effect.gen(function*() {
      const seed = testSeed()
      console.log(`rolling upgrade: EFFECT_LOCK_TEST_SEED=${seed}`)
      const random = seededRandom(seed)
      const names = Array.from({ length: 40 }, (_, i) => `up-${i}`)
      const book = tokenBook()
      // The tables as the previous version left them: per-name tokens up to 10⁶.
      yield* query(Previous.createLease)
      yield* query(Previous.fencingTable)
      for (const [i, name] of names.entries()) {
        const token = 1_000_000 - i * 1_000
        yield* query(`insert into pg_upgrade_leases (name, token) values ($1, $2)`, [name, token])
        yield* query(`insert into pg_upgrade_fencing (key, name, token) values ($1, $2, $3)`, [PgAdvisory.keyOf(name).toString(), name, token])
        book.record(`lease:${name}`, BigInt(token), "the previous version")
        book.record(`fencing:${name}`, BigInt(token), "the previous version")
      }
      const lease = lockOf(yield* leaseOn({ table: "pg_upgrade_leases", ttl: Duration.seconds(2) }))
      const advisory = lockOf(yield* advisoryOn({ fencingTable: "pg_upgrade_fencing", maxSessions: 2 }))
      const old = new pg.Client({ connectionString: db.url })
      yield* Effect.acquireRelease(Effect.promise(() => old.connect()), () => Effect.promise(() => old.end()))

      // Grants of the previous version on a name whose row the sweep had deleted: its insert of
      // token 1 is the case the trigger exists for.
      let oldOnSwept = 0
      const oldLease = (name: string) =>
        Effect.promise(async () => {
          const { rows: [row] } = await old.query<{ n: string }>("select count(*)::text as n from pg_upgrade_leases where name = $1", [name])
          const owner = crypto.randomUUID()
          const { rows } = await old.query<{ token: string | null }>(Previous.leaseAcquire, [
            name, owner, crypto.randomUUID(), "exclusive", 2_000, 10_000, "previous", "host", 1, false
          ])
          const token = rows[0]?.token ?? null
          if (token !== null && row!.n === "0") oldOnSwept++
          if (token !== null) await old.query(Previous.leaseRelease, [name, owner, null, "pg_upgrade_leases"])
          return token === null ? undefined : BigInt(token)
        })
      const oldAdvisory = (name: string) =>
        Effect.promise(async () => {
          const key = PgAdvisory.keyOf(name).toString()
          const { rows: [row] } = await old.query<{ n: string }>("select count(*)::text as n from pg_upgrade_fencing where key = $1", [key])
          const { rows } = await old.query<{ key: string | null; token: string | null }>(Previous.advisoryTry, [[key], [name], [false]])
          const granted = rows.find((row) => row.key === key)
          if (granted !== undefined && row!.n === "0") oldOnSwept++
          if (granted !== undefined) await old.query("select pg_advisory_unlock($1::bigint)", [key])
          return granted === undefined ? undefined : BigInt(granted.token!)
        })

      // First use of each new layer installs the sequence above every token in its table: only then can a row go.
      book.record("lease:up-0", yield* Effect.scoped(Effect.map(lease.acquire("up-0"), (l) => l.token)), "PgLease")
      book.record("fencing:up-0", yield* Effect.scoped(Effect.map(advisory.acquire("up-0"), (l) => l.token)), "PgAdvisory")
      let oldGrants = 0
      let round = 0
      const deadline = Date.now() + 2_500
      // Bounded: on a loaded machine 2.5 s held 20 grants of the previous version, not the 21 below.
      const cap = Date.now() + 15_000
      const enough = () => oldGrants > 20 && oldOnSwept > 0
      // Past about a dozen sweeps (every 200 ms): names go idle, are swept, and are granted again by
      // either version; on until the previous version made enough grants, at most 15 s.
      while (Date.now() < deadline || (!enough() && Date.now() < cap)) {
        const name = names[Math.floor(random() * names.length)]!
        const useOld = random() < 0.5
        if (random() < 0.5) {
          const token = useOld ? yield* oldLease(name) : yield* Effect.scoped(Effect.map(lease.tryAcquire(name), Option.map((l) => l.token)).pipe(Effect.map(Option.getOrUndefined)))
          if (token !== undefined) book.record(`lease:${name}`, token, useOld ? "the previous version" : "PgLease")
          if (useOld && token !== undefined) oldGrants++
        } else {
          const token = useOld ? yield* oldAdvisory(name) : yield* Effect.scoped(Effect.map(advisory.tryAcquire(name), Option.map((l) => l.token)).pipe(Effect.map(Option.getOrUndefined)))
          if (token !== undefined) book.record(`fencing:${name}`, token, useOld ? "the previous version" : "PgAdvisory")
          if (useOld && token !== undefined) oldGrants++
        }
        if (++round % 20 === 1) {
          // The trigger's case made to happen: a name whose row was swept (observed, bounded), then
          // the previous version grants on it. Any name of the 40: one the previous version bumped
          // past the sequence keeps its row until the sequence passes it, and waiting stops the draws.
          const onLease = random() < 0.5
          const found = yield* eventually(
            "a name's row swept",
            onLease
              ? query<{ name: string | null }>(
                "select (select n from unnest($1::text[]) n where not exists (select 1 from pg_upgrade_leases l where l.name = n) limit 1) as name",
                [names]
              )
              : query<{ name: string | null }>(
                "select (select n from unnest($1::text[], $2::text[]) u(n, k) where not exists (select 1 from pg_upgrade_fencing f where f.key = k::bigint) limit 1) as name",
                [names, names.map((n) => PgAdvisory.keyOf(n).toString())]
              ),
            ([row]) => row!.name !== null,
            Duration.toMillis(SWEPT_WITHIN)
          )
          const swept = found[0]!.name!
          const token = onLease ? yield* oldLease(swept) : yield* oldAdvisory(swept)
          if (token !== undefined) book.record(`${onLease ? "lease" : "fencing"}:${swept}`, token, "the previous version")
          if (token !== undefined) oldGrants++
        }
      }
      expect(oldGrants).toBeGreaterThan(20)
      // The sweeps deleted rows that the previous version then made anew (its inserts drew from the sequence).
      expect(oldOnSwept).toBeGreaterThan(0)
    }), { timeout: 60_000 })
})

describe("PostgreSQL: tokens after a crash", () => {
  const server = { url: "", stop: async () => {}, restart: undefined as ((o?: { immediate?: boolean }) => Promise<void>) | undefined }
  afterAll(() => server.stop())

  it.scopedLive("an immediate-mode stop (WAL replay) keeps every name's next token above the ones granted before", () =>
    Effect.gen(function*() {
      const own = yield* Effect.promise(() => startEmbedded())
      Object.assign(server, own)
      const names = Array.from({ length: 20 }, (_, i) => `crash-${i}`)
      const before = new Map<string, bigint>()
      {
        const scope = yield* Scope.make()
        const lease = lockOf(yield* Scope.extend(leaseOn({ table: "pg_tokens_crash" }, own.url), scope))
        const advisory = lockOf(yield* Scope.extend(advisoryOn({ fencingTable: "pg_tokens_crash_fencing" }, own.url), scope))
        for (let round = 0; round < 3; round++) {
          for (const name of names) {
            before.set(`lease:${name}`, yield* Effect.scoped(Effect.map(lease.acquire(name), (l) => l.token)))
            before.set(`fencing:${name}`, yield* Effect.scoped(Effect.map(advisory.acquire(name), (l) => l.token)))
          }
        }
        yield* Scope.close(scope, Exit.void)
      }
      yield* Effect.promise(() => own.restart!({ immediate: true }))
      const lease = lockOf(yield* leaseOn({ table: "pg_tokens_crash" }, own.url))
      const advisory = lockOf(yield* advisoryOn({ fencingTable: "pg_tokens_crash_fencing" }, own.url))
      for (const name of names) {
        expect((yield* Effect.scoped(Effect.map(lease.acquire(name), (l) => l.token))) > before.get(`lease:${name}`)!).toBe(true)
        expect((yield* Effect.scoped(Effect.map(advisory.acquire(name), (l) => l.token))) > before.get(`fencing:${name}`)!).toBe(true)
      }
    }), { timeout: 90_000 })
})

import { describe, expect, it, layer } from "@effect/vitest"
import { Context, Effect, Fiber, Layer, Option } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import { LockBackendError } from "effect-lock/LockError"
import * as PgAdvisory from "effect-lock/PgAdvisory"
import * as PgLease from "effect-lock/PgLease"
import * as Os from "node:os"
import pg from "pg"
import { keyFromLockTag, lockTagOfKey } from "../src/internal/advisory/inspect.js"
import { PgTest, useTestDatabase } from "./support/pg.js"
import { eventually as pollUntil } from "./support/eventually.js"

// First, so that its afterAll (no advisory locks, no held leases; drop) runs after every layer is closed.
const db = useTestDatabase("inspect")

/** A PgAdvisory service whose sessions live as long as the surrounding scope. */
const advisory = (applicationName: string) =>
  Layer.build(PgAdvisory.layer({ url: db.url, applicationName })).pipe(
    Effect.map(Context.get(DistributedLock.DistributedLock))
  )

/** The first name with the given prefix whose advisory key has the wanted sign. */
const nameWithKey = (prefix: string, sign: "negative" | "positive"): string => {
  for (let i = 0;; i++) {
    const name = `${prefix}-${i}`
    if ((PgAdvisory.keyOf(name) < 0n) === (sign === "negative")) return name
  }
}

const eventually = <A, E, R>(read: Effect.Effect<A, E, R>, check: (a: A) => boolean, ms = 5_000) =>
  pollUntil("condition", read, check, ms)

const holdersOf = (applications: ReadonlyArray<string>) =>
  Effect.map(
    PgAdvisory.listHolders(),
    (rows) => rows.filter((row) => Option.exists(row.applicationName, (name) => applications.includes(name)))
  )

/** A raw session of its own, holding session advisory locks on `keys` until the scope closes. */
const rawSessionHolding = (applicationName: string, keys: ReadonlyArray<bigint>) =>
  Effect.acquireRelease(
    Effect.promise(async () => {
      const client = new pg.Client({ connectionString: db.url, application_name: applicationName })
      client.on("error", () => {})
      await client.connect()
      for (const key of keys) await client.query("select pg_advisory_lock($1::bigint)", [key.toString()])
      return client
    }),
    // Ending the session makes the server drop every lock it holds.
    (client) => Effect.promise(() => client.end().catch(() => {}))
  )

describe("advisory key reconstruction", () => {
  it("inverts PostgreSQL's classid/objid split for every sign and boundary", () => {
    const keys = [0n, 1n, -1n, 2n ** 31n, 2n ** 32n, -(2n ** 32n), 2n ** 63n - 1n, -(2n ** 63n), -123456789012345n]
    for (const key of keys) {
      const { classid, objid } = lockTagOfKey(key)
      expect(classid >= 0n && classid < 2n ** 32n && objid >= 0n && objid < 2n ** 32n).toBe(true)
      expect(keyFromLockTag(classid, objid)).toBe(key)
    }
    // -1 is all ones: both halves are the largest oid.
    expect(lockTagOfKey(-1n)).toEqual({ classid: 4294967295n, objid: 4294967295n })
    expect(() => keyFromLockTag(2n ** 32n, 0n)).toThrow(RangeError)
  })
})

layer(PgTest.layer(db), { excludeTestServices: true })("PgAdvisory.listHolders", (it) => {
  it.scoped("reads back the exact keys PostgreSQL holds, negative and extreme ones included", () =>
    Effect.gen(function*() {
      const keys = [-(2n ** 63n), -1n, 2n ** 63n - 1n, 2n ** 32n, 0n, -4294967296n]
      yield* rawSessionHolding("inspect-raw", keys)
      const rows = yield* holdersOf(["inspect-raw"])
      expect(rows.map((row) => row.key).sort((a, b) => (a < b ? -1 : a > b ? 1 : 0))).toEqual(
        [...keys].sort((a, b) => (a < b ? -1 : a > b ? 1 : 0))
      )
      for (const row of rows) {
        expect(row).toMatchObject({ mode: "exclusive", granted: true, name: Option.none() })
        expect(Option.isSome(row.since)).toBe(true)
      }
    }))

  it.scoped("names holders and waiters, with their modes, sessions and application names", () =>
    Effect.gen(function*() {
      const negative = nameWithKey("inspect/negative", "negative")
      const positive = nameWithKey("inspect/positive", "positive")
      const shared = "inspect/shared"
      expect(PgAdvisory.keyOf(negative)).toBeLessThan(0n)

      const a = yield* advisory("inspect-a")
      const b = yield* advisory("inspect-b")
      yield* a.acquire(negative)
      yield* a.acquire(positive)
      yield* a.acquire(shared, { mode: "shared" })
      yield* b.acquire(shared, { mode: "shared" })
      const waiter = yield* Effect.fork(Effect.scoped(b.acquire(negative)))

      const rows = yield* eventually(holdersOf(["inspect-a", "inspect-b"]), (rows) => rows.some((r) => !r.granted))
      const pidOf = (app: string, name: string) =>
        rows.find((r) => Option.contains(r.applicationName, app) && Option.contains(r.name, name))?.pid
      const view = rows.map((row) => ({
        key: row.key,
        name: Option.getOrNull(row.name),
        mode: row.mode,
        granted: row.granted,
        app: Option.getOrNull(row.applicationName)
      }))
      expect(view).toHaveLength(5)
      expect(view).toEqual(expect.arrayContaining([
        { key: PgAdvisory.keyOf(negative), name: negative, mode: "exclusive", granted: true, app: "inspect-a" },
        { key: PgAdvisory.keyOf(negative), name: negative, mode: "exclusive", granted: false, app: "inspect-b" },
        { key: PgAdvisory.keyOf(positive), name: positive, mode: "exclusive", granted: true, app: "inspect-a" },
        { key: PgAdvisory.keyOf(shared), name: shared, mode: "shared", granted: true, app: "inspect-a" },
        { key: PgAdvisory.keyOf(shared), name: shared, mode: "shared", granted: true, app: "inspect-b" }
      ]))

      // Holder identity comes from pg_stat_activity.
      const held = rows.find((r) => r.granted && Option.contains(r.name, negative))!
      const waiting = rows.find((r) => !r.granted)!
      expect(held.pid).toBe(pidOf("inspect-a", negative))
      expect(waiting.pid).not.toBe(held.pid)
      expect(Option.getOrNull(held.clientAddress)).toMatch(/^(127\.0\.0\.1|::1)$|^$/)
      expect(Option.getOrThrow(held.since)).toBeLessThanOrEqual(Date.now() + 1_000)
      expect(Option.getOrThrow(waiting.since)).toBeGreaterThan(Option.getOrThrow(held.since) - 1)
      expect(Option.getOrNull(waiting.waitEvent)).toBe("Lock:advisory")

      yield* Fiber.interrupt(waiter)
    }))

  it.scoped("after release, the locks are gone", () =>
    Effect.gen(function*() {
      const name = "inspect/released"
      yield* Effect.scoped(
        Effect.gen(function*() {
          const a = yield* advisory("inspect-release")
          yield* a.acquire(name)
          const rows = yield* holdersOf(["inspect-release"])
          expect(rows.map((row) => Option.getOrNull(row.name))).toEqual([name])
        })
      )
      // A closed session's backend exits a moment after the client goes.
      yield* eventually(holdersOf(["inspect-release"]), (rows) => rows.length === 0)
    }))

  it.scoped("names transaction locks from the names it is given", () =>
    Effect.gen(function*() {
      const name = "inspect/xact"
      const rows = yield* Effect.all([
        PgAdvisory.listHolders({ fencingTable: "no_such_fencing_table" }),
        PgAdvisory.listHolders({ names: ["something/else", name], namespace: "jobs" })
      ]).pipe(PgAdvisory.withXactLock(name, { namespace: "jobs" }))
      const key = PgAdvisory.keyOf(name, "jobs")
      expect(rows[0].find((row) => row.key === key)?.name).toEqual(Option.none())
      expect(rows[1].find((row) => row.key === key)?.name).toEqual(Option.some(name))
    }))

  it.effect("fails with LockBackendError { operation: \"inspect\" } when the statement fails", () =>
    Effect.gen(function*() {
      const error = yield* Effect.flip(PgAdvisory.listHolders({ fencingTable: "bad\u0000name" }))
      expect(error).toBeInstanceOf(LockBackendError)
      expect(error.operation).toBe("inspect")
    }))
})

layer(PgTest.layer(db), { excludeTestServices: true })("PgLease.listHolders", (it) => {
  const table = "inspect_leases"

  it.scoped("lists held leases with holder identity, token and times; none once released", () =>
    Effect.gen(function*() {
      // Before the first acquire the table does not exist: no leases, not an error.
      expect(yield* PgLease.listHolders({ table })).toEqual([])

      const locks = yield* Layer.build(PgLease.layer({ table, applicationName: "inspect-lease-app" })).pipe(
        Effect.map(Context.get(DistributedLock.DistributedLock))
      )
      yield* Effect.scoped(
        Effect.gen(function*() {
          const first = yield* locks.acquire("lease/one")
          const second = yield* locks.acquire("lease/two")
          const rows = yield* PgLease.listHolders({ table })
          expect(rows.map((row) => row.name)).toEqual(["lease/one", "lease/two"])
          for (const [row, lease] of [[rows[0]!, first], [rows[1]!, second]] as const) {
            expect(row).toMatchObject({
              application: "inspect-lease-app",
              host: Os.hostname(),
              pid: process.pid,
              token: lease.token
            })
            expect(row.expiresAt).toBeGreaterThan(row.acquiredAt)
          }
          expect((yield* PgLease.listHolders({ table, name: "lease/two" })).map((row) => row.name)).toEqual(["lease/two"])
          // The same rows as `holders`.
          expect(yield* PgLease.holders({ table })).toEqual(rows)
        })
      )
      expect(yield* PgLease.listHolders({ table })).toEqual([])
    }))

  it.effect("refuses a table name that is not an identifier", () =>
    Effect.gen(function*() {
      const error = yield* Effect.flip(PgLease.listHolders({ table: "no;such" }))
      expect(error.operation).toBe("configure")
    }))
})

/**
 * The lease backends give `DistributedLock.schedule` the database's clock (`LockBackend.now`,
 * surfaced as `Service.storeTime`): replicas whose own clocks disagree compare occurrence times
 * on the one clock they share. Checked against the server's own reading, from a process whose
 * Clock is an hour off.
 */
import { PgClient } from "@effect/sql-pg"
import { describe, expect, it } from "@effect/vitest"
import { Clock, Context, Effect, Layer, Redacted } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as PgAdvisory from "effect-lock/PgAdvisory"
import * as PgLease from "effect-lock/PgLease"
import * as SqliteLease from "effect-lock/SqliteLease"
import Sqlite from "better-sqlite3"
import { useSqliteFile } from "./fixtures/sqlite-db.js"
import { useTestDatabase, withClient } from "./support/pg.js"

const db = useTestDatabase("store_time")
const file = useSqliteFile("store-time")

const HOUR = 3_600_000

const pgNow = () =>
  withClient(db.url, async (client) =>
    Number((await client.query<{ now: number }>("select (extract(epoch from clock_timestamp()) * 1000)::float8 as now")).rows[0]!.now))

/** A Clock an hour behind the real one, wall and monotonic alike. */
const hourBehind: Clock.Clock = (() => {
  const base = Clock.make()
  const millis = () => base.unsafeCurrentTimeMillis() - HOUR
  const nanos = () => base.unsafeCurrentTimeNanos() - BigInt(HOUR) * 1_000_000n
  return {
    [Clock.ClockTypeId]: Clock.ClockTypeId,
    unsafeCurrentTimeMillis: millis,
    unsafeCurrentTimeNanos: nanos,
    currentTimeMillis: Effect.sync(millis),
    currentTimeNanos: Effect.sync(nanos),
    sleep: (duration) => base.sleep(duration)
  }
})()

/** The store's time as the service reports it, bracketed by the database's own readings. */
const bracketed = (layer: Layer.Layer<DistributedLock.DistributedLock, unknown>, serverNow: () => Promise<number>) =>
  Effect.scoped(
    Effect.gen(function*() {
      const lock = Context.get(yield* Layer.build(layer), DistributedLock.DistributedLock)
      expect(lock.storeTime).toBeDefined()
      yield* lock.storeTime! // the first read opens the connection
      const before = yield* Effect.promise(serverNow)
      const read = yield* lock.storeTime!
      const after = yield* Effect.promise(serverNow)
      return { before, read, after }
    }).pipe(Effect.withClock(hourBehind))
  )

describe("the store's clock", () => {
  it.live("PgLease reads the server's clock, not the process's", () =>
    Effect.gen(function*() {
      const { after, before, read } = yield* bracketed(
        Layer.provide(PgLease.layer(), PgClient.layer({ url: Redacted.make(db.url) })),
        pgNow
      )
      expect(read).toBeGreaterThanOrEqual(before)
      expect(read).toBeLessThanOrEqual(after)
    }))

  it.live("PgAdvisory reads the server's clock on one of its sessions, not the process's", () =>
    Effect.gen(function*() {
      const { after, before, read } = yield* bracketed(PgAdvisory.layer({ url: db.url }), pgNow)
      expect(read).toBeGreaterThanOrEqual(before)
      expect(read).toBeLessThanOrEqual(after)
    }))

  it.live("SqliteLease reads the database's clock, not the process's", () =>
    Effect.gen(function*() {
      const serverNow = async () => {
        const raw = new Sqlite(file.path, { readonly: true })
        try {
          return Number((raw.prepare("select unixepoch('subsec') * 1000.0 as now").get() as { now: number }).now)
        } finally {
          raw.close()
        }
      }
      const { after, before, read } = yield* bracketed(SqliteLease.layer({ filename: file.path }), serverNow)
      // unixepoch('subsec') has millisecond resolution.
      expect(read).toBeGreaterThanOrEqual(before - 1)
      expect(read).toBeLessThanOrEqual(after + 1)
    }))
})

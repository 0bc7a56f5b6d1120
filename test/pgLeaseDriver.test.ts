/**
 * PgLease's own connections send their parameterised statements prepared (parsed and planned
 * once per connection), and stop preparing the first time the server has lost one — what a
 * transaction pooler that moves statements between server connections does. The loss is made on
 * demand here: `deallocate all` on the connection drops what node-pg believes is prepared.
 */
import { describe, expect, it } from "@effect/vitest"
import { Effect } from "effect"
import * as Driver from "effect-lock/internal/pg/leaseDriver"
import { useTestDatabase } from "./support/pg.js"

const db = useTestDatabase("lease_driver")

const BOUND_MS = 5_000

describe("PgLease's own connections", () => {
  it.live("send parameterised statements prepared, and fall back to unnamed ones when the server lost them", () =>
    Effect.gen(function*() {
      const driver = yield* Driver.load
      // One connection, so every statement below runs on the same session.
      const pool = Driver.makePool(driver, { connectionString: db.url }, 1)
      try {
        const prepared = () =>
          pool.statement<{ n: number }>("select count(*)::int as n from pg_prepared_statements where name like 'effect_lock_%'", [], BOUND_MS)
        expect(yield* pool.statement<{ v: number }>("select $1::int as v", [7], BOUND_MS)).toEqual([{ v: 7 }])
        expect(yield* prepared()).toEqual([{ n: 1 }])
        // Gone at the server, still "prepared" for node-pg: the next bind is refused with 26000.
        yield* pool.statement("deallocate all", [], BOUND_MS)
        expect(yield* pool.statement<{ v: number }>("select $1::int as v", [8], BOUND_MS)).toEqual([{ v: 8 }])
        expect(yield* pool.statement<{ v: number }>("select $1::int as v", [9], BOUND_MS)).toEqual([{ v: 9 }])
        // Unnamed from then on: nothing prepared again.
        expect(yield* prepared()).toEqual([{ n: 0 }])
      } finally {
        pool.close()
      }
    }))
})

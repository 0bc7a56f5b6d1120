/**
 * PgAdvisory semaphores against the contract every permit store keeps (test/support/semaphoreContract.ts),
 * on the real server, once as is and once with a yield budget of 12: the same waiting order as
 * memory, PgLease and SQLite (first in, first out; a try never overtakes a waiter; a release wakes
 * the head waiters that fit).
 *
 * The target is `sessionBound`: permits are session locks, with no ttl, no renewal and no revoking
 * in the store (a session's loss is tested in PgAdvisory.semaphore.test.ts). The store's view of a
 * semaphore is read from the server itself: permits held are the slot locks granted in pg_locks,
 * waiters the fencing row's queue entries whose waiter key a session still holds.
 */
import { Duration, Effect } from "effect"
import pg from "pg"
import * as engine from "../src/internal/advisory/engine.js"
import * as optionsOf from "../src/internal/advisory/options.js"
import { permitKeysOf } from "../src/internal/advisory/permits.js"
import { terminateBackends, useTestDatabase, withClient } from "./support/pg.js"
import { semaphoreContractSuite, type StoreState } from "./support/semaphoreContract.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("pg_advisory_semaphore_contract")

const APP = "adv-sem-contract"

/**
 * Statements in flight on the contract's sessions, by each text parameter they carry: every
 * permit statement carries its semaphore's key, so a name is quiet when none carries its key.
 */
const inFlight = new Map<string, number>()
const count = (values: ReadonlyArray<unknown>, by: number) => {
  for (const value of values) {
    if (typeof value === "string") inFlight.set(value, (inFlight.get(value) ?? 0) + by)
  }
}

/** node-pg with a client that counts its statements in flight (the library's own driver, observed). */
class CountingClient extends pg.Client {
  override query(...args: Array<any>): any {
    const [config, second, third] = args
    const values: ReadonlyArray<unknown> = Array.isArray(config?.values) ? config.values : Array.isArray(second) ? second : []
    const callback = typeof third === "function" ? third : typeof second === "function" ? second : undefined
    if (callback === undefined || values.length === 0) return (super.query as any)(...args)
    count(values, 1)
    const done = (error: unknown, result: unknown) => {
      count(values, -1)
      callback(error, result)
    }
    return typeof third === "function" ? (super.query as any)(config, second, done) : (super.query as any)(config, done)
  }
}
const countingPg = { ...pg, Client: CountingClient } as unknown as typeof pg

/** The semaphore `name` as the server has it. */
const stateOf = (name: string): Effect.Effect<StoreState> =>
  Effect.promise(() =>
    withClient(db.url, async (client) => {
      const keys = permitKeysOf(name, "")
      const result = await client.query<{ held: number; waiting: ReadonlyArray<number> }>(
        `with locks as (select ((l.classid::int8 << 32) | l.objid::int8) as k from pg_locks l
           where l.locktype = 'advisory' and l.objsubid = 1 and l.granted
             and l.database = (select oid from pg_database where datname = current_database()))
         select (select count(*) from locks where (k # $2::int8) between 0 and 1023)::int as held,
           coalesce((select jsonb_agg((q.e->>'p')::int order by q.pos)
             from effect_lock_fencing f, jsonb_array_elements(f.permit_queue) with ordinality as q(e, pos)
             where f.key = $1::int8 and exists (select 1 from locks where k = (q.e->>'k')::int8)), '[]'::jsonb) as waiting`,
        [keys.keyText, keys.slotBase.toString()]
      ).catch((error: { code?: string }) =>
        // Before the first acquire of the file the table does not exist yet: nothing is held.
        error.code === "42P01" ? { rows: [{ held: 0, waiting: [] }] } : Promise.reject(error)
      )
      return result.rows[0]!
    })
  )

semaphoreContractSuite("PgAdvisory", {
  clock: "live",
  ttl: Duration.seconds(2),
  makeBackend: Effect.suspend(() =>
    Effect.flatMap(
      optionsOf.resolve({ url: db.url, applicationName: APP }),
      (options) => Effect.map(engine.makeWith(options, countingPg), (backend) => backend.semaphore)
    )
  ),
  state: stateOf,
  // Not used (the cases that revoke are lease-only); an operator's way: the holders' sessions end.
  revoke: () => Effect.asVoid(Effect.promise(() => terminateBackends(db.url, APP))),
  advance: (duration) => Effect.sleep(duration),
  rounds: 6,
  // Session locks have no expiry: any bound shows a give-back; this one is generous for a loaded machine.
  giveBackBound: Duration.millis(2_500),
  quiet: (name) => Effect.sync(() => (inFlight.get(permitKeysOf(name, "").keyText) ?? 0) === 0),
  sessionBound: true
})

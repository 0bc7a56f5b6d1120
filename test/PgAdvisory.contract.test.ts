/**
 * PgAdvisory against the backend contract every backend keeps (test/support/contract.ts), on the
 * real server, once as is and once with a yield budget of 12.
 *
 * The target is `sessionBound`: the contract's tests about renewals and lease expiry are skipped
 * (a grant has no `validUntil`, the core never renews it; a session lock is lost only with its
 * session, tested in PgAdvisory.faults.test.ts and PgAdvisory.test.ts). "Queued" is read from the
 * store: a not-granted request on the name's key in pg_locks.
 */
import { Duration, Effect } from "effect"
import * as PgAdvisory from "../src/PgAdvisory.js"
import { WAIT_SLICE_MS } from "../src/internal/advisory/wait.js"
import { contractSuite } from "./support/contract.js"
import { useTestDatabase, withClient } from "./support/pg.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("pg_advisory_contract")

/** Advisory lock requests on the name's key, granted or waiting, read from pg_locks (the store itself). */
const requests = (name: string, granted: boolean) =>
  Effect.promise(() =>
    withClient(db.url, async (client) => {
      const key = BigInt.asUintN(64, PgAdvisory.keyOf(name))
      const result = await client.query<{ n: number }>(
        `select count(*)::int as n from pg_locks
         where locktype = 'advisory' and granted = $3 and objsubid = 1 and classid = $1 and objid = $2
           and database = (select oid from pg_database where datname = current_database())`,
        [String(key >> 32n), String(key & 0xffffffffn), granted]
      )
      return result.rows[0]?.n ?? 0
    })
  )

/** Terminates the sessions holding `name`'s key, as an operator would: the server drops their locks. */
const terminateHolders = (name: string) =>
  Effect.promise(() =>
    withClient(db.url, async (client) => {
      const key = BigInt.asUintN(64, PgAdvisory.keyOf(name))
      await client.query(
        `select pg_terminate_backend(pid) from pg_locks
         where locktype = 'advisory' and granted and objsubid = 1 and classid = $1 and objid = $2
           and database = (select oid from pg_database where datname = current_database())`,
        [String(key >> 32n), String(key & 0xffffffffn)]
      )
    })
  )

contractSuite("PgAdvisory", {
  clock: "live",
  ttl: Duration.seconds(1),
  makeBackend: Effect.suspend(() => PgAdvisory.makeBackend({ url: db.url, applicationName: "adv-contract", maxSessions: 3 })),
  storeHolders: (name) => requests(name, true),
  waiting: (name) => Effect.map(requests(name, false), (n) => n > 0),
  waitingCount: (name) => requests(name, false),
  sessionBound: true,
  // A lock wait at the server runs in slices; at a slice's end the waiter queues again, at the back.
  orderWithin: Duration.millis(WAIT_SLICE_MS),
  revoke: terminateHolders,
  advance: (duration) => Effect.sleep(duration),
  maxNameBytes: 1024,
  minTtl: Duration.seconds(1)
})

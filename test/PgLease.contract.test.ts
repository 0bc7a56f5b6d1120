/**
 * PgLease runs the backend contract suite (twice: as scheduled, and with the runtime switching
 * fibers every 12 ops) and its event-loop stall cases, against a real PostgreSQL.
 */
import { Effect } from "effect"
import * as PgLease from "effect-lock/PgLease"
import { contractSuite, LIVE_CONTRACT_TTL } from "./support/contract.js"
import { useTestDatabase } from "./support/pg.js"
import { pgLeaseHelpers } from "./support/pgLease.js"

// First, so that its afterAll (no held lease rows, no advisory locks; drop) runs after every layer is closed.
const db = useTestDatabase("pglease_contract")

const { backendOn, poolOn, probe, query } = pgLeaseHelpers(db, LIVE_CONTRACT_TTL)

contractSuite("PgLease", {
  clock: "live",
  ttl: LIVE_CONTRACT_TTL,
  makeBackend: Effect.flatMap(poolOn(() => db.url), (env) => backendOn(env, { ttl: LIVE_CONTRACT_TTL })),
  storeHolders: (name) =>
    Effect.map(
      query<{ n: number }>(
        `select count(*)::int as n from ${PgLease.DEFAULT_TABLE} where name = $1 and owner is not null and expires_at > now()`,
        [name]
      ),
      (rows) => rows[0]!.n
    ),
  advance: (duration) => Effect.sleep(duration),
  // The operator's revoke, through a pool of its own.
  revoke: (name) => Effect.scoped(Effect.flatMap(poolOn(() => db.url), (env) => Effect.provide(PgLease.revoke(name), env))),
  // Each live place's time left, by the server's clock after the statement's snapshot.
  placesLeft: (name) =>
    Effect.map(
      query<{ left: number }>(
        `select (extract(epoch from expires_at - clock_timestamp()) * 1000)::float8 as left from ${PgLease.DEFAULT_TABLE}_queue
         where name = $1 and token is null and expires_at > clock_timestamp()`,
        [name]
      ),
      (rows) => rows.map((row) => row.left)
    ),
  // The live lease's expiry by the server's clock, from the operator's listing (its own pool).
  leaseExpiresAt: (name) =>
    Effect.scoped(Effect.flatMap(poolOn(() => db.url), (env) => Effect.provide(Effect.map(PgLease.holders({ name }), (held) => held[0]!.expiresAt), env))),
  settle: probe.settle,
  maxNameBytes: PgLease.defaults.maxNameBytes,
  minTtl: PgLease.defaults.minTtl
})

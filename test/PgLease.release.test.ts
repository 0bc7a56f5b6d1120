/**
 * PgLease: a holder's release that gets no answer within its statement bound (here: its
 * statement waits for a row lock another transaction holds) is told failed, and the lease is not
 * left to its ttl: the give-back is repeated in the background, and frees it once the store
 * answers again.
 */
import type { SqlClient } from "@effect/sql"
import type { PgClient } from "@effect/sql-pg"
import { layer } from "@effect/vitest"
import { Duration, Effect, Exit, Scope } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as Make from "effect-lock/internal/lease/pg/make"
import * as PgLease from "effect-lock/PgLease"
import pg from "pg"
import { expect } from "vitest"
import { freshName, HOLD_THROUGH, untilFree } from "./support/contract.js"
import { waitFor } from "./support/eventually.js"
import { lockWaitsOf, PgTest, useTestDatabase } from "./support/pg.js"

// First, so that its afterAll (no held lease rows, no advisory locks; drop) runs after every layer is closed.
const db = useTestDatabase("pglease_release")

/** A layer's lock service (leases of 30 s), each statement bounded by `statementTimeout`. */
const lockService = (application: string, statementTimeout?: Duration.Duration) =>
  Effect.gen(function*() {
    const env = yield* Effect.context<PgClient.PgClient | SqlClient.SqlClient | Scope.Scope>()
    const backend = yield* Make.makeBackend({
      ttl: HOLD_THROUGH,
      sweepInterval: 0,
      applicationName: application,
      ...(statementTimeout === undefined ? {} : { statementTimeout })
    }).pipe(Effect.provide(env))
    return yield* DistributedLock.make(backend)
  })

layer(PgTest.layer(db), { excludeTestServices: true })("PgLease releases", (it) => {
  it.scoped("a release told failed within its bound (its row locked by another transaction) is repeated in the background: the lease is free soon after the store answers again, not at its 30 s ttl", () =>
    Effect.gen(function*() {
      const application = freshName("release-repeated")
      const a = yield* lockService(application, Duration.seconds(1))
      const b = yield* lockService(freshName("release-other"))
      const name = freshName("repeated")
      const scope = yield* Scope.make()
      yield* Scope.extend(a.acquire(name), scope)
      // Another transaction locks the lease row: the release's statement waits for it past its 1 s bound.
      const client = new pg.Client({ connectionString: db.url })
      yield* Effect.promise(() => client.connect())
      yield* Effect.addFinalizer(() => Effect.promise(() => client.end().catch(() => {})))
      yield* Effect.promise(() => client.query("begin"))
      yield* Effect.promise(() => client.query(`select 1 from ${PgLease.DEFAULT_TABLE} where name = $1 for update`, [name]))
      const startedAt = performance.now()
      // The scope closes once the release is told failed (logged; the core's bound on a release is longer).
      yield* Scope.close(scope, Exit.void)
      expect(performance.now() - startedAt).toBeGreaterThanOrEqual(900)
      expect(yield* Effect.scoped(b.tryAcquire(name))).toMatchObject({ _tag: "None" })
      // The server has abandoned the release's statement (its connection was destroyed at the
      // bound; `client_connection_check_interval`): once the row is free nothing of it can commit.
      yield* waitFor("no statement of the layer waiting for the row", Effect.map(lockWaitsOf(db.url, application), (n) => n === 0), Duration.seconds(10))
      yield* Effect.promise(() => client.query("commit"))
      const committedAt = performance.now()
      // The repeats are spaced 50 ms doubling to 1 s: the next one after the commit frees it.
      yield* untilFree(b, name, Duration.seconds(5))
      expect(performance.now() - committedAt).toBeLessThan(5_000)
    }))
})

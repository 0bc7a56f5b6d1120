/**
 * Helpers of the PgLease test files: pools of their own (one per "process"), backends whose lane
 * and acquires are watched (`probe`: tests wait on what the backend is doing instead of
 * sleeping), and raw queries against the file's database.
 */
import type { SqlClient } from "@effect/sql"
import { PgClient } from "@effect/sql-pg"
import { Context, Duration, Effect, Layer, Scope } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import type { LockBackend } from "effect-lock/LockBackend"
import type * as Lane from "effect-lock/internal/lease/pg/lane"
import * as Make from "effect-lock/internal/lease/pg/make"
import { withRun } from "./laneRun.js"
import type * as PgLease from "effect-lock/PgLease"
import type pg from "pg"
import { PgTest, type UsedTestDatabase, withClient } from "./pg.js"

/** Polls `check` every 5 ms until it holds; dies naming `what` after `bound`. */
export function waitFor(what: string, check: Effect.Effect<boolean, unknown>, bound: Duration.DurationInput) {
  return Effect.gen(function*() {
    const deadline = Date.now() + Duration.toMillis(Duration.decode(bound))
    while (!(yield* Effect.orDie(check))) {
      if (Date.now() > deadline) return yield* Effect.dieMessage(`timed out waiting for: ${what}`)
      yield* Effect.sleep(Duration.millis(5))
    }
  })
}

export type Env = Context.Context<PgClient.PgClient | SqlClient.SqlClient>

/**
 * What every backend made by one set of helpers is doing, read from wrappers around its lane and
 * its acquire: statements in flight, and for each lock name the acquires running and those in
 * their wait (a failed attempt behind them, subscribed to wake-ups).
 */
const makeProbe = () => {
  let inFlight = 0
  const active = new Map<string, number>()
  const waiting = new Map<string, number>()
  const waitsEntered = new Map<string, number>()
  const bump = (map: Map<string, number>, name: string, by: number) => map.set(name, (map.get(name) ?? 0) + by)
  const counted = <A, E, R>(self: Effect.Effect<A, E, R>) =>
    Effect.acquireUseRelease(Effect.sync(() => inFlight++), () => self, () => Effect.sync(() => inFlight--))
  const wrapLane = (lane: Lane.Lane): Lane.Lane => {
    const runNow = lane.runNow
    return {
      ...withRun(lane, (operation, name, text, params, bound) => counted(lane.run(operation, name, text, params, bound))),
      // The callback path counted as it is, batches included (`pg/pool`): the library's own path.
      runNow: runNow === undefined ? undefined : (operation, name, text, params, bound, done, batch) => {
        inFlight++
        let open = true
        const finish = () => {
          if (open) inFlight--
          open = false
        }
        const abandon = runNow(operation, name, text, params, bound, (error, rows) => {
          finish()
          done(error, rows)
        }, batch)
        return () => {
          finish()
          abandon()
        }
      },
      renew: (text, params, bound) => counted(lane.renew(text, params, bound))
    }
  }
  const wrapBackend = <G extends PgLease.PgLeaseGrant>(backend: LockBackend<G>): LockBackend<G> => ({
    ...backend,
    acquire: (request) =>
      Effect.acquireUseRelease(
        Effect.sync(() => bump(active, request.name, 1)),
        () =>
          backend.acquire({
            ...request,
            waitUntilDeadline: (step) =>
              Effect.acquireUseRelease(
                Effect.sync(() => {
                  bump(waiting, request.name, 1)
                  bump(waitsEntered, request.name, 1)
                }),
                () => request.waitUntilDeadline(step),
                () => Effect.sync(() => bump(waiting, request.name, -1))
              )
          }),
        () => Effect.sync(() => bump(active, request.name, -1))
      )
  })
  /** Every acquire is in its wait (or done) and no statement is in flight. */
  const quiet = () => inFlight === 0 && Array.from(active).every(([name, n]) => n === (waiting.get(name) ?? 0))
  return {
    wrapLane,
    wrapBackend,
    /**
     * Every acquire is done or waiting and no statement is in flight, on three polls 5 ms apart:
     * a fiber forked just before has had event-loop turns to reach its statement by then (with
     * the yield budget of 12 it may need several).
     */
    settle: Effect.gen(function*() {
      let quietPolls = 0
      yield* waitFor(
        "every acquire waiting or done, no statement in flight",
        Effect.sync(() => (quietPolls = quiet() ? quietPolls + 1 : 0) >= 3),
        Duration.seconds(5)
      )
    }),
    /** Until `count` acquires of `name` are in their wait. */
    waiting: (name: string, count = 1) =>
      waitFor(`${count} waiter(s) of "${name}" in their wait`, Effect.sync(() => (waiting.get(name) ?? 0) >= count), Duration.seconds(5)),
    /**
     * Until the `count` waiters of `name` (one by default) are in a wait after their look-again
     * following their first attempt: from then on only a wake-up (or their long retry interval)
     * makes them try again.
     */
    waitingLong: (name: string, count = 1) =>
      waitFor(
        `${count} waiter(s) of "${name}" in their long wait`,
        Effect.sync(() => (waiting.get(name) ?? 0) >= count && (waitsEntered.get(name) ?? 0) >= 2 * count),
        Duration.seconds(5)
      )
  }
}

/**
 * The helpers of one test file, over its database `db`; backends default to a lease of `ttl` and
 * to `defaults` (a test's own options win).
 */
export const pgLeaseHelpers = (db: UsedTestDatabase, ttl: Duration.Duration, defaults?: PgLease.Options) => {
  const probe = makeProbe()

  /** A pool of its own, like a separate process would have; closed with the enclosing scope. */
  const poolOn = (url: string | (() => string), applicationName?: string) =>
    Layer.build(PgTest.layer(url, applicationName === undefined ? {} : { applicationName }))

  /** The same context without `PgClient`: a plain `SqlClient`, as another driver would give. */
  const sqlOnly = (env: Env): Context.Context<SqlClient.SqlClient> =>
    Context.omit(PgClient.PgClient)(env) as Context.Context<SqlClient.SqlClient>

  /** A backend that sees exactly `env` (plus the caller's Scope), not the test's own context. */
  const backendOn = (env: Context.Context<SqlClient.SqlClient>, options?: PgLease.Options, wrapLane?: (lane: Lane.Lane) => Lane.Lane) =>
    Make.makeBackend({ ttl, pollInterval: Duration.millis(100), ...defaults, ...options }, (lane) => probe.wrapLane(wrapLane === undefined ? lane : wrapLane(lane))).pipe(
      Effect.map(probe.wrapBackend),
      Effect.mapInputContext((outer: Context.Context<Scope.Scope>) => Context.add(env, Scope.Scope, Context.get(outer, Scope.Scope)))
    )

  /** One "process": a backend on `env` under a DistributedLock service. */
  const processOn = (env: Context.Context<SqlClient.SqlClient>, options?: PgLease.Options) =>
    Effect.flatMap(backendOn(env, options), DistributedLock.make)

  const query = <R extends pg.QueryResultRow>(text: string, values: ReadonlyArray<unknown> = []) =>
    Effect.promise(() => withClient(db.url, (client) => client.query<R>(text, [...values]).then((r) => r.rows)))

  return { waitFor, poolOn, sqlOnly, probe, backendOn, processOn, query }
}

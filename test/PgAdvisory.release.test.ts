/**
 * Releases notify only when somebody waits on notifications: a release nobody waits for commits
 * without NOTIFY (a database-wide serialisation point), one that a notification-only waiter
 * waits for wakes it at once.
 */
import { describe, expect, it } from "@effect/vitest"
import { Context, Effect, Exit, Fiber, Layer, Scope } from "effect"
import pg from "pg"
import * as DistributedLock from "../src/DistributedLock.js"
import { advisoryKey } from "../src/internal/core/lockKey.js"
import { INTEREST_NAMESPACE } from "../src/internal/advisory/sql.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import { HARNESS_APPLICATION_NAME, useTestDatabase, withClient } from "./support/pg.js"
import { eventually as pollUntil } from "./support/eventually.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("pg_advisory_release")

const service = (applicationName: string, options?: Omit<PgAdvisory.Options, "url" | "applicationName">) =>
  Layer.build(PgAdvisory.layer({ url: db.url, applicationName, ...options })).pipe(
    Effect.map(Context.get(DistributedLock.DistributedLock))
  )

const eventually = <A>(read: Effect.Effect<A>, check: (a: A) => boolean, ms: number, what: string): Effect.Effect<A> =>
  pollUntil(what, read, check, ms)

/** Granted advisory locks of an application on a key. */
const holdsKey = (applicationName: string, key: bigint) =>
  Effect.promise(() =>
    withClient(db.url, async (client) => {
      const unsigned = BigInt.asUintN(64, key)
      const result = await client.query(
        `select 1 from pg_locks l join pg_stat_activity a on a.pid = l.pid
         where l.locktype = 'advisory' and l.granted and l.classid = $1 and l.objid = $2 and a.application_name = $3`,
        [String(unsigned >> 32n), String(unsigned & 0xffffffffn), applicationName]
      )
      return (result.rowCount ?? 0) > 0
    })
  )

describe("PgAdvisory release notifications", () => {
  it.scopedLive("a release nobody waits for notifies nobody; a notification-only waiter is notified", () =>
    Effect.gen(function*() {
      const listener = yield* Effect.acquireRelease(
        Effect.promise(async () => {
          const client = new pg.Client({ connectionString: db.url, application_name: HARNESS_APPLICATION_NAME })
          client.on("error", () => {})
          await client.connect()
          await client.query(`LISTEN "effect_lock_released"`)
          return client
        }),
        (client) => Effect.promise(() => client.end().catch(() => {}))
      )
      const heard: Array<string> = []
      listener.on("notification", (message) => heard.push(message.payload ?? ""))

      const a = yield* service("adv-notify-quiet-a")
      // One session that already holds a lock: it never blocks at the server, so it waits on
      // notifications (and registers its interest in them).
      const b = yield* service("adv-notify-quiet-b", { maxSessions: 1 })
      yield* b.acquire("held-by-b")

      // Nobody waits: taken and given back.
      yield* Effect.scoped(a.acquire("quiet"))

      const held = yield* Scope.make()
      yield* a.acquire("noisy").pipe(Scope.extend(held))
      const waiter = yield* Effect.fork(Effect.scoped(Effect.map(b.acquire("noisy"), (lease) => lease.token)))
      const noisyKey = PgAdvisory.keyOf("noisy")
      const interestKey = advisoryKey(noisyKey.toString(), INTEREST_NAMESPACE)
      yield* eventually(holdsKey("adv-notify-quiet-b", interestKey), (held) => held, 3_000, "b registered its interest")
      yield* Scope.close(held, Exit.void)
      expect(yield* Fiber.join(waiter)).toBeGreaterThan(0n)
      yield* eventually(Effect.sync(() => heard.length), (n) => n > 0, 3_000, "the noisy release notified")
      // Notifications arrive in commit order: had the quiet release notified, it would be first.
      expect(heard).toEqual([noisyKey.toString()])
      // The interest is withdrawn once the waiter is served.
      yield* eventually(holdsKey("adv-notify-quiet-b", interestKey), (held) => !held, 3_000, "interest withdrawn")
    }))
})

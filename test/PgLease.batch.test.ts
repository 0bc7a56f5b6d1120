/**
 * PgLease's batches (issue 37): first attempts and give-backs of different names that wait for a
 * lock connection together go out as one statement (`acquireBatch`, `releaseBatch`, sent by
 * `pg/pool`). Each case holds the layer's only lock connection busy on purpose — its statement
 * waits for a row lock a raw transaction holds — so that the statements queue behind it, and
 * lets them go by committing that transaction.
 */
import type { SqlClient } from "@effect/sql"
import type { PgClient } from "@effect/sql-pg"
import { layer } from "@effect/vitest"
import { Deferred, Duration, Effect, Exit, Fiber, Scope } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import type * as Lane from "effect-lock/internal/lease/pg/lane"
import * as Make from "effect-lock/internal/lease/pg/make"
import * as PgLease from "effect-lock/PgLease"
import pg from "pg"
import { expect } from "vitest"
import { freshName, HOLD_THROUGH, untilFree } from "./support/contract.js"
import { eventually, waitFor } from "./support/eventually.js"
import { lockWaitsOf, PgTest, useTestDatabase, withClient } from "./support/pg.js"

// First, so that its afterAll (no held lease rows, no advisory locks; drop) runs after every layer is closed.
const db = useTestDatabase("pglease_batch")

const TABLE = PgLease.DEFAULT_TABLE
const QUEUE = `${TABLE}_queue`

const query = <R extends pg.QueryResultRow>(text: string, values: ReadonlyArray<unknown> = []) =>
  Effect.promise(() => withClient(db.url, (client) => client.query<R>(text, [...values]).then((r) => r.rows)))

/** A layer's lock service on one lock connection, and its lane's counters. */
const process1 = (application: string, statementTimeout?: Duration.Duration) =>
  Effect.gen(function*() {
    let lane: (Lane.Lane & Lane.OwnLane) | undefined
    const env = yield* Effect.context<PgClient.PgClient | SqlClient.SqlClient | Scope.Scope>()
    const backend = yield* Make.makeBackend(
      // The cases are about batching, not renewal: leases that outlast any stall of the host.
      { ttl: HOLD_THROUGH, sweepInterval: 0, connections: 1, applicationName: application, ...(statementTimeout === undefined ? {} : { statementTimeout }) },
      (own) => {
        lane = own as Lane.Lane & Lane.OwnLane
        return own
      }
    ).pipe(Effect.provide(env))
    const lock = yield* DistributedLock.make(backend)
    return { lock, lane: lane! }
  })

/**
 * Holds the lock connection of `application` busy: a raw transaction locks the lease row of a
 * name of its own, then the layer's acquire of that name waits for it on the connection. Returns
 * `unblock` (the transaction commits: the acquire goes on) and `done` (that acquire and its
 * give-back, queued behind whatever the connection does next, have run).
 */
const blockConnection = (
  lock: Effect.Effect.Success<ReturnType<typeof DistributedLock.make>>,
  application: string,
  /** What the blocking acquire does holding its lease before it gives it back (nothing by default). */
  holding: Effect.Effect<void> = Effect.void
) =>
  Effect.gen(function*() {
    const name = freshName("blocker")
    // The row must exist for the raw transaction to lock it.
    yield* Effect.scoped(lock.acquire(name))
    const client = new pg.Client({ connectionString: db.url })
    yield* Effect.promise(() => client.connect())
    yield* Effect.addFinalizer(() => Effect.promise(() => client.end().catch(() => {})))
    yield* Effect.promise(() => client.query("begin"))
    yield* Effect.promise(() => client.query(`select 1 from ${TABLE} where name = $1 for update`, [name]))
    const blocked = yield* Effect.forkScoped(Effect.scoped(Effect.zipRight(lock.acquire(name, { timeout: Duration.seconds(30) }), holding)))
    yield* waitFor("the layer's lock connection waiting for the row lock", Effect.map(lockWaitsOf(db.url, application), (n) => n === 1), Duration.seconds(10))
    return { unblock: Effect.asVoid(Effect.promise(() => client.query("commit"))), done: Fiber.join(blocked) }
  })

/**
 * Each of `names` acquired in a fiber of its own (waiting up to 20 s) and held until `letGo`;
 * `granted[i]` is done once `names[i]` is held, `done` once every lease was given back.
 */
const holdEach = (lock: Effect.Effect.Success<ReturnType<typeof DistributedLock.make>>, names: ReadonlyArray<string>) =>
  Effect.gen(function*() {
    const granted = yield* Effect.all(names.map(() => Deferred.make<void>()))
    const end = yield* Deferred.make<void>()
    const fibers = yield* Effect.forkAll(names.map((name, i) =>
      Effect.scoped(Effect.gen(function*() {
        const lease = yield* lock.acquire(name, { timeout: Duration.seconds(20) })
        yield* Deferred.succeed(granted[i]!, undefined)
        yield* Deferred.await(end)
        return lease.token
      }))
    ))
    return { granted, letGo: Deferred.succeed(end, undefined), done: Fiber.join(fibers) }
  })

/**
 * A batch of `names`' acquires waiting at the server: the lock connection is held busy until both
 * are queued (`start` forks them), then runs them as one statement, whose insert of `names[0]`
 * waits for another transaction's first insert of that name, not committed. Returns the batch's
 * backend pid, that transaction's client (`rollback` lets the insert go) and what `start` gave.
 */
const batchWaitingForInsert = <A>(
  layer1: Effect.Effect.Success<ReturnType<typeof process1>>,
  application: string,
  names: readonly [string, string],
  start: Effect.Effect<A, never, Scope.Scope>,
  holding?: Effect.Effect<void>
) =>
  Effect.gen(function*() {
    const { lane, lock } = layer1
    const blocked = yield* blockConnection(lock, application, holding)
    const client = new pg.Client({ connectionString: db.url })
    yield* Effect.promise(() => client.connect())
    yield* Effect.addFinalizer(() => Effect.promise(() => client.end().catch(() => {})))
    yield* Effect.promise(() => client.query("begin"))
    yield* Effect.promise(() => client.query(`insert into ${TABLE} (name, token) values ($1, 1)`, [names[0]]))
    const before = lane.batchesSent()
    const started = yield* start
    yield* waitFor("2 acquires queued for the connection", Effect.sync(() => lane.queuedStatements() === 2), Duration.seconds(10))
    yield* blocked.unblock
    const [waiting] = yield* eventually(
      "the batch waiting for the other's insert",
      query<{ pid: number }>(
        `select pid from pg_stat_activity where application_name = $1 and wait_event_type = 'Lock'
           and query like '%with ordinality as i(name, owner, waiter%'`,
        [application]
      ),
      (rows) => rows.length === 1,
      10_000
    )
    expect(lane.batchesSent()).toBe(before + 1)
    return { pid: waiting!.pid, rollback: Effect.asVoid(Effect.promise(() => client.query("rollback"))), blocked, started, before }
  })

/** Nothing of `names` left held or queued: another process takes each at once (bounded), and no place is left. */
const freeForAnother = (
  lock: Effect.Effect.Success<ReturnType<typeof DistributedLock.make>>,
  names: ReadonlyArray<string>
) =>
  Effect.gen(function*() {
    // The give-backs of failed requests run in the background, bounded.
    for (const name of names) yield* untilFree(lock, name)
    expect(yield* query<{ n: number }>(`select count(*)::int as n from ${QUEUE} where name = any($1)`, [names])).toEqual([{ n: 0 }])
  })


layer(PgTest.layer(db), { excludeTestServices: true })("PgLease batches", (it) => {
  it.scoped("acquires of different names waiting for the lock connection go out as one statement, each with a token of its own; their give-backs too", () =>
    Effect.gen(function*() {
      const application = freshName("batch-grants")
      const { lane, lock } = yield* process1(application)
      const names = Array.from({ length: 8 }, (_, i) => freshName(`batched-${i}`))
      const { unblock } = yield* blockConnection(lock, application)
      const batchesBefore = lane.batchesSent()
      const letGo = yield* Deferred.make<void>()
      const granted = yield* Deferred.make<void>()
      let held = 0
      const holders = yield* Effect.forkAll(names.map((name) =>
        Effect.scoped(Effect.gen(function*() {
          const lease = yield* lock.acquire(name, { timeout: Duration.seconds(20) })
          if (++held === names.length) yield* Deferred.succeed(granted, undefined)
          yield* Deferred.await(letGo)
          return lease.token
        }))
      ))
      yield* waitFor("8 acquires queued for the connection", Effect.sync(() => lane.queuedStatements() === 8), Duration.seconds(10))
      yield* unblock
      yield* Deferred.await(granted).pipe(Effect.timeoutFail({ duration: Duration.seconds(10), onTimeout: () => new Error("8 grants: not within 10 s") }))
      // The 8 waited together: one statement granted them.
      expect(lane.batchesSent()).toBe(batchesBefore + 1)
      const rows = yield* query<{ name: string; token: string; owner: string | null }>(
        `select name, token::text as token, owner from ${TABLE} where name = any($1)`,
        [names]
      )
      expect(rows.filter((row) => row.owner !== null).map((row) => row.name).sort()).toEqual([...names].sort())

      // The give-backs: queued behind a busy connection again, then one statement.
      const { unblock: unblockAgain } = yield* blockConnection(lock, application)
      yield* Deferred.succeed(letGo, undefined)
      yield* waitFor("8 give-backs queued for the connection", Effect.sync(() => lane.queuedStatements() === 8), Duration.seconds(10))
      yield* unblockAgain
      const tokens = yield* Fiber.join(holders)
      expect(lane.batchesSent()).toBe(batchesBefore + 2)
      // Each its own token, the one its row recorded; every lease given back.
      const recorded = new Map(rows.map((row) => [row.name, row.token]))
      expect(tokens.map(String)).toEqual(names.map((name) => recorded.get(name)))
      expect(new Set(tokens.map(String)).size).toBe(names.length)
      const left = yield* query<{ n: number }>(`select count(*)::int as n from ${TABLE} where name = any($1) and owner is not null`, [names])
      expect(left[0]!.n).toBe(0)
    }))

  it.scoped("a batch grants only what it can decide: a held name waits for its release, a name with a live place ahead is not overtaken", () =>
    Effect.gen(function*() {
      const application = freshName("batch-undecided")
      const { lane, lock } = yield* process1(application)
      const other = yield* process1(freshName("batch-other"))
      const [held, placed, freeA, freeB] = ["held", "placed", "free-a", "free-b"].map(freshName)
      const holder = yield* Scope.make()
      yield* Scope.extend(other.lock.acquire(held!), holder)
      // A live place of another process's waiter for `placed`, whose lease row is free: 3 s left.
      yield* query(
        `insert into ${QUEUE} (owner, name, mode, expires_at, enqueued_at) values (gen_random_uuid(), $1, 'exclusive', now() + interval '3 seconds', now())`,
        [placed]
      )
      const [placeEnds] = yield* query<{ at: number }>(`select (extract(epoch from expires_at) * 1000)::float8 as at from ${QUEUE} where name = $1`, [placed])
      const { unblock } = yield* blockConnection(lock, application)
      const batchesBefore = lane.batchesSent()
      const { done, granted: grants, letGo } = yield* holdEach(lock, [held!, placed!, freeA!, freeB!])
      yield* waitFor("4 acquires queued for the connection", Effect.sync(() => lane.queuedStatements() === 4), Duration.seconds(10))
      yield* unblock
      yield* Deferred.await(grants[2]!)
      yield* Deferred.await(grants[3]!)
      // One statement granted the two free names.
      expect(lane.batchesSent()).toBe(batchesBefore + 1)
      // The two it could not decide went alone and took their places.
      yield* eventually(
        "both undecided acquires waiting in the queue",
        query<{ name: string }>(`select name from ${QUEUE} where name = any($1) and token is null and expires_at > now() and holder_application = $2`, [[held, placed], application]),
        (rows) => rows.length === 2,
        10_000
      )
      expect(yield* Deferred.isDone(grants[0]!)).toBe(false)
      // Granted only once the place ahead ran out (server time), never over it.
      yield* Deferred.await(grants[1]!)
      const [granted] = yield* query<{ at: number }>(`select (extract(epoch from acquired_at) * 1000)::float8 as at from ${TABLE} where name = $1`, [placed])
      expect(granted!.at).toBeGreaterThanOrEqual(placeEnds!.at)
      expect(yield* Deferred.isDone(grants[0]!)).toBe(false)
      yield* Scope.close(holder, Exit.void)
      yield* Deferred.await(grants[0]!)
      yield* letGo
      yield* done
    }))

  it.scoped("an acquire interrupted while it waits in a batch returns only once what the batch granted it is given back; the others keep theirs", () =>
    Effect.gen(function*() {
      const application = freshName("batch-interrupt")
      const { lane, lock } = yield* process1(application)
      const [gone, kept] = ["interrupted", "kept"].map(freshName)
      const blocked = yield* blockConnection(lock, application)
      const before = lane.batchesSent()
      const { done, granted, letGo } = yield* holdEach(lock, [kept!])
      const interrupted = yield* Effect.fork(Effect.scoped(lock.acquire(gone!, { timeout: Duration.seconds(20) })))
      yield* waitFor("2 acquires queued for the connection", Effect.sync(() => lane.queuedStatements() === 2), Duration.seconds(10))
      // Interrupted before its statement is sent; its attempt is the layer's work and goes out in the batch.
      const interrupting = yield* Effect.fork(Fiber.interrupt(interrupted))
      yield* blocked.unblock
      yield* Fiber.join(interrupting)
      // The interrupt returned: the lease the batch granted `gone` is given back already.
      const rows = yield* query<{ name: string; owner: string | null }>(`select name, owner from ${TABLE} where name = any($1)`, [[gone, kept]])
      yield* Deferred.await(granted[0]!)
      expect(lane.batchesSent()).toBe(before + 1)
      expect(rows.find((row) => row.name === gone)?.owner ?? null).toBeNull()
      expect(rows.find((row) => row.name === kept)?.owner).not.toBeNull()
      yield* letGo
      yield* done
      yield* blocked.done
    }))

  it.scoped("16 fibers on 3 names through one lock connection, batched and alone mixed: never two holders of a name, tokens rising per name", () =>
    Effect.gen(function*() {
      const application = freshName("batch-mixed")
      const { lane, lock } = yield* process1(application)
      const names = ["m-a", "m-b", "m-c"].map(freshName)
      const inside = new Map<string, number>()
      const tokens = new Map<string, Array<bigint>>()
      let overlaps = 0
      const batchesBefore = lane.batchesSent()
      yield* Effect.forEach(Array.from({ length: 16 }, (_, i) => i), (fiber) =>
        Effect.forEach(Array.from({ length: 15 }, (_, round) => round), (round) => {
          const name = names[(fiber + round) % names.length]!
          return Effect.scoped(Effect.gen(function*() {
            const lease = yield* lock.acquire(name, { timeout: Duration.seconds(30) })
            const n = (inside.get(name) ?? 0) + 1
            inside.set(name, n)
            if (n > 1) overlaps++
            tokens.set(name, [...(tokens.get(name) ?? []), lease.token])
            // Held across a yield, so that the other fibers run (and would see an overlap) meanwhile.
            yield* Effect.yieldNow()
            inside.set(name, inside.get(name)! - 1)
          }))
        }, { discard: true }), { concurrency: "unbounded", discard: true })
      expect(overlaps).toBe(0)
      for (const name of names) {
        const seen = tokens.get(name)!
        expect(seen.every((token, i) => i === 0 || token > seen[i - 1]!), `${name}: ${seen.join(", ")}`).toBe(true)
      }
      expect([...tokens.values()].reduce((sum, seen) => sum + seen.length, 0)).toBe(16 * 15)
      // Statements of different names met in the queue: some went out together.
      expect(lane.batchesSent()).toBeGreaterThan(batchesBefore)
    }))

  it.scoped("a batch never waits for a row lock: a name whose row another transaction holds is left out, its request goes alone and waits, the others are done at once", () =>
    Effect.gen(function*() {
      const application = freshName("batch-skip")
      const { lane, lock } = yield* process1(application)
      const [heldRow, freeRow, fresh] = ["skip-held", "skip-free", "skip-fresh"].map(freshName)
      const letGo = yield* Deferred.make<void>()
      const both = yield* Deferred.make<void>()
      let held = 0
      const holders = yield* Effect.forkAll([heldRow!, fresh!].map((name) =>
        Effect.scoped(Effect.gen(function*() {
          yield* lock.acquire(name)
          if (++held === 2) yield* Deferred.succeed(both, undefined)
          yield* Deferred.await(letGo)
        }))
      ))
      yield* Deferred.await(both)
      // `freeRow` has a row and no lease.
      yield* Effect.scoped(lock.acquire(freeRow!))
      const client = new pg.Client({ connectionString: db.url })
      yield* Effect.promise(() => client.connect())
      yield* Effect.addFinalizer(() => Effect.promise(() => client.end().catch(() => {})))
      yield* Effect.promise(() => client.query("begin"))
      yield* Effect.promise(() => client.query(`select 1 from ${TABLE} where name = any($1) for update`, [[heldRow, freeRow]]))
      const rowOwner = (name: string) =>
        Effect.map(query<{ owner: string | null }>(`select owner from ${TABLE} where name = $1`, [name]), (rows) => rows[0]?.owner ?? null)
      const stillLocked = lockWaitsOf(db.url, application)

      // Give-backs: `fresh`'s in the batch at once, `heldRow`'s alone, waiting for the transaction.
      const first = yield* blockConnection(lock, application)
      const before = lane.batchesSent()
      yield* Deferred.succeed(letGo, undefined)
      yield* waitFor("2 give-backs queued for the connection", Effect.sync(() => lane.queuedStatements() === 2), Duration.seconds(10))
      yield* first.unblock
      yield* waitFor("fresh's lease given back", Effect.map(rowOwner(fresh!), (owner) => owner === null), Duration.seconds(10))
      expect(lane.batchesSent()).toBe(before + 1)
      yield* waitFor("heldRow's give-back waiting for the row", Effect.map(stillLocked, (n) => n === 1), Duration.seconds(10))
      expect(yield* rowOwner(heldRow!)).not.toBeNull()
      yield* Effect.promise(() => client.query("commit"))
      yield* Fiber.join(holders)
      yield* first.done
      expect(yield* rowOwner(heldRow!)).toBeNull()

      // Acquires: `fresh` granted by the batch at once, `freeRow` alone, waiting for the transaction.
      yield* Effect.promise(() => client.query("begin"))
      yield* Effect.promise(() => client.query(`select 1 from ${TABLE} where name = $1 for update`, [freeRow]))
      const second = yield* blockConnection(lock, application)
      const beforeAcquires = lane.batchesSent()
      const { done: takers, granted: grants, letGo: end } = yield* holdEach(lock, [freeRow!, fresh!])
      yield* waitFor("2 acquires queued for the connection", Effect.sync(() => lane.queuedStatements() === 2), Duration.seconds(10))
      yield* second.unblock
      yield* Deferred.await(grants[1]!)
      expect(lane.batchesSent()).toBe(beforeAcquires + 1)
      yield* waitFor("freeRow's acquire waiting for the row", Effect.map(stillLocked, (n) => n === 1), Duration.seconds(10))
      expect(yield* Deferred.isDone(grants[0]!)).toBe(false)
      yield* Effect.promise(() => client.query("commit"))
      yield* Deferred.await(grants[0]!)
      yield* end
      yield* takers
      yield* second.done
    }))

  it.scoped("a batch the server refuses as a whole (cancelled as it waits for another's first insert of a name) is not lost: every request is granted", () =>
    Effect.gen(function*() {
      const application = freshName("batch-refused")
      const { lane, lock } = yield* process1(application)
      const [raced, other] = ["refused-raced", "refused-other"].map(freshName)
      const batch = yield* batchWaitingForInsert({ lane, lock }, application, [raced!, other!], holdEach(lock, [raced!, other!]))
      const { done: takers, granted: grants, letGo: end } = batch.started
      const before = batch.before
      // Refused by the server (57014): nothing of the batch committed, its session is fine.
      yield* query("select pg_cancel_backend($1)", [batch.pid])
      // Each goes alone now; `raced`'s own acquire waits for the other's insert in turn (on the
      // only connection), until that transaction rolls back.
      yield* waitFor(
        "the refused batch's requests sent alone",
        Effect.map(
          query<{ n: number }>(
            `select count(*)::int as n from pg_stat_activity where application_name = $1 and wait_event_type = 'Lock'
               and query not like '%with ordinality as i(name, owner, waiter%'`,
            [application]
          ),
          (rows) => rows[0]!.n === 1
        ),
        Duration.seconds(10)
      )
      expect(lane.batchesSent()).toBe(before + 1)
      yield* batch.rollback
      yield* Deferred.await(grants[0]!)
      yield* Deferred.await(grants[1]!)
      yield* end
      yield* takers
      yield* batch.blocked.done
    }))
  it.scoped("a batch whose connection is terminated as it runs fails each of its requests with a backend error (their outcome unknown) and leaves nothing held: another process takes every name", () =>
    Effect.gen(function*() {
      const application = freshName("batch-terminated")
      const { lane, lock } = yield* process1(application)
      const other = yield* process1(freshName("batch-terminated-other"))
      const [raced, plain] = ["terminated-raced", "terminated-plain"].map(freshName)
      const batch = yield* batchWaitingForInsert(
        { lane, lock },
        application,
        [raced!, plain!],
        Effect.forkAll([raced!, plain!].map((name) => Effect.either(Effect.scoped(lock.acquire(name, { timeout: Duration.seconds(20) })))))
      )
      // The session ends (57P01): whether the batch committed is unknown to the layer, so no
      // request is sent again as it was; each fails, and what it may have been granted is given back.
      yield* query("select pg_terminate_backend($1)", [batch.pid])
      const outcomes = yield* Fiber.join(batch.started)
      // Each fails with the termination itself (57P01), not after a statement of its own sent alone.
      for (const outcome of outcomes) {
        expect(outcome).toMatchObject({ _tag: "Left", left: { _tag: "LockBackendError", cause: { code: "57P01" } } })
      }
      yield* batch.rollback
      yield* batch.blocked.done
      yield* freeForAnother(other.lock, [raced!, plain!])
    }))
  it.scoped("a batch whose requests' statement bounds all run out fails every request with that timeout, and leaves nothing held", () =>
    Effect.gen(function*() {
      const application = freshName("batch-bound")
      // A short bound, long enough for the set-up below to queue the batch before the blocker's runs out.
      const { lane, lock } = yield* process1(application, Duration.seconds(2))
      const other = yield* process1(freshName("batch-bound-other"))
      const [raced, plain] = ["bound-raced", "bound-plain"].map(freshName)
      // The blocker keeps its lease until the batch has ended: its give-back, queued behind the
      // batch, would otherwise have its own bound run out too (and its lease left to its ttl).
      const batchEnded = yield* Deferred.make<void>()
      const batch = yield* batchWaitingForInsert(
        { lane, lock },
        application,
        [raced!, plain!],
        Effect.forkAll([raced!, plain!].map((name) => Effect.either(Effect.scoped(lock.acquire(name, { timeout: Duration.seconds(20) }))))),
        Deferred.await(batchEnded)
      )
      // Each request fails at its own bound; the last one's ends the batch (its connection is
      // destroyed): the timeout, not "the session was destroyed".
      const outcomes = yield* Fiber.join(batch.started)
      for (const outcome of outcomes) {
        expect(outcome).toMatchObject({ _tag: "Left", left: { _tag: "LockBackendError" } })
        const cause = outcome._tag === "Left" ? outcome.left.cause : undefined
        expect(String(cause)).toMatch(/did not complete within 2s/)
      }
      yield* Deferred.succeed(batchEnded, undefined)
      yield* batch.rollback
      yield* batch.blocked.done
      yield* freeForAnother(other.lock, [raced!, plain!])
    }))
  it.scoped("a request whose bound runs out while its batch still runs leaves it: the batch goes on, and a request in it whose own bound has time left is answered (granted), not failed with the first one's timeout", () =>
    Effect.gen(function*() {
      const application = freshName("batch-own-bound")
      // 3 s bounds: the blocker's must not run out before the second request is queued 1.5 s in.
      const { lane, lock } = yield* process1(application, Duration.seconds(3))
      const other = yield* process1(freshName("batch-own-bound-other"))
      const [early, late] = ["own-bound-early", "own-bound-late"].map(freshName)
      const batchEnded = yield* Deferred.make<void>()
      const acquireOf = (name: string) =>
        Effect.fork(Effect.either(Effect.scoped(Effect.map(lock.acquire(name, { timeout: Duration.seconds(20) }), (lease) => lease.token))))
      const batch = yield* batchWaitingForInsert(
        { lane, lock },
        application,
        [early!, late!],
        Effect.gen(function*() {
          const first = yield* acquireOf(early!)
          yield* waitFor("the first acquire queued", Effect.sync(() => lane.queuedStatements() === 1), Duration.seconds(5))
          const queuedAt = performance.now()
          // The second request goes once half of the first's bound is gone, on the clock the bounds
          // run on: their bounds then end 1.5 s apart, the window in which the batch is let go.
          yield* waitFor("half of the first request's bound gone", Effect.sync(() => performance.now() - queuedAt >= 1_500), Duration.seconds(10))
          return [first, yield* acquireOf(late!)] as const
        }),
        Deferred.await(batchEnded)
      )
      const [first, second] = batch.started
      // The first request's bound passes while the batch waits for the other transaction's insert.
      const firstOutcome = yield* Fiber.join(first)
      expect(firstOutcome).toMatchObject({ _tag: "Left", left: { _tag: "LockBackendError" } })
      expect(String(firstOutcome._tag === "Left" ? firstOutcome.left.cause : undefined)).toMatch(/did not complete within 3s/)
      // The insert is let go within the second request's bound: the batch answers it.
      yield* batch.rollback
      const secondOutcome = yield* Fiber.join(second)
      expect(secondOutcome).toMatchObject({ _tag: "Right" })
      expect(secondOutcome._tag === "Right" && secondOutcome.right > 0n).toBe(true)
      yield* Deferred.succeed(batchEnded, undefined)
      yield* batch.blocked.done
      // The first request's grant, committed by the batch after it was told the timeout, is given back.
      yield* freeForAnother(other.lock, [early!, late!])
    }))
})

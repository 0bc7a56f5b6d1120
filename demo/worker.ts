/**
 * One demo worker process: competes for one lock forever and, each time it wins, does one round
 * of work ending in a fenced write. Prints what happens as JSON lines for the orchestrator.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import { PgClient } from "@effect/sql-pg"
import { SqliteClient } from "@effect/sql-sqlite-node"
import { Duration, Effect, Layer, Logger, LogLevel, Random, Redacted } from "effect"
import { DistributedLock, Fence, FencingToken, LockError, PgAdvisory, PgLease, RedisLease, SqliteLease } from "effect-lock"
import { applicationName, FENCE_RESOURCE, LOCK_NAME, type WorkerEvent } from "./events.js"

const worker = Number(process.env["DEMO_WORKER"])
const url = process.env["DEMO_URL"] ?? ""
const file = process.env["DEMO_FILE"] ?? ""
const backend = (["advisory", "sqlite", "redis"] as const).find((b) => b === process.env["DEMO_BACKEND"]) ?? "lease"
const redisUrl = process.env["DEMO_REDIS_URL"] ?? ""
const redisPrefix = process.env["DEMO_REDIS_PREFIX"]
const ttl = Duration.millis(Number(process.env["DEMO_TTL_MS"] ?? 2000))
const work = Duration.millis(Number(process.env["DEMO_WORK_MS"] ?? 400))
const send = Duration.millis(Number(process.env["DEMO_SEND_MS"] ?? 300))

const emit = (event: WorkerEvent) =>
  Effect.sync(() => process.stdout.write(`${JSON.stringify({ ...event, t: Date.now(), w: worker })}\n`))

/** The round's write: recorded only if no newer token has written to this resource. */
const fencedWrite = (token: FencingToken.FencingToken) =>
  (backend === "sqlite" ? sqliteFencedWrite(token) : pgFencedWrite(token)).pipe(
    Effect.flatMap((round) => emit({ e: "wrote", token: token.toString(), round }))
  )

/** On PostgreSQL: `Fence.check` in the write's transaction. */
const pgFencedWrite = (token: FencingToken.FencingToken) =>
  Effect.flatMap(SqlClient.SqlClient, (sql) =>
    sql.withTransaction(Effect.gen(function*() {
      yield* Fence.check(FENCE_RESOURCE, token)
      const [row] = yield* sql<{ round: number }>`
        insert into demo_rounds (round, worker, token)
        select coalesce(max(round), 0) + 1, ${worker}, ${token.toString()}::bigint from demo_rounds
        returning round`
      return row!.round
    })))

/**
 * On SQLite (`Fence` is PostgreSQL-only): the same rule in the write's own statement — the row is
 * written only if no higher token has written one — atomic under SQLite's write lock.
 */
const sqliteFencedWrite = (token: FencingToken.FencingToken) =>
  Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    const presented = token.toString()
    const [row] = yield* sql<{ round: number }>`
      insert into demo_rounds (round, worker, token)
      select (select coalesce(max(round), 0) + 1 from demo_rounds), ${worker}, cast(${presented} as integer)
      where cast(${presented} as integer) >= (select coalesce(max(token), 0) from demo_rounds)
      returning round`
    if (row !== undefined) return row.round
    const [current] = yield* sql<{ token: string }>`select cast(max(token) as text) as token from demo_rounds`
    return yield* new LockError.StaleFencingToken({
      resource: FENCE_RESOURCE,
      presented: token,
      current: FencingToken.make(BigInt(current!.token))
    })
  })

const round = Effect.gen(function*() {
  const lease = yield* DistributedLock.acquire(LOCK_NAME, { ttl })
  const token = lease.token.toString()
  yield* emit({ e: "acquired", token })
  yield* Effect.addFinalizer(() => emit({ e: "released", token }))
  const outcome = yield* DistributedLock.guard(
    lease,
    Effect.gen(function*() {
      yield* Effect.sleep(work)
      if (!(yield* lease.isHeld)) return
      // From here the write is on its way and is not called back — a request already on the
      // wire, `send` long — so when the holder is frozen meanwhile, only the fence can refuse it.
      yield* Effect.uninterruptible(
        Effect.zipRight(emit({ e: "writing", token }), Effect.zipRight(Effect.sleep(send), fencedWrite(lease.token)))
      )
    })
  ).pipe(
    // A write whose connection is killed under it dies in @effect/sql-pg (its COMMIT is orDie):
    // the worker reports it and goes on competing, as for any other failed round.
    Effect.catchAllDefect((defect) => Effect.fail({ _tag: "Defect" as const, message: String(defect) })),
    Effect.either
  )
  if (outcome._tag === "Left") {
    const error = outcome.left
    if (error._tag === "LockLost") {
      yield* emit({ e: "lost", token, reason: error.reason })
      return
    }
    if (error._tag === "StaleFencingToken") {
      yield* emit({ e: "stale-rejected", token, current: error.current.toString() })
    } else {
      yield* emit({ e: "error", message: error.message })
    }
    // The round failed on its own; if the lease went away meanwhile (the watcher already knows), say why.
    const lost = yield* Effect.flip(lease.lost).pipe(Effect.timeout("2 seconds"), Effect.option)
    if (lost._tag === "Some") yield* emit({ e: "lost", token, reason: lost.value.reason })
  }
}).pipe(Effect.scoped)

const program = Effect.gen(function*() {
  yield* emit({ e: "ready" })
  while (true) {
    yield* round.pipe(Effect.catchAll((error) => emit({ e: "error", message: error.message })))
    yield* Effect.sleep(Duration.millis(yield* Random.nextIntBetween(50, 250)))
  }
})

const pgLive = PgClient.layer({ url: Redacted.make(url), applicationName: applicationName(worker) })
const live: Layer.Layer<DistributedLock.DistributedLock | SqlClient.SqlClient, unknown> = backend === "sqlite"
  ? Layer.provideMerge(SqliteLease.layer({ ttl, applicationName: applicationName(worker) }), SqliteClient.layer({ filename: file }))
  : backend === "redis"
  // The lock on Redis (its connections named after the worker, so the demo can kill them), the fenced write on PostgreSQL.
  ? Layer.merge(RedisLease.layer({ url: redisUrl, prefix: redisPrefix, ttl, applicationName: applicationName(worker) }), pgLive)
  : Layer.provideMerge(
    backend === "lease" ? PgLease.layer({ ttl }) : PgAdvisory.layer({ url: Redacted.make(url), applicationName: applicationName(worker) }),
    pgLive
  )

const fiber = Effect.runFork(
  program.pipe(
    Effect.provide(live),
    Effect.catchAllCause(Effect.logError),
    // The timeline reports what happens; the library's own warnings would repeat it.
    Logger.withMinimumLogLevel(LogLevel.Error)
  )
)
// A clean stop releases the lock through the scopes before the process exits.
process.on("SIGTERM", () => Effect.runFork(fiber.interruptAsFork(fiber.id())))
fiber.addObserver(() => process.exit(0))

/**
 * One chaos worker process: loops on one lock forever. Each round, holding the lock, it reads the
 * last round of the write log, waits a deliberate gap (a second holder would read the same round
 * in it), then in one transaction checks the lease's fencing token with `Fence.check` and writes
 * round + 1. With `sharedChance` a round may be a reader's instead: it holds the lock `shared`,
 * reads the write log twice a gap apart (a writer holding meanwhile would show between the two
 * reads) and writes nothing. It reports on stdout (JSON lines, see `protocol.ts`) and obeys the driver's stdin
 * commands: an event-loop stall, its own pool saturated, stop.
 *
 * It is an ordinary user of the library's public API (`withLock`-style guard, interruptible
 * write): whatever the checker finds, a user's program would do the same. The one exception is
 * `broken` in its config (protocol.ts), set only by the test that shows the checker catches a
 * write begun after a reported loss.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import * as PgClient from "@effect/sql-pg/PgClient"
import * as Cause from "effect/Cause"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Layer from "effect/Layer"
import * as Logger from "effect/Logger"
import * as Option from "effect/Option"
import * as LogLevel from "effect/LogLevel"
import * as Redacted from "effect/Redacted"
import * as Runtime from "effect/Runtime"
import * as Schedule from "effect/Schedule"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as Fence from "effect-lock/Fence"
import type { FencingToken } from "effect-lock/FencingToken"
import type { Lease } from "effect-lock/Lease"
import type { LockLost } from "effect-lock/LockError"
import * as PgAdvisory from "effect-lock/PgAdvisory"
import * as PgLease from "effect-lock/PgLease"
import * as RedisLease from "effect-lock/RedisLease"
import * as Readline from "node:readline"
import { deriveSeed, makePrng } from "./prng.js"
import {
  appName,
  type Command,
  EXIT_LAYER_FAILED,
  FENCE_RESOURCE,
  GAP_MS,
  LOCK_NAME,
  LONG_WORK_TTLS,
  lockName,
  ROUNDS_TABLE,
  SHORT_WORK_MS,
  WORKER_ENV,
  type WorkerConfig,
  type WorkerEvent
} from "./protocol.js"
import { blockThread } from "../tools/blockThread.js"

/** Bound on one wait for the lock: a wait this long with four workers means nobody is writing. */
const ACQUIRE_TIMEOUT = Duration.seconds(30)
/** Pause after an error before competing again, so a down server is not hammered. */
const ERROR_BACKOFF = Duration.millis(200)
/** Pool checkout bound: a saturated pool fails the write typed instead of waiting forever. */
const POOL_CONNECT_TIMEOUT = Duration.seconds(5)
/** A broken worker's stall in its first round, in ttls: past the lease's safe time. */
const BROKEN_STALL_TTLS = 1.5
/** A lockless reader (`broken: "shared-overlap"`) claims this token: above any real grant's. */
const BROKEN_READER_TOKEN = String(Number.MAX_SAFE_INTEGER)
/** How often, and how long at most, a lockless reader looks for a write committed after its first read. */
const BROKEN_POLL = { every: Duration.millis(50), times: 200 } as const

const config = JSON.parse(process.env[WORKER_ENV] ?? "null") as WorkerConfig | null
if (config === null) {
  console.error(`chaos worker: ${WORKER_ENV} is not set; the driver (chaos/main.ts) starts workers`)
  process.exit(2)
}
const { slot, incarnation } = config
const prng = makePrng(deriveSeed(config.seed, `worker-${slot}-${incarnation}`))
const ttl = Duration.millis(config.ttlMs)

/** Events printed so far by this process: an event's `n`. */
let printed = 0

/**
 * Prints one event and returns its stamp. stdout to a pipe is synchronous on Linux: an event
 * printed before a SIGKILL is not lost. `t` and `n` are taken in the same synchronous step as the
 * print, so two events of this process are in the order they happened by `n` (and by `t`, ties aside).
 */
const print = (event: WorkerEvent): { readonly t: number; readonly n: number } => {
  const stamp = { t: Date.now(), n: ++printed }
  process.stdout.write(`${JSON.stringify({ ...event, ...stamp, w: slot, i: incarnation })}\n`)
  return stamp
}
const emit = (event: WorkerEvent) => Effect.sync(() => void print(event))

/** Work before the read: mostly short (many handoffs), sometimes long (renewals while held). */
const workMillis = (): number => {
  // Every draw is made every round, so a worker's PRNG stream does not depend on which kind it got.
  const long = prng.chance(LONG_WORK_TTLS.chance)
  const short = prng.int(SHORT_WORK_MS.min, SHORT_WORK_MS.max)
  const longMillis = prng.int(Math.round(LONG_WORK_TTLS.min * config.ttlMs), Math.round(LONG_WORK_TTLS.max * config.ttlMs))
  return long ? longMillis : short
}

/**
 * The fenced write of `round`, in one transaction: `Fence.check` with `token`, then the insert.
 * The write's begin is stamped by printing `writing` in the fiber that writes, after the fence
 * check returned and right before the insert is handed to the driver (no wait in between), and
 * the stamp goes into the row: the checker compares it with this acquisition's `lost` event,
 * printed by the same process, by their place in its output (`n`). A write begun before the loss
 * was reported may still commit later (its outcome was unknown); one begun after is a violation.
 * Under `guard`, a body resuming after the loss is stopped before its next step, so it never
 * prints `writing` after `lost`.
 */
const fencedWrite = (token: FencingToken, acq: string, round: number) =>
  Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    const tokenText = token.toString()
    const seq = yield* sql.withTransaction(
      Effect.gen(function*() {
        yield* Fence.check(FENCE_RESOURCE, token)
        const began = yield* Effect.sync(() => print({ e: "writing", acq, token: tokenText, round }))
        const [row] = yield* sql<{ seq: string }>`
          insert into ${sql(ROUNDS_TABLE)} (round, worker, token, acquisition, began_at, began_n, written_at)
          values (${round}, ${slot}, ${tokenText}::bigint, ${acq}, ${began.t}, ${began.n}, clock_timestamp())
          returning seq::text as seq`
        return row?.seq ?? "?"
      })
    )
    yield* emit({ e: "wrote", acq, token: tokenText, round, seq })
  })

/** The next round: one more than the last in the write log. */
const nextRound = Effect.gen(function*() {
  const sql = yield* SqlClient.SqlClient
  const [last] = yield* sql<{ last: number }>`select coalesce(max(round), 0)::int as last from ${sql(ROUNDS_TABLE)}`
  return (last?.last ?? 0) + 1
})

/**
 * A reader's look at the write log, in one statement: the statement's snapshot says exactly which
 * rows it saw (a row is seen iff its `xid` is below `xmin`, or below `xmax` and not in the list of
 * those in progress). `read` is printed in the body's fiber right after the statement returned, as
 * `writing` is in the fiber that writes: the checker compares it with this acquisition's `lost`.
 */
const readLog = (acq: string, token: string, which: 1 | 2) =>
  Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    const [row] = yield* sql<{ snapshot: string; last: number }>`
      select pg_current_snapshot()::text as snapshot, coalesce(max(round), 0)::int as last from ${sql(ROUNDS_TABLE)}`
    const last = row?.last ?? 0
    yield* emit({ e: "read", acq, token, which, snapshot: row?.snapshot ?? "", last })
    return last
  })

/**
 * A reader's round under a shared lease: the same work, a first read, the gap, a second read, no
 * write. A writer holding at once would have its write land between the two reads.
 */
const readTwice = (lease: Lease, acq: string) =>
  Effect.gen(function*() {
    const token = lease.token.toString()
    yield* Effect.sleep(Duration.millis(workMillis()))
    yield* readLog(acq, token, 1)
    yield* Effect.sleep(Duration.millis(prng.int(GAP_MS.min, GAP_MS.max)))
    yield* readLog(acq, token, 2)
  })

/**
 * Broken on purpose (`broken: "shared-overlap"`): a reader that never acquires. It reports a shared
 * grant with a token above any real one, reads, waits until the log holds a round above the last
 * it saw (another worker wrote meanwhile: it holds the lock the reader claims), and reads again.
 */
const readWithoutLock = (acq: string) =>
  Effect.gen(function*() {
    yield* emit({ e: "acquired", acq, token: BROKEN_READER_TOKEN, mode: "shared" })
    const seen = yield* readLog(acq, BROKEN_READER_TOKEN, 1)
    // Polled, not timed: the second read must come after a write that the first did not see.
    yield* nextRound.pipe(
      Effect.repeat({ until: (next) => next > seen + 1, schedule: Schedule.spaced(BROKEN_POLL.every), times: BROKEN_POLL.times })
    )
    yield* readLog(acq, BROKEN_READER_TOKEN, 2)
    yield* emit({ e: "released", acq, token: BROKEN_READER_TOKEN })
  }).pipe(Effect.catchAll((error) => emit({ e: "error", acq, tag: error._tag, message: error.message })))

/** The round's work: read, gap, fenced write. Interruptible throughout, like any `withLock` body. */
const work = (lease: Lease, acq: string, first: boolean) =>
  Effect.gen(function*() {
    // Broken on purpose: a stall past the safe time, so that this holder loses its lease.
    if (config.broken === "write-after-loss" && first) stall(BROKEN_STALL_TTLS * config.ttlMs)
    yield* Effect.sleep(Duration.millis(workMillis()))
    const round = yield* nextRound
    // The deliberate gap: a second holder in it would read the same last round and write it twice.
    yield* Effect.sleep(Duration.millis(prng.int(GAP_MS.min, GAP_MS.max)))
    yield* fencedWrite(lease.token, acq, round)
  })

/**
 * Broken on purpose (`broken: "write-after-loss"`): what a program that ignores `LockLost` does —
 * it goes on writing after the loss was reported, on a daemon fiber outside the guard, which the
 * library cannot stop. Retried while the server is unreachable; a refusal by the fence ends it.
 */
const writeAfterLoss = (token: FencingToken, acq: string) =>
  Effect.gen(function*() {
    const round = yield* nextRound
    yield* fencedWrite(token, acq, round)
  }).pipe(
    Effect.catchTag("StaleFencingToken", (error) => emit({ e: "refused", acq, token: token.toString(), current: error.current.toString() })),
    Effect.retry({ times: 20, schedule: Schedule.spaced(ERROR_BACKOFF) }),
    Effect.catchAllCause((cause) => emit({ e: "error", acq, tag: "broken-write", message: Cause.pretty(cause).split("\n")[0] ?? "failed" })),
    Effect.uninterruptible,
    Effect.forkDaemon,
    Effect.asVoid
  )

/** Whether this round is a reader's: drawn only with readers on, so that other runs keep their PRNG streams. */
const drawShared = (): boolean => (config.sharedChance ?? 0) > 0 && prng.chance(config.sharedChance ?? 0)

/** One acquisition: acquire, watch for loss, run the work (or a reader's reads) under `guard`, release. */
const round = (n: number) =>
  Effect.gen(function*() {
    const acq = `${slot}.${incarnation}.${n}`
    // Broken on purpose: after a round of its own (so the log has a row), worker 1 reads without the lock.
    if (config.broken === "shared-overlap" && slot === 1 && n === 2) return yield* readWithoutLock(acq)
    const shared = drawShared()
    const state: { token?: string; lost: boolean } = { lost: false }
    const reportLoss = (error: LockLost) =>
      Effect.suspend(() => {
        if (state.lost) return Effect.void
        state.lost = true
        const report = emit({ e: "lost", acq, token: error.token.toString(), reason: error.reason })
        // Broken on purpose: a write begun after the report.
        return config.broken === "write-after-loss" ? Effect.zipRight(report, writeAfterLoss(error.token, acq)) : report
      })
    const held = Effect.gen(function*() {
      const lease = yield* DistributedLock.acquire(LOCK_NAME, { ttl, timeout: ACQUIRE_TIMEOUT, mode: shared ? "shared" : "exclusive" })
      state.token = lease.token.toString()
      yield* emit(shared ? { e: "acquired", acq, token: state.token, mode: "shared" } : { e: "acquired", acq, token: state.token })
      // Reports the moment this process learns of the loss, not when the body has stopped.
      yield* Effect.forkScoped(Effect.catchAll(lease.lost, reportLoss))
      const body = shared ? readTwice(lease, acq) : work(lease, acq, n === 1)
      const outcome = yield* Effect.either(DistributedLock.guard(lease, body))
      if (outcome._tag === "Right") return
      const error = outcome.left
      switch (error._tag) {
        case "LockLost":
          return yield* reportLoss(error)
        case "StaleFencingToken":
          return yield* emit({ e: "refused", acq, token: state.token, current: error.current.toString() })
        default:
          return yield* emit({ e: "error", acq, tag: error._tag, message: error.message })
      }
    })
    const started = Date.now()
    // Interruption (the driver's stop) goes through; any other failure or defect ends only this round.
    const failure = yield* Effect.scoped(held).pipe(
      Effect.as(Option.none<Cause.Cause<DistributedLock.AcquireError>>()),
      Effect.catchAllCause((cause) => Cause.isInterruptedOnly(cause) ? Effect.failCause(cause) : Effect.succeedSome(cause))
    )
    // The scope has closed: the lock was released (or given back) unless it was lost.
    if (state.token !== undefined && !state.lost) yield* emit({ e: "released", acq, token: state.token })
    if (Option.isNone(failure)) return
    const error = Cause.failureOption(failure.value)
    if (Option.isSome(error) && error.value._tag === "LockTimeout") return yield* emit({ e: "timeout", waitedMs: Date.now() - started })
    yield* Option.match(error, {
      // A defect, e.g. a COMMIT on a killed connection, which sql-pg makes a defect.
      onNone: () => emit({ e: "error", acq, tag: "defect", message: Cause.pretty(failure.value).split("\n")[0] ?? "defect" }),
      onSome: (e) => emit({ e: "error", acq, tag: e._tag, message: e.message })
    })
    // Paced, so that a server that is down is not hammered.
    yield* Effect.sleep(ERROR_BACKOFF)
  })

/** All of the pool's connections busy in slow queries, as an application under load would keep them. */
const saturate = (ms: number) =>
  Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
    yield* emit({ e: "saturate-begin", connections: config.poolSize, ms })
    const results = yield* Effect.forEach(
      Array.from({ length: config.poolSize }),
      () => Effect.either(sql`select pg_sleep(${ms / 1000})`),
      { concurrency: "unbounded" }
    )
    yield* emit({ e: "saturate-end", failed: results.filter((r) => r._tag === "Left").length })
  })

/** Blocks the event loop: timers and sockets are serviced only afterwards, as after a GC pause. */
const stall = (ms: number): void => {
  print({ e: "stall-begin", ms })
  // Nothing else in this process runs; the thread is parked, not spinning (tools/blockThread).
  blockThread(ms)
  print({ e: "stall-end", ms })
}

/** Stops the round loop; its scopes close, so whatever is held is released before the process exits. */
let stop = (): void => {}

const program = Effect.gen(function*() {
  const runtime = yield* Effect.runtime<SqlClient.SqlClient>()
  const main = yield* Effect.fork(
    Effect.gen(function*() {
      for (let n = 1;; n++) {
        yield* round(n)
        yield* Effect.sleep(Duration.millis(prng.int(20, 150)))
      }
    })
  )
  stop = () => void Effect.runFork(Fiber.interrupt(main))
  const lines = Readline.createInterface({ input: process.stdin })
  lines.on("line", (line) => {
    const command = JSON.parse(line) as Command
    switch (command.c) {
      case "stall":
        return stall(command.ms)
      case "saturate":
        return void Runtime.runFork(runtime)(saturate(command.ms))
      case "stop":
        return stop()
    }
  })
  // A closed stdin means the driver is gone: stop cleanly too.
  lines.on("close", () => stop())
  yield* emit({ e: "ready" })
  yield* Fiber.await(main)
  lines.close()
})

const SqlLive = PgClient.layer({
  url: Redacted.make(config.url),
  applicationName: appName(slot),
  maxConnections: config.poolSize,
  connectTimeout: POOL_CONNECT_TIMEOUT
})
const LockLive = config.backend === "pg-lease"
  ? PgLease.layer({ ttl })
  : config.backend === "redis"
  // Its connections are named `<lockName>:<role>`: the driver kills them by name (session-terminate).
  ? RedisLease.layer({ url: config.redis?.url, prefix: config.redis?.prefix, ttl, applicationName: lockName(slot) })
  : PgAdvisory.layer({ url: Redacted.make(config.url), applicationName: lockName(slot) })

Effect.runFork(
  Effect.scoped(program).pipe(
    Effect.provide(Layer.provideMerge(LockLive, SqlLive)),
    Effect.catchAll((error) =>
      Effect.zipRight(
        emit({ e: "error", tag: error._tag, message: `layer: ${error.message}` }),
        Effect.sync(() => process.exit(EXIT_LAYER_FAILED))
      )
    ),
    // The library's warnings go to stderr (the driver keeps them in the run's log), never into the events.
    Effect.provide(Logger.replace(Logger.defaultLogger, Logger.withConsoleError(Logger.logfmtLogger))),
    Logger.withMinimumLogLevel(LogLevel.Info)
  )
).addObserver((exit) => process.exit(exit._tag === "Success" ? 0 : 1))
process.on("SIGTERM", () => stop())

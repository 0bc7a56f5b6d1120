/**
 * Scenario 3 — scale: one process holds 1,000 and 10,000 locks. Measured: time to acquire
 * (and then release) them all, server sessions used (pg_stat_activity by application_name,
 * sampled every 100 ms, peak), Node heap and RSS after a full GC relative to before the layer
 * was built, and — while the locks sit held and idle — every statement the process sends:
 * PgLease's renewal statements counted at its connection lane (exact) and the database's committed
 * transactions (pg_stat_database, server side).
 */
import { PgClient } from "@effect/sql-pg"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Redacted from "effect/Redacted"
import * as Scope from "effect/Scope"
import type pg from "pg"
import * as DistributedLock from "../../src/DistributedLock.js"
import * as LeaseSql from "../../src/internal/lease/pg/sql.js"
import * as PgAdvisory from "../../src/PgAdvisory.js"
import * as PgLease from "../../src/PgLease.js"
import type { Context, Scenario } from "../lib/context.js"
import { readMemory } from "../lib/memory.js"
import { ADMIN_APPLICATION_NAME, committedTransactions, countSessions, createDatabase, type Database } from "../lib/postgres.js"
import { connect } from "../lib/rawPg.js"
import * as Report from "../lib/report.js"
import type { Target } from "../lib/report.js"
import { reasonOf } from "../lib/rounds.js"
import { openRuntime } from "../lib/runtime.js"
import { spread, type Spread } from "../lib/stats.js"
import { countingLane, type LoggedStatement, StatementLog } from "../lib/statementLog.js"
import * as PgLeaseMake from "../../src/internal/lease/pg/make.js"
import { now, sleep } from "../lib/timing.js"

/** Acquisitions in flight at once while taking all the locks. */
const ACQUIRE_CONCURRENCY = 64
/** PgAdvisory's default, stated here so the target can be checked against it. */
const ADVISORY_MAX_SESSIONS = 4
const SAMPLE_EVERY_MS = 100
/** Longer than the at-most-once-a-second publication of a backend's statistics. */
const STATS_SETTLE_MS = 1_100
/** Pause before the baseline memory reading, for the previous round's sockets to close. */
const MEMORY_SETTLE_MS = 500

interface ScaleRound {
  readonly acquireMs: number
  readonly releaseMs: number
  readonly peakSessions: number
  readonly heldSessions: number
  readonly heapBytes: number
  readonly rssBytes: number
  readonly heldRssBytes: number
  /** Locks no longer held when the hold ended (the library declared them lost). */
  readonly lost: number
  /** Idle hold (PgLease): length, statements by kind (client side), transactions (server side). */
  readonly idle: {
    readonly ms: number
    readonly renewPeriodMs: number | undefined
    readonly renewStatements: number
    readonly renewedRows: number
    readonly otherStatements: number
    readonly largestBatch: number
    /** Statements of each renewal tick in the window. */
    readonly ticks: ReadonlyArray<number>
    /** Committed transactions of the database per second over the window (server side). */
    readonly serverTransactionsPerSecond: number
  } | undefined
}

type Kind = "pg-lease" | "pg-advisory"

interface ScaleSubject {
  readonly kind: Kind
  readonly count: number
  readonly applicationName: string
}

/** Samples the session count of one application until stopped; keeps the peak. */
const sampleSessions = (admin: pg.Client, database: string, applicationName: string) => {
  let peak = 0
  let running = true
  const loop = (async () => {
    while (running) {
      peak = Math.max(peak, await countSessions(admin, database, applicationName))
      await sleep(SAMPLE_EVERY_MS)
    }
  })()
  return {
    stop: async (): Promise<number> => {
      running = false
      await loop
      return peak
    }
  }
}

/**
 * Renewal statements grouped into ticks. The registry renews everything due in one tick as
 * consecutive full batches followed by one partial batch, so a statement with fewer rows than a
 * full batch (or a pause longer than `gap`) ends a tick.
 */
const ticksOf = (entries: ReadonlyArray<LoggedStatement>, batchSize: number, gap: number): Array<number> => {
  const ticks: Array<number> = []
  let open = false
  let last = Number.NEGATIVE_INFINITY
  for (const entry of entries) {
    if (!open || entry.at - last > gap) ticks.push(0)
    ticks[ticks.length - 1]! += 1
    open = entry.batch >= batchSize
    last = entry.at
  }
  return ticks
}

const renewText = LeaseSql.renew(LeaseSql.parseTable(PgLease.DEFAULT_TABLE) as LeaseSql.TableRef)

const runOnce = async (
  context: Context,
  database: Database,
  admin: pg.Client,
  sampling: pg.Client,
  subject: ScaleSubject,
  ttlMs: number,
  idleMs: number,
  measureIdle: boolean
): Promise<ScaleRound> => {
  // The previous round's sessions and buffers are freed as their close events arrive: let them.
  await sleep(MEMORY_SETTLE_MS)
  const before = readMemory()
  const log = new StatementLog()
  const layer: Layer.Layer<DistributedLock.DistributedLock, unknown> = subject.kind === "pg-lease"
    ? Layer.provide(
      DistributedLock.layerBackend(PgLeaseMake.makeBackend({ ttl: ttlMs }, countingLane(log))),
      PgClient.layer({ url: Redacted.make(database.url), applicationName: subject.applicationName })
    )
    : PgAdvisory.layer({ url: database.url, applicationName: subject.applicationName })
  // Its own session: a pg.Client runs one statement at a time, and the sampler never waits.
  const sampler = sampleSessions(sampling, database.name, subject.applicationName)
  const runtime = await openRuntime(layer)
  try {
    const names = Array.from({ length: subject.count }, (_, i) => `scale-${subject.kind}-${i}`)
    const t0 = now()
    // Each lock gets its own scope, so all can be released concurrently afterwards.
    const held = await runtime.run(
      Effect.forEach(
        names,
        (name) =>
          Effect.gen(function*() {
            const scope = yield* Scope.make()
            const lease = yield* Scope.extend(DistributedLock.acquire(name), scope)
            return { scope, lease }
          }),
        { concurrency: ACQUIRE_CONCURRENCY }
      )
    )
    const scopes = held.map((h) => h.scope)
    const acquireMs = now() - t0
    const memory = readMemory()
    const heldSessions = await countSessions(admin, database.name, subject.applicationName)

    // Idle hold (PgLease, measured rounds): nothing but the library's own background work runs
    // now. Backends publish their transaction counts when idle, at most once a second: settle
    // before the first reading, and divide the server's count by the time between the readings.
    let idle: ScaleRound["idle"] | undefined
    if (measureIdle) {
      await sleep(STATS_SETTLE_MS)
      const commitsBefore = await committedTransactions(admin, database.name)
      const idleStart = now()
      await sleep(idleMs)
      const idleEnd = now()
      await sleep(STATS_SETTLE_MS)
      const commitsAfter = await committedTransactions(admin, database.name)
      const serverSeconds = (now() - idleStart) / 1000
      const inWindow = log.between(idleStart, idleEnd)
      const renewals = inWindow.filter((e) => e.text === renewText)
      idle = {
        ms: idleEnd - idleStart,
        renewPeriodMs: ttlMs / 3,
        renewStatements: renewals.length,
        renewedRows: renewals.reduce((n, e) => n + e.batch, 0),
        otherStatements: inWindow.length - renewals.length,
        largestBatch: renewals.reduce((n, e) => Math.max(n, e.batch), 0),
        ticks: ticksOf(renewals, PgLease.defaults.renewBatchSize, ttlMs / 12),
        serverTransactionsPerSecond: (commitsAfter - commitsBefore) / serverSeconds
      }
    }

    // Everything was held until now unless the library said otherwise (a renewal that fell behind).
    const lost = (await runtime.run(Effect.forEach(held, (h) => h.lease.isHeld))).filter((isHeld) => !isHeld).length

    const t1 = now()
    await runtime.run(Effect.forEach(scopes, (scope) => Scope.close(scope, Exit.void), { concurrency: ACQUIRE_CONCURRENCY, discard: true }))
    const releaseMs = now() - t1
    context.log(
      `  scale ${subject.kind} ${subject.count}: acquired in ${acquireMs.toFixed(0)} ms, released in ${releaseMs.toFixed(0)} ms`
    )
    return {
      acquireMs,
      releaseMs,
      peakSessions: await sampler.stop(),
      heldSessions,
      heapBytes: memory.heapUsedBytes - before.heapUsedBytes,
      rssBytes: memory.rssBytes - before.rssBytes,
      heldRssBytes: memory.rssBytes,
      lost,
      idle
    }
  } finally {
    await sampler.stop()
    await runtime.close()
  }
}

export interface IdleSummary {
  /** Renewal statements per renewal period (ttl/3), per round. */
  readonly renewStatementsPerPeriod: Spread
  readonly renewedRowsPerStatement: Spread
  readonly largestTick: number
  readonly ticksPerPeriod: Spread
  readonly largestBatch: number
  readonly otherStatements: number
  readonly serverTransactionsPerSecond: Spread
}

export interface ScaleRow {
  readonly kind: Kind
  readonly count: number
  readonly ttlMs: number | undefined
  readonly result:
    | {
      readonly _tag: "Measured"
      readonly rounds: ReadonlyArray<ScaleRound>
      readonly acquireMs: Spread
      readonly acquirePerSecond: Spread
      readonly releaseMs: Spread
      readonly peakSessions: number
      readonly heldSessions: number
      readonly heapBytes: Spread
      readonly rssBytes: Spread
      readonly heldRssBytes: Spread
      /** Most locks lost during one round's hold. */
      readonly lost: number
      /** What the process sent while the locks sat held (PgLease only). */
      readonly idle: IdleSummary | undefined
    }
    | { readonly _tag: "Skipped"; readonly reason: string }
}

export interface ScaleResult {
  readonly rows: ReadonlyArray<ScaleRow>
  readonly acquireConcurrency: number
  readonly idleMs: number
  readonly leaseTtlMs: number
  readonly renewBatchSize: number
}

const summarise = (kind: Kind, count: number, ttlMs: number, rounds: ReadonlyArray<ScaleRound>): ScaleRow => {
  const idle = rounds.flatMap((r) => (r.idle === undefined ? [] : [r.idle]))
  const periods = (i: NonNullable<ScaleRound["idle"]>) => (i.renewPeriodMs === undefined ? Number.NaN : i.ms / i.renewPeriodMs)
  return {
    kind,
    count,
    ttlMs: kind === "pg-lease" ? ttlMs : undefined,
    result: {
      _tag: "Measured",
      rounds,
      acquireMs: spread(rounds.map((r) => r.acquireMs)),
      acquirePerSecond: spread(rounds.map((r) => count / (r.acquireMs / 1000))),
      releaseMs: spread(rounds.map((r) => r.releaseMs)),
      peakSessions: Math.max(...rounds.map((r) => r.peakSessions)),
      heldSessions: Math.max(...rounds.map((r) => r.heldSessions)),
      heapBytes: spread(rounds.map((r) => r.heapBytes)),
      rssBytes: spread(rounds.map((r) => r.rssBytes)),
      heldRssBytes: spread(rounds.map((r) => r.heldRssBytes)),
      lost: Math.max(...rounds.map((r) => r.lost)),
      idle: idle.length === 0 ? undefined : {
        renewStatementsPerPeriod: spread(idle.map((i) => i.renewStatements / periods(i))),
        renewedRowsPerStatement: spread(idle.map((i) => i.renewedRows / Math.max(1, i.renewStatements))),
        largestTick: Math.max(0, ...idle.flatMap((i) => i.ticks)),
        ticksPerPeriod: spread(idle.map((i) => i.ticks.length / periods(i))),
        largestBatch: Math.max(0, ...idle.map((i) => i.largestBatch)),
        otherStatements: idle.reduce((n, i) => n + i.otherStatements, 0),
        serverTransactionsPerSecond: spread(idle.map((i) => i.serverTransactionsPerSecond))
      }
    }
  }
}

const run = async (context: Context): Promise<ScaleResult> => {
  const { settings } = context
  // Long enough that renewals keep up while 10,000 acquisitions queue for the same pool (with
  // ttl 4.5 s they did not, and leases were lost), short enough to see two renewal periods.
  const leaseTtlMs = settings.quick ? 6_000 : 15_000
  // Two renewal periods (ttl/3 each), so a renewal tick cannot fall between the window's edges.
  const idleMs = (2 * leaseTtlMs) / 3
  const database = await createDatabase(context.adminUrl, "scale")
  const admin = await connect(context.adminUrl, ADMIN_APPLICATION_NAME)
  const sampling = await connect(context.adminUrl, ADMIN_APPLICATION_NAME)
  const subjects: Array<ScaleSubject> = settings.scaleCounts.flatMap((count) => [
    { kind: "pg-lease" as const, count, applicationName: `bench-scale-lease-${count}` },
    ...(count <= settings.scaleAdvisoryMax ? [{ kind: "pg-advisory" as const, count, applicationName: `bench-scale-advisory-${count}` }] : [])
  ])
  const smallest = Math.min(...settings.scaleCounts)
  const largest = Math.max(...settings.scaleCounts)
  // The largest counts take tens of seconds per round: they get as many rounds as fit the budget.
  const budgetMs = settings.quick ? 30_000 : 60_000
  const started = now()
  const rounds = new Map<ScaleSubject, Array<ScaleRound>>(subjects.map((s) => [s, []]))
  const failures = new Map<ScaleSubject, string>()
  const attempt = async (subject: ScaleSubject, record: boolean) => {
    if (failures.has(subject)) return
    try {
      // The idle window costs two renewal periods: measured where the target is, the most leases.
      const measureIdle = record && subject.kind === "pg-lease" && subject.count === largest
      const round = await runOnce(context, database, admin, sampling, subject, leaseTtlMs, idleMs, measureIdle)
      if (record) rounds.get(subject)!.push(round)
    } catch (error) {
      failures.set(subject, reasonOf(error))
      context.log(`  scale ${subject.kind} ${subject.count} failed: ${reasonOf(error)}`)
    }
  }
  try {
    for (const subject of subjects.filter((s) => s.count === smallest)) await attempt(subject, false)
    for (let round = 0; round < settings.rounds; round++) {
      for (const subject of subjects) {
        const large = subject.count > smallest
        if (large && round > 0 && now() - started > budgetMs) continue
        await attempt(subject, true)
      }
      context.log(`  scale: round ${round + 1}/${settings.rounds} done`)
    }
  } finally {
    await admin.end().catch(() => {})
    await sampling.end().catch(() => {})
    await database.drop()
  }
  return {
    acquireConcurrency: ACQUIRE_CONCURRENCY,
    idleMs,
    leaseTtlMs,
    renewBatchSize: PgLease.defaults.renewBatchSize,
    rows: subjects.map((subject): ScaleRow => {
      const measured = rounds.get(subject) ?? []
      const failure = failures.get(subject)
      if (failure !== undefined || measured.length === 0) {
        return { kind: subject.kind, count: subject.count, ttlMs: undefined, result: { _tag: "Skipped", reason: failure ?? "no measured round" } }
      }
      return summarise(subject.kind, subject.count, leaseTtlMs, measured)
    })
  }
}

const label = (row: ScaleRow) => `${row.kind === "pg-lease" ? "PgLease" : "PgAdvisory"} × ${Report.integer(row.count)}`

const render = (result: ScaleResult): string => {
  const measured = result.rows.filter((r) => r.result._tag === "Measured")
  const main = Report.table(
    ["Locks held", "rounds", "acquire all ms (min–max)", "locks/s", "release all ms", "sessions: peak / while held", "heap Δ (per lock)", "RSS while held (Δ)", "lost while held"],
    result.rows.map((row) => {
      if (row.result._tag === "Skipped") return [label(row), "skipped", row.result.reason, "", "", "", "", "", ""]
      const r = row.result
      return [
        label(row),
        `${r.rounds.length}`,
        `${Report.ms(r.acquireMs.median)} (${Report.range(r.acquireMs, Report.ms)})`,
        Report.rate(r.acquirePerSecond.median),
        Report.ms(r.releaseMs.median),
        `${r.peakSessions} / ${r.heldSessions}`,
        `${Report.mib(r.heapBytes.median)} (${Report.integer(r.heapBytes.median / row.count)} B)`,
        `${Report.mib(r.heldRssBytes.median)} (${r.rssBytes.median >= 0 ? "+" : ""}${Report.mib(r.rssBytes.median)})`,
        `${r.lost}`
      ]
    }),
    ["l", "r", "r", "r", "r", "r", "r", "r", "r"]
  )
  const idleRows = measured.flatMap((row) => {
    const idle = row.result._tag === "Measured" ? row.result.idle : undefined
    return idle === undefined ? [] : [{ row, idle }]
  })
  const idle = Report.table(
    ["Leases held", "renew statements per period (min–max)", "ticks per period", "largest tick (statements)", "rows per renew statement", "largest batch", "other statements", "server transactions/s (min–max)"],
    idleRows.map(({ idle, row }) => [
      label(row),
      `${idle.renewStatementsPerPeriod.median.toFixed(1)} (${Report.range(idle.renewStatementsPerPeriod, (n) => n.toFixed(1))})`,
      idle.ticksPerPeriod.median.toFixed(1),
      `${idle.largestTick}`,
      Report.integer(idle.renewedRowsPerStatement.median),
      Report.integer(idle.largestBatch),
      `${idle.otherStatements}`,
      `${idle.serverTransactionsPerSecond.median.toFixed(1)} (${Report.range(idle.serverTransactionsPerSecond, (n) => n.toFixed(1))})`
    ]),
    ["l", "r", "r", "r", "r", "r", "r", "r"]
  )
  return [
    `The locks are acquired ${result.acquireConcurrency} at a time, each into its own scope, held, then released ` +
    `${result.acquireConcurrency} at a time. PgAdvisory runs with its default maxSessions (${ADVISORY_MAX_SESSIONS}); ` +
    `PgLease on its own connection lane (settings from one PgClient; up to 4 lock, 2 renewal and 1 LISTEN connections) with ttl ${result.leaseTtlMs / 1000} s, so it renews every ` +
    `${(result.leaseTtlMs / 3000).toFixed(1)} s. Heap and RSS are read after a full GC; heap and the RSS Δ are relative ` +
    "to before the layer was built, and include what any caller holding the locks keeps (a name, a scope and the " +
    "lease per lock). RSS also moves with what earlier rounds freed, so its Δ is rough. Sessions are counted in pg_stat_activity by the layer's application_name every 100 ms. The first " +
    "(smallest) size is run once unmeasured as a warm-up; larger sizes get as many rounds as fit a time budget.",
    "",
    main,
    "",
    `**PgLease while held and idle** (the most leases only: a ${result.idleMs / 1000} s window — two renewal periods — after all leases are acquired): its statements ` +
    "are counted at its own connection lane (where it sends them): renewal statements per renewal period (ttl/3), renewal ticks (the registry renews " +
    `everything due in one tick as full batches of ${result.renewBatchSize} rows and one partial batch, so a partial ` +
    "batch ends a tick), rows per statement, and any other statement. Server transactions/s is the database's " +
    "xact_commit delta over the window (pg_stat_database; backends publish it at most once a second, so the " +
    "window is widened by a settle period on each side): it counts every transaction in the database, autovacuum's " +
    "included, so it is an upper bound on what the library sent; the lane count is exact.",
    "",
    idle
  ].join("\n")
}

const targets = (result: ScaleResult): ReadonlyArray<Target> => {
  const out: Array<Target> = []
  for (const row of result.rows) {
    if (row.kind === "pg-lease" && row.count === 10_000) {
      if (row.result._tag !== "Measured") {
        out.push({ target: "10,000 leases renew with a bounded number of statements per tick", subject: label(row), status: "N/A", detail: row.result.reason })
        continue
      }
      const r = row.result.idle
      if (r === undefined) {
        out.push({ target: "10,000 leases renew with a bounded number of statements per tick", subject: label(row), status: "N/A", detail: "no idle window measured" })
        continue
      }
      const bound = Math.ceil(row.count / result.renewBatchSize)
      const perPeriod = r.renewStatementsPerPeriod.median
      // Bounded: a tick sends at most ceil(N / renewBatchSize) statements, whatever N is.
      out.push({
        target: "10,000 leases renew with a bounded number of statements per tick",
        subject: label(row),
        status: r.largestTick <= bound && r.largestBatch <= result.renewBatchSize && row.result.lost === 0 ? "PASS" : "MISS",
        detail: `largest tick ${r.largestTick} statements (bound ⌈N/${result.renewBatchSize}⌉ = ${bound}), ` +
          `${r.ticksPerPeriod.median.toFixed(1)} ticks and ` +
          `${perPeriod.toFixed(1)} renewal statements per ${(result.leaseTtlMs / 3000).toFixed(1)} s period, ` +
          `${Report.integer(r.renewedRowsPerStatement.median)} rows each; ${r.otherStatements} other statements while idle; ` +
          `${row.result.lost} leases lost`
      })
    }
    if (row.kind === "pg-advisory" && row.count === 1_000) {
      out.push(
        row.result._tag === "Measured"
          ? {
            target: `1,000 advisory locks use ≤ maxSessions (${ADVISORY_MAX_SESSIONS}) connections`,
            subject: label(row),
            status: row.result.peakSessions <= ADVISORY_MAX_SESSIONS ? "PASS" : "MISS",
            detail: `peak ${row.result.peakSessions} sessions, ${row.result.heldSessions} while held`
          }
          : { target: `1,000 advisory locks use ≤ maxSessions (${ADVISORY_MAX_SESSIONS}) connections`, subject: label(row), status: "N/A", detail: row.result.reason }
      )
    }
  }
  return out
}

export const scenario: Scenario<ScaleResult> = {
  name: "scale",
  title: "3. Scale: holding 1,000 and 10,000 locks",
  run,
  render,
  targets
}

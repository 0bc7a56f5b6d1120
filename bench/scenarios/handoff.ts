/**
 * Scenario 2 — handoff latency and fairness: 8 contenders on one name, each looping
 * acquire → hold 1 ms → release, against raw pg waiters blocked in `pg_advisory_lock` on their
 * own connections (the floor: the server's own hand-off).
 */
import { PgClient } from "@effect/sql-pg"
import * as Duration from "effect/Duration"
import * as Layer from "effect/Layer"
import * as Redacted from "effect/Redacted"
import * as DistributedLock from "../../src/DistributedLock.js"
import { advisoryKey } from "../../src/internal/core/lockKey.js"
import * as PgAdvisory from "../../src/PgAdvisory.js"
import * as PgLease from "../../src/PgLease.js"
import type { Context, Scenario } from "../lib/context.js"
import {
  CONTENDERS,
  effectContender,
  HOLD_MS,
  measureHandoff,
  promiseContender,
  Recorder,
  renderHandoff,
  type HandoffRound,
  type HandoffRow,
  type HandoffSpec
} from "../lib/handoff.js"
import { createDatabase, type Database } from "../lib/postgres.js"
import { closeAll, connectMany } from "../lib/rawPg.js"
import * as Report from "../lib/report.js"
import type { Target } from "../lib/report.js"
import { isolatedRounds } from "../lib/isolated.js"
import { lengthOf, type Subject } from "../lib/rounds.js"
import { openRuntime, type OpenRuntime } from "../lib/runtime.js"
import { fencingDdl, IN_PROCESS, RAW_FENCING_TABLE } from "./uncontended.js"

const range = (n: number): Array<number> => Array.from({ length: n }, (_, i) => i)

/** Raw pg: each contender blocks in `pg_advisory_lock` on its own connection. */
export const rawHandoff = (database: Database, durationMs: number, fenced: boolean): Subject<HandoffRound> => {
  const id = fenced ? "raw-handoff-fenced" : "raw-handoff"
  const name = `handoff-${id}`
  const key = advisoryKey(name).toString()
  // The fenced variant bumps the counter in the same round trip as the grant, as PgAdvisory's waits do.
  const lock = fenced
    ? `SELECT pg_advisory_lock('${key}'::bigint); ` +
      `INSERT INTO "${RAW_FENCING_TABLE}" AS f (key, name, token) VALUES ('${key}'::bigint, '${name}', nextval('effect_lock_tokens')) ` +
      "ON CONFLICT (key) DO UPDATE SET token = greatest(f.token + 1, excluded.token), name = excluded.name RETURNING f.token::text AS token"
    : `SELECT pg_advisory_lock('${key}'::bigint)`
  return {
    id,
    open: async () => {
      const clients = await connectMany(database.url, CONTENDERS, `bench-${id}`)
      await clients[0]!.query(fencingDdl)
      return {
        run: async (round) => {
          const recorder = new Recorder(CONTENDERS, lengthOf(round, durationMs))
          await Promise.all(clients.map((client, who) =>
            promiseContender(recorder, who, async () => {
              await client.query(lock)
              return () => client.query(`SELECT pg_advisory_unlock('${key}'::bigint)`)
            })
          ))
          return recorder.finish()
        },
        close: () => closeAll(clients)
      }
    }
  }
}

/** Contenders over `layers` lock layers (contender i uses layer i mod layers), in one process. */
export const lockHandoff = <E>(
  id: string,
  layers: number,
  layer: (index: number) => Layer.Layer<DistributedLock.DistributedLock, E>,
  durationMs: number
): Subject<HandoffRound> => ({
  id,
  open: async () => {
    const runtimes: Array<OpenRuntime<DistributedLock.DistributedLock>> = []
    try {
      for (const i of range(layers)) runtimes.push(await openRuntime(layer(i)))
    } catch (error) {
      await Promise.all(runtimes.map((r) => r.close()))
      throw error
    }
    const name = `handoff-${id}`
    return {
      run: async (round) => {
        const recorder = new Recorder(CONTENDERS, lengthOf(round, durationMs))
        await Promise.all(range(CONTENDERS).map((who) =>
          runtimes[who % runtimes.length]!.run(effectContender(recorder, who, DistributedLock.acquire(name)))
        ))
        return recorder.finish()
      },
      close: async () => {
        await Promise.all(runtimes.map((r) => r.close()))
      }
    }
  }
})

export const pgAdvisoryHandoff = (database: Database, durationMs: number, layers: number): Subject<HandoffRound> =>
  lockHandoff(
    `pg-advisory-${layers}`,
    layers,
    (i) => PgAdvisory.layer({ url: database.url, applicationName: `bench-handoff-advisory-${layers}-${i}` }),
    durationMs
  )

export const pgLeaseHandoff = (database: Database, durationMs: number, listen: boolean): Subject<HandoffRound> =>
  lockHandoff(
    `pg-lease-${listen ? "notify" : "poll"}`,
    CONTENDERS,
    (i) =>
      Layer.provide(
        PgLease.layer({ listen }),
        PgClient.layer({ url: Redacted.make(database.url), applicationName: `bench-handoff-lease-${listen ? "notify" : "poll"}-${i}` })
      ),
    durationMs
  )

export interface HandoffResult {
  readonly rows: ReadonlyArray<HandoffRow>
}

/** The rows' subjects by name, for the child process that measures each (`isolated.ts`). */
export const FACTORIES = {
  rawHandoff: (database: Database, ms: number, fenced: boolean) => rawHandoff(database, ms, fenced),
  pgAdvisoryHandoff: (database: Database, ms: number, layers: number) => pgAdvisoryHandoff(database, ms, layers),
  pgLeaseHandoff: (database: Database, ms: number, listen: boolean) => pgLeaseHandoff(database, ms, listen)
}

/**
 * The row of `FACTORIES[factory]` in a process of its own, as the throughput rows are (unless
 * BENCH_IN_PROCESS=1): a round's longest wait is one stall, and in the bench's own process it
 * could be a collection of the garbage and heap that the scenarios before it left.
 */
const own = <K extends keyof typeof FACTORIES>(
  factory: K,
  database: Database,
  ...args: Parameters<(typeof FACTORIES)[K]> extends [unknown, ...infer Rest] ? Rest : never
): Subject<HandoffRound> => {
  const local = (FACTORIES[factory] as (database: Database, ...args: Array<unknown>) => Subject<HandoffRound>)(database, ...args)
  if (IN_PROCESS) return local
  return isolatedRounds(local, { module: import.meta.url, factory, database: { name: database.name, url: database.url }, args })
}

const specs = (database: Database, ms: number): Array<HandoffSpec> => [
  { id: "raw", label: "raw pg: waiters blocked in pg_advisory_lock", setup: "8 connections", subject: own("rawHandoff", database, ms, false) },
  {
    id: "raw-fenced",
    label: "raw pg: same, + fencing upsert in the grant's round trip",
    setup: "8 connections",
    baseline: "raw",
    subject: own("rawHandoff", database, ms, true)
  },
  { id: "pg-advisory-8", label: "PgAdvisory.layer", setup: "8 layers (\"processes\")", baseline: "raw", subject: own("pgAdvisoryHandoff", database, ms, 8) },
  { id: "pg-advisory-1", label: "PgAdvisory.layer", setup: "1 layer, 8 fibers", baseline: "raw", subject: own("pgAdvisoryHandoff", database, ms, 1) },
  { id: "pg-lease-notify", label: "PgLease.layer, listen: true", setup: "8 layers, 8 pools", baseline: "raw", subject: own("pgLeaseHandoff", database, ms, true) },
  { id: "pg-lease-poll", label: "PgLease.layer, listen: false (polling)", setup: "8 layers, 8 pools", baseline: "raw", subject: own("pgLeaseHandoff", database, ms, false) }
]

const run = async (context: Context): Promise<HandoffResult> => {
  const database = await createDatabase(context.adminUrl, "handoff")
  try {
    return { rows: await measureHandoff(context, "handoff", specs(database, context.settings.handoffMs)) }
  } finally {
    await database.drop()
  }
}

export const HANDOFF_EXPLANATION = [
  `${CONTENDERS} contenders loop on one name: acquire → hold ${HOLD_MS} ms → release, back to back. A *handoff* is the ` +
  "time from one holder's release moment (its `release()` call, or the instant its scope starts closing) to the " +
  "next grant, counted only when the next holder is a different contender; when the releaser itself gets the lock " +
  "again it is a *self re-acquire* (share of all grants that followed a release). Per round: handoff p50 and p99, " +
  "grants per contender, and the longest wait from asking to grant (a contender still waiting when the round " +
  "ends counts with the time it has waited). Tables: median over rounds (min–max across rounds); acquisitions per " +
  "contender are the lowest and highest count any contender got in any round; longest wait is the median of the " +
  "rounds' longest waits, with the worst round in parentheses."
].join("\n")

const render = (result: HandoffResult): string =>
  [
    HANDOFF_EXPLANATION,
    "",
    "PgAdvisory waiters block in `pg_advisory_lock` on a wait session (the server hands over), and each grant bumps " +
    "the fencing counter in the same round trip; with one layer the 8 fibers queue in process and the grant moves " +
    "between fibers of the same layer. PgLease waiters take a place in a queue at the server, in arrival order (a " +
    "releaser that asks again goes to the back); a release notifies only the waiter now at the head, which then " +
    "takes the lock (listen: true), or waiters retry on their poll interval (listen: false, 500 ms jittered down to half).",
    "",
    renderHandoff(result.rows)
  ].join("\n")

const find = (rows: ReadonlyArray<HandoffRow>, id: string) => rows.find((r) => r.id === id)

/** Median of a measured row's statistic, or undefined. */
const medianOf = (row: HandoffRow | undefined, pick: (m: Extract<HandoffRow["result"], { _tag: "Measured" }>) => { readonly median: number }) =>
  row?.result._tag === "Measured" ? pick(row.result).median : undefined

const subjectOf = (row: HandoffRow) => `${row.label} (${row.setup})`

const notMeasured = (target: string, row: HandoffRow, floor: string): Target => ({
  target,
  subject: subjectOf(row),
  status: "N/A",
  detail: row.result._tag === "Skipped" ? row.result.reason : `${floor} not measured`
})

/**
 * The handoff and fairness targets: PgAdvisory's handoff against raw waiters whose grant
 * also writes the fencing counter (the floor of a fenced handoff), its longest wait against raw
 * waiters; PgLease's handoff against PgAdvisory's in the same run, its longest wait against raw
 * advisory waiters, and no self re-acquire while others wait.
 */
const targets = (result: HandoffResult): ReadonlyArray<Target> => {
  const raw = find(result.rows, "raw")
  const rawFenced = find(result.rows, "raw-fenced")
  const rawLongest = medianOf(raw, (m) => m.longestWaitMs)
  const fencedP50 = medianOf(rawFenced, (m) => m.p50Ms)
  const out: Array<Target> = []

  const advisory = find(result.rows, "pg-advisory-8")
  if (advisory !== undefined) {
    const target = "PgAdvisory handoff p50 ≤ 1.5× raw waiters with the fencing write"
    const p50 = medianOf(advisory, (m) => m.p50Ms)
    out.push(
      p50 === undefined || fencedP50 === undefined
        ? notMeasured(target, advisory, "raw pg with the fencing write")
        : {
          target,
          subject: subjectOf(advisory),
          status: p50 <= 1.5 * fencedP50 ? "PASS" : "MISS",
          detail: `p50 ${Report.ms(p50)} ms vs fenced raw ${Report.ms(fencedP50)} ms = ${Report.ratio(p50 / fencedP50)}`
        }
    )
  }

  // PgLease's waiters are woken by NOTIFY and then send their acquire: one more round trip per
  // grant than a waiter blocked at the server, so its bound is relative to PgAdvisory's, same run.
  const notify = find(result.rows, "pg-lease-notify")
  if (notify !== undefined) {
    const target = "PgLease handoff p50 ≤ 2× PgAdvisory's (NOTIFY)"
    const advisoryP50 = advisory === undefined ? undefined : medianOf(advisory, (m) => m.p50Ms)
    out.push(
      notify.result._tag === "Measured" && advisoryP50 !== undefined
        ? {
          target,
          subject: subjectOf(notify),
          status: notify.result.p50Ms.median <= 2 * advisoryP50 ? "PASS" : "MISS",
          detail: `p50 ${Report.ms(notify.result.p50Ms.median)} ms (rounds ${Report.range(notify.result.p50Ms, Report.ms)}) ` +
            `vs PgAdvisory ${Report.ms(advisoryP50)} ms = ${Report.ratio(notify.result.p50Ms.median / advisoryP50)}`
        }
        : notMeasured(target, notify, "PgAdvisory.layer")
    )
  }

  // A polling waiter is judged on what polling can do (issue 37): its handoff within one poll
  // interval, its longest wait within one interval per contender ahead of it and one more. Against
  // raw waiters blocked at the server it is information only.
  const polling = find(result.rows, "pg-lease-poll")
  if (polling !== undefined) {
    const poll = Duration.toMillis(PgLease.defaults.pollInterval)
    const handoffTarget = `PgLease polling: handoff p50 ≤ the poll interval (${poll} ms)`
    const waitTarget = `PgLease polling: longest wait ≤ (contenders + 1) × the poll interval (${(CONTENDERS + 1) * poll} ms)`
    if (polling.result._tag !== "Measured") {
      out.push(notMeasured(handoffTarget, polling, "the poll interval"), notMeasured(waitTarget, polling, "the poll interval"))
    } else {
      const p50 = polling.result.p50Ms.median
      const longest = polling.result.longestWaitMs.median
      out.push({
        target: handoffTarget,
        subject: subjectOf(polling),
        status: p50 <= poll ? "PASS" : "MISS",
        detail: `p50 ${Report.ms(p50)} ms (rounds ${Report.range(polling.result.p50Ms, Report.ms)}) vs poll ${poll} ms`
      }, {
        target: waitTarget,
        subject: subjectOf(polling),
        status: longest <= (CONTENDERS + 1) * poll ? "PASS" : "MISS",
        detail: `longest wait ${Report.ms(longest)} ms (worst round ${Report.ms(polling.result.longestWaitMs.max)}) vs ` +
          `${(CONTENDERS + 1) * poll} ms` +
          (rawLongest === undefined ? "" : `; ${Report.ratio(longest / rawLongest)} raw pg (information only)`)
      })
    }
  }

  const fairness: ReadonlyArray<{ readonly id: string; readonly atMost: number; readonly noSelf: boolean }> = [
    { id: "pg-advisory-8", atMost: 2, noSelf: false },
    { id: "pg-advisory-1", atMost: 2, noSelf: false },
    { id: "pg-lease-notify", atMost: 3, noSelf: true }
  ]
  for (const { atMost, id, noSelf } of fairness) {
    const row = find(result.rows, id)
    if (row === undefined) continue
    const target = `longest wait ≤ ${atMost}× raw pg${noSelf ? ", no self re-acquire while others wait" : ""}`
    if (row.result._tag !== "Measured" || rawLongest === undefined) {
      out.push(notMeasured(target, row, "raw pg"))
      continue
    }
    const longest = row.result.longestWaitMs.median
    const self = row.result.selfReacquireShare.median
    out.push({
      target,
      subject: subjectOf(row),
      status: longest <= atMost * rawLongest && (!noSelf || self === 0) ? "PASS" : "MISS",
      detail: `longest wait ${Report.ms(longest)} ms (worst round ${Report.ms(row.result.longestWaitMs.max)}) vs raw ` +
        `${Report.ms(rawLongest)} ms = ${Report.ratio(longest / rawLongest)}; acquisitions per contender ` +
        `${row.result.acquisitionsMin}–${row.result.acquisitionsMax}, self re-acquire ${Report.percent(self)}`
    })
  }
  return out
}

export const scenario: Scenario<HandoffResult> = {
  name: "handoff",
  title: "2. Handoff latency and fairness",
  run,
  render,
  targets
}

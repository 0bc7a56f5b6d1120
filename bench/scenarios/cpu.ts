/**
 * Scenario 7 — CPU per cycle: each backend's uncontended loop (one worker) next to its raw floor
 * with V8's CPU profiler on, in interleaved rounds, and the CPU this process spends per cycle
 * (profile samples that are not idle) compared with the floor's: issue 23's target "CPU per cycle
 * ≤ 2× the raw row's, for each backend". `bench/profile.ts` prints the same split by place, with
 * the profiles for reading.
 */
import type { Context, Scenario } from "../lib/context.js"
import { createDatabase, type Database } from "../lib/postgres.js"
import { cpuMs, PLACES, type Profiled, profiled, summarize, type Where } from "../lib/profiling.js"
import * as Report from "../lib/report.js"
import type { Target } from "../lib/report.js"
import type { Subject } from "../lib/rounds.js"
import { median } from "../lib/stats.js"
import { own } from "./uncontended.js"

/** The CPU-per-cycle target: the library's CPU per cycle within this many times its floor's. */
const CPU_TARGET = 2

interface Pair {
  readonly backend: string
  readonly floorLabel: string
  readonly subject: (database: Database, ms: number) => Subject<unknown>
  readonly floor: (database: Database, ms: number) => Subject<unknown>
}

const PAIRS: ReadonlyArray<Pair> = [
  { backend: "PgAdvisory.layer", floorLabel: "raw pg, same 2 statements", subject: (db, ms) => own("pgAdvisorySubject", db, 1, ms), floor: (db, ms) => own("rawAdvisoryFenced", db, 1, 1, ms) },
  { backend: "PgLease.layer", floorLabel: "raw pg, same 2 statements", subject: (db, ms) => own("pgLeaseSubject", db, 1, ms), floor: (db, ms) => own("rawLease", db, 1, ms) },
  // Against @effect/sql-pg's withTransaction sending the same statements, as its throughput target
  // is (issue 37): the transaction machinery is the user's with or without the lock.
  { backend: "PgAdvisory.withXactLock", floorLabel: "@effect/sql-pg withTransaction, same 3 statements", subject: (db, ms) => own("xactSubject", db, 1, ms), floor: (db, ms) => own("sqlXactSubject", db, 1, ms) },
  { backend: "MemoryBackend.layer", floorLabel: "Effect.makeSemaphore", subject: (_, ms) => own("memorySubject", undefined, 1, ms), floor: (_, ms) => own("semaphoreSubject", undefined, 1, ms) }
]

/** One side of a pair: per-cycle figures of each round (µs), and the CPU split of all rounds. */
export interface CpuSide {
  readonly id: string
  readonly cpuUs: ReadonlyArray<number>
  readonly wallUs: ReadonlyArray<number>
  readonly byPlaceUs: Readonly<Partial<Record<Where, number>>>
}

export interface CpuRow {
  readonly backend: string
  readonly floorLabel: string
  readonly floor: CpuSide
  readonly subject: CpuSide
}

export interface CpuResult {
  readonly roundMs: number
  readonly rounds: number
  readonly rows: ReadonlyArray<CpuRow>
}

const throughputCycles = (result: unknown) => (result as { readonly cycles: number }).cycles

const sideOf = (rounds: ReadonlyArray<Profiled>): CpuSide => {
  const byPlace: Partial<Record<Where, number>> = {}
  let cycles = 0
  for (const round of rounds) {
    cycles += round.cycles
    const { byWhere } = summarize(round.profile)
    for (const where of PLACES) byPlace[where] = (byPlace[where] ?? 0) + (byWhere.get(where) ?? 0)
  }
  const perCycle = (ms: number, n: number) => (ms * 1000) / Math.max(1, n)
  return {
    id: rounds[0]?.id ?? "",
    cpuUs: rounds.map((round) => perCycle(cpuMs(round), round.cycles)),
    wallUs: rounds.map((round) => perCycle(round.wallMs, round.cycles)),
    byPlaceUs: Object.fromEntries(PLACES.map((where) => [where, perCycle(byPlace[where] ?? 0, cycles)]))
  }
}

const run = async (context: Context): Promise<CpuResult> => {
  const { settings, log } = context
  const roundMs = settings.quick ? 500 : 2_000
  const rounds = settings.quick ? 1 : 3
  const database = await createDatabase(context.adminUrl, "cpu")
  try {
    const rows: Array<CpuRow> = []
    for (const pair of PAIRS) {
      log(`cpu: ${pair.backend} and its floor, ${rounds} profiled rounds of ${roundMs} ms each`)
      const floor = sideOf(await profiled(pair.floor(database, roundMs), throughputCycles, rounds))
      const subject = sideOf(await profiled(pair.subject(database, roundMs), throughputCycles, rounds))
      rows.push({ backend: pair.backend, floorLabel: pair.floorLabel, floor, subject })
    }
    return { roundMs, rounds, rows }
  } finally {
    await database.drop()
  }
}

const us = (n: number) => `${n.toFixed(0)} µs`

const render = (result: CpuResult): string => {
  const rows = result.rows.flatMap((row) => {
    const floorCpu = median(row.floor.cpuUs)
    const cpu = median(row.subject.cpuUs)
    const place = (where: Where) => us(row.subject.byPlaceUs[where] ?? 0)
    return [
      [row.floorLabel, us(median(row.floor.wallUs)), us(floorCpu), "", "", "", "", "", ""],
      [
        `**${row.backend}**`,
        us(median(row.subject.wallUs)),
        us(cpu),
        Report.ratio(cpu / floorCpu),
        place("Effect runtime"),
        place("node internals"),
        place("effect-lock"),
        place("pg driver"),
        place("gc")
      ]
    ]
  })
  return [
    `One worker, ${result.rounds} profiled round(s) of ${result.roundMs} ms per row after a warm-up; medians per cycle. ` +
    "CPU is what this process spent (profile samples that are not idle); the split is the library's, over all its rounds. " +
    "`npx tsx bench/profile.ts` prints the same with the top functions and writes the profiles.",
    "",
    Report.table(
      ["row", "wall", "CPU here", "CPU vs floor", "Effect runtime", "node internals", "effect-lock", "pg driver", "GC"],
      rows,
      ["l", "r", "r", "r", "r", "r", "r", "r", "r"]
    )
  ].join("\n")
}

const targets = (result: CpuResult): ReadonlyArray<Target> =>
  result.rows.map((row) => {
    const floorCpu = median(row.floor.cpuUs)
    const cpu = median(row.subject.cpuUs)
    const r = cpu / floorCpu
    return {
      target: `CPU per cycle ≤ ${CPU_TARGET}× the floor's (profiled)`,
      subject: `${row.backend}, 1 worker`,
      status: r <= CPU_TARGET ? "PASS" : "MISS",
      detail: `${us(cpu)} vs ${us(floorCpu)} (${row.floorLabel}) = ${Report.ratio(r)}`
    }
  })

export const scenario: Scenario<CpuResult> = {
  name: "cpu",
  title: "CPU per cycle against the raw floor (profiled)",
  run,
  render,
  targets
}

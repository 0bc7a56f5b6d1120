/**
 * Scenario `sqlite` — SqliteLease on one database file shared by OS processes (sqliteWorker.ts):
 *
 * - cycles/s: acquire + release of per-process names, 1 and 4 processes, each beside raw
 *   better-sqlite3 sending the same two statements (the floor: no Effect, no renewal bookkeeping);
 * - handoff: 4 processes competing for one name (acquire → hold 1 ms → release): the latency from
 *   a holder starting its release to another process holding it. Waiters of other processes poll
 *   (SQLite has no notifications): default 50 ms, and 10 ms. Beside it, 4 fibers of ONE process,
 *   woken by the release itself.
 *
 * Every subject is a group of processes started once; rounds are interleaved (a library row next
 * to its raw row, their order flipping every round) after a half-length warm-up.
 */
import { type ChildProcessWithoutNullStreams, spawn } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import * as Readline from "node:readline"
import { fileURLToPath } from "node:url"
import type { Context, Scenario } from "../lib/context.js"
import * as Report from "../lib/report.js"
import type { Target } from "../lib/report.js"
import { median, percentile, type Spread, spread } from "../lib/stats.js"

const WORKER = fileURLToPath(new URL("./sqliteWorker.ts", import.meta.url))
const PROCESSES = 4
/** The workers run the library as the parent does: its tsc build when the bench was started on it (`lib/built.mjs`). */
const BUILT = process.env["EFFECT_LOCK_BENCH_BUILD"] ? ["--import", fileURLToPath(new URL("../lib/built.mjs", import.meta.url))] : []

/** One worker process, answering one JSON line per command. */
interface Proc {
  readonly send: (command: string) => Promise<Record<string, unknown>>
  readonly stop: () => Promise<void>
}

const startProc = (mode: "lib" | "raw", file: string, pollMs: number): Promise<Proc> =>
  new Promise((resolve, reject) => {
    const child: ChildProcessWithoutNullStreams = spawn(process.execPath, [...BUILT, "--import", "tsx", WORKER, mode, file, String(pollMs)], {
      stdio: ["pipe", "pipe", "pipe"]
    })
    let stderr = ""
    child.stderr.on("data", (chunk: Buffer) => (stderr = (stderr + chunk.toString()).slice(-4000)))
    const pending: Array<{ readonly answer: (line: string) => void; readonly fail: (error: Error) => void }> = []
    let ready = false
    Readline.createInterface({ input: child.stdout }).on("line", (line) => {
      if (!ready) {
        if (line.trim() === "ready") {
          ready = true
          resolve({
            send: (command) =>
              new Promise((answer, fail) => {
                if (child.exitCode !== null) return fail(new Error(`bench worker exited (${child.exitCode}):\n${stderr}`))
                pending.push({ answer: (reply) => answer(JSON.parse(reply) as Record<string, unknown>), fail })
                child.stdin.write(`${command}\n`)
              }),
            stop: () =>
              new Promise((done) => {
                if (child.exitCode !== null) return done()
                child.once("exit", () => done())
                child.stdin.end("exit\n")
                setTimeout(() => child.kill("SIGKILL"), 5_000).unref()
              })
          })
        }
        return
      }
      pending.shift()?.answer(line)
    })
    child.once("exit", (code) => {
      // A worker that died answers nothing more: fail what it was asked, never hang the run.
      const error = new Error(`bench worker exited (${code}):\n${stderr}`)
      if (!ready) reject(error)
      for (const waiting of pending.splice(0)) waiting.fail(error)
    })
  })

/** A group of processes of one kind, driven together. */
interface Group {
  readonly label: string
  readonly procs: ReadonlyArray<Proc>
}

const startGroup = async (label: string, mode: "lib" | "raw", file: string, size: number, pollMs = 50): Promise<Group> => ({
  label,
  procs: await Promise.all(Array.from({ length: size }, () => startProc(mode, file, pollMs)))
})

const failed = (reply: Record<string, unknown>) => {
  if (typeof reply["error"] === "string") throw new Error(reply["error"])
  return reply
}

/** Cycles per second of a group in one round: every process on its own name, for `ms`. */
const cyclesRound = async (group: Group, ms: number, round: number): Promise<number> => {
  const replies = await Promise.all(group.procs.map((p, i) => p.send(`cycles ${ms} cycles-${group.label}-${round}-${i}`)))
  return replies.reduce((total, reply) => total + Number(failed(reply)["cycles"]), 0) / (ms / 1000)
}

type Grant = readonly [acquiredAt: number, releaseAt: number, who: number]

/** Handoffs between different contenders, and how often a releaser took it again itself. */
const handoffsOf = (grants: ReadonlyArray<Grant>) => {
  const ordered = [...grants].sort((a, b) => a[0] - b[0])
  const latencies: Array<number> = []
  let self = 0
  for (let i = 1; i < ordered.length; i++) {
    if (ordered[i]![2] === ordered[i - 1]![2]) self++
    else latencies.push(ordered[i]![0] - ordered[i - 1]![1])
  }
  return { latencies, self, grants: ordered.length }
}

/** One handoff round: the processes of the group compete (`local`: one process, `fibers` fibers). */
const handoffRound = async (group: Group, ms: number, round: number, fibers?: number) => {
  const name = `handoff-${group.label}-${round}`
  const replies = fibers === undefined
    ? await Promise.all(group.procs.map((p) => p.send(`handoff ${ms} ${name}`)))
    : [await group.procs[0]!.send(`local ${ms} ${name} ${fibers}`)]
  const grants = replies.flatMap((reply, who) =>
    (failed(reply)["grants"] as Array<Grant>).map(([a, r, fiber]): Grant => [a, r, fibers === undefined ? who : fiber])
  )
  return handoffsOf(grants)
}

export interface CyclesRow {
  readonly label: string
  readonly processes: number
  readonly lib: Spread
  readonly raw: Spread
  readonly ratio: Spread
}

export interface HandoffRow {
  readonly label: string
  readonly contenders: string
  readonly grantsPerSecond: Spread
  readonly p50: number
  readonly p90: number
  readonly p99: number
  readonly selfReacquires: number
  readonly handoffs: number
}

export interface SqliteResult {
  readonly sqliteVersion: string
  readonly cycles: ReadonlyArray<CyclesRow>
  readonly handoff: ReadonlyArray<HandoffRow>
  readonly meta: Record<string, string>
}

const sqliteVersionOf = async (): Promise<string> => {
  const { default: Database } = await import("better-sqlite3")
  const db = new Database(":memory:")
  try {
    return (db.prepare("select sqlite_version() as v").get() as { v: string }).v
  } finally {
    db.close()
  }
}

const run = async (context: Context): Promise<SqliteResult> => {
  const { settings, log } = context
  const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-bench-sqlite-"))
  const file = Path.join(dir, "bench.db")
  const groups: Array<Group> = []
  const open = async (...args: Parameters<typeof startGroup>) => {
    const group = await startGroup(...args)
    groups.push(group)
    return group
  }
  try {
    const sqliteVersion = await sqliteVersionOf()
    log(`sqlite: starting ${2 + 3 * PROCESSES} worker processes on ${file}`)
    // Raw first: it creates the tables (the library's layers would too).
    const raw1 = await open("raw-1", "raw", file, 1)
    const lib1 = await open("lib-1", "lib", file, 1)
    const raw4 = await open("raw-4", "raw", file, PROCESSES)
    const lib4 = await open("lib-4", "lib", file, PROCESSES)
    const poll10 = await open("poll-10", "lib", file, PROCESSES, 10)
    // The default poll (50 ms) is lib-4's and lib-1's.
    const poll50 = lib4
    const local = lib1

    const cycles: Array<CyclesRow> = []
    for (const [lib, raw, processes] of [[lib1, raw1, 1], [lib4, raw4, PROCESSES]] as const) {
      const libRounds: Array<number> = []
      const rawRounds: Array<number> = []
      for (let round = -1; round < settings.rounds; round++) {
        const ms = round < 0 ? settings.throughputMs / 2 : settings.throughputMs
        const order = round % 2 === 0 ? [lib, raw] : [raw, lib]
        const figures = new Map<Group, number>()
        for (const group of order) figures.set(group, await cyclesRound(group, ms, round))
        if (round < 0) continue
        libRounds.push(figures.get(lib)!)
        rawRounds.push(figures.get(raw)!)
      }
      const row: CyclesRow = {
        label: processes === 1 ? "1 process" : `${processes} processes`,
        processes,
        lib: spread(libRounds),
        raw: spread(rawRounds),
        ratio: spread(libRounds.map((l, i) => l / rawRounds[i]!))
      }
      log(`sqlite: cycles/s ${row.label}: SqliteLease ${Report.rate(row.lib.median)}, raw ${Report.rate(row.raw.median)}`)
      cycles.push(row)
    }

    const handoff: Array<HandoffRow> = []
    const subjects = [
      { group: poll50, label: "4 processes, poll 50 ms (default)", contenders: "4 processes", fibers: undefined },
      { group: poll10, label: "4 processes, poll 10 ms", contenders: "4 processes", fibers: undefined },
      { group: local, label: "1 process, 4 fibers (woken by the release)", contenders: "4 fibers", fibers: PROCESSES }
    ]
    const pooled = subjects.map(() => ({ latencies: [] as Array<number>, self: 0, rates: [] as Array<number>, handoffs: 0 }))
    for (let round = -1; round < settings.rounds; round++) {
      const ms = round < 0 ? settings.handoffMs / 2 : settings.handoffMs
      const order = round % 2 === 0 ? subjects : [...subjects].reverse()
      for (const subject of order) {
        const outcome = await handoffRound(subject.group, ms, round, subject.fibers)
        if (round < 0) continue
        const into = pooled[subjects.indexOf(subject)]!
        into.latencies.push(...outcome.latencies)
        into.self += outcome.self
        into.handoffs += outcome.latencies.length
        into.rates.push(outcome.grants / (ms / 1000))
      }
    }
    subjects.forEach((subject, i) => {
      const p = pooled[i]!
      handoff.push({
        label: subject.label,
        contenders: subject.contenders,
        grantsPerSecond: spread(p.rates),
        p50: percentile(p.latencies, 50),
        p90: percentile(p.latencies, 90),
        p99: percentile(p.latencies, 99),
        selfReacquires: p.self,
        handoffs: p.handoffs
      })
      log(`sqlite: handoff ${subject.label}: p50 ${Report.ms(percentile(p.latencies, 50))} ms, median ${Report.rate(median(p.rates))} grants/s`)
    })
    return { sqliteVersion, cycles, handoff, meta: { "SQLite (better-sqlite3's bundled library)": sqliteVersion } }
  } finally {
    await Promise.all(groups.flatMap((g) => g.procs.map((p) => p.stop())))
    Fs.rmSync(dir, { recursive: true, force: true })
  }
}

const render = (result: SqliteResult): string =>
  [
    `SQLite ${result.sqliteVersion} (better-sqlite3 12), WAL, synchronous = FULL, one database file in the temp directory; ` +
    "each process is a separate Node process with one SqliteLease layer (its own connection) or one raw better-sqlite3 connection.",
    "",
    "**Uncontended cycles/s** (acquire + release of per-process names; the whole group's total). Raw: the same two statements " +
    "(`src/internal/lease/sqlite/sql.ts`) in a synchronous loop.",
    "",
    Report.table(
      ["Processes", "SqliteLease", "range", "raw better-sqlite3", "range", "ratio"],
      result.cycles.map((row) => [
        row.label,
        Report.rate(row.lib.median),
        Report.range(row.lib, Report.rate),
        Report.rate(row.raw.median),
        Report.range(row.raw, Report.rate),
        Report.ratio(row.ratio.median)
      ]),
      ["l", "r", "r", "r", "r", "r"]
    ),
    "",
    "**Handoff** (acquire → hold 1 ms → release, one name): from a holder starting its release to another contender " +
    "holding the lock. Waiters in other processes are not notified (SQLite has none): they poll, jittered between half " +
    "and all of the interval. Fibers of the releasing process are woken by the release itself.",
    "",
    Report.table(
      ["Contenders", "grants/s", "handoff p50 ms", "p90 ms", "p99 ms", "self re-acquires", "handoffs"],
      result.handoff.map((row) => [
        row.label,
        Report.rate(row.grantsPerSecond.median),
        Report.ms(row.p50),
        Report.ms(row.p90),
        Report.ms(row.p99),
        Report.integer(row.selfReacquires),
        Report.integer(row.handoffs)
      ]),
      ["l", "r", "r", "r", "r", "r", "r"]
    )
  ].join("\n")

const targets = (result: SqliteResult): ReadonlyArray<Target> => {
  const poll = result.handoff.find((row) => row.label.includes("default"))
  return poll === undefined ? [] : [{
    target: "SqliteLease: a waiter in another process is granted within one poll interval",
    subject: poll.label,
    status: poll.p50 <= 50 ? "PASS" : "MISS",
    detail: `handoff p50 ${Report.ms(poll.p50)} ms, p99 ${Report.ms(poll.p99)} ms (poll 50 ms, jittered 25–50)`
  }]
}

export const scenario: Scenario<SqliteResult> = {
  name: "sqlite",
  title: "SqliteLease: cycles/s beside raw better-sqlite3, and handoff across processes",
  run,
  render,
  targets
}

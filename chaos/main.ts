/**
 * `npm run chaos`: worker processes loop on one lock per backend, each round a fenced
 * write, while faults are injected at random from a printed seed; a checker then proves the
 * write log and the workers' reports consistent, prints a table and writes bench/CHAOS.md. Exits
 * non-zero on any violation.
 *
 *   npm run chaos [-- --backend pg-advisory|pg-lease|redis|all] [--minutes N] [--seed S] [--workers K]
 *                    [--ttl-ms T] [--pool P] [--shared P] [--report FILE | --no-report]
 *                    [--broken write-after-loss|shared-overlap]
 *
 * `redis` locks on Redis (EFFECT_LOCK_REDIS_URL / REDIS_URL, else `redis-server` from the PATH)
 * and writes to PostgreSQL as the others; `all` includes it only when a Redis can be had.
 *
 * `--shared P` makes a share P (0 ≤ P < 1) of the rounds readers': a `shared` acquisition that reads
 * the write log twice and writes nothing (protocol.ts `WorkerConfig.sharedChance`; default 0).
 *
 * `--broken write-after-loss` runs deliberately broken workers (see protocol.ts `WorkerConfig.broken`)
 * to show the checker flags a write begun after a reported loss, `--broken shared-overlap` a reader
 * that reads without the lock; such a run must fail.
 */
import * as Fs from "node:fs"
import * as Path from "node:path"
import { fileURLToPath } from "node:url"
import { INSTALL_HINT, redisAvailable } from "../tools/redisServer.js"
import { parseSeed, randomSeed } from "./prng.js"
import { BACKENDS, type Backend, BROKEN_WORKERS, type BrokenWorker, isBackend } from "./protocol.js"
import { renderMarkdown, renderSummary } from "./report.js"
import { DEFAULTS, resumeFrozenServerProcesses, runChaos } from "./run.js"

const ROOT = fileURLToPath(new URL("..", import.meta.url))
const DEFAULT_REPORT = Path.join(ROOT, "bench", "CHAOS.md")

const usage =
  "usage: npm run chaos -- [--backend pg-advisory|pg-lease|redis|all] [--minutes N] [--seed S] [--workers K] [--ttl-ms T] [--pool P] [--shared P] [--report FILE | --no-report] [--broken write-after-loss|shared-overlap]"

const argument = (flag: string): string | undefined => {
  const index = process.argv.indexOf(flag)
  if (index < 0) return undefined
  const value = process.argv[index + 1]
  if (value === undefined || value.startsWith("--")) throw new Error(`${flag} needs a value\n${usage}`)
  return value
}

const number = (flag: string, fallback: number, valid: (n: number) => boolean, what: string): number => {
  const text = argument(flag)
  if (text === undefined) return fallback
  const n = Number(text)
  if (!valid(n)) throw new Error(`${flag} must be ${what}, got ${text}\n${usage}`)
  return n
}

const parse = () => {
  const known = new Set(["--backend", "--minutes", "--seed", "--workers", "--ttl-ms", "--pool", "--shared", "--report", "--no-report", "--broken"])
  for (const arg of process.argv.slice(2)) {
    if (arg.startsWith("--") && !known.has(arg)) throw new Error(`unknown option ${arg}\n${usage}`)
  }
  const backend = argument("--backend") ?? "all"
  if (backend !== "all" && !isBackend(backend)) throw new Error(`--backend is pg-advisory, pg-lease, redis or all, not ${backend}\n${usage}`)
  if (backend === "redis" && !redisAvailable()) throw new Error(INSTALL_HINT)
  if (backend === "all" && !redisAvailable()) console.log(`redis left out of --backend all: ${INSTALL_HINT}`)
  const seedText = argument("--seed")
  const broken = argument("--broken")
  if (broken !== undefined && !(BROKEN_WORKERS as ReadonlyArray<string>).includes(broken)) {
    throw new Error(`--broken is ${BROKEN_WORKERS.join(" or ")}, not ${broken}\n${usage}`)
  }
  return {
    backends: backend === "all" ? BACKENDS.filter((b) => b !== "redis" || redisAvailable()) : [backend as Backend],
    // 0: one fault of each kind, then stop.
    minutes: number("--minutes", DEFAULTS.minutes, (n) => n >= 0 && n <= 24 * 60, "a number of minutes from 0 (one fault of each kind) to 1440"),
    seed: seedText === undefined ? randomSeed() : parseSeed(seedText),
    workers: number("--workers", DEFAULTS.workers, (n) => Number.isInteger(n) && n >= 2 && n <= 32, "a whole number from 2 to 32"),
    ttlMs: number("--ttl-ms", DEFAULTS.ttlMs, (n) => Number.isInteger(n) && n >= 1_000, "a whole number of ms, at least 1000 (PgLease's floor)"),
    poolSize: number("--pool", DEFAULTS.poolSize, (n) => Number.isInteger(n) && n >= 1 && n <= 50, "a whole number from 1 to 50"),
    sharedChance: number("--shared", 0, (n) => n >= 0 && n < 1, "a chance from 0 (no readers) to below 1"),
    broken: broken as BrokenWorker | undefined,
    report: process.argv.includes("--no-report") ? undefined : Path.resolve(argument("--report") ?? DEFAULT_REPORT)
  }
}

const main = async () => {
  const args = parse()
  // The seed comes first, so that even a run that dies can be repeated.
  console.log(`chaos seed ${args.seed} (repeat with --seed ${args.seed})`)
  console.log(
    `backends ${args.backends.join(", ")}; ${args.minutes} min each; ${args.workers} workers; lease ttl ${args.ttlMs} ms; worker pool ${args.poolSize}${
      args.sharedChance > 0 ? `; reader rounds ${args.sharedChance}` : ""
    }`
  )
  for (const signal of ["SIGINT", "SIGTERM"] as const) process.on(signal, resumeFrozenServerProcesses)
  const started = Date.now()
  const run = await runChaos({
    backends: args.backends,
    durationMs: Math.round(args.minutes * 60_000),
    seed: args.seed,
    workers: args.workers,
    ttlMs: args.ttlMs,
    poolSize: args.poolSize,
    logDir: DEFAULTS.logDir,
    broken: args.broken,
    sharedChance: args.sharedChance,
    log: (line) => console.log(`[${((Date.now() - started) / 1000).toFixed(1).padStart(6)}s] ${line}`)
  })
  console.log(renderSummary(run))
  if (args.report !== undefined) {
    Fs.writeFileSync(args.report, renderMarkdown(run))
    console.log(`report written to ${Path.relative(process.cwd(), args.report) || args.report}`)
  }
  process.exit(run.violations === 0 ? 0 : 1)
}

main().catch((error) => {
  console.error(error instanceof Error ? error.message : error)
  process.exit(2)
})

/**
 * `npx tsx bench/revisions.ts <rev> [--backend=redis|memory] [--workers=N] [--rounds=R] [--ms=M]`
 *
 * The library at git revision `<rev>` against the working tree, side by side in one process: both
 * compiled by tsc (as published), each on a layer of its own, the same loops in alternating
 * rounds (the order flips every round), medians. What one change does to a cycle's speed, without
 * the run-to-run drift of this shared machine that two separate runs would carry (±10–20 %).
 * Rows: `Effect.scoped(DistributedLock.acquire(name))` and `DistributedLock.withLock(Effect.void,
 * name)`, each worker on its own name; cycles/s and the process's CPU µs per cycle.
 * Redis: a fresh `redis-server` from the PATH (or `EFFECT_LOCK_REDIS_URL` / `REDIS_URL`).
 */
import * as Effect from "effect/Effect"
import * as ManagedRuntime from "effect/ManagedRuntime"
import { execFileSync } from "node:child_process"
import * as Fs from "node:fs"
import { createRequire } from "node:module"
import * as Path from "node:path"
import { fileURLToPath, pathToFileURL } from "node:url"
import { startRedis } from "../tools/redisServer.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const rev = process.argv.slice(2).find((a) => !a.startsWith("--"))
if (rev === undefined) throw new Error("usage: npx tsx bench/revisions.ts <rev> [--backend=redis|memory] [--workers=N] [--rounds=R] [--ms=M]")
const backend = arg("backend") ?? "redis"
const workers = Number(arg("workers") ?? "16")
const rounds = Number(arg("rounds") ?? "9")
const ms = Number(arg("ms") ?? "700")

const root = fileURLToPath(new URL("../", import.meta.url))
const tsc = createRequire(import.meta.url).resolve("typescript/bin/tsc")

/** Compiles `src` (of `rev`, or of the working tree) into `.tmp/revisions/<label>` and returns that directory. */
const build = (label: string, commit: string | undefined): string => {
  const out = Path.join(root, ".tmp", "revisions", label)
  Fs.rmSync(out, { recursive: true, force: true })
  let project = Path.join(root, "tsconfig.build.json")
  if (commit !== undefined) {
    // The revision's src and build settings, unpacked beside the working tree (its node_modules resolve from there).
    const tree = Path.join(root, ".tmp", "revisions", `${label}-tree`)
    Fs.rmSync(tree, { recursive: true, force: true })
    Fs.mkdirSync(tree, { recursive: true })
    // The tar of src outgrew execFileSync's default 1 MiB buffer (ENOBUFS): room for 64 MiB.
    const archive = execFileSync("git", ["-C", root, "archive", commit, "src", "tsconfig.build.json", "tsconfig.json"], { maxBuffer: 64 * 1024 * 1024 })
    execFileSync("tar", ["-x", "-C", tree], { input: archive })
    project = Path.join(tree, "tsconfig.build.json")
  }
  execFileSync(process.execPath, [tsc, "-p", project, "--outDir", out, "--declaration", "false"], { stdio: "inherit" })
  return out
}

interface Side {
  readonly label: string
  readonly cycle: (form: "acquire" | "withLock", name: string) => Effect.Effect<unknown, unknown, unknown>
  readonly runtime: ManagedRuntime.ManagedRuntime<unknown, unknown>
}

const open = async (label: string, dir: string, url: string | undefined): Promise<Side> => {
  const lock = await import(pathToFileURL(Path.join(dir, "DistributedLock.js")).href)
  const layer = url !== undefined
    ? (await import(pathToFileURL(Path.join(dir, "RedisLease.js")).href)).layer({ url, prefix: `bench-revisions-${label}:` })
    : (await import(pathToFileURL(Path.join(dir, "MemoryBackend.js")).href)).layer()
  return {
    label,
    cycle: (form, name) => form === "acquire" ? Effect.scoped(lock.acquire(name)) : lock.withLock(Effect.void, name),
    runtime: ManagedRuntime.make(layer) as ManagedRuntime.ManagedRuntime<unknown, unknown>
  }
}

const names = Array.from({ length: workers }, (_, i) => `w${i}`)

const measure = async (side: Side, form: "acquire" | "withLock") => {
  let cycles = 0
  const cpu0 = process.cpuUsage()
  const start = performance.now()
  const stopAt = start + ms
  const worker = (w: number) =>
    Effect.gen(function*() {
      while (performance.now() < stopAt) {
        yield* side.cycle(form, names[w]!)
        cycles++
      }
    })
  await side.runtime.runPromise(Effect.forEach(names.map((_, w) => w), worker, { concurrency: "unbounded", discard: true }))
  const seconds = (performance.now() - start) / 1000
  const cpu = process.cpuUsage(cpu0)
  return { rate: cycles / seconds, cpuPerCycle: (cpu.user + cpu.system) / cycles }
}

const median = (xs: ReadonlyArray<number>) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!

const commit = execFileSync("git", ["-C", root, "rev-parse", "--short", rev]).toString().trim()
const server = backend === "redis" ? await startRedis() : undefined
try {
  const sides = [
    await open(commit, build(commit, commit), server?.url),
    await open("work", build("work", undefined), server?.url)
  ]
  const forms = ["acquire", "withLock"] as const
  // Warm-up: one round of each, not counted.
  for (const side of sides) for (const form of forms) await measure(side, form)
  const results = new Map<string, { rate: Array<number>; cpu: Array<number> }>()
  for (let round = 0; round < rounds; round++) {
    for (const side of round % 2 === 0 ? sides : [...sides].reverse()) {
      for (const form of forms) {
        const { cpuPerCycle, rate } = await measure(side, form)
        const key = `${side.label} ${form}`
        const row = results.get(key) ?? { rate: [], cpu: [] }
        row.rate.push(rate)
        row.cpu.push(cpuPerCycle)
        results.set(key, row)
      }
    }
  }
  console.log(`${backend}, ${workers} worker(s), ${rounds} rounds of ${ms} ms, medians:`)
  for (const [key, row] of results) {
    console.log(`  ${key.padEnd(24)} ${Math.round(median(row.rate)).toLocaleString("en-US").padStart(8)} cycles/s   ${median(row.cpu).toFixed(1).padStart(6)} µs CPU/cycle`)
  }
  for (const side of sides) await side.runtime.dispose()
} finally {
  await server?.stop()
}

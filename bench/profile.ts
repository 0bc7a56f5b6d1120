/**
 * `npx tsx bench/profile.ts [--seconds=S] [--only=<subject>[,<subject>]]`
 *
 * Where a lock cycle's time goes. Each subject (a backend's uncontended loop by one worker, or a
 * handoff between 8 contenders) runs for S seconds (default 5) with V8's CPU profiler on, started
 * after the subject is opened and warmed up, so the profile holds the loop only. For every
 * subject it prints, per cycle: wall time, the CPU this process spent (profile samples that are
 * not idle), and that CPU split by where it ran — the pg driver, Effect's runtime, effect-lock's
 * own code, Node's internals, the garbage collector. Wall time not spent on CPU here is time
 * waiting: for the server, for the network, or for a timer or scheduler hop.
 *
 * Each subject runs next to its raw floor (the same statements sent by raw node-postgres), so
 * the difference is the library's. The `.cpuprofile` files go to `bench/results/profiles/`
 * (git-ignored), for Chrome DevTools or `npx speedscope`.
 */
import * as Fs from "node:fs"
import * as Inspector from "node:inspector/promises"
import * as Path from "node:path"
import { fileURLToPath } from "node:url"
import { pgAdvisoryHandoff, pgLeaseHandoff, rawHandoff } from "./scenarios/handoff.js"
import { memorySubject, pgAdvisorySubject, pgLeaseSubject, rawAdvisoryFenced, rawLease, rawXactLibrary, semaphoreSubject, xactSubject } from "./scenarios/uncontended.js"
import { createDatabase, type Database, startPostgres } from "./lib/postgres.js"
import type { Subject } from "./lib/rounds.js"

const OUT_DIR = fileURLToPath(new URL("./results/profiles/", import.meta.url))

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const seconds = Number(arg("seconds") ?? "5")
const only = arg("only")?.split(",")

/** What one profiled round reports: how many lock cycles (or grants, for handoff) it did. */
interface Profiled {
  readonly id: string
  readonly cycles: number
  readonly wallMs: number
  readonly profile: CpuProfile
}

interface CpuProfile {
  readonly nodes: ReadonlyArray<{
    readonly id: number
    readonly callFrame: { readonly functionName: string; readonly url: string }
  }>
  readonly samples: ReadonlyArray<number>
  readonly timeDeltas: ReadonlyArray<number>
  readonly startTime: number
  readonly endTime: number
}

type Where = "idle" | "gc" | "pg driver" | "Effect runtime" | "effect-lock" | "node internals" | "other"

const whereOf = (frame: CpuProfile["nodes"][number]["callFrame"]): Where => {
  if (frame.functionName === "(idle)") return "idle"
  if (frame.functionName === "(garbage collector)") return "gc"
  const url = frame.url
  if (url.includes("/node_modules/pg") || url.includes("/node_modules/pg-")) return "pg driver"
  if (url.includes("/node_modules/effect/") || url.includes("/node_modules/@effect/")) return "Effect runtime"
  if (url.includes("/src/")) return "effect-lock"
  if (url.startsWith("node:") || url === "" || frame.functionName === "(program)") return "node internals"
  return "other"
}

/** Milliseconds of samples per place, and the top self-time functions outside the idle state. */
const summarize = (profile: CpuProfile) => {
  const byId = new Map(profile.nodes.map((node) => [node.id, node]))
  const byWhere = new Map<Where, number>()
  const byFunction = new Map<string, number>()
  profile.samples.forEach((id, i) => {
    const node = byId.get(id)
    if (node === undefined) return
    const ms = (profile.timeDeltas[i] ?? 0) / 1000
    const where = whereOf(node.callFrame)
    byWhere.set(where, (byWhere.get(where) ?? 0) + ms)
    if (where !== "idle") {
      const file = node.callFrame.url.split("/node_modules/").pop()?.split("/src/").pop() ?? node.callFrame.url
      const key = `${node.callFrame.functionName || "(anonymous)"} ${file}`
      byFunction.set(key, (byFunction.get(key) ?? 0) + ms)
    }
  })
  const top = [...byFunction].sort((a, b) => b[1] - a[1]).slice(0, 8)
  return { byWhere, top }
}

const profiled = async <R>(subject: Subject<R>, cyclesOf: (result: R) => number): Promise<Profiled> => {
  const trial = await subject.open()
  try {
    await trial.run({ warmup: true })
    const session = new Inspector.Session()
    session.connect()
    await session.post("Profiler.enable")
    await session.post("Profiler.setSamplingInterval", { interval: 100 })
    await session.post("Profiler.start")
    const started = performance.now()
    const result = await trial.run({ warmup: false })
    const wallMs = performance.now() - started
    const { profile } = (await session.post("Profiler.stop")) as unknown as { profile: CpuProfile }
    session.disconnect()
    Fs.mkdirSync(OUT_DIR, { recursive: true })
    Fs.writeFileSync(Path.join(OUT_DIR, `${subject.id}.cpuprofile`), JSON.stringify(profile))
    return { id: subject.id, cycles: cyclesOf(result), wallMs, profile }
  } finally {
    await trial.close()
  }
}

const PLACES: ReadonlyArray<Where> = ["pg driver", "Effect runtime", "effect-lock", "node internals", "gc", "other"]

const print = (label: string, p: Profiled): void => {
  const { byWhere, top } = summarize(p.profile)
  const perCycle = (ms: number) => `${((ms * 1000) / Math.max(1, p.cycles)).toFixed(0)} µs`
  const cpu = PLACES.reduce((sum, where) => sum + (byWhere.get(where) ?? 0), 0)
  console.log(`\n${label} (${p.id}): ${p.cycles} cycles in ${(p.wallMs / 1000).toFixed(1)} s`)
  console.log(`  per cycle: wall ${perCycle(p.wallMs)}, CPU here ${perCycle(cpu)}, waiting ${perCycle(Math.max(0, p.wallMs - cpu))}`)
  console.log(`  CPU by place: ${PLACES.map((where) => `${where} ${perCycle(byWhere.get(where) ?? 0)}`).join(", ")}`)
  console.log(`  top self time: ${top.map(([name, ms]) => `${name} ${perCycle(ms)}`).join("; ")}`)
}

interface Pair {
  readonly name: string
  readonly subject: (database: Database, ms: number) => Subject<unknown>
  readonly floor: (database: Database, ms: number) => Subject<unknown>
  readonly cycles: (result: unknown) => number
}

const throughput = (result: unknown) => (result as { readonly cycles: number }).cycles
const grants = (result: unknown) => (result as { readonly grants: number }).grants

const PAIRS: ReadonlyArray<Pair> = [
  { name: "pg-advisory", subject: (db, ms) => pgAdvisorySubject(db, 1, ms), floor: (db, ms) => rawAdvisoryFenced(db, 1, 1, ms), cycles: throughput },
  { name: "pg-lease", subject: (db, ms) => pgLeaseSubject(db, 1, ms), floor: (db, ms) => rawLease(db, 1, ms), cycles: throughput },
  { name: "xact", subject: (db, ms) => xactSubject(db, 1, ms), floor: (db, ms) => rawXactLibrary(db, 1, ms), cycles: throughput },
  { name: "memory", subject: (_, ms) => memorySubject(1, ms), floor: (_, ms) => semaphoreSubject(1, ms), cycles: throughput },
  { name: "handoff-advisory", subject: (db, ms) => pgAdvisoryHandoff(db, ms, 8), floor: (db, ms) => rawHandoff(db, ms, true), cycles: grants },
  { name: "handoff-lease", subject: (db, ms) => pgLeaseHandoff(db, ms, true), floor: (db, ms) => rawHandoff(db, ms, true), cycles: grants }
]

const main = async () => {
  const server = await startPostgres()
  const database = await createDatabase(server.adminUrl, "profile")
  try {
    for (const pair of PAIRS) {
      if (only !== undefined && !only.includes(pair.name)) continue
      const ms = seconds * 1000
      print(`${pair.name}, raw floor`, await profiled(pair.floor(database, ms), pair.cycles))
      print(`${pair.name}, effect-lock`, await profiled(pair.subject(database, ms), pair.cycles))
    }
    console.log(`\nprofiles written to ${OUT_DIR}`)
  } finally {
    await database.drop()
    await server.stop()
  }
}

main().catch((error) => {
  console.error(error)
  process.exitCode = 1
})

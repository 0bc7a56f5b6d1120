/**
 * V8 CPU profiles of a subject's rounds, and where their CPU went: the machinery of
 * `bench/profile.ts` (printed, with `.cpuprofile` files) and of the bench's `cpu` scenario (CPU
 * per cycle against the raw floor, a coded target).
 */
import * as Fs from "node:fs"
import * as Inspector from "node:inspector/promises"
import * as Path from "node:path"
import { fileURLToPath, pathToFileURL } from "node:url"
import type { ProfilingTrial } from "./isolated.js"
import type { Subject } from "./rounds.js"

export const OUT_DIR = fileURLToPath(new URL("../results/profiles/", import.meta.url))

/** What one profiled round reports: how many lock cycles (or grants, for handoff) it did. */
export interface Profiled {
  readonly id: string
  readonly cycles: number
  readonly wallMs: number
  /** CPU this process used during the round, from the kernel's account (user + system), ms. */
  readonly processCpuMs: number
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

/**
 * Where a sample ran. "pg driver" is the database driver's code: node-postgres, or ioredis and its
 * own packages for the Redis rows (the key keeps its name: `results.json` and the `cpu` scenario's
 * table use it).
 */
export type Where = "idle" | "gc" | "pg driver" | "Effect runtime" | "effect-lock" | "node internals" | "other"

/** The library's tsc build the bench runs on (`built.mjs`), as a URL prefix. */
const BUILD = process.env["EFFECT_LOCK_BENCH_BUILD"] ? pathToFileURL(process.env["EFFECT_LOCK_BENCH_BUILD"]).href : undefined

/** ioredis and the packages only it uses (its parser, command table, queue, key slots, callbacks, errors). */
const REDIS_DRIVER = ["ioredis", "@ioredis", "redis-parser", "redis-errors", "denque", "cluster-key-slot", "standard-as-callback"]
  .map((name) => `/node_modules/${name}/`)

const whereOf = (frame: CpuProfile["nodes"][number]["callFrame"]): Where => {
  if (frame.functionName === "(idle)") return "idle"
  if (frame.functionName === "(garbage collector)") return "gc"
  const url = frame.url
  if (url.includes("/node_modules/pg") || url.includes("/node_modules/pg-")) return "pg driver"
  if (REDIS_DRIVER.some((dir) => url.includes(dir))) return "pg driver"
  if (url.includes("/node_modules/effect/") || url.includes("/node_modules/@effect/")) return "Effect runtime"
  if (url.includes("/src/") || (BUILD !== undefined && url.startsWith(BUILD))) return "effect-lock"
  if (url.startsWith("node:") || url === "" || frame.functionName === "(program)") return "node internals"
  return "other"
}

/** Milliseconds of samples per place, and the top self-time functions outside the idle state. */
export const summarize = (profile: CpuProfile) => {
  const byId = new Map(profile.nodes.map((node) => [node.id, node]))
  const byWhere = new Map<Where, number>()
  const byFunction = new Map<string, number>()
  profile.samples.forEach((id, i) => {
    // The first delta runs from the profiler's start: the inspector's own `dispatch` of the start
    // command (76–142 ms seen), not the loop; it would add that to every row's CPU per cycle.
    if (i === 0) return
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

/** `use` with an inspector session of this process, disconnected after. */
const withSession = async <A>(use: (session: Inspector.Session) => Promise<A>): Promise<A> => {
  const session = new Inspector.Session()
  session.connect()
  try {
    return await use(session)
  } finally {
    session.disconnect()
  }
}

/** One round of an open subject with the profiler on. */
export const profileRound = <R>(id: string, run: () => Promise<R>, cyclesOf: (result: R) => number): Promise<Profiled> =>
  withSession(async (session) => {
    await session.post("Profiler.enable")
    await session.post("Profiler.setSamplingInterval", { interval: 100 })
    await session.post("Profiler.start")
    const started = performance.now()
    const cpuBefore = process.cpuUsage()
    const result = await run()
    const cpu = process.cpuUsage(cpuBefore)
    const wallMs = performance.now() - started
    const { profile } = (await session.post("Profiler.stop")) as unknown as { profile: CpuProfile }
    return { id, cycles: cyclesOf(result), wallMs, processCpuMs: (cpu.user + cpu.system) / 1000, profile }
  })

/**
 * Opens `subject`, warms it up, and profiles `rounds` rounds of it (each its own profile); the last
 * round's profile is written to `OUT_DIR`.
 */
export const profiled = async <R>(subject: Subject<R>, cyclesOf: (result: R) => number, rounds = 1): Promise<Array<Profiled>> => {
  const trial: ProfilingTrial<R> = await subject.open()
  try {
    await trial.run({ warmup: true })
    const out: Array<Profiled> = []
    for (let i = 0; i < rounds; i++) {
      // An isolated subject is profiled in its own process (`isolated.ts`).
      out.push(await (trial.profile ?? (() => profileRound(subject.id, () => trial.run({ warmup: false }), cyclesOf)))())
    }
    Fs.mkdirSync(OUT_DIR, { recursive: true })
    Fs.writeFileSync(Path.join(OUT_DIR, `${subject.id}.cpuprofile`), JSON.stringify(out[out.length - 1]!.profile))
    return out
  } finally {
    await trial.close()
  }
}

/** CPU spent in this process (profile samples that are not idle), ms. */
export const cpuMs = (p: Profiled): number => {
  const { byWhere } = summarize(p.profile)
  return PLACES.reduce((sum, where) => sum + (byWhere.get(where) ?? 0), 0)
}

export const PLACES: ReadonlyArray<Where> = ["pg driver", "Effect runtime", "effect-lock", "node internals", "gc", "other"]

export const print = (label: string, p: Profiled): void => {
  const { byWhere, top } = summarize(p.profile)
  const perCycle = (ms: number) => `${((ms * 1000) / Math.max(1, p.cycles)).toFixed(0)} µs`
  const cpu = cpuMs(p)
  console.log(`\n${label} (${p.id}): ${p.cycles} cycles in ${(p.wallMs / 1000).toFixed(1)} s`)
  console.log(`  per cycle: wall ${perCycle(p.wallMs)}, CPU here ${perCycle(cpu)}, waiting ${perCycle(Math.max(0, p.wallMs - cpu))}; the process's CPU clock (profiler running) ${perCycle(p.processCpuMs)}`)
  console.log(`  CPU by place: ${PLACES.map((where) => `${where} ${perCycle(byWhere.get(where) ?? 0)}`).join(", ")}`)
  console.log(`  top self time: ${top.map(([name, ms]) => `${name} ${perCycle(ms)}`).join("; ")}`)
}


/** How many functions each allocation listing names (`BENCH_ALLOC_TOP`, default 10). */
const TOP = Number(process.env["BENCH_ALLOC_TOP"] ?? "10")

/** What one round allocated, from V8's sampling heap profiler: bytes per place and the top allocating functions. */
export interface Allocated {
  readonly id: string
  readonly cycles: number
  readonly wallMs: number
  /** Estimated bytes allocated during the round (collected objects included), by place. */
  readonly bytes: Partial<Record<Where, number>>
  /** The functions that allocated most, with their bytes, largest first. */
  readonly top: ReadonlyArray<readonly [string, number]>
  /** The same, of effect-lock's own functions only. */
  readonly topOwn: ReadonlyArray<readonly [string, number]>
  /** Bytes by the nearest effect-lock frame on the allocating stack (what its calls into Effect or the driver allocated too). */
  readonly topCaller: ReadonlyArray<readonly [string, number]>
}

interface HeapNode {
  readonly callFrame: { readonly functionName: string; readonly url: string }
  readonly selfSize: number
  readonly children: ReadonlyArray<HeapNode>
}

/**
 * One round of an open subject under V8's sampling heap profiler, keeping the samples of objects
 * that the young and old generation collections freed meanwhile: each node's `selfSize` is then
 * an estimate of all the bytes allocated there during the round, not only of those still alive.
 * A sample every 512 bytes on average: a cycle's few kilobytes get several samples each.
 */
export const allocationRound = <R>(id: string, run: () => Promise<R>, cyclesOf: (result: R) => number): Promise<Allocated> =>
  withSession(async (session) => {
    await session.post("HeapProfiler.enable")
    await session.post("HeapProfiler.startSampling", {
      samplingInterval: 512,
      includeObjectsCollectedByMajorGC: true,
      includeObjectsCollectedByMinorGC: true
    })
    const started = performance.now()
    const result = await run()
    const wallMs = performance.now() - started
    const { profile } = (await session.post("HeapProfiler.stopSampling")) as unknown as { profile: { head: HeapNode } }
    const bytes: Partial<Record<Where, number>> = {}
    const byFunction = new Map<string, number>()
    const byOwnFunction = new Map<string, number>()
    const byCaller = new Map<string, number>()
    const walk = (node: HeapNode, caller: string) => {
      const own = whereOf(node.callFrame) === "effect-lock"
      const here = own
        ? `${node.callFrame.functionName || "(anonymous)"} ${node.callFrame.url.split("/bench-build/").pop()?.split("/src/").pop()}:${(node.callFrame as { readonly lineNumber?: number }).lineNumber ?? "?"}`
        : caller
      if (node.selfSize > 0) byCaller.set(here, (byCaller.get(here) ?? 0) + node.selfSize)
      if (node.selfSize > 0) {
        const where = whereOf(node.callFrame)
        bytes[where] = (bytes[where] ?? 0) + node.selfSize
        const file = node.callFrame.url.split("/node_modules/").pop()?.split("/src/").pop()?.split("/bench-build/").pop() ?? node.callFrame.url
        const key = `${node.callFrame.functionName || "(anonymous)"} ${file}`
        byFunction.set(key, (byFunction.get(key) ?? 0) + node.selfSize)
        if (where === "effect-lock") {
          const line = `${key}:${(node.callFrame as { readonly lineNumber?: number }).lineNumber ?? "?"}`
          byOwnFunction.set(line, (byOwnFunction.get(line) ?? 0) + node.selfSize)
        }
      }
      for (const child of node.children) walk(child, here)
    }
    walk(profile.head, "(no effect-lock frame)")
    const largest = (map: Map<string, number>, n = TOP) => [...map].sort((a, b) => b[1] - a[1]).slice(0, n)
    await session.post("HeapProfiler.disable")
    return { id, cycles: cyclesOf(result), wallMs, bytes, top: largest(byFunction), topOwn: largest(byOwnFunction), topCaller: largest(byCaller) }
  })

/** Opens `subject`, warms it up, and samples the allocations of one round. */
export const allocations = async <R>(subject: Subject<R>, cyclesOf: (result: R) => number): Promise<Allocated> => {
  const trial: ProfilingTrial<R> = await subject.open()
  try {
    await trial.run({ warmup: true })
    return await (trial.allocations ?? (() => allocationRound(subject.id, () => trial.run({ warmup: false }), cyclesOf)))()
  } finally {
    await trial.close()
  }
}

export const printAllocations = (label: string, a: Allocated): void => {
  const total = Object.values(a.bytes).reduce((sum, n) => sum + (n ?? 0), 0)
  const perCycle = (n: number) => `${(n / Math.max(1, a.cycles) / 1024).toFixed(2)} KiB`
  console.log(`\n${label} (${a.id}): ${a.cycles} cycles in ${(a.wallMs / 1000).toFixed(1)} s`)
  console.log(`  allocated per cycle: ${perCycle(total)}`)
  console.log(`  by place: ${PLACES.map((where) => `${where} ${perCycle(a.bytes[where] ?? 0)}`).join(", ")}`)
  console.log(`  top allocating: ${a.top.map(([name, n]) => `${name} ${perCycle(n)}`).join("; ")}`)
  if (a.topOwn.length > 0) console.log(`  top in effect-lock (function file:line): ${a.topOwn.map(([name, n]) => `${name} ${perCycle(n)}`).join("; ")}`)
  if (a.topCaller.length > 0) console.log(`  by nearest effect-lock frame on the stack: ${a.topCaller.map(([name, n]) => `${name} ${perCycle(n)}`).join("; ")}`)
}

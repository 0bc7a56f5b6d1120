/**
 * `npx tsx --import ./bench/lib/built.mjs bench/promotion.ts [--rounds=R] [--seconds=S] [--only=<id>[,<id>]] [--v8=<flag>[,<flag>]]`
 * (ids: raw-pg, pg-advisory-8, pg-advisory-1, pg-lease-notify, memory, raw-redis, redis-lease-8; default all)
 *
 * What a handoff grant leaves to the old generation. Each row of the bench's handoff scenarios
 * (8 contenders on one name, hold 1 ms) runs in a process of its own under V8's
 * `--trace-gc-nvp`, R rounds of S seconds after a warm-up, a second apart. Per round it prints
 * the grants and longest wait, the young-generation collections (scavenges) and their pauses,
 * the bytes they promoted to the old generation, per grant, and the mark-compacts that
 * followed. A round that meets a mark-compact has the longer longest wait (bench/README.md,
 * "longest waits"); the old generation fills with what the scavenges promote.
 *
 * `--v8=` passes flags to the children's V8 (information only: no user's process is started
 * with them), e.g. `--v8=--no-allocation-site-pretenuring`. Without a Redis the Redis rows are
 * skipped, with the reason. A diagnostic, not a target: nothing here is written to the report.
 */
import { spawn } from "node:child_process"
import { fileURLToPath } from "node:url"
import { lockHandoff, pgAdvisoryHandoff, pgLeaseHandoff, rawHandoff } from "./scenarios/handoff.js"
import { HANDOFF_FACTORIES } from "./scenarios/redis.js"
import * as MemoryBackend from "../src/MemoryBackend.js"
import { INSTALL_HINT, redisAvailable, startRedis } from "../tools/redisServer.js"
import type { HandoffRound } from "./lib/handoff.js"
import { type Database, runMain, withScratchDatabase } from "./lib/postgres.js"
import type { Subject } from "./lib/rounds.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const rounds = Number(arg("rounds") ?? "3")
const seconds = Number(arg("seconds") ?? "2")
const only = arg("only")?.split(",")
const v8Flags = arg("v8")?.split(",") ?? []
const child = arg("child")

type On = { readonly database?: Database; readonly redis?: string }
const ROWS: Record<string, { readonly on: "pg" | "redis" | "none"; readonly subject: (on: On, ms: number) => Subject<HandoffRound> }> = {
  "raw-pg": { on: "pg", subject: (on, ms) => rawHandoff(on.database!, ms, false) },
  "pg-advisory-8": { on: "pg", subject: (on, ms) => pgAdvisoryHandoff(on.database!, ms, 8) },
  "pg-advisory-1": { on: "pg", subject: (on, ms) => pgAdvisoryHandoff(on.database!, ms, 1) },
  "pg-lease-notify": { on: "pg", subject: (on, ms) => pgLeaseHandoff(on.database!, ms, true) },
  memory: { on: "none", subject: (_, ms) => lockHandoff("memory", 1, () => MemoryBackend.layer(), ms) },
  "raw-redis": { on: "redis", subject: (on, ms) => HANDOFF_FACTORIES.rawHandoff(undefined, on.redis!, ms) },
  "redis-lease-8": { on: "redis", subject: (on, ms) => HANDOFF_FACTORIES.redisLeaseHandoff(undefined, on.redis!, ms) }
}

const START = "PROMOTION-ROUND-START"
const END = "PROMOTION-ROUND-END"

/** The child: one row, its rounds between markers on stdout (V8's trace lines come between them). */
const runChild = async (id: string): Promise<void> => {
  const row = ROWS[id]!
  const measure = async (on: On) => {
    const trial = await row.subject(on, seconds * 1000).open()
    try {
      console.log("PROMOTION-WARMUP")
      await trial.run({ warmup: true })
      for (let r = 0; r < rounds; r++) {
        // A second with nobody waiting, as between the bench's interleaved rows.
        await new Promise((resolve) => setTimeout(resolve, 1000))
        console.log(START)
        const round = await trial.run({ warmup: false })
        console.log(`${END} ${round.perContender.reduce((a, b) => a + b, 0)} ${round.longestWaitMs}`)
      }
    } finally {
      await trial.close()
    }
  }
  if (row.on === "pg") return withScratchDatabase(`promotion-${id}`, (database) => measure({ database }))
  if (row.on === "none") return measure({})
  const server = await startRedis()
  try {
    await measure({ redis: server.url })
  } finally {
    await server.stop()
  }
}

interface Round {
  readonly grants: number
  readonly longestMs: number
  readonly scavenges: number
  readonly scavengeMs: number
  readonly promoted: number
  readonly markCompacts: number
  readonly markCompactMs: number
}

/** Rounds out of a child's output: `--trace-gc-nvp` lines (`gc=s` scavenge, `gc=mc` mark-compact) between the markers. */
const parse = (output: string): Array<Round> => {
  const found: Array<Round> = []
  let current: { scavenges: number; scavengeMs: number; promoted: number; markCompacts: number; markCompactMs: number } | undefined
  for (const line of output.split("\n")) {
    if (line.startsWith(START)) {
      current = { scavenges: 0, scavengeMs: 0, promoted: 0, markCompacts: 0, markCompactMs: 0 }
      continue
    }
    if (line.startsWith(END) && current !== undefined) {
      const [, grants, longest] = line.split(" ")
      found.push({ ...current, grants: Number(grants), longestMs: Number(longest) })
      current = undefined
      continue
    }
    if (current === undefined) continue
    const kind = /\bgc=(\w+)/.exec(line)?.[1]
    const pause = Number(/\bpause=([\d.]+)/.exec(line)?.[1] ?? 0)
    if (kind === "s") {
      current.scavenges++
      current.scavengeMs += pause
      current.promoted += Number(/\bpromoted=(\d+)/.exec(line)?.[1] ?? 0)
    } else if (kind === "mc") {
      current.markCompacts++
      current.markCompactMs += pause
    }
  }
  return found
}

const runRow = (id: string): Promise<Array<Round>> =>
  new Promise((resolve, reject) => {
    const script = fileURLToPath(import.meta.url)
    // The parent's loaders (tsx, the library's build), as `lib/isolated.ts` starts its children.
    const proc = spawn(process.execPath, [...process.execArgv, "--trace-gc-nvp", ...v8Flags, script, `--child=${id}`, `--rounds=${rounds}`, `--seconds=${seconds}`], {
      stdio: ["ignore", "pipe", "inherit"]
    })
    let output = ""
    proc.stdout.setEncoding("utf8").on("data", (chunk: string) => output += chunk)
    proc.on("error", reject)
    proc.on("exit", (code) => code === 0 ? resolve(parse(output)) : reject(new Error(`${id}: the child exited with ${code}`)))
  })

const main = async (): Promise<void> => {
  if (child !== undefined) return runChild(child)
  const redis = redisAvailable()
  console.log(`handoff rows, ${rounds} rounds of ${seconds} s each, a process per row${v8Flags.length > 0 ? `, V8 flags ${v8Flags.join(" ")}` : ""}`)
  for (const [id, row] of Object.entries(ROWS)) {
    if (only !== undefined && !only.includes(id)) continue
    if (row.on === "redis" && !redis) {
      console.log(`${id}: skipped, no Redis (${INSTALL_HINT})`)
      continue
    }
    for (const [r, round] of (await runRow(id)).entries()) {
      console.log(
        `${id.padEnd(16)} r${r}: ${String(round.grants).padStart(5)} grants, longest wait ${round.longestMs.toFixed(1).padStart(5)} ms; ` +
          `${round.scavenges} scavenges (${round.scavengeMs.toFixed(0)} ms), promoted ${(round.promoted / 1024).toFixed(0).padStart(5)} KiB = ` +
          `${(round.promoted / Math.max(1, round.grants)).toFixed(0).padStart(5)} B/grant; ${round.markCompacts} mark-compacts (${round.markCompactMs.toFixed(1)} ms)`
      )
    }
  }
}

runMain(main)

/**
 * `npx tsx --import ./bench/lib/built.mjs bench/profile.ts [--seconds=S] [--only=<subject>[,<subject>]]`
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
import { pgAdvisoryHandoff, pgLeaseHandoff, rawHandoff } from "./scenarios/handoff.js"
import { own } from "./scenarios/uncontended.js"
import { type Database, runMain, withScratchDatabase } from "./lib/postgres.js"
import { OUT_DIR, print, profiled } from "./lib/profiling.js"
import type { Subject } from "./lib/rounds.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const seconds = Number(arg("seconds") ?? "5")
const only = arg("only")?.split(",")

interface Pair {
  readonly name: string
  readonly subject: (database: Database, ms: number) => Subject<unknown>
  readonly floor: (database: Database, ms: number) => Subject<unknown>
  readonly cycles: (result: unknown) => number
}

const throughput = (result: unknown) => (result as { readonly cycles: number }).cycles
const grants = (result: unknown) => (result as { readonly grants: number }).grants

const PAIRS: ReadonlyArray<Pair> = [
  { name: "pg-advisory", subject: (db, ms) => own("pgAdvisorySubject", db, 1, ms), floor: (db, ms) => own("rawAdvisoryFenced", db, 1, 1, ms), cycles: throughput },
  { name: "pg-lease", subject: (db, ms) => own("pgLeaseSubject", db, 1, ms), floor: (db, ms) => own("rawLease", db, 1, ms), cycles: throughput },
  { name: "xact", subject: (db, ms) => own("xactSubject", db, 1, ms), floor: (db, ms) => own("rawXactLibrary", db, 1, ms), cycles: throughput },
  { name: "xact-16", subject: (db, ms) => own("xactSubject", db, 16, ms), floor: (db, ms) => own("sqlXactSubject", db, 16, ms), cycles: throughput },
  { name: "pg-lease-16", subject: (db, ms) => own("pgLeaseSubject", db, 16, ms), floor: (db, ms) => own("rawLease", db, 16, ms), cycles: throughput },
  { name: "memory", subject: (_, ms) => own("memorySubject", undefined, 1, ms), floor: (_, ms) => own("semaphoreSubject", undefined, 1, ms), cycles: throughput },
  { name: "handoff-advisory", subject: (db, ms) => pgAdvisoryHandoff(db, ms, 8), floor: (db, ms) => rawHandoff(db, ms, true), cycles: grants },
  { name: "handoff-lease", subject: (db, ms) => pgLeaseHandoff(db, ms, true), floor: (db, ms) => rawHandoff(db, ms, true), cycles: grants }
]

runMain(() =>
  withScratchDatabase("profile", async (database) => {
    for (const pair of PAIRS) {
      if (only !== undefined && !only.includes(pair.name)) continue
      const ms = seconds * 1000
      print(`${pair.name}, raw floor`, (await profiled(pair.floor(database, ms), pair.cycles))[0]!)
      print(`${pair.name}, effect-lock`, (await profiled(pair.subject(database, ms), pair.cycles))[0]!)
    }
    console.log(`\nprofiles written to ${OUT_DIR}`)
  })
)

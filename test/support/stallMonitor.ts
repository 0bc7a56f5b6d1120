/**
 * An event-loop stall monitor for diagnosing timing flakes, off unless `STALL_MONITOR=<dir>` is
 * set (vitest.config.ts adds this setup file only then). Each worker process appends to
 * `<dir>/<pid>.log`:
 *
 * - `GAP`: a 10 ms timer that ran 150 ms or more late, with what the main thread did meanwhile
 *   (Linux `/proc/self/task/<pid>/schedstat`): `oncpu` ran, `runqwait` was runnable but waited
 *   for a CPU (the OS starving the process), the rest it slept (a blocking call: a busy_timeout
 *   wait, a deliberate stall); `gc` is the GC pause time reported in between; the tests running.
 * - `GC`: GC pauses of 20 ms or more. `SQL`/`DB.*`: better-sqlite3 calls of 40 ms or more.
 *
 * `STALL_NICE=<n>` (with the monitor) sets the SQLite contract worker's main thread to nice `n`
 * (negative needs CAP_SYS_NICE): the experiment that showed its stalls are CPU scheduling delay.
 */
import * as Fs from "node:fs"
import { createRequire } from "node:module"
import * as Os from "node:os"
import * as Path from "node:path"
import { PerformanceObserver, performance } from "node:perf_hooks"
import { afterEach, beforeEach, expect } from "vitest"

const dir = process.env["STALL_MONITOR"]
const KEY = Symbol.for("effect-lock/test/stall-monitor")
interface Monitor {
  readonly running: Set<string>
  readonly log: (line: string) => void
}
const store = globalThis as { [KEY]?: Monitor }

const GAP_MS = 150
const TICK_MS = 10

/** Main-thread ns on a CPU and ns runnable but waiting for one, or undefined off Linux. */
const schedstat = (): [number, number] | undefined => {
  try {
    const [oncpu, wait] = Fs.readFileSync(`/proc/self/task/${process.pid}/schedstat`, "utf8").split(" ").map(Number)
    return [oncpu!, wait!]
  } catch {
    return undefined
  }
}

/** Times better-sqlite3's synchronous calls: statements (all users of the driver in this worker) and the database's own. */
const timeSqlite = (log: (line: string) => void) => {
  const Database = createRequire(import.meta.url)("better-sqlite3")
  const probe = new Database(":memory:")
  const statement = Object.getPrototypeOf(probe.prepare("select 1"))
  probe.close()
  const wrap = (target: Record<string, Function>, method: string, label: (self: any, args: Array<unknown>) => string) => {
    const original = target[method]!
    target[method] = function(this: unknown, ...args: Array<unknown>) {
      const started = performance.now()
      try {
        return original.apply(this, args)
      } finally {
        const took = performance.now() - started
        if (took >= 40) log(`${label(this, args)} ${took.toFixed(0)} ms`)
      }
    }
  }
  const text = (sql: unknown) => String(sql).replace(/\s+/g, " ").slice(0, 120)
  for (const method of ["run", "get", "all"]) wrap(statement, method, (self) => `SQL ${method} ${text(self.source)}`)
  for (const method of ["exec", "pragma", "prepare", "close"]) wrap(Database.prototype, method, (_, args) => `DB.${method} ${text(args[0])}`)
}

const start = (folder: string): Monitor => {
  Fs.mkdirSync(folder, { recursive: true })
  const file = Path.join(folder, `${process.pid}.log`)
  const running = new Set<string>()
  const log = (line: string) => Fs.appendFileSync(file, `${(Date.now() / 1000).toFixed(3)} ${line}\n`)
  let gcMs = 0
  new PerformanceObserver((list) => {
    for (const entry of list.getEntries()) {
      gcMs += entry.duration
      if (entry.duration >= 20) log(`GC ${entry.duration.toFixed(0)} ms, heap ${(process.memoryUsage().heapUsed / 1e6).toFixed(0)} MB`)
    }
  }).observe({ entryTypes: ["gc"] })
  let last = performance.now()
  let lastSched = schedstat()
  let lastGc = 0
  setInterval(() => {
    const now = performance.now()
    const sched = schedstat()
    const gap = now - last - TICK_MS
    if (gap >= GAP_MS) {
      const split = sched && lastSched
        ? `oncpu ${((sched[0] - lastSched[0]) / 1e6).toFixed(0)} runqwait ${((sched[1] - lastSched[1]) / 1e6).toFixed(0)} `
        : ""
      const load = Fs.existsSync("/proc/loadavg") ? ` load ${Fs.readFileSync("/proc/loadavg", "utf8").split(" ").slice(0, 3).join(" ")}` : ""
      log(`GAP ${gap.toFixed(0)} ms: ${split}gc ${(gcMs - lastGc).toFixed(0)}${load} running=[${[...running].join(" | ")}]`)
    }
    last = now
    lastSched = sched
    lastGc = gcMs
  }, TICK_MS).unref()
  try {
    timeSqlite(log)
  } catch (error) {
    log(`better-sqlite3 not timed: ${String(error)}`)
  }
  return { running, log }
}

if (dir !== undefined && dir !== "") {
  // Once per worker: setup files run again for every test file of a shared (isolate: false) worker.
  const { running, log } = (store[KEY] ??= start(dir))
  beforeEach((context) => {
    running.add(context.task.name.slice(0, 70))
  })
  afterEach((context) => {
    running.delete(context.task.name.slice(0, 70))
    if (context.task.result?.state === "fail") log(`FAIL ${context.task.name}`)
  })
  const testPath = String(expect.getState().testPath)
  log(`file ${testPath}`)
  const nice = process.env["STALL_NICE"]
  if (nice !== undefined && testPath.endsWith("/SqliteLease.test.ts")) {
    Os.setPriority(Number(nice))
    log(`nice ${Os.getPriority()}`)
  }
}

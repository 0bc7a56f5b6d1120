/**
 * `npx tsx --import ./bench/lib/built.mjs bench/cpuSplit.ts [factory,factory,...] [--seconds=S]`
 * (factories of `scenarios/uncontended.ts`; default rawLease,pgLeaseSubject,effectLeaseFloor)
 *
 * Where a row's CPU clock goes, by the kernel's account: each row (one worker) in a process of its
 * own, warmed up, then 3 rounds of S seconds (default 2); per cycle, the process's user and system
 * time and voluntary / involuntary context switches (`process.resourceUsage()`), and each
 * thread's time (`/proc/self/task/<tid>/stat`, 10 ms ticks: the main thread is the one named like
 * the process). The bench's CPU target reads user + system of every thread; this splits it.
 */
import { fork } from "node:child_process"
import * as Fs from "node:fs"
import { createDatabase, runMain, startPostgres } from "./lib/postgres.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const ms = Number(arg("seconds") ?? "2") * 1000

/** Each thread's user + system ticks (10 ms) so far, by `tid:name`. */
const threadTicks = (): Record<string, number> =>
  Object.fromEntries(Fs.readdirSync("/proc/self/task").map((tid) => {
    const stat = Fs.readFileSync(`/proc/self/task/${tid}/stat`, "utf8")
    const name = stat.slice(stat.indexOf("(") + 1, stat.lastIndexOf(")"))
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ")
    // Fields 14 and 15 of stat(5) (utime, stime), counted from the state field here.
    return [`${tid}:${name}`, Number(fields[11]) + Number(fields[12])]
  }))

const child = async (factory: string, url: string, name: string) => {
  const { FACTORIES } = (await import("./scenarios/uncontended.js")) as unknown as {
    readonly FACTORIES: Record<string, (database: unknown, concurrency: number, ms: number) => { open: () => Promise<{ run: (o: { warmup: boolean }) => Promise<{ cycles: number }>; close: () => Promise<void> }> }>
  }
  const make = FACTORIES[factory]
  if (make === undefined) throw new Error(`scenarios/uncontended.ts has no factory ${factory}`)
  const trial = await make({ name, url, drop: () => Promise.resolve() }, 1, ms).open()
  try {
    await trial.run({ warmup: true })
    for (let round = 0; round < 3; round++) {
      const ticksBefore = threadTicks()
      const before = process.resourceUsage()
      const { cycles } = await trial.run({ warmup: false })
      const after = process.resourceUsage()
      const ticksAfter = threadTicks()
      const each = (n: number, digits = 0) => (n / cycles).toFixed(digits)
      const threads = Object.entries(ticksAfter)
        .map(([thread, ticks]) => [thread, ((ticks - (ticksBefore[thread] ?? 0)) * 10_000) / cycles] as const)
        .filter(([, us]) => us > 0)
        .map(([thread, us]) => `${thread} ${us.toFixed(0)}`)
      console.log(
        `${factory.padEnd(18)} ${String(cycles).padStart(5)} cycles; per cycle µs: user ${each(after.userCPUTime - before.userCPUTime)}, ` +
          `system ${each(after.systemCPUTime - before.systemCPUTime)}; context switches ${each(after.voluntaryContextSwitches - before.voluntaryContextSwitches, 2)} ` +
          `voluntary, ${each(after.involuntaryContextSwitches - before.involuntaryContextSwitches, 2)} involuntary; threads (µs): ${threads.join(", ")}`
      )
    }
  } finally {
    await trial.close()
  }
}

if (process.argv[2] === "--child") {
  const [factory, url, name] = process.argv.slice(3)
  runMain(() => child(factory!, url!, name!).then(() => process.exit(0)))
} else {
  runMain(async () => {
    const factories = (process.argv[2]?.startsWith("--") ? undefined : process.argv[2]?.split(",")) ??
      ["rawLease", "pgLeaseSubject", "effectLeaseFloor"]
    const server = await startPostgres()
    try {
      const database = await createDatabase(server.adminUrl, "cpu_split")
      try {
        for (const factory of factories) {
          await new Promise<void>((resolve, reject) =>
            fork(new URL(import.meta.url).pathname, ["--child", factory, database.url, database.name, `--seconds=${ms / 1000}`], {
              execArgv: process.execArgv,
              // The row runs here, in this child, not in a grandchild (`own`'s isolation).
              env: { ...process.env, BENCH_IN_PROCESS: "1" }
            }).on("exit", (code) => (code === 0 ? resolve() : reject(new Error(`${factory}: exit ${code}`)))))
        }
      } finally {
        await database.drop()
      }
    } finally {
      await server.stop()
    }
  })
}

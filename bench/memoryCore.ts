/**
 * `npx tsx bench/memoryCore.ts [--rounds=N] [--ms=M] [--profile=<loop-seconds>] [--guard]`
 *
 * The core's own cost: `Effect.scoped(DistributedLock.acquire(name))` on the memory backend
 * against `Effect.makeSemaphore` taking and releasing one permit per name, in one process, by 1
 * and 16 workers (each worker its own name). Rounds are interleaved (the order flips every
 * round) and the ratio is the median over rounds of memory / semaphore cycles per second.
 * Needs no database. `--profile=S` instead runs only the memory loop for S seconds (for
 * `node --cpu-prof --import tsx bench/memoryCore.ts --profile=5`). `--guard` measures what
 * `guard`'s stall watch adds per resumption of a body fiber (a lease from the service is
 * watched, a hand-made copy of it is not).
 */
import * as Effect from "effect/Effect"
import * as DistributedLock from "../src/DistributedLock.js"
import * as MemoryBackend from "../src/MemoryBackend.js"
import { effectLoop } from "./lib/loops.js"
import { openRuntime, type OpenRuntime } from "./lib/runtime.js"
import { median } from "./lib/stats.js"

const arg = (name: string, fallback: number): number => {
  const found = process.argv.find((a) => a.startsWith(`--${name}=`))
  return found === undefined ? fallback : Number(found.slice(name.length + 3))
}

const range = (n: number): Array<number> => Array.from({ length: n }, (_, i) => i)

interface Runner {
  readonly label: string
  readonly run: (ms: number) => Promise<number>
  readonly close: () => Promise<void>
}

const memoryRunner = async (concurrency: number): Promise<Runner> => {
  const runtime: OpenRuntime<DistributedLock.DistributedLock> = await openRuntime(MemoryBackend.layer())
  const names = range(concurrency).map((w) => `memory-c${concurrency}-w${w}`)
  return {
    label: "MemoryBackend",
    run: async (ms) => {
      const sample = await runtime.run(effectLoop(concurrency, ms, (w) => Effect.scoped(DistributedLock.acquire(names[w]!))))
      return sample.cycles / sample.seconds
    },
    close: runtime.close
  }
}

const semaphoreRunner = async (concurrency: number): Promise<Runner> => {
  const semaphores = await Effect.runPromise(Effect.forEach(range(concurrency), () => Effect.makeSemaphore(1)))
  const cycle = (w: number) => Effect.scoped(Effect.acquireRelease(semaphores[w]!.take(1), () => semaphores[w]!.release(1)))
  return {
    label: "Effect.makeSemaphore",
    run: async (ms) => {
      const sample = await Effect.runPromise(effectLoop(concurrency, ms, cycle))
      return sample.cycles / sample.seconds
    },
    close: async () => {}
  }
}

const measure = async (concurrency: number, rounds: number, ms: number) => {
  const memory = await memoryRunner(concurrency)
  const semaphore = await semaphoreRunner(concurrency)
  await memory.run(ms / 2)
  await semaphore.run(ms / 2)
  const m: Array<number> = []
  const s: Array<number> = []
  const paired: Array<number> = []
  for (let r = 0; r < rounds; r++) {
    const order = r % 2 === 0 ? [memory, semaphore] : [semaphore, memory]
    const rates = new Map<Runner, number>()
    for (const runner of order) rates.set(runner, await runner.run(ms))
    m.push(rates.get(memory)!)
    s.push(rates.get(semaphore)!)
    paired.push(rates.get(memory)! / rates.get(semaphore)!)
  }
  await memory.close()
  const fmt = (n: number) => Math.round(n).toLocaleString("en-US")
  const ratio = median(m) / median(s)
  console.log(
    `workers=${concurrency}: MemoryBackend ${fmt(median(m))}/s, Effect.makeSemaphore ${fmt(median(s))}/s, ` +
      `ratio ${ratio.toFixed(2)}x (per round ${Math.min(...paired).toFixed(2)}–${Math.max(...paired).toFixed(2)})`
  )
}

/** Median time per resumption of a body of `yieldNow`s under `guard`, watched and not. */
const measureGuard = async (rounds: number) => {
  const runtime = await openRuntime(MemoryBackend.layer())
  const yields = (n: number): Effect.Effect<void> =>
    n <= 0 ? Effect.void : Effect.zipRight(Effect.yieldNow(), Effect.suspend(() => yields(n - 1)))
  const RESUMES = 2_000
  const BODIES = 20
  const run = (watched: boolean) =>
    runtime.run(Effect.scoped(Effect.gen(function*() {
      const lease = yield* DistributedLock.acquire("guarded")
      const target = watched ? lease : { name: lease.name, token: lease.token, mode: lease.mode, lost: lease.lost, isHeld: lease.isHeld }
      const start = performance.now()
      for (let i = 0; i < BODIES; i++) yield* DistributedLock.guard(target, yields(RESUMES))
      return (performance.now() - start) * 1e6 / (BODIES * RESUMES)
    })))
  const watched: Array<number> = []
  const bare: Array<number> = []
  for (let r = 0; r < rounds; r++) {
    bare.push(await run(false))
    watched.push(await run(true))
  }
  await runtime.close()
  console.log(
    `guard, per resumption of the body: watched ${median(watched).toFixed(0)} ns, not watched ${median(bare).toFixed(0)} ns ` +
      `(the stall watch adds ${(median(watched) - median(bare)).toFixed(0)} ns)`
  )
}

const profileSeconds = arg("profile", 0)
if (process.argv.includes("--guard")) {
  await measureGuard(arg("rounds", 9))
} else if (profileSeconds > 0) {
  const memory = await memoryRunner(1)
  const rate = await memory.run(profileSeconds * 1000)
  await memory.close()
  console.log(`MemoryBackend, 1 worker: ${Math.round(rate)}/s`)
} else {
  const rounds = arg("rounds", 7)
  const ms = arg("ms", 300)
  for (const concurrency of [1, 16]) await measure(concurrency, rounds, ms)
}

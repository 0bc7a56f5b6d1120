/**
 * Scenario 5 — semaphore cycles/s: `DistributedSemaphore.acquire` + release on the memory backend,
 * beside the lock's `DistributedLock.acquire` + release on the same backend and `Effect.makeSemaphore`
 * (the in-process floor), by 1 and 16 workers.
 *
 * - *uncontended*: each worker its own name (limit 1 for the semaphore), as in scenario 1;
 * - *one name, limit = workers*: every worker on one name with enough permits for all, so every
 *   cycle goes through one entry's queue without waiting;
 * - *contended*: 16 workers on one name with 4 permits: every release hands permits to a waiter.
 *
 * Only the memory backend has permits so far; the PostgreSQL rows follow when PgLease,
 * SQLite and PgAdvisory provide `DistributedSemaphore`.
 */
import * as Effect from "effect/Effect"
import * as DistributedLock from "../../src/DistributedLock.js"
import * as DistributedSemaphore from "../../src/DistributedSemaphore.js"
import * as MemoryBackend from "../../src/MemoryBackend.js"
import type { Context, Scenario } from "../lib/context.js"
import { effectLoop, type ThroughputSample } from "../lib/loops.js"
import * as Report from "../lib/report.js"
import type { Target } from "../lib/report.js"
import { lengthOf, type Subject } from "../lib/rounds.js"
import { openRuntime } from "../lib/runtime.js"
import { measureThroughput, ratioOf, renderThroughput, type ThroughputRow, type ThroughputSpec } from "../lib/throughput.js"

const CONCURRENCIES = [1, 16] as const
/** Permits of the contended row's one name. */
const CONTENDED_LIMIT = 4

const range = (n: number): Array<number> => Array.from({ length: n }, (_, i) => i)

type Cycle = (worker: number) => Effect.Effect<unknown, unknown, DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore>

/** Cycles of `cycle` by `concurrency` workers over one memory layer, opened once. */
const memorySubject = (id: string, concurrency: number, durationMs: number, cycle: Cycle): Subject<ThroughputSample> => ({
  id,
  open: async () => {
    const runtime = await openRuntime(MemoryBackend.layer())
    return {
      run: (round) => runtime.run(effectLoop(concurrency, lengthOf(round, durationMs), (w) => Effect.asVoid(cycle(w)))),
      close: runtime.close
    }
  }
})

/** The floor: Effect semaphores, one per name (`perWorker`) or one shared by all workers. */
const effectSemaphoreSubject = (
  id: string,
  concurrency: number,
  durationMs: number,
  permits: number,
  perWorker: boolean
): Subject<ThroughputSample> => ({
  id,
  open: async () => {
    const semaphores = await Effect.runPromise(Effect.forEach(range(perWorker ? concurrency : 1), () => Effect.makeSemaphore(permits)))
    const of = (w: number) => semaphores[perWorker ? w : 0]!
    const cycle = (w: number) => Effect.scoped(Effect.acquireRelease(of(w).take(1), () => of(w).release(1)))
    return { run: (round) => Effect.runPromise(effectLoop(concurrency, lengthOf(round, durationMs), cycle)), close: async () => {} }
  }
})

const specs = (c: number, ms: number): Array<ThroughputSpec> => {
  const names = range(c).map((w) => `semaphore-bench-c${c}-w${w}`)
  const rows: Array<ThroughputSpec> = [
    { block: "own", id: "effect-own", label: "Effect.makeSemaphore(1), one per worker", connections: "–", concurrency: c, subject: effectSemaphoreSubject(`effect-own-${c}`, c, ms, 1, true) },
    {
      block: "own",
      id: "lock-own",
      label: "DistributedLock.acquire, own name",
      connections: "–",
      concurrency: c,
      baseline: "effect-own",
      subject: memorySubject(`lock-own-${c}`, c, ms, (w) => Effect.scoped(DistributedLock.acquire(names[w]!)))
    },
    {
      block: "own",
      id: "semaphore-own",
      label: "DistributedSemaphore.acquire, own name, limit 1",
      connections: "–",
      concurrency: c,
      baseline: "lock-own",
      subject: memorySubject(`semaphore-own-${c}`, c, ms, (w) => Effect.scoped(DistributedSemaphore.acquire(names[w]!, { limit: 1 })))
    }
  ]
  if (c > 1) {
    rows.push(
      { block: "shared", id: "effect-shared", label: `Effect.makeSemaphore(${c}), one for all`, connections: "–", concurrency: c, subject: effectSemaphoreSubject(`effect-shared-${c}`, c, ms, c, false) },
      {
        block: "shared",
        id: "semaphore-shared",
        label: `DistributedSemaphore.acquire, one name, limit ${c}`,
        connections: "–",
        concurrency: c,
        baseline: "effect-shared",
        subject: memorySubject(`semaphore-shared-${c}`, c, ms, () => Effect.scoped(DistributedSemaphore.acquire("semaphore-bench-shared", { limit: c })))
      },
      { block: "contended", id: "effect-contended", label: `Effect.makeSemaphore(${CONTENDED_LIMIT}), one for all`, connections: "–", concurrency: c, subject: effectSemaphoreSubject(`effect-contended-${c}`, c, ms, CONTENDED_LIMIT, false) },
      {
        block: "contended",
        id: "semaphore-contended",
        label: `DistributedSemaphore.acquire, one name, limit ${CONTENDED_LIMIT}`,
        connections: "–",
        concurrency: c,
        baseline: "effect-contended",
        subject: memorySubject(
          `semaphore-contended-${c}`,
          c,
          ms,
          () => Effect.scoped(DistributedSemaphore.acquire("semaphore-bench-contended", { limit: CONTENDED_LIMIT }))
        )
      }
    )
  }
  return rows
}

export interface SemaphoreResult {
  readonly byConcurrency: ReadonlyArray<{ readonly concurrency: number; readonly rows: ReadonlyArray<ThroughputRow> }>
}

const run = async (context: Context): Promise<SemaphoreResult> => {
  const byConcurrency: Array<SemaphoreResult["byConcurrency"][number]> = []
  for (const c of CONCURRENCIES) {
    byConcurrency.push({ concurrency: c, rows: await measureThroughput(context, `semaphore c=${c}`, specs(c, context.settings.memoryThroughputMs)) })
  }
  return { byConcurrency }
}

const render = (result: SemaphoreResult): string =>
  [
    "A cycle is `Effect.scoped(DistributedSemaphore.acquire(name, { limit }))` (one permit), " +
    "`Effect.scoped(DistributedLock.acquire(name))` for the lock, and a scoped take/release of one permit of " +
    "an `Effect.makeSemaphore` for the floor, all in this process on the memory backend. The semaphore row of each " +
    "block is divided by the lock's (own names) or by the Effect semaphore of the same shape (one name). " +
    "Only the memory backend has permits so far.",
    "",
    ...result.byConcurrency.map((level) =>
      [`### ${level.concurrency} concurrent ${level.concurrency === 1 ? "worker" : "workers"}`, "", renderThroughput(level.rows)].join("\n")
    )
  ].join("\n\n")

const targets = (result: SemaphoreResult): ReadonlyArray<Target> =>
  result.byConcurrency.map((level): Target => {
    const row = level.rows.find((r) => r.id === "semaphore-own")
    const lock = level.rows.find((r) => r.id === "lock-own")
    const subject = `memory backend, ${level.concurrency} ${level.concurrency === 1 ? "worker" : "workers"}`
    const target = "semaphore acquire/release cycles/s reported beside the lock's"
    const ratio = ratioOf(row)
    if (row?.result._tag !== "Measured" || lock?.result._tag !== "Measured" || ratio === undefined) {
      return { target, subject, status: "MISS", detail: "a row was not measured" }
    }
    return {
      target,
      subject,
      status: "PASS",
      detail: `semaphore ${Report.rate(row.result.cyclesPerSecond.median)}/s, lock ${Report.rate(lock.result.cyclesPerSecond.median)}/s (${Report.ratio(ratio)})`
    }
  })

export const scenario: Scenario<SemaphoreResult> = {
  name: "semaphore",
  title: "Scenario 5 — semaphore cycles/s (memory)",
  run,
  render,
  targets
}

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
 * Then, on every database backend (PgAdvisory, PgLease, SqliteLease), one permit of an own name
 * (limit 1) beside the lock of an own name on the same layer, by 1 and 16 workers: what a permit
 * costs over a lock where the round trips are real.
 */
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import * as DistributedLock from "../../src/DistributedLock.js"
import * as DistributedSemaphore from "../../src/DistributedSemaphore.js"
import * as MemoryBackend from "../../src/MemoryBackend.js"
import * as PgAdvisory from "../../src/PgAdvisory.js"
import * as PgLease from "../../src/PgLease.js"
import * as SqliteLease from "../../src/SqliteLease.js"
import type { Context, Scenario } from "../lib/context.js"
import { createDatabase, type Database } from "../lib/postgres.js"
import { effectLoop, type ThroughputSample } from "../lib/loops.js"
import * as Report from "../lib/report.js"
import type { Target } from "../lib/report.js"
import { lengthOf, type Subject } from "../lib/rounds.js"
import { openRuntime } from "../lib/runtime.js"
import { measureThroughput, ratioOf, renderThroughput, type ThroughputRow, type ThroughputSpec } from "../lib/throughput.js"
import { pgClientLayer } from "./uncontended.js"

const CONCURRENCIES = [1, 16] as const
/** Permits of the contended row's one name. */
const CONTENDED_LIMIT = 4

const range = (n: number): Array<number> => Array.from({ length: n }, (_, i) => i)

type Cycle = (worker: number) => Effect.Effect<unknown, unknown, DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore>

type Services = DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore

/** Cycles of `cycle` by `concurrency` workers over one layer (memory unless given), opened once. */
const memorySubject = (
  id: string,
  concurrency: number,
  durationMs: number,
  cycle: Cycle,
  layer: () => Layer.Layer<Services, unknown> = () => MemoryBackend.layer()
): Subject<ThroughputSample> => ({
  id,
  open: async () => {
    const runtime = await openRuntime(layer())
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

/** The database backends, each a layer providing both services, by workers. */
const databaseBackends = (database: Database, sqliteFile: string) => [
  { id: "pg-advisory", label: "PgAdvisory", layer: (c: number) => PgAdvisory.layer({ url: database.url, applicationName: `bench-sem-advisory-${c}` }) },
  {
    id: "pg-lease",
    label: "PgLease",
    layer: (c: number) =>
      Layer.provide(PgLease.layer({ connections: c }), pgClientLayer(database, c, `bench-sem-lease-${c}`))
  },
  { id: "sqlite", label: "SqliteLease", layer: (_c: number) => SqliteLease.layer({ filename: sqliteFile }) }
] as const

/** Per backend: the lock of an own name, and one permit of an own name beside it. */
const databaseSpecs = (database: Database, sqliteFile: string, c: number, ms: number): Array<ThroughputSpec> =>
  databaseBackends(database, sqliteFile).flatMap(({ id, label, layer }) => {
    const names = range(c).map((w) => `semaphore-bench-${id}-c${c}-w${w}`)
    return [
      {
        block: id,
        id: `${id}-lock`,
        label: `${label}: DistributedLock.acquire, own name`,
        connections: "own",
        concurrency: c,
        subject: memorySubject(`${id}-lock-${c}`, c, ms, (w) => Effect.scoped(DistributedLock.acquire(names[w]!)), () => layer(c))
      },
      {
        block: id,
        id: `${id}-semaphore`,
        label: `${label}: DistributedSemaphore.acquire, own name, limit 1`,
        connections: "own",
        concurrency: c,
        baseline: `${id}-lock`,
        subject: memorySubject(
          `${id}-semaphore-${c}`,
          c,
          ms,
          (w) => Effect.scoped(DistributedSemaphore.acquire(names[w]!, { limit: 1 })),
          () => layer(c)
        )
      }
    ]
  })

export interface SemaphoreResult {
  readonly byConcurrency: ReadonlyArray<{ readonly concurrency: number; readonly rows: ReadonlyArray<ThroughputRow> }>
  readonly databases?: ReadonlyArray<{ readonly concurrency: number; readonly rows: ReadonlyArray<ThroughputRow> }>
}

const run = async (context: Context): Promise<SemaphoreResult> => {
  const byConcurrency: Array<SemaphoreResult["byConcurrency"][number]> = []
  for (const c of CONCURRENCIES) {
    byConcurrency.push({ concurrency: c, rows: await measureThroughput(context, `semaphore c=${c}`, specs(c, context.settings.memoryThroughputMs)) })
  }
  const database = await createDatabase(context.adminUrl, "semaphore")
  const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-bench-semaphore-"))
  try {
    const databases: Array<{ readonly concurrency: number; readonly rows: ReadonlyArray<ThroughputRow> }> = []
    for (const c of CONCURRENCIES) {
      const specsOf = databaseSpecs(database, Path.join(dir, "locks.db"), c, context.settings.throughputMs)
      databases.push({ concurrency: c, rows: await measureThroughput(context, `semaphore c=${c} databases`, specsOf) })
    }
    return { byConcurrency, databases }
  } finally {
    await database.drop()
    Fs.rmSync(dir, { recursive: true, force: true })
  }
}

const render = (result: SemaphoreResult): string =>
  [
    "A cycle is `Effect.scoped(DistributedSemaphore.acquire(name, { limit }))` (one permit), " +
    "`Effect.scoped(DistributedLock.acquire(name))` for the lock, and a scoped take/release of one permit of " +
    "an `Effect.makeSemaphore` for the floor, all in this process on the memory backend. The semaphore row of each " +
    "block is divided by the lock's (own names) or by the Effect semaphore of the same shape (one name).",
    "",
    ...result.byConcurrency.map((level) =>
      [`### Memory, ${level.concurrency} concurrent ${level.concurrency === 1 ? "worker" : "workers"}`, "", renderThroughput(level.rows)].join("\n")
    ),
    "On the database backends, each row's layer is opened once (its own sessions or connections; SqliteLease on a file " +
    "in a temp directory), and the semaphore row is divided by the lock row of the same backend, measured in the same rounds.",
    ...(result.databases ?? []).map((level) =>
      [`### Databases, ${level.concurrency} concurrent ${level.concurrency === 1 ? "worker" : "workers"}`, "", renderThroughput(level.rows)].join("\n")
    )
  ].join("\n\n")

const beside = (rows: ReadonlyArray<ThroughputRow>, semaphoreId: string, lockId: string, subject: string): Target => {
  const row = rows.find((r) => r.id === semaphoreId)
  const lock = rows.find((r) => r.id === lockId)
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
}

const workers = (c: number) => `${c} ${c === 1 ? "worker" : "workers"}`

const targets = (result: SemaphoreResult): ReadonlyArray<Target> => [
  ...result.byConcurrency.map((level) => beside(level.rows, "semaphore-own", "lock-own", `memory backend, ${workers(level.concurrency)}`)),
  ...(result.databases ?? []).flatMap((level) =>
    ["pg-advisory", "pg-lease", "sqlite"].map((id) => beside(level.rows, `${id}-semaphore`, `${id}-lock`, `${id}, ${workers(level.concurrency)}`))
  )
]

export const scenario: Scenario<SemaphoreResult> = {
  name: "semaphore",
  title: "Scenario 5 — semaphore cycles/s",
  run,
  render,
  targets
}

/**
 * Closed-loop throughput drivers: `concurrency` workers each run `cycle` back to back until the
 * time is up; every cycle's latency is kept. The same driver shape is used for the library (in
 * Effect fibers) and for its raw-pg baselines (async functions), so both count alike.
 */
import * as Effect from "effect/Effect"
import { Samples } from "./stats.js"
import { now } from "./timing.js"

export interface ThroughputSample {
  readonly cycles: number
  readonly seconds: number
  /** Latency of every cycle, ms. */
  readonly latencies: Samples
  /**
   * CPU the measuring process used during the round (user + system, all its threads, from the
   * kernel's account), ms: set where the round ran in a process of its own (`isolated.ts`).
   */
  readonly cpuMs?: number
}

const range = (n: number): Array<number> => Array.from({ length: n }, (_, i) => i)

export const promiseLoop = async (
  concurrency: number,
  durationMs: number,
  cycle: (worker: number, iteration: number) => Promise<void>
): Promise<ThroughputSample> => {
  const latencies = new Samples()
  let cycles = 0
  const start = now()
  const stopAt = start + durationMs
  await Promise.all(range(concurrency).map(async (worker) => {
    for (let i = 0; now() < stopAt; i++) {
      const t0 = now()
      await cycle(worker, i)
      latencies.push(now() - t0)
      cycles++
    }
  }))
  return { cycles, seconds: (now() - start) / 1000, latencies }
}

export const effectLoop = <E, R>(
  concurrency: number,
  durationMs: number,
  cycle: (worker: number, iteration: number) => Effect.Effect<void, E, R>
): Effect.Effect<ThroughputSample, E, R> =>
  Effect.suspend(() => {
    const latencies = new Samples()
    let cycles = 0
    const start = now()
    const stopAt = start + durationMs
    const worker = (w: number): Effect.Effect<void, E, R> =>
      Effect.gen(function*() {
        for (let i = 0; now() < stopAt; i++) {
          const t0 = now()
          yield* cycle(w, i)
          latencies.push(now() - t0)
          cycles++
        }
      })
    return Effect.forEach(range(concurrency), worker, { concurrency: "unbounded", discard: true }).pipe(
      Effect.map((): ThroughputSample => ({ cycles, seconds: (now() - start) / 1000, latencies }))
    )
  })

/**
 * Effect layers opened once and kept for several rounds, so a round measures cycles, not the
 * building of a layer (connecting, probing, creating tables).
 */
import type * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Logger from "effect/Logger"
import * as ManagedRuntime from "effect/ManagedRuntime"

/** Log lines the library wrote per layer that are printed; the rest are only counted. */
const PRINTED_PER_LAYER = 3

let logged = 0

/** Log lines the library wrote in this process so far (a lost lease logs a warning, for example), and in the subjects' own processes. */
export const libraryLogLines = (): number => logged

/** Adds the log lines a subject's own process counted (`isolated.ts`). */
export const countLogLines = (lines: number): void => {
  logged += lines
}

export interface OpenRuntime<R> {
  readonly run: <A, E>(effect: Effect.Effect<A, E, R>) => Promise<A>
  readonly close: () => Promise<void>
}

/**
 * Builds `layer` now (failing here if it cannot be built) and keeps it until `close`. The
 * library's log lines go through a logger that prints the first few per layer and counts the
 * rest: 10,000 leases lost at once must show up in the report, not flood the terminal.
 */
export const openRuntime = async <R, E>(layer: Layer.Layer<R, E>): Promise<OpenRuntime<R>> => {
  let here = 0
  const bounded = Logger.make<unknown, void>((options) => {
    logged++
    here++
    if (here <= PRINTED_PER_LAYER) Logger.defaultLogger.log(options)
  })
  const runtime = ManagedRuntime.make(Layer.provide(layer, Logger.replace(Logger.defaultLogger, bounded)))
  try {
    await runtime.runtime()
  } catch (error) {
    await runtime.dispose().catch(() => {})
    throw error
  }
  return {
    run: (effect) => runtime.runPromise(effect),
    close: async () => {
      await runtime.dispose()
      if (here > PRINTED_PER_LAYER) process.stderr.write(`  (the library logged ${here} lines in this layer; ${PRINTED_PER_LAYER} shown)\n`)
    }
  }
}

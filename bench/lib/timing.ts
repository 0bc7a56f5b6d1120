/**
 * Clocks and small async helpers. Durations are read from `performance.now()` (monotonic,
 * sub-millisecond); nothing here reads the wall clock.
 */
import * as Effect from "effect/Effect"

/** Monotonic milliseconds since process start. */
export const now = (): number => performance.now()

/** `now()` as an Effect, for loops written in Effect. */
export const nowEffect: Effect.Effect<number> = Effect.sync(now)

export const sleep = (ms: number): Promise<void> => new Promise((resolve) => setTimeout(resolve, ms))

export { withTimeout } from "../../tools/embeddedPostgres.js"

/** Milliseconds elapsed while running `f`, with its result. */
export const timed = async <A>(f: () => Promise<A>): Promise<{ readonly value: A; readonly ms: number }> => {
  const start = now()
  const value = await f()
  return { value, ms: now() - start }
}

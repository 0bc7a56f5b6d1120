import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import { yieldTimes } from "./faults.js"

/** A small seeded generator (mulberry32), so a failing random test can be re-run with its seed. */
export const seededRandom = (seed: number) => {
  let a = seed >>> 0
  return () => {
    a = (a + 0x6d2b79f5) >>> 0
    let t = a
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
}

/** The seed of this run: `EFFECT_LOCK_TEST_SEED` when set, otherwise a fresh one (print it). */
export const testSeed = (): number => Number(process.env.EFFECT_LOCK_TEST_SEED ?? Date.now() % 1_000_000)

/**
 * A random moment in the first few milliseconds, for racing an interrupt against a step: 0–6 ms
 * on real time, 0–60 yields on the TestClock (where no real time passes).
 */
export const somewhen = (random: () => number, live: boolean): Effect.Effect<void> => {
  const n = Math.floor(random() * 7)
  return live ? Effect.sleep(Duration.millis(n)) : yieldTimes(n * 10)
}

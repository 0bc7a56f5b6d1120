/**
 * A small seeded PRNG (mulberry32) for the chaos run: the seed is printed first and accepted
 * back by `--seed`, so the same fault sequence (kinds, targets' choice, durations) can be
 * replayed. Math.random is never used for a decision of the run.
 */

export interface Prng {
  /** A float in [0, 1). */
  readonly next: () => number
  /** An integer in [lo, hi], both included. */
  readonly int: (lo: number, hi: number) => number
  /** True with probability p. */
  readonly chance: (p: number) => boolean
  readonly pick: <A>(items: ReadonlyArray<A>) => A
  readonly shuffle: <A>(items: ReadonlyArray<A>) => Array<A>
}

/** FNV-1a over a label, mixed with a seed: independent streams per backend and per worker. */
export const deriveSeed = (seed: number, label: string): number => {
  let hash = (0x811c9dc5 ^ seed) >>> 0
  for (const char of label) {
    hash ^= char.codePointAt(0)!
    hash = Math.imul(hash, 0x01000193) >>> 0
  }
  return hash >>> 0
}

/** A fresh seed for a run whose seed was not given; printed so the run can be repeated. */
export const randomSeed = (): number => Math.floor(Math.random() * 0x1_0000_0000) >>> 0

export const parseSeed = (text: string): number => {
  const seed = Number(text)
  if (!Number.isInteger(seed) || seed < 0 || seed > 0xffff_ffff) {
    throw new Error(`--seed must be a whole number from 0 to ${0xffff_ffff}, got ${text}`)
  }
  return seed
}

export const makePrng = (seed: number): Prng => {
  let state = seed >>> 0
  const next = () => {
    state = (state + 0x6d2b79f5) >>> 0
    let t = state
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 0x1_0000_0000
  }
  const int = (lo: number, hi: number) => lo + Math.floor(next() * (hi - lo + 1))
  return {
    next,
    int,
    chance: (p) => next() < p,
    pick: (items) => {
      if (items.length === 0) throw new Error("pick from an empty list")
      return items[int(0, items.length - 1)]!
    },
    shuffle: (items) => {
      const out = [...items]
      for (let i = out.length - 1; i > 0; i--) {
        const j = int(0, i)
        ;[out[i], out[j]] = [out[j]!, out[i]!]
      }
      return out
    }
  }
}

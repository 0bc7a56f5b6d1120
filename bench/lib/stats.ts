/**
 * Order statistics for benchmark samples. Percentiles use the nearest-rank method on a sorted
 * copy, so p99 of 200 samples is the 198th value: a real observation, never an interpolation.
 */

/** Sorted ascending copy; the input is left untouched. */
export const sorted = (values: ReadonlyArray<number>): Array<number> => Array.from(values).sort((a, b) => a - b)

/** Nearest-rank percentile (`p` in 0..100) of already sorted values; NaN when empty. */
export const percentileOfSorted = (ascending: ReadonlyArray<number>, p: number): number => {
  if (ascending.length === 0) return Number.NaN
  const rank = Math.ceil((p / 100) * ascending.length)
  return ascending[Math.min(ascending.length, Math.max(1, rank)) - 1]!
}

export const percentile = (values: ReadonlyArray<number>, p: number): number => percentileOfSorted(sorted(values), p)

/** Median; for an even count, the mean of the two middle values (a median of rounds, not of samples). */
export const median = (values: ReadonlyArray<number>): number => {
  const s = sorted(values)
  if (s.length === 0) return Number.NaN
  const mid = Math.floor(s.length / 2)
  return s.length % 2 === 1 ? s[mid]! : (s[mid - 1]! + s[mid]!) / 2
}

export const min = (values: ReadonlyArray<number>): number =>
  values.length === 0 ? Number.NaN : values.reduce((a, b) => (b < a ? b : a))

export const max = (values: ReadonlyArray<number>): number =>
  values.length === 0 ? Number.NaN : values.reduce((a, b) => (b > a ? b : a))

export const sum = (values: ReadonlyArray<number>): number => values.reduce((a, b) => a + b, 0)

/** A figure measured once per round: its median and range across rounds, and the raw values. */
export interface Spread {
  readonly median: number
  readonly min: number
  readonly max: number
  readonly rounds: ReadonlyArray<number>
}

export const spread = (rounds: ReadonlyArray<number>): Spread => ({
  median: median(rounds),
  min: min(rounds),
  max: max(rounds),
  rounds: [...rounds]
})

/** A growable sample buffer that stays cheap at millions of values. */
export class Samples {
  private buffer = new Float64Array(1024)
  private size = 0

  push(value: number): void {
    if (this.size === this.buffer.length) {
      const grown = new Float64Array(this.buffer.length * 2)
      grown.set(this.buffer)
      this.buffer = grown
    }
    this.buffer[this.size++] = value
  }

  get length(): number {
    return this.size
  }

  /** Sorted ascending copy of the samples. */
  sorted(): Float64Array {
    return this.buffer.slice(0, this.size).sort()
  }

  values(): Array<number> {
    return Array.from(this.buffer.subarray(0, this.size))
  }
}

/** Percentile of a sorted typed array (nearest rank). */
export const percentileOfTyped = (ascending: Float64Array, p: number): number => {
  if (ascending.length === 0) return Number.NaN
  const rank = Math.ceil((p / 100) * ascending.length)
  return ascending[Math.min(ascending.length, Math.max(1, rank)) - 1]!
}

/**
 * How long a lease handed over by a release lasts on this process's monotonic clock.
 *
 * The release sets the lease's expiry on the store's clock (`now() + ttl`) and says it in its
 * notification, with no answer to time it against. The waiter bounds how far the store's clock
 * is ahead of its own monotonic one from its own attempts: each answer carries the store's
 * `now()`, read after the attempt was sent, so at that moment the store was at most
 * `now − sentAt` ahead. An expiry `E` on the store's clock is then no earlier than `E − ahead` on
 * the monotonic one — assuming, as every lease grant does (`sentAt + ttl`), that the store's
 * clock does not run faster than ours; a margin of `DRIFT` per ms elapsed since the sample covers
 * an ordinary skew of rates (NTP slews at most 0.05 %).
 */

/** Rate skew allowed between the store's clock and ours: 0.1 % of the time since a sample. */
const DRIFT = 0.001
/** Samples kept: the latest attempts of one request (a live waiter attempts every 1.5 s or sooner). */
const KEPT = 4

/** One attempt's bound: the store's clock was at most `ahead` ms ahead of ours at `sentAt` (monotonic ms). */
export interface Sample {
  readonly ahead: number
  readonly sentAt: number
}

/** The latest samples of one request, newest last. */
export const remember = (samples: Array<Sample>, ahead: number | undefined, sentAt: number): void => {
  if (ahead === undefined || !Number.isFinite(ahead)) return
  samples.push({ ahead, sentAt })
  if (samples.length > KEPT) samples.shift()
}

/**
 * The monotonic ms until which a lease that runs out at `expiresMs` on the store's clock is
 * surely still the holder's; undefined without a sample (then an attempt reads the lease).
 */
export const validUntil = (expiresMs: number, samples: ReadonlyArray<Sample>): number | undefined => {
  let bound = Number.POSITIVE_INFINITY
  for (const { ahead, sentAt } of samples) {
    // The expiry on our clock by this sample, less the skew its distance could hide.
    const until = expiresMs - ahead
    bound = Math.min(bound, until - DRIFT * Math.max(0, until - sentAt))
  }
  return Number.isFinite(bound) ? bound : undefined
}

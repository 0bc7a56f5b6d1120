/**
 * A waiting request's place in a lease store's queue (PgLease, SqliteLease, RedisLease; locks and
 * semaphores): how long it lasts, how often its waiter retries, and when a retry writes it again.
 * Plain numbers, spliced into each store's statement or script text as they are.
 */

/** How long a place lasts unless its waiter keeps it (by retrying): a dead waiter loses it after this. */
export const PLACE_TTL_MILLIS = 5_000

/** A waiter retries at least this often (0.3 of a place): each retry keeps its place. */
export const PLACE_RETRY_MILLIS = PLACE_TTL_MILLIS * 0.3

/**
 * A retry writes its place again once at most this share of it is left (4 s of 5). Retries come
 * at least every 1.5 s, counted from the previous retry: a live place keeps 3.5 s or more while
 * they come on schedule, and 2.5 s at worst (a retry within 1 s of the last write writes nothing,
 * e.g. a wake-up that did not grant, and the next may come 1.5 s after it). So a retry held back
 * 2 s (a stalled event loop, a starved host) still finds its place. At one half, places fell to
 * 2 s between writes on schedule and to 1 s at worst, and a retry late by 2 s lost its turn.
 */
export const PLACE_REFRESH_BELOW = 0.8

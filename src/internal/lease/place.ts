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
 * A retry writes its place again once at most this share of it is left (4 s of 5): with a retry
 * at least every 1.5 s, a live place keeps 3.5 s or more, so a retry held back 3.5 s (a stalled
 * event loop, a starved host) still finds it. At one half (2.5 s), places fell to 2 s between
 * writes and a retry late by 2 s lost its turn. A retry within 1 s of the last write writes
 * nothing (the quick retries of a contended handoff).
 */
export const PLACE_REFRESH_BELOW = 0.8

/**
 * The metrics effect-lock records through Effect's `Metric`, each tagged with `backend`
 * (`memory`, `pg-advisory`, `pg-lease`); export them with any Effect metrics exporter.
 *
 * @since 0.1.0
 */
import * as internal from "./internal/core/metrics.js"

/**
 * Time from asking for a lock to holding it, in milliseconds (histogram).
 *
 * @since 0.1.0
 * @category metrics
 */
export const acquireWait = internal.acquireWait

/**
 * Locks this process holds right now (gauge).
 *
 * @since 0.1.0
 * @category metrics
 */
export const held = internal.heldGauge

/**
 * Locks granted (counter).
 *
 * @since 0.1.0
 * @category metrics
 */
export const acquisitions = internal.acquisitions

/**
 * Acquisitions that ran out of time (counter).
 *
 * @since 0.1.0
 * @category metrics
 */
export const timeouts = internal.timeouts

/**
 * Leases lost, also tagged with `reason` (counter).
 *
 * @since 0.1.0
 * @category metrics
 */
export const losses = internal.losses

/**
 * Releases that failed or timed out; the backend gave the lock up another way (counter).
 *
 * @since 0.1.0
 * @category metrics
 */
export const releaseFailures = internal.releaseFailures

/**
 * Database sessions destroyed because their state could not be proven (counter).
 *
 * @since 0.1.0
 * @category metrics
 */
export const destroyedSessions = internal.destroyedSessions

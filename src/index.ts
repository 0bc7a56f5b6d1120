/**
 * effect-lock: distributed locks for Effect 3.
 *
 * @since 0.1.0
 */
export * as DistributedLock from "./DistributedLock.js"
export * as DistributedSemaphore from "./DistributedSemaphore.js"
export * as Fence from "./Fence.js"
export * as FencingToken from "./FencingToken.js"
export * as Lease from "./Lease.js"
export * as LockBackend from "./LockBackend.js"
export * as LockConfig from "./LockConfig.js"
export * as LockError from "./LockError.js"
export * as LockMetrics from "./LockMetrics.js"
export * as MemoryBackend from "./MemoryBackend.js"
export * as PgAdvisory from "./PgAdvisory.js"
export * as PgLease from "./PgLease.js"
export * as RedisLease from "./RedisLease.js"
export * as SqliteLease from "./SqliteLease.js"

/**
 * The `effect-distributed-lock` npm package (a distributed semaphore for Effect, Redis-backed
 * via ioredis), loaded from bench/node_modules at run time. Its Effect values come from the same
 * `effect` as ours (bench/package.json links it), so they run on our runtime. The surface used
 * is declared here: `DistributedSemaphore.make(key, { limit, ttl })` needing the backing that
 * `RedisBacking.layer(redis, options)` provides, and `semaphore.take(permits)`, which holds the
 * permits until the enclosing scope closes.
 */
import type * as Duration from "effect/Duration"
import type * as Effect from "effect/Effect"
import type * as Layer from "effect/Layer"
import type * as Scope from "effect/Scope"

/** The package's backing service, opaque here. */
export interface Backing {
  readonly _Backing: unique symbol
}

export interface Semaphore {
  readonly take: (permits: number) => Effect.Effect<unknown, unknown, Scope.Scope>
}

export interface Module {
  readonly DistributedSemaphore: {
    readonly make: (
      key: string,
      config?: { readonly limit?: number; readonly ttl?: Duration.DurationInput }
    ) => Effect.Effect<Semaphore, never, Backing>
  }
  readonly RedisBacking: {
    readonly layer: (
      redis: RedisClient,
      options?: { readonly keyPrefix?: string; readonly pushBasedAcquireEnabled?: boolean }
    ) => Layer.Layer<Backing>
  }
}

/** The part of an ioredis client the bench uses directly. */
export interface RedisClient {
  readonly set: (key: string, value: string, px: "PX", ttlMs: number, nx: "NX") => Promise<string | null>
  readonly eval: (script: string, keys: number, ...args: Array<string>) => Promise<unknown>
  readonly quit: () => Promise<unknown>
  readonly disconnect: () => void
}

export type RedisConstructor = new (url: string, options?: { readonly lazyConnect?: boolean; readonly maxRetriesPerRequest?: number }) => RedisClient

export interface Loaded {
  readonly module: Module
  readonly Redis: RedisConstructor
}

export const load = async (): Promise<Loaded> => {
  // Computed specifiers: resolved at run time from bench/peers, so they find bench/node_modules.
  const names = { lock: "effect-distributed-lock", redis: "ioredis" }
  const module = (await import(names.lock)) as Module
  const ioredis = (await import(names.redis)) as { Redis?: unknown; default?: unknown }
  const Redis = (ioredis.Redis ?? ioredis.default) as RedisConstructor | undefined
  if (typeof module.DistributedSemaphore?.make !== "function" || typeof Redis !== "function") {
    throw new Error("effect-distributed-lock or ioredis did not load as expected")
  }
  return { module, Redis }
}

import { describe, expect, it } from "@effect/vitest"
import { ConfigError, ConfigProvider, Effect, Exit, Layer } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as LockConfig from "effect-lock/LockConfig"
import Sqlite from "better-sqlite3"
import { Redis } from "ioredis"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import { useTestDatabase } from "./support/pg.js"
import { describeWithRedis, useRedis } from "./support/redis.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("lock_config")

/** The config-chosen layer, reading `env` as environment variables would be read. */
const fromEnv = (env: Record<string, string>) =>
  LockConfig.layer.pipe(Layer.provide(Layer.setConfigProvider(ConfigProvider.fromMap(new Map(Object.entries(env))))))

/** Builds the layer from `env`, takes and releases one lock, and says which backend served it. */
const lockWith = (env: Record<string, string>, whileHeld: Effect.Effect<unknown> = Effect.void) =>
  Effect.scoped(
    Effect.gen(function*() {
      const lease = yield* DistributedLock.acquire("config-chosen", { timeout: "5 seconds" })
      const service = yield* DistributedLock.DistributedLock
      const seen = yield* whileHeld
      return { backend: service.backend, token: lease.token, seen }
    })
  ).pipe(Effect.provide(fromEnv(env)))

/** The typed error building the layer from `env` fails with (the test fails if it builds). */
const failureOf = (env: Record<string, string>) =>
  Effect.flatMap(Effect.exit(lockWith(env)), (exit) =>
    Exit.isFailure(exit) ? Effect.flip(Effect.failCause(exit.cause)) : Effect.dieMessage("the layer was built"))

describe("LockConfig.layer", () => {
  it.live("EFFECT_LOCK_BACKEND=memory builds the memory backend", () =>
    Effect.gen(function*() {
      const used = yield* lockWith({ EFFECT_LOCK_BACKEND: "memory", EFFECT_LOCK_TTL: "2 seconds" })
      expect(used.backend).toBe("memory")
      expect(used.token > 0n).toBe(true)
    }))

  it.live("EFFECT_LOCK_BACKEND=pg-advisory builds PgAdvisory on DATABASE_URL", () =>
    Effect.gen(function*() {
      const used = yield* lockWith({ EFFECT_LOCK_BACKEND: "pg-advisory", DATABASE_URL: db.url, EFFECT_LOCK_MAX_SESSIONS: "2" })
      expect(used.backend).toBe("pg-advisory")
    }))

  it.live("EFFECT_LOCK_BACKEND=pg-lease builds PgLease on EFFECT_LOCK_DATABASE_URL, which wins over DATABASE_URL", () =>
    Effect.gen(function*() {
      const used = yield* lockWith({
        EFFECT_LOCK_BACKEND: "pg-lease",
        EFFECT_LOCK_DATABASE_URL: db.url,
        DATABASE_URL: "postgres://nobody:wrong@127.0.0.1:1/none",
        EFFECT_LOCK_TABLE: "config_leases"
      })
      expect(used.backend).toBe("pg-lease")
    }))

  it.live("EFFECT_LOCK_BACKEND=sqlite builds SqliteLease on EFFECT_LOCK_SQLITE_FILE", () =>
    Effect.gen(function*() {
      const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-config-"))
      try {
        const file = Path.join(dir, "locks.db")
        const used = yield* lockWith({ EFFECT_LOCK_BACKEND: "sqlite", EFFECT_LOCK_SQLITE_FILE: file, EFFECT_LOCK_TABLE: "config_leases" })
        expect(used.backend).toBe("sqlite-lease")
        // The lease went to that file, in the table configured.
        const db = new Sqlite(file, { readonly: true })
        try {
          expect(db.prepare("select name, token from config_leases").all()).toEqual([{ name: "config-chosen", token: Number(used.token) }])
        } finally {
          db.close()
        }
      } finally {
        Fs.rmSync(dir, { recursive: true, force: true })
      }
    }))

  it.live("a missing backend is a ConfigError naming EFFECT_LOCK_BACKEND", () =>
    Effect.gen(function*() {
      const error = yield* failureOf({})
      expect(ConfigError.isConfigError(error) && ConfigError.isMissingDataOnly(error)).toBe(true)
      expect(String(error)).toContain("EFFECT_LOCK_BACKEND")
    }))

  it.live("an unknown backend is a ConfigError naming the value and the choices", () =>
    Effect.gen(function*() {
      const text = String(yield* failureOf({ EFFECT_LOCK_BACKEND: "etcd" }))
      expect(text).toContain("EFFECT_LOCK_BACKEND")
      expect(text).toContain("etcd")
      expect(text).toContain("pg-lease")
      expect(text).toContain("sqlite")
    }))

  it.live("sqlite without a file is a ConfigError naming EFFECT_LOCK_SQLITE_FILE; an empty one too", () =>
    Effect.gen(function*() {
      for (const file of [undefined, ""]) {
        const error = yield* failureOf({ EFFECT_LOCK_BACKEND: "sqlite", ...(file === undefined ? {} : { EFFECT_LOCK_SQLITE_FILE: file }) })
        expect(ConfigError.isConfigError(error)).toBe(true)
        expect(String(error)).toContain("EFFECT_LOCK_SQLITE_FILE")
      }
    }))

  it.live("a PostgreSQL backend without a URL is a ConfigError naming the URL key", () =>
    Effect.gen(function*() {
      for (const backend of ["pg-advisory", "pg-lease"]) {
        const text = String(yield* failureOf({ EFFECT_LOCK_BACKEND: backend }))
        expect(text).toContain("EFFECT_LOCK_DATABASE_URL")
      }
    }))

  it.live("a malformed ttl or session count is a ConfigError naming its key", () =>
    Effect.gen(function*() {
      const ttl = String(yield* failureOf({ EFFECT_LOCK_BACKEND: "memory", EFFECT_LOCK_TTL: "soon" }))
      expect(ttl).toContain("EFFECT_LOCK_TTL")
      const sessions = String(
        yield* failureOf({ EFFECT_LOCK_BACKEND: "pg-advisory", DATABASE_URL: db.url, EFFECT_LOCK_MAX_SESSIONS: "many" })
      )
      expect(sessions).toContain("EFFECT_LOCK_MAX_SESSIONS")
    }))
})

describeWithRedis("LockConfig.layer on Redis", () => {
  const redis = useRedis()

  it.live("EFFECT_LOCK_BACKEND=redis builds RedisLease on EFFECT_LOCK_REDIS_URL, which wins over REDIS_URL, with EFFECT_LOCK_REDIS_PREFIX", () =>
    Effect.gen(function*() {
      // The lease's keys carry the configured prefix: read while it is held (an idle name keeps no key).
      const prefixed = Effect.promise(() => {
        const client = new Redis(redis.url())
        return client.keys("config-test:*").finally(() => client.quit())
      })
      const used = yield* lockWith({
        EFFECT_LOCK_BACKEND: "redis",
        EFFECT_LOCK_REDIS_URL: redis.url(),
        REDIS_URL: "redis://127.0.0.1:1",
        EFFECT_LOCK_REDIS_PREFIX: "config-test:"
      }, prefixed)
      expect(used.backend).toBe("redis-lease")
      expect(used.token > 0n).toBe(true)
      expect((used.seen as ReadonlyArray<string>).length).toBeGreaterThan(0)
    }))

  it.live("EFFECT_LOCK_BACKEND=redis without a URL is a ConfigError naming EFFECT_LOCK_REDIS_URL", () =>
    Effect.gen(function*() {
      const error = yield* failureOf({ EFFECT_LOCK_BACKEND: "redis" })
      expect(ConfigError.isConfigError(error)).toBe(true)
      expect(String(error)).toContain("EFFECT_LOCK_REDIS_URL")
    }))
})

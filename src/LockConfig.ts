/**
 * One layer for every backend, chosen by configuration: deploy the same program with the memory
 * backend in tests, PgLease behind PgBouncer and PgAdvisory elsewhere, by setting environment
 * variables (or any Effect `ConfigProvider`) instead of writing the choice in each app.
 *
 * | key | meaning |
 * |---|---|
 * | `EFFECT_LOCK_BACKEND` | `memory`, `pg-advisory`, `pg-lease`, `sqlite` or `redis` (required) |
 * | `EFFECT_LOCK_DATABASE_URL`, else `DATABASE_URL` | the server, for the PostgreSQL backends |
 * | `EFFECT_LOCK_SQLITE_FILE` | the database file the processes share, for `sqlite` |
 * | `EFFECT_LOCK_REDIS_URL`, else `REDIS_URL` | the server, for `redis` |
 * | `EFFECT_LOCK_TTL` | default lease length (`30 seconds`, …), lease backends |
 * | `EFFECT_LOCK_REDIS_PREFIX` | RedisLease's key prefix |
 * | `EFFECT_LOCK_TABLE` | PgLease's or SqliteLease's table |
 * | `EFFECT_LOCK_MAX_SESSIONS` | PgAdvisory's `maxSessions` |
 * | `EFFECT_LOCK_NAMESPACE` | PgAdvisory's key namespace |
 * | `EFFECT_LOCK_APPLICATION_NAME` | shown in `pg_stat_activity` |
 *
 * A missing or unknown backend, a PostgreSQL backend without a URL, `sqlite` without a file, or
 * `redis` without a URL, is a `ConfigError` naming the key. Drivers are loaded only for the backend chosen.
 *
 * @since 0.1.0
 */
import * as Config from "effect/Config"
import * as ConfigError from "effect/ConfigError"
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Redacted from "effect/Redacted"
import type * as DistributedLock from "./DistributedLock.js"
import type * as DistributedSemaphore from "./DistributedSemaphore.js"
import { LockBackendError, type UnsafeConnectionPooling } from "./LockError.js"
import * as MemoryBackend from "./MemoryBackend.js"
import * as PgAdvisory from "./PgAdvisory.js"
import * as PgLease from "./PgLease.js"
import * as RedisLease from "./RedisLease.js"
import * as SqliteLease from "./SqliteLease.js"

/**
 * The backends `layer` can build.
 *
 * @since 0.1.0
 * @category models
 */
export type BackendKind = "memory" | "pg-advisory" | "pg-lease" | "sqlite" | "redis"

/**
 * What `layer` reads, before it builds anything.
 *
 * @since 0.1.0
 * @category models
 */
export interface Settings {
  readonly backend: BackendKind
  readonly url: Option.Option<Redacted.Redacted<string>>
  readonly sqliteFile: Option.Option<string>
  readonly redisUrl: Option.Option<Redacted.Redacted<string>>
  readonly redisPrefix: Option.Option<string>
  readonly ttl: Option.Option<Duration.Duration>
  readonly table: Option.Option<string>
  readonly maxSessions: Option.Option<number>
  readonly namespace: Option.Option<string>
  readonly applicationName: Option.Option<string>
}

const optional = <A>(config: Config.Config<A>) => Config.option(config)

/**
 * The settings as read from configuration (the flat keys of the module's table, so any
 * `ConfigProvider` reads them by the same names).
 *
 * @since 0.1.0
 * @category config
 */
export const settings: Config.Config<Settings> = Config.all({
  backend: Config.literal("memory", "pg-advisory", "pg-lease", "sqlite", "redis")("EFFECT_LOCK_BACKEND"),
  url: optional(
    Config.orElse(Config.redacted("EFFECT_LOCK_DATABASE_URL"), () => Config.redacted("DATABASE_URL"))
  ),
  sqliteFile: optional(Config.nonEmptyString("EFFECT_LOCK_SQLITE_FILE")),
  redisUrl: optional(Config.orElse(Config.redacted("EFFECT_LOCK_REDIS_URL"), () => Config.redacted("REDIS_URL"))),
  redisPrefix: optional(Config.nonEmptyString("EFFECT_LOCK_REDIS_PREFIX")),
  ttl: optional(Config.duration("EFFECT_LOCK_TTL")),
  table: optional(Config.nonEmptyString("EFFECT_LOCK_TABLE")),
  maxSessions: optional(Config.integer("EFFECT_LOCK_MAX_SESSIONS")),
  namespace: optional(Config.string("EFFECT_LOCK_NAMESPACE")),
  applicationName: optional(Config.nonEmptyString("EFFECT_LOCK_APPLICATION_NAME"))
})

/** The URL a PostgreSQL backend needs; when absent, read again to fail with Effect's error naming the key. */
const urlOf = (read: Settings): Effect.Effect<Redacted.Redacted<string>, ConfigError.ConfigError> =>
  Option.match(read.url, {
    onSome: Effect.succeed,
    onNone: () => Config.redacted("EFFECT_LOCK_DATABASE_URL")
  })

/** The file `sqlite` needs; when absent, read again to fail with Effect's error naming the key. */
const sqliteFileOf = (read: Settings): Effect.Effect<string, ConfigError.ConfigError> =>
  Option.match(read.sqliteFile, {
    onSome: Effect.succeed,
    onNone: () => Config.nonEmptyString("EFFECT_LOCK_SQLITE_FILE")
  })

/** The server `redis` needs; when absent, read again to fail with Effect's error naming the key. */
const redisUrlOf = (read: Settings): Effect.Effect<Redacted.Redacted<string>, ConfigError.ConfigError> =>
  Option.match(read.redisUrl, {
    onSome: Effect.succeed,
    onNone: () => Config.redacted("EFFECT_LOCK_REDIS_URL")
  })

const defined = <A>(option: Option.Option<A>): A | undefined => Option.getOrUndefined(option)

/**
 * The layer for settings already read (e.g. built in code rather than from configuration).
 *
 * @since 0.1.0
 * @category layers
 */
export const fromSettings = (
  read: Settings
): Layer.Layer<
  DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore,
  ConfigError.ConfigError | LockBackendError | UnsafeConnectionPooling
> => {
  // What several backends take alike, read once.
  const applicationName = defined(read.applicationName)
  const lease = { ttl: defined(read.ttl), table: defined(read.table) }
  switch (read.backend) {
    case "memory":
      return MemoryBackend.layer({ ttl: defined(read.ttl) })
    case "pg-advisory":
      return Layer.unwrapEffect(Effect.map(urlOf(read), (url) =>
        PgAdvisory.layer({ url, maxSessions: defined(read.maxSessions), namespace: defined(read.namespace), applicationName })))
    case "pg-lease":
      return Layer.unwrapEffect(
        Effect.gen(function*() {
          const url = yield* urlOf(read)
          // Loaded only when this backend is chosen: a memory-only app needs no PostgreSQL driver.
          const { PgClient } = yield* Effect.tryPromise({
            try: () => import("@effect/sql-pg"),
            catch: (cause) =>
              new LockBackendError({
                operation: "configure",
                cause: new Error(`EFFECT_LOCK_BACKEND=pg-lease needs @effect/sql-pg installed (${String(cause)})`)
              })
          })
          const client = PgClient.layer({ url, ...(applicationName === undefined ? {} : { applicationName }) }).pipe(
            Layer.mapError((cause): ConfigError.ConfigError | LockBackendError =>
              ConfigError.isConfigError(cause) ? cause : new LockBackendError({ operation: "connect", cause })
            )
          )
          return PgLease.layer(lease).pipe(Layer.provide(client))
        })
      )
    case "sqlite":
      // SqliteLease loads its driver only when the layer is built: nothing to load here.
      return Layer.unwrapEffect(Effect.map(sqliteFileOf(read), (filename) =>
        SqliteLease.layer({ filename, ...lease, applicationName })))
    case "redis":
      // RedisLease loads ioredis only when the layer is built: nothing to load here.
      return Layer.unwrapEffect(Effect.map(redisUrlOf(read), (url) =>
        RedisLease.layer({ url, ttl: defined(read.ttl), prefix: defined(read.redisPrefix), applicationName })))
  }
}

/**
 * `DistributedLock` and `DistributedSemaphore` on the backend configuration names (see the
 * module's table of keys).
 *
 * @since 0.1.0
 * @category layers
 */
export const layer: Layer.Layer<
  DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore,
  ConfigError.ConfigError | LockBackendError | UnsafeConnectionPooling
> = Layer.unwrapEffect(Effect.map(settings, fromSettings))

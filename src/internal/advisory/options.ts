/**
 * Resolving PgAdvisory's public options into the engine's: defaults, validation (a bad value is
 * a `LockBackendError` of operation `configure`), and the node-pg client config — URL or fields,
 * TLS, a password given as text, `Redacted` or a function — also derived from an app's
 * `PgClient` config.
 */
import type { PgClientConfig } from "@effect/sql-pg/PgClient"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Redacted from "effect/Redacted"
import type pg from "pg"
import type { ConnectionOptions } from "node:tls"
import { LockBackendError } from "../../LockError.js"
import { parseTable } from "../sql/tables.js"
import { durationOption, MAX_TIMER } from "../core/validate.js"
import type { BackendOptions } from "./state.js"

/** A password as text, `Redacted`, or a function asked at each connect (rotating credentials). */
export type Password = string | Redacted.Redacted<string> | (() => string | Promise<string>)

/** The fields of the public `Options` this module reads. */
export interface ConnectionFields {
  readonly url?: string | Redacted.Redacted<string> | undefined
  readonly host?: string | undefined
  readonly port?: number | undefined
  readonly database?: string | undefined
  readonly user?: string | undefined
  readonly password?: Password | undefined
  readonly ssl?: boolean | ConnectionOptions | undefined
  readonly maxSessions?: number | undefined
  readonly applicationName?: string | undefined
  readonly namespace?: string | undefined
  readonly fencingTable?: string | undefined
  readonly createTables?: boolean | undefined
  readonly connectTimeout?: Duration.DurationInput | undefined
  readonly heartbeatInterval?: Duration.DurationInput | undefined
  readonly heartbeatTimeout?: Duration.DurationInput | undefined
  readonly sweepInterval?: Duration.DurationInput | undefined
}

/** Sessions a layer opens when `maxSessions` is not given. */
const DEFAULT_MAX_SESSIONS = 4
const DEFAULT_APPLICATION_NAME = "effect-lock"
export const DEFAULT_FENCING_TABLE = "effect_lock_fencing"
const DEFAULT_CONNECT_TIMEOUT = Duration.seconds(10)
const DEFAULT_HEARTBEAT_INTERVAL = Duration.millis(500)
const DEFAULT_HEARTBEAT_TIMEOUT = Duration.millis(1_000)
/** An idle lock name's fencing row goes within about this long (plus one round). */
export const DEFAULT_SWEEP_INTERVAL = Duration.seconds(5)

/**
 * A duration option in whole milliseconds; thrown (naming the option) when refused. Each of them
 * ends up in a Node timer (node-pg's connect timeout, the heartbeat's schedule and bound), hence the cap.
 */
const positiveMillis = (input: Duration.DurationInput | undefined, fallback: Duration.Duration, what: string) =>
  Either.match(durationOption(what, input, fallback, { max: MAX_TIMER }), {
    onLeft: (reason) => {
      throw new Error(reason)
    },
    onRight: (duration) => Math.ceil(Duration.toMillis(duration))
  })

const passwordOf = (password: Password): pg.ClientConfig["password"] =>
  typeof password === "function" ? password : Redacted.isRedacted(password) ? Redacted.value(password) : password

/** node-pg's client config from the connection fields: the URL first, fields on top of it. */
const clientOf = (options: ConnectionFields): pg.ClientConfig => {
  if (options.url === undefined && options.host === undefined) {
    throw new Error("either url or host is required")
  }
  if (options.port !== undefined && (!Number.isInteger(options.port) || options.port < 1 || options.port > 65_535)) {
    throw new Error(`port must be a whole number from 1 to 65535, got ${options.port}`)
  }
  const url = options.url === undefined ? undefined : Redacted.isRedacted(options.url) ? Redacted.value(options.url) : options.url
  return {
    ...(url === undefined ? {} : { connectionString: url }),
    ...(options.host === undefined ? {} : { host: options.host }),
    ...(options.port === undefined ? {} : { port: options.port }),
    ...(options.database === undefined ? {} : { database: options.database }),
    ...(options.user === undefined ? {} : { user: options.user }),
    ...(options.password === undefined ? {} : { password: passwordOf(options.password) }),
    ...(options.ssl === undefined ? {} : { ssl: options.ssl })
  }
}

/** The engine's options, or a `LockBackendError` saying which option is wrong. */
export const resolve = (options: ConnectionFields): Effect.Effect<BackendOptions, LockBackendError> =>
  Effect.try({
    try: (): BackendOptions => {
      const maxSessions = options.maxSessions ?? DEFAULT_MAX_SESSIONS
      if (!Number.isInteger(maxSessions) || maxSessions < 1) {
        throw new Error(`maxSessions must be a whole number of at least 1, got ${maxSessions}`)
      }
      const table = parseTable(options.fencingTable ?? DEFAULT_FENCING_TABLE)
      if (typeof table === "string") throw new Error(`fencingTable: ${table}`)
      return {
        connect: {
          client: clientOf(options),
          applicationName: options.applicationName ?? DEFAULT_APPLICATION_NAME,
          connectTimeoutMillis: positiveMillis(options.connectTimeout, DEFAULT_CONNECT_TIMEOUT, "connectTimeout"),
          explicitApplicationName: options.applicationName !== undefined
        },
        createTables: options.createTables ?? true,
        maxSessions,
        namespace: options.namespace ?? "",
        fencingTable: table,
        heartbeatIntervalMillis: positiveMillis(options.heartbeatInterval, DEFAULT_HEARTBEAT_INTERVAL, "heartbeatInterval"),
        heartbeatTimeoutMillis: positiveMillis(options.heartbeatTimeout, DEFAULT_HEARTBEAT_TIMEOUT, "heartbeatTimeout"),
        sweepIntervalMillis: Either.match(
          durationOption("sweepInterval", options.sweepInterval, DEFAULT_SWEEP_INTERVAL, { max: MAX_TIMER, allowZero: true }),
          {
            onLeft: (reason) => {
              throw new Error(reason)
            },
            onRight: (duration) => Math.ceil(Duration.toMillis(duration))
          }
        )
      }
    },
    catch: (cause) => new LockBackendError({ operation: "configure", cause })
  })

/**
 * The connection fields of an app's `PgClient` config (`PgClient.config`): the same server,
 * database, credentials and TLS. A unix-socket `path` becomes the host (node-pg's convention).
 */
export const fromPgClientConfig = (config: PgClientConfig): ConnectionFields => ({
  ...(config.url === undefined ? {} : { url: config.url }),
  ...(config.host === undefined && config.path === undefined ? {} : { host: config.host ?? config.path }),
  ...(config.port === undefined ? {} : { port: config.port }),
  ...(config.database === undefined ? {} : { database: config.database }),
  ...(config.username === undefined ? {} : { user: config.username }),
  ...(config.password === undefined ? {} : { password: config.password }),
  ...(config.ssl === undefined ? {} : { ssl: config.ssl }),
  ...(config.connectTimeout === undefined ? {} : { connectTimeout: config.connectTimeout })
})

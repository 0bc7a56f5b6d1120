/**
 * The options the lease stores (PgLease, SqliteLease, RedisLease) share, resolved once for both: their defaults, the
 * configuration errors that name the backend and the option, the tables from a user-given name,
 * and the `defaults` record each public module shows.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import { LockBackendError } from "../../LockError.js"
import { durationOption, type DurationRules, TIMER } from "../core/validate.js"
import { MAX_NAME_BYTES, MIN_TTL } from "./engine.js"
import { RENEW_BATCH_SIZE } from "./renew.js"
import { DEFAULT_SWEEP_INTERVAL } from "./sweep.js"

/** The options of both lease stores (documented on `PgLease.Options` and `SqliteLease.Options`). */
export interface CommonOptions {
  readonly table?: string | undefined
  readonly ttl?: Duration.DurationInput | undefined
  readonly pollInterval?: Duration.DurationInput | undefined
  readonly statementTimeout?: Duration.DurationInput | undefined
  readonly createTable?: boolean | undefined
  readonly applicationName?: string | undefined
  readonly sweepInterval?: Duration.DurationInput | undefined
}

export const DEFAULT_TABLE = "effect_lock_leases"
export const DEFAULT_TTL = Duration.seconds(30)
export const DEFAULT_STATEMENT_TIMEOUT = Duration.seconds(5)
export const DEFAULT_APPLICATION = "effect-lock"

/** How one lease store (`PgLease`, `SqliteLease`) reads its options. */
export interface Resolver<T> {
  /** A configuration error of this store, saying what is wrong. */
  readonly configError: (reason: string) => LockBackendError
  /** The validated tables (default when absent), or the configuration error that names the problem. */
  readonly resolveTables: (table: string | undefined) => Effect.Effect<T, LockBackendError>
  /** A duration option, refused at build (naming it) when it is not one the store can run on. */
  readonly duration: (
    option: string,
    input: Duration.DurationInput | undefined,
    fallback: Duration.Duration,
    rules?: DurationRules
  ) => Effect.Effect<Duration.Duration, LockBackendError>
  /** `statementTimeout`, a bound on timers like every interval option. */
  readonly statementTimeout: (options: CommonOptions | undefined) => Effect.Effect<Duration.Duration, LockBackendError>
  /** `sweepInterval`: how often idle names' rows are deleted (default `fallback`, else the lease stores'); zero turns the sweep off. */
  readonly sweepInterval: (options: CommonOptions | undefined, fallback?: Duration.Duration) => Effect.Effect<Duration.Duration, LockBackendError>
  /** `ttl`: a positive ttl below the floor or above the ceiling is clamped by DistributedLock, so no max here. */
  readonly ttl: (options: CommonOptions | undefined) => Effect.Effect<Duration.Duration, LockBackendError>
  /** The engine's times of a store whose waiters are woken by a listener (PgLease, RedisLease), in the order they are checked. */
  readonly timings: (
    options: ListeningOptions | undefined,
    defaults: { readonly poll: Duration.Duration; readonly check: Duration.Duration; readonly sweep?: Duration.Duration }
  ) => Effect.Effect<Timings, LockBackendError>
}

/** The options of a store with a wake-up listener whose health is checked. */
export interface ListeningOptions extends CommonOptions {
  readonly listenCheckInterval?: Duration.DurationInput | undefined
}

/** The lease engine's times, validated. */
export interface Timings {
  readonly statementTimeout: Duration.Duration
  readonly defaultTtl: Duration.Duration
  readonly pollInterval: Duration.Duration
  readonly checkInterval: Duration.Duration
  readonly sweepInterval: Duration.Duration
}

/** The resolver of the store `backend` (its name in errors), whose tables `parseTables` reads. */
export const resolver = <T>(backend: string, parseTables: (input: string) => T | string): Resolver<T> => {
  const configError = (reason: string) => new LockBackendError({ operation: "configure", cause: new Error(`${backend}: ${reason}`) })
  const duration: Resolver<T>["duration"] = (option, input, fallback, rules) =>
    Either.mapLeft(durationOption(option, input, fallback, rules), configError)
  const statementTimeout: Resolver<T>["statementTimeout"] = (options) =>
    duration("statementTimeout", options?.statementTimeout, DEFAULT_STATEMENT_TIMEOUT, TIMER)
  const ttl: Resolver<T>["ttl"] = (options) => duration("ttl", options?.ttl, DEFAULT_TTL)
  const sweepInterval: Resolver<T>["sweepInterval"] = (options, fallback = DEFAULT_SWEEP_INTERVAL) =>
    duration("sweepInterval", options?.sweepInterval, fallback, { ...TIMER, allowZero: true })
  return {
    configError,
    resolveTables: (table) => {
      const parsed = parseTables(table ?? DEFAULT_TABLE)
      return typeof parsed === "string" ? Effect.fail(configError(parsed)) : Effect.succeed(parsed)
    },
    duration,
    statementTimeout,
    ttl,
    sweepInterval,
    timings: (options, defaults) =>
      Effect.all({
        statementTimeout: statementTimeout(options),
        defaultTtl: ttl(options),
        pollInterval: duration("pollInterval", options?.pollInterval, defaults.poll, TIMER),
        checkInterval: duration("listenCheckInterval", options?.listenCheckInterval, defaults.check, TIMER),
        sweepInterval: sweepInterval(options, defaults.sweep)
      })
  }
}

/**
 * A store's `migration`: the idempotent statements `ddl` creates `table`'s tables with, each ended
 * by `;` on its own line. Throws on an invalid identifier (a programming error).
 */
export const migration = <T>(backend: string, parseTables: (input: string) => T | string, ddl: (tables: T) => ReadonlyArray<string>) =>
(table: string): string => {
  const tables = parseTables(table)
  if (typeof tables === "string") throw new TypeError(`${backend}.migration: ${tables}`)
  return `${ddl(tables).join(";\n")};\n`
}

/** A store's `defaults`: what every lease store has, around its own (`own`, in the order shown). */
export const defaults = <const Own extends object>(own: Own) => ({
  ttl: DEFAULT_TTL,
  minTtl: MIN_TTL,
  ...own,
  statementTimeout: DEFAULT_STATEMENT_TIMEOUT,
  sweepInterval: DEFAULT_SWEEP_INTERVAL,
  renewBatchSize: RENEW_BATCH_SIZE,
  maxNameBytes: MAX_NAME_BYTES
} as const)

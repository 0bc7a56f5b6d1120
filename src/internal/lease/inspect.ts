/**
 * What PgLease and SqliteLease read alike: their configuration errors
 * and the rows of their `holders` statement (the same columns on both databases).
 */
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as FencingToken from "../../FencingToken.js"
import type { LockMode } from "../../Lease.js"
import { LockBackendError } from "../../LockError.js"
import { durationOption, type DurationRules } from "../core/validate.js"

/** A configuration error of the backend named `backend` (e.g. `PgLease`), saying what is wrong. */
export const configError = (backend: string) => (reason: string) =>
  new LockBackendError({ operation: "configure", cause: new Error(`${backend}: ${reason}`) })

/** A duration option of the backend `fail` names, refused at build (naming the option) when it is not one it can run on. */
export const durationOf = (fail: (reason: string) => LockBackendError) =>
(
  option: string,
  input: Duration.DurationInput | undefined,
  fallback: Duration.Duration,
  rules?: DurationRules
): Either.Either<Duration.Duration, LockBackendError> => Either.mapLeft(durationOption(option, input, fallback, rules), fail)

/** A live lease as stored in a lease table (documented on `PgLease.StoredLease`). */
export interface StoredLease {
  readonly name: string
  readonly mode: LockMode
  readonly token: FencingToken.FencingToken
  readonly expiresAt: number
  readonly acquiredAt: number
  readonly application: string | null
  readonly host: string | null
  readonly pid: number | null
  readonly waitingSince: number | null
}

/** A row of a `holders` statement (numbers may arrive as bigints from SQLite's safe integers). */
export interface HolderRow {
  readonly name: string
  readonly mode: LockMode
  readonly token: string
  readonly expires: number
  readonly acquired: number
  readonly application: string | null
  readonly host: string | null
  readonly pid: number | bigint | null
  readonly waiting: number | null
}

const numberOrNull = (value: number | bigint | null | undefined): number | null =>
  value === null || value === undefined ? null : Number(value)

export const storedLease = (row: HolderRow): StoredLease => ({
  name: row.name,
  mode: row.mode,
  token: FencingToken.make(BigInt(row.token)),
  expiresAt: Number(row.expires),
  acquiredAt: Number(row.acquired),
  application: row.application,
  host: row.host,
  pid: numberOrNull(row.pid),
  waitingSince: numberOrNull(row.waiting)
})

/**
 * `holders` for inspection tools, on either lease store: no lease while the tables do not exist
 * yet (`present`), and a failure of the listing reported as `inspect`, the operation asked for.
 */
export const inspectHolders = <R>(
  name: string | undefined,
  present: Effect.Effect<boolean, LockBackendError, R>,
  holders: Effect.Effect<ReadonlyArray<StoredLease>, LockBackendError, R>
): Effect.Effect<ReadonlyArray<StoredLease>, LockBackendError, R> =>
  Effect.flatMap(present, (exists) =>
    exists
      ? Effect.mapError(holders, (error) =>
        error.operation === "holders"
          ? new LockBackendError({ operation: "inspect", ...(name === undefined ? {} : { name }), cause: error.cause })
          : error)
      : Effect.succeed([]))

/** A semaphore in use as stored in a semaphore table (documented on `PgLease.StoredSemaphore`). */
export interface StoredSemaphore {
  readonly name: string
  readonly limit: number
  readonly holders: ReadonlyArray<{
    readonly permits: number
    readonly tokens: ReadonlyArray<FencingToken.FencingToken>
    readonly expiresAt: number
    readonly acquiredAt: number
    readonly application: string | null
    readonly host: string | null
    readonly pid: number | null
  }>
  readonly waiting: ReadonlyArray<{ readonly permits: number; readonly since: number }>
}

/** A row of a `semaphores` statement: the arrays as jsonb (PostgreSQL) or JSON text (SQLite). */
export interface SemaphoreRow {
  readonly name: string
  readonly lim: number | bigint
  readonly holders: string | ReadonlyArray<Readonly<Record<string, unknown>>>
  readonly waiters: string | ReadonlyArray<Readonly<Record<string, unknown>>>
}

const entries = (value: SemaphoreRow["holders"]): ReadonlyArray<Readonly<Record<string, unknown>>> =>
  typeof value === "string" ? JSON.parse(value) : value

const textOrNull = (value: unknown): string | null => (typeof value === "string" ? value : null)

export const storedSemaphore = (row: SemaphoreRow): StoredSemaphore => ({
  name: row.name,
  limit: Number(row.lim),
  holders: entries(row.holders).map((holder) => {
    const permits = Number(holder["permits"])
    const first = BigInt(String(holder["token"]))
    return {
      permits,
      tokens: Array.from({ length: permits }, (_, i) => FencingToken.make(first + BigInt(i))),
      expiresAt: Number(holder["expires"]),
      acquiredAt: Number(holder["acquired"]),
      application: textOrNull(holder["application"]),
      host: textOrNull(holder["host"]),
      pid: holder["pid"] === null || holder["pid"] === undefined ? null : Number(holder["pid"])
    }
  }),
  waiting: entries(row.waiters).map((waiter) => ({ permits: Number(waiter["permits"]), since: Number(waiter["since"]) }))
})

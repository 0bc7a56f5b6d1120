/**
 * What PgLease and SqliteLease read alike: their options' durations, their configuration errors,
 * and the rows of their `holders` statement (the same columns on both databases).
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as FencingToken from "../FencingToken.js"
import type { LockMode } from "../Lease.js"
import { LockBackendError } from "../LockError.js"

/** A configuration error of the backend named `backend` (e.g. `PgLease`), saying what is wrong. */
export const configError = (backend: string) => (reason: string) =>
  new LockBackendError({ operation: "configure", cause: new Error(`${backend}: ${reason}`) })

/** An optional duration option: `fallback` when absent, a configuration error when not a duration. */
export const durationOption = (fail: (reason: string) => LockBackendError) =>
(input: Duration.DurationInput | undefined, fallback: Duration.Duration, what: string) =>
  input === undefined ? Effect.succeed(fallback) : Option.match(Duration.decodeUnknown(input), {
    onNone: () => Effect.fail(fail(`${what} is not a duration: ${String(input)}`)),
    onSome: Effect.succeed
  })

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

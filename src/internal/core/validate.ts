import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Option from "effect/Option"
import type { LockMode } from "../../Lease.js"
import { InvalidLockName, LockBackendError } from "../../LockError.js"

/** Why `name` cannot be a lock name, or `undefined` when it can: no backend could store it faithfully. */
export const nameProblem = (name: string, maxBytes: number): InvalidLockName | undefined => {
  if (typeof name !== "string") {
    return new InvalidLockName({ name: String(name), reason: "a lock name must be a string" })
  }
  if (name.length === 0) {
    return new InvalidLockName({ name, reason: "a lock name must not be empty" })
  }
  // Lone surrogates cannot be encoded as UTF-8: two different names would map to the same bytes.
  if (!name.isWellFormed()) {
    return new InvalidLockName({ name, reason: "a lock name must be well-formed Unicode text" })
  }
  // PostgreSQL text cannot hold NUL; refuse it everywhere so names behave alike on every backend.
  if (name.includes("\u0000")) {
    return new InvalidLockName({ name, reason: "a lock name must not contain NUL characters" })
  }
  // A UTF-16 unit is at most 3 UTF-8 bytes: short names need no byte count.
  if (name.length * 3 > maxBytes) {
    const bytes = Buffer.byteLength(name, "utf8")
    if (bytes > maxBytes) {
      return new InvalidLockName({ name, reason: `a lock name is at most ${maxBytes} UTF-8 bytes, this one has ${bytes}` })
    }
  }
  return undefined
}

/** Rejects names no backend can store faithfully. */
export const validateName = (name: string, maxBytes: number): Effect.Effect<string, InvalidLockName> => {
  const problem = nameProblem(name, maxBytes)
  return problem === undefined ? Effect.succeed(name) : Effect.fail(problem)
}

/** Decodes an optional duration; `undefined` means "not given". */
export const decodeDuration = (input: Duration.DurationInput | undefined): Duration.Duration | undefined =>
  input === undefined ? undefined : Duration.decode(input)

/**
 * The longest delay Node's timers take (2^31 - 1 ms, about 24.8 days): a longer `setTimeout`
 * fires after 1 ms instead (TimeoutOverflowWarning), and Effect's sleep never fires at all.
 */
export const MAX_TIMER = Duration.millis(2 ** 31 - 1)

/** What a duration option accepts besides a positive, finite duration. */
export interface DurationRules {
  /** Zero means something (e.g. "never block"), so it is not a mistake. */
  readonly allowZero?: boolean | undefined
  /** The longest value accepted: `MAX_TIMER` for an option that ends up in a timer. */
  readonly max?: Duration.Duration | undefined
}

/** An option's value as written, for a message. */
const shown = (input: unknown): string =>
  Duration.isDuration(input)
    ? Duration.format(input)
    : typeof input === "string"
    ? JSON.stringify(input)
    : Array.isArray(input)
    ? `[${input.map(String).join(", ")}]`
    : String(input)

/** Written below zero, or NaN: `Duration.decode` turns those into zero, which would hide them. */
const belowZero = (input: unknown): boolean =>
  typeof input === "number"
    ? !(input >= 0)
    : typeof input === "bigint"
    ? input < BigInt(0)
    : typeof input === "string"
    ? input.startsWith("-")
    : Array.isArray(input) && input.some((part) => typeof part !== "number" || !(part >= 0))

/**
 * A duration option of a layer: `fallback` when absent, else the decoded value, or (Left) why it
 * is refused, naming `option`: not a duration (callers may be untyped JS), negative or NaN, zero
 * unless `rules.allowZero`, infinite, or longer than `rules.max`. The caller wraps the reason in
 * its own configuration error.
 */
export const durationOption = (
  option: string,
  input: unknown,
  fallback: Duration.Duration,
  rules: DurationRules = {}
): Either.Either<Duration.Duration, string> => {
  if (input === undefined) return Either.right(fallback)
  const decoded = Duration.decodeUnknown(input)
  const refused = Option.isNone(decoded) ||
    // An infinite bound or interval reaches a timer as an overflow: every statement would time out at once.
    !Duration.isFinite(decoded.value) ||
    (Duration.isZero(decoded.value) && (rules.allowZero !== true || belowZero(input)))
  if (refused) {
    const wanted = rules.allowZero === true ? "non-negative" : "positive"
    return Either.left(`${option} must be a ${wanted}, finite duration, got ${shown(input)}`)
  }
  if (rules.max !== undefined && Duration.greaterThan(decoded.value, rules.max)) {
    const why = rules.max === MAX_TIMER ? " (the longest timer Node can set)" : ""
    return Either.left(`${option} must be at most ${Duration.format(rules.max)}${why}, got ${shown(input)}`)
  }
  return Either.right(decoded.value)
}

/** Clamps a lease length into the backend's bounds. */
export const clampTtl = (
  ttl: Duration.Duration,
  min: Duration.Duration,
  max: Duration.Duration
): Duration.Duration => Duration.max(min, Duration.min(max, ttl))

/** Why `mode` is not a lock mode, or `undefined`; callers may be untyped JS. */
export const modeProblem = (name: string, mode: LockMode | undefined): LockBackendError | undefined =>
  mode === undefined || mode === "exclusive" || mode === "shared"
    ? undefined
    : new LockBackendError({
      operation: "acquire",
      name,
      cause: new Error(`unknown lock mode ${JSON.stringify(mode)}; use "exclusive" or "shared"`)
    })

/** The mode asked for, `exclusive` when absent; anything else is a typed error. */
export const validateMode = (name: string, mode: LockMode | undefined): Effect.Effect<LockMode, LockBackendError> => {
  const problem = modeProblem(name, mode)
  return problem === undefined ? Effect.succeed(mode ?? "exclusive") : Effect.fail(problem)
}

/** The rules of a duration that ends up in a Node timer (a statement's bound, a poll, a check). */
export const TIMER: DurationRules = { max: MAX_TIMER }

import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type { LockMode } from "../Lease.js"
import { InvalidLockName, LockBackendError } from "../LockError.js"

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

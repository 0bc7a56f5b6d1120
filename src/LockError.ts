/**
 * The typed failures of effect-lock. Each carries what a person needs to act on it — the lock
 * name, how long was waited, the fencing token of the lease concerned — and a readable message.
 *
 * **Over HTTP.** Each error is annotated for `@effect/platform`'s `HttpApi`: an endpoint that
 * declares it (`HttpApiEndpoint.addError(LockError.LockTimeout)`) answers with its status and a
 * JSON body of its fields (tokens as decimal strings, `waited` in milliseconds):
 *
 * | error | status | body |
 * |---|---|---|
 * | `LockTimeout` | 503 | `name`, `waited`, `retryAfter` |
 * | `LockLost` | 503 | `name`, `token`, `reason`, `retryAfter` |
 * | `LockBackendError` | 503 | `operation`, `name?`, `cause` (the driver error's name and message), `retryAfter` |
 * | `InvalidLockName` | 400 | `name`, `reason` |
 * | `StaleFencingToken` | 409 | `resource`, `presented`, `current` |
 * | `UnsafeConnectionPooling` | 500 | `detail` |
 *
 * `retryAfter` is the retry hint in seconds (default 1). It is a body field, not a
 * `Retry-After` header: an `HttpApi` error schema sets the status and body of its response, not
 * its headers. `LockBackendError` is 503 because the lock store being unreachable is a temporary
 * unavailability of the service, but its body carries the driver's error message (host names,
 * SQL states): declare it only on internal APIs, or map it to your own error first.
 * `UnsafeConnectionPooling` is a deployment mistake found when `PgAdvisory.layer` is built, so it
 * never reaches a request; should it be declared anyway, it is a server fault (500).
 *
 * @since 0.1.0
 */
import * as Duration from "effect/Duration"
import * as Schema from "effect/Schema"
import { FencingTokenSchema } from "./FencingToken.js"

/**
 * The key `@effect/platform`'s `HttpApiSchema` reads a response status from. A registered symbol,
 * so the errors carry their status without this module loading `@effect/platform`.
 *
 * @since 0.1.0
 * @category annotations
 */
export const HttpStatusAnnotation: unique symbol = Symbol.for("@effect/platform/HttpApiSchema/AnnotationStatus")

/**
 * The retry hint of the errors worth retrying, in seconds, when they are built without one.
 *
 * @since 0.1.0
 * @category constants
 */
export const DEFAULT_RETRY_AFTER_SECONDS = 1

/** `retryAfter`: seconds after which a retry may succeed; optional in constructors and in decoding. */
const retryAfter = Schema.optionalWith(Schema.NonNegativeInt, { default: () => DEFAULT_RETRY_AFTER_SECONDS })

/** Fencing tokens travel as decimal strings: a bigint is not JSON. */
const Token = FencingTokenSchema

/**
 * Why a held lease was lost.
 *
 * - `expired`: its lease ran out in the store before it could be renewed.
 * - `stolen`: another holder took it over after it expired.
 * - `connection-lost`: the database session holding it died.
 * - `renewal-failed`: renewals could not reach the store before the local deadline minus the
 *   safety margin, so the lease is given up before it can expire.
 * - `revoked`: an operator or test took it away.
 * - `shutdown`: the layer providing the lock service is closing; a guarded body was interrupted
 *   and had stopped before the lock was given back.
 *
 * @since 0.1.0
 * @category models
 */
export const LostReason = Schema.Literal("expired", "stolen", "connection-lost", "renewal-failed", "revoked", "shutdown")

/**
 * @since 0.1.0
 * @category models
 */
export type LostReason = typeof LostReason.Type

/**
 * The wait for a lock (session or connection checkout included) ran past the caller's `timeout`.
 *
 * @since 0.1.0
 * @category errors
 */
export class LockTimeout extends Schema.TaggedError<LockTimeout>("effect-lock/LockTimeout")("LockTimeout", {
  name: Schema.String,
  /** Encoded as milliseconds. */
  waited: Schema.DurationFromMillis,
  retryAfter
}, {
  description: "The lock was not granted within the caller's timeout",
  [HttpStatusAnnotation]: 503
}) {
  override get message(): string {
    return `timed out after ${Duration.format(this.waited)} acquiring lock "${this.name}"`
  }
}

/**
 * A lease this process held is gone. Work done under it must stop: another holder may already
 * have a larger fencing token.
 *
 * @since 0.1.0
 * @category errors
 */
export class LockLost extends Schema.TaggedError<LockLost>("effect-lock/LockLost")("LockLost", {
  name: Schema.String,
  token: Token,
  reason: LostReason,
  retryAfter
}, {
  description: "A lock held for this request was lost; the work under it was stopped",
  [HttpStatusAnnotation]: 503
}) {
  override get message(): string {
    return `lost lock "${this.name}" (fencing token ${this.token}): ${describeReason(this.reason)}`
  }
}

const describeReason = (reason: LostReason): string => {
  switch (reason) {
    case "expired":
      return "its lease expired before it was renewed"
    case "stolen":
      return "another holder took it over after the lease expired"
    case "connection-lost":
      return "the database session holding it died"
    case "renewal-failed":
      return "renewals could not reach the store before the lease's safety margin"
    case "revoked":
      return "it was revoked"
    case "shutdown":
      return "its lock service is shutting down"
  }
}

/**
 * The lock store failed (database unreachable, a statement failed). The raw driver error is kept
 * in `cause` for logs; it is never the failure itself.
 *
 * @since 0.1.0
 * @category errors
 */
export class LockBackendError extends Schema.TaggedError<LockBackendError>("effect-lock/LockBackendError")(
  "LockBackendError",
  {
    operation: Schema.String,
    name: Schema.optional(Schema.String),
    cause: Schema.Defect,
    retryAfter
  },
  {
    description: "The lock store could not be reached or failed",
    [HttpStatusAnnotation]: 503
  }
) {
  override get message(): string {
    // `name` is optional here, and Error.prototype.name would stand in for a missing one.
    const subject = Object.hasOwn(this, "name") && this.name !== undefined ? ` for lock "${this.name}"` : ""
    return `lock backend failed during ${this.operation}${subject}: ${causeMessage(this.cause)}`
  }
}

const causeMessage = (cause: unknown): string => {
  const own = typeof cause === "object" && cause !== null && "message" in cause ? String(cause.message) : String(cause)
  // SqlError says only "Failed to execute statement"; the driver error it wraps says why.
  const inner = typeof cause === "object" && cause !== null && "cause" in cause ? cause.cause : undefined
  if (typeof inner === "object" && inner !== null && "message" in inner && String(inner.message) !== own) {
    return `${own}: ${String(inner.message)}`
  }
  return own
}

/**
 * The lock name cannot be used: empty, longer than the backend allows, or not well-formed text.
 *
 * @since 0.1.0
 * @category errors
 */
export class InvalidLockName extends Schema.TaggedError<InvalidLockName>("effect-lock/InvalidLockName")(
  "InvalidLockName",
  {
    name: Schema.String,
    reason: Schema.String
  },
  {
    description: "The lock name cannot be used",
    [HttpStatusAnnotation]: 400
  }
) {
  override get message(): string {
    const shown = this.name.length > 64 ? `${this.name.slice(0, 64)}…` : this.name
    return `invalid lock name "${shown}": ${this.reason}`
  }
}

/**
 * Session locks were asked for on a connection without session affinity (for example PgBouncer
 * in `pool_mode = transaction`), where a lock would silently attach to someone else's session.
 *
 * @since 0.1.0
 * @category errors
 */
export class UnsafeConnectionPooling extends Schema.TaggedError<UnsafeConnectionPooling>(
  "effect-lock/UnsafeConnectionPooling"
)("UnsafeConnectionPooling", {
  detail: Schema.String
}, {
  description: "Session advisory locks were configured on a connection without session affinity",
  [HttpStatusAnnotation]: 500
}) {
  override get message(): string {
    return `session advisory locks need a connection with session affinity: ${this.detail}`
  }
}

/**
 * A write presented a fencing token older than one the resource has already accepted: the
 * writer lost its lock and someone newer has written since.
 *
 * @since 0.1.0
 * @category errors
 */
export class StaleFencingToken extends Schema.TaggedError<StaleFencingToken>("effect-lock/StaleFencingToken")(
  "StaleFencingToken",
  {
    resource: Schema.String,
    presented: Token,
    current: Token
  },
  {
    description: "A write presented a fencing token older than one the resource already accepted",
    [HttpStatusAnnotation]: 409
  }
) {
  override get message(): string {
    return `stale fencing token for "${this.resource}": presented ${this.presented}, but ${this.current} was already accepted`
  }
}

/**
 * The typed failures of effect-lock. Each carries what a person needs to act on it — the lock
 * name, how long was waited, the fencing token of the lease concerned — and a readable message.
 *
 * @since 0.1.0
 */
import * as Duration from "effect/Duration"
import * as Schema from "effect/Schema"
import { FencingTokenFromSelf } from "./FencingToken.js"

/**
 * Why a held lease was lost.
 *
 * - `expired`: its lease ran out in the store before it could be renewed.
 * - `stolen`: another holder took it over after it expired.
 * - `connection-lost`: the database session holding it died.
 * - `renewal-failed`: renewals could not reach the store before the local deadline minus the
 *   safety margin, so the lease is given up before it can expire.
 * - `revoked`: an operator or test took it away, or the layer providing the lock service was
 *   closed while the lease was held.
 *
 * @since 0.1.0
 * @category models
 */
export const LostReason = Schema.Literal("expired", "stolen", "connection-lost", "renewal-failed", "revoked")

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
  waited: Schema.DurationFromSelf
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
  token: FencingTokenFromSelf,
  reason: LostReason
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
      return "it was revoked (or its lock service was shut down)"
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
    cause: Schema.Defect
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
    presented: FencingTokenFromSelf,
    current: FencingTokenFromSelf
  }
) {
  override get message(): string {
    return `stale fencing token for "${this.resource}": presented ${this.presented}, but ${this.current} was already accepted`
  }
}

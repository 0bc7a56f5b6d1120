/**
 * A raw request of the backend SPI for tests that call a backend directly: one attempt (or a
 * wait, with `"wait"`), exclusive, no deadline, nothing interruptible (what the core would wrap
 * around it is left out).
 */
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import type { AcquireRequest } from "effect-lock/LockBackend"

export const onceRequest = (name: string, ttl: Duration.Duration, attempt: AcquireRequest["attempt"] = "once"): AcquireRequest => ({
  name,
  mode: "exclusive",
  attempt,
  ttl,
  deadline: Option.none(),
  interruptible: (step) => step,
  waitUntilDeadline: (step) => Effect.map(step, Option.some),
  onLost: () => Effect.void
})

/**
 * Clocks for the schedule tests: a replica whose wall clock disagrees with the others'.
 */
import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"

/**
 * `base` with its wall time (`currentTimeMillis`) `behindMs` behind; its monotonic time
 * (`currentTimeNanos`, on which leases are measured) and its sleeps are `base`'s, as on a host
 * whose system clock is off while its timers run true.
 */
export const skewed = (base: Clock.Clock, behindMs: number): Clock.Clock => ({
  [Clock.ClockTypeId]: Clock.ClockTypeId,
  unsafeCurrentTimeMillis: () => base.unsafeCurrentTimeMillis() - behindMs,
  currentTimeMillis: Effect.sync(() => base.unsafeCurrentTimeMillis() - behindMs),
  unsafeCurrentTimeNanos: () => base.unsafeCurrentTimeNanos(),
  currentTimeNanos: base.currentTimeNanos,
  sleep: (duration) => base.sleep(duration)
})

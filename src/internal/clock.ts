import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"

/**
 * Milliseconds on the Clock's monotonic timeline (`currentTimeNanos`: hrtime in production,
 * TestClock in tests). Every lease deadline is measured on it: the wall clock (`Date.now()`)
 * can be stepped back by NTP, which would make a lease look valid for longer than it is.
 */
export const monotonicMillis: Effect.Effect<number> = Effect.map(Clock.currentTimeNanos, (nanos) => Number(nanos) / 1e6)

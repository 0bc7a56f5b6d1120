import * as Clock from "effect/Clock"
import * as Context from "effect/Context"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type * as Fiber from "effect/Fiber"

/**
 * Milliseconds on the Clock's monotonic timeline (`currentTimeNanos`: hrtime in production,
 * TestClock in tests). Every lease deadline is measured on it: the wall clock (`Date.now()`)
 * can be stepped back by NTP, which would make a lease look valid for longer than it is.
 */
export const monotonicMillis: Effect.Effect<number> = Effect.clockWith((clock) => Effect.succeed(clockMillis(clock)))

/**
 * `monotonicMillis` read synchronously from a Clock. (`unsafeCurrentTimeNanos`, because
 * TestClock's `currentTimeNanos` throws once its instant is not a whole millisecond.)
 */
export function clockMillis(clock: Clock.Clock): number {
  return Number(clock.unsafeCurrentTimeNanos()) / 1e6
}

/**
 * A sleep of `millis` rounded up to whole milliseconds: deadlines are fractional, and a
 * fractional sleep would leave TestClock at a fractional instant, which it cannot report in
 * nanoseconds. Waking up to 1 ms late is within every margin the library keeps.
 */
export const sleepMillis = (millis: number): Effect.Effect<void> => Effect.sleep(Duration.millis(wholeMillis(millis)))

/** `millis` rounded up to a whole, non-negative number of milliseconds. */
export const wholeMillis = (millis: number): number => Math.max(0, Math.ceil(millis))

/** The Clock service `fiber` runs with (TestClock in tests), read synchronously. */
export const clockOf = (fiber: Fiber.RuntimeFiber<unknown, unknown>): Clock.Clock =>
  Context.get(fiber.currentDefaultServices, Clock.Clock)

/**
 * `monotonicMillis` as `fiber` sees it, read synchronously: for steps that must check the time
 * and act on it with no other fiber running in between.
 */
export const fiberMillis = (fiber: Fiber.RuntimeFiber<unknown, unknown>): number => clockMillis(clockOf(fiber))

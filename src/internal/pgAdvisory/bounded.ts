/**
 * Client-side bounds for the engine, on `stallSafe`'s timer (a stall never fails a live answer).
 *
 * Both sides of the race run interruptibly, whatever the caller's region: most of the engine runs
 * uninterruptibly (a grant must never be dropped half-way), and a race whose loser inherits that
 * cannot interrupt it — the winner would then wait for the loser, e.g. for the whole timeout
 * after the answer came. Interrupting either side is harmless: a sent statement cannot be taken
 * back anyway (its outcome stays with the worker), a timer just stops.
 */
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { sleepThenReadIO } from "../stallSafe.js"

/** `self`, or `None` if it has not completed `duration` after it started and after pending I/O was read. */
export const within = <A, E, R>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput
): Effect.Effect<Option.Option<A>, E, R> =>
  Effect.raceFirst(
    Effect.interruptible(Effect.asSome(self)),
    Effect.interruptible(Effect.as(sleepThenReadIO(duration), Option.none<A>()))
  )

/** `self`, or the failure `onTimeout` builds if it did not complete in time (see `within`). */
export const withinOrFail = <A, E, R, E2>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput,
  onTimeout: () => E2
): Effect.Effect<A, E | E2, R> =>
  Effect.flatMap(
    within(self, duration),
    Option.match({ onNone: () => Effect.fail(onTimeout()), onSome: Effect.succeed })
  )

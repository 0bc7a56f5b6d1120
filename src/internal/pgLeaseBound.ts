/**
 * Client-side bounds for PgLease's statements, on top of `stallSafe`: the timer only fires after
 * the event loop has read what already arrived, so a stall never fails an answered statement.
 *
 * Both sides of the race are interruptible in their own fibers. Releases run in finalizers, which
 * are uninterruptible, and a race started there forks uninterruptible fibers: the winner could
 * then not stop the loser, and a release that answered in 2 ms would wait out the whole timer
 * (or a stuck statement would outlive its bound). The bounded effect must tolerate interruption
 * (every statement here does: its connection is destroyed, or its outcome given back).
 */
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { sleepThenReadIO } from "./stallSafe.js"

/** `self`, or `None` when it has not completed within `duration` (and the I/O already received is read). */
export const timeoutOption = <A, E, R>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput
): Effect.Effect<Option.Option<A>, E, R> =>
  Effect.raceFirst(
    Effect.interruptible(Effect.asSome(self)),
    Effect.interruptible(Effect.as(sleepThenReadIO(duration), Option.none<A>()))
  )

/** `self`, or the failure `onTimeout` builds when it has not completed within `duration`. */
export const timeoutFail = <A, E, R, E2>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput,
  onTimeout: () => E2
): Effect.Effect<A, E | E2, R> =>
  Effect.flatMap(timeoutOption(self, duration), Option.match({ onNone: () => Effect.fail(onTimeout()), onSome: Effect.succeed }))

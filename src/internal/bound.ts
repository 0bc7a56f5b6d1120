import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { wholeMillis } from "./clock.js"
import { sleepThenReadIO } from "./stallSafe.js"

/**
 * `self`, or `None` if it has not completed `millis` after it started and after the event loop
 * read what had already arrived: `stallSafe.timeoutOption`, usable where the caller is
 * uninterruptible (a finalizer, the core's acquire).
 *
 * Why not `timeoutOption` itself: its racers inherit the caller's interruptibility, and a race
 * waits for its loser to stop, so in an uninterruptible region it returns only when *both* the
 * step and the timer are done — an answered release still waits the whole bound. Here the
 * timer is always interruptible, so an answer ends the wait at once. `self` keeps the caller's
 * interruptibility: a step that must not be cut off (a backend's release) is not, and the bound
 * then ends when the step does, as the backend's own bound promises.
 */
export const boundOption = <A, E, R>(self: Effect.Effect<A, E, R>, millis: number): Effect.Effect<Option.Option<A>, E, R> =>
  Effect.raceFirst(Effect.asSome(self), Effect.as(Effect.interruptible(sleepThenReadIO(wholeMillis(millis))), Option.none<A>()))

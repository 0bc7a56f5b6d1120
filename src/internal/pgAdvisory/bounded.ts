/**
 * Client-side bounds for the engine, on `stallSafe`'s timer (a stall never fails a live answer).
 *
 * The bounded side runs interruptibly, whatever the caller's region: most of the engine runs
 * uninterruptibly (a grant must never be dropped half-way), and a bounded step that inherited
 * that could not be cut off at its bound. Interrupting it is harmless here: a sent statement
 * cannot be taken back anyway (its outcome stays with the session's worker).
 */
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type * as Option from "effect/Option"
import { timeoutFail, timeoutOption } from "../stallSafe.js"

/** `self`, or `None` if it has not completed `duration` after it started and after pending I/O was read. */
export const within = <A, E, R>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput
): Effect.Effect<Option.Option<A>, E, R> => timeoutOption(Effect.interruptible(self), duration)

/** `self`, or the failure `onTimeout` builds if it did not complete in time (see `within`). */
export const withinOrFail = <A, E, R, E2>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput,
  onTimeout: () => E2
): Effect.Effect<A, E | E2, R> => timeoutFail(Effect.interruptible(self), duration, onTimeout)

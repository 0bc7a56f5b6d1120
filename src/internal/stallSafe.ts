/**
 * Timeouts that an event-loop stall cannot turn into false failures.
 *
 * After the event loop was blocked (a GC pause, a CPU-throttled container, a long synchronous
 * computation), Node runs due timers *before* it reads the sockets: a plain `Effect.timeout`
 * fires even though the server's answer has been sitting in the socket buffer all along, and a
 * live session or lease is given up for nothing. Here the timer's firing only opens the
 * question: the process first lets the event loop poll its sockets (two hops through the check
 * phase, so that answers resumed through Effect's scheduler, which defers to a `setTimeout(0)`
 * after long microtask chains, have run too), and only an answer still missing after that is a
 * timeout. The bound is then the duration plus two event-loop turns, never more.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"

/** One turn of the event loop through its poll phase: I/O already received is read before this ends. */
const hop: Effect.Effect<void> = Effect.async<void>((resume) => {
  const handle = setImmediate(() => resume(Effect.void))
  return Effect.sync(() => clearImmediate(handle))
})

/**
 * Lets the event loop read every socket that is ready (and Effect resume what that answers)
 * before going on.
 */
export const yieldToIO: Effect.Effect<void> = Effect.zipRight(hop, hop)

/** Sleeps on the Clock, then lets pending I/O be read: "this much time passed and nothing came in". */
export const sleepThenReadIO = (duration: Duration.DurationInput): Effect.Effect<void> =>
  Effect.zipRight(Effect.sleep(duration), yieldToIO)

/**
 * `self`, or `None` if it has not completed `duration` after it started *and* after the event
 * loop has read what had already arrived. On timeout `self` is interrupted and awaited, as with
 * `Effect.timeout` (wrap it in `Effect.disconnect` not to wait for an uninterruptible one).
 */
export const timeoutOption = <A, E, R>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput
): Effect.Effect<Option.Option<A>, E, R> =>
  Effect.raceFirst(
    Effect.asSome(self),
    // Interruptible even inside an uninterruptible caller: the losing timer must stop at once
    // when `self` answers, not hold the caller for the rest of the duration.
    Effect.interruptible(Effect.as(sleepThenReadIO(duration), Option.none<A>()))
  )

/** `self`, or the failure `onTimeout` builds if it did not complete in time (see `timeoutOption`). */
export const timeoutFail = <A, E, R, E2>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput,
  onTimeout: () => E2
): Effect.Effect<A, E | E2, R> =>
  Effect.flatMap(
    timeoutOption(self, duration),
    Option.match({ onNone: () => Effect.fail(onTimeout()), onSome: Effect.succeed })
  )

/**
 * `timeoutOption` with `self` run interruptibly too, whatever the caller's region: for bounds
 * inside uninterruptible code (a grant's bookkeeping, a release in a finalizer), where a step that
 * inherited uninterruptibility could not be cut off at its bound. Use it only for steps that
 * tolerate interruption (a sent statement whose connection is then destroyed, or whose outcome
 * is given back by its owner).
 */
export const within = <A, E, R>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput
): Effect.Effect<Option.Option<A>, E, R> => timeoutOption(Effect.interruptible(self), duration)

/** `within`, failing with what `onTimeout` builds when the bound passed. */
export const withinOrFail = <A, E, R, E2>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput,
  onTimeout: () => E2
): Effect.Effect<A, E | E2, R> => timeoutFail(Effect.interruptible(self), duration, onTimeout)

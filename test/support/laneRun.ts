/**
 * A lease lane with its `run` replaced by a test's wrapper (a gate, a counter). The lane's callback
 * path (`runNow`, which the engine takes on its own connections) goes through the same wrapper, so
 * a test meets the path the library takes by default, not only the fiber path beside it.
 */
import { Cause, Effect, Exit, FiberId, Option } from "effect"
import type { Row } from "effect-lock/internal/lease/dialect"
import type { Lane } from "effect-lock/internal/lease/lane"
import { LockBackendError } from "effect-lock/LockError"

export const withRun = (lane: Lane, run: Lane["run"]): Lane => ({
  ...lane,
  run,
  runNow: lane.runNow === undefined ? undefined : (operation, name, text, params, bound, done) => {
    const fiber = Effect.runFork(run<Row>(operation, name, text, params, bound))
    fiber.addObserver((exit) => {
      if (Exit.isSuccess(exit)) return done(undefined, exit.value.rows)
      if (Cause.isInterruptedOnly(exit.cause)) return
      const failure = Cause.failureOption(exit.cause)
      done(Option.isSome(failure) ? failure.value : new LockBackendError({ operation, cause: Cause.squash(exit.cause) }))
    })
    // Abandoned: the statement's own abandon (its connection destroyed if it was sending).
    return () => fiber.unsafeInterruptAsFork(FiberId.none)
  }
})

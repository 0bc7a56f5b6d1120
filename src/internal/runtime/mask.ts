/**
 * `Effect.uninterruptibleMask` for steps on every cycle's path that are nearly always called from
 * an uninterruptible region already (the core's acquire): there it is skipped, and `restore` is
 * the identity — restoring "uninterruptible" inside an uninterruptible region changes nothing —
 * saving the mask's step, the restore's step and the two frames they push. Called from an
 * interruptible region it is `Effect.uninterruptibleMask` itself. Use `restore` only directly in
 * the masked body, in the same fiber: inside a region the body made interruptible, or in another
 * fiber, the identity would not restore "uninterruptible" as Effect's `restore` does.
 */
import * as Clock from "effect/Clock"
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as RuntimeFlags from "effect/RuntimeFlags"

export type Restore = <A, E, R>(self: Effect.Effect<A, E, R>) => Effect.Effect<A, E, R>

const identity: Restore = (self) => self

/** `f` under an uninterruptible mask, with the fiber's Clock (as `Effect.clockWith`: one step for both). */
export const uninterruptibleMaskClock = <A, E, R>(
  f: (restore: Restore, clock: Clock.Clock) => Effect.Effect<A, E, R>
): Effect.Effect<A, E, R> =>
  Effect.withFiberRuntime<A, E, R>((fiber, status) => {
    const clock = Context.get(fiber.currentDefaultServices, Clock.Clock)
    return RuntimeFlags.interruption(status.runtimeFlags)
      ? Effect.uninterruptibleMask((restore) => f(restore, clock))
      : f(identity, clock)
  })

/** `Effect.uninterruptibleMask(f)`, skipped where the caller is uninterruptible already. */
export const uninterruptibleMask = <A, E, R>(f: (restore: Restore) => Effect.Effect<A, E, R>): Effect.Effect<A, E, R> =>
  uninterruptibleMaskClock((restore) => f(restore))

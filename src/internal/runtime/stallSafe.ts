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
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as FiberRef from "effect/FiberRef"
import * as Option from "effect/Option"

/**
 * True in the fibers `detachedWithin` runs its step and its timer in. A guarded body's stall
 * watch leaves them alone: the body fiber waiting for them is itself checked when it resumes, and
 * a helper stopped by the watch would end the step with an interruption — even where the caller
 * made the step uninterruptible (a write already on its way, a `Fence.check` in it).
 *
 * Why these helpers stay now that a layer's own work runs on the layer's runtime (`owner.ts`):
 * their users — `Fence.check` and `withXactLock` — send the *caller's* statements in the
 * caller's transaction (its connection is in the caller's context), so that work cannot move to
 * a layer's runtime; it stays the caller's, bounded here without the caller's stall watch.
 */
export const boundHelper: FiberRef.FiberRef<boolean> = FiberRef.unsafeMake(false)

/** Forks `self` as a daemon helper: the flag is set before it starts (the watch checks a fiber's very first run too). */
const forkHelper = <A, E, R>(self: Effect.Effect<A, E, R>) => Effect.locally(Effect.forkDaemon(self), boundHelper, true)

/** The longest delay Node's timers take (a longer one fires at once). */
export const MAX_TIMER_MILLIS = 2_147_483_647

/**
 * A stall-safe timer outside any fiber: `onTimeout` runs `millis` after now unless cancelled, but
 * only after the event loop has read the I/O that was ready when the timer fired (two turns
 * through the check phase, as `yieldToIO`). Returns the cancel. For bounds on the hot path, where
 * a fiber racing a sleep per statement or per wait is the cost (issue 23).
 */
export const stallSafeTimer = (millis: number, onTimeout: () => void): () => void => {
  let cancelled = false
  const timer = setTimeout(() =>
    setImmediate(() =>
      setImmediate(() => {
        if (!cancelled) onTimeout()
      })
    ), Math.min(Math.max(0, millis), MAX_TIMER_MILLIS))
  return () => {
    cancelled = true
    clearTimeout(timer)
  }
}

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

/**
 * `self` bounded by `duration`, run in fibers of its own rather than children of the caller: an
 * interruption of the caller that the caller holds back (it is in an uninterruptible region, such
 * as a fenced write already on its way) never reaches `self`, nor does a guarded body's stall
 * watch; only the bound stops it (then interrupted in the background, the caller not waiting for
 * it), or the caller's interruption where the caller is interruptible. `None` when the bound
 * passed first (stall-safe, as `timeoutOption`).
 *
 * `abandon`, when given, is awaited whenever the caller leaves `self` behind (the bound passed, or
 * the caller was interrupted) before the caller goes on: for a stop that must have reached the
 * server before the caller's next statement can (a cancel of an uninterruptible statement).
 */
export const detachedWithin = <A, E, R>(
  self: Effect.Effect<A, E, R>,
  duration: Duration.DurationInput,
  abandon: Effect.Effect<void> = Effect.void
): Effect.Effect<Option.Option<A>, E, R> =>
  Effect.uninterruptibleMask((restore) =>
    Effect.gen(function*() {
      const outcome = yield* Deferred.make<Option.Option<Exit.Exit<A, E>>>()
      // Daemons, not children: Effect passes a fiber's interruption on to its children at once,
      // even while the fiber itself holds it back in an uninterruptible region.
      const step = yield* forkHelper(
        Effect.flatMap(Effect.exit(Effect.interruptible(self)), (exit) => Deferred.succeed(outcome, Option.some(exit)))
      )
      const timer = yield* forkHelper(
        Effect.zipRight(Effect.interruptible(sleepThenReadIO(duration)), Deferred.succeed(outcome, Option.none()))
      )
      const settled = yield* restore(Deferred.await(outcome)).pipe(
        Effect.onInterrupt(() => Effect.zipRight(Effect.zipRight(Fiber.interruptFork(step), Fiber.interruptFork(timer)), abandon))
      )
      yield* Fiber.interruptFork(timer)
      if (Option.isNone(settled)) {
        // Past the bound: stopped in the background (a sent statement is cancelled by its driver).
        yield* Fiber.interruptFork(step)
        yield* abandon
        return Option.none<A>()
      }
      return Option.some(yield* settled.value)
    })
  )

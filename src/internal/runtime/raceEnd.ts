/**
 * A step raced against an end that a callback delivers (a timer, a closing service), with one
 * fiber instead of `Effect.raceFirst`'s two: the step runs in a child fiber whose exit and the end
 * are both plain callbacks, and the caller waits for whichever comes first in one `Effect.async`.
 * Every contended acquire waits through this (`AcquireRequest.waitUntilDeadline`), a waiter of a
 * handoff once per grant, so the race's fibers and its loser's interruption were on the
 * handoff's path. A step made by `callbackStep` (a wake-up, a statement's outcome) is itself a
 * callback: then no fiber at all.
 */
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"

/** A wait that is a plain callback: `register` arranges `done` to be called once, and returns the cancel. */
export type Register<A> = (done: (value: A) => void) => () => void

/** The callbacks behind the effects `callbackStep` made (a WeakMap: the effect's shape stays the runtime's). */
const registers = new WeakMap<object, Register<unknown>>()

/** The effect that waits for `register`'s callback, which `raceEnd` races without a fiber. */
export const callbackStep = <A>(register: Register<A>): Effect.Effect<A> => {
  const step = Effect.async<A>((resume) => {
    const cancel = register((value) => resume(Effect.succeed(value)))
    return Effect.sync(cancel)
  })
  registers.set(step, register as Register<unknown>)
  return step
}

/**
 * `raceEnd` of a callback step: both sides are callbacks, decided in one `async`. Interruptible
 * whatever the caller's region, as the step's child fiber is on the other path (Effect passes a
 * parent's interruption to its children at once): a waiting step grants nothing.
 */
const raceCallbacks = <A>(register: Register<A>, arm: (end: () => void) => () => void): Effect.Effect<Option.Option<A>> =>
  Effect.interruptible(Effect.async<Option.Option<A>>((resume) => {
    let decided = false
    let cancelStep: (() => void) | undefined
    let disarm: (() => void) | undefined
    // The loser's cancel is synchronous: nothing of it outlives the race.
    const decide = (outcome: Option.Option<A>) => {
      if (decided) return
      decided = true
      cancelStep?.()
      disarm?.()
      resume(Effect.succeed(outcome))
    }
    cancelStep = register((value) => decide(Option.some(value)))
    // The step ended while registering: its cancel runs now that it is known.
    if (decided) cancelStep()
    else {
      try {
        disarm = arm(() => decide(Option.none()))
      } catch (defect) {
        // Arming failed (a defect): the step's registration must not outlive the race.
        decided = true
        cancelStep()
        throw defect
      }
      if (decided) disarm()
    }
    return Effect.sync(() => {
      if (decided) return
      decided = true
      cancelStep?.()
      disarm?.()
    })
  }))

/**
 * `step` (run interruptibly, whatever the caller's region), or `None` once `arm`'s `end` is
 * called first; `arm` returns its own cancel, called once the race is decided either way. As
 * with `Effect.raceFirst`, the loser never outlives the race: a step the end beat is interrupted
 * and awaited, and so is the step when the caller is interrupted while it waits.
 * `arm` may call `end` at once (an end that has already come).
 */
export const raceEnd = <A, E, R>(
  step: Effect.Effect<A, E, R>,
  arm: (end: () => void) => () => void
): Effect.Effect<Option.Option<A>, E, R> => {
  const register = registers.get(step) as Register<A> | undefined
  return register !== undefined ? raceCallbacks(register, arm) : raceFiber(step, arm)
}

const raceFiber = <A, E, R>(
  step: Effect.Effect<A, E, R>,
  arm: (end: () => void) => () => void
): Effect.Effect<Option.Option<A>, E, R> =>
  // A child of the caller's fiber on purpose (as raceFirst's were): the step is the caller's own
  // wait, interrupted with it and awaited before it goes on; it is no work of the layer's.
  Effect.flatMap(Effect.fork(Effect.interruptible(step)), (child) =>
    Effect.async<Option.Option<A>, E>((resume) => {
      let decided = false
      let disarm: (() => void) | undefined
      const onExit = (exit: Exit.Exit<A, E>) => {
        if (decided) return
        decided = true
        disarm?.()
        resume(Exit.isSuccess(exit) ? Effect.succeed(Option.some(exit.value)) : Effect.failCause(exit.cause))
      }
      const end = () => {
        if (decided) return
        decided = true
        child.removeObserver(onExit)
        // The loser stops before the caller goes on, as in a race of fibers.
        resume(Effect.as(Fiber.interrupt(child), Option.none()))
      }
      // Called at once when the step has already ended.
      child.addObserver(onExit)
      if (!decided) {
        disarm = arm(end)
        // The end came while arming: it is decided, and the end's own resources go now.
        if (decided) disarm()
      }
      // The caller interrupted while it waits: nothing more is decided; the step stops and is awaited.
      return Effect.suspend(() => {
        if (!decided) {
          decided = true
          child.removeObserver(onExit)
          disarm?.()
        }
        return Fiber.interrupt(child)
      })
    }))

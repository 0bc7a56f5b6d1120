import { describe, expect, it } from "@effect/vitest"
import { Deferred, Effect, Exit, Fiber, Option } from "effect"
import { callbackStep, raceEnd } from "effect-lock/internal/runtime/raceEnd"

/** An end the test fires by hand; `armed` counts arms not yet cancelled. */
const manualEnd = () => {
  const state = { fire: undefined as (() => void) | undefined, armed: 0 }
  const arm = (end: () => void) => {
    state.armed++
    state.fire = end
    return () => {
      state.armed--
      state.fire = undefined
    }
  }
  return { state, arm }
}

/** A callback step the test completes by hand; `registered` counts registrations not yet cancelled. */
const manualStep = <A>() => {
  const state = { done: undefined as ((value: A) => void) | undefined, registered: 0 }
  const step = callbackStep<A>((done) => {
    state.registered++
    state.done = done
    return () => {
      state.registered--
      state.done = undefined
    }
  })
  return { state, step }
}

/** A fiber step that never ends by itself; `stopped` once it was interrupted (its finalizer ran). */
const stoppableStep = () => {
  const state = { stopped: false }
  const step = Effect.onInterrupt(Effect.never, () => Effect.sync(() => { state.stopped = true }))
  return { state, step }
}

/** `self` forked and given two turns: its child fiber (if any) has started and registered. */
const started = <A, E>(self: Effect.Effect<A, E>) =>
  Effect.tap(Effect.fork(self), () => Effect.zipRight(Effect.yieldNow(), Effect.yieldNow()))

describe("raceEnd: a step raced with an end that a callback delivers", () => {
  it.effect("a fiber step that ends first wins, and the end is disarmed", () =>
    Effect.gen(function*() {
      const { arm, state } = manualEnd()
      const gate = yield* Deferred.make<number>()
      const fiber = yield* Effect.fork(raceEnd(Deferred.await(gate), arm))
      yield* Effect.yieldNow()
      expect(state.armed).toBe(1)
      yield* Deferred.succeed(gate, 7)
      expect(yield* Fiber.join(fiber)).toEqual(Option.some(7))
      expect(state.armed).toBe(0)
    }))

  it.effect("an end that comes first gives None only once the fiber step has stopped (its finalizer ran)", () =>
    Effect.gen(function*() {
      const { arm, state } = manualEnd()
      const stoppable = stoppableStep()
      const fiber = yield* started(raceEnd(stoppable.step, arm))
      state.fire!()
      expect(yield* Fiber.join(fiber)).toEqual(Option.none())
      expect(stoppable.state.stopped).toBe(true)
    }))

  it.effect("an end already there when armed decides at once, and its cancel still runs", () =>
    Effect.gen(function*() {
      let cancelled = 0
      const result = yield* raceEnd(Effect.never, (end) => {
        end()
        return () => {
          cancelled++
        }
      })
      expect(result).toEqual(Option.none())
      expect(cancelled).toBe(1)
    }))

  it.effect("a failing fiber step fails the race with its own error", () =>
    Effect.gen(function*() {
      const { arm, state } = manualEnd()
      const exit = yield* Effect.exit(raceEnd(Effect.fail("boom" as const), arm))
      expect(exit).toEqual(Exit.fail("boom"))
      expect(state.armed).toBe(0)
    }))

  it.effect("an interrupted caller stops the fiber step before its interrupt returns, and disarms the end", () =>
    Effect.gen(function*() {
      const { arm, state } = manualEnd()
      const stoppable = stoppableStep()
      const fiber = yield* started(raceEnd(stoppable.step, arm))
      yield* Fiber.interrupt(fiber)
      expect(stoppable.state.stopped).toBe(true)
      expect(state.armed).toBe(0)
    }))

  it.effect("a callback step that ends first wins with no fiber, its end disarmed and its own cancel run", () =>
    Effect.gen(function*() {
      const { arm, state: end } = manualEnd()
      const { state, step } = manualStep<string>()
      const fiber = yield* Effect.fork(raceEnd(step, arm))
      yield* Effect.yieldNow()
      expect(state.registered).toBe(1)
      state.done!("woken")
      expect(yield* Fiber.join(fiber)).toEqual(Option.some("woken"))
      expect(end.armed).toBe(0)
      expect(state.registered).toBe(0)
    }))

  it.effect("an end that beats a callback step cancels the step's registration", () =>
    Effect.gen(function*() {
      const { arm, state: end } = manualEnd()
      const { state, step } = manualStep<string>()
      const fiber = yield* Effect.fork(raceEnd(step, arm))
      yield* Effect.yieldNow()
      end.fire!()
      expect(yield* Fiber.join(fiber)).toEqual(Option.none())
      expect(state.registered).toBe(0)
      expect(end.armed).toBe(0)
    }))

  it.effect("a callback step already done when registered wins without arming the end", () =>
    Effect.gen(function*() {
      const { arm, state: end } = manualEnd()
      let cancelled = 0
      const step = callbackStep<number>((done) => {
        done(1)
        return () => {
          cancelled++
        }
      })
      expect(yield* raceEnd(step, arm)).toEqual(Option.some(1))
      expect(end.armed).toBe(0)
      expect(cancelled).toBe(1)
    }))

  it.effect("an interrupted caller cancels a callback step and the end", () =>
    Effect.gen(function*() {
      const { arm, state: end } = manualEnd()
      const { state, step } = manualStep<string>()
      const fiber = yield* Effect.fork(raceEnd(step, arm))
      yield* Effect.yieldNow()
      yield* Fiber.interrupt(fiber)
      expect(state.registered).toBe(0)
      expect(end.armed).toBe(0)
      // A late callback after the race is over changes nothing.
      expect(state.done).toBeUndefined()
    }))

  it.effect("a callback step run on its own (not raced) waits for its callback and cancels when interrupted", () =>
    Effect.gen(function*() {
      const { state, step } = manualStep<string>()
      const fiber = yield* Effect.fork(step)
      yield* Effect.yieldNow()
      state.done!("alone")
      expect(yield* Fiber.join(fiber)).toBe("alone")
      const second = yield* Effect.fork(step)
      yield* Effect.yieldNow()
      yield* Fiber.interrupt(second)
      expect(state.registered).toBe(1) // the first registration's callback fired; only the second was cancelled
    }))
  // Review of bfba86d: the callback path ran in the caller's region, so an uninterruptible caller
  // (a finalizer, acquireRelease's acquire) interrupted while it waited kept waiting for the step.
  it.effect("an uninterruptible caller interrupted while it waits on a callback step ends the wait, both sides cancelled", () =>
    Effect.gen(function*() {
      const { arm, state: end } = manualEnd()
      const { state, step } = manualStep<string>()
      const fiber = yield* started(Effect.uninterruptible(raceEnd(step, arm)))
      expect(state.registered).toBe(1)
      const exit = yield* Fiber.interrupt(fiber)
      expect(Exit.isInterrupted(exit)).toBe(true)
      expect(state.registered).toBe(0)
      expect(end.armed).toBe(0)
    }))

  it.effect("an uninterruptible caller interrupted while it waits on a fiber step ends the wait, the step stopped", () =>
    Effect.gen(function*() {
      const { arm, state: end } = manualEnd()
      const stoppable = stoppableStep()
      const fiber = yield* started(Effect.uninterruptible(raceEnd(stoppable.step, arm)))
      const exit = yield* Fiber.interrupt(fiber)
      expect(Exit.isInterrupted(exit)).toBe(true)
      expect(stoppable.state.stopped).toBe(true)
      expect(end.armed).toBe(0)
    }))

  it.effect("an end whose arming throws cancels the callback step's registration", () =>
    Effect.gen(function*() {
      const { state, step } = manualStep<string>()
      const exit = yield* Effect.exit(raceEnd(step, () => {
        throw new Error("arming failed")
      }))
      expect(Exit.isFailure(exit)).toBe(true)
      expect(state.registered).toBe(0)
    }))
})

/**
 * A one-shot cell for an outcome that a driver callback delivers: set once, awaited by whoever
 * still wants it (the caller, or the layer's clean-up once the caller stopped waiting). What a
 * `Deferred` does for this, without its cost on every statement: a `Deferred` costs more to make
 * than the rest of a cycle's bookkeeping.
 */
import * as Effect from "effect/Effect"
import { callbackStep } from "./raceEnd.js"

const noop = () => {}

export class Cell<A> {
  private done = false
  private value: A | undefined = undefined
  private waiters: Array<(value: A) => void> | undefined = undefined

  /** Sets the outcome (the first call wins) and hands it to every waiter. Callable from any callback. */
  readonly set = (value: A): void => {
    if (this.done) return
    this.done = true
    this.value = value
    const waiters = this.waiters
    this.waiters = undefined
    if (waiters !== undefined) for (const waiter of waiters) waiter(value)
  }

  /** The outcome when it is there. */
  readonly poll = (): A | undefined => this.value

  /**
   * Calls `done` with the outcome once it is there (at once if it is); returns the cancel, after
   * which `done` is never called. For `callbackStep`: a wait raced without a fiber. A cancelled
   * registration stays in the list (ignored) until the cell is set or dropped: fine for the
   * one-shot cells it serves (a statement's outcome, a ticket, a claim), not for a long-lived
   * cell registered again and again.
   */
  readonly register = (done: (value: A) => void): () => void => {
    if (this.done) {
      done(this.value as A)
      return noop
    }
    let live = true
    ;(this.waiters ??= []).push((value: A) => {
      if (live) done(value)
    })
    return () => {
      live = false
    }
  }

  /** The outcome as a callback step (`raceEnd`): a wait raced with its deadline without a fiber. */
  get step(): Effect.Effect<A> {
    return callbackStep(this.register)
  }

  /**
   * The outcome, once it is there. Interrupting the wait only stops this waiter: its callback
   * stays until the cell is set and is then ignored by the fiber (an `Effect.async` with no
   * canceler costs the runtime no interruption handler: this is on every statement's path).
   *
   * A getter, not a field: built when read, not with every cell (most are read once). Once set,
   * the outcome never changes, so `succeed` is right whenever it runs; otherwise the `async`
   * checks again each time it runs.
   */
  get await(): Effect.Effect<A> {
    return this.done ? Effect.succeed(this.value as A) : Effect.async<A>((resume) => {
      // Set since the effect was built (or between two of the fiber's steps).
      if (this.done) return resume(Effect.succeed(this.value as A))
      ;(this.waiters ??= []).push((value: A) => resume(Effect.succeed(value)))
    })
  }
}

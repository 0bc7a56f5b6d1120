import * as Clock from "effect/Clock"
import * as Context from "effect/Context"
import * as DefaultServices from "effect/DefaultServices"
import * as Effect from "effect/Effect"
import type * as Fiber from "effect/Fiber"
import type * as FiberId from "effect/FiberId"
import * as RuntimeFlags from "effect/RuntimeFlags"
import * as RuntimeFlagsPatch from "effect/RuntimeFlagsPatch"
import * as Supervisor from "effect/Supervisor"
import type { Grant } from "../../LockBackend.js"
import { clockMillis } from "./clock.js"
import { type Held, safetyDeadline } from "./registry.js"
import { boundHelper } from "../runtime/stallSafe.js"

/** Effect's live Clock: its monotonic time can be read as `performance.now()` plus a fixed offset. */
const liveClock = Context.get(DefaultServices.liveServices, Clock.Clock)

/**
 * Watches the fibers of a guarded body (the body and every fiber it forks) before every step
 * they take: when a lease with a deadline is watched, the body runs with Effect's op supervision
 * on (`watchSteps`), so the runtime calls `onEffect` before each operation; it also checks each
 * time one of them resumes.
 *
 * Why: after an event-loop stall (a GC pause, a throttled container), Node runs whatever timers
 * and I/O are due in whatever order; the renewal loop's deadline timer is only one of them, so
 * a body could run several more steps on a lease whose safe time passed during the stall — and a
 * body that stalled inside its own synchronous work would run on, without resuming, for up to the
 * runtime's yield budget (2,048 operations). Here, the first step of a body fiber past the
 * lease's safety deadline declares the loss on the spot and is interrupted; the interrupt sits in
 * its mailbox, which the runtime drains right after `onEffect`, before it runs that step.
 * A fiber stepping after the loss was declared (by anyone) is interrupted the same way.
 *
 * Cost: a field read and a `performance.now()` per operation of a watched body (TestClock: a
 * clock read), measured in bench/README.md; nothing for fibers outside guarded bodies.
 */
export class StallWatch extends Supervisor.AbstractSupervisor<void> {
  /** Cleared when the guard is done: fibers the body left behind are not the guard's business. */
  active = true
  readonly value: Effect.Effect<void> = Effect.void
  /** The watched clock's monotonic millis, read without allocating on the live clock. */
  private readonly now: () => number
  /** Fibers this watch interrupted: interrupted once, not at every later step of their finalizers. */
  private readonly stopped = new WeakSet<Fiber.RuntimeFiber<unknown, unknown>>()

  constructor(
    private readonly held: Held<Grant>,
    /** The guard's fiber: the interrupts are sent in its name. */
    private readonly interruptor: FiberId.FiberId,
    /** The guard's Clock (TestClock in tests), read once rather than looked up per step. */
    clock: Clock.Clock
  ) {
    super()
    if (clock === liveClock) {
      // Both are the process's monotonic clock: one offset, read once, maps one onto the other.
      const offset = clockMillis(clock) - performance.now()
      this.now = () => performance.now() + offset
    } else {
      this.now = () => clockMillis(clock)
    }
  }

  override onEffect<A, E>(fiber: Fiber.RuntimeFiber<A, E>): void {
    this.check(fiber)
  }

  override onResume<A, E>(fiber: Fiber.RuntimeFiber<A, E>): void {
    this.check(fiber)
  }

  private check(fiber: Fiber.RuntimeFiber<unknown, unknown>): void {
    if (!this.active) return
    const held = this.held
    // The common case first: held, and inside its safe time (or with no deadline).
    if (held.state === "held" && (held.validUntil === undefined || this.now() < safetyDeadline(held))) return
    if (held.state === "released") return
    // The guard's own fiber carries the watch only while it forks the body; it is never stopped.
    // A bound's own race fibers: their parent in the body is checked when the race ends.
    if (fiber.id() === this.interruptor || fiber.getFiberRef(boundHelper) || this.stopped.has(fiber)) return
    try {
      if (held.state === "held") held.sink.declareLostNow(held, "renewal-failed")
    } catch {
      // Never throw into the runtime (it would stall the fiber's scheduler); stop the body instead.
    }
    // A lost lease's body does no more work: interrupted before its next step.
    this.stopped.add(fiber)
    fiber.unsafeInterruptAsFork(this.interruptor)
  }
}

/**
 * `self` with every step checked by the fibers' supervisor (`StallWatch.onEffect`); fibers it
 * forks inherit the flag.
 */
export const watchSteps = <A, E, R>(self: Effect.Effect<A, E, R>): Effect.Effect<A, E, R> =>
  Effect.withRuntimeFlagsPatch(self, RuntimeFlagsPatch.enable(RuntimeFlags.OpSupervision))

import type * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import type * as Fiber from "effect/Fiber"
import type * as FiberId from "effect/FiberId"
import * as Supervisor from "effect/Supervisor"
import type { Grant } from "../../LockBackend.js"
import { clockMillis } from "./clock.js"
import { type Held, safetyDeadline } from "./registry.js"
import { boundHelper } from "../runtime/stallSafe.js"

/**
 * Watches the fibers of a guarded body (the body and every fiber it forks): each time one of
 * them resumes, it checks the lease before the fiber runs its next step.
 *
 * Why: after an event-loop stall (a GC pause, a throttled container), Node runs whatever timers
 * and I/O are due in whatever order; the renewal loop's deadline timer is only one of them, so
 * a body could run several more steps on a lease whose safe time passed during the stall. Here,
 * a fiber resuming past the lease's safety deadline declares the loss on the spot and is
 * interrupted; the interrupt sits in its mailbox, which the runtime drains before the next op.
 * A fiber resuming after the loss was declared (by anyone) is interrupted the same way.
 *
 * Cost: a few field reads per resumption, plus a clock read for leases with a deadline; measured
 * at 0.15–0.25 µs per resumption of a body fiber (a `yieldNow` round trip is ~0.9 µs).
 */
export class StallWatch extends Supervisor.AbstractSupervisor<void> {
  /** Cleared when the guard is done: fibers the body left behind are not the guard's business. */
  active = true
  readonly value: Effect.Effect<void> = Effect.void

  constructor(
    private readonly held: Held<Grant>,
    /** The guard's fiber: the interrupts are sent in its name. */
    private readonly interruptor: FiberId.FiberId,
    /** The guard's Clock (TestClock in tests), read once rather than looked up per resumption. */
    private readonly clock: Clock.Clock
  ) {
    super()
  }

  override onResume<A, E>(fiber: Fiber.RuntimeFiber<A, E>): void {
    // The guard's own fiber carries the watch only while it forks the body; it is never stopped.
    if (!this.active || fiber.id() === this.interruptor) return
    // A bound's own race fibers: their parent in the body is checked when the race ends.
    if (fiber.getFiberRef(boundHelper)) return
    const held = this.held
    try {
      if (held.state === "held") {
        if (held.validUntil === undefined || clockMillis(this.clock) < safetyDeadline(held)) return
        held.sink.declareLostNow(held, "renewal-failed")
      }
    } catch {
      // Never throw into the runtime (it would stall the fiber's scheduler); stop the body instead.
      fiber.unsafeInterruptAsFork(this.interruptor)
      return
    }
    // A lost lease's body does no more work: interrupted before its next step.
    if (held.state === "lost") fiber.unsafeInterruptAsFork(this.interruptor)
  }
}

/**
 * The guard of a held lease: the body runs in a fiber of its own, watched for stalls past the
 * lease's safe time and interrupted the moment the lease is lost; it has fully stopped (its
 * finalizers included) before the guard returns, so the release that follows never overlaps it.
 * `DistributedLock.guard`, `withLock` and `DistributedSemaphore.withPermits` use it.
 */
import * as Cause from "effect/Cause"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import type { Lease } from "../../Lease.js"
import type { LockLost } from "../../LockError.js"
import { clockOf } from "./clock.js"
import { addBody, heldOf } from "./registry.js"
import { StallWatch, watchSteps } from "./stallWatch.js"

/** Runs `self` while `lease` is held (documented on `DistributedLock.guard`). */
export const guard = <A, E, R>(lease: Lease, self: Effect.Effect<A, E, R>): Effect.Effect<A, E | LockLost, R> =>
  Effect.uninterruptibleMask((restore) =>
    Effect.withFiberRuntime<A, E | LockLost, R>((parent) => {
      const held = heldOf(lease)
      // A lease already known lost never starts the body.
      if (held?.lostError !== undefined) return Effect.fail(held.lostError)
      // The body and everything it forks are checked before each step: after a stall past the
      // lease's safe time, the loss is declared and they stop before their next step.
      const watch = held === undefined ? undefined : new StallWatch(held, parent.id(), clockOf(parent))
      // A lease with a deadline is checked before every step too: a stall inside the body's own
      // synchronous work is caught at its next operation, not at its next resumption.
      const fork = Effect.fork(restore(held?.validUntil === undefined ? self : watchSteps(self)))
      return Effect.gen(function*() {
        const body = yield* (watch === undefined ? fork : Effect.supervised(fork, watch))
        // A shutdown waits for the body to stop before it gives the lease back.
        if (held !== undefined) addBody(held, body)
        let lostWith: LockLost | undefined
        // The body is interrupted and awaited here, so it stops before anyone releases.
        // Interruptible whatever the caller's region: it only waits for the loss, and guard ends it
        // after the body; forked uninterruptible (a caller in a finalizer) it could not be ended.
        const watcher = yield* Effect.fork(
          Effect.interruptible(Effect.catchAll(lease.lost, (error) => {
            lostWith = error
            return Fiber.interrupt(body)
          }))
        )
        const exit = yield* restore(Fiber.await(body)).pipe(
          // The caller was interrupted: stop the body and wait until it has stopped.
          Effect.onInterrupt(() => Effect.zipRight(Fiber.interrupt(body), Fiber.interrupt(watcher)))
        )
        if (watch !== undefined) watch.active = false
        yield* Fiber.interrupt(watcher)
        if (Exit.isFailure(exit) && Cause.isInterruptedOnly(exit.cause)) {
          // Whoever interrupted the body (the watcher, or the body's own fibers on resuming after
          // the loss), a body stopped by a lost lease ends in LockLost, never a bare interruption.
          const lost = held?.lostError ?? lostWith
          if (lost !== undefined) return yield* Effect.fail(lost)
        }
        return yield* exit
      })
    })
  )

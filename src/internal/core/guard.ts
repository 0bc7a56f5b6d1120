/**
 * The guard of a held lease: the body runs in a fiber of its own, watched for stalls past the
 * lease's safe time and interrupted the moment the lease is lost; it has fully stopped (its
 * finalizers included) before the guard returns, so the release that follows never overlaps it.
 * `DistributedLock.guard`, `withLock` and `DistributedSemaphore.withPermits` use it.
 */
import * as Cause from "effect/Cause"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Context from "effect/Context"
import * as Fiber from "effect/Fiber"
import * as FiberRef from "effect/FiberRef"
import * as Scope from "effect/Scope"
import type { Lease } from "../../Lease.js"
import type { LockLost } from "../../LockError.js"
import { clockOf } from "./clock.js"
import { addBody, type Held, heldOf, whenLost } from "./registry.js"
import type { Grant } from "../../LockBackend.js"
import { StallWatch, watchSteps } from "./stallWatch.js"

/** Runs `self` while `lease` is held (documented on `DistributedLock.guard`). */
export const guard = <A, E, R>(
  lease: Lease,
  self: Effect.Effect<A, E, R>,
  /** The Scope the body sees (`withLock`'s own, as under `Effect.scoped`); the caller's when `undefined`. */
  scope?: Scope.Scope
): Effect.Effect<A, E | LockLost, R> =>
  Effect.uninterruptibleMask((restore) =>
    Effect.withFiberRuntime<A, E | LockLost, R>((parent) => {
      const held = heldOf(lease)
      // A lease already known lost never starts the body.
      if (held?.lostError !== undefined) return Effect.fail(held.lostError)
      // Nor one already given back (its scope closed): the body would run without the lock.
      if (held?.state === "released") return Effect.die(releasedError(held))
      // The body and everything it forks are checked before each step: after a stall past the
      // lease's safe time, the loss is declared and they stop before their next step.
      const watch = held === undefined ? undefined : new StallWatch(held, parent.id(), clockOf(parent))
      // A lease with a deadline is checked before every step too: a stall inside the body's own
      // synchronous work is caught at its next operation, not at its next resumption.
      // The body is the caller's own work: forked from the caller's fiber on purpose, with its
      // FiberRefs, supervisor and interruptibility; the guard interrupts and awaits it before returning.
      const fork = Effect.fork(restore(Effect.zipRight(
        held === undefined ? bodyRefs(scope, watch) : bodyStart(held, bodyRefs(scope, watch)),
        held?.validUntil === undefined ? self : watchSteps(self)
      )))
      if (held === undefined) return handMade(lease, fork, restore)
      return Effect.flatMap(fork, (body) => {
        // The body is interrupted in the step that marks the loss (no fiber waits for it), or here
        // at once when that step came first, and awaited here, so it stops before anyone releases.
        const cancel = whenLost(held, () => body.unsafeInterruptAsFork(parent.id()))
        // Fibers the body left behind are not the guard's business once it is done.
        const done = () => {
          watch!.active = false
          cancel()
        }
        return Effect.flatMap(
          restore(Fiber.await(body)).pipe(
            // The caller was interrupted: stop the body and wait until it has stopped.
            Effect.onInterrupt(() => Effect.zipRight(Fiber.interrupt(body), Effect.sync(done)))
          ),
          (exit) => {
            done()
            return outcome(exit, held.lostError)
          }
        )
      })
    })
  )

/**
 * `guard` of a lease this library did not make: a fiber waits for its loss, interruptible whatever
 * the caller's region (it only waits for the loss, and guard ends it after the body).
 */
const handMade = <A, E, R>(
  lease: Lease,
  fork: Effect.Effect<Fiber.RuntimeFiber<A, E>, never, R>,
  restore: <X, Y, Z>(self: Effect.Effect<X, Y, Z>) => Effect.Effect<X, Y, Z>
): Effect.Effect<A, E | LockLost, R> =>
  Effect.gen(function*() {
    const body = yield* fork
    let lostWith: LockLost | undefined
    // Part of this call, not background work: a child of the guard's fiber, interrupted and
    // awaited by it below whatever happens.
    const watcher = yield* Effect.fork(
      Effect.interruptible(Effect.catchAll(lease.lost, (error) => {
        lostWith = error
        return Fiber.interrupt(body)
      }))
    )
    const exit = yield* restore(Fiber.await(body)).pipe(
      Effect.onInterrupt(() => Effect.zipRight(Fiber.interrupt(body), Fiber.interrupt(watcher)))
    )
    yield* Fiber.interrupt(watcher)
    return yield* outcome(exit, lostWith)
  })

/**
 * The body's exit as the guard's: whoever interrupted the body (the loss, a stall watch, or the
 * body's own fibers on resuming after the loss), a body stopped by a lost lease ends in LockLost,
 * never a bare interruption.
 */
const outcome = <A, E>(exit: Exit.Exit<A, E>, lost: LockLost | undefined): Effect.Effect<A, E | LockLost> =>
  lost !== undefined && Exit.isFailure(exit) && Cause.isInterruptedOnly(exit.cause) ? Effect.fail(lost) : exit

/**
 * The body fiber's very first step, before any of its own: it registers with the lease, so that a
 * shutdown waits for it before giving the lease back, or, when the loss (a shutdown's included)
 * was marked before it, it never starts. Done here, not by the guard after the fork, because the
 * guard's fiber may yield between the two: a close that ran there found no body to wait for and
 * gave the lease back while the body went on to run.
 */
const bodyStart = (held: Held<Grant>, then: Effect.Effect<void>): Effect.Effect<void> =>
  Effect.withFiberRuntime((body) => {
    // Marked before this step: whoever marked it found no body here to wait for.
    if (held.lostError !== undefined) return Effect.interrupt
    // Given back meanwhile (a guard forked off and its lease's scope closed): never run unlocked.
    if (held.state === "released") return Effect.die(releasedError(held))
    addBody(held, body)
    return then
  })

/** `guard` of a lease whose release has begun: a programming error (the lease's scope closed before the guard ran). */
const releasedError = (held: Held<Grant>) =>
  new Cause.IllegalArgumentException(
    `effect-lock: guard on the lease of "${held.name}" (fencing token ${held.grant.token}) after it was released: ` +
      "its scope closed before the guarded work started; run the work inside that scope (or use withLock)"
  )

/**
 * The body fiber's first step after `bodyStart` (its very first under a hand-made lease): it sees `scope` as its Scope and carries `watch` (with the
 * supervisor it inherited). Set in the body's own fiber, which ends with the body, so nothing is
 * restored: a context or supervisor changed around the fork (`provideService`, `supervised`) costs
 * a get, a set and a restore on the guard's fiber, about 5 µs of CPU each per call.
 */
const bodyRefs = (scope: Scope.Scope | undefined, watch: StallWatch | undefined): Effect.Effect<void> => {
  const context = scope === undefined
    ? Effect.void
    : FiberRef.update(FiberRef.currentContext, (context) => Context.add(context, Scope.Scope, scope) as Context.Context<never>)
  return watch === undefined ? context : Effect.zipRight(context, FiberRef.update(FiberRef.currentSupervisor, (s) => s.zip(watch)))
}

/**
 * The runtime a backend layer owns for the work it does on its own behalf: statements in flight,
 * give-backs, session openers, loss reports, listeners, the clean-up of an interrupted wait, the
 * release of a lease.
 *
 * Why: a fiber forked from the caller's fiber (`fork`, `forkIn`, `forkDaemon` alike) inherits the
 * caller's FiberRefs — its supervisor among them. A guarded body's stall watch is such a
 * supervisor: once the body's lease is lost it interrupts every fiber it watches on its next
 * resume, so a give-back, an attempt or a session opener started from inside that body would be
 * stopped half-way, leaving a lock held that nobody holds. A caller's transaction travels the same
 * way (a statement sent from a forked fiber would join it). Fibers started here begin from the
 * runtime captured when the layer was built — no supervisor, no transaction, no caller — and are
 * interrupted only when the layer's scope closes, after its own finalizers have given back what
 * they must.
 */
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import type * as Exit from "effect/Exit"
import type * as Fiber from "effect/Fiber"
import * as FiberRef from "effect/FiberRef"
import * as Option from "effect/Option"
import * as Runtime from "effect/Runtime"
import type * as Scope from "effect/Scope"
import * as Supervisor from "effect/Supervisor"
import { TransactionConnectionTag } from "../sql/tags.js"


/**
 * Runs `self` outside any transaction of the caller. @effect/sql sends a statement on the
 * connection found under its `TransactionConnection` tag: a lock statement run inside the user's
 * `sql.withTransaction` would join that transaction — a rollback would undo a grant's token bump,
 * `now()` would be the transaction's start, and the uncommitted row would block and hide from
 * everyone else. Without the tag, @effect/sql takes a fresh pool connection per statement.
 */
export const outsideTransaction = <A, E, R>(self: Effect.Effect<A, E, R>): Effect.Effect<A, E, R> =>
  Effect.contextWithEffect((context: Context.Context<R>) =>
    context.unsafeMap.has(TransactionConnectionTag.key)
      // Replaces the context (`Effect.provide` would merge it into the current one, tag included).
      ? Effect.mapInputContext(self, (current: Context.Context<R>) => Context.omit(TransactionConnectionTag)(current) as Context.Context<R>)
      : self
  )

export interface Owner {
  /** Starts `self` as a fiber of the layer, at once; it is interrupted when the layer closes. */
  readonly unsafeFork: <A, E>(self: Effect.Effect<A, E>) => Fiber.RuntimeFiber<A, E>
  /** `unsafeFork` as an Effect. */
  readonly fork: <A, E>(self: Effect.Effect<A, E>) => Effect.Effect<Fiber.RuntimeFiber<A, E>>
  /**
   * Runs `self` as a fiber of the layer and waits for its outcome. Interrupting the caller stops
   * the wait, never `self`: work the layer started finishes whatever happens to who asked for it.
   */
  readonly run: <A, E>(self: Effect.Effect<A, E>) => Effect.Effect<A, E>
}

/**
 * How long closing the layer waits for its fibers to stop once interrupted: a fiber that holds
 * interruption off (a release stuck in an uninterruptible step) must not hold the close forever.
 */
const CLOSE_WAIT_MS = 2_000

/** The owner of the background work of the layer whose scope this runs in. */
export const make: Effect.Effect<Owner, never, Scope.Scope> = Effect.gen(function*() {
  const runtime = yield* Effect.runtime<never>().pipe(
    // Captured without the builder's supervisor (a layer built inside a guarded body would hand
    // its stall watch on) and without its transaction.
    Effect.locally(FiberRef.currentSupervisor, Supervisor.none),
    outsideTransaction
  )
  const runFork = Runtime.runFork(runtime)
  const fibers = new Set<Fiber.RuntimeFiber<unknown, unknown>>()
  let closed = false
  yield* Effect.addFinalizer(() =>
    Effect.withFiberRuntime((closer) => {
      closed = true
      const running = Array.from(fibers)
      for (const fiber of running) fiber.unsafeInterruptAsFork(closer.id())
      return Effect.asVoid(awaitAll(running, CLOSE_WAIT_MS))
    })
  )
  // Interruptible whatever the builder's region was: the layer's close must be able to stop it.
  const unsafeFork = <A, E>(self: Effect.Effect<A, E>): Fiber.RuntimeFiber<A, E> => {
    // A layer that has closed starts nothing more: the fiber is born interrupted.
    const fiber = runFork(closed ? Effect.interrupt : Effect.interruptible(self))
    fibers.add(fiber)
    fiber.addObserver(() => fibers.delete(fiber))
    return fiber
  }
  const fork = <A, E>(self: Effect.Effect<A, E>) => Effect.sync(() => unsafeFork(self))
  // Awaited, not joined: joining would copy the layer fiber's FiberRefs into the caller.
  const run = <A, E>(self: Effect.Effect<A, E>) =>
    Effect.flatMap(fork(self), (fiber) => Effect.flatten(awaitFiber(fiber)))
  return { unsafeFork, fork, run }
})

/** Waits for `fibers` to end, `millis` in all (stall-safe, forking nothing); true when they all did. */
export const awaitAll = (
  fibers: ReadonlyArray<Fiber.RuntimeFiber<unknown, unknown>>,
  millis: number
): Effect.Effect<boolean> =>
  Effect.suspend(() => {
    const until = performance.now() + millis
    const next = (i: number): Effect.Effect<boolean> =>
      i >= fibers.length
        ? Effect.succeed(true)
        : Effect.flatMap(
          awaitWithin(fibers[i]!, Math.max(0, until - performance.now())),
          (done) => (Option.isSome(done) ? next(i + 1) : Effect.succeed(false))
        )
    return next(0)
  })

/**
 * The exit of `fiber`, waited for without a fiber of the caller's: a caller inside a guarded body
 * (whose stall watch interrupts the body's fibers) or in a finalizer waits here undisturbed.
 */
export const awaitFiber = <A, E>(fiber: Fiber.RuntimeFiber<A, E>): Effect.Effect<Exit.Exit<A, E>> =>
  Effect.async<Exit.Exit<A, E>>((resume) => {
    const observer = (exit: Exit.Exit<A, E>) => resume(Effect.succeed(exit))
    fiber.addObserver(observer)
    return Effect.sync(() => fiber.removeObserver(observer))
  })

/**
 * The exit of `fiber`, or `None` when it has not ended `millis` after this started *and* after
 * the event loop has read the I/O that was ready when the timer fired (stall-safe, as
 * `stallSafe.timeoutOption`). Never waits for `fiber` past the bound, whatever it does — an
 * uninterruptible step in it included — and forks nothing: a timer and an observer.
 */
export const awaitWithin = <A, E>(
  fiber: Fiber.RuntimeFiber<A, E>,
  millis: number
): Effect.Effect<Option.Option<Exit.Exit<A, E>>> =>
  Effect.async<Option.Option<Exit.Exit<A, E>>>((resume) => {
    let settled = false
    const observer = (exit: Exit.Exit<A, E>) => {
      if (settled) return
      settled = true
      clearTimeout(timer)
      resume(Effect.succeed(Option.some(exit)))
    }
    // Two hops through the check phase after the timer: answers already received are read first.
    const timer = setTimeout(() =>
      setImmediate(() =>
        setImmediate(() => {
          if (settled) return
          settled = true
          fiber.removeObserver(observer)
          resume(Effect.succeed(Option.none()))
        })
      ), Math.max(0, millis))
    fiber.addObserver(observer)
    return Effect.sync(() => {
      settled = true
      clearTimeout(timer)
      fiber.removeObserver(observer)
    })
  })

import * as Cause from "effect/Cause"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as FiberId from "effect/FiberId"
import * as FiberSet from "effect/FiberSet"
import * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import type { HeldLock, Lease, LockMode } from "../../Lease.js"
import type { Grant, LockBackend, RenewOutcome } from "../../LockBackend.js"
import { LockLost, type LostReason } from "../../LockError.js"
import { stallSafeTimer, timeoutOption, within } from "../runtime/stallSafe.js"
import { clockOf, fiberMillis, monotonicMillis, sleepMillis, wholeMillis } from "./clock.js"
import { makeLoopAlarm } from "./loopAlarm.js"
import * as metrics from "./metrics.js"
import * as Owner from "../runtime/owner.js"
import { isTraced } from "./tracing.js"

/** Renewals fire once a third of the lease has passed since the last good renewal. */
const RENEW_FRACTION = 1 / 3
/** A lease is given up when less than this fraction of its ttl is left without a renewal. */
export const SAFETY_FRACTION = 1 / 5
/** Leases falling due within this fraction of their ttl join the current batch. */
const COALESCE_FRACTION = 1 / 12
/** Renewal batches in flight at once (each is one backend call, e.g. one statement). */
const RENEW_CONCURRENCY = 4
/** After a failed renewal, try again after this fraction of the ttl (sooner near the store's expiry, below). */
const RETRY_FRACTION = 1 / 10
/**
 * Near the store's expiry a failed renewal is retried after this fraction of the time left, at
 * least `RETRY_MIN_MS`: the last stretch before the store lets a lease go (a draining lease's
 * whole chance, `close`) is where a store that recovered still saves it, and one retry every
 * ttl/10 could miss all of it.
 */
const RETRY_LEFT_FRACTION = 1 / 4
const RETRY_MIN_MS = 25
/** Longest pause of the renewal loop after a defect before it restarts (it restarts at once the first time). */
const RESTART_PAUSE_MAX_MS = 1_000
/**
 * How long closing the service waits for guarded bodies to stop after they were interrupted; a
 * body still running then (it holds interruption off) has its lock given back all the same,
 * logged, so that a shutdown ends.
 */
const SHUTDOWN_BODY_WAIT_MS = 10_000
/** How long closing the service waits for acquisitions in flight to settle (each is bounded by its backend). */
const SHUTDOWN_TAKE_WAIT_MS = 10_000
/** Slack of a caller's wait for a release over the release's own bounds. */
const RELEASE_GRACE_MS = 1_000

/** The moment (monotonic ms) a lease valid until `validUntil` must be given up. */
export const safetyDeadlineOf = (validUntil: number | undefined, ttlMillis: number): number =>
  validUntil === undefined ? Number.POSITIVE_INFINITY : validUntil - ttlMillis * SAFETY_FRACTION

const nextRenewAt = (validUntil: number, ttlMillis: number): number =>
  validUntil - ttlMillis + ttlMillis * RENEW_FRACTION

/** When a lease whose renewal failed at `at` is tried again: ttl/10 later, sooner near its expiry. */
const retryAt = (held: { readonly validUntil?: number | undefined; readonly ttlMillis: number }, at: number): number => {
  const left = held.validUntil === undefined ? Number.POSITIVE_INFINITY : held.validUntil - at
  return at + Math.max(RETRY_MIN_MS, Math.min(held.ttlMillis * RETRY_FRACTION, left * RETRY_LEFT_FRACTION))
}

/** Where a loss found synchronously (by `StallWatch`) is declared. */
export interface LossSink {
  declareLostNow(held: Held<Grant>, reason: LostReason): void
}

/** One lease this process holds, with what the renewal loop needs to keep it. */
export class Held<G extends Grant> {
  state: "held" | "lost" | "released" = "held"
  /** Set once the release started (by the lease's scope or by the service closing). */
  releasing = false
  renewAt: number
  /** Set while a renewal covering this lease is queued or in flight; release waits for it. */
  renewing: Deferred.Deferred<void> | undefined = undefined
  /** The loss, once known. */
  lostError: LockLost | undefined = undefined
  /** Completed with the loss; made only when someone waits on `lease.lost`. */
  signal: Deferred.Deferred<never, LockLost> | undefined = undefined
  /** Called once with the loss, in the step that marks it (`whenLost`: a guard stopping its body without a fiber). */
  onLost: Set<(error: LockLost) => void> | undefined = undefined
  /** The guarded bodies running under this lease (`guard`), awaited before a shutdown gives it back. */
  bodies: Set<Fiber.RuntimeFiber<unknown, unknown>> | undefined = undefined
  constructor(
    readonly id: number,
    readonly name: string,
    readonly mode: LockMode,
    readonly grant: G,
    readonly ttlMillis: number,
    /** Wall-clock time of the grant, for `inspect`; deadlines use the monotonic timeline. */
    readonly since: number,
    public validUntil: number | undefined,
    /** The metric labels of the acquiring fiber: the held gauge goes down where it went up. */
    readonly labels: metrics.Labels,
    /** The owning registry, for losses declared from inside the runtime (shared, not per lease). */
    readonly sink: LossSink
  ) {
    this.renewAt = validUntil === undefined ? Number.POSITIVE_INFINITY : nextRenewAt(validUntil, ttlMillis)
  }
}

/** The moment (monotonic ms) `held` must be given up. */
export const safetyDeadline = (held: { readonly validUntil: number | undefined; readonly ttlMillis: number }): number => safetyDeadlineOf(held.validUntil, held.ttlMillis)

/**
 * Calls `f` with the loss of `held` once it is marked (at once if it is already), in the step that
 * marks it: no fiber waits for it. Returns the cancel.
 */
export const whenLost = (held: Held<Grant>, f: (error: LockLost) => void): () => void => {
  if (held.lostError !== undefined) {
    f(held.lostError)
    return () => {}
  }
  const callbacks = (held.onLost ??= new Set())
  callbacks.add(f)
  return () => callbacks.delete(f)
}

/** Records a guarded body of `held` until it ends: a shutdown waits for it before giving the lease back. */
export const addBody = (held: Held<Grant>, body: Fiber.RuntimeFiber<unknown, unknown>): void => {
  const bodies = (held.bodies ??= new Set())
  bodies.add(body)
  body.addObserver(() => bodies.delete(body))
}

/** Where a lease handed out by a registry keeps its `Held` (so `guard` can read it synchronously). */
const HeldKey: unique symbol = Symbol.for("effect-lock/internal/Held")

/** The `Held` behind `lease`, when a registry made it (a hand-made `Lease` has none). */
export const heldOf = (lease: Lease): Held<Grant> | undefined =>
  (lease as Lease & { readonly [HeldKey]?: Held<Grant> })[HeldKey]

/** The loss of `lease` if it is already known, without waiting. */
export const lostOf = (lease: Lease): Option.Option<LockLost> =>
  Option.fromNullable(heldOf(lease)?.lostError)

const lostSignal = (held: Held<Grant>): Deferred.Deferred<never, LockLost> => {
  if (held.signal === undefined) held.signal = Deferred.unsafeMake<never, LockLost>(FiberId.none)
  return held.signal
}

/**
 * The leases of one `DistributedLock` and the single background loop that keeps them: it gives
 * up leases at their safety deadline and renews due leases in batches, the backend calls running
 * in their own fibers so that one slow call never delays another lease's loss.
 */
export interface Registry<G extends Grant> {
  /**
   * Records a grant as held, synchronously: called in the same step as the checks that decided
   * to hand it out, so no loss report can fall between them.
   */
  readonly register: (
    fiber: Fiber.RuntimeFiber<unknown, unknown>,
    input: { readonly name: string; readonly mode: LockMode; readonly grant: G; readonly ttlMillis: number }
  ) => Held<G>
  readonly declareLost: (held: Held<G>, reason: LostReason) => Effect.Effect<void>
  /**
   * Declares the loss synchronously from inside the runtime (a guarded fiber resuming after a
   * stall past the safety deadline); the log line follows from the renewal loop.
   */
  readonly declareLostNow: (held: Held<G>, reason: LostReason) => void
  readonly release: (held: Held<G>) => Effect.Effect<void>
  /** Gives back a grant that was never handed out (it arrived too late to be safe). */
  readonly discard: (name: string, grant: G) => Effect.Effect<void>
  readonly toLease: (held: Held<G>) => Lease
  readonly snapshot: Effect.Effect<ReadonlyArray<HeldLock>>
  /** True once the service is closing: no new grants are handed out. */
  readonly isClosed: () => boolean
  /**
   * Calls `listener` when the service starts closing (at once if it has): waits of acquisitions
   * in flight end then. Returns the unsubscribe. A callback, not an Effect to race: it is armed
   * on every wait of every acquisition.
   */
  readonly whenClosing: (listener: () => void) => () => void
  /**
   * Runs an acquisition uninterruptibly (`restore` gives back the caller's interruptibility to the
   * steps that may be interrupted), counted in flight until it ends: closing waits for it to settle
   * (its grant handed out or given back) before the backend's connections close.
   */
  readonly taking: <A, E, R>(
    self: (restore: <X, Y, Z>(step: Effect.Effect<X, Y, Z>) => Effect.Effect<X, Y, Z>) => Effect.Effect<A, E, R>
  ) => Effect.Effect<A, E, R>
  /**
   * The ordered shutdown: refuses new grants and ends waits; tells every holder `shutdown`, which
   * interrupts its guarded bodies, and waits for them to stop (bounded); waits for acquisitions
   * in flight to settle (bounded); then gives every lease back and waits for the give-backs.
   */
  readonly close: Effect.Effect<void>
}

export const makeRegistry = <G extends Grant>(
  // Everything of the store but its `acquire`, which the acquire path calls itself.
  backend: Omit<LockBackend<G>, "acquire">,
  options: { readonly releaseTimeout: Duration.Duration }
): Effect.Effect<Registry<G>, never, Scope.Scope> =>
  Effect.gen(function*() {
    const leases = new Map<number, Held<G>>()
    // Releases run as the layer's work, never on the caller's fiber: a caller interrupted (or a
    // body's stall watch firing) while a release is under way must not cut it off.
    const owner = yield* Owner.make
    const renewals = yield* FiberSet.make<void>()
    const alarm = yield* makeLoopAlarm(owner.unsafeFork)
    const baseLabels = metrics.backendLabels(backend.backend)
    const releaseTimeoutMillis = Duration.toMillis(options.releaseTimeout)
    /** Renewal calls in flight; due leases wait for a free slot and then go in one batch. */
    let inFlight = 0
    let closed = false
    const closingListeners = new Set<() => void>()
    /** Acquisitions in flight, and the signal closing waits on for them to settle. */
    let takes = 0
    const takesSettled = Deferred.unsafeMake<void>(FiberId.none)
    /** Releases under way on the owner's runtime: closing waits for them before connections close. */
    const releasing = new Set<Fiber.RuntimeFiber<void>>()
    let nextId = 0
    /**
     * Leases of a closing service whose holders were told `shutdown` and that are not given back
     * yet: still renewed, so that the store keeps them while their guarded bodies stop.
     */
    const draining = new Set<Held<G>>()
    /** Whether the renewal loop keeps `held` alive: held, or told `shutdown` and not given back yet. */
    const kept = (held: Held<G>): boolean => held.state === "held" || draining.has(held)
    /** Losses declared synchronously (`declareLostNow`) whose log line the loop still owes. */
    const unreported: Array<{ readonly held: Held<G>; readonly error: LockLost }> = []

    /** Marks the loss and tells the holder; synchronous, so nothing runs between check and mark. */
    const markLost = (held: Held<G>, reason: LostReason): LockLost | undefined => {
      if (held.state !== "held") return undefined
      held.state = "lost"
      leases.delete(held.id)
      const error = new LockLost({ name: held.name, token: held.grant.token, reason })
      held.lostError = error
      metrics.unsafe.lost(held.labels, reason)
      metrics.unsafe.held(held.labels, -1)
      if (held.signal !== undefined) Deferred.unsafeDone(held.signal, Exit.fail(error))
      if (held.onLost !== undefined) {
        for (const f of held.onLost) {
          try {
            f(error)
          } catch {
            // A callback never stops the others, nor the marking (a stall watch's loss still gets its log line).
          }
        }
      }
      return error
    }

    const reportLost = (held: Held<G>, error: LockLost): Effect.Effect<void> =>
      Effect.withFiberRuntime((fiber) => {
        const log = Effect.logWarning(error.message).pipe(
          Effect.annotateLogs({ "lock.name": held.name, "lock.token": String(held.grant.token), reason: error.reason })
        )
        return isTraced(fiber)
          ? Effect.withSpan(log, "effect-lock.lost", {
            captureStackTrace: false,
            attributes: {
              "lock.name": held.name,
              "lock.token": String(held.grant.token),
              "lock.backend": backend.backend,
              "lock.reason": error.reason
            }
          })
          : log
      })

    const declareLost = (held: Held<G>, reason: LostReason): Effect.Effect<void> =>
      Effect.suspend(() => {
        const error = markLost(held, reason)
        return error === undefined ? Effect.void : reportLost(held, error)
      })

    const declareLostNow = (held: Held<G>, reason: LostReason): void => {
      const error = markLost(held, reason)
      if (error === undefined) return
      unreported.push({ held, error })
      alarm.ring()
    }

    const sink: LossSink = { declareLostNow: (held, reason) => declareLostNow(held as Held<G>, reason) }

    const register: Registry<G>["register"] = (fiber, input) => {
      const labels = metrics.labelsOn(fiber, baseLabels)
      const held = new Held(
        nextId++,
        input.name,
        input.mode,
        input.grant,
        input.ttlMillis,
        clockOf(fiber).unsafeCurrentTimeMillis(),
        Option.getOrUndefined(input.grant.validUntil),
        labels,
        sink
      )
      leases.set(held.id, held)
      metrics.unsafe.held(labels, 1)
      // Nothing of a fresh lease is due now: the loop is rung when its renewal is (a ring now
      // would run a round of the loop per grant).
      if (held.validUntil !== undefined) alarm.wakeBy(Math.min(held.renewAt, safetyDeadline(held)), fiberMillis(fiber))
      return held
    }

    const giveBackFailed = (
      name: string,
      token: string,
      labels: metrics.Labels,
      cause: Cause.Cause<unknown>,
      outcome = "the backend gave it up"
    ) =>
      Effect.suspend(() => {
        metrics.unsafe.releaseFailed(labels)
        return Effect.logWarning(`releasing lock "${name}" failed; ${outcome}`, cause).pipe(
          Effect.annotateLogs({ "lock.name": name, "lock.token": token })
        )
      })

    /**
     * The grant's release, its failure reported. Its bound is the one `owned` keeps around it (a
     * timer, not a race of two more fibers per release: this is on every cycle's path).
     */
    const giveBack = (name: string, grant: G, labels: metrics.Labels): Effect.Effect<void> =>
      Effect.catchAllCause(grant.release, (cause) => giveBackFailed(name, String(grant.token), labels, cause))

    /**
     * Runs a release on the owner's runtime and waits for it, bounded whatever it does (an
     * uninterruptible step in a backend's release included): past the bound the caller goes on,
     * the failure is reported, and the release is stopped in the background.
     */
    const owned = (work: Effect.Effect<void>, boundMillis: number, name: string, token: string, labels: metrics.Labels) =>
      Effect.suspend(() => {
        const fiber = owner.unsafeFork(work)
        releasing.add(fiber)
        fiber.addObserver(() => releasing.delete(fiber))
        return Effect.flatMap(Owner.awaitWithin(fiber, boundMillis), (done) =>
          Option.isSome(done)
            ? Effect.void
            : Effect.zipRight(
              Fiber.interruptFork(fiber),
              giveBackFailed(name, token, labels, Cause.fail(new Error(`release did not finish within ${boundMillis} ms`)))
            ))
      })

    /** Give-backs the backend runs on its own callbacks (`Grant.releaseNow`) that have not finished. */
    let detachedPending = 0
    const detachedSettled = new Set<() => void>()

    /**
     * Waits for a give-back the backend runs as its own work (`Grant.releaseNow`): one callback and
     * one stall-safe timer, no fiber. Past the bound the caller goes on and the failure is
     * reported; the give-back goes on too (the backend bounds it), and closing still waits for it.
     */
    const detached = (grant: G, boundMillis: number, name: string, labels: metrics.Labels): Effect.Effect<void> =>
      Effect.async<void>((resume) => {
        let waiting = true
        detachedPending++
        const cancelTimer = stallSafeTimer(boundMillis, () => {
          if (!waiting) return
          waiting = false
          resume(giveBackFailed(
            name,
            String(grant.token),
            labels,
            Cause.fail(new Error(`release did not finish within ${boundMillis} ms`)),
            // Not given up: the backend's own bound ends it, destroying what it cannot prove.
            "the backend goes on with it in the background, and destroys the session if it cannot prove it"
          ))
        })
        let finished = false
        const finish = (failure: Cause.Cause<unknown> | undefined) => {
          if (finished) return
          finished = true
          detachedPending--
          if (detachedPending === 0) for (const settled of detachedSettled) settled()
          if (!waiting) return
          waiting = false
          cancelTimer()
          resume(failure === undefined ? Effect.void : giveBackFailed(name, String(grant.token), labels, failure))
        }
        try {
          grant.releaseNow!((failure) => finish(failure === undefined ? undefined : Cause.fail(failure)))
        } catch (defect) {
          // A backend that throws instead of calling back has finished, badly: reported, not waited for.
          finish(Cause.die(defect))
        }
        // No canceler: a release waits in a scope's finalizer, where nothing interrupts it, and an
        // interrupted waiter would only leave its timer to run out (its `resume` is then ignored).
        // An Effect.async with a canceler costs an interruption handler on every release.
      })

    /** Closing's wait for the give-backs still running on the backend's callbacks, bounded. */
    const detachedDone = (boundMillis: number): Effect.Effect<void> =>
      Effect.async<void>((resume) => {
        if (detachedPending === 0) return resume(Effect.void)
        const settled = () => finish()
        const cancelTimer = stallSafeTimer(boundMillis, () => finish())
        const finish = () => {
          detachedSettled.delete(settled)
          cancelTimer()
          resume(Effect.void)
        }
        detachedSettled.add(settled)
        return Effect.sync(() => {
          detachedSettled.delete(settled)
          cancelTimer()
        })
      })

    // The renewal of this lease is finished before its release starts: a renewal landing after
    // the release would otherwise extend a lease nobody holds any more.
    const release = (held: Held<G>): Effect.Effect<void> =>
      Effect.withFiberRuntime((fiber) => {
        if (held.releasing) return Effect.void
        held.releasing = true
        // Given back now: a closing service's loop stops renewing it.
        draining.delete(held)
        if (held.state === "held") {
          held.state = "released"
          metrics.unsafe.held(held.labels, -1)
        }
        leases.delete(held.id)
        const renewing = held.renewing
        // An in-process store's release is one synchronous step: nothing to own or to bound.
        // Bound: releaseTimeout for the release, as much again for a renewal in flight before it.
        // The release Effect is built only on the paths that run it: the callback path (`detached`) is every cycle's.
        const done = renewing === undefined && backend.instantRelease !== true && held.grant.releaseNow !== undefined
          ? detached(held.grant, releaseTimeoutMillis + RELEASE_GRACE_MS, held.name, held.labels)
          : backend.instantRelease === true && renewing === undefined
          ? giveBack(held.name, held.grant, held.labels)
          : owned(
            renewing === undefined
              ? giveBack(held.name, held.grant, held.labels)
              // Bounded: a renewal is itself cut off at its budget, this is only a backstop.
              // `within`: the wait runs interruptibly, so the backstop holds in an uninterruptible caller too.
              : Effect.zipRight(within(Deferred.await(renewing), wholeMillis(releaseTimeoutMillis)), giveBack(held.name, held.grant, held.labels)),
            (renewing === undefined ? 1 : 2) * releaseTimeoutMillis + RELEASE_GRACE_MS,
            held.name,
            String(held.grant.token),
            held.labels
          )
        const traced = isTraced(fiber)
          ? Effect.withSpan(done, "effect-lock.release", {
            captureStackTrace: false,
            attributes: { "lock.name": held.name, "lock.token": String(held.grant.token), "lock.backend": backend.backend }
          })
          : done
        // A guarded body still running under it (a guard forked off, and the lease's scope closed
        // first): stopped and awaited (bounded) before the lease is given back, never overlapped.
        // A closing service has done this already (bounded once): not waited for again here.
        const bodies = held.bodies
        if (bodies === undefined || bodies.size === 0 || closed) return traced
        const running = Array.from(bodies)
        for (const body of running) body.unsafeInterruptAsFork(fiber.id())
        return Effect.zipRight(stopped(running, held.name), traced)
      })

    /** Waits (bounded) for interrupted guarded bodies to stop; past the bound, says so and goes on. */
    const stopped = (bodies: ReadonlyArray<Fiber.RuntimeFiber<unknown, unknown>>, name?: string): Effect.Effect<void> =>
      Effect.flatMap(Owner.awaitAll(bodies, SHUTDOWN_BODY_WAIT_MS), (done) =>
        done ? Effect.void : Effect.logWarning(
          `effect-lock: guarded bodies still running ${SHUTDOWN_BODY_WAIT_MS} ms after they were interrupted; their locks are given back`
        ).pipe(Effect.annotateLogs(name === undefined ? { "lock.backend": backend.backend } : { "lock.backend": backend.backend, "lock.name": name })))

    const discard = (name: string, grant: G): Effect.Effect<void> =>
      Effect.withFiberRuntime((fiber) => {
        const labels = metrics.labelsOn(fiber, baseLabels)
        return backend.instantRelease === true
          ? giveBack(name, grant, labels)
          : grant.releaseNow !== undefined
          ? detached(grant, releaseTimeoutMillis + RELEASE_GRACE_MS, name, labels)
          : owned(giveBack(name, grant, labels), releaseTimeoutMillis + RELEASE_GRACE_MS, name, String(grant.token), labels)
      })

    const toLease = (held: Held<G>): Lease => {
      const lease: Lease & { readonly [HeldKey]: Held<G> } = {
      name: held.name,
      token: held.grant.token,
      mode: held.mode,
      lost: Effect.suspend(() =>
        held.lostError !== undefined ? Effect.fail(held.lostError) : Deferred.await(lostSignal(held))
      ),
      isHeld: Effect.sync(() => held.state === "held"),
      [HeldKey]: held
      }
      return lease
    }

    const snapshot = Effect.sync(() =>
      Array.from(leases.values(), (held): HeldLock => ({
        name: held.name,
        token: held.grant.token,
        mode: held.mode,
        backend: backend.backend,
        since: held.since,
        validUntil: Option.fromNullable(held.validUntil)
      }))
    )

    const applyOutcome = (held: Held<G>, outcome: RenewOutcome | undefined, startedAt: number): Effect.Effect<void> => {
      if (!kept(held)) return Effect.void
      if (outcome === undefined) {
        held.renewAt = retryAt(held, startedAt)
        return Effect.void
      }
      if (outcome._tag === "Lost") {
        // A draining lease the store no longer has: nothing left to keep (its holder was told already).
        draining.delete(held)
        return declareLost(held, outcome.reason)
      }
      held.validUntil = outcome.validUntil
      held.renewAt = nextRenewAt(outcome.validUntil, held.ttlMillis)
      return Effect.void
    }

    /** The backend call for one batch: its outcomes, or `undefined` when it failed or ran out of time. */
    const callRenew = (live: ReadonlyArray<Held<G>>, budget: number) =>
      Effect.withFiberRuntime<ReadonlyArray<RenewOutcome> | undefined>((fiber) => {
        // Stall-safe: an answer that arrived while the event loop was blocked counts.
        const call = timeoutOption(Effect.suspend(() => backend.renew(live.map((h) => h.grant))), wholeMillis(budget)).pipe(
          Effect.flatMap(Option.match({
            onNone: () => Effect.as(Effect.logDebug("lease renewal ran out of time; retrying"), undefined),
            onSome: (outcomes) => Effect.succeed(outcomes)
          })),
          // A failed or defective renewal is retried until the safety deadline; it never stops the loop.
          Effect.catchAllCause((cause) =>
            Effect.as(
              Cause.isFailure(cause) && !Cause.isDie(cause)
                ? Effect.logDebug("lease renewal failed; retrying", cause)
                : Effect.logWarning("lease renewal died; retrying", cause),
              undefined
            )
          )
        )
        return isTraced(fiber)
          ? Effect.withSpan(call, "effect-lock.renew", {
            captureStackTrace: false,
            attributes: { "lock.backend": backend.backend, "lock.count": live.length }
          })
          : call
      })

    /** One backend call for a batch, in its own fiber; `done` is completed however it ends. */
    const renewBatch = (batch: ReadonlyArray<Held<G>>, done: Deferred.Deferred<void>): Effect.Effect<void> => {
      let start = Number.NaN
      return Effect.gen(function*() {
        const live = batch.filter(kept)
        if (live.length === 0) return
        start = yield* monotonicMillis
        // Cut off before the earliest safety deadline in the batch, measured from this call's own
        // start; the loop gives leases up on time whatever this call does.
        let budget = Number.POSITIVE_INFINITY
        for (const h of live) {
          // A draining lease was told already: its bound is the store's expiry, not the safety
          // deadline (past which its renewal would get no time at all while the store still keeps it).
          const until = draining.has(h) ? (h.validUntil ?? Number.POSITIVE_INFINITY) : safetyDeadline(h)
          budget = Math.min(budget, until - start, h.ttlMillis * RENEW_FRACTION)
        }
        const outcomes = yield* callRenew(live, Math.max(1, wholeMillis(budget)))
        for (let i = 0; i < live.length; i++) yield* applyOutcome(live[i]!, outcomes?.[i], start)
      }).pipe(
        Effect.catchAllCause((cause) =>
          Effect.zipRight(
            Effect.sync(() => {
              for (const h of batch) if (kept(h)) h.renewAt = retryAt(h, Number.isNaN(start) ? 0 : start)
            }),
            Effect.logWarning("applying a lease renewal failed; retrying", cause)
          )
        ),
        // Completed even when the service closes mid-renewal, so no release waits on it forever.
        Effect.ensuring(Effect.sync(() => {
          inFlight--
          for (const held of batch) if (held.renewing === done) held.renewing = undefined
          Deferred.unsafeDone(done, Exit.void)
          alarm.ring()
        }))
      )
    }

    /** Every lease the loop keeps: the held ones, and those of a closing service not given back yet. */
    const keptLeases = (): Iterable<Held<G>> => (draining.size === 0 ? leases.values() : [...leases.values(), ...draining])

    /** Starts a batch for every due lease there is a free slot for. */
    const startRenewals = (now: number): Effect.Effect<void> =>
      Effect.suspend(() => {
        // A closing service renews only the leases it has not given back yet (`draining`): a lease
        // whose body still runs must not run out in the store before the body has stopped.
        if (closed && draining.size === 0) return Effect.void
        const idle: Array<Held<G>> = []
        let anyDue = false
        for (const held of keptLeases()) {
          if (held.validUntil === undefined || held.renewing !== undefined) continue
          // The store has let a draining lease go (its expiry passed): nothing left to renew.
          if (draining.has(held) && now >= held.validUntil) {
            draining.delete(held)
            continue
          }
          idle.push(held)
          if (held.renewAt <= now) anyDue = true
        }
        if (!anyDue) return Effect.void
        // A batch starts when some lease is due, and takes along every lease falling due within the
        // coalescing window: the next batch then waits for the window to pass, not for the next lease.
        const due = idle.filter((h) => h.renewAt <= now + h.ttlMillis * COALESCE_FRACTION)
        const size = backend.renewBatchSize
        const starts: Array<Effect.Effect<unknown>> = []
        // Only as many batches as there are free slots: while calls are in flight, due leases pile
        // up into full batches instead of queueing as many small ones (fewer statements per tick).
        for (let i = 0; i < due.length && inFlight < RENEW_CONCURRENCY; i += size) {
          const batch = due.slice(i, i + size)
          const done = Deferred.unsafeMake<void>(FiberId.none)
          for (const held of batch) held.renewing = done
          inFlight++
          starts.push(FiberSet.run(renewals, renewBatch(batch, done)))
        }
        return Effect.all(starts, { discard: true })
      }).pipe(
        // A defect here (a broken backend) is logged; the due leases retry later, and the loop goes
        // on declaring losses on time whatever happens to their renewals.
        Effect.catchAllCause((cause) =>
          Effect.zipRight(
            Effect.sync(() => {
              for (const held of keptLeases()) {
                if (held.renewing === undefined && held.renewAt <= now) held.renewAt = retryAt(held, now)
              }
            }),
            Effect.logError("effect-lock: starting lease renewals failed; retrying", cause).pipe(
              Effect.annotateLogs("lock.backend", backend.backend)
            )
          )
        )
      )

    /** The next time the loop must look: a renewal due with a free slot, or a safety deadline. */
    const nextWake = (): number => {
      let wakeAt = Number.POSITIVE_INFINITY
      // With every slot busy, a due lease waits for a completion (which rings) or its deadline.
      const slotFree = inFlight < RENEW_CONCURRENCY
      for (const h of leases.values()) {
        if (h.validUntil === undefined) continue
        const renewable = slotFree && h.renewing === undefined
        wakeAt = Math.min(wakeAt, safetyDeadline(h), renewable ? h.renewAt : Number.POSITIVE_INFINITY)
      }
      // A draining lease has no deadline to declare (its holder was told): only its renewal.
      if (slotFree) for (const h of draining) if (h.renewing === undefined) wakeAt = Math.min(wakeAt, h.renewAt)
      return wakeAt
    }

    const tick: Effect.Effect<void> = Effect.gen(function*() {
      alarm.wokeUp()
      if (unreported.length > 0) {
        yield* Effect.forEach(unreported.splice(0), ({ error, held }) => reportLost(held, error), { discard: true })
      }
      const now = yield* monotonicMillis
      // Every lease past its deadline is marked lost before anything is logged or started.
      const lost: Array<{ readonly held: Held<G>; readonly error: LockLost }> = []
      for (const held of leases.values()) {
        if (now < safetyDeadline(held)) continue
        const error = markLost(held, "renewal-failed")
        if (error !== undefined) lost.push({ held, error })
      }
      yield* Effect.forEach(lost, ({ error, held }) => reportLost(held, error), { discard: true })
      yield* startRenewals(now)
      yield* Effect.suspend(() => alarm.sleepUntil(nextWake()))
    })

    /**
     * After a defect the loop restarts: at once the first time, then after a growing pause (up to
     * its next deadline). Losses due by then are declared here first, with no help from the code
     * that failed, so loss detection goes on whatever keeps breaking.
     */
    let defects = 0
    const restart = (cause: Cause.Cause<never>): Effect.Effect<void> =>
      Effect.withFiberRuntime((fiber) => {
        alarm.wokeUp()
        const now = fiberMillis(fiber)
        const lost: Array<{ readonly held: Held<G>; readonly error: LockLost }> = []
        let next = Number.POSITIVE_INFINITY
        for (const held of leases.values()) {
          const deadline = safetyDeadline(held)
          if (now < deadline) next = Math.min(next, deadline)
          else {
            const error = markLost(held, "renewal-failed")
            if (error !== undefined) lost.push({ held, error })
          }
        }
        const pause = defects === 0 ? 0 : Math.min(2 ** defects, RESTART_PAUSE_MAX_MS, next - now)
        defects++
        return Effect.logError("effect-lock: the lease renewal loop failed; it restarts", cause).pipe(
          Effect.annotateLogs("lock.backend", backend.backend),
          Effect.zipRight(Effect.forEach(lost, ({ error, held }) => reportLost(held, error), { discard: true })),
          Effect.zipRight(pause > 0 ? sleepMillis(pause) : Effect.yieldNow())
        )
      })

    // The renewal loop, the service's own work: it restarts after a defect (logged), so loss
    // detection never stops while the service lives.
    yield* owner.fork(Effect.forever(
      tick.pipe(
        Effect.tap(() => Effect.sync(() => (defects = 0))),
        Effect.catchAllCause(restart)
      )
    ))

    // Counted and uncounted in uninterruptible steps: an interruption between the count and the
    // finalizer that undoes it would leave closing waiting for an acquisition that is gone.
    const taking: Registry<G>["taking"] = (self) =>
      Effect.uninterruptibleMask((restore) => {
        // An in-process store gives a late grant back in the same step: nothing for closing to wait for.
        if (backend.instantRelease === true) return self(restore)
        takes++
        const settled = () => {
          takes--
          if (closed && takes === 0) Deferred.unsafeDone(takesSettled, Exit.void)
        }
        // `ensuring` without its own mask: this region is uninterruptible already.
        return Effect.matchCauseEffect(self(restore), {
          onFailure: (cause) => {
            settled()
            return Effect.failCause(cause)
          },
          onSuccess: (value) => {
            settled()
            return Effect.succeed(value)
          }
        })
      })

    /** Stops the renewal loop for good and completes the signals of renewals cut off (no release waits on one). */
    const stopRenewals = (held: ReadonlyArray<Held<G>>) =>
      Effect.suspend(() => {
        draining.clear()
        // A renewal fiber interrupted before it started never runs its own completion.
        return FiberSet.clear(renewals).pipe(
          Effect.zipRight(alarm.stop),
          Effect.zipRight(Effect.sync(() => {
            for (const h of held) {
              if (h.renewing !== undefined) Deferred.unsafeDone(h.renewing, Exit.void)
              h.renewing = undefined
            }
          }))
        )
      })

    const close = Effect.suspend(() => {
      // 1. No new grant is handed out, and waits of acquisitions in flight end now.
      closed = true
      for (const listener of closingListeners) listener()
      closingListeners.clear()
      if (takes === 0) Deferred.unsafeDone(takesSettled, Exit.void)
      const held = Array.from(leases.values())
      // Still renewed until given back (step 4): a body that outlives its ttl while it stops must
      // not lose its lease in the store to another process before it has stopped.
      for (const h of held) draining.add(h)
      // 2. Holders are told; their guarded bodies are interrupted by it and awaited, so that no
      // lock is handed on while the work under it still runs.
      return Effect.forEach(held, (h) => declareLost(h, "shutdown"), { discard: true }).pipe(
        Effect.zipRight(Effect.suspend(() => {
          const bodies = held.flatMap((h) => (h.bodies === undefined ? [] : Array.from(h.bodies)))
          return bodies.length === 0 ? Effect.void : stopped(bodies)
        })),
        // 3. Acquisitions in flight settle: a grant that arrives now is given back by its own caller.
        // `within`, not `timeoutOption`: a close runs uninterruptibly (a finalizer), and the wait must
        // be cut off at its bound there too (with `timeoutOption` it waited for the last acquisition).
        Effect.zipRight(within(Deferred.await(takesSettled), SHUTDOWN_TAKE_WAIT_MS)),
        // Renewals stop only now, right before the give-backs: a release waits for a renewal in flight.
        Effect.zipRight(stopRenewals(held)),
        // 4. Every lease is given back, and every release under way is awaited before the
        // backend's finalizers close its connections.
        Effect.zipRight(Effect.forEach(held, release, { concurrency: RENEW_CONCURRENCY, discard: true })),
        Effect.zipRight(Effect.suspend(() => Owner.awaitAll(Array.from(releasing), 2 * releaseTimeoutMillis + RELEASE_GRACE_MS))),
        Effect.zipRight(detachedDone(releaseTimeoutMillis + RELEASE_GRACE_MS))
      )
    })

    return {
      register,
      declareLost,
      declareLostNow,
      release,
      discard,
      toLease,
      snapshot,
      isClosed: () => closed,
      whenClosing: (listener) => {
        if (closed) {
          listener()
          return () => {}
        }
        closingListeners.add(listener)
        return () => {
          closingListeners.delete(listener)
        }
      },
      taking,
      close
    }
  })

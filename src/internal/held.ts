import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as FiberSet from "effect/FiberSet"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import type * as Scope from "effect/Scope"
import type { HeldLock, Lease, LockMode } from "../Lease.js"
import type { Grant, LockBackend, RenewOutcome } from "../LockBackend.js"
import { LockLost, type LostReason } from "../LockError.js"
import { monotonicMillis } from "./clock.js"
import * as metrics from "./metrics.js"

/** One lease this process holds, with what the renewal loop needs to keep it. */
export interface Held<G extends Grant> {
  readonly id: number
  readonly name: string
  readonly mode: LockMode
  readonly grant: G
  readonly ttlMillis: number
  /** Wall-clock time of the grant, for `inspect`; deadlines use the monotonic timeline. */
  readonly since: number
  readonly lost: Deferred.Deferred<never, LockLost>
  state: "held" | "lost" | "released"
  /** Set once the release started (by the lease's scope or by the service closing). */
  releasing: boolean
  validUntil: number | undefined
  renewAt: number
  /** Set while a renewal covering this lease is queued or in flight; release waits for it. */
  renewing: Deferred.Deferred<void> | undefined
}

/** Renewals fire once a third of the lease has passed since the last good renewal. */
const RENEW_FRACTION = 1 / 3
/** A lease is given up when less than this fraction of its ttl is left without a renewal. */
export const SAFETY_FRACTION = 1 / 5
/** Leases falling due within this fraction of their ttl join the current batch. */
const COALESCE_FRACTION = 1 / 12
/** Renewal batches in flight at once (each is one backend call, e.g. one statement). */
const RENEW_CONCURRENCY = 4
/** After a failed renewal, try again after this fraction of the ttl. */
const RETRY_FRACTION = 1 / 10

/** The moment (monotonic ms) a lease valid until `validUntil` must be given up. */
export const safetyDeadlineOf = (validUntil: number | undefined, ttlMillis: number): number =>
  validUntil === undefined ? Number.POSITIVE_INFINITY : validUntil - ttlMillis * SAFETY_FRACTION

const safetyDeadline = (held: Held<Grant>): number => safetyDeadlineOf(held.validUntil, held.ttlMillis)

const nextRenewAt = (validUntil: number, ttlMillis: number): number =>
  validUntil - ttlMillis + ttlMillis * RENEW_FRACTION

/** The loss signal behind each lease this module hands out, so `guard` can poll it. */
const lostSignals = new WeakMap<Lease, Deferred.Deferred<never, LockLost>>()

/** The loss of `lease` if it is already known, without waiting. */
export const pollLost = (lease: Lease): Effect.Effect<Option.Option<LockLost>> => {
  const signal = lostSignals.get(lease)
  if (signal === undefined) return Effect.succeedNone
  return Effect.flatMap(
    Deferred.poll(signal),
    Option.match({
      onNone: () => Effect.succeedNone,
      onSome: (done) => Effect.map(Effect.flip(done), Option.some)
    })
  )
}

/**
 * The leases of one `DistributedLock` and the single background loop that keeps them: it gives
 * up leases at their safety deadline and renews due leases in batches, the backend calls running
 * in their own fibers so that one slow call never delays another lease's loss.
 */
export interface Registry<G extends Grant> {
  readonly register: (
    input: {
      readonly name: string
      readonly mode: LockMode
      readonly grant: G
      readonly ttl: Duration.Duration
      readonly since: number
    },
    lost: Deferred.Deferred<never, LockLost>
  ) => Effect.Effect<Held<G>>
  readonly declareLost: (held: Held<G>, reason: LostReason) => Effect.Effect<void>
  readonly release: (held: Held<G>) => Effect.Effect<void>
  /** Gives back a grant that was never handed out (it arrived too late to be safe). */
  readonly discard: (name: string, grant: G) => Effect.Effect<void>
  readonly toLease: (held: Held<G>) => Lease
  readonly snapshot: Effect.Effect<ReadonlyArray<HeldLock>>
  /** True once the service is closing: no new grants are handed out. */
  readonly isClosed: () => boolean
  /** Tells every holder its lease is gone and releases it; then refuses new grants. */
  readonly close: Effect.Effect<void>
  readonly run: Effect.Effect<never>
}

export const makeRegistry = <G extends Grant>(
  backend: LockBackend<G>,
  options: { readonly releaseTimeout: Duration.Duration }
): Effect.Effect<Registry<G>, never, Scope.Scope> =>
  Effect.gen(function*() {
    const leases = new Map<number, Held<G>>()
    const kick = yield* Queue.sliding<void>(1)
    const renewals = yield* FiberSet.make<void>()
    /** Renewal calls in flight; due leases wait for a free slot and then go in one batch. */
    let inFlight = 0
    /** When the loop will next wake by itself; a new lease only kicks it if it is due earlier. */
    let scheduledWake = Number.POSITIVE_INFINITY
    let closed = false
    let nextId = 0

    const declareLost = (held: Held<G>, reason: LostReason): Effect.Effect<void> =>
      Effect.suspend(() => {
        if (held.state !== "held") return Effect.void
        held.state = "lost"
        leases.delete(held.id)
        const error = new LockLost({ name: held.name, token: held.grant.token, reason })
        return Deferred.fail(held.lost, error).pipe(
          Effect.zipRight(metrics.lost(backend.backend, reason)),
          Effect.zipRight(
            Effect.logWarning(error.message).pipe(
              Effect.annotateLogs({ "lock.name": held.name, "lock.token": String(held.grant.token), reason })
            )
          ),
          Effect.zipRight(metrics.held(backend.backend, -1)),
          Effect.withSpan("effect-lock.lost", {
            captureStackTrace: false,
            attributes: {
              "lock.name": held.name,
              "lock.token": String(held.grant.token),
              "lock.backend": backend.backend,
              "lock.reason": reason
            }
          })
        )
      })

    const register: Registry<G>["register"] = (input, lost) =>
      Effect.sync(() => {
        const ttlMillis = Duration.toMillis(input.ttl)
        const validUntil = Option.getOrUndefined(input.grant.validUntil)
        const held: Held<G> = {
          id: nextId++,
          name: input.name,
          mode: input.mode,
          grant: input.grant,
          ttlMillis,
          since: input.since,
          lost,
          state: "held",
          releasing: false,
          validUntil,
          renewAt: validUntil === undefined ? Number.POSITIVE_INFINITY : nextRenewAt(validUntil, ttlMillis),
          renewing: undefined
        }
        leases.set(held.id, held)
        return held
      }).pipe(
        // Kicking on every registration would rescan every lease per acquire (quadratic).
        Effect.tap((held) =>
          held.validUntil !== undefined && Math.min(held.renewAt, safetyDeadline(held)) < scheduledWake
            ? kick.offer(undefined)
            : Effect.void
        ),
        Effect.tap(() => metrics.held(backend.backend, 1))
      )

    const giveBack = (name: string, token: string, release: Effect.Effect<void, unknown>) =>
      release.pipe(
        Effect.timeoutFail({
          duration: options.releaseTimeout,
          onTimeout: () => new Error(`release did not finish within ${Duration.format(options.releaseTimeout)}`)
        }),
        Effect.catchAllCause((cause) =>
          metrics.releaseFailed(backend.backend).pipe(
            Effect.zipRight(
              Effect.logWarning(`releasing lock "${name}" failed; the backend gave it up`, cause).pipe(
                Effect.annotateLogs({ "lock.name": name, "lock.token": token })
              )
            )
          )
        )
      )

    // The renewal of this lease is finished before its release starts: a renewal landing after
    // the release would otherwise extend a lease nobody holds any more.
    const release = (held: Held<G>): Effect.Effect<void> =>
      Effect.suspend(() => {
        if (held.releasing) return Effect.void
        held.releasing = true
        const wasHeld = held.state === "held"
        if (wasHeld) held.state = "released"
        leases.delete(held.id)
        const renewing = held.renewing
        return Effect.gen(function*() {
          // Bounded: a renewal is itself cut off at its budget, this is only a backstop.
          if (renewing !== undefined) yield* Effect.timeout(Deferred.await(renewing), options.releaseTimeout).pipe(Effect.ignore)
          if (wasHeld) yield* metrics.held(backend.backend, -1)
          yield* giveBack(held.name, String(held.grant.token), held.grant.release)
        })
      }).pipe(
        Effect.withSpan("effect-lock.release", {
          captureStackTrace: false,
          attributes: { "lock.name": held.name, "lock.token": String(held.grant.token), "lock.backend": backend.backend }
        })
      )

    const discard = (name: string, grant: G): Effect.Effect<void> => giveBack(name, String(grant.token), grant.release)

    const toLease = (held: Held<G>): Lease => {
      const lease: Lease = {
        name: held.name,
        token: held.grant.token,
        mode: held.mode,
        lost: Deferred.await(held.lost),
        isHeld: Effect.sync(() => held.state === "held")
      }
      lostSignals.set(lease, held.lost)
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

    const applyOutcome = (held: Held<G>, outcome: RenewOutcome | undefined, startedAt: number) => {
      if (held.state !== "held") return Effect.void
      if (outcome === undefined) {
        held.renewAt = startedAt + held.ttlMillis * RETRY_FRACTION
        return Effect.void
      }
      if (outcome._tag === "Lost") return declareLost(held, outcome.reason)
      held.validUntil = outcome.validUntil
      held.renewAt = nextRenewAt(outcome.validUntil, held.ttlMillis)
      return Effect.void
    }

    /** One backend call for a batch, in its own fiber; `done` is completed however it ends. */
    const renewBatch = (batch: ReadonlyArray<Held<G>>, done: Deferred.Deferred<void>): Effect.Effect<void> =>
      Effect.gen(function*() {
        const live = batch.filter((h) => h.state === "held")
        if (live.length === 0) return
        const start = yield* monotonicMillis
        // Cut off before the earliest safety deadline in the batch, measured from this call's own
        // start; the loop gives leases up on time whatever this call does.
        const budget = Math.max(
          1,
          Math.min(...live.map((h) => Math.min(safetyDeadline(h) - start, h.ttlMillis * RENEW_FRACTION)))
        )
        const outcomes = yield* backend.renew(live.map((h) => h.grant)).pipe(
          Effect.timeout(Duration.millis(budget)),
          // A failed or defective renewal is retried until the safety deadline; it must never stop the loop.
          Effect.catchAllCause((cause) =>
            Effect.logDebug("lease renewal failed; retrying", cause).pipe(Effect.as(undefined))
          ),
          Effect.withSpan("effect-lock.renew", {
            captureStackTrace: false,
            attributes: { "lock.backend": backend.backend, "lock.count": live.length }
          })
        )
        for (let i = 0; i < live.length; i++) yield* applyOutcome(live[i]!, outcomes?.[i], start)
      }).pipe(
        // Completed even when the service closes mid-renewal, so no release waits on it forever.
        Effect.ensuring(
          Effect.suspend(() => {
            inFlight--
            for (const held of batch) if (held.renewing === done) held.renewing = undefined
            return Effect.zipRight(Deferred.succeed(done, undefined), kick.offer(undefined))
          })
        )
      )

    const tick: Effect.Effect<void> = Effect.gen(function*() {
      const now = yield* monotonicMillis
      const live: Array<Held<G>> = []
      for (const held of leases.values()) {
        if (held.validUntil === undefined) continue
        if (now >= safetyDeadline(held)) yield* declareLost(held, "renewal-failed")
        else live.push(held)
      }
      // A batch starts when some lease is due, and takes along every lease falling due within the
      // coalescing window: the next batch then waits for the window to pass, not for the next lease.
      const idle = live.filter((h) => h.renewing === undefined)
      const due = idle.some((h) => h.renewAt <= now)
        ? idle.filter((h) => h.renewAt <= now + h.ttlMillis * COALESCE_FRACTION)
        : []
      // Only as many batches as there are free slots: while calls are in flight, due leases pile
      // up into full batches instead of queueing as many small ones (fewer statements per tick).
      for (let i = 0; i < due.length && inFlight < RENEW_CONCURRENCY; i += backend.renewBatchSize) {
        const batch = due.slice(i, i + backend.renewBatchSize)
        const done = yield* Deferred.make<void>()
        for (const held of batch) held.renewing = done
        inFlight++
        yield* FiberSet.run(renewals, renewBatch(batch, done))
      }
      if (live.length === 0) {
        scheduledWake = Number.POSITIVE_INFINITY
        yield* kick.take
        scheduledWake = Number.NEGATIVE_INFINITY
        return
      }
      let wakeAt = Number.POSITIVE_INFINITY
      // With every slot busy, a due lease waits for a completion (which kicks) or its deadline.
      const slotFree = inFlight < RENEW_CONCURRENCY
      for (const h of live) {
        const renewable = slotFree && h.renewing === undefined
        wakeAt = Math.min(wakeAt, safetyDeadline(h), renewable ? h.renewAt : Number.POSITIVE_INFINITY)
      }
      scheduledWake = wakeAt
      const after = yield* monotonicMillis
      yield* Effect.raceFirst(Effect.sleep(Duration.millis(Math.max(0, wakeAt - after))), kick.take)
      scheduledWake = Number.NEGATIVE_INFINITY
    })

    const close = Effect.suspend(() => {
      closed = true
      const held = Array.from(leases.values())
      // Renewals are stopped first (their `renewing` signals complete), so no release waits on one.
      return FiberSet.clear(renewals).pipe(Effect.zipRight(Effect.forEach(
        held,
        (h) => Effect.zipRight(declareLost(h, "revoked"), release(h)),
        { concurrency: RENEW_CONCURRENCY, discard: true }
      )))
    })

    return {
      register,
      declareLost,
      release,
      discard,
      toLease,
      snapshot,
      isClosed: () => closed,
      close,
      run: Effect.forever(tick)
    }
  })

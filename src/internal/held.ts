import * as Clock from "effect/Clock"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import type { HeldLock, Lease, LockMode } from "../Lease.js"
import type { Grant, LockBackend, RenewOutcome } from "../LockBackend.js"
import { LockLost, type LostReason } from "../LockError.js"
import * as metrics from "./metrics.js"

/** One lease this process holds, with what the renewal loop needs to keep it. */
export interface Held<G extends Grant> {
  readonly id: number
  readonly name: string
  readonly mode: LockMode
  readonly grant: G
  readonly ttlMillis: number
  readonly since: number
  readonly lost: Deferred.Deferred<never, LockLost>
  state: "held" | "lost" | "released"
  validUntil: number | undefined
  renewAt: number
  /** Set while a renewal statement covering this lease is in flight; release waits for it. */
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

export const safetyDeadline = (held: Held<Grant>): number =>
  held.validUntil === undefined ? Number.POSITIVE_INFINITY : held.validUntil - held.ttlMillis * SAFETY_FRACTION

const nextRenewAt = (validUntil: number, ttlMillis: number): number =>
  validUntil - ttlMillis + ttlMillis * RENEW_FRACTION

/**
 * The leases of one `DistributedLock` and the single background fiber that renews all of them:
 * one loop per process, batching due leases into as few backend calls as the backend allows.
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
  readonly toLease: (held: Held<G>) => Lease
  readonly snapshot: Effect.Effect<ReadonlyArray<HeldLock>>
  readonly run: Effect.Effect<never>
}

export const makeRegistry = <G extends Grant>(
  backend: LockBackend<G>,
  options: { readonly releaseTimeout: Duration.Duration }
): Effect.Effect<Registry<G>> =>
  Effect.gen(function*() {
    const leases = new Map<number, Held<G>>()
    const kick = yield* Queue.sliding<void>(1)
    /** When the loop will next wake by itself; a new lease only kicks it if it is due earlier. */
    let scheduledWake = Number.POSITIVE_INFINITY
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

    // The renewal of this lease is finished before its release starts: a renewal landing after
    // the release would otherwise extend a lease nobody holds any more.
    const release = (held: Held<G>): Effect.Effect<void> =>
      Effect.gen(function*() {
        const wasHeld = held.state === "held"
        if (wasHeld) held.state = "released"
        leases.delete(held.id)
        if (held.renewing !== undefined) yield* Deferred.await(held.renewing)
        if (wasHeld) yield* metrics.held(backend.backend, -1)
        yield* held.grant.release.pipe(
          Effect.timeoutFail({
            duration: options.releaseTimeout,
            onTimeout: () => new Error(`release did not finish within ${Duration.format(options.releaseTimeout)}`)
          }),
          Effect.catchAll((error) =>
            metrics.releaseFailed(backend.backend).pipe(
              Effect.zipRight(
                Effect.logWarning(`releasing lock "${held.name}" failed; the backend gave it up`).pipe(
                  Effect.annotateLogs({ "lock.name": held.name, "lock.token": String(held.grant.token), error })
                )
              )
            )
          )
        )
      }).pipe(
        Effect.withSpan("effect-lock.release", {
          attributes: { "lock.name": held.name, "lock.token": String(held.grant.token), "lock.backend": backend.backend }
        })
      )

    const toLease = (held: Held<G>): Lease => ({
      name: held.name,
      token: held.grant.token,
      mode: held.mode,
      lost: Deferred.await(held.lost),
      isHeld: Effect.sync(() => held.state === "held")
    })

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

    const renewable = (): Array<Held<G>> => Array.from(leases.values()).filter((h) => h.validUntil !== undefined)

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

    const renewBatch = (batch: ReadonlyArray<Held<G>>, now: number): Effect.Effect<void> =>
      Effect.gen(function*() {
        const done = yield* Deferred.make<void>()
        for (const held of batch) held.renewing = done
        // Each renewal is cut off before the earliest safety deadline in the batch, so the loop is
        // always back in time to give up a lease before it can expire in the store.
        const budget = Math.max(
          1,
          Math.min(...batch.map((h) => Math.min(safetyDeadline(h) - now, h.ttlMillis * RENEW_FRACTION)))
        )
        const outcomes = yield* backend.renew(batch.map((h) => h.grant)).pipe(
          Effect.timeout(Duration.millis(budget)),
          // A failed or defective renewal is retried until the safety deadline; it must never stop the loop.
          Effect.catchAllCause((cause) =>
            Effect.logDebug("lease renewal failed; retrying", cause).pipe(Effect.as(undefined))
          ),
          Effect.withSpan("effect-lock.renew", {
            attributes: { "lock.backend": backend.backend, "lock.count": batch.length }
          })
        )
        for (let i = 0; i < batch.length; i++) {
          yield* applyOutcome(batch[i]!, outcomes?.[i], now)
        }
        for (const held of batch) if (held.renewing === done) held.renewing = undefined
        yield* Deferred.succeed(done, undefined)
      })

    const tick: Effect.Effect<void> = Effect.gen(function*() {
      const now = yield* Clock.currentTimeMillis
      for (const held of renewable()) {
        if (now >= safetyDeadline(held)) yield* declareLost(held, "renewal-failed")
      }
      const live = renewable()
      const due = live.filter((h) => h.renewAt <= now + h.ttlMillis * COALESCE_FRACTION)
      if (due.length > 0) {
        const batches: Array<ReadonlyArray<Held<G>>> = []
        for (let i = 0; i < due.length; i += backend.renewBatchSize) {
          batches.push(due.slice(i, i + backend.renewBatchSize))
        }
        // A few batches at once: one slow statement must not hold the others past their deadline.
        yield* Effect.forEach(batches, (batch) => renewBatch(batch, now), {
          concurrency: RENEW_CONCURRENCY,
          discard: true
        })
        return
      }
      if (live.length === 0) {
        scheduledWake = Number.POSITIVE_INFINITY
        yield* kick.take
        scheduledWake = Number.NEGATIVE_INFINITY
        return
      }
      let wakeAt = Number.POSITIVE_INFINITY
      for (const h of live) wakeAt = Math.min(wakeAt, h.renewAt, safetyDeadline(h))
      scheduledWake = wakeAt
      yield* Effect.raceFirst(Clock.sleep(Duration.millis(Math.max(0, wakeAt - now))), kick.take)
      scheduledWake = Number.NEGATIVE_INFINITY
    })

    return {
      register,
      declareLost,
      release,
      toLease,
      snapshot,
      run: Effect.forever(tick)
    }
  })

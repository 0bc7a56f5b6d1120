import * as Effect from "effect/Effect"
import type { AcquireResult, Grant, LockBackend } from "effect-lock/LockBackend"
import { LockBackendError } from "effect-lock/LockError"
import { monotonicMillis } from "effect-lock/internal/core/clock"

/** What a test can make the wrapped backend do, and what it saw. */
export interface Faults {
  /** When set, every renew call fails (the store is "unreachable"). */
  failRenew: boolean
  /**
   * When set, every renew call fails until this moment (monotonic ms, `monotonicMillis`), judged
   * when the call is made: the window ends on time however late the test's own fiber runs.
   */
  failRenewUntil: number | undefined
  /** When set, every renew call hangs until interrupted. */
  hangRenew: boolean
  /** Extra time a renew call takes before it reaches the store. */
  renewDelay: Effect.Effect<void>
  /** Runs before each renew call reaches the store, given the names it renews. */
  renewHook: (names: ReadonlyArray<string>) => Effect.Effect<void>
  /** Runs after the store granted, before the grant is handed back (a network round trip). */
  afterGrant: Effect.Effect<void>
  /** Runs after each of the backend's waits ends, before it looks again (a slow wake-up). */
  afterWait: Effect.Effect<void>
  /**
   * When set, the next grant is reported lost (`revoked`) by a separate fiber that first yields
   * this many times: a session dying right after its grant, racing the hand-over. One-shot.
   */
  loseAfterGrant: number | undefined
  /** Losses reported through `loseAfterGrant` so far. */
  lossesReported: number
  readonly events: Array<string>
  readonly renewCalls: Array<{ readonly at: number; readonly size: number; readonly names: ReadonlyArray<string> }>
  /** Acquires of each name that are inside the backend's wait for the lock right now. */
  readonly waiting: Map<string, number>
}

export const makeFaults = (): Faults => ({
  failRenew: false,
  failRenewUntil: undefined,
  hangRenew: false,
  renewDelay: Effect.void,
  renewHook: () => Effect.void,
  afterGrant: Effect.void,
  afterWait: Effect.void,
  loseAfterGrant: undefined,
  lossesReported: 0,
  events: [],
  renewCalls: [],
  waiting: new Map()
})

/** How many acquires of `name` are waiting for the lock in the backend (observable, not guessed). */
export const waitingFor = (faults: Faults, name: string): number => faults.waiting.get(name) ?? 0

/** Yields `n` times: lets the other fibers run `n` turns. */
export const yieldTimes = (n: number): Effect.Effect<void> =>
  n <= 0 ? Effect.void : Effect.zipRight(Effect.yieldNow(), Effect.suspend(() => yieldTimes(n - 1)))

const nameOf = (grant: Grant): string => {
  const name = (grant as { readonly name?: unknown }).name
  return typeof name === "string" ? name : "?"
}

/**
 * Wraps a backend so tests can break renewals on demand and see the order of renewals and
 * releases. It only adds faults a real store cannot produce on demand; the store itself is real.
 */
export const withFaults = <G extends Grant>(backend: LockBackend<G>, faults: Faults): LockBackend<G> => ({
  ...backend,
  acquire: (request) => {
    // Counts the acquire as waiting while the backend is inside its wait for the lock.
    const tracked = {
      ...request,
      waitUntilDeadline: <A, E, R>(step: Effect.Effect<A, E, R>) =>
        Effect.acquireUseRelease(
          Effect.sync(() => faults.waiting.set(request.name, waitingFor(faults, request.name) + 1)),
          () => request.waitUntilDeadline(step),
          () => Effect.sync(() => faults.waiting.set(request.name, waitingFor(faults, request.name) - 1))
        ).pipe(Effect.zipLeft(Effect.suspend(() => faults.afterWait)))
    }
    return Effect.flatMap(Effect.tap(backend.acquire(tracked), () => faults.afterGrant), (result): Effect.Effect<AcquireResult<G>> => {
      if (result._tag !== "Granted") return Effect.succeed(result)
      const grant = result.grant
      const wrapped = {
        _tag: "Granted" as const,
        grant: {
          ...grant,
          release: Effect.sync(() => faults.events.push(`release:start:${request.name}`)).pipe(
            Effect.zipRight(grant.release),
            Effect.ensuring(Effect.sync(() => faults.events.push(`release:end:${request.name}`)))
          )
        }
      }
      const yields = faults.loseAfterGrant
      if (yields === undefined) return Effect.succeed(wrapped)
      faults.loseAfterGrant = undefined
      // A separate fiber, so the report lands wherever the acquiring fiber happens to be.
      const report = yieldTimes(yields).pipe(
        Effect.zipRight(Effect.suspend(() => request.onLost("revoked"))),
        Effect.ensuring(Effect.sync(() => faults.lossesReported++))
      )
      return Effect.as(Effect.forkDaemon(report), wrapped)
    })
  },
  renew: (grants) =>
    Effect.gen(function*() {
      const names = grants.map(nameOf)
      faults.renewCalls.push({ at: yield* Effect.clockWith((c) => c.currentTimeMillis), size: grants.length, names })
      faults.events.push("renew:start")
      yield* faults.renewDelay
      yield* faults.renewHook(names)
      if (faults.hangRenew) yield* Effect.never
      if (faults.failRenew || (faults.failRenewUntil !== undefined && (yield* monotonicMillis) < faults.failRenewUntil)) {
        return yield* new LockBackendError({ operation: "renew", cause: new Error("injected: store unreachable") })
      }
      return yield* backend.renew(grants)
    }).pipe(Effect.ensuring(Effect.sync(() => faults.events.push("renew:end"))))
})

import * as Effect from "effect/Effect"
import type { Grant, LockBackend } from "effect-lock/LockBackend"
import { LockBackendError } from "effect-lock/LockError"

/** What a test can make the wrapped backend do, and what it saw. */
export interface Faults {
  /** When set, every renew call fails (the store is "unreachable"). */
  failRenew: boolean
  /** When set, every renew call hangs until interrupted. */
  hangRenew: boolean
  /** Extra time a renew call takes before it reaches the store. */
  renewDelay: Effect.Effect<void>
  /** Runs after the store granted, before the grant is handed back (a network round trip). */
  afterGrant: Effect.Effect<void>
  readonly events: Array<string>
  readonly renewCalls: Array<{ readonly at: number; readonly size: number }>
}

export const makeFaults = (): Faults => ({
  failRenew: false,
  hangRenew: false,
  renewDelay: Effect.void,
  afterGrant: Effect.void,
  events: [],
  renewCalls: []
})

/**
 * Wraps a backend so tests can break renewals on demand and see the order of renewals and
 * releases. It only adds faults a real store cannot produce on demand; the store itself is real.
 */
export const withFaults = <G extends Grant>(backend: LockBackend<G>, faults: Faults): LockBackend<G> => ({
  ...backend,
  acquire: (request) =>
    Effect.map(Effect.tap(backend.acquire(request), () => faults.afterGrant), (result) => {
      if (result._tag === "Granted") {
        const grant = result.grant
        return {
          _tag: "Granted" as const,
          grant: {
            ...grant,
            release: Effect.sync(() => faults.events.push(`release:start:${request.name}`)).pipe(
              Effect.zipRight(grant.release),
              Effect.ensuring(Effect.sync(() => faults.events.push(`release:end:${request.name}`)))
            )
          }
        }
      }
      return result
    }),
  renew: (grants) =>
    Effect.gen(function*() {
      faults.renewCalls.push({ at: yield* Effect.clockWith((c) => c.currentTimeMillis), size: grants.length })
      faults.events.push("renew:start")
      yield* faults.renewDelay
      if (faults.hangRenew) yield* Effect.never
      if (faults.failRenew) {
        return yield* new LockBackendError({ operation: "renew", cause: new Error("injected: store unreachable") })
      }
      return yield* backend.renew(grants)
    }).pipe(Effect.ensuring(Effect.sync(() => faults.events.push("renew:end"))))
})

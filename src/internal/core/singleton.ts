/**
 * `DistributedLock.singleton`'s loop: compete for the lock with no timeout, run the effect holding
 * it, and compete again — at once after one loss, after `restartAfter` when the effect succeeds,
 * with capped exponential backoff after backend errors or repeated losses. A failure of the
 * effect itself ends the loop with it. The lock is taken through `withLock`, passed in, so this
 * module does not depend on the public service.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type { InvalidLockName, LockLost } from "../../LockError.js"
import type { AcquireError, AcquireOptions } from "./acquire.js"
import { decodeDuration } from "./validate.js"

/** Options for `singleton` (documented on `DistributedLock.SingletonOptions`). */
export interface SingletonOptions {
  readonly ttl?: Duration.DurationInput | undefined
  readonly restartAfter?: Duration.DurationInput | undefined
  readonly retryBase?: Duration.DurationInput | undefined
  readonly retryMax?: Duration.DurationInput | undefined
}

/** The effect's own failure, kept apart from the lock's on the way through `withLock`. */
class BodyFailed<E> {
  readonly _tag = "effect-lock/internal/BodyFailed"
  constructor(readonly error: E) {}
}

/** How `singleton` holds the lock for one round. */
export type WithLock<R2> = <A, E, R>(
  self: Effect.Effect<A, E, R>,
  name: string,
  options: AcquireOptions
) => Effect.Effect<A, E | AcquireError | LockLost, R | R2>

/** Keeps `effect` running on one process of the cluster at a time (documented on `DistributedLock.singleton`). */
export const singleton = <A, E, R, R2>(
  withLock: WithLock<R2>,
  name: string,
  effect: Effect.Effect<A, E, R>,
  options?: SingletonOptions
): Effect.Effect<never, E | InvalidLockName, R | R2> => {
  const restartAfter = decodeDuration(options?.restartAfter) ?? Duration.seconds(1)
  const retryBase = decodeDuration(options?.retryBase) ?? Duration.millis(100)
  const retryMax = decodeDuration(options?.retryMax) ?? Duration.seconds(10)
  const round = withLock(
    Effect.mapError(effect, (error) => new BodyFailed(error)),
    name,
    options?.ttl === undefined ? {} : { ttl: options.ttl }
  )
  const backoff = (failures: number) => Duration.min(retryMax, Duration.times(retryBase, 2 ** Math.min(failures, 30)))
  const loop = (failures: number): Effect.Effect<never, E | InvalidLockName, R | R2> =>
    round.pipe(
      Effect.matchEffect({
        onSuccess: () => Effect.zipRight(Effect.sleep(restartAfter), loop(0)),
        onFailure: (error) => {
          if (error instanceof BodyFailed) return Effect.fail(error.error as E)
          switch (error._tag) {
            case "InvalidLockName":
              return Effect.fail(error)
            case "LockLost":
              // Competes again at once after one loss; repeated losses back off like errors.
              return Effect.logWarning(`singleton "${name}" lost its lock; competing again`).pipe(
                Effect.zipRight(failures === 0 ? Effect.void : Effect.sleep(backoff(failures - 1))),
                Effect.zipRight(loop(failures + 1))
              )
            default: {
              return Effect.logWarning(`singleton "${name}" could not compete: ${error.message}`).pipe(
                Effect.zipRight(Effect.sleep(backoff(failures))),
                Effect.zipRight(loop(failures + 1))
              )
            }
          }
        }
      })
    )
  return Effect.suspend(() => loop(0))
}

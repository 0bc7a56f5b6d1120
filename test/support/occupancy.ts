/**
 * Counts the permits held inside bodies at once and remembers the worst it saw: the check of a
 * semaphore's limit shared by its suites (`inside` is the body's work while holding them, so that
 * holders overlap: work, not synchronisation).
 */
import * as Effect from "effect/Effect"

export const occupancy = (limit: number, inside: Effect.Effect<unknown>) => {
  let held = 0
  let most = 0
  let violations = 0
  const body = (permits: number) =>
    Effect.acquireUseRelease(
      Effect.sync(() => {
        held += permits
        most = Math.max(most, held)
        if (held > limit) violations++
      }),
      () => inside,
      () => Effect.sync(() => (held -= permits))
    )
  return { body, held: () => held, most: () => most, violations: () => violations }
}

/**
 * A lease store's statements in flight, by the name they are about: a lane wrapper for the
 * semaphore contract's `quiet` (an interrupted acquire's statement may still grant, and its
 * give-back follows it). Renewals, which only extend what is held, are not counted.
 */
import * as Effect from "effect/Effect"
import type { Lane } from "effect-lock/internal/lease/lane"
import { withRun } from "./laneRun.js"

export const laneInFlight = () => {
  const inFlight = new Map<string | undefined, number>()
  const count = (name: string | undefined, by: number) => inFlight.set(name, (inFlight.get(name) ?? 0) + by)
  /** The lane with its `run` statements counted while they are running. */
  const counted = (lane: Lane): Lane =>
    withRun(lane, (operation, name, text, params, bound) =>
      Effect.acquireUseRelease(
        Effect.sync(() => count(name, 1)),
        () => lane.run(operation, name, text, params, bound),
        () => Effect.sync(() => count(name, -1))
      ))
  /** No statement on `name` (nor on no name) in flight. */
  const quiet = (name: string) => Effect.sync(() => (inFlight.get(name) ?? 0) === 0 && (inFlight.get(undefined) ?? 0) === 0)
  return { counted, quiet }
}

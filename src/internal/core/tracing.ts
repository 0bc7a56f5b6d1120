import * as Context from "effect/Context"
import * as DefaultServices from "effect/DefaultServices"
import type * as Fiber from "effect/Fiber"
import * as FiberRef from "effect/FiberRef"
import * as Tracer from "effect/Tracer"

/** Effect's built-in tracer: its spans are kept in memory and exported nowhere. */
const builtIn: Tracer.Tracer = Context.get(DefaultServices.liveServices, Tracer.Tracer)

/**
 * Whether a span started on `fiber` now would reach anyone: a tracer other than the built-in
 * one is installed, tracing is on, and the parent span (if any) is sampled. Spans cost a clock
 * read, an attribute map and a context update each; on the hot path they are skipped otherwise.
 */
export const isTraced = (fiber: Fiber.RuntimeFiber<unknown, unknown>): boolean => {
  if (fiber.currentTracer === builtIn) return false
  if (!fiber.getFiberRef(FiberRef.currentTracerEnabled)) return false
  const parent = fiber.currentSpan
  return parent === undefined || parent.sampled
}

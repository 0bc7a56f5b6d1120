import { describe, expect, it } from "@effect/vitest"
import { Deferred, Duration, Effect, Option } from "effect"
import { timeoutOption } from "effect-lock/internal/runtime/stallSafe"
import pg from "pg"
import { adminUrl } from "./support/pg.js"
import { blockThread } from "../tools/blockThread.js"

/** Blocks the event loop, as a GC pause or a throttled container does. */
const stall = (ms: number) =>
  Effect.sync(() => {
    blockThread(ms)
  })

/** A query whose answer arrives while the event loop is blocked: it sits in the socket buffer. */
const answeredDuringStall = <A>(
  bound: (query: Effect.Effect<unknown>) => Effect.Effect<Option.Option<A>>
) =>
  Effect.acquireUseRelease(
    Effect.promise(async () => {
      const client = new pg.Client(adminUrl())
      client.on("error", () => {})
      await client.connect()
      return client
    }),
    (client) =>
      Effect.gen(function*() {
        const sent = yield* Deferred.make<void>()
        const query = Effect.zipLeft(
          Effect.promise(() => client.query("select 1")),
          Deferred.succeed(sent, undefined),
          { concurrent: true }
        )
        const fiber = yield* Effect.fork(bound(query))
        // The statement is on the wire and the timer armed before the loop blocks.
        yield* Deferred.await(sent)
        yield* Effect.yieldNow()
        yield* stall(1_500)
        return yield* fiber.await.pipe(Effect.flatten)
      }),
    (client) => Effect.promise(() => client.end())
  )

describe("stall-safe timeouts", () => {
  it.live("a 1 s timeout around a statement answered during a 1.5 s stall sees the answer", () =>
    Effect.gen(function*() {
      const outcome = yield* answeredDuringStall((query) => timeoutOption(query, Duration.seconds(1)))
      expect(Option.isSome(outcome)).toBe(true)
    }))

  it.live("control: Effect.timeout fires first and reports the answered statement as timed out", () =>
    Effect.gen(function*() {
      const outcome = yield* answeredDuringStall((query) => Effect.option(Effect.timeout(query, Duration.seconds(1))))
      expect(Option.isNone(outcome)).toBe(true)
    }))

  it.live("a statement that never answers still times out, within the duration plus two loop turns", () =>
    Effect.gen(function*() {
      const start = performance.now()
      const outcome = yield* timeoutOption(Effect.never, Duration.millis(100))
      expect(Option.isNone(outcome)).toBe(true)
      // The promised bound: the duration plus two event-loop turns (generous for a loaded machine).
      expect(performance.now() - start).toBeLessThan(1_000)
    }))

  it.live("inside an uninterruptible region, an answer ends the wait at once, not when the timer would fire", () =>
    Effect.gen(function*() {
      const start = performance.now()
      const outcome = yield* Effect.uninterruptible(
        timeoutOption(Effect.as(Effect.sleep(Duration.millis(10)), 1), Duration.seconds(5))
      )
      expect(outcome).toEqual(Option.some(1))
      // Far below the 5 s timer: the losing sleep was interrupted when the answer came.
      expect(performance.now() - start).toBeLessThan(2_000)
    }))
})

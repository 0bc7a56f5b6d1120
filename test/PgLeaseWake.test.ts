import { describe, expect, it } from "@effect/vitest"
import { Deferred, Duration, Effect, ExecutionStrategy, Exit, Option, Queue, Scope, Stream } from "effect"
import * as Wake from "effect-lock/internal/pgLeaseWake"
import { withYieldBudget } from "./support/contract.js"

/** A hub over an in-memory channel: what is notified is heard, as by a healthy listener. */
const hubWithChannel = Effect.gen(function*() {
  const channel = yield* Queue.unbounded<string>()
  const scope = yield* Effect.scope
  const hub = yield* Wake.make({
    listen: () => Stream.fromQueue(channel),
    notify: (_, payload) => Queue.offer(channel, payload),
    channel: "test",
    checkInterval: Duration.seconds(5),
    mode: "always"
  }, scope)
  return { hub, publish: (payload: string) => Queue.offer(channel, payload) }
})

const BUDGETS = Array.from({ length: 29 }, (_, i) => 12 + i)

describe("pgLeaseWake", () => {
  it.live("waiters subscribing to one name at the same time are all woken by its release", () =>
    Effect.gen(function*() {
      let stranded = 0
      for (const budget of BUDGETS) {
        const scope = yield* Scope.make()
        const { hub, publish } = yield* Scope.extend(hubWithChannel, scope)
        const wakes = yield* Effect.forEach(
          Array.from({ length: 8 }),
          () => Scope.extend(Effect.flatMap(hub.subscribe("x"), (s) => s.current), scope),
          { concurrency: "unbounded" }
        ).pipe(withYieldBudget(budget))
        yield* publish("rx")
        const woken = yield* Effect.forEach(wakes, (wake) => Effect.timeoutOption(Deferred.await(wake), Duration.millis(500)))
        stranded += woken.filter(Option.isNone).length
        yield* Scope.close(scope, Exit.void)
      }
      expect(stranded).toBe(0)
    }), { timeout: 60_000 })

  it.live("a waiter that leaves does not take the wake-ups of those still waiting on the same name", () =>
    Effect.gen(function*() {
      let stranded = 0
      for (const budget of BUDGETS) {
        const scope = yield* Scope.make()
        const { hub, publish } = yield* Scope.extend(hubWithChannel, scope)
        const leaving = yield* Effect.forEach(Array.from({ length: 4 }), () => Scope.fork(scope, ExecutionStrategy.sequential))
        const staying = yield* Effect.forEach(Array.from({ length: 4 }), () => Scope.fork(scope, ExecutionStrategy.sequential))
        const subscribe = (own: Scope.CloseableScope) => Scope.extend(hub.subscribe("x"), own)
        const subscriptions = yield* Effect.forEach([...staying, ...leaving], subscribe, { concurrency: "unbounded" }).pipe(
          withYieldBudget(budget)
        )
        yield* Effect.forEach(leaving, (own) => Scope.close(own, Exit.void), { concurrency: "unbounded" }).pipe(withYieldBudget(budget))
        const wakes = yield* Effect.forEach(subscriptions.slice(0, staying.length), (s) => s.current)
        yield* publish("rx")
        const woken = yield* Effect.forEach(wakes, (wake) => Effect.timeoutOption(Deferred.await(wake), Duration.millis(500)))
        stranded += woken.filter(Option.isNone).length
        yield* Scope.close(scope, Exit.void)
      }
      expect(stranded).toBe(0)
    }), { timeout: 60_000 })
})

/**
 * The wake hub's proof of its listener (PgLease and RedisLease share it), on an in-memory channel:
 * what counts as hearing. The real-server tests (PgLease.test.ts, RedisLease.test.ts) show that a
 * waiter's wake-up heard through LISTEN / SUBSCRIBE spares the pings, and that another process's
 * does not; these show the cases a server cannot be asked for on demand: a wake-up that did not
 * come through the listener, and one naming a request that has ended.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Clock from "effect/Clock"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Wake from "effect-lock/internal/lease/pg/wake"
import { HANDED_PREFIX, WAITER_PREFIX } from "effect-lock/internal/lease/pg/sql"
import * as Owner from "effect-lock/internal/runtime/owner"
import { waitFor } from "./support/eventually.js"

/** Short, so that a test spans several check intervals; the grace is then 150 ms. */
const CHECK = Duration.millis(300)
/** How long each case streams its wake-ups: eight check intervals (the bounds below leave room for a loaded machine's stalls). */
const STREAM_MS = 2_400
/** One wake-up every this many ms, each of a newly registered waiter (as a handoff's next waiter is). */
const EVERY_MS = 40

/**
 * A channel in memory: whatever is notified on it reaches the listener on a later turn of the
 * event loop, as a server's echo would; `pings` counts the hub's pings.
 */
const memoryChannel = () => {
  let deliver: ((payload: string) => void) | undefined
  let pings = 0
  /** While set, every notification fails to be sent (a failing pool): a ping then proves nothing either way. */
  let failing = false
  const send = (payload: string) => {
    setImmediate(() => deliver?.(payload))
  }
  const options: Wake.WakeOptions = {
    channel: "test",
    checkInterval: CHECK,
    mode: "always",
    listen: (_channel, onPayload) =>
      Effect.async<void>(() => {
        deliver = onPayload
        return Effect.sync(() => {
          if (deliver === onPayload) deliver = undefined
        })
      }),
    notify: (_channel, payload) =>
      Effect.suspend(() => {
        if (failing) return Effect.fail(new Error("the pool is failing"))
        if (payload.startsWith("p")) pings++
        send(payload)
        return Effect.void
      })
  }
  return {
    options,
    send,
    pings: () => pings,
    fail: () => {
      failing = true
    }
  }
}

/**
 * A hub on a memory channel with one waiter that waits throughout (so its watch keeps checking),
 * its listener proven by its start-up ping; then, for `STREAM_MS`, a new waiter every `EVERY_MS`
 * woken by `wakeUp`, and the pings sent meanwhile.
 */
const pingsWhile = (
  wakeUp: (hub: Wake.WakeHub, channel: ReturnType<typeof memoryChannel>, waiter: string) => Effect.Effect<void>,
  ends: "granted" | "not granted"
) =>
  Effect.gen(function*() {
    const channel = memoryChannel()
    const hub = yield* Wake.make(channel.options, yield* Owner.make)
    const givenBack: Array<string> = []
    // As PgLease's layer does: a lease handed to the place of a request that ended is given back.
    hub.onHandedToEnded?.((_name, waiter) => givenBack.push(waiter))
    yield* hub.subscribe("long", "w-long")
    yield* waitFor("the start-up ping", Effect.sync(() => channel.pings() >= 1), Duration.seconds(5))
    const before = channel.pings()
    const until = Date.now() + STREAM_MS
    for (let i = 0; Date.now() < until; i++) {
      const id = `w-${i}`
      const registered = yield* hub.subscribeNow("n", id)
      if (ends === "not granted") registered.unsubscribe(false)
      yield* wakeUp(hub, channel, id)
      if (ends === "granted") {
        // It ends once its wake-up reached it (a grant follows the wake-up it was handed by).
        yield* waitFor("the wake-up reached its waiter", Effect.map(registered.subscription.mark, (wakes) => wakes > 0), Duration.seconds(5))
        registered.unsubscribe(true)
      }
      // The stream's pace: the next waiter comes this much later (a workload, not a wait).
      yield* Effect.sleep(Duration.millis(EVERY_MS))
    }
    return { pings: channel.pings() - before, givenBack }
  })

describe("the wake hub's proof of its listener", () => {
  it.scopedLive("a wake-up of this process's waiter heard through the listener proves it: no ping while they keep coming", () =>
    Effect.gen(function*() {
      const { pings } = yield* pingsWhile((_hub, channel, id) => Effect.sync(() => channel.send(WAITER_PREFIX + id)), "granted")
      // The control of the two cases below: the same stream, heard, spares every ping (a stall of
      // a loaded machine longer than a check interval may cost one each: two are allowed).
      expect(pings).toBeLessThanOrEqual(2)
    }))

  it.scopedLive("a waiter woken in process (this process's own give-back found it) proves nothing: the listener is still pinged every check interval", () =>
    Effect.gen(function*() {
      const { pings } = yield* pingsWhile((hub, _channel, id) => Effect.sync(() => hub.wake([id])), "granted")
      // About one a check interval (8 here); counting the in-process wake-up as proof leaves 0.
      expect(pings).toBeGreaterThanOrEqual(3)
    }))

  it.scopedLive("a wake-up or a handover naming a request that has ended proves nothing (the lease handed to it is given back)", () =>
    Effect.gen(function*() {
      let handed = 0
      const { givenBack, pings } = yield* pingsWhile((_hub, channel, id) =>
        Effect.sync(() => {
          // Every other one a handover of the lease to the ended request's place.
          if (handed++ % 2 === 0) channel.send(`${HANDED_PREFIX}${id}:${handed}:${Date.now() + 30_000}`)
          else channel.send(WAITER_PREFIX + id)
        }), "not granted")
      expect(pings).toBeGreaterThanOrEqual(3)
      // Each handover to an ended request's place reached the give-back, and nothing else did.
      expect(givenBack.length).toBeGreaterThan(0)
      expect(givenBack.every((id) => Number(id.slice(2)) % 2 === 0)).toBe(true)
    }))

  it.scoped("trust decays on the hub's own clock, whatever clock the waiter that asks runs on", () =>
    Effect.gen(function*() {
      // The layer's hub on real time; the waiter asking in a fiber on TestClock (this test's
      // default Clock, never moved: it reads the epoch), as a test of an application's may.
      const live = Clock.make()
      const channel = memoryChannel()
      const hub = yield* Effect.withClock(
        Effect.flatMap(Owner.make, (owner) => Wake.make(channel.options, owner)),
        live
      )
      yield* Effect.withClock(hub.subscribe("long", "w-long"), live)
      yield* Effect.withClock(waitFor("the start-up ping", Effect.sync(() => channel.pings() >= 1), Duration.seconds(5)), live)
      yield* Effect.withClock(waitFor("the listener trusted", hub.trusted, Duration.seconds(5)), live)
      expect(yield* hub.trusted).toBe(true)
      // From now on no ping can be sent: the listener is neither proven nor disproven, and its
      // trust runs out a check interval and two echo timeouts (1 s each) after its last proof.
      channel.fail()
      const failedAt = Date.now()
      yield* Effect.withClock(waitFor("trust to run out", Effect.map(hub.trusted, (t) => !t), Duration.seconds(6)), live)
      // Read on real time it ran out when it should (2.3 s, later on a loaded machine) ...
      expect(Date.now() - failedAt).toBeGreaterThanOrEqual(2_000)
      // ... and read from the TestClock fiber it has too: before, the waiter's own clock was
      // compared with a proof dated on the hub's, and a clock at the epoch trusted it for ever.
      expect(yield* hub.trusted).toBe(false)
    }))
})

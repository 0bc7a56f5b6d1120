/**
 * Wake-ups for PgLease waiters: one LISTEN stream per backend on a dedicated connection (the
 * lane's own, or sql-pg's `PgClient.listen`), fanned out in process: a notification naming a
 * waiter wakes that waiter (releases name the waiters at the head of the queue), one naming a
 * lock wakes all its waiters (a revoke).
 *
 * Notifications are hints. A LISTEN connection can die unnoticed (sql-pg's stream hangs silently
 * when its backend dies), and behind PgBouncer in transaction mode LISTEN "succeeds" on a server
 * connection that is handed to someone else. So the listener is trusted only while it proves it
 * hears: while anyone waits, it sends itself a ping every check interval and expects the echo —
 * unless a release's notification naming one of this process's waiters came through meanwhile,
 * which proves the same. A first waiter after a quiet spell is given a short grace before the
 * ping (`IDLE_PING_GRACE`): most waits end within a few handoffs, each heard, and need none.
 * A missed echo, or the stream ending, marks it untrusted, wakes every waiter (they fall back to
 * polling), and restarts the listener with backoff. */
import * as Cause from "effect/Cause"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Queue from "effect/Queue"
import * as Crypto from "node:crypto"
import { clockMillis, sleepMillis } from "../../core/clock.js"
import { makeWaiters, type Subscription, type WakeHub } from "../waiters.js"
import type { Owner } from "../../runtime/owner.js"
import { HANDED_PREFIX, PING_PREFIX, RELEASED_PREFIX, WAITER_PREFIX } from "./sql.js"
import { within } from "../../runtime/stallSafe.js"

/** How long after its ping statement returned the echo may take before the listener is distrusted. */
const ECHO_TIMEOUT = Duration.seconds(1)
/** A (re)started listener gets this many pings to hear its first echo (LISTEN runs asynchronously). */
const STARTUP_PINGS = 5
const STARTUP_ECHO_TIMEOUT = Duration.millis(300)
/** Backoff between listener restarts. */
const RESTART_BASE = Duration.seconds(1)
const RESTART_MAX = Duration.seconds(30)
/**
 * A first waiter after a quiet spell (the last proof older than a check interval): the ping waits
 * this long (at most half the check interval), and is not sent at all when a wake-up of one of
 * this process's waiters came through first, or when nobody waits any more. A ping is a
 * statement, and a notification every listener of the channel hears; sent at once, every
 * process's first waiter of a burst pays it at the burst's busiest moment (bench/README.md).
 * Trust only sets how long waiters may sleep between looks (at most `PLACE_RETRY_MILLIS`), and
 * after a spell longer than the check interval and its echo timeouts a waiter's first sleep is
 * the untrusted one either way (a ping's echo takes a round trip); after a shorter one, a
 * listener that died in the spell is found out up to the grace later.
 */
const IDLE_PING_GRACE = Duration.millis(200)
/** In `auto` mode, listeners that never heard themselves this many times in a row mean "no LISTEN here". */
const AUTO_GIVE_UP_AFTER = 3

export interface WakeOptions {
  /**
   * Listens on the channel, handing every payload to `deliver` as it arrives; ends or fails only
   * when the listener is lost.
   */
  readonly listen: (channel: string, deliver: (payload: string) => void) => Effect.Effect<void, unknown>
  /** Sends `payload` on `channel` through the lock statements' lane. */
  readonly notify: (channel: string, payload: string) => Effect.Effect<void, unknown>
  readonly channel: string
  /** Re-check interval while anyone waits. */
  readonly checkInterval: Duration.Duration
  /** `auto` gives up listening for good when the first listener never hears itself. */
  readonly mode: "auto" | "always"
}

export type { Subscription, WakeHub } from "../waiters.js"

/**
 * Builds the hub. Nothing connects until the first subscription; from then on the listener
 * lives as long as the layer (`owner`).
 */
export const make = (options: WakeOptions, owner: Owner): Effect.Effect<WakeHub> =>
  Effect.gen(function*() {
    // The hub's one clock: every proof, registration and check is dated on it, whichever fiber asks.
    const clock = yield* Effect.clock
    const waiters = makeWaiters(() => clockMillis(clock))
    const pings = new Map<string, Deferred.Deferred<void>>()
    const kick = yield* Queue.sliding<void>(1)
    const checkMillis = Duration.toMillis(options.checkInterval)
    const graceMillis = Math.min(Duration.toMillis(IDLE_PING_GRACE), checkMillis / 2)
    const nonceBase = Crypto.randomBytes(6).toString("hex")
    let nonceCounter = 0
    let started = false
    let verifiedAt = Number.NEGATIVE_INFINITY
    let healthy = false
    /** The watch waits for a first waiter (its `kick.take` with nobody subscribed). */
    let idle = false

    const distrust = Effect.sync(() => {
      const was = healthy
      healthy = false
      // Waiters sleeping on the promise of a notification re-check now and poll from here on.
      if (was) waiters.wakeAll()
    })

    /**
     * A release found one of this process's places at the head and its notification came through:
     * the listener hears what the store that keeps this process's places sends, as a ping's echo
     * would. The proof is dated when the woken waiter was registered, not when the payload was
     * read: the release was sent after that, but maybe long before it was read (a stalled event
     * loop, a listener that has died since), and a ping's nonce cannot be that stale. It counts
     * only for a listener proven since it (re)started (`healthy`): never one distrusted.
     */
    const heardOwn = (registeredAt: number | undefined) => {
      if (registeredAt !== undefined && healthy && registeredAt > verifiedAt) verifiedAt = registeredAt
    }

    /** Handles a payload as it arrives, synchronously: a wake-up is never queued behind anything. */
    const onPayload = (payload: string) => {
      if (payload.startsWith(WAITER_PREFIX)) {
        heardOwn(waiters.wakeWaiter(payload.slice(WAITER_PREFIX.length)))
      } else if (payload.startsWith(HANDED_PREFIX)) {
        const colon = payload.indexOf(":", HANDED_PREFIX.length)
        // Every listener of the channel hears every handover: a place of another process is
        // dropped before its token and expiry are parsed (7 of 8 layers in the bench's handoff).
        if (!waiters.knows(colon < 0 ? payload.slice(HANDED_PREFIX.length) : payload.slice(HANDED_PREFIX.length, colon))) return
        const [waiter, token, expires] = payload.slice(HANDED_PREFIX.length).split(":")
        const expiresMs = Number(expires)
        // A malformed payload still wakes its waiter: its next attempt finds the lease handed to it.
        if (token !== undefined && /^[0-9]+$/.test(token) && Number.isFinite(expiresMs)) {
          heardOwn(waiters.handWaiter(waiter!, { token: BigInt(token), expiresMs }))
        } else {
          heardOwn(waiters.wakeWaiter(waiter!))
        }
      } else if (payload.startsWith(RELEASED_PREFIX)) {
        waiters.wakeName(payload.slice(RELEASED_PREFIX.length))
      } else if (payload.startsWith(PING_PREFIX)) {
        const echo = pings.get(payload.slice(PING_PREFIX.length))
        if (echo !== undefined) Deferred.unsafeDone(echo, Exit.void)
      }
    }

    /** One ping: true when its echo came back, false when it did not, undefined when it could not be sent. */
    const pingOnce = (echoTimeout: Duration.Duration): Effect.Effect<boolean | undefined> => {
      const nonce = `${nonceBase}-${nonceCounter++}`
      return Effect.gen(function*() {
        const echo = yield* Deferred.make<void>()
        pings.set(nonce, echo)
        const sent = yield* within(options.notify(options.channel, PING_PREFIX + nonce), ECHO_TIMEOUT).pipe(
          Effect.map((answered) => answered._tag === "Some"),
          Effect.catchAllCause(() => Effect.succeed(false))
        )
        if (!sent) return undefined
        // Stall-safe: an echo already in the socket when the timer fires still counts.
        const heard = yield* within(Deferred.await(echo), echoTimeout)
        return heard._tag === "Some"
      }).pipe(Effect.ensuring(Effect.sync(() => pings.delete(nonce))))
    }

    let heardThisRound = false
    const markVerified = Effect.sync(() => {
      verifiedAt = clockMillis(clock)
      healthy = true
      heardThisRound = true
    })

    /**
     * Pings a fresh listener until it hears itself (the LISTEN runs asynchronously after
     * subscribing). `deaf`: pings went out through the pool and none came back.
     */
    const startup = Effect.gen(function*() {
      let sent = 0
      for (let i = 0; i < STARTUP_PINGS; i++) {
        const ok = yield* pingOnce(STARTUP_ECHO_TIMEOUT)
        if (ok === true) return "heard" as const
        if (ok === false) sent++
        else yield* Effect.sleep(STARTUP_ECHO_TIMEOUT)
      }
      return sent > 0 ? "deaf" as const : "unreachable" as const
    })

    /** Re-checks while anyone waits; returns when an echo is missed. */
    const watch = Effect.gen(function*() {
      while (true) {
        if (waiters.size() === 0) {
          // Only an idle watch is kicked (see `onSubscribe`): a kick per acquire while it sleeps
          // toward its next check would cost a race of two fibers and a timer each (issue 23).
          idle = true
          // Reset however the wait ends (the watch is interrupted when its listener dies).
          yield* Effect.ensuring(kick.take, Effect.sync(() => {
            idle = false
          }))
          // A first waiter after a quiet spell: the ping only if no wake-up of its proves the
          // listener within the grace, and only while anyone still waits (`IDLE_PING_GRACE`).
          if (verifiedAt + checkMillis <= clockMillis(clock)) {
            yield* sleepMillis(graceMillis)
            continue
          }
        }
        const due = verifiedAt + checkMillis - clockMillis(clock)
        if (due > 0) {
          yield* Effect.raceFirst(Effect.sleep(Duration.millis(due)), kick.take)
          continue
        }
        const ok = yield* pingOnce(ECHO_TIMEOUT)
        if (ok === false) return
        if (ok === true) yield* markVerified
        // A ping that could not be sent says nothing about the listener (the pool is failing);
        // trust decays with time meanwhile, so waiters poll.
        else yield* Effect.sleep(options.checkInterval)
      }
    })

    const listening = options.listen(options.channel, onPayload)

    const supervise = Effect.gen(function*() {
      let everHeard = false
      let deafRounds = 0
      let restart = RESTART_BASE
      while (true) {
        heardThisRound = false
        let deaf = false
        const listener = yield* Effect.fork(Effect.interruptible(listening))
        yield* Effect.raceFirst(
          Effect.asVoid(Fiber.await(listener)),
          Effect.flatMap(startup, (outcome) => {
            if (outcome === "heard") return Effect.zipRight(markVerified, watch)
            deaf = outcome === "deaf"
            return Effect.void
          })
        )
        yield* distrust
        // Not awaited: closing a listener on a dead socket may take a while.
        yield* Fiber.interruptFork(listener)
        if (heardThisRound) {
          everHeard = true
          deafRounds = 0
          restart = RESTART_BASE
        } else if (deaf) {
          // Only "sent but never heard" says notifications cannot arrive here; a failing
          // connection says nothing about that.
          deafRounds++
        }
        if (!everHeard && options.mode === "auto" && deafRounds >= AUTO_GIVE_UP_AFTER) {
          yield* Effect.logInfo(
            `PgLease: notifications on channel "${options.channel}" do not arrive (a transaction pooler?); waiters poll`
          )
          return
        }
        yield* Effect.logDebug(`PgLease: restarting the listener on channel "${options.channel}"`)
        yield* Effect.sleep(restart)
        restart = Duration.min(RESTART_MAX, Duration.times(restart, 2))
      }
    })

    const ensureStarted = Effect.suspend(() => {
      if (started) return Effect.void
      started = true
      // Started by the first waiter, maybe inside its `sql.withTransaction` or a guarded body: the
      // listener is the layer's, so it inherits neither that transaction nor the body's stall watch.
      // Should it die (a defect), the next waiter starts it again, and waiters poll meanwhile; it
      // ends on its own only when it gave up listening for good (`auto`), and stays so.
      return Effect.asVoid(owner.fork(Effect.onExit(supervise, (exit) =>
        Exit.isFailure(exit) && !Cause.isInterruptedOnly(exit.cause)
          ? Effect.zipRight(distrust, Effect.sync(() => {
            started = false
          }))
          : Effect.void)))
    })

    // The watch is kicked only when it waits for a first waiter: asleep toward its next check, it
    // re-checks on time anyway.
    const onSubscribe = Effect.zipRight(ensureStarted, Effect.suspend(() => idle ? kick.offer(undefined) : Effect.void))
    const subscribe = (name: string, id: string): Effect.Effect<Subscription, never, import("effect/Scope").Scope> =>
      waiters.subscribe(name, id, onSubscribe)
    // Every waiting acquire's path: with the listener started and the watch not idle, `onSubscribe`
    // has nothing to do, and the waiter is registered in this one step.
    const subscribeNow = (name: string, id: string) =>
      Effect.suspend(() => started && !idle ? Effect.succeed(waiters.register(name, id)) : waiters.subscribeNow(name, id, onSubscribe))

    // On the hub's clock, the one every proof is dated on: the asking waiter's fiber may run on
    // another (a test's TestClock, read at the epoch, would trust a stale proof for ever).
    const trustMillis = checkMillis + Duration.toMillis(ECHO_TIMEOUT) * 2
    const trusted = Effect.sync(() => healthy && clockMillis(clock) - verifiedAt <= trustMillis)

    const wake = (ids: ReadonlyArray<string>) => {
      for (const id of ids) waiters.wakeWaiter(id)
    }

    return { subscribe, subscribeNow, trusted, wake, onHandedToEnded: waiters.onHandedToEnded }
  })

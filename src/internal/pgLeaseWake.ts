/**
 * Wake-ups for PgLease waiters: one LISTEN stream per backend on a dedicated connection (the
 * lane's own, or sql-pg's `PgClient.listen`), fanned out in process: a notification naming a
 * waiter wakes that waiter (releases name the waiters at the head of the queue), one naming a
 * lock wakes all its waiters (a revoke).
 *
 * Notifications are hints. A LISTEN connection can die unnoticed (sql-pg's stream hangs silently
 * when its backend dies), and behind PgBouncer in transaction mode LISTEN "succeeds" on a server
 * connection that is handed to someone else. So the listener is trusted only while it proves it
 * hears: while anyone waits, it sends itself a ping every check interval and expects the echo.
 * A missed echo, or the stream ending, marks it untrusted, wakes every waiter (they fall back to
 * polling), and restarts the listener with backoff. */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Queue from "effect/Queue"
import type * as Scope from "effect/Scope"
import type * as Stream from "effect/Stream"
import * as StreamOps from "effect/Stream"
import * as Crypto from "node:crypto"
import { monotonicMillis } from "./clock.js"
import { outsideTransaction } from "./pgLeaseLane.js"
import { PING_PREFIX, RELEASED_PREFIX, WAITER_PREFIX } from "./pgLeaseSql.js"
import { timeoutOption } from "./pgLeaseBound.js"

/** How long after its ping statement returned the echo may take before the listener is distrusted. */
const ECHO_TIMEOUT = Duration.seconds(1)
/** A (re)started listener gets this many pings to hear its first echo (LISTEN runs asynchronously). */
const STARTUP_PINGS = 5
const STARTUP_ECHO_TIMEOUT = Duration.millis(300)
/** Backoff between listener restarts. */
const RESTART_BASE = Duration.seconds(1)
const RESTART_MAX = Duration.seconds(30)
/** In `auto` mode, listeners that never heard themselves this many times in a row mean "no LISTEN here". */
const AUTO_GIVE_UP_AFTER = 3

export interface WakeOptions {
  /** Subscribes to the channel; the stream ends or fails when its connection is lost. */
  readonly listen: (channel: string) => Stream.Stream<string, unknown>
  /** Sends `payload` on `channel` through the lock statements' lane. */
  readonly notify: (channel: string, payload: string) => Effect.Effect<void, unknown>
  readonly channel: string
  /** Re-check interval while anyone waits. */
  readonly checkInterval: Duration.Duration
  /** `auto` gives up listening for good when the first listener never hears itself. */
  readonly mode: "auto" | "always"
}

/** What a waiter holds while it waits for one name. */
export interface Subscription {
  /** The current wake-up: take it before an attempt, await it after a failed one. */
  readonly current: Effect.Effect<Deferred.Deferred<void>>
}

export interface WakeHub {
  /**
   * Subscribes the waiter `waiter` (its place in the queue) of the lock `name`: it is woken by a
   * notification naming it, one naming the lock (a revoke), and whenever the listener is lost.
   */
  readonly subscribe: (name: string, waiter: string) => Effect.Effect<Subscription, never, Scope.Scope>
  /** True while notifications are proven to arrive: waiters may then sleep long. */
  readonly trusted: Effect.Effect<boolean>
}

/** One waiter. Its wake-up is replaced when fired; every change happens in one synchronous step. */
interface Waiter {
  readonly name: string
  deferred: Deferred.Deferred<void>
}

/**
 * Builds the hub. Nothing connects until the first subscription; from then on the listener
 * lives as long as `scope`.
 */
export const make = (options: WakeOptions, scope: Scope.Scope): Effect.Effect<WakeHub> =>
  Effect.gen(function*() {
    // Each waiter has an entry of its own, added and removed synchronously: no entry is shared,
    // so none can be replaced or counted down under a waiter still holding it.
    const byName = new Map<string, Set<Waiter>>()
    const byId = new Map<string, Waiter>()
    const pings = new Map<string, Deferred.Deferred<void>>()
    const kick = yield* Queue.sliding<void>(1)
    const checkMillis = Duration.toMillis(options.checkInterval)
    const nonceBase = Crypto.randomBytes(6).toString("hex")
    let nonceCounter = 0
    let started = false
    let verifiedAt = Number.NEGATIVE_INFINITY
    let healthy = false

    const fire = (waiter: Waiter) =>
      Effect.withFiberRuntime<void>((fiber) => {
        const previous = waiter.deferred
        waiter.deferred = Deferred.unsafeMake<void>(fiber.id())
        return Deferred.succeed(previous, undefined)
      })

    const wakeName = (name: string) => Effect.suspend(() => Effect.forEach(Array.from(byName.get(name) ?? []), fire, { discard: true }))

    const wakeWaiter = (id: string) =>
      Effect.suspend(() => {
        const waiter = byId.get(id)
        return waiter === undefined ? Effect.void : fire(waiter)
      })

    const wakeAll = Effect.suspend(() => Effect.forEach(Array.from(byId.values()), fire, { discard: true }))

    const distrust = Effect.suspend(() => {
      const was = healthy
      healthy = false
      // Waiters sleeping on the promise of a notification re-check now and poll from here on.
      return was ? wakeAll : Effect.void
    })

    const onPayload = (payload: string) => {
      if (payload.startsWith(WAITER_PREFIX)) return wakeWaiter(payload.slice(WAITER_PREFIX.length))
      if (payload.startsWith(RELEASED_PREFIX)) return wakeName(payload.slice(RELEASED_PREFIX.length))
      if (payload.startsWith(PING_PREFIX)) {
        const waiting = pings.get(payload.slice(PING_PREFIX.length))
        return waiting === undefined ? Effect.void : Deferred.succeed(waiting, undefined)
      }
      return Effect.void
    }

    /** One ping: true when its echo came back, false when it did not, undefined when it could not be sent. */
    const pingOnce = (echoTimeout: Duration.Duration): Effect.Effect<boolean | undefined> => {
      const nonce = `${nonceBase}-${nonceCounter++}`
      return Effect.gen(function*() {
        const echo = yield* Deferred.make<void>()
        pings.set(nonce, echo)
        const sent = yield* timeoutOption(options.notify(options.channel, PING_PREFIX + nonce), ECHO_TIMEOUT).pipe(
          Effect.map((answered) => answered._tag === "Some"),
          Effect.catchAllCause(() => Effect.succeed(false))
        )
        if (!sent) return undefined
        // Stall-safe: an echo already in the socket when the timer fires still counts.
        const heard = yield* timeoutOption(Deferred.await(echo), echoTimeout)
        return heard._tag === "Some"
      }).pipe(Effect.ensuring(Effect.sync(() => pings.delete(nonce))))
    }

    let heardThisRound = false
    const markVerified = Effect.flatMap(monotonicMillis, (now) =>
      Effect.sync(() => {
        verifiedAt = now
        healthy = true
        heardThisRound = true
      }))

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
        if (byId.size === 0) yield* kick.take
        const now = yield* monotonicMillis
        const due = verifiedAt + checkMillis - now
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

    const listenStream = options.listen(options.channel).pipe(StreamOps.runForEach(onPayload))

    const supervise = Effect.gen(function*() {
      let everHeard = false
      let deafRounds = 0
      let restart = RESTART_BASE
      while (true) {
        heardThisRound = false
        let deaf = false
        const listener = yield* Effect.fork(Effect.interruptible(listenStream))
        yield* Effect.raceFirst(
          Effect.asVoid(Fiber.await(listener)),
          Effect.flatMap(startup, (outcome) => {
            if (outcome === "heard") return Effect.zipRight(markVerified, watch)
            deaf = outcome === "deaf"
            return Effect.void
          })
        )
        yield* distrust
        // Not awaited: on a dead socket the stream's UNLISTEN finalizer can hang.
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
      // Started by the first waiter, maybe inside its `sql.withTransaction`: the listener outlives
      // that transaction, so it must not inherit its connection (nor send its pings on it).
      return Effect.asVoid(outsideTransaction(Effect.forkIn(Effect.interruptible(supervise), scope)))
    })

    const subscribe = (name: string, id: string): Effect.Effect<Subscription, never, Scope.Scope> =>
      Effect.acquireRelease(
        Effect.withFiberRuntime<Waiter>((fiber) => {
          const waiter: Waiter = { name, deferred: Deferred.unsafeMake<void>(fiber.id()) }
          byId.set(id, waiter)
          let named = byName.get(name)
          if (named === undefined) byName.set(name, named = new Set())
          named.add(waiter)
          return Effect.succeed(waiter)
        }).pipe(Effect.tap(() => Effect.zipRight(ensureStarted, kick.offer(undefined)))),
        (waiter) =>
          Effect.sync(() => {
            if (byId.get(id) === waiter) byId.delete(id)
            const named = byName.get(name)
            named?.delete(waiter)
            if (named?.size === 0) byName.delete(name)
          })
      ).pipe(Effect.map((waiter): Subscription => ({ current: Effect.sync(() => waiter.deferred) })))

    const trusted = Effect.map(
      monotonicMillis,
      (now) => healthy && now - verifiedAt <= checkMillis + Duration.toMillis(ECHO_TIMEOUT) * 2
    )

    return { subscribe, trusted }
  })

/**
 * Wake-ups for RedisLease waiters: pub/sub on ONE channel per prefix (`<prefix>wake`), heard on
 * one shared subscriber connection per layer and fanned out in process. The payloads are
 * PgLease's (`lease/pg/sql`): `w` + a place's id (a release found it at the head), `h` + a place's
 * id, token and expiry (a release handed it the lease), `r` + a lock name (a revoke: every waiter
 * of it), `p` + a nonce (the hub's own health check).
 *
 * The hub is PgLease's (`lease/pg/wake`) over the lane's subscriber: it trusts the subscription
 * only while it proves it hears (it publishes a ping every check interval while anyone waits and
 * expects the echo); a missed echo or a closed subscriber connection wakes every waiter, which
 * then polls (`pollInterval`) until the subscription is back.
 *
 * Subscribed before the first try: a waiter is registered only once the channel's SUBSCRIBE has
 * been acknowledged on the subscriber connection (at once when it already is), and the messages
 * that arrive before the hub's listener takes them over are buffered, not dropped: a release
 * published after a waiter's first attempt is never lost for want of a subscription. If the
 * subscription cannot be made within the bound, the waiter goes on and polls.
 */
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type { WakeHub } from "../lease/waiters.js"
import * as PgWake from "../lease/pg/wake.js"
import type { Owner } from "../runtime/owner.js"

export interface RedisWakeOptions extends Omit<PgWake.WakeOptions, "mode"> {
  /** SUBSCRIBE acknowledged on the subscriber connection, within `bound`. */
  readonly ensureSubscribed: (bound: Duration.Duration) => Effect.Effect<void, unknown>
  /** True while SUBSCRIBE is acknowledged and the subscriber connection has not closed since. */
  readonly isSubscribed: () => boolean
  /** The bound on making sure of the subscription before a waiter's first try. */
  readonly subscribeBound: Duration.Duration
}

export const make = (options: RedisWakeOptions, owner: Owner): Effect.Effect<WakeHub> =>
  Effect.map(PgWake.make({ ...options, mode: "always" }, owner), (inner): WakeHub => {
    // Never fails: without the subscription the waiter polls (the hub is not trusted meanwhile).
    const subscribed = Effect.ignore(options.ensureSubscribed(options.subscribeBound))
    // PgLease's hub with its subscribe steps replaced: every other part of it (wake, trusted, the
    // give-back of a lease handed to an ended request) is the same, whatever the hub grows.
    return {
      ...inner,
      subscribe: (name, waiter) => Effect.zipRight(subscribed, inner.subscribe(name, waiter)),
      // Every waiting acquire's path: already subscribed, nothing to make sure of first.
      subscribeNow: (name, waiter) =>
        Effect.suspend(() => options.isSubscribed() ? inner.subscribeNow(name, waiter) : Effect.zipRight(subscribed, inner.subscribeNow(name, waiter)))
    }
  })

/**
 * Wake-ups for SqliteLease waiters. SQLite has no notifications, so only this process's own
 * give-backs can wake at once: a release (or a waiter leaving its place) returns the waiters it
 * found at the head of the queue (`sqlite/dialect` reads them), and those of this process are
 * woken without waiting for their next poll. Waiters of other processes poll (`pollInterval`, jittered), so the hub never claims
 * to be trusted: every waiter keeps polling.
 */
import * as Effect from "effect/Effect"
import { makeWaiters, type WakeHub } from "../waiters.js"

export const make = (): WakeHub => {
  const waiters = makeWaiters()
  return {
    subscribe: (name, waiter) => waiters.subscribe(name, waiter, Effect.void),
    subscribeNow: (name, waiter) => waiters.subscribeNow(name, waiter, Effect.void),
    trusted: Effect.succeed(false),
    wake: (ids) => {
      for (const id of ids) waiters.wakeWaiter(id)
    }
  }
}

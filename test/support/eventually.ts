/**
 * Waiting for an observable condition on real time, with a bound: the one poll loop the test
 * files share (contract.ts's `waitUntil` is the TestClock-aware one of the contract suites).
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"

/** How often a condition is read again. */
const POLL = Duration.millis(10)

/** Reads `read` until `check` holds and returns that value; dies naming `what` and the last value after `ms`. */
export const eventually = <A, E, R>(
  what: string,
  read: Effect.Effect<A, E, R>,
  check: (a: A) => boolean,
  ms: number
): Effect.Effect<A, E, R> =>
  Effect.gen(function*() {
    const deadline = Date.now() + ms
    for (;;) {
      const value = yield* read
      if (check(value)) return value
      if (Date.now() > deadline) return yield* Effect.dieMessage(`${what}: not within ${ms} ms (last: ${String(JSON.stringify(value))})`)
      yield* Effect.sleep(POLL)
    }
  })

/** Until `check` holds, within `bound`; a failure of `check` is a defect. */
export const waitFor = (what: string, check: Effect.Effect<boolean, unknown>, bound: Duration.DurationInput): Effect.Effect<void> =>
  Effect.asVoid(eventually(what, Effect.orDie(check), (holds) => holds, Duration.toMillis(Duration.decode(bound))))

/**
 * A plain timer for the wall-clock moment `at` (ms since the epoch): the wall-clock time it ran.
 * How late it ran is how late this process could run then (a CPU-starved host), which delays a
 * timer of the library's for the same moment as much. Real time, whatever Clock the test has.
 */
export const untilWallClock = (at: number): Effect.Effect<number> =>
  Effect.promise(() => new Promise<number>((resolve) => setTimeout(() => resolve(Date.now()), Math.max(0, at - Date.now()))))

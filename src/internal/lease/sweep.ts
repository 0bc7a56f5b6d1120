/**
 * The idle-name sweep of a lease store: a fiber of the layer that, every `interval` (jittered),
 * deletes the rows of names nobody holds or waits for — and places and shared holders that ran
 * out — in rounds of at most `SWEEP_LIMIT` rows per table, round after round while a round finds
 * a full batch. A name's fencing counter does not live in its row (the store has one token source,
 * see the dialects' `sweep`), so a name that went idle leaves nothing behind once the sweep passed.
 *
 * Only tables this layer has made sure of are swept (`ready`): a layer that never locked touches
 * nothing, and a missing table is never an error here. A failed round is tried again at the next
 * interval; the sweep never delays a lock statement's answer, since it runs on its own fiber.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Random from "effect/Random"
import type { LockBackendError } from "../../LockError.js"
import type { Statement, SweepInput } from "./dialect.js"
import * as Lane from "./lane.js"
import type { Owner } from "../runtime/owner.js"

/** Rows per table deleted by one statement: short row-lock holds, while a backlog goes in a few rounds. */
export const SWEEP_LIMIT = 1_000
/** Rounds in one pass at most: a backlog larger than this goes over the next passes. */
const MAX_ROUNDS = 100
/** Default interval: an idle name's rows go within it (plus one round), well under 10 s. */
export const DEFAULT_SWEEP_INTERVAL = Duration.seconds(5)

export interface Sweepable {
  readonly statement: Statement<SweepInput, number>
  /** Whether this layer has made sure the statement's tables exist. */
  readonly ready: () => boolean
}

/**
 * `round` (one sweep statement: how many rows it deleted) again while it deletes a full batch of
 * `limit` — only a full batch suggests more is left — at most `maxRounds` times; the rows deleted.
 * A backlog larger than `limit × maxRounds` goes over the next passes.
 */
export const rounds = <E>(round: Effect.Effect<number, E>, limit: number, maxRounds: number): Effect.Effect<number, E> => {
  const go = (n: number, swept: number): Effect.Effect<number, E> =>
    Effect.flatMap(round, (deleted) => (deleted >= limit && n + 1 < maxRounds ? go(n + 1, swept + deleted) : Effect.succeed(swept + deleted)))
  return go(0, 0)
}

/**
 * `pass` forever on the layer's runtime (it stops when the layer closes), each run after a pause
 * of 0.75–1× `interval` — the first too. An interval of zero starts nothing.
 */
export const every = (interval: Duration.Duration, pass: Effect.Effect<unknown>, owner: Owner): Effect.Effect<void> => {
  const millis = Duration.toMillis(interval)
  if (millis <= 0) return Effect.void
  // Jittered: replicas started together do not sweep in step.
  const pause = Effect.flatMap(Random.next, (r) => Effect.sleep(Duration.millis(millis * (0.75 + r / 4))))
  return Effect.asVoid(owner.fork(Effect.forever(Effect.zipRight(pause, pass))))
}

/** One pass: every ready table kind, in rounds; how many rows went (errors end the pass quietly). */
export const pass = (lane: Lane.Lane, kinds: ReadonlyArray<Sweepable>, bound: Duration.Duration): Effect.Effect<number> =>
  Effect.reduce(kinds, 0, (total, kind) => {
    if (!kind.ready()) return Effect.succeed(total)
    const round = Effect.map(Lane.send(lane, undefined, kind.statement, { limit: SWEEP_LIMIT }, bound), ({ value }) => value)
    return rounds(round, SWEEP_LIMIT, MAX_ROUNDS).pipe(
      Effect.catchAll((error: LockBackendError) =>
        Effect.as(Effect.logDebug("effect-lock: idle-name sweep failed; tried again later", error), 0)
      ),
      Effect.map((swept) => total + swept)
    )
  })

/**
 * Starts the sweep on the layer's runtime; it stops when the layer closes. An interval of zero
 * turns the sweep off (the rows then stay, as before the store had one token source).
 */
export const start = (
  lane: Lane.Lane,
  kinds: ReadonlyArray<Sweepable>,
  interval: Duration.Duration,
  bound: Duration.Duration,
  owner: Owner
): Effect.Effect<void> => every(interval, pass(lane, kinds, bound), owner)

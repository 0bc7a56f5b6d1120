/**
 * `DistributedLock.schedule`: every replica steps the same Schedule; each occurrence is run by
 * the replica that wins its lock, and skipped by the others.
 *
 * What identifies an occurrence across replicas is the lock name plus its scheduled time (on the
 * wall clock, so the schedule must be aligned to it: `Schedule.cron`, `Cron`, `secondOfMinute`…).
 * One lock per name serves every occurrence (no row per occurrence); two rules make the claim of
 * an occurrence unique:
 *
 * - **held at least `atLeastFor`** after it was won (never past the next occurrence): a replica
 *   that reaches the same occurrence a little later — its clock behind, its timer late — finds the
 *   lock held and skips;
 * - **claimed within `atLeastFor` of its time** (or before the next one is due, if that is
 *   sooner): a replica that wins the lock later than that skips instead of running it again,
 *   however late it is (a GC pause, a slow start).
 *
 * Together: an occurrence runs twice only if two replicas' clocks disagree by about `atLeastFor`
 * or more. Where the backend has a clock of its own (`LockBackend.now`), every replica reads the
 * occurrence times on it, and their own clocks do not matter at all.
 */
import * as Cause from "effect/Cause"
import * as Clock from "effect/Clock"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import type * as Schedule from "effect/Schedule"
import * as ScheduleDecision from "effect/ScheduleDecision"
import * as Intervals from "effect/ScheduleIntervals"
import type { AcquireError, LockService as Service } from "./acquire.js"
import type { SingletonOptions } from "./singleton.js"
import type { Lease } from "../../Lease.js"
import type { InvalidLockName, LockLost } from "../../LockError.js"
import { monotonicMillis, sleepMillis } from "./clock.js"
import { timeoutOption } from "../runtime/stallSafe.js"
import { decodeDuration, nameProblem } from "./validate.js"

/** `atLeastFor` when none is given: half the time to the next occurrence, at most this. */
const DEFAULT_AT_LEAST_MAX = Duration.seconds(10)
/** Longest single sleep: a long wait re-reads the clock now and then, so a stepped clock is followed. */
const SLEEP_CHUNK_MS = 60_000
/** Longest wait of one claim for a session or connection (the claim window may cut it shorter). */
const CLAIM_TIMEOUT_MS = 5_000

/** Options for `schedule` (documented on `DistributedLock.ScheduleOptions`). */
export interface ScheduleOptions extends Pick<SingletonOptions, "ttl" | "retryBase" | "retryMax"> {
  readonly atLeastFor?: Duration.DurationInput | undefined
  readonly atMostFor?: Duration.DurationInput | undefined
}

/** One occurrence of a scheduled job, as the job sees it (documented on `DistributedLock.Occurrence`). */
export interface Occurrence {
  readonly name: string
  readonly scheduledAt: number
  readonly lease: Lease
}

/** What the loop needs from `DistributedLock`, passed in so this module does not import it at run time. */
export interface Deps {
  readonly lock: Service
  readonly guard: <A, E, R>(lease: Lease, self: Effect.Effect<A, E, R>) => Effect.Effect<A, E | LockLost, R>
}

/** A job given as an effect, or as a function of the occurrence it runs for. */
export type Job<E, R> = Effect.Effect<unknown, E, R> | ((occurrence: Occurrence) => Effect.Effect<unknown, E, R>)

/** The job's own failure, kept apart from the library's (a job may use locks and fail with LockLost itself). */
class JobFailed<E> {
  readonly _tag = "effect-lock/internal/JobFailed"
  constructor(readonly error: E) {}
}

interface Settings {
  readonly atLeastFor: number | undefined
  readonly atMostFor: number | undefined
  readonly ttl: Duration.DurationInput | undefined
  readonly retryBase: number
  readonly retryMax: number
}

const settingsOf = (options: ScheduleOptions | undefined): Settings => {
  const millis = (input: Duration.DurationInput | undefined) => {
    const duration = decodeDuration(input)
    return duration === undefined ? undefined : Duration.toMillis(duration)
  }
  return {
    atLeastFor: millis(options?.atLeastFor),
    atMostFor: millis(options?.atMostFor),
    ttl: options?.ttl,
    retryBase: millis(options?.retryBase) ?? 100,
    retryMax: millis(options?.retryMax) ?? 10_000
  }
}

/**
 * The wall clock the replicas compare occurrence times on: the store's where the backend has one
 * (its offset from the local clock re-read before every sleep), the local Clock otherwise.
 */
const makeWallClock = (lock: Service, name: string) => {
  let offset = 0
  const storeTime = lock.storeTime
  const local = Clock.currentTimeMillis
  const refresh: Effect.Effect<void> = storeTime === undefined
    ? Effect.void
    : Effect.flatMap(local, (before) =>
      storeTime.pipe(
        Effect.flatMap((store) =>
          Effect.map(local, (after) => {
            // Half the round trip: the store read its clock somewhere in between.
            offset = store - (before + after) / 2
          })
        ),
        // The previous offset stays: one failed read does not move every occurrence.
        Effect.catchAll((error) =>
          Effect.logDebug(`schedule "${name}": could not read the store's clock; using the last offset`, error)
        )
      ))
  return { refresh, now: Effect.map(local, (t) => t + offset) }
}

const iso = (at: number) => (Number.isFinite(at) ? new Date(at).toISOString() : String(at))

/**
 * Runs the schedule loop. Returns the schedule's last output if it ends; fails only with the
 * job's own error (after giving the lock back) or an invalid name.
 */
export const run = <Out, R2, E, R>(
  deps: Deps,
  name: string,
  schedule: Schedule.Schedule<Out, unknown, R2>,
  job: Job<E, R>,
  options: ScheduleOptions | undefined
): Effect.Effect<Out, E | InvalidLockName, R | R2> =>
  Effect.suspend(() => {
    // The backend checks its own length bound at the first claim; everything else is checked now,
    // not at the first occurrence (which may be a day away).
    const invalid = nameProblem(name, Number.MAX_SAFE_INTEGER)
    if (invalid !== undefined) return Effect.fail(invalid)
    const settings = settingsOf(options)
    const clock = makeWallClock(deps.lock, name)
    const jobFor = typeof job === "function" ? job : () => job

    const sleepUntil = (at: number): Effect.Effect<void> =>
      Effect.flatMap(Effect.zipRight(clock.refresh, clock.now), (now) =>
        now >= at ? Effect.void : Effect.zipRight(sleepMillis(Math.min(at - now, SLEEP_CHUNK_MS)), sleepUntil(at)))

    /** One occurrence, due at `at`; the next one is due at `next` (Infinity: none). */
    const occurrence = (at: number, next: number): Effect.Effect<void, E | InvalidLockName, R> => {
      const gap = next - at
      const atLeastFor = settings.atLeastFor ?? Math.min(gap / 2, Duration.toMillis(DEFAULT_AT_LEAST_MAX))
      // Claimed within atLeastFor of its time (so that the hold covers whoever comes later), and
      // never once the next occurrence is due. With atLeastFor 0 (no hold), until the next one.
      const claimBy = at + Math.min(atLeastFor > 0 ? atLeastFor : gap, gap)
      const annotate = <A, E1, R1>(self: Effect.Effect<A, E1, R1>) =>
        Effect.annotateLogs(self, { "lock.name": name, "schedule.occurrence": iso(at) })

      const claim = (failures: number): Effect.Effect<void, E | InvalidLockName, R> =>
        Effect.flatMap(clock.now, (now) => {
          if (now >= claimBy) {
            return failures === 0
              ? Effect.logDebug(`schedule "${name}": occurrence ${iso(at)} is past its claim window (reached ${Math.round(now - at)} ms after its time); skipped`)
              : Effect.logWarning(`schedule "${name}": occurrence ${iso(at)} skipped: the lock store could not be reached in time (${Math.round(now - at)} ms after its time)`)
          }
          const timeout = Duration.millis(Math.max(1, Math.min(claimBy - now, CLAIM_TIMEOUT_MS)))
          const attempt = deps.lock.tryAcquire(name, { timeout, ttl: settings.ttl }).pipe(
            Effect.flatMap(Option.match({
              onNone: () => Effect.logDebug(`schedule "${name}": occurrence ${iso(at)} runs on another replica`),
              onSome: (lease) => holding(lease)
            })),
            Effect.scoped
          )
          return Effect.catchAll(attempt, (error: AcquireError | JobFailed<E>) => {
            if (error instanceof JobFailed) return Effect.fail(error.error)
            if (error._tag === "InvalidLockName") return Effect.fail(error)
            // Logged and retried within the claim window, like `singleton`'s competing.
            const pause = Math.min(settings.retryMax, settings.retryBase * 2 ** Math.min(failures, 30))
            return Effect.logWarning(`schedule "${name}" could not compete for occurrence ${iso(at)}: ${error.message}`).pipe(
              Effect.zipRight(sleepMillis(pause)),
              Effect.zipRight(claim(failures + 1))
            )
          })
        })

      /** Won: runs the job unless the claim came too late, then holds the lock until atLeastFor. */
      const holding = (lease: Lease): Effect.Effect<void, JobFailed<E>, R> =>
        Effect.gen(function*() {
          const grantedAt = yield* monotonicMillis
          // Checked after the grant: a claim that came too late is given back without running.
          const wonAt = yield* clock.now
          if (wonAt >= claimBy) {
            return yield* Effect.logDebug(
              `schedule "${name}": occurrence ${iso(at)} was won past its claim window (${Math.round(wonAt - at)} ms after its time); skipped`
            )
          }
          yield* runJob(lease)
          // Held until atLeastFor after the grant, never past the next occurrence, and not once lost.
          const elapsed = (yield* monotonicMillis) - grantedAt
          const hold = Math.min(atLeastFor - elapsed, next - (yield* clock.now))
          // Both sides interruptible whatever the caller's region: the race ends the loser, whichever.
          if (hold > 0) yield* Effect.raceFirst(Effect.interruptible(sleepMillis(hold)), Effect.interruptible(Effect.either(lease.lost)))
        })

      const runJob = (lease: Lease): Effect.Effect<void, JobFailed<E>, R> => {
        const body = Effect.mapError(jobFor({ name, scheduledAt: at, lease }), (error) => new JobFailed(error))
        const guarded = deps.guard(lease, body)
        const bounded = settings.atMostFor === undefined
          ? Effect.asSome(guarded)
          // The job is interrupted at atMostFor; `guard` waits until it has stopped.
          : timeoutOption(guarded, Duration.millis(settings.atMostFor))
        return bounded.pipe(
          Effect.flatMap(Option.match({
            onSome: () => Effect.void,
            onNone: () =>
              Effect.logWarning(
                `schedule "${name}": the job of occurrence ${iso(at)} ran past atMostFor (${
                  Duration.format(Duration.millis(settings.atMostFor ?? 0))
                }) and was interrupted`
              )
          })),
          Effect.catchAll((error: JobFailed<E> | LockLost) =>
            error instanceof JobFailed
              ? Effect.fail(error)
              : Effect.logWarning(`schedule "${name}": ${error.message}; the job of occurrence ${iso(at)} was interrupted`)
          )
        )
      }

      return annotate(claim(0))
    }

    /** Steps the schedule at `now`: the next occurrence, or the output of a schedule that is done. */
    const step = (now: number, state: unknown) =>
      Effect.map(schedule.step(now, undefined, state), ([nextState, out, decision]) =>
        ScheduleDecision.isDone(decision)
          ? { done: true as const, out }
          : { done: false as const, at: Intervals.start(decision.intervals), state: nextState, out })

    /** One occurrence and the step after it; tail-recursive through `flatMap`, so it runs forever in constant memory. */
    const loop = (at: number, state: unknown): Effect.Effect<Out, E | InvalidLockName, R | R2> =>
      Effect.gen(function*() {
        yield* sleepUntil(at)
        // The following occurrence, stepped at this one's time (or now, if this one is late):
        // it bounds how long this one may be claimed and held.
        const following = yield* step(Math.max(at, yield* clock.now), state)
        const next = following.done ? Number.POSITIVE_INFINITY : following.at
        if (next <= at) {
          return yield* Effect.die(
            new Cause.IllegalArgumentException(
              `schedule "${name}": the next occurrence (${iso(next)}) is not after the previous one (${iso(at)}); ` +
                "use a schedule with a spacing, aligned to the wall clock (Schedule.cron, for example)"
            )
          )
        }
        yield* occurrence(at, next)
        return following
      }).pipe(Effect.flatMap((following) => following.done ? Effect.succeed(following.out) : loop(following.at, following.state)))

    return Effect.gen(function*() {
      yield* clock.refresh
      const first = yield* step(yield* clock.now, schedule.initial)
      if (first.done) return first.out
      return yield* loop(first.at, first.state)
    })
  })

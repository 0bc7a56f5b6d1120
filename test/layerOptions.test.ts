/**
 * Duration options of every layer are checked when the layer is built: a value no backend can run
 * on (not a duration, negative, zero, infinite, or past Node's longest timer) fails the build with
 * the backend's configuration error, naming the option, before any connection is opened.
 */
import { describe, expect, it } from "@effect/vitest"
import { Cause, Context, Duration, Effect, Exit, Layer, Option } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as Fence from "effect-lock/Fence"
import * as MemoryBackend from "effect-lock/MemoryBackend"
import * as PgAdvisory from "effect-lock/PgAdvisory"
import * as PgLease from "effect-lock/PgLease"
import * as SqliteLease from "effect-lock/SqliteLease"
import { useSqliteFile } from "./fixtures/sqlite-db.js"
import { PgTest, useTestDatabase } from "./support/pg.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("layer_options")
const file = useSqliteFile("layer-options")

/** Refused by every duration option: not a duration, negative, zero, infinite (cast: callers may be untyped JS). */
const ALWAYS_BAD: ReadonlyArray<unknown> = [Infinity, Duration.infinity, -1, "-1 millis", NaN, "soon", "Infinity", {}]
/** Refused by options that allow no zero. */
const ZERO: ReadonlyArray<unknown> = [0, Duration.zero]
/** Refused by options that end up in a timer: past Node's 2^31 - 1 ms. */
const PAST_TIMER: ReadonlyArray<unknown> = [Duration.days(30), Duration.millis(2 ** 31)]

const badValues = (rules: { readonly zero?: boolean; readonly timer?: boolean }) => [
  ...ALWAYS_BAD,
  ...(rules.zero === true ? [] : ZERO),
  ...(rules.timer === false ? [] : PAST_TIMER)
]

/** The typed error the layer fails to build with (never a defect). */
const buildFailure = <A, E>(layer: Layer.Layer<A, E>) =>
  Effect.gen(function*() {
    const exit = yield* Effect.exit(Effect.scoped(Layer.build(layer)))
    if (Exit.isSuccess(exit)) return yield* Effect.dieMessage("the layer was built")
    expect(Cause.isDie(exit.cause)).toBe(false)
    return Option.getOrThrow(Cause.failureOption(exit.cause)) as { _tag: string; operation: string; message: string }
  })

const expectRefused = (error: { _tag: string; operation: string; message: string }, prefix: string, option: string) => {
  expect(error._tag).toBe("LockBackendError")
  expect(error.operation).toBe("configure")
  expect(error.message).toContain(`${prefix}${option} must be`)
}

const builds = <E>(layer: Layer.Layer<DistributedLock.DistributedLock, E>) =>
  Effect.scoped(Effect.flatMap(Layer.build(layer), (context) =>
    Effect.scoped(Effect.map(Context.get(context, DistributedLock.DistributedLock).acquire("layer-options"), (lease) => lease.token))))

describe("layer duration options", () => {
  it.scopedLive("PgLease refuses each bad duration option by name, before using the database", () =>
    Effect.gen(function*() {
      const client = Layer.succeedContext(yield* Layer.build(PgTest.layer(db)))
      for (
        const [option, rules] of [
          ["ttl", { timer: false }],
          ["pollInterval", {}],
          ["listenCheckInterval", {}],
          ["statementTimeout", {}]
        ] as const
      ) {
        for (const bad of badValues(rules)) {
          const layer = PgLease.layer({ [option]: bad as Duration.DurationInput }).pipe(Layer.provide(client))
          expectRefused(yield* buildFailure(layer), "PgLease: ", option)
        }
      }
    }))

  it.scopedLive("PgLease builds on valid durations (the longest timer, a ttl above the ceiling)", () =>
    Effect.gen(function*() {
      const client = Layer.succeedContext(yield* Layer.build(PgTest.layer(db)))
      const token = yield* builds(PgLease.layer({
        ttl: Duration.days(30),
        pollInterval: "100 millis",
        listenCheckInterval: "1 second",
        statementTimeout: Duration.millis(2 ** 31 - 1)
      }).pipe(Layer.provide(client)))
      expect(token).toBeGreaterThan(0n)
    }))

  it.scopedLive("SqliteLease refuses each bad duration option by name; busyTimeout may be zero", () =>
    Effect.gen(function*() {
      for (
        const [option, rules] of [
          ["ttl", { timer: false }],
          ["pollInterval", {}],
          ["busyTimeout", { zero: true }],
          ["statementTimeout", {}]
        ] as const
      ) {
        for (const bad of badValues(rules)) {
          const layer = SqliteLease.layer({ filename: file.path, [option]: bad as Duration.DurationInput })
          expectRefused(yield* buildFailure(layer), "SqliteLease: ", option)
        }
      }
    }))

  it.scopedLive("SqliteLease builds on valid durations (busyTimeout zero, the longest timer, a ttl above the ceiling)", () =>
    Effect.gen(function*() {
      const token = yield* builds(SqliteLease.layer({
        filename: file.path,
        ttl: Duration.days(30),
        pollInterval: "20 millis",
        busyTimeout: 0,
        statementTimeout: Duration.millis(2 ** 31 - 1)
      }))
      expect(token).toBeGreaterThan(0n)
    }))

  it.scopedLive("PgAdvisory refuses each bad duration option by name, before connecting", () =>
    Effect.gen(function*() {
      // Nothing listens there: only an option error can come back at once.
      const url = "postgres://127.0.0.1:1/nowhere"
      for (const option of ["connectTimeout", "heartbeatInterval", "heartbeatTimeout"] as const) {
        for (const bad of badValues({})) {
          const layer = PgAdvisory.layer({ url, [option]: bad as Duration.DurationInput })
          expectRefused(yield* buildFailure(layer), "", option)
        }
      }
    }))

  it.scopedLive("PgAdvisory builds on valid durations", () =>
    Effect.gen(function*() {
      const token = yield* builds(PgAdvisory.layer({
        url: db.url,
        maxSessions: 1,
        connectTimeout: "5 seconds",
        heartbeatInterval: "200 millis",
        heartbeatTimeout: Duration.millis(2 ** 31 - 1)
      }))
      expect(token).toBeGreaterThan(0n)
    }))

  it.effect("MemoryBackend dies with an IllegalArgumentException naming ttl (its layer has no error type)", () =>
    Effect.gen(function*() {
      for (const bad of badValues({ timer: false })) {
        const exit = yield* Effect.exit(Effect.scoped(Layer.build(MemoryBackend.layer({ ttl: bad as Duration.DurationInput }))))
        const defect = Exit.isFailure(exit) ? Option.getOrUndefined(Cause.dieOption(exit.cause)) : undefined
        expect(Cause.isIllegalArgumentException(defect)).toBe(true)
        expect((defect as Error).message).toContain("MemoryBackend: ttl must be")
      }
    }))

  it.effect("MemoryBackend builds on a valid ttl (one above the ceiling is clamped)", () =>
    Effect.gen(function*() {
      for (const ttl of [Duration.seconds(5), Duration.days(30), "50 millis"] as const) {
        expect(yield* builds(MemoryBackend.layer({ ttl }))).toBe(1n)
      }
    }))

  it.effect("Fence refuses a bad statementTimeout by name, and builds on a valid one", () =>
    Effect.gen(function*() {
      for (const bad of badValues({})) {
        expectRefused(yield* buildFailure(Fence.layer({ statementTimeout: bad as Duration.DurationInput })), "Fence: ", "statementTimeout")
      }
      const fence = yield* Effect.scoped(Layer.build(Fence.layer({ statementTimeout: Duration.millis(2 ** 31 - 1) })))
      expect(Context.get(fence, Fence.Fence).table).toBe("effect_lock_fences")
    }))
})

/**
 * The public API's types, as a user's editor sees them: what each call needs (its requirements),
 * what it can fail with (its typed errors) and what it gives. Checked by tsc through vitest's
 * typecheck mode, which also type-checks the whole project (a type error anywhere fails the run).
 */
import { describe, expectTypeOf, it } from "vitest"
import type { ConfigError, Effect, Layer, Option, Schedule, Scope } from "effect"
import type { SqlClient } from "@effect/sql/SqlClient"
import { DistributedLock, DistributedSemaphore, Fence, LockConfig, MemoryBackend } from "effect-lock"
import type { FencingToken, Lease, LockError } from "effect-lock"
import * as PgAdvisory from "effect-lock/PgAdvisory"

type Errors<T> = T extends Effect.Effect<infer _A, infer E, infer _R> ? E : never
type Needs<T> = T extends Effect.Effect<infer _A, infer _E, infer R> ? R : never
type Gives<T> = T extends Effect.Effect<infer A, infer _E, infer _R> ? A : never

describe("DistributedLock", () => {
  it("acquire is a scoped resource: a Lease with a fencing token, failing only with what a wait can end in", () => {
    const acquired = DistributedLock.acquire("nightly")
    expectTypeOf<Gives<typeof acquired>>().toEqualTypeOf<Lease.Lease>()
    expectTypeOf<Gives<typeof acquired>["token"]>().toEqualTypeOf<FencingToken.FencingToken>()
    expectTypeOf<Needs<typeof acquired>>().toEqualTypeOf<DistributedLock.DistributedLock | Scope.Scope>()
    expectTypeOf<Errors<typeof acquired>>().toEqualTypeOf<
      LockError.LockTimeout | LockError.LockBackendError | LockError.InvalidLockName
    >()
    expectTypeOf<Gives<ReturnType<typeof DistributedLock.tryAcquire>>>().toEqualTypeOf<Option.Option<Lease.Lease>>()
  })

  it("withLock keeps the body's own types and adds LockLost, both data-first and data-last", () => {
    const body = null as unknown as Effect.Effect<number, "body-error", "body-needs">
    const last = DistributedLock.withLock("nightly")(body)
    const first = DistributedLock.withLock(body, "nightly")
    const tried = DistributedLock.tryWithLock(body, "nightly")
    expectTypeOf(first).toEqualTypeOf(last)
    // tryWithLock: the body's value when the lock was free, None when it was not.
    expectTypeOf<Gives<typeof tried>>().toEqualTypeOf<Option.Option<number>>()
    expectTypeOf<Gives<typeof last>>().toEqualTypeOf<number>()
    expectTypeOf<Needs<typeof last>>().toEqualTypeOf<"body-needs" | DistributedLock.DistributedLock>()
    expectTypeOf<Errors<typeof last>>().toEqualTypeOf<"body-error" | DistributedLock.AcquireError | LockError.LockLost>()
  })

  it("schedule hands the job its occurrence and fails only with the job's own error", () => {
    const job = (_: DistributedLock.Occurrence) => null as unknown as Effect.Effect<void, "job-error">
    const every = null as unknown as Schedule.Schedule<number>
    const scheduled = DistributedLock.schedule("nightly", every, job)
    // A finite schedule returns its last output; the lock store's errors are retried, never surfaced.
    expectTypeOf<Gives<typeof scheduled>>().toEqualTypeOf<number>()
    expectTypeOf<Errors<typeof scheduled>>().toEqualTypeOf<"job-error" | LockError.InvalidLockName>()
    expectTypeOf<Needs<typeof scheduled>>().toEqualTypeOf<DistributedLock.DistributedLock>()
  })
})

describe("DistributedSemaphore", () => {
  it("acquire gives permits with a token each; withPermits adds LockLost to the body's errors", () => {
    const permits = DistributedSemaphore.acquire("reports", { limit: 3 })
    expectTypeOf<Gives<typeof permits>["tokens"]>().toEqualTypeOf<ReadonlyArray<FencingToken.FencingToken>>()
    expectTypeOf<Needs<typeof permits>>().toEqualTypeOf<DistributedSemaphore.DistributedSemaphore | Scope.Scope>()
    const body = null as unknown as Effect.Effect<string, "body-error">
    const guarded = DistributedSemaphore.withPermits(body, "reports", { limit: 3, permits: 2 })
    expectTypeOf<Errors<typeof guarded>>().toMatchTypeOf<"body-error" | LockError.LockLost | DistributedSemaphore.AcquireError>()
    expectTypeOf<Needs<typeof guarded>>().toEqualTypeOf<DistributedSemaphore.DistributedSemaphore>()
  })
})

describe("layers and fencing", () => {
  it("backend layers provide both services; only the database ones can fail to build", () => {
    expectTypeOf(MemoryBackend.layer()).toEqualTypeOf<
      Layer.Layer<DistributedLock.DistributedLock | DistributedSemaphore.DistributedSemaphore>
    >()
    expectTypeOf<Layer.Layer.Error<ReturnType<typeof PgAdvisory.layer>>>().toEqualTypeOf<
      LockError.UnsafeConnectionPooling | LockError.LockBackendError
    >()
    expectTypeOf<Layer.Layer.Error<typeof LockConfig.layer>>().toEqualTypeOf<
      ConfigError.ConfigError | LockError.LockBackendError | LockError.UnsafeConnectionPooling
    >()
  })

  it("Fence.check runs on the caller's SqlClient and fails with StaleFencingToken carrying the tokens", () => {
    const checked = Fence.check("report", 1n as FencingToken.FencingToken)
    expectTypeOf<Needs<typeof checked>>().toEqualTypeOf<SqlClient>()
    expectTypeOf<Errors<typeof checked>>().toEqualTypeOf<LockError.StaleFencingToken | LockError.LockBackendError>()
    expectTypeOf<LockError.StaleFencingToken["presented"]>().toEqualTypeOf<FencingToken.FencingToken>()
  })
})

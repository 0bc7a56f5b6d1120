import { describe, expect, it } from "@effect/vitest"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"
import * as FencingToken from "effect-lock/FencingToken"
import * as LockError from "effect-lock/LockError"

describe("LockError", () => {
  it("messages say what happened, to which lock, with the numbers a person needs", () => {
    const timeout = new LockError.LockTimeout({ name: "nightly-cleanup", waited: Duration.millis(1500) })
    expect(timeout.message).toBe(`timed out after 1s 500ms acquiring lock "nightly-cleanup"`)
    const lost = new LockError.LockLost({ name: "job", token: FencingToken.make(7n), reason: "stolen" })
    expect(lost.message).toContain(`"job"`)
    expect(lost.message).toContain("fencing token 7")
    expect(lost.message).toContain("took it over")
    const stale = new LockError.StaleFencingToken({
      resource: "orders",
      presented: FencingToken.make(3n),
      current: FencingToken.make(5n)
    })
    expect(stale.message).toBe(`stale fencing token for "orders": presented 3, but 5 was already accepted`)
    const backend = new LockError.LockBackendError({ operation: "acquire", name: "x", cause: new Error("ECONNREFUSED") })
    expect(backend.message).toBe(`lock backend failed during acquire for lock "x": ECONNREFUSED`)
    const unnamed = new LockError.LockBackendError({ operation: "renew", cause: new Error("ECONNRESET") })
    expect(unnamed.message).toBe("lock backend failed during renew: ECONNRESET")
    const invalid = new LockError.InvalidLockName({ name: "", reason: "a lock name must not be empty" })
    expect(invalid.message).toContain("must not be empty")
  })

  it("errors are tagged values that Effect can catch by tag", () =>
    Effect.runPromise(
      Effect.gen(function*() {
        const caught = yield* Effect.fail(new LockError.LockTimeout({ name: "n", waited: Duration.zero })).pipe(
          Effect.catchTag("LockTimeout", (e) => Effect.succeed(e.name))
        )
        expect(caught).toBe("n")
      })
    ))

  it("every error encodes to JSON-safe fields and decodes back to an equal error", () => {
    const errors = [
      new LockError.LockTimeout({ name: "n", waited: Duration.millis(1500) }),
      new LockError.LockLost({ name: "job", token: FencingToken.make(2n ** 63n - 1n), reason: "stolen" }),
      new LockError.LockBackendError({ operation: "acquire", name: "x", cause: new Error("ECONNREFUSED") }),
      new LockError.InvalidLockName({ name: "", reason: "empty" }),
      new LockError.UnsafeConnectionPooling({ detail: "pooler" }),
      new LockError.StaleFencingToken({ resource: "r", presented: FencingToken.make(3n), current: FencingToken.make(5n) })
    ] as const
    const schema = Schema.Union(
      LockError.LockTimeout,
      LockError.LockLost,
      LockError.LockBackendError,
      LockError.InvalidLockName,
      LockError.UnsafeConnectionPooling,
      LockError.StaleFencingToken
    )
    const encoded = errors.map((error) => Schema.encodeSync(schema)(error))
    // What an HttpApi response body carries: bigints as decimal strings, durations in milliseconds.
    expect(JSON.parse(JSON.stringify(encoded))).toEqual([
      { _tag: "LockTimeout", name: "n", waited: 1500, retryAfter: 1 },
      { _tag: "LockLost", name: "job", token: "9223372036854775807", reason: "stolen", retryAfter: 1 },
      { _tag: "LockBackendError", operation: "acquire", name: "x", cause: { name: "Error", message: "ECONNREFUSED" }, retryAfter: 1 },
      { _tag: "InvalidLockName", name: "", reason: "empty" },
      { _tag: "UnsafeConnectionPooling", detail: "pooler" },
      { _tag: "StaleFencingToken", resource: "r", presented: "3", current: "5" }
    ])
    const decoded = encoded.map((e) => Schema.decodeUnknownSync(schema)(JSON.parse(JSON.stringify(e))))
    expect(decoded[0]).toBeInstanceOf(LockError.LockTimeout)
    expect(decoded[1]).toEqual(errors[1])
    expect(decoded[5]).toEqual(errors[5])
    expect(decoded.map((e) => e.message)).toEqual(errors.map((e) => e.message))
  })

  it("retryAfter is a hint in seconds: 1 unless given, and required to be a non-negative integer", () => {
    expect(new LockError.LockTimeout({ name: "n", waited: Duration.zero }).retryAfter).toBe(1)
    expect(new LockError.LockLost({ name: "n", token: FencingToken.make(1n), reason: "expired", retryAfter: 30 }).retryAfter).toBe(30)
    expect(() => new LockError.LockLost({ name: "n", token: FencingToken.make(1n), reason: "expired", retryAfter: -1 })).toThrow()
    // A body without the field (an older server) still decodes.
    const decoded = Schema.decodeUnknownSync(LockError.LockTimeout)({ _tag: "LockTimeout", name: "n", waited: 20 })
    expect(decoded.retryAfter).toBe(1)
    expect(Duration.toMillis(decoded.waited)).toBe(20)
  })

  it("fencing tokens are non-negative branded bigints with an order and a schema", () => {
    expect(() => FencingToken.make(-1n)).toThrow()
    expect(FencingToken.Order(FencingToken.make(1n), FencingToken.make(2n))).toBe(-1)
    const decoded = Schema.decodeUnknownSync(FencingToken.Schema)("42")
    expect(decoded).toBe(42n)
    expect(Schema.encodeSync(FencingToken.Schema)(decoded)).toBe("42")
  })
})

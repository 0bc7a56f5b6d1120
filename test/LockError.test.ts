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

  it("fencing tokens are non-negative branded bigints with an order and a schema", () => {
    expect(() => FencingToken.make(-1n)).toThrow()
    expect(FencingToken.Order(FencingToken.make(1n), FencingToken.make(2n))).toBe(-1)
    const decoded = Schema.decodeUnknownSync(FencingToken.Schema)("42")
    expect(decoded).toBe(42n)
    expect(Schema.encodeSync(FencingToken.Schema)(decoded)).toBe("42")
  })
})

import { describe, expect, it } from "@effect/vitest"
import { createHash } from "node:crypto"
import { advisoryKey } from "../src/internal/core/lockKey.js"

// Frozen wire format: SHA-256("effect-lock:v1" ‖ 0x00 ‖ namespace ‖ 0x00 ‖ name), first 8 bytes
// big-endian, signed. The vectors were computed independently (Python hashlib + struct ">q").
const vectors: ReadonlyArray<readonly [namespace: string, name: string, key: bigint]> = [
  ["", "nightly", 1384332068308176461n],
  ["", "nightly-cleanup", 6963395152417499185n],
  ["billing", "nightly", 2562720170310160530n],
  ["", "ünïcødé 🔒", 8807368046264901439n],
  ["", "a", -6450100667446515482n]
]

describe("advisory lock keys", () => {
  it.each(vectors)("namespace %j, name %j -> %s", (namespace, name, key) => {
    expect(advisoryKey(name, namespace)).toBe(key)
  })

  it("the namespace defaults to the empty string and separates key spaces", () => {
    expect(advisoryKey("nightly")).toBe(advisoryKey("nightly", ""))
    expect(advisoryKey("nightly", "billing")).not.toBe(advisoryKey("nightly"))
    // The 0x00 separator keeps ("ab", "c") and ("a", "bc") apart.
    expect(advisoryKey("c", "ab")).not.toBe(advisoryKey("bc", "a"))
  })

  it("keys are signed 64-bit integers", () => {
    const digest = createHash("sha256").update("effect-lock:v1\u0000\u0000a").digest()
    expect(digest.readBigInt64BE(0)).toBe(advisoryKey("a"))
    for (const [namespace, name] of vectors) {
      const key = advisoryKey(name, namespace)
      expect(key >= -(2n ** 63n) && key < 2n ** 63n).toBe(true)
    }
  })
})

import { createHash } from "node:crypto"

const PREFIX = "effect-lock:v1"

/**
 * The signed 64-bit advisory-lock key of a lock name: SHA-256("effect-lock:v1" ‖ 0x00 ‖
 * namespace ‖ 0x00 ‖ name), first 8 bytes big-endian. A wire format: two versions of the library
 * must agree on it, so it is frozen by test vectors.
 */
export const advisoryKey = (name: string, namespace = ""): bigint => {
  const digest = createHash("sha256")
    .update(PREFIX, "utf8")
    .update(Buffer.of(0))
    .update(namespace, "utf8")
    .update(Buffer.of(0))
    .update(name, "utf8")
    .digest()
  return digest.readBigInt64BE(0)
}

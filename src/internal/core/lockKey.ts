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

/** Keys remembered by `cachedAdvisoryKey`; past this many the memory starts over. */
const KEY_CACHE_SIZE = 4_096
const keyCache = new Map<string, bigint>()

/**
 * `advisoryKey`, remembered: a hash per call costs more than the rest of an uncontended
 * `withXactLock`'s own CPU work, and names are few and reused.
 */
export const cachedAdvisoryKey = (name: string, namespace = ""): bigint => {
  const id = `${namespace}\u0000${name}`
  let key = keyCache.get(id)
  if (key === undefined) {
    if (keyCache.size >= KEY_CACHE_SIZE) keyCache.clear()
    key = advisoryKey(name, namespace)
    keyCache.set(id, key)
  }
  return key
}

/**
 * RedisLease's key layout. Every key of one name lives in one hash slot, so that each operation's
 * script touches one slot (Redis Cluster refuses a script across slots with CROSSSLOT): the keys
 * of a name share a hash tag `{…}`. A lock name may contain any character, `{` and `}` included,
 * and Redis takes the tag from the first `{` to the next `}`: so the tag is not the name but a
 * digest of it (base64url of its SHA-256, 43 characters, never a brace), and the readable name
 * is kept in a field of the lease hash.
 *
 * Keys of the lock `name` (tag T = digest of the name, P = the prefix, default `effect-lock:`):
 * - `P{T}:lease` — hash: the exclusive holder (`owner`, `token`, `expires`, `acquired`,
 *   `application`, `host`, `pid`), the last token granted for the name (`last`), the bound of the
 *   shared holders' leases (`suntil`), and the name itself (`name`).
 * - `P{T}:queue` — sorted set: the waiting places, scored by arrival (see `scripts.ts`).
 * - `P{T}:places` — hash: each place's details (mode, expiry, since, who), JSON.
 * - `P{T}:shared` — hash: each shared holder's lease (token, expiry, acquired, who), JSON.
 *
 * Keys of the semaphore `name` (`permitScripts.ts`):
 * - `P{T}:sem` — hash: the semaphore's limit, last token, holders and waiters (JSON arrays),
 *   its readable name. Same slot as the lock of the same name, never the same key: lock and
 *   semaphore namespaces stay apart, as PgLease's tables do.
 *
 * No key outlives its use: every script that writes a key sets its expiry to cover the latest
 * time it must (a lease's end, a place's end), so an idle name leaves nothing behind.
 */
import * as Crypto from "node:crypto"

export const DEFAULT_PREFIX = "effect-lock:"
/** Longest key prefix, in UTF-8 bytes. */
export const MAX_PREFIX_BYTES = 256

/** The keys of one lock name, in the order the scripts take them (`KEYS[1..4]`). */
export interface LockKeys {
  readonly lease: string
  readonly queue: string
  readonly places: string
  readonly shared: string
}

/** The hash tag of `name`: base64url of its SHA-256 (no brace can occur in it). */
export const tagOf = (name: string): string => Crypto.createHash("sha256").update(name, "utf8").digest("base64url")

/** The lock keys of `name` under `prefix`. */
export const lockKeys = (prefix: string, name: string): LockKeys => {
  const base = `${prefix}{${tagOf(name)}}:`
  return { lease: `${base}lease`, queue: `${base}queue`, places: `${base}places`, shared: `${base}shared` }
}

/** The key of the semaphore `name` under `prefix` (its only key). */
export const semKey = (prefix: string, name: string): string => `${prefix}{${tagOf(name)}}:sem`

/** The keys as a script's KEYS list, in the documented order. */
export const keyList = (keys: LockKeys): ReadonlyArray<string> => [keys.lease, keys.queue, keys.places, keys.shared]

/** Names whose keys a `keyCache` keeps: a loop over a few names hits, a sweep over many stays bounded. */
export const KEY_CACHE_LIMIT = 1_000

/**
 * `f` memoized per name in a Map of at most `KEY_CACHE_LIMIT` entries, the oldest evicted first
 * when full: every statement of a name (acquire and release alike) would otherwise hash it with
 * SHA-256 and build its key strings again. `f` must be pure (keys depend on the prefix and name only).
 */
export const keyCache = <A>(f: (name: string) => A): (name: string) => A => {
  const cache = new Map<string, A>()
  return (name) => {
    let value = cache.get(name)
    if (value === undefined) {
      value = f(name)
      // FIFO: the Map iterates in insertion order, so its first key is the oldest entry.
      if (cache.size >= KEY_CACHE_LIMIT) cache.delete(cache.keys().next().value as string)
      cache.set(name, value)
    }
    return value
  }
}

/** A SCAN pattern matching every key of `name` (tests, inspection). */
export const namePattern = (prefix: string, name: string): string => `${escapeGlob(prefix)}\\{${tagOf(name)}\\}:*`

/** A SCAN pattern matching every key under `prefix`. */
export const prefixPattern = (prefix: string): string => `${escapeGlob(prefix)}*`

const escapeGlob = (text: string): string => text.replace(/[*?[\]\\{}^]/g, (c) => `\\${c}`)

/** The pub/sub channel of wake-ups under `prefix`. */
export const channelOf = (prefix: string): string => `${prefix}wake`

/** Why `prefix` cannot be used, or undefined. */
export const prefixProblem = (prefix: unknown): string | undefined => {
  if (typeof prefix !== "string") return "prefix must be a string"
  if (prefix.includes("{") || prefix.includes("}")) {
    return `prefix "${prefix}" must not contain "{" or "}" (the keys' hash tag would be taken from it)`
  }
  if (Buffer.byteLength(prefix, "utf8") > MAX_PREFIX_BYTES) return `prefix is longer than ${MAX_PREFIX_BYTES} bytes`
  return undefined
}

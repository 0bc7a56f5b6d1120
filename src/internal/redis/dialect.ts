/**
 * RedisLease's dialect of the lease engine: each operation's Lua script (`scripts.ts`) as a
 * typed statement. A statement's parameters are one script call, `[numKeys, ...keys, ...argv]`
 * (a renewal batch: a list of such calls, one per lease, sent in one pipeline by the lane); the
 * lane answers one row `{ reply }` holding the script's reply, and the decoders here turn it
 * into the rows (`token`, `wait`, `released`, `idx`/`outcome`, `now`) that the engine's shared
 * decoders (`lease/dialect`) read.
 *
 * Releases and revokes publish their wake-ups themselves (on `channel`), so the releasing
 * process hears them through its subscriber like every other. Semaphores' statements are the
 * scripts of `permitScripts.ts`, over the one key of a semaphore name (`Keys.semKey`).
 */
import {
  decode,
  type Dialect,
  type LockAcquireInput,
  type PermitAcquireInput,
  type RenewInput,
  type Row,
  type Statement
} from "../lease/dialect.js"
import * as Keys from "./keys.js"
import * as PermitScripts from "./permitScripts.js"
import * as Scripts from "./scripts.js"

/** One script call's parameters: the number of keys, the keys, the arguments. */
export type Call = ReadonlyArray<string | number>

const reply = (rows: ReadonlyArray<Row>): unknown => rows[0]?.["reply"]
const list = (value: unknown): ReadonlyArray<unknown> => (Array.isArray(value) ? value : [])

const call = (keys: ReadonlyArray<string>, argv: ReadonlyArray<string | number>): Call => [keys.length, ...keys, ...argv]

/**
 * Lock acquire's call: its 4 keys, then its arguments in the order `Scripts.acquire` reads them.
 * Built in one array, not as `call(keys, args)`: this is on every acquire's path.
 */
const acquireCall = (keys: ReadonlyArray<string>, i: LockAcquireInput, handing: "1" | "0"): Call => [
  4,
  keys[0]!,
  keys[1]!,
  keys[2]!,
  keys[3]!,
  i.name,
  i.owner,
  i.waiter,
  i.mode,
  Math.max(1, Math.round(i.ttlMillis)),
  Math.max(1, Math.round(i.placeMillis)),
  i.application,
  i.host,
  i.pid,
  i.takePlace ? "1" : "0",
  handing
]

/** Permit acquire's arguments, in the order `PermitScripts.acquire` reads them. */
const permitAcquireArgs = (i: PermitAcquireInput) => [
  i.name,
  i.owner,
  i.waiter,
  i.limit,
  i.permits,
  Math.max(1, Math.round(i.ttlMillis)),
  Math.max(1, Math.round(i.placeMillis)),
  i.application,
  i.host,
  i.pid,
  i.takePlace ? "1" : "0"
]

/** An array a script encoded as JSON: Lua's cjson writes an empty one as `{}`. */
const array = (value: unknown): ReadonlyArray<unknown> => (Array.isArray(value) ? value : [])

/** The SqlClient-side operator statements: never sent, RedisLease's operator functions run on a client. */
const notBuilt = <I, O>(operation: string, decoded: O): Statement<I, O> => ({
  operation,
  text: "return redis.error_reply('not available on RedisLease: use its operator functions')",
  encode: () => [0],
  decode: () => decoded
})

/** The operator statements of `RedisLease.holders`/`revoke`/`semaphores`/`revokePermits`, run on a client. */
export const operator = (prefix: string, channel: string) => ({
  revoke: {
    operation: "revoke",
    text: Scripts.revoke,
    encode: ({ name }: { readonly name: string }) => {
      const keys = Keys.lockKeys(prefix, name)
      return call([keys.lease, keys.shared], [name, channel])
    },
    decode: (rows: ReadonlyArray<Row>) => Number(reply(rows)) === 1
  } satisfies Statement<{ readonly name: string }, boolean>,
  holders: {
    operation: "holders",
    text: Scripts.holders,
    encode: ({ name }: { readonly name: string }) => call(Keys.keyList(Keys.lockKeys(prefix, name)), [name]),
    decode: (rows: ReadonlyArray<Row>) => decode.holders(list(reply(rows)).map((text) => JSON.parse(String(text)) as Row))
  },
  revokePermits: {
    operation: "revoke",
    text: PermitScripts.revoke,
    encode: ({ name }: { readonly name: string }) => call([Keys.semKey(prefix, name)], [channel]),
    decode: (rows: ReadonlyArray<Row>) => Number(reply(rows)) === 1
  } satisfies Statement<{ readonly name: string }, boolean>,
  semaphores: {
    operation: "semaphores",
    text: PermitScripts.semaphore,
    encode: ({ name }: { readonly name: string }) => call([Keys.semKey(prefix, name)], [name]),
    decode: (rows: ReadonlyArray<Row>) => {
      const text = reply(rows)
      if (text === null || text === undefined) return []
      const row = JSON.parse(String(text)) as Record<string, unknown>
      return decode.semaphores([{ ...row, holders: array(row["holders"]), waiters: array(row["waiters"]) }])
    }
  }
})

/**
 * The statements under `prefix`, waking on `channel`. `handOver`: this layer's waiting places may
 * be handed the lease by a release (off with `waitForReplicas`: a handed lease would skip the
 * WAIT that each of its grants gets, so its waiters are woken and their own acquires waited for).
 */
export const dialect = (prefix: string, channel: string, handOver = true): Dialect => {
  const handing = handOver ? "1" : "0"
  // Cached (bounded): acquire and release of a name would each hash it and build its keys again.
  const keysOf = Keys.keyCache((name) => Keys.keyList(Keys.lockKeys(prefix, name)))
  const semKeyOf = Keys.keyCache((name) => Keys.semKey(prefix, name))
  return {
    backend: "redis-lease",
    locks: {
      acquire: {
        operation: "acquire",
        text: Scripts.acquire,
        encode: (i) => acquireCall(keysOf(i.name), i, handing),
        decode: (rows) => {
          const [token, wait, handed, left, now] = list(reply(rows))
          return decode.lockAcquire([{ token: token ?? null, wait: wait ?? null, handed: handed ?? 0, left: left ?? null, now: now ?? null }])
        }
      },
      release: {
        operation: "release",
        text: Scripts.release,
        encode: (i) => {
          const keys = keysOf(i.name)
          // In one array, as `acquireCall`: `call(keys, args)` would build two more per release.
          return [4, keys[0]!, keys[1]!, keys[2]!, keys[3]!, i.name, i.owner ?? "", i.waiter ?? "", channel]
        },
        // The script publishes the wake-ups itself: nothing to wake from the answer.
        decode: (rows) => decode.release(() => [])([{ released: list(reply(rows))[0] ?? 0 }])
      },
      renew: {
        operation: "renew",
        text: Scripts.renew,
        // One call per lease, in batch order (the lane pipelines them).
        encode: (grants: ReadonlyArray<RenewInput>) =>
          grants.map((g) => {
            // keyList order is [lease, queue, places, shared]: the renew script takes lease and shared as its KEYS[1] and KEYS[2].
            const keys = keysOf(g.name)
            return call([keys[0]!, keys[3]!], [g.owner, g.token.toString(), Math.max(1, Math.round(g.ttlMillis)), g.mode ?? "exclusive"])
          }),
        decode: (rows) => decode.renew(list(reply(rows)).map((outcome, idx) => ({ idx, outcome })))
      },
      // Nothing to create: keys come into being with their first write.
      ensureTable: [],
      // Nothing to sweep: keys expire by themselves (the sweep is off unless asked for).
      sweep: { operation: "sweep", text: Scripts.sweep, encode: () => [0], decode: (rows) => Number(reply(rows) ?? 0) }
    },
    permits: {
      acquire: {
        operation: "acquire",
        text: PermitScripts.acquire,
        encode: (i) => call([semKeyOf(i.name)], permitAcquireArgs(i)),
        decode: (rows) => {
          const [token, current, wait] = list(reply(rows))
          return decode.permitAcquire([{ token: token ?? null, current: current ?? null, wait: wait ?? null }])
        }
      },
      release: {
        operation: "release",
        text: PermitScripts.release,
        encode: (i) => call([semKeyOf(i.name)], [i.owner ?? "", i.waiter ?? "", channel]),
        // The script publishes the wake-ups itself: nothing to wake from the answer.
        decode: (rows) => decode.release(() => [])([{ released: list(reply(rows))[0] ?? 0 }])
      },
      renew: {
        operation: "renew",
        text: PermitScripts.renew,
        // One call per grant, in batch order (the lane pipelines them); a grant's token is its first.
        encode: (grants: ReadonlyArray<RenewInput>) =>
          grants.map((g) => call([semKeyOf(g.name)], [g.owner, g.token.toString(), Math.max(1, Math.round(g.ttlMillis))])),
        decode: (rows) => decode.renew(list(reply(rows)).map((outcome, idx) => ({ idx, outcome })))
      },
      ensureTable: [],
      // Nothing to sweep: the key expires by itself.
      sweep: { operation: "sweep", text: Scripts.sweep, encode: () => [0], decode: (rows) => Number(reply(rows) ?? 0) }
    },
    // Not through the SqlClient: RedisLease's operator functions run these on a client.
    operator: {
      holders: notBuilt("holders", []),
      present: notBuilt("inspect", true),
      revoke: notBuilt("revoke", false),
      semaphores: notBuilt("semaphores", []),
      revokePermits: notBuilt("revoke", false)
    },
    now: { operation: "now", text: Scripts.now, encode: () => [0], decode: (rows) => decode.now([{ now: reply(rows) }]) },
    retryCreate: () => false
  }
}

/** A wake-up through the lock connection, to check that the subscriber still hears. */
export const ping: Statement<{ readonly channel: string; readonly payload: string }, void> = {
  operation: "notify",
  text: Scripts.publish,
  encode: ({ channel, payload }) => [0, channel, payload],
  decode: decode.nothing
}

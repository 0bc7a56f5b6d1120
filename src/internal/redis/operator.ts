/**
 * RedisLease's operator functions, on any ioredis client the caller gives (not the layer's):
 * the live leases of a name and a semaphore in use, and an operator's revokes. Each is one
 * script, EVALSHA then EVAL on NOSCRIPT, bounded. `list` finds every name in use with SCAN (by
 * the keys' tags: it never knows the names beforehand) and reads each with those scripts; given
 * a Cluster, it does so on every master (each with its own node client) and merges the lists.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type { Cluster, Redis } from "ioredis"
import { LockBackendError } from "../../LockError.js"
import type { Row, Statement } from "../lease/dialect.js"
import type { StoredLease, StoredSemaphore } from "../lease/stored.js"
import * as Dialect from "./dialect.js"
import * as Keys from "./keys.js"
import * as Scripts from "./scripts.js"
import { isCluster, shaOf } from "./lane.js"

const BOUND = Duration.seconds(5)

export interface OperatorOptions {
  readonly prefix?: string | undefined
}

/** `attempt` with the client-side bound of every operator command. */
const bounded = <A>(operation: string, name: string | undefined, attempt: () => Promise<A>): Effect.Effect<A, LockBackendError> =>
  // Interruptible whatever the caller's region (a finalizer): the bound abandons the promise.
  Effect.interruptible(Effect.tryPromise({
    try: attempt,
    catch: (cause) => new LockBackendError({ operation, ...(name === undefined ? {} : { name }), cause })
  })).pipe(
    Effect.timeoutFail({
      duration: BOUND,
      onTimeout: () =>
        new LockBackendError({ operation, ...(name === undefined ? {} : { name }), cause: new Error("no answer from Redis within 5 s") })
    })
  )

const run = <I, O>(client: Redis, statement: Statement<I, O>, input: I, name: string): Effect.Effect<O, LockBackendError> =>
  bounded(statement.operation, name, async () => {
    const args = statement.encode(input) as ReadonlyArray<string | number>
    const reply = await client.call("evalsha", [shaOf(statement.text), ...args]).catch((error: unknown) => {
      if (error instanceof Error && error.message.startsWith("NOSCRIPT")) return client.call("eval", [statement.text, ...args])
      throw error
    })
    return statement.decode([{ reply } as Row])
  })

const statements = (options: OperatorOptions | undefined) => {
  const prefix = options?.prefix ?? Keys.DEFAULT_PREFIX
  return Dialect.operator(prefix, Keys.channelOf(prefix))
}

/** The live leases of `name` (exclusive, or each shared holder), read on `client`. */
export const holders = (client: Redis, name: string, options?: OperatorOptions): Effect.Effect<ReadonlyArray<StoredLease>, LockBackendError> =>
  run(client, statements(options).holders, { name }, name)

/** Takes the lock `name` away from whoever holds it and wakes its waiters; whether a lease was held. */
export const revoke = (client: Redis, name: string, options?: OperatorOptions): Effect.Effect<boolean, LockBackendError> =>
  run(client, statements(options).revoke, { name }, name)

/** The semaphore `name` if it is in use (a live holder or waiter; else none), read on `client`. */
export const semaphores = (
  client: Redis,
  name: string,
  options?: OperatorOptions
): Effect.Effect<ReadonlyArray<StoredSemaphore>, LockBackendError> => run(client, statements(options).semaphores, { name }, name)

/** Takes every permit of the semaphore `name` away and wakes the waiters that now fit; whether a permit was held. */
export const revokePermits = (client: Redis, name: string, options?: OperatorOptions): Effect.Effect<boolean, LockBackendError> =>
  run(client, statements(options).revokePermits, { name }, name)

// ---------------------------------------------------------------- listing every name in use

/** How many keys each SCAN step looks at. */
const SCAN_COUNT = 1000
/** Default cap on the names of each kind (locks, semaphores) that a listing reads. */
export const DEFAULT_LIST_LIMIT = 10_000
/** Bound on a whole listing (SCAN steps and reads), beside each command's own bound. */
const LIST_BOUND = Duration.seconds(60)
/** How many names are read at once (ioredis pipelines them on the one connection). */
const READ_CONCURRENCY = 8

export interface ListOptions extends OperatorOptions {
  /** Most names of each kind to read (default 10,000); `truncated` says when more were found. */
  readonly limit?: number | undefined
}

/** Who waits for a lock name: live places by mode, and when the oldest arrived (server ms). */
export interface LockWaiting {
  readonly exclusive: number
  readonly shared: number
  readonly since: number | null
}

/** A lock name that is held or waited for. */
export interface LockInUse {
  /** The readable name, or `{tag}` when the name's keys do not keep it (a name only waited for). */
  readonly name: string
  /** The name's hash tag (digest) in its keys. */
  readonly tag: string
  /** Whether `name` is the readable name (else it is the tag). */
  readonly named: boolean
  /** Its live leases: the exclusive holder, or each shared holder. */
  readonly holders: ReadonlyArray<StoredLease>
  readonly waiting: LockWaiting
}

/** Every name in use under a prefix, read on one server or on every master of a Cluster. */
export interface Listing {
  /** The server's clock (ms since the epoch) when the listing began (on a Cluster, the earliest master's). */
  readonly serverTime: number
  readonly locks: ReadonlyArray<LockInUse>
  readonly semaphores: ReadonlyArray<StoredSemaphore>
  /** True when more names were found than `limit`: the lists are incomplete. */
  readonly truncated: boolean
}

const escapeGlob = (text: string): string => text.replace(/[*?[\]\\{}^]/g, (c) => `\\${c}`)
/** A tag as `Keys.tagOf` makes it; anything else matching the pattern is not ours. */
const TAG = /^[A-Za-z0-9_-]+$/

/** The tags of the keys `<prefix>{<tag>}:<suffix>` on the server, up to `limit` (then `more`). */
const scanTags = (client: Redis, prefix: string, suffix: string, limit: number) =>
  Effect.gen(function*() {
    const pattern = `${escapeGlob(prefix)}\\{*\\}:${suffix}`
    const head = `${prefix}{`
    const tail = `}:${suffix}`
    const tags = new Set<string>()
    let cursor = "0"
    do {
      const [next, keys] = yield* bounded("inspect", undefined, () => client.scan(cursor, "MATCH", pattern, "COUNT", SCAN_COUNT))
      cursor = next
      for (const key of keys) {
        if (!key.startsWith(head) || !key.endsWith(tail)) continue
        const tag = key.slice(head.length, key.length - tail.length)
        // SCAN may repeat a key; the set keeps each tag once.
        if (TAG.test(tag)) tags.add(tag)
      }
    } while (cursor !== "0" && tags.size <= limit)
    return { tags: Array.from(tags).sort(), more: cursor !== "0" || tags.size > limit }
  })

const decoders = Dialect.operator(Keys.DEFAULT_PREFIX, Keys.channelOf(Keys.DEFAULT_PREFIX))

const tagKeys = (prefix: string, tag: string): Keys.LockKeys => {
  const base = `${prefix}{${tag}}:`
  return { lease: `${base}lease`, queue: `${base}queue`, places: `${base}places`, shared: `${base}shared` }
}

const waitingOf: Statement<Keys.LockKeys, { readonly name: string | null } & LockWaiting> = {
  operation: "inspect",
  text: Scripts.waiting,
  encode: (keys) => [3, keys.lease, keys.queue, keys.places],
  decode: (rows) => {
    const reply = rows[0]?.["reply"]
    const [name, exclusive, shared, since] = Array.isArray(reply) ? reply : []
    return {
      name: typeof name === "string" ? name : null,
      exclusive: Number(exclusive ?? 0),
      shared: Number(shared ?? 0),
      since: since === null || since === undefined ? null : Number(since)
    }
  }
}

/** The existing `holders` script, over the keys of a tag (its name argument is only echoed back). */
const holdersOf: Statement<{ readonly keys: Keys.LockKeys; readonly name: string }, ReadonlyArray<StoredLease>> = {
  operation: "holders",
  text: Scripts.holders,
  encode: ({ keys, name }) => [4, ...Keys.keyList(keys), name],
  decode: decoders.holders.decode
}

/** The existing `semaphore` script, over the key of a tag (its name argument is only echoed back). */
const semaphoreOf: Statement<{ readonly key: string; readonly name: string }, ReadonlyArray<StoredSemaphore>> = {
  operation: "semaphores",
  text: decoders.semaphores.text,
  encode: ({ key, name }) => [1, key, name],
  decode: decoders.semaphores.decode
}

const readLock = (client: Redis, prefix: string, tag: string) =>
  Effect.gen(function*() {
    const keys = tagKeys(prefix, tag)
    const found = yield* run(client, waitingOf, keys, `{${tag}}`)
    const name = found.name ?? `{${tag}}`
    // A second script, not one atomic read: an inspection is a snapshot either way, and a lease
    // granted in between shows with the waiters counted just before.
    const holders = yield* run(client, holdersOf, { keys, name }, name)
    const waiting = { exclusive: found.exclusive, shared: found.shared, since: found.since }
    return holders.length === 0 && waiting.exclusive + waiting.shared === 0
      ? []
      : [{ name, tag, named: found.name !== null, holders, waiting } satisfies LockInUse]
  })

const readSemaphore = (client: Redis, prefix: string, tag: string) =>
  Effect.gen(function*() {
    const key = `${prefix}{${tag}}:sem`
    const name = yield* bounded("semaphores", `{${tag}}`, () => client.hget(key, "name"))
    return yield* run(client, semaphoreOf, { key, name: name ?? `{${tag}}` }, name ?? `{${tag}}`)
  })

const byName = (a: { readonly name: string }, b: { readonly name: string }) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0)

/** The listing of the one server `client` talks to (the caller checked the prefix and bounds the whole). */
const listServer = (client: Redis, prefix: string, limit: number): Effect.Effect<Listing, LockBackendError> =>
  Effect.gen(function*() {
    const [seconds, micros] = yield* bounded("inspect", undefined, () => client.time())
    const serverTime = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000)
    const [leases, queues, sems] = yield* Effect.all([
      scanTags(client, prefix, "lease", limit),
      scanTags(client, prefix, "queue", limit),
      scanTags(client, prefix, "sem", limit)
    ])
    const lockTags = Array.from(new Set([...leases.tags, ...queues.tags])).sort()
    const locks = yield* Effect.forEach(lockTags.slice(0, limit), (tag) => readLock(client, prefix, tag), {
      concurrency: READ_CONCURRENCY
    })
    const semaphores = yield* Effect.forEach(sems.tags.slice(0, limit), (tag) => readSemaphore(client, prefix, tag), {
      concurrency: READ_CONCURRENCY
    })
    return {
      serverTime,
      locks: locks.flat().sort(byName),
      semaphores: semaphores.flat().sort(byName),
      truncated: leases.more || queues.more || sems.more || lockTags.length > limit || sems.tags.length > limit
    } satisfies Listing
  })

/** The master nodes' own clients of a Cluster, once it is connected and knows its slots. */
const mastersOf = (cluster: Cluster): Effect.Effect<ReadonlyArray<Redis>, LockBackendError> =>
  Effect.gen(function*() {
    // The node list is filled only once the Cluster is ready (slots read): a lazy one connects
    // here, and TIME resolves only when it is ready (and proves a node answers).
    yield* bounded("inspect", undefined, async () => {
      if (cluster.status === "wait") await cluster.connect()
      return cluster.time()
    })
    const masters = cluster.nodes("master")
    if (masters.length === 0) {
      return yield* Effect.fail(new LockBackendError({ operation: "inspect", cause: new Error("the Cluster knows no master node") }))
    }
    return masters
  })

/** The listings of several masters as one: each kind merged by name and cut at `limit`, the earliest clock. */
const merge = (parts: ReadonlyArray<Listing>, limit: number): Listing => {
  // A name's keys are in one slot, so on one master; during a slot migration SCAN may find them
  // on two, and the first found is kept.
  const locks = new Map<string, LockInUse>()
  const semaphores = new Map<string, StoredSemaphore>()
  for (const part of parts) {
    for (const lock of part.locks) if (!locks.has(lock.tag)) locks.set(lock.tag, lock)
    for (const sem of part.semaphores) if (!semaphores.has(sem.name)) semaphores.set(sem.name, sem)
  }
  const allLocks = Array.from(locks.values()).sort(byName)
  const allSemaphores = Array.from(semaphores.values()).sort(byName)
  return {
    serverTime: Math.min(...parts.map((part) => part.serverTime)),
    locks: allLocks.slice(0, limit),
    semaphores: allSemaphores.slice(0, limit),
    truncated: parts.some((part) => part.truncated) || allLocks.length > limit || allSemaphores.length > limit
  }
}

/** A listing and how many servers it read: 1, or every master of a Cluster. */
export interface NodesListing {
  readonly listing: Listing
  readonly nodes: number
}

/** `list`, also saying how many servers were listed (the CLI reports it). */
export const listNodes = (client: Redis | Cluster, options?: ListOptions): Effect.Effect<NodesListing, LockBackendError> => {
  const prefix = options?.prefix ?? Keys.DEFAULT_PREFIX
  const limit = Math.max(1, Math.floor(options?.limit ?? DEFAULT_LIST_LIMIT))
  return Effect.gen(function*() {
    const problem = Keys.prefixProblem(prefix)
    if (problem !== undefined) {
      return yield* Effect.fail(new LockBackendError({ operation: "configure", cause: new Error(problem) }))
    }
    if (!isCluster(client)) return { listing: yield* listServer(client, prefix, limit), nodes: 1 }
    const masters = yield* mastersOf(client)
    // Each master with its own node client: SCAN and the tag's scripts run on the node that has the keys.
    const parts = yield* Effect.forEach(masters, (node) => listServer(node, prefix, limit), { concurrency: "unbounded" })
    return { listing: merge(parts, limit), nodes: masters.length }
  }).pipe(
    // Interruptible whatever the caller's region: the bound cuts the listing off.
    Effect.interruptible,
    Effect.timeoutFail({
      duration: LIST_BOUND,
      onTimeout: () => new LockBackendError({ operation: "inspect", cause: new Error("listing took longer than 60 s") })
    })
  )
}

/**
 * Every lock name held or waited for and every semaphore in use under the prefix, on the server
 * `client` talks to, or with a Cluster on every master (its node clients, once the Cluster is
 * ready), merged: names found with SCAN, each read with its own scripts on the node that found
 * it. Names are read one by one, not at one instant; `limit` caps each merged kind.
 */
export const list = (client: Redis | Cluster, options?: ListOptions): Effect.Effect<Listing, LockBackendError> =>
  Effect.map(listNodes(client, options), (found) => found.listing)

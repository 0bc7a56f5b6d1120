/**
 * The lane RedisLease's scripts travel on, over three ioredis connections:
 * - lock commands (acquire, release, give-backs, health pings): the backend's own connection,
 *   or the application's client when it passes one (`client`);
 * - renewals: a connection nothing else uses, so a renewal never queues behind a lock command
 *   or the application's commands (Redis answers one connection's commands in order);
 * - wake-ups: a subscriber connection, SUBSCRIBEd to the one channel of the prefix.
 *
 * Every script goes as EVALSHA (its SHA-1, computed once per text); a server that does not know
 * it (NOSCRIPT: after a restart, a failover or `SCRIPT FLUSH`) gets it again as EVAL, which also
 * caches it. Every command has a client-side bound: one that has not answered in time fails with
 * `LockBackendError { operation }`; when nothing at all came back on an own connection since the
 * command was sent (a frozen server, a connection silently dropped) that connection is dropped
 * and reconnected, its pending commands failed — never resent by ioredis
 * (`autoResendUnfulfilledCommands: false`), since a resent acquire could grant a lease nobody
 * waits for any more. The application's client is never disconnected by the backend.
 *
 * The application's client may be an ioredis `Cluster`: the own connections are then Clusters
 * too (copies of its nodes and options), scripts are routed by their keys (one slot per name),
 * a renewal batch goes as one call per lease (a pipeline must stay on one node), and the
 * subscriber is the Cluster's (PUBLISH reaches every node's subscribers).
 *
 * With `replicas` (the opt-in `waitForReplicas`), a script that granted a lease is followed by
 * `WAIT count timeout` on the same connection, and so is a renewal batch that renewed anything:
 * fewer acknowledgements fail the command (the engine gives a failed grant back; a failed
 * renewal does not move the holder's deadline).
 *
 * `ioredis` is loaded when a layer is built, not when `effect-lock` is imported: a missing
 * package is a `LockBackendError` saying what to install.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type * as Scope from "effect/Scope"
import type { Cluster, ClusterOptions, Redis, RedisOptions } from "ioredis"
import * as Crypto from "node:crypto"
import { LockBackendError } from "../../LockError.js"
import { monotonicMillis } from "../core/clock.js"
import type { Lane, Sent } from "../lease/lane.js"
import type { Row } from "../lease/dialect.js"
import { stallSafeTimer } from "../runtime/stallSafe.js"
import type { Call } from "./dialect.js"

/** The ioredis constructor. */
export type RedisConstructor = new(...args: Array<unknown>) => Redis

let loading: Promise<RedisConstructor> | undefined

const importIoredis = (): Promise<unknown> => import("ioredis")

/**
 * Loads ioredis (once per process) with `importer`; fails with a `LockBackendError` naming the
 * package when it cannot be loaded. A later call tries again.
 */
export const loadWith = (importer: () => Promise<unknown>): Effect.Effect<RedisConstructor, LockBackendError> =>
  Effect.tryPromise({
    try: () => {
      const attempt = importer === importIoredis ? (loading ??= importer().then(constructorOf)) : importer().then(constructorOf)
      return attempt.catch((error: unknown) => {
        if (importer === importIoredis) loading = undefined
        throw error
      })
    },
    catch: (cause) =>
      new LockBackendError({
        operation: "configure",
        cause: new Error(`RedisLease needs the "ioredis" package (npm install ioredis): ${String(cause)}`)
      })
  })

const constructorOf = (module: unknown): RedisConstructor => {
  const m = module as { readonly Redis?: unknown; readonly default?: unknown }
  const ctor = m.Redis ?? m.default
  if (typeof ctor !== "function") throw new Error("the ioredis module has no Redis constructor")
  return ctor as RedisConstructor
}

/** ioredis, loaded on first use. */
export const load: Effect.Effect<RedisConstructor, LockBackendError> = loadWith(importIoredis)

const shas = new Map<string, string>()
/** The SHA-1 of a script's text, computed once. */
export const shaOf = (text: string): string => {
  let sha = shas.get(text)
  if (sha === undefined) {
    sha = Crypto.createHash("sha1").update(text, "utf8").digest("hex")
    shas.set(text, sha)
  }
  return sha
}

const isNoScript = (error: unknown): boolean => error instanceof Error && error.message.startsWith("NOSCRIPT")

/** A server's answer that is an error (ioredis's ReplyError): the server is alive and answered. */
const isReply = (error: unknown): boolean => error instanceof Error && error.name === "ReplyError"

const failed = (operation: string, name: string | undefined, cause: unknown) =>
  cause instanceof LockBackendError ? cause : new LockBackendError({ operation, ...(name === undefined ? {} : { name }), cause })

const timedOut = (operation: string, name: string | undefined, bound: number) =>
  new LockBackendError({
    operation,
    ...(name === undefined ? {} : { name }),
    cause: new Error(`the ${operation} command got no answer from Redis within ${bound} ms`)
  })

/** A client the lane sends on: one server's connection, or a Cluster's (one connection per node). */
export type Client = Redis | Cluster

/** True for an ioredis Cluster (`isCluster`, set by ioredis on both kinds). */
export const isCluster = (client: Client): client is Cluster => (client as { readonly isCluster?: boolean }).isCluster === true

/**
 * The opt-in WAIT after a write that grants (`waitForReplicas`): WAIT `count` `timeoutMillis`
 * on the connection that sent it, and the grant fails unless `count` replicas acknowledged.
 */
export interface ReplicaWait {
  readonly count: number
  readonly timeoutMillis: number
  /** Whether the reply of `operation`'s script granted a lease (then it waits for the replicas). */
  readonly grants: (operation: string, reply: unknown) => boolean
}

/** WAIT for `replicas` on `connection`; resolves with the number that acknowledged. */
const waitReplicas = (connection: Connection, replicas: ReplicaWait): Promise<number> =>
  // On the connection that wrote: WAIT counts the writes this connection made before it.
  (connection.client.call("wait", [replicas.count, replicas.timeoutMillis]) as Promise<unknown>).then((acknowledged) => {
    connection.lastAnswer = performance.now()
    return Number(acknowledged)
  })

const tooFewReplicas = (operation: string, name: string | undefined, acknowledged: number, replicas: ReplicaWait) =>
  new LockBackendError({
    operation,
    ...(name === undefined ? {} : { name }),
    cause: new Error(
      `WAIT: ${acknowledged} of ${replicas.count} replicas acknowledged the ${operation} within ${replicas.timeoutMillis} ms`
    )
  })

/** One connection as the lane uses it. */
interface Connection {
  readonly client: Client
  /** The backend's own (dropped when stuck, quit at the end), or the application's (never touched). */
  readonly own: boolean
  /** performance.now() of the latest answer (or server error) on it. */
  lastAnswer: number
}

/** Drops an own connection on which nothing has come back since `sentAt`: ioredis reconnects. */
const dropIfStuck = (connection: Connection, sentAt: number) => {
  if (connection.own && connection.lastAnswer < sentAt) connection.client.disconnect(true)
}

/**
 * One script call on `connection`, `done` once with the reply or the error (EVALSHA, then EVAL
 * on NOSCRIPT), within `bound` ms. Returns the abandon.
 */
const evalNow = (
  connection: Connection,
  operation: string,
  name: string | undefined,
  text: string,
  params: ReadonlyArray<unknown>,
  bound: number,
  replicas: ReplicaWait | undefined,
  done: (error: LockBackendError | undefined, reply?: unknown) => void
): () => void => {
  const args = params as Call
  const sentAt = performance.now()
  let settled = false
  const finish = (error: LockBackendError | undefined, reply?: unknown) => {
    if (settled) return
    settled = true
    cancel()
    done(error, reply)
  }
  const cancel = stallSafeTimer(bound, () => {
    if (settled) return
    settled = true
    dropIfStuck(connection, sentAt)
    done(timedOut(operation, name, bound))
  })
  const refused = (error: unknown) => {
    if (isReply(error)) connection.lastAnswer = performance.now()
    finish(failed(operation, name, error))
  }
  const answered = (reply: unknown) => {
    connection.lastAnswer = performance.now()
    if (replicas === undefined || settled || !replicas.grants(operation, reply)) return finish(undefined, reply)
    // A grant on the primary alone is lost if it fails over before replicating: count it only
    // once `count` replicas acknowledged; otherwise it fails, and the engine gives it back.
    waitReplicas(connection, replicas).then(
      (acknowledged) =>
        acknowledged >= replicas.count ? finish(undefined, reply) : finish(tooFewReplicas(operation, name, acknowledged, replicas)),
      refused
    )
  }
  // The arguments spread into ioredis's own rest array (it flattens them into one more anyway):
  // `call(command, [sha, ...args])` built a third copy per command.
  connection.client.call("evalsha", shaOf(text), ...args).then(answered, (error: unknown) => {
    if (!isNoScript(error)) return refused(error)
    connection.lastAnswer = performance.now()
    if (settled) return
    connection.client.call("eval", text, ...args).then(answered, refused)
  })
  return () => {
    settled = true
    cancel()
  }
}

/** `evalNow` as an Effect (the reply as the one row `{ reply }`), with the monotonic time before sending. */
const evalEffect = <A extends object>(
  connection: Connection,
  operation: string,
  name: string | undefined,
  text: string,
  params: ReadonlyArray<unknown>,
  bound: Duration.Duration,
  replicas: ReplicaWait | undefined
): Effect.Effect<Sent<A>, LockBackendError> =>
  Effect.flatMap(monotonicMillis, (sentAt) =>
    Effect.async<Sent<A>, LockBackendError>((resume) => {
      const abandon = evalNow(connection, operation, name, text, params, Duration.toMillis(bound), replicas, (error, reply) =>
        resume(error === undefined ? Effect.succeed({ rows: [{ reply } as unknown as A], sentAt }) : Effect.fail(error)))
      return Effect.sync(abandon)
    }))

/**
 * A renewal batch: one script call per lease (`params`: the calls) in one pipeline, EVALSHA,
 * then EVAL for those the server did not know; the replies in batch order as the row `{ reply }`.
 * On a Cluster the calls go one by one, concurrently: a pipeline must stay on one node, and the
 * batch's names are spread over the slots. With `replicas`, a batch that renewed anything is
 * confirmed by WAIT on the same connection; fewer acknowledgements fail the batch (a renewal the
 * replicas may not have must not push the holder's deadline).
 */
const renewBatch = <A extends object>(
  connection: Connection,
  text: string,
  params: ReadonlyArray<unknown>,
  bound: Duration.Duration,
  replicas: ReplicaWait | undefined
): Effect.Effect<Sent<A>, LockBackendError> =>
  Effect.flatMap(monotonicMillis, (sentAt) =>
    Effect.async<Sent<A>, LockBackendError>((resume) => {
      const calls = params as ReadonlyArray<Call>
      const started = performance.now()
      let settled = false
      const finish = (exit: Effect.Effect<Sent<A>, LockBackendError>) => {
        if (settled) return
        settled = true
        cancel()
        resume(exit)
      }
      const millis = Duration.toMillis(bound)
      const cancel = stallSafeTimer(millis, () => {
        if (settled) return
        settled = true
        dropIfStuck(connection, started)
        resume(Effect.fail(timedOut("renew", undefined, millis)))
      })
      const sha = shaOf(text)
      const replies: Array<unknown> = new Array(calls.length)
      const client = connection.client
      const run = (indices: ReadonlyArray<number>, command: "evalsha" | "eval"): Promise<Array<[Error | null, unknown]> | null> =>
        isCluster(client)
          ? Promise.all(indices.map((i) =>
            (client.call(command, [command === "evalsha" ? sha : text, ...calls[i]!]) as Promise<unknown>).then(
              (reply): [Error | null, unknown] => [null, reply],
              (error: Error): [Error | null, unknown] => [error, null]
            )
          ))
          : client.pipeline(indices.map((i) => [command, command === "evalsha" ? sha : text, ...calls[i]!])).exec()
      run(calls.map((_, i) => i), "evalsha").then(async (results) => {
        connection.lastAnswer = performance.now()
        if (results === null) throw new Error("the renewal pipeline was discarded")
        const unknown: Array<number> = []
        results.forEach(([error, reply], i) => {
          if (error === null) replies[i] = reply
          else if (isNoScript(error)) unknown.push(i)
          else throw error
        })
        if (unknown.length > 0 && !settled) {
          const again = await run(unknown, "eval")
          connection.lastAnswer = performance.now()
          if (again === null) throw new Error("the renewal pipeline was discarded")
          again.forEach(([error, reply], j) => {
            if (error !== null) throw error
            replies[unknown[j]!] = reply
          })
        }
        if (replicas !== undefined && !settled && replies.includes("renewed")) {
          const acknowledged = await waitReplicas(connection, replicas)
          if (acknowledged < replicas.count) return finish(Effect.fail(tooFewReplicas("renew", undefined, acknowledged, replicas)))
        }
        finish(Effect.succeed({ rows: [{ reply: replies } as unknown as A], sentAt }))
      }).catch((error: unknown) => finish(Effect.fail(failed("renew", undefined, error))))
      return Effect.sync(() => {
        settled = true
        cancel()
      })
    }))

/** What the layer passes to open its connections. */
export interface ConnectOptions {
  readonly url?: string | undefined
  readonly redis?: RedisOptions | undefined
  /** The application's client, for lock commands (never quit or disconnected by the backend); a Cluster too. */
  readonly client?: Client | undefined
  /** WAIT for replicas after each grant and renewal (opt-in). */
  readonly replicas?: ReplicaWait | undefined
  /** The channel wake-ups go on. */
  readonly channel: string
  readonly connectTimeout: Duration.Duration
  readonly connectionName: string
  /**
   * Told once, after the first grant, when the server may evict keys (a `maxmemory` with a policy
   * other than `noeviction`): every lock key carries an expiry, so an eviction can drop a live lease.
   */
  readonly onEvictingServer?: ((policy: string, maxmemory: string) => void) | undefined
}

/**
 * The server's eviction settings, read once on `client` (bounded; a server that refuses CONFIG, as
 * managed ones may, or a Cluster, says nothing): `told` when it evicts.
 */
const checkEviction = (client: Client, bound: number, told: (policy: string, maxmemory: string) => void): void => {
  if (isCluster(client)) return
  const read = (key: string) =>
    (client.call("config", ["get", key]) as Promise<Array<string>>).then((pair) => (Array.isArray(pair) ? String(pair[1] ?? "") : ""))
  let settled = false
  const cancel = stallSafeTimer(bound, () => (settled = true))
  Promise.all([read("maxmemory-policy"), read("maxmemory")]).then(([policy, maxmemory]) => {
    if (settled) return
    settled = true
    cancel()
    if (policy !== "" && policy !== "noeviction" && maxmemory !== "" && maxmemory !== "0") told(policy, maxmemory)
  }, () => {
    // CONFIG refused or the connection failed: nothing known, nothing said.
    settled = true
    cancel()
  })
}

/** The options the backend's own connections always get, over the application's. */
const ownSettings = (connectTimeout: Duration.Duration, connectionName: string): RedisOptions => ({
  // Nothing connects until the first command: a layer builds while Redis is down.
  lazyConnect: true,
  // A command sent while reconnecting waits for the connection (its bound still applies) ...
  enableOfflineQueue: true,
  // ... but fails at the first failed reconnection rather than being sent much later.
  maxRetriesPerRequest: 1,
  // A command whose connection dropped is failed, never resent: its outcome is handled by the engine.
  autoResendUnfulfilledCommands: false,
  // The subscriber re-subscribes itself (`subscribed` below), so it knows when it hears again.
  autoResubscribe: false,
  connectTimeout: Math.max(1, Math.round(Duration.toMillis(connectTimeout))),
  connectionName
})

/** The lane, and how the hub's subscription is made sure of. */
export interface RedisLane extends Lane {
  /** SUBSCRIBE acknowledged on the subscriber connection (at once when it already is); bounded by `bound`. */
  readonly ensureSubscribed: (bound: Duration.Duration) => Effect.Effect<void, LockBackendError>
  /** True while SUBSCRIBE is acknowledged and the subscriber connection has not closed since: `ensureSubscribed` would do nothing. */
  readonly isSubscribed: () => boolean
}

/**
 * Opens the lane's connections (lazily: nothing connects before the first command), closed with
 * the scope; the application's client is reused for lock commands and never closed.
 */
export const open = (Ctor: RedisConstructor, options: ConnectOptions): Effect.Effect<RedisLane, LockBackendError, Scope.Scope> =>
  Effect.gen(function*() {
    const settings = ownSettings(options.connectTimeout, options.connectionName)
    const make = (role: string): Client => {
      const own = { ...settings, connectionName: `${options.connectionName}:${role}` }
      const app = options.client
      const client = app !== undefined
        ? isCluster(app) ? duplicateCluster(app, own) : app.duplicate(own)
        : options.url !== undefined
        ? new Ctor(options.url, { ...options.redis, ...own })
        : new Ctor({ ...options.redis, ...own })
      // Errors reach the commands that meet them; without a listener ioredis prints every one.
      client.on("error", () => {})
      return client
    }
    const opened: Array<Client> = []
    yield* Effect.addFinalizer(() => Effect.promise(() => Promise.all(opened.map(close))))
    const commands: Connection = options.client !== undefined
      ? { client: options.client, own: false, lastAnswer: 0 }
      : { client: make("commands"), own: true, lastAnswer: 0 }
    if (commands.own) opened.push(commands.client)
    const renewals: Connection = { client: make("renewals"), own: true, lastAnswer: 0 }
    opened.push(renewals.client)
    const subscriber = make("subscriber")
    opened.push(subscriber)

    // --- the subscriber: one channel, payloads handed to whoever listens (buffered meanwhile) ---
    let sink: { readonly deliver: (payload: string) => void } | undefined
    const buffered: Array<string> = []
    let subscribed = false
    let subscribing: Promise<void> | undefined
    const lost = new Set<() => void>()
    subscriber.on("message", (channel: string, message: string) => {
      if (channel !== options.channel) return
      if (sink !== undefined) return sink.deliver(message)
      // Between SUBSCRIBE's acknowledgement and the hub's listener taking over: kept, in order.
      if (buffered.length < BUFFER_LIMIT) buffered.push(message)
    })
    subscriber.on("close", () => {
      subscribed = false
      for (const notify of Array.from(lost)) notify()
    })
    const subscribe = (): Promise<void> => {
      if (subscribed) return Promise.resolve()
      subscribing ??= subscriber.subscribe(options.channel).then(
        () => {
          subscribing = undefined
          subscribed = subscriber.status === "ready"
        },
        (error: unknown) => {
          subscribing = undefined
          throw error
        }
      )
      return subscribing
    }
    const ensureSubscribed: RedisLane["ensureSubscribed"] = (bound) =>
      Effect.suspend(() => {
        if (subscribed) return Effect.void
        return Effect.async<void, LockBackendError>((resume) => {
          let settled = false
          const cancel = stallSafeTimer(Duration.toMillis(bound), () => {
            if (settled) return
            settled = true
            resume(Effect.fail(timedOut("subscribe", undefined, Duration.toMillis(bound))))
          })
          subscribe().then(
            () => {
              if (settled) return
              settled = true
              cancel()
              resume(Effect.void)
            },
            (error: unknown) => {
              if (settled) return
              settled = true
              cancel()
              resume(Effect.fail(failed("subscribe", undefined, error)))
            }
          )
          return Effect.sync(() => {
            settled = true
            cancel()
          })
        })
      })

    const listen: Lane["listen"] = (_channel, deliver) =>
      Effect.zipRight(
        ensureSubscribed(options.connectTimeout),
        Effect.async<void, LockBackendError>((resume) => {
          // Its own entry: a previous listener's late clean-up never takes this one's place.
          const mine = { deliver }
          sink = mine
          for (const message of buffered.splice(0)) deliver(message)
          const onLost = () => resume(Effect.fail(failed("listen", undefined, new Error("the subscriber connection closed"))))
          lost.add(onLost)
          // Already lost between the subscription and now: the hub restarts the listener.
          if (!subscribed) onLost()
          return Effect.sync(() => {
            lost.delete(onLost)
            if (sink === mine) sink = undefined
          })
        })
      )

    return {
      kind: options.client !== undefined ? "application" : "own",
      run: <A extends object>(
        operation: string,
        name: string | undefined,
        text: string,
        params: ReadonlyArray<unknown>,
        bound: Duration.Duration
      ) => evalEffect<A>(commands, operation, name, text, params, bound, options.replicas),
      runNow: (operation, name, text, params, bound, done) =>
        evalNow(commands, operation, name, text, params, Duration.toMillis(bound), options.replicas, (error, reply) =>
          error === undefined ? done(undefined, [{ reply } as Row]) : done(error)),
      renew: <A extends object>(text: string, params: ReadonlyArray<unknown>, bound: Duration.Duration) =>
        renewBatch<A>(renewals, text, params, bound, options.replicas),
      listen,
      // The renewal connection is made at the first grant, before the first renewal needs it.
      prepareRenewals: () => {
        if (renewals.client.status !== "wait") return
        renewals.client.connect().catch(() => {})
        // Once, on the renewal connection (never queued behind lock commands): does the server evict?
        if (options.onEvictingServer !== undefined) {
          checkEviction(renewals.client, Duration.toMillis(options.connectTimeout), options.onEvictingServer)
        }
      },
      ensureSubscribed,
      isSubscribed: () => subscribed
    }
  })

/** Messages kept while nobody listens yet (wake-ups are hints: beyond this, waiters poll). */
const BUFFER_LIMIT = 1_000
/** How long closing waits for QUIT before it drops a connection. */
const QUIT_WAIT_MS = 1_000

/**
 * A connection of the backend's own to the application's Cluster: the same nodes and options,
 * with the lane's settings — the Cluster's own (lazy, offline queue) and each node connection's.
 */
const duplicateCluster = (cluster: Cluster, own: RedisOptions): Cluster =>
  cluster.duplicate([], {
    lazyConnect: true,
    enableOfflineQueue: true,
    redisOptions: { ...cluster.options.redisOptions, ...own }
  } satisfies Partial<ClusterOptions>)

/** QUIT, or a plain disconnect when it does not answer in time (or never connected). */
const close = (client: Client): Promise<void> =>
  new Promise<void>((resolve) => {
    if (client.status === "wait" || client.status === "end") {
      client.disconnect()
      return resolve()
    }
    const timer = setTimeout(() => {
      client.disconnect()
      resolve()
    }, QUIT_WAIT_MS)
    client.quit().then(
      () => {
        clearTimeout(timer)
        resolve()
      },
      () => {
        clearTimeout(timer)
        client.disconnect()
        resolve()
      }
    )
  })

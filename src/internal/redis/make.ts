/**
 * From `RedisLease.Options` to a running backend: options validated and defaulted, ioredis
 * loaded, the lane's connections opened (lazily), wake-ups through pub/sub (`wake.ts`), and the
 * lease engine assembled with Redis's dialect — attempts, give-backs, renewals, interruption,
 * shutdown and stall handling are the engine's, unchanged, for locks and semaphores alike.
 * `wrapLane` lets tests observe or delay the lane's commands.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import { identity } from "effect/Function"
import * as Redacted from "effect/Redacted"
import type * as Scope from "effect/Scope"
import type { Cluster, Redis, RedisOptions } from "ioredis"
import * as Os from "node:os"
import type { LockAndSemaphoreBackend } from "../../LockBackend.js"
import { LockBackendError } from "../../LockError.js"
import { TIMER } from "../core/validate.js"
import type { LeaseGrant } from "../lease/attempt.js"
import * as Engine from "../lease/engine.js"
import * as Lanes from "../lease/lane.js"
import * as LeaseOptions from "../lease/options.js"
import type { PermitLeaseGrant } from "../lease/permits.js"
import * as Owner from "../runtime/owner.js"
import * as Dialect from "./dialect.js"
import * as Keys from "./keys.js"
import * as Lane from "./lane.js"
import * as Wake from "./wake.js"

/** The options of `RedisLease.layer`; documented there. */
export interface Options {
  readonly url?: string | Redacted.Redacted<string> | undefined
  readonly redis?: RedisOptions | undefined
  readonly client?: Redis | Cluster | undefined
  readonly ttl?: Duration.DurationInput | undefined
  readonly prefix?: string | undefined
  readonly pollInterval?: Duration.DurationInput | undefined
  readonly statementTimeout?: Duration.DurationInput | undefined
  readonly sweepInterval?: Duration.DurationInput | undefined
  readonly applicationName?: string | undefined
  readonly listenCheckInterval?: Duration.DurationInput | undefined
  readonly waitForReplicas?: {
    readonly count: number
    readonly timeout?: Duration.DurationInput | undefined
  } | undefined
}

/** WAIT's default timeout: a second, and always within the command's bound. */
export const DEFAULT_REPLICA_TIMEOUT = Duration.seconds(1)

/** A script's reply that granted a lease: an acquire whose first element (the token) is set. */
const grants = (operation: string, reply: unknown): boolean =>
  operation === "acquire" && Array.isArray(reply) && reply[0] !== null && reply[0] !== undefined && reply[0] !== false

export const DEFAULT_POLL = Duration.millis(500)
export const DEFAULT_CHECK = Duration.seconds(5)
/** Keys expire by themselves: nothing to sweep unless asked for. */
export const DEFAULT_SWEEP_INTERVAL = Duration.zero

/** Option errors name RedisLease; there are no tables (the prefix is checked on its own). */
export const options = LeaseOptions.resolver("RedisLease", (input: string) => input)

export const makeBackend = (
  input?: Options,
  wrapLane: (lane: Lanes.Lane) => Lanes.Lane = identity,
  importer?: () => Promise<unknown>
): Effect.Effect<LockAndSemaphoreBackend<LeaseGrant, PermitLeaseGrant>, LockBackendError, Scope.Scope> =>
  Effect.gen(function*() {
    const prefix = input?.prefix ?? Keys.DEFAULT_PREFIX
    const badPrefix = Keys.prefixProblem(prefix)
    if (badPrefix !== undefined) return yield* options.configError(badPrefix)
    // A Redacted url (Config.redacted) is opened here only, never logged.
    const url = input?.url !== undefined && Redacted.isRedacted(input.url) ? Redacted.value(input.url) : input?.url
    if (url !== undefined && (typeof url !== "string" || url.length === 0)) {
      return yield* options.configError("url must be a non-empty string (or a Redacted one)")
    }
    if (input?.client !== undefined && (input.url !== undefined || input.redis !== undefined)) {
      return yield* options.configError("give either client or url/redis options: the layer's own connections copy the client's settings")
    }
    // The keys are the library's: a client that rewrites them would put them where no other process looks.
    const clientPrefix = (input?.client as { readonly options?: { readonly keyPrefix?: string } } | undefined)?.options?.keyPrefix
    if (clientPrefix !== undefined && clientPrefix !== "") {
      return yield* options.configError(`the client has keyPrefix "${clientPrefix}": pass a client without it and use the prefix option`)
    }
    if ((input?.redis as { readonly keyPrefix?: string } | undefined)?.keyPrefix) {
      return yield* options.configError("redis.keyPrefix is not supported: use the prefix option")
    }
    // All before any connection is opened: a bad option fails the build at once.
    const timings = yield* options.timings(input, { poll: DEFAULT_POLL, check: DEFAULT_CHECK, sweep: DEFAULT_SWEEP_INTERVAL })
    const { checkInterval, statementTimeout } = timings
    const application = input?.applicationName ?? LeaseOptions.DEFAULT_APPLICATION
    const replicas = yield* replicaWait(input, statementTimeout)
    const Ctor = yield* (importer === undefined ? Lane.load : Lane.loadWith(importer))
    const channel = Keys.channelOf(prefix)
    // Before the lane: the layer's own fibers are stopped only after everything else has closed.
    const owner = yield* Owner.make
    const redisLane = yield* Lane.open(Ctor, {
      url,
      redis: input?.redis,
      client: input?.client,
      replicas,
      channel,
      connectTimeout: statementTimeout,
      connectionName: connectionName(application),
      onEvictingServer: (policy, maxmemory) =>
        owner.unsafeFork(Effect.logWarning(
          `RedisLease: the server evicts keys (maxmemory ${maxmemory}, maxmemory-policy ${policy}): under memory pressure it may ` +
            "drop a live lease and let a second holder in. Set maxmemory-policy noeviction for the server that holds the locks."
        ))
    })
    const lane = wrapLane(redisLane)
    const hub = yield* Wake.make({
      listen: redisLane.listen!,
      notify: (channel, payload) => Lanes.send(lane, undefined, Dialect.ping, { channel, payload }, statementTimeout),
      channel,
      checkInterval,
      ensureSubscribed: redisLane.ensureSubscribed,
      isSubscribed: redisLane.isSubscribed,
      subscribeBound: statementTimeout
    }, owner)
    const backend = yield* Engine.make(lane, {
      ...timings,
      application,
      host: Os.hostname(),
      // Nothing to create: keys come into being with their first write.
      createTable: false,
      // Scripts run one at a time: a release sees every place taken before it, and its PUBLISH
      // reaches a waiter subscribed before its first try. No look again after taking a place.
      placesSeenByEveryRelease: true
    }, Dialect.dialect(prefix, channel, replicas === undefined), hub, owner)
    return backend
  })

/** CLIENT SETNAME allows no spaces or newlines: the application name with those replaced. */
const connectionName = (application: string): string => application.replace(/[^\x21-\x7e]/g, "_").slice(0, 64) || "effect-lock"

/** `waitForReplicas` checked: a positive whole count, a timeout of at least 1 ms below the command bound. */
const replicaWait = (input: Options | undefined, statementTimeout: Duration.Duration) =>
  Effect.gen(function*() {
    const wanted = input?.waitForReplicas
    if (wanted === undefined) return undefined
    if (!Number.isSafeInteger(wanted.count) || wanted.count < 1) {
      return yield* options.configError("waitForReplicas.count must be a whole number of replicas, at least 1")
    }
    // WAIT has no key: on a Cluster, ioredis would send it to any node, not the one that wrote.
    if (input?.client !== undefined && Lane.isCluster(input.client)) {
      return yield* options.configError("waitForReplicas is not supported with a Cluster client")
    }
    const fallback = Duration.min(DEFAULT_REPLICA_TIMEOUT, Duration.times(statementTimeout, 0.5))
    const timeout = yield* options.duration("waitForReplicas.timeout", wanted.timeout, fallback, TIMER)
    // WAIT 0 blocks for ever; at or past the command's bound the bound would cut every WAIT short.
    const timeoutMillis = Math.round(Duration.toMillis(timeout))
    if (timeoutMillis < 1 || !Duration.lessThan(timeout, statementTimeout)) {
      return yield* options.configError("waitForReplicas.timeout must be at least 1 ms and shorter than statementTimeout")
    }
    return { count: wanted.count, timeoutMillis, grants } satisfies Lane.ReplicaWait
  })

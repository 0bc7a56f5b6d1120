/**
 * A throw-away Redis for RedisLease's tests: `redis-server` from the PATH (CI installs it with
 * apt in `.ci/run`; tests never install anything), started on a free loopback port with
 * persistence off, stopped at the end of the file. With `REDIS_URL` set, that server is used
 * instead (and the tests that restart the server skip). Without either, the Redis test files
 * skip, printing why.
 *
 * Fault, replica and cluster tests start servers of their own (`startRedisServer`: a free port,
 * a directory of its own, AOF on request; `startRedisCluster`: masters joined by
 * `redis-cli --cluster create`), never the shared one, and stop them when they end; they need
 * `redis-server` on the PATH even when REDIS_URL is set (`noRedisServer`).
 */
import { spawn, spawnSync } from "node:child_process"
import * as Effect from "effect/Effect"
import { Redis } from "ioredis"
import { afterAll, beforeAll, describe } from "vitest"
import * as Keys from "../../src/internal/redis/keys.js"
import { freeLoopbackPort } from "../../tools/embeddedPostgres.js"
import { type LaunchOptions, launchRedis, redisServerPath } from "../../tools/redisServer.js"

export { redisServerPath }

const START_TIMEOUT_MS = 10_000

const externalUrl = (): string | undefined => {
  const url = process.env["REDIS_URL"]
  return url === undefined || url === "" ? undefined : url
}

/** Why the Redis tests skip, or undefined when they can run. */
export const redisSkipReason = (): string | undefined =>
  externalUrl() === undefined && redisServerPath() === undefined
    ? "redis-server not found on PATH and REDIS_URL not set; skipping RedisLease tests (apt-get install redis-server)"
    : undefined

let warned = false
/** True when the Redis tests cannot run (after printing why once). */
export const noRedis = (): boolean => {
  const reason = redisSkipReason()
  if (reason !== undefined && !warned) {
    warned = true
    console.warn(reason)
  }
  return reason !== undefined
}

let warnedServer = false
/** True when no `redis-server` can be started here (after printing why once): tests of own servers skip. */
export const noRedisServer = (): boolean => {
  const missing = redisServerPath() === undefined
  if (missing && !warnedServer) {
    warnedServer = true
    console.warn("redis-server not found on PATH; skipping the RedisLease tests that start servers of their own (apt-get install redis-server)")
  }
  return missing
}

/** `describe` that skips its tests, printing why, when there is no Redis to run them on. */
export const describeWithRedis = (name: string, f: () => void): void => {
  describe.skipIf(noRedis())(name, f)
}

/** A running server of the tests. */
export interface TestRedis {
  readonly url: string
  readonly port: number
  /** The server's process id (the current one after a restart); undefined on an external server. */
  readonly pid: () => number | undefined
  /**
   * Stops the server (SIGTERM, or `signal`: SIGKILL for a crash) and starts it again on the same
   * port with the same settings: without persistence every key is lost; with AOF
   * (`appendfsync always`) every acknowledged write comes back.
   */
  readonly restart: ((signal?: NodeJS.Signals) => Promise<void>) | undefined
  /** Sends a signal to the server process (SIGSTOP/SIGCONT: a frozen server); undefined on an external server. */
  readonly signal: ((signal: NodeJS.Signals) => void) | undefined
  /** Stops the server and deletes its directory. */
  readonly stop: () => Promise<void>
}

/** How a test's own server runs. */
export type ServerOptions = LaunchOptions

/**
 * Starts `redis-server` on a free loopback port, in a directory of its own (deleted by `stop`),
 * persistence off unless `aof`; rejects when it does not answer PING.
 */
export const startRedisServer = async (options?: ServerOptions): Promise<TestRedis> => {
  const binary = redisServerPath()
  if (binary === undefined) throw new Error("redis-server not found on PATH")
  const server = await launchRedis(binary, options)
  return {
    url: `redis://127.0.0.1:${server.port}`,
    port: server.port,
    pid: server.pid,
    restart: async (signal) => {
      await server.halt(signal)
      await server.launch()
    },
    signal: server.signal,
    stop: server.stop
  }
}

/**
 * The Redis of one test file: started in `beforeAll` (or `REDIS_URL`), stopped in `afterAll`.
 * `restart` is undefined on an external server (its tests skip).
 */
export const useRedis = () => {
  let server: TestRedis | undefined
  beforeAll(async () => {
    if (noRedis()) return
    const external = externalUrl()
    server = external !== undefined
      ? {
        url: external,
        port: Number(new URL(external).port || 6379),
        pid: () => undefined,
        restart: undefined,
        signal: undefined,
        stop: async () => {}
      }
      : await startRedisServer()
  })
  afterAll(async () => {
    await server?.stop()
  })
  return {
    url: (): string => {
      if (server === undefined) throw new Error("no Redis server: the tests should have been skipped")
      return server.url
    },
    restart: (): ((signal?: NodeJS.Signals) => Promise<void>) | undefined => server?.restart,
    signal: (): ((signal: NodeJS.Signals) => void) | undefined => server?.signal,
    external: (): boolean => externalUrl() !== undefined
  }
}

/** Runs `redis-cli` with `args`; rejects with its output when it fails or takes over `ms`. */
export const redisCli = (args: ReadonlyArray<string>, ms = 20_000): Promise<string> =>
  new Promise((resolve, reject) => {
    const child = spawn("redis-cli", args, { stdio: ["ignore", "pipe", "pipe"] })
    let output = ""
    child.stdout?.on("data", (chunk) => (output += String(chunk)))
    child.stderr?.on("data", (chunk) => (output += String(chunk)))
    const timer = setTimeout(() => child.kill("SIGKILL"), ms)
    child.on("error", (error) => {
      clearTimeout(timer)
      reject(error)
    })
    child.on("exit", (code) => {
      clearTimeout(timer)
      if (code === 0) resolve(output)
      else reject(new Error(`redis-cli ${args.join(" ")} exited with ${code}: ${output}`))
    })
  })

/** A Redis Cluster of the tests: its nodes (each a server of its own) and how to stop them all. */
export interface TestCluster {
  readonly nodes: ReadonlyArray<TestRedis>
  readonly stop: () => Promise<void>
}

/**
 * A cluster of `size` masters (no replicas): servers started in parallel with
 * `--cluster-enabled yes`, each with its own directory (its `nodes.conf`) and a free bus port,
 * joined by `redis-cli --cluster create`; resolves once every node reports `cluster_state:ok`.
 */
export const startRedisCluster = async (size = 3): Promise<TestCluster> => {
  const busPorts = await Promise.all(Array.from({ length: size }, () => freeLoopbackPort()))
  const started = await Promise.allSettled(busPorts.map((bus) =>
    startRedisServer({
      // The bus port is chosen too: the default (port + 10000) may be taken or out of range.
      args: ["--cluster-enabled", "yes", "--cluster-port", `${bus}`, "--cluster-node-timeout", "2000"]
    })
  ))
  const nodes = started.flatMap((s) => (s.status === "fulfilled" ? [s.value] : []))
  const stop = async () => {
    await Promise.all(nodes.map((node) => node.stop()))
  }
  try {
    const failed = started.find((s) => s.status === "rejected")
    if (failed !== undefined) throw (failed as PromiseRejectedResult).reason
    await redisCli([
      "--cluster", "create", ...nodes.map((node) => `127.0.0.1:${node.port}`),
      "--cluster-replicas", "0", "--cluster-yes"
    ])
    const deadline = Date.now() + START_TIMEOUT_MS
    for (const node of nodes) {
      while (!(await redisCli(["-p", `${node.port}`, "cluster", "info"])).includes("cluster_state:ok")) {
        if (Date.now() > deadline) throw new Error(`the cluster did not report cluster_state:ok within ${START_TIMEOUT_MS} ms`)
        await new Promise((resolve) => setTimeout(resolve, 50))
      }
    }
    return { nodes, stop }
  } catch (error) {
    await stop()
    throw error
  }
}

/** True when `redis-cli` is on the PATH (the cluster tests need it to create the cluster). */
export const hasRedisCli = (): boolean => spawnSync("sh", ["-c", "command -v redis-cli"]).status === 0

/**
 * A test file's own client on `redis` (made at first use, quit after the file), for reading keys
 * and poking the server, and the keys of a name (default prefix), lock's and semaphore's, by SCAN.
 */
export const useInspector = (redis: { readonly url: () => string }) => {
  let client: Redis | undefined
  const inspector = (): Redis => {
    if (client === undefined) {
      client = new Redis(redis.url(), { lazyConnect: true, maxRetriesPerRequest: 1 })
      // A server restarted by a test refuses its reconnects meanwhile; its commands fail on their
      // own. Without a listener ioredis prints each refusal as an "Unhandled error event".
      client.on("error", () => {})
    }
    return client
  }
  afterAll(async () => {
    await client?.quit().catch(() => client?.disconnect())
  })
  const keysOf = (name: string): Effect.Effect<ReadonlyArray<string>> =>
    Effect.promise(async () => {
      const found: Array<string> = []
      let cursor = "0"
      do {
        const [next, batch] = await inspector().scan(cursor, "MATCH", Keys.namePattern(Keys.DEFAULT_PREFIX, name), "COUNT", 1000)
        found.push(...batch)
        cursor = next
      } while (cursor !== "0")
      return found
    })
  return { inspector, keysOf }
}

/**
 * A throw-away Redis for the demo and the chaos runs, as `embeddedPostgres.ts` is for PostgreSQL:
 * `EFFECT_LOCK_REDIS_URL`, else `REDIS_URL`, when set (nothing to stop, restart or signal);
 * otherwise `redis-server` from the PATH on a free loopback port, in a directory of its own,
 * without persistence (`--save "" --appendonly no`) unless asked for AOF, stopped and deleted by
 * `stop()`.
 * The tests' servers (test/support/redis.ts) start with `launchRedis` too.
 */
import { type ChildProcess, spawn, spawnSync } from "node:child_process"
import * as Fs from "node:fs"
import * as Net from "node:net"
import * as Os from "node:os"
import * as Path from "node:path"
import { freeLoopbackPort } from "./embeddedPostgres.js"
import { watchServer } from "./watchdog.js"

const START_TIMEOUT_MS = 10_000
const STOP_TIMEOUT_MS = 5_000
const START_ATTEMPTS = 3

/** What to do when there is neither a server URL nor `redis-server`. */
export const INSTALL_HINT =
  "redis-server was not found on the PATH and neither EFFECT_LOCK_REDIS_URL nor REDIS_URL is set: " +
  "install Redis (e.g. `apt-get install redis-server` or `brew install redis`), or point REDIS_URL at a server"

/** The server URL from the environment (EFFECT_LOCK_REDIS_URL first, as `LockConfig` reads it), or undefined. */
export const externalRedisUrl = (): string | undefined => {
  for (const name of ["EFFECT_LOCK_REDIS_URL", "REDIS_URL"]) {
    const url = process.env[name]
    if (url !== undefined && url !== "") return url
  }
  return undefined
}

/** The `redis-server` binary on the PATH, or undefined. */
export const redisServerPath = (): string | undefined => {
  const found = spawnSync("sh", ["-c", "command -v redis-server"], { encoding: "utf8" })
  const path = found.stdout?.trim() ?? ""
  return found.status === 0 && path !== "" ? path : undefined
}

/** True when a Redis can be had: a URL in the environment or `redis-server` on the PATH. */
export const redisAvailable = (): boolean => externalRedisUrl() !== undefined || redisServerPath() !== undefined

export interface RedisServer {
  readonly url: string
  /** False for a server of EFFECT_LOCK_REDIS_URL / REDIS_URL. */
  readonly embedded: boolean
  /** The server process id (the current one after a restart); undefined on an external server. */
  readonly pid: () => number | undefined
  /**
   * Own servers only: SIGTERM, `downMillis` with nothing listening, then a start on the same port
   * and settings. Without persistence every key is lost, as in a crash of a cache-only Redis;
   * with `aof` every acknowledged write comes back (expiry times are absolute, so a key whose
   * time ran out meanwhile is gone).
   */
  readonly restart?: (options?: { readonly downMillis?: number }) => Promise<void>
  readonly stop: () => Promise<void>
}

/** One PING over a raw connection: true when the server answered PONG within `ms`. */
export const ping = (port: number, ms: number): Promise<boolean> =>
  new Promise((resolve) => {
    const socket = Net.connect({ host: "127.0.0.1", port })
    let answer = ""
    const done = (ok: boolean) => {
      clearTimeout(timer)
      socket.destroy()
      resolve(ok)
    }
    const timer = setTimeout(() => done(false), ms)
    socket.on("connect", () => socket.write("PING\r\n"))
    socket.on("data", (chunk) => {
      answer += chunk.toString("utf8")
      if (answer.includes("\r\n")) done(answer.startsWith("+PONG"))
    })
    socket.on("error", () => done(false))
  })

/** Stops a server process (SIGTERM, or `signal`: SIGKILL for a crash), SIGKILL past a bound; resolves once it exited. */
export const stopChild = async (child: ChildProcess, signal: NodeJS.Signals = "SIGTERM"): Promise<void> => {
  if (child.exitCode !== null || child.signalCode !== null) return
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()))
  // A stopped (SIGSTOP) server would never act on SIGTERM: continue it first.
  child.kill("SIGCONT")
  child.kill(signal)
  // A server that ignores SIGTERM past the bound is killed: stop() must end.
  const timer = setTimeout(() => child.kill("SIGKILL"), STOP_TIMEOUT_MS)
  await exited
  clearTimeout(timer)
}

/** How an own server runs. */
export interface RedisServerOptions {
  /** AOF on, fsync'ed at every write (`appendonly yes`, `appendfsync always`); default off. */
  readonly aof?: boolean
}

/** How a launched `redis-server` runs. */
export interface LaunchOptions extends RedisServerOptions {
  /** More `redis-server` arguments (`--replicaof`, `--cluster-enabled` ...). */
  readonly args?: ReadonlyArray<string>
  /** The port; default a free loopback port. */
  readonly port?: number
}

/** A `redis-server` process of this machine, in a directory of its own. */
export interface RedisProcess {
  readonly port: number
  /** The current process id (a new one after `launch` again). */
  readonly pid: () => number | undefined
  /** Starts the server (again, after `halt`), on the same port and settings; resolves once it answers PING. */
  readonly launch: () => Promise<void>
  /** Stops the process (SIGTERM, or `signal`), keeping its directory. */
  readonly halt: (signal?: NodeJS.Signals) => Promise<void>
  /** Sends a signal to the process (SIGSTOP/SIGCONT: a frozen server). */
  readonly signal: (signal: NodeJS.Signals) => void
  /** Stops the process and deletes its directory. */
  readonly stop: () => Promise<void>
}

/**
 * Starts `binary` on a loopback port in a directory of its own (deleted by `stop`), without
 * snapshots and with AOF only when asked for; rejects when it does not answer PING.
 * The demo's, the chaos runs' and the tests' own servers all start here.
 */
export const launchRedis = async (binary: string, options?: LaunchOptions): Promise<RedisProcess> => {
  const port = options?.port ?? await freeLoopbackPort()
  // Its own directory: AOF files, cluster config and RDB of one server never meet another's.
  const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), `effect-lock-redis-${port}-`))
  const pidFile = Path.join(dir, "redis.pid")
  // A process killed with its server running leaves neither the server nor its directory (tools/watchdog).
  const stopWatching = watchServer({ pidFile, command: "redis-server", signal: "TERM", paths: [dir] })
  let child: ChildProcess | undefined
  const launch = async () => {
    const started = spawn(
      binary,
      [
        "--port", `${port}`, "--bind", "127.0.0.1", "--dir", dir, "--pidfile", pidFile,
        // No snapshots ever; AOF only when asked for: without it a restart loses every key.
        "--save", "",
        ...(options?.aof === true ? ["--appendonly", "yes", "--appendfsync", "always"] : ["--appendonly", "no"]),
        "--daemonize", "no", "--loglevel", "warning", ...(options?.args ?? [])
      ],
      { stdio: "ignore" }
    )
    child = started
    const deadline = Date.now() + START_TIMEOUT_MS
    while (!(await ping(port, 500))) {
      if (started.exitCode !== null || Date.now() > deadline) {
        await stopChild(started)
        throw new Error(`redis-server did not answer PING on port ${port} within ${START_TIMEOUT_MS} ms (port taken?)`)
      }
      // Polling the new server's port: there is no readiness signal to wait on instead.
      await new Promise((resolve) => setTimeout(resolve, 25))
    }
  }
  try {
    await launch()
  } catch (error) {
    stopWatching()
    Fs.rmSync(dir, { recursive: true, force: true })
    throw error
  }
  const halt = async (signal?: NodeJS.Signals) => {
    if (child !== undefined) await stopChild(child, signal)
  }
  return {
    port,
    pid: () => child?.pid,
    launch,
    halt,
    signal: (signal) => {
      child?.kill(signal)
    },
    stop: async () => {
      await halt()
      stopWatching()
      Fs.rmSync(dir, { recursive: true, force: true })
    }
  }
}

const startOwn = async (binary: string, options?: RedisServerOptions): Promise<RedisServer> => {
  const server = await launchRedis(binary, options)
  let restarting: Promise<void> = Promise.resolve()
  return {
    url: `redis://127.0.0.1:${server.port}`,
    embedded: true,
    pid: server.pid,
    restart: (options) =>
      restarting = restarting.then(async () => {
        await server.halt()
        const down = options?.downMillis ?? 0
        // The outage itself: nothing listens on the port for this long.
        if (down > 0) await new Promise((resolve) => setTimeout(resolve, down))
        await server.launch()
      }),
    stop: async () => {
      await restarting.catch(() => {})
      await server.stop()
    }
  }
}

/**
 * EFFECT_LOCK_REDIS_URL / REDIS_URL when set, else a fresh `redis-server`; rejects with
 * `INSTALL_HINT` when there is neither.
 */
export const startRedis = async (options?: RedisServerOptions): Promise<RedisServer> => {
  const external = externalRedisUrl()
  if (external !== undefined) return { url: external, embedded: false, pid: () => undefined, stop: async () => {} }
  const binary = redisServerPath()
  if (binary === undefined) throw new Error(INSTALL_HINT)
  // The free port can be taken between probing and binding: try again on a new one.
  for (let attempt = 1; ; attempt++) {
    try {
      return await startOwn(binary, options)
    } catch (error) {
      if (attempt >= START_ATTEMPTS) throw error
    }
  }
}

/** The URL with its password masked, for logs. */
export const redactRedisUrl = (url: string): string => url.replace(/:[^:@/]*@/, ":***@")

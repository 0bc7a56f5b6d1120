/**
 * A throw-away Redis for RedisLease's tests: `redis-server` from the PATH (CI installs it with
 * apt in `.ci/run`; tests never install anything), started on a free loopback port with
 * persistence off, stopped at the end of the file. With `REDIS_URL` set, that server is used
 * instead (and the tests that restart the server skip). Without either, the Redis test files
 * skip, printing why.
 */
import { type ChildProcess, spawn, spawnSync } from "node:child_process"
import * as Net from "node:net"
import { afterAll, beforeAll, describe } from "vitest"
import { freeLoopbackPort } from "../../tools/embeddedPostgres.js"

const START_TIMEOUT_MS = 10_000
const STOP_TIMEOUT_MS = 5_000

/** The `redis-server` binary on the PATH, or undefined. */
export const redisServerPath = (): string | undefined => {
  const found = spawnSync("sh", ["-c", "command -v redis-server"], { encoding: "utf8" })
  const path = found.stdout?.trim() ?? ""
  return found.status === 0 && path !== "" ? path : undefined
}

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

/** `describe` that skips its tests, printing why, when there is no Redis to run them on. */
export const describeWithRedis = (name: string, f: () => void): void => {
  describe.skipIf(noRedis())(name, f)
}

/** One PING over a raw connection: true when the server answered PONG within `ms`. */
const ping = (port: number, ms: number): Promise<boolean> =>
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

const stopChild = async (child: ChildProcess): Promise<void> => {
  if (child.exitCode !== null || child.signalCode !== null) return
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()))
  child.kill("SIGTERM")
  const timer = setTimeout(() => child.kill("SIGKILL"), STOP_TIMEOUT_MS)
  await exited
  clearTimeout(timer)
}

/** A running server of the tests. */
export interface TestRedis {
  readonly url: string
  readonly port: number
  /** Stops the server and starts a new one on the same port, without persistence: every key is lost. */
  readonly restart: (() => Promise<void>) | undefined
  /** Sends a signal to the server process (SIGSTOP/SIGCONT: a frozen server); undefined on an external server. */
  readonly signal: ((signal: NodeJS.Signals) => void) | undefined
  readonly stop: () => Promise<void>
}

/** Starts `redis-server` on a free loopback port (persistence off); rejects when it does not answer. */
export const startRedisServer = async (): Promise<TestRedis> => {
  const binary = redisServerPath()
  if (binary === undefined) throw new Error("redis-server not found on PATH")
  const port = await freeLoopbackPort()
  let child: ChildProcess | undefined
  const launch = async () => {
    const started = spawn(
      binary,
      ["--port", `${port}`, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
      { stdio: "ignore" }
    )
    child = started
    const deadline = Date.now() + START_TIMEOUT_MS
    while (!(await ping(port, 500))) {
      if (started.exitCode !== null || Date.now() > deadline) {
        await stopChild(started)
        throw new Error(`redis-server did not answer PING on port ${port} within ${START_TIMEOUT_MS} ms`)
      }
      await new Promise((resolve) => setTimeout(resolve, 25))
    }
  }
  await launch()
  const stop = async () => {
    if (child !== undefined) await stopChild(child)
  }
  return {
    url: `redis://127.0.0.1:${port}`,
    port,
    restart: async () => {
      await stop()
      await launch()
    },
    signal: (signal) => {
      child?.kill(signal)
    },
    stop
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
      ? { url: external, port: Number(new URL(external).port || 6379), restart: undefined, signal: undefined, stop: async () => {} }
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
    restart: (): (() => Promise<void>) | undefined => server?.restart,
    signal: (): ((signal: NodeJS.Signals) => void) | undefined => server?.signal,
    external: (): boolean => externalUrl() !== undefined
  }
}

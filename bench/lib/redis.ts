/**
 * A throw-away Redis for the Redis-based peer: the Debian `redis-server` (installed with
 * apt-get when absent), started on a free loopback port with persistence off, stopped at the end.
 */
import { type ChildProcess, spawn, spawnSync } from "node:child_process"
import { freeLoopbackPort } from "../../tools/embeddedPostgres.js"
import { ask } from "./net.js"
import { sleep } from "./timing.js"

export interface RedisServer {
  readonly url: string
  readonly version: string
  readonly stop: () => Promise<void>
}

export type RedisStart = { readonly _tag: "Started"; readonly server: RedisServer } | { readonly _tag: "Unavailable"; readonly reason: string }

const START_TIMEOUT_MS = 10_000

const findBinary = (): string | undefined => {
  const found = spawnSync("sh", ["-c", "command -v redis-server"], { encoding: "utf8" })
  const path = found.stdout.trim()
  return found.status === 0 && path !== "" ? path : undefined
}

const aptInstall = (log: (message: string) => void): string | undefined => {
  const env = { ...process.env, DEBIAN_FRONTEND: "noninteractive" }
  const install = () => spawnSync("apt-get", ["install", "-y", "-q", "redis-server"], { encoding: "utf8", env })
  log("redis-server not found: apt-get install -y redis-server")
  let result = install()
  if (result.status !== 0) {
    // A fresh container may have no package lists yet.
    log("apt-get install failed; running apt-get update and trying again")
    spawnSync("apt-get", ["update", "-q"], { encoding: "utf8", env })
    result = install()
  }
  if (result.status !== 0) {
    const output = `${result.stderr ?? ""}${result.stdout ?? ""}`.trim().split("\n").slice(-3).join(" / ")
    return `apt-get install -y redis-server failed (${result.error?.message ?? `exit ${result.status}`}): ${output}`
  }
  return undefined
}

const stopChild = async (child: ChildProcess): Promise<void> => {
  if (child.exitCode !== null || child.signalCode !== null) return
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()))
  child.kill("SIGTERM")
  const timer = setTimeout(() => child.kill("SIGKILL"), 5_000)
  await exited
  clearTimeout(timer)
}

export const startRedis = async (log: (message: string) => void): Promise<RedisStart> => {
  let binary = findBinary()
  if (binary === undefined) {
    const failure = aptInstall(log)
    if (failure !== undefined) return { _tag: "Unavailable", reason: failure }
    binary = findBinary()
    if (binary === undefined) return { _tag: "Unavailable", reason: "redis-server is still not on PATH after apt-get install" }
  }
  const version = spawnSync(binary, ["--version"], { encoding: "utf8" }).stdout.match(/v=([0-9.]+)/)?.[1] ?? "?"
  const port = await freeLoopbackPort()
  const child = spawn(
    binary,
    ["--port", `${port}`, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
    { stdio: "ignore" }
  )
  const deadline = Date.now() + START_TIMEOUT_MS
  while ((await ask(port, "PING\r\n", 500))?.startsWith("+PONG") !== true) {
    if (child.exitCode !== null || Date.now() > deadline) {
      await stopChild(child)
      return { _tag: "Unavailable", reason: `redis-server ${version} did not answer PING on port ${port}` }
    }
    await sleep(50)
  }
  return { _tag: "Started", server: { url: `redis://127.0.0.1:${port}`, version, stop: () => stopChild(child) } }
}

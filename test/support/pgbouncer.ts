/**
 * A throw-away PgBouncer in front of the test server, for pooler tests.
 *
 * PgBouncer comes from the Debian package `pgbouncer` (CI installs it in `.ci/run`). When the
 * binary is absent, pooler tests skip with a printed reason instead of failing.
 */
import { spawn, type ChildProcess } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import pg from "pg"
import { describe } from "vitest"
import { freeLoopbackPort } from "../../tools/embeddedPostgres.js"

const CANDIDATES = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer", "/usr/local/sbin/pgbouncer"]
/** PgBouncer refuses to run as root; as root it is started with `-u` as this unprivileged user. */
const RUN_AS = "nobody"
const READY_TIMEOUT_MS = 10_000
const STOP_TIMEOUT_MS = 5_000
const START_ATTEMPTS = 3

/**
 * Startup parameters node-pg may send that PgBouncer does not track; without this list it refuses
 * the login ("unsupported startup parameter"). Settings passed this way are silently NOT applied
 * on the server: through a pooler they must be set with SET / SET LOCAL instead.
 */
export const DEFAULT_IGNORE_STARTUP_PARAMETERS: ReadonlyArray<string> = [
  "extra_float_digits",
  "options",
  "statement_timeout",
  "lock_timeout",
  "idle_in_transaction_session_timeout"
]

const isExecutable = (file: string): boolean => {
  try {
    Fs.accessSync(file, Fs.constants.X_OK)
    return Fs.statSync(file).isFile()
  } catch {
    return false
  }
}

/** Path of the `pgbouncer` binary (PATH first, then the usual sbin/bin locations), or undefined when absent. */
export const pgbouncerPath = (): string | undefined => {
  const dirs = (process.env["PATH"] ?? "").split(Path.delimiter).filter((dir) => dir !== "")
  return [...dirs.map((dir) => Path.join(dir, "pgbouncer")), ...CANDIDATES].find(isExecutable)
}

/** Why pooler tests are skipped, or undefined when PgBouncer is available. */
const skipReason = (): string | undefined =>
  pgbouncerPath() === undefined ? "PgBouncer not found on PATH; skipping pooler tests" : undefined

let warned = false
const warnOnce = (reason: string) => {
  if (!warned) {
    warned = true
    console.warn(reason)
  }
}

/** True when PgBouncer is absent (after printing why once); for `it.skipIf(noPgBouncer())`. */
export const noPgBouncer = (): boolean => {
  const reason = skipReason()
  if (reason !== undefined) warnOnce(reason)
  return reason !== undefined
}

/** `describe` that skips its tests, printing why, when the PgBouncer binary is absent. */
export const describeWithPgBouncer = (name: string, f: () => void): void => {
  describe.skipIf(noPgBouncer())(name, f)
}

/** Options of `startPgBouncer`. */
export interface PgBouncerOptions {
  /** URL of the real server database the pooler fronts (user and password are used for server logins). */
  readonly targetUrl: string
  readonly poolMode: "session" | "transaction"
  /** Server connections per user/database pair. Default 4. */
  readonly defaultPoolSize?: number
  readonly maxClientConn?: number
  readonly ignoreStartupParameters?: ReadonlyArray<string>
}

/** A running PgBouncer. */
export interface PgBouncer {
  /** URL of the target database through the pooler. */
  readonly url: string
  readonly port: number
  /** Last lines PgBouncer wrote (its log goes to stderr). */
  readonly log: () => string
  readonly stop: () => Promise<void>
}

const quoteUserlist = (value: string): string => `"${value.replace(/"/g, '""')}"`

/** Server connection string values are single-quoted in pgbouncer.ini. */
const quoteConnValue = (value: string): string => `'${value.replace(/\\/g, "\\\\").replace(/'/g, "\\'")}'`

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))

const canQuery = async (url: string): Promise<boolean> => {
  const client = new pg.Client({ connectionString: url, connectionTimeoutMillis: 1_000 })
  client.on("error", () => {})
  try {
    await client.connect()
    await client.query("select 1")
    return true
  } catch {
    return false
  } finally {
    await client.end().catch(() => {})
  }
}

const exited = (child: ChildProcess): boolean => child.exitCode !== null || child.signalCode !== null

const stopChild = async (child: ChildProcess): Promise<void> => {
  if (exited(child)) return
  const done = new Promise<void>((resolve) => child.once("exit", () => resolve()))
  // SIGTERM is PgBouncer's immediate shutdown; SIGINT would wait for clients to finish.
  child.kill("SIGTERM")
  const timer = setTimeout(() => child.kill("SIGKILL"), STOP_TIMEOUT_MS)
  await done
  clearTimeout(timer)
}

const startOnce = async (binary: string, options: PgBouncerOptions): Promise<PgBouncer> => {
  const target = new URL(options.targetUrl)
  const database = decodeURIComponent(target.pathname.replace(/^\//, "")) || "postgres"
  const user = decodeURIComponent(target.username) || "postgres"
  const password = decodeURIComponent(target.password)
  const port = await freeLoopbackPort()

  const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-pgbouncer-"))
  // Readable by the unprivileged user PgBouncer drops to when started as root.
  Fs.chmodSync(dir, 0o755)
  const userlist = Path.join(dir, "userlist.txt")
  const ini = Path.join(dir, "pgbouncer.ini")
  Fs.writeFileSync(userlist, `${quoteUserlist(user)} ${quoteUserlist(password)}\n`, { mode: 0o644 })
  Fs.writeFileSync(
    ini,
    [
      "[databases]",
      // Server logins use the target URL's credentials from the userlist (plain text, so SCRAM works).
      `${database} = host=${quoteConnValue(target.hostname)} port=${target.port || "5432"} dbname=${quoteConnValue(database)}`,
      "",
      "[pgbouncer]",
      "listen_addr = 127.0.0.1",
      `listen_port = ${port}`,
      // No unix socket: parallel instances would collide on /tmp/.s.PGSQL.<port> files and locks.
      "unix_socket_dir =",
      // Clients are the tests themselves on loopback; trust still requires the user in auth_file.
      "auth_type = trust",
      `auth_file = ${userlist}`,
      `pool_mode = ${options.poolMode}`,
      `max_client_conn = ${options.maxClientConn ?? 200}`,
      `default_pool_size = ${options.defaultPoolSize ?? 4}`,
      `ignore_startup_parameters = ${(options.ignoreStartupParameters ?? DEFAULT_IGNORE_STARTUP_PARAMETERS).join(",")}`,
      "server_login_retry = 1",
      "log_connections = 0",
      "log_disconnections = 0",
      ""
    ].join("\n"),
    { mode: 0o644 }
  )

  const asRoot = typeof process.getuid === "function" && process.getuid() === 0
  const args = [...(asRoot ? ["-u", RUN_AS] : []), ini]
  const child = spawn(binary, args, { stdio: ["ignore", "pipe", "pipe"] })
  let output = ""
  const collect = (chunk: Buffer) => {
    output = (output + chunk.toString("utf8")).slice(-16_000)
  }
  child.stdout?.on("data", collect)
  child.stderr?.on("data", collect)
  // A pooler left behind by a test that forgot stop() must not outlive the worker.
  const killOnExit = () => child.kill("SIGKILL")
  process.once("exit", killOnExit)

  const cleanup = async () => {
    process.removeListener("exit", killOnExit)
    await stopChild(child)
    Fs.rmSync(dir, { recursive: true, force: true })
  }
  const tail = () => output.trimEnd().split("\n").slice(-20).join("\n")

  const url = new URL(options.targetUrl)
  url.hostname = "127.0.0.1"
  url.port = String(port)
  const poolerUrl = url.toString()

  const deadline = Date.now() + READY_TIMEOUT_MS
  for (;;) {
    if (exited(child)) {
      await cleanup()
      throw new Error(`pgbouncer exited during start (code ${child.exitCode}, signal ${child.signalCode}):\n${tail()}`)
    }
    if (await canQuery(poolerUrl)) break
    if (Date.now() >= deadline) {
      await cleanup()
      throw new Error(`pgbouncer did not accept a query within ${READY_TIMEOUT_MS} ms on port ${port}:\n${tail()}`)
    }
    await sleep(50)
  }

  return { url: poolerUrl, port, log: tail, stop: cleanup }
}

/**
 * Starts PgBouncer in the foreground as a child process on a free loopback port, fronting the
 * database of `targetUrl`, and resolves once a query passes through it.
 */
export const startPgBouncer = async (options: PgBouncerOptions): Promise<PgBouncer> => {
  const binary = pgbouncerPath()
  if (binary === undefined) throw new Error("PgBouncer not found on PATH")
  let lastError: unknown
  // The probed port can be taken before PgBouncer binds it: retry on a fresh one.
  for (let attempt = 1; attempt <= START_ATTEMPTS; attempt++) {
    try {
      return await startOnce(binary, options)
    } catch (error) {
      lastError = error
    }
  }
  throw lastError
}

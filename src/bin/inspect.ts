/**
 * The `effect-lock` command line: argument parsing, the `inspect` command and its two output
 * formats, on PostgreSQL (advisory locks and PgLease) or Redis (RedisLease). A few flags do not
 * need a CLI framework; argv is parsed here by hand.
 */
import type * as SqlClient from "@effect/sql/SqlClient"
import type * as PgClient from "@effect/sql-pg/PgClient"
import * as Console from "effect/Console"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Option from "effect/Option"
import * as Redacted from "effect/Redacted"
import type { Cluster, Redis } from "ioredis"
import * as PgAdvisory from "../PgAdvisory.js"
import * as PgLease from "../PgLease.js"
import { parseTable } from "../internal/lease/pg/sql.js"
import * as RedisKeys from "../internal/redis/keys.js"
import * as RedisOperator from "../internal/redis/operator.js"

/** Exit statuses: the usual shell convention (2: the command line itself was wrong). */
export const ExitCode = { ok: 0, failure: 1, usage: 2 } as const

const APPLICATION_NAME = "effect-lock-cli"
const CONNECT_TIMEOUT = Duration.seconds(5)
const DEFAULT_FENCING_TABLE = "effect_lock_fencing"
/** Widest cell of the table; lock names may be up to 1024 bytes. */
const MAX_CELL = 60

export const usage = `Usage: effect-lock inspect [--url URL] [--json] [--lease-table NAME] [--fencing-table NAME]
       effect-lock inspect --url redis://host:port [--prefix PREFIX] [--json]

Lists the locks held in one PostgreSQL database, by every process: session advisory locks
(pg_locks, with the holding session from pg_stat_activity, waiters included) and the leases
of a PgLease table. With a redis:// or rediss:// URL, lists RedisLease's lock names held or
waited for (holders, tokens, waiters) and its semaphores in use, found with SCAN (on a Redis
Cluster, on every master).

Options:
  --url URL              postgres:// connection URL (default: $DATABASE_URL), or redis:// /
                         rediss:// (default without DATABASE_URL: $EFFECT_LOCK_REDIS_URL, then $REDIS_URL)
  --json                 print JSON for scripts (keys and tokens as strings)
  --lease-table NAME     PgLease table, as table or schema.table (default: ${PgLease.DEFAULT_TABLE})
  --fencing-table NAME   table naming advisory keys (default: ${DEFAULT_FENCING_TABLE})
  --prefix PREFIX        RedisLease key prefix, no { or } (default: ${RedisKeys.DEFAULT_PREFIX})
  -h, --help             show this help`

/** What the command line asks for. */
export type Command =
  | { readonly _tag: "Help" }
  | {
    readonly _tag: "Inspect"
    readonly url: Redacted.Redacted<string>
    readonly json: boolean
    readonly leaseTable: string
    readonly fencingTable: string
  }
  | {
    readonly _tag: "InspectRedis"
    readonly url: Redacted.Redacted<string>
    readonly json: boolean
    readonly prefix: string
  }

const POSTGRES_PROTOCOLS = new Set(["postgres:", "postgresql:"])
const REDIS_PROTOCOLS = new Set(["redis:", "rediss:"])

/** The URL with its password masked, for messages. */
export const redactUrl = (url: string): string => {
  try {
    const parsed = new URL(url)
    if (parsed.password !== "") parsed.password = "***"
    return parsed.toString()
  } catch {
    return "<unparseable URL>"
  }
}

/** Which server `url` names, or why it cannot be used. */
const checkUrl = (url: string): { readonly backend: "postgres" | "redis" } | string => {
  let parsed: URL
  try {
    parsed = new URL(url)
  } catch {
    return "--url is not a URL; expected postgres://user:password@host:port/database (or redis://host:port)"
  }
  if (POSTGRES_PROTOCOLS.has(parsed.protocol)) return { backend: "postgres" }
  if (REDIS_PROTOCOLS.has(parsed.protocol)) return { backend: "redis" }
  return `--url must start with postgres:// or postgresql:// (or redis:// or rediss://), got ${parsed.protocol}//…`
}

const fromEnv = (env: Readonly<Record<string, string | undefined>>, name: string): string | undefined =>
  env[name] === "" ? undefined : env[name]

/** Parses the arguments after the program name; `Left` is a message for a usage error. */
export const parseArgs = (
  argv: ReadonlyArray<string>,
  env: Readonly<Record<string, string | undefined>>
): Either.Either<Command, string> => {
  if (argv.length === 0) return Either.left("no command given")
  const [command, ...rest] = argv
  if (command === "-h" || command === "--help" || command === "help") return Either.right({ _tag: "Help" })
  if (command !== "inspect") {
    return Either.left(`unknown command ${JSON.stringify(command)}; the only command is "inspect"`)
  }
  let url: string | undefined
  let json = false
  let leaseTable = PgLease.DEFAULT_TABLE
  let fencingTable = DEFAULT_FENCING_TABLE
  let prefix: string | undefined
  const tableFlags: Array<string> = []
  for (let i = 0; i < rest.length; i++) {
    const arg = rest[i]!
    const eq = arg.startsWith("--") ? arg.indexOf("=") : -1
    const flag = eq === -1 ? arg : arg.slice(0, eq)
    const value = (): string | undefined => (eq !== -1 ? arg.slice(eq + 1) : rest[++i])
    switch (flag) {
      case "-h":
      case "--help":
        return Either.right({ _tag: "Help" })
      case "--json":
        if (eq !== -1) return Either.left("--json takes no value")
        json = true
        break
      case "--url":
      case "--lease-table":
      case "--fencing-table":
      case "--prefix": {
        const given = value()
        if (given === undefined || (given === "" && flag !== "--prefix")) return Either.left(`${flag} needs a value`)
        if (flag === "--url") url = given
        else if (flag === "--prefix") prefix = given
        else {
          tableFlags.push(flag)
          if (flag === "--lease-table") leaseTable = given
          else fencingTable = given
        }
        break
      }
      default:
        return Either.left(`unknown option ${JSON.stringify(arg)}`)
    }
  }
  // DATABASE_URL first, as before Redis was known here; the Redis variables only without it.
  url ??= fromEnv(env, "DATABASE_URL") ?? fromEnv(env, "EFFECT_LOCK_REDIS_URL") ?? fromEnv(env, "REDIS_URL")
  if (url === undefined) {
    return Either.left("--url is required (or set DATABASE_URL); for Redis, --url redis://… or EFFECT_LOCK_REDIS_URL / REDIS_URL")
  }
  const server = checkUrl(url)
  if (typeof server === "string") return Either.left(server)
  if (server.backend === "redis") {
    if (tableFlags.length > 0) return Either.left(`${tableFlags[0]} applies to PostgreSQL URLs only`)
    const keyPrefix = prefix ?? RedisKeys.DEFAULT_PREFIX
    const badPrefix = RedisKeys.prefixProblem(keyPrefix)
    if (badPrefix !== undefined) return Either.left(`--prefix: ${badPrefix}`)
    return Either.right({ _tag: "InspectRedis", url: Redacted.make(url), json, prefix: keyPrefix })
  }
  if (prefix !== undefined) return Either.left("--prefix applies to Redis URLs only")
  const badTable = parseTable(leaseTable)
  if (typeof badTable === "string") return Either.left(`--lease-table: ${badTable}`)
  return Either.right({ _tag: "Inspect", url: Redacted.make(url), json, leaseTable, fencingTable })
}

// ---------------------------------------------------------------- the report

/** What `inspect` found, with the server's clock for ages. */
export interface Report {
  readonly database: string
  readonly serverTime: number
  readonly advisory: ReadonlyArray<PgAdvisory.AdvisoryHolder>
  readonly leases: ReadonlyArray<PgLease.StoredLease>
  readonly leaseTable: string
}

const iso = (ms: number): string => new Date(ms).toISOString()

/** JSON for scripts: bigints as strings, times as ISO 8601, absent values as null. */
export const toJson = (report: Report): string =>
  JSON.stringify(
    {
      database: report.database,
      serverTime: iso(report.serverTime),
      advisory: report.advisory.map((row) => ({
        key: row.key.toString(),
        name: Option.getOrNull(row.name),
        mode: row.mode,
        granted: row.granted,
        pid: row.pid,
        applicationName: Option.getOrNull(row.applicationName),
        clientAddress: Option.getOrNull(row.clientAddress),
        user: Option.getOrNull(row.user),
        since: Option.getOrNull(Option.map(row.since, iso)),
        state: Option.getOrNull(row.state),
        waitEvent: Option.getOrNull(row.waitEvent)
      })),
      leases: {
        table: report.leaseTable,
        held: report.leases.map((lease) => ({
          name: lease.name,
          token: lease.token.toString(),
          application: lease.application,
          host: lease.host,
          pid: lease.pid,
          acquiredAt: iso(lease.acquiredAt),
          expiresAt: iso(lease.expiresAt),
          waitingSince: lease.waitingSince === null ? null : iso(lease.waitingSince)
        }))
      }
    },
    null,
    2
  )

/** A compact duration, e.g. `3m12s`. */
const age = (ms: number): string => {
  const s = Math.max(0, Math.round(ms / 1000))
  if (s < 60) return `${s}s`
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`
  if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor(s / 60) % 60).padStart(2, "0")}m`
  return `${Math.floor(s / 86400)}d${String(Math.floor(s / 3600) % 24).padStart(2, "0")}h`
}

/** One cell: control characters escaped (names are arbitrary text), long values cut. */
const cell = (text: string | null | undefined): string => {
  if (text === null || text === undefined || text === "") return "-"
  // eslint-disable-next-line no-control-regex
  const safe = /[\u0000-\u001f\u007f]/.test(text) ? JSON.stringify(text).slice(1, -1) : text
  return safe.length > MAX_CELL ? `${safe.slice(0, MAX_CELL - 1)}…` : safe
}

/** Fixed-width columns, two spaces apart, with a header row. */
const table = (header: ReadonlyArray<string>, rows: ReadonlyArray<ReadonlyArray<string>>): string => {
  const widths = header.map((title, i) => Math.max(title.length, ...rows.map((row) => row[i]!.length)))
  const line = (cells: ReadonlyArray<string>) => cells.map((c, i) => c.padEnd(widths[i]!)).join("  ").trimEnd()
  return [line(header), ...rows.map(line)].join("\n")
}

/** The human-readable report: one table of advisory locks, one of leases. */
export const toTable = (report: Report): string => {
  const now = report.serverTime
  const held = report.advisory.filter((row) => row.granted).length
  const advisory = report.advisory.length === 0 ? "(none)" : table(
    ["KEY", "NAME", "MODE", "STATUS", "PID", "APPLICATION", "CLIENT", "SINCE"],
    report.advisory.map((row) => [
      row.key.toString(),
      cell(Option.getOrNull(row.name)),
      row.mode,
      row.granted ? "held" : "waiting",
      String(row.pid),
      cell(Option.getOrNull(row.applicationName)),
      cell(Option.getOrNull(row.clientAddress)),
      Option.match(row.since, { onNone: () => "-", onSome: (t) => `${iso(t).slice(0, 19)}Z (${age(now - t)} ago)` })
    ])
  )
  const leases = report.leases.length === 0 ? "(none)" : table(
    ["NAME", "TOKEN", "APPLICATION", "HOST", "PID", "ACQUIRED", "EXPIRES"],
    report.leases.map((lease) => [
      cell(lease.name),
      lease.token.toString(),
      cell(lease.application),
      cell(lease.host),
      lease.pid === null ? "-" : String(lease.pid),
      `${iso(lease.acquiredAt).slice(0, 19)}Z (${age(now - lease.acquiredAt)} ago)`,
      `in ${age(lease.expiresAt - now)}${lease.waitingSince === null ? "" : ", wanted"}`
    ])
  )
  return [
    `Advisory locks in database ${JSON.stringify(report.database)}: ` +
    `${held} held, ${report.advisory.length - held} waiting`,
    advisory,
    ...(report.advisory.length === 0 ? [] : [
      "SINCE: when a waiter began waiting; for a holder, the start of its session (PostgreSQL keeps no grant time)."
    ]),
    "",
    `Leases in table ${report.leaseTable}: ${report.leases.length} held`,
    leases
  ].join("\n")
}

// ---------------------------------------------------------------- the Redis report

/** What `inspect` found on a Redis server, with the server's clock for ages. */
export interface RedisReport {
  readonly server: string
  readonly prefix: string
  readonly listing: RedisOperator.Listing
  /** How many servers were listed: 1, or every master of a Cluster. */
  readonly nodes: number
}

const holderJson = (lease: PgLease.StoredLease) => ({
  token: lease.token.toString(),
  mode: lease.mode,
  application: lease.application,
  host: lease.host,
  pid: lease.pid,
  acquiredAt: iso(lease.acquiredAt),
  expiresAt: iso(lease.expiresAt)
})

/** JSON for scripts, as the PostgreSQL report's (tokens as strings, ISO 8601 times), in a `redis` section. */
export const redisToJson = (report: RedisReport): string =>
  JSON.stringify(
    {
      server: report.server,
      serverTime: iso(report.listing.serverTime),
      redis: {
        prefix: report.prefix,
        nodes: report.nodes,
        truncated: report.listing.truncated,
        leases: report.listing.locks.map((lock) => ({
          name: lock.named ? lock.name : null,
          tag: lock.tag,
          holders: lock.holders.map(holderJson),
          waiting: {
            exclusive: lock.waiting.exclusive,
            shared: lock.waiting.shared,
            since: lock.waiting.since === null ? null : iso(lock.waiting.since)
          }
        })),
        semaphores: report.listing.semaphores.map((sem) => ({
          name: sem.name,
          limit: sem.limit,
          held: sem.holders.reduce((n, h) => n + h.permits, 0),
          holders: sem.holders.map((holder) => ({
            permits: holder.permits,
            tokens: holder.tokens.map((token) => token.toString()),
            application: holder.application,
            host: holder.host,
            pid: holder.pid,
            acquiredAt: iso(holder.acquiredAt),
            expiresAt: iso(holder.expiresAt)
          })),
          waiting: sem.waiting.map((waiter) => ({ permits: waiter.permits, since: iso(waiter.since) }))
        }))
      }
    },
    null,
    2
  )

const waitingCell = (waiting: RedisOperator.LockWaiting, now: number): string => {
  const parts = [
    ...(waiting.exclusive > 0 ? [`${waiting.exclusive} exclusive`] : []),
    ...(waiting.shared > 0 ? [`${waiting.shared} shared`] : [])
  ]
  if (parts.length === 0) return "-"
  return `${parts.join(", ")}${waiting.since === null ? "" : `, oldest ${age(now - waiting.since)}`}`
}

/** The human-readable report: one row per lease (or per name only waited for), one per semaphore. */
export const redisToTable = (report: RedisReport): string => {
  const { listing } = report
  const now = listing.serverTime
  const held = listing.locks.reduce((n, lock) => n + lock.holders.length, 0)
  const waiters = listing.locks.reduce((n, lock) => n + lock.waiting.exclusive + lock.waiting.shared, 0)
  const rows = listing.locks.flatMap((lock): Array<Array<string>> => {
    const waiting = waitingCell(lock.waiting, now)
    if (lock.holders.length === 0) return [[cell(lock.name), "-", "-", "-", "-", "-", "-", "-", waiting]]
    return lock.holders.map((lease) => [
      cell(lock.name),
      lease.token.toString(),
      lease.mode,
      cell(lease.application),
      cell(lease.host),
      lease.pid === null ? "-" : String(lease.pid),
      `${iso(lease.acquiredAt).slice(0, 19)}Z (${age(now - lease.acquiredAt)} ago)`,
      `in ${age(lease.expiresAt - now)}`,
      waiting
    ])
  })
  const leases = rows.length === 0
    ? "(none)"
    : table(["NAME", "TOKEN", "MODE", "APPLICATION", "HOST", "PID", "ACQUIRED", "EXPIRES", "WAITING"], rows)
  const semaphores = listing.semaphores.length === 0 ? "(none)" : table(
    ["NAME", "LIMIT", "HELD", "WAITING"],
    listing.semaphores.map((sem) => {
      const permits = sem.holders.reduce((n, h) => n + h.permits, 0)
      const wanted = sem.waiting.reduce((n, w) => n + w.permits, 0)
      return [
        cell(sem.name),
        String(sem.limit),
        `${permits} (${sem.holders.length} holder${sem.holders.length === 1 ? "" : "s"})`,
        sem.waiting.length === 0 ? "-" : `${sem.waiting.length} (${wanted} permit${wanted === 1 ? "" : "s"})`
      ]
    })
  )
  return [
    `Redis leases at ${report.server} (prefix ${JSON.stringify(report.prefix)}): ${held} held, ${waiters} waiting ` +
    `(${report.nodes} node${report.nodes === 1 ? "" : "s"})`,
    leases,
    ...(listing.locks.some((lock) => !lock.named) ? ["{…}: a name only waited for, whose keys no longer keep it, shows as its key tag."] : []),
    "",
    `Semaphores: ${listing.semaphores.length} in use`,
    semaphores,
    ...(listing.truncated ? ["", "More names were found than were read: the lists above are incomplete."] : [])
  ].join("\n")
}

// ---------------------------------------------------------------- running it

/** The message of an error and of the errors it wraps, without repeats. */
const reason = (error: unknown): string => {
  const parts: Array<string> = []
  const visit = (e: unknown, depth: number) => {
    if (depth > 4 || e === null || e === undefined) return
    if (e instanceof AggregateError) {
      for (const inner of e.errors) visit(inner, depth + 1)
      if (e.errors.length > 0) return
    }
    const message = typeof e === "object" && "message" in e ? String(e.message) : String(e)
    const code = typeof e === "object" && "code" in e && typeof e.code === "string" ? e.code : undefined
    const text = message !== "" ? message : code ?? ""
    if (text !== "" && !parts.some((part) => part.includes(text))) parts.push(text)
    if (typeof e === "object" && "cause" in e) visit(e.cause, depth + 1)
  }
  visit(error, 0)
  return parts.join(": ") || "unknown error"
}

const report = (command: Extract<Command, { _tag: "Inspect" }>, Sql: typeof SqlClient) =>
  Effect.gen(function*() {
    const sql = yield* Sql.SqlClient
    const [server] = yield* sql.unsafe<{ database: string; now: number }>(
      "select current_database() as database, (extract(epoch from now()) * 1000)::float8 as now"
    ).withoutTransform
    const advisory = yield* PgAdvisory.listHolders({ fencingTable: command.fencingTable })
    const leases = yield* PgLease.listHolders({ table: command.leaseTable })
    return {
      database: server?.database ?? "?",
      serverTime: server?.now ?? Date.now(),
      advisory,
      leases,
      leaseTable: command.leaseTable
    } satisfies Report
  })

/** What `main` needs from outside besides argv and env; tests replace it. */
export interface Deps {
  /** Loads the optional `ioredis` peer (a dynamic import: only a Redis URL needs it). */
  readonly importIoredis: () => Promise<unknown>
  /** Loads the optional PostgreSQL client modules (dynamic imports: only a postgres URL needs them). */
  readonly importPg: () => Promise<readonly [typeof SqlClient, typeof PgClient]>
}

const defaultDeps: Deps = {
  importIoredis: () => import("ioredis"),
  importPg: () => Promise.all([import("@effect/sql/SqlClient"), import("@effect/sql-pg/PgClient")])
}

/**
 * The PostgreSQL client modules, loaded only for a postgres URL: they are optional peers, and an
 * app on Redis alone need not install them to inspect its locks.
 */
const loadPg = (deps: Deps) =>
  Effect.tryPromise({
    try: deps.importPg,
    catch: () => "inspecting PostgreSQL needs @effect/sql and @effect/sql-pg: npm install @effect/sql@0.52 @effect/sql-pg@0.53"
  })

const inspectPg = (
  command: Extract<Command, { _tag: "Inspect" }>,
  Sql: typeof SqlClient,
  Pg: typeof PgClient
): Effect.Effect<number> =>
  report(command, Sql).pipe(
    Effect.flatMap((found) => Console.log(command.json ? toJson(found) : toTable(found))),
    Effect.as(ExitCode.ok),
    Effect.scoped,
    Effect.provide(Pg.layer({
      url: command.url,
      applicationName: APPLICATION_NAME,
      connectTimeout: CONNECT_TIMEOUT,
      maxConnections: 1
    })),
    Effect.catchAll((error) => {
      const where = redactUrl(Redacted.value(command.url))
      // PgClient's own connect check fails with these messages; the driver's error says why.
      const connecting = error._tag === "SqlError" && /Failed to connect|timed out/.test(error.message)
      const message = connecting
        ? `cannot connect to ${where}: ${reason(error.cause)}`
        : `inspect failed on ${where}: ${reason(error)}`
      return Effect.as(Console.error(`effect-lock: ${message}`), ExitCode.failure)
    })
  )

type RedisCtor = new(url: string, options: Record<string, unknown>) => Redis
type ClusterCtor = new(nodes: ReadonlyArray<{ readonly host: string; readonly port: number }>, options: Record<string, unknown>) => Cluster

/** ioredis's two client constructors. */
interface Ioredis {
  readonly Redis: RedisCtor
  readonly Cluster: ClusterCtor
}

class Failed {
  readonly _tag = "Failed"
  constructor(readonly message: string) {}
}

const loadIoredis = (deps: Deps): Effect.Effect<Ioredis, Failed> =>
  Effect.tryPromise({
    try: async () => {
      const m = (await deps.importIoredis()) as { readonly Redis?: unknown; readonly Cluster?: unknown; readonly default?: unknown }
      const ctor = m.Redis ?? m.default
      if (typeof ctor !== "function") throw new Error("the ioredis module has no Redis constructor")
      // ioredis also hangs Cluster on the Redis class (Redis.Cluster), for a module seen as its default only.
      const cluster = m.Cluster ?? (ctor as { readonly Cluster?: unknown }).Cluster
      if (typeof cluster !== "function") throw new Error("the ioredis module has no Cluster constructor")
      return { Redis: ctor as RedisCtor, Cluster: cluster as ClusterCtor }
    },
    catch: () => new Failed("inspecting Redis needs the ioredis package: npm install ioredis")
  })

/** What `open` needs of an ioredis client: a `Redis` or a `Cluster`. */
interface Connectable {
  readonly status: string
  connect(): Promise<unknown>
  disconnect(): void
  on(event: string, listener: (error: unknown) => void): unknown
}

/**
 * A lazy client `make` builds, connected within the connect bound and disconnected when the scope
 * closes; a failure names `target` and the last error the client reported (`errorEvents`).
 */
const open = <C extends Connectable>(make: () => C, errorEvents: ReadonlyArray<string>, target: string, late: string) =>
  Effect.gen(function*() {
    let lastError: unknown
    const client = yield* Effect.acquireRelease(
      Effect.sync(() => {
        const made = make()
        // Without a listener ioredis prints every connection error itself; the last one says why.
        for (const event of errorEvents) {
          made.on(event, (error: unknown) => {
            lastError = error
          })
        }
        return made
      }),
      // disconnect, not quit: nothing was written, and quit would wait on a frozen server. Not on
      // an ended client: its disconnect arms a 2 s timer that would hold the process open.
      (made) => Effect.sync(() => made.status === "end" ? undefined : made.disconnect())
    )
    yield* Effect.tryPromise({
      try: () => client.connect(),
      catch: (error) => new Failed(`cannot connect to ${target}: ${reason(lastError ?? error)}`)
    }).pipe(
      Effect.timeoutFail({
        duration: CONNECT_TIMEOUT,
        onTimeout: () => new Failed(`cannot connect to ${target}: ${late} within ${Duration.format(CONNECT_TIMEOUT)}`)
      })
    )
    return client
  })

const connectRedis = (Redis: RedisCtor, url: string, where: string) =>
  open(
    () =>
      new Redis(url, {
        lazyConnect: true,
        connectionName: APPLICATION_NAME,
        connectTimeout: Duration.toMillis(CONNECT_TIMEOUT),
        // One try, no reconnects, no queue: an unreachable server is one failure, not a retry loop.
        retryStrategy: () => null,
        maxRetriesPerRequest: 0,
        enableOfflineQueue: false
      }),
    ["error"],
    where,
    "no answer"
  )

/** Whether the server is a Cluster node (`INFO cluster` says `cluster_enabled:1`), asked within the connect bound. */
const clusterEnabled = (client: Redis, where: string) =>
  Effect.tryPromise({
    try: () => client.info("cluster"),
    catch: (error) => error
  }).pipe(
    Effect.timeoutFail({
      duration: CONNECT_TIMEOUT,
      onTimeout: () => new Failed(`inspect failed on ${where}: INFO got no answer within ${Duration.format(CONNECT_TIMEOUT)}`)
    }),
    Effect.map((info) => /^cluster_enabled:1\s*$/m.test(info)),
    Effect.catchAll((error) =>
      // A server that refuses INFO (an ACL without it) is listed as one server, as before.
      error instanceof Error && error.name === "ReplyError"
        ? Effect.succeed(false)
        : Effect.fail(error instanceof Failed ? error : new Failed(`inspect failed on ${where}: ${reason(error)}`))
    )
  )

/**
 * A Cluster seeded with the connected server's host and port and its credentials and TLS (as
 * ioredis parsed them from the URL), ready (slots known), disconnected when the scope closes.
 */
const connectCluster = (ClusterClient: ClusterCtor, seed: Redis, where: string) => {
  const { host, port, username, password, tls } = seed.options
  return open(
    () =>
      new ClusterClient([{ host: host ?? "localhost", port: port ?? 6379 }], {
        lazyConnect: true,
        // As the plain client: one try, no reconnects, no queue.
        clusterRetryStrategy: () => null,
        enableOfflineQueue: false,
        redisOptions: {
          username,
          password,
          tls,
          connectionName: APPLICATION_NAME,
          connectTimeout: Duration.toMillis(CONNECT_TIMEOUT),
          maxRetriesPerRequest: 0
        }
      }),
    ["error", "node error"],
    `the Cluster of ${where}`,
    "not ready"
  )
}

const inspectRedis = (command: Extract<Command, { _tag: "InspectRedis" }>, deps: Deps): Effect.Effect<number> => {
  const where = redactUrl(Redacted.value(command.url))
  return Effect.gen(function*() {
    const ioredis = yield* loadIoredis(deps)
    const client = yield* connectRedis(ioredis.Redis, Redacted.value(command.url), where)
    // SCAN on a Cluster node sees that node only: a Cluster client lists every master.
    const target = (yield* clusterEnabled(client, where)) ? yield* connectCluster(ioredis.Cluster, client, where) : client
    const { listing, nodes } = yield* RedisOperator.listNodes(target, { prefix: command.prefix }).pipe(
      Effect.mapError((error) => new Failed(`inspect failed on ${where}: ${reason(error)}`))
    )
    const found: RedisReport = { server: where, prefix: command.prefix, listing, nodes }
    yield* Console.log(command.json ? redisToJson(found) : redisToTable(found))
    return ExitCode.ok
  }).pipe(
    Effect.scoped,
    Effect.catchAll((failed) => Effect.as(Console.error(`effect-lock: ${failed.message}`), ExitCode.failure))
  )
}

/**
 * Runs the command line and returns the exit status; every expected failure is printed as one
 * line on stderr. Only defects escape.
 */
export const main = (
  argv: ReadonlyArray<string>,
  env: Readonly<Record<string, string | undefined>>,
  overrides?: Partial<Deps>
): Effect.Effect<number> => {
  const deps: Deps = { ...defaultDeps, ...overrides }
  return Either.match(parseArgs(argv, env), {
    onLeft: (message) => Effect.as(Console.error(`effect-lock: ${message}\nTry "effect-lock --help".`), ExitCode.usage),
    onRight: (command) =>
      command._tag === "Help"
        ? Effect.as(Console.log(usage), ExitCode.ok)
        : command._tag === "InspectRedis"
        ? inspectRedis(command, deps)
        : loadPg(deps).pipe(
          Effect.matchEffect({
            onFailure: (message) => Effect.as(Console.error(`effect-lock: ${message}`), ExitCode.failure),
            onSuccess: ([Sql, Pg]) => inspectPg(command, Sql, Pg)
          })
        )
  })
}

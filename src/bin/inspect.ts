/**
 * The `effect-lock` command line: argument parsing, the `inspect` command and its two output
 * formats. Three flags do not need a CLI framework; argv is parsed here by hand.
 */
import * as SqlClient from "@effect/sql/SqlClient"
import * as PgClient from "@effect/sql-pg/PgClient"
import * as Console from "effect/Console"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Option from "effect/Option"
import * as Redacted from "effect/Redacted"
import * as PgAdvisory from "../PgAdvisory.js"
import * as PgLease from "../PgLease.js"
import { parseTable } from "../internal/lease/pg/sql.js"

/** Exit statuses: the usual shell convention (2: the command line itself was wrong). */
export const ExitCode = { ok: 0, failure: 1, usage: 2 } as const

const APPLICATION_NAME = "effect-lock-cli"
const CONNECT_TIMEOUT = Duration.seconds(5)
const DEFAULT_FENCING_TABLE = "effect_lock_fencing"
/** Widest cell of the table; lock names may be up to 1024 bytes. */
const MAX_CELL = 60

export const usage = `Usage: effect-lock inspect [--url URL] [--json] [--lease-table NAME] [--fencing-table NAME]

Lists the locks held in one PostgreSQL database, by every process: session advisory locks
(pg_locks, with the holding session from pg_stat_activity, waiters included) and the leases
of a PgLease table.

Options:
  --url URL              postgres:// connection URL (default: $DATABASE_URL)
  --json                 print JSON for scripts (keys and tokens as strings)
  --lease-table NAME     PgLease table, as table or schema.table (default: ${PgLease.DEFAULT_TABLE})
  --fencing-table NAME   table naming advisory keys (default: ${DEFAULT_FENCING_TABLE})
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

const POSTGRES_PROTOCOLS = new Set(["postgres:", "postgresql:"])

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

const checkUrl = (url: string): string | undefined => {
  let parsed: URL
  try {
    parsed = new URL(url)
  } catch {
    return "--url is not a URL; expected postgres://user:password@host:port/database"
  }
  if (!POSTGRES_PROTOCOLS.has(parsed.protocol)) {
    return `--url must start with postgres:// or postgresql://, got ${parsed.protocol}//…`
  }
  return undefined
}

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
      case "--fencing-table": {
        const given = value()
        if (given === undefined || given === "") return Either.left(`${flag} needs a value`)
        if (flag === "--url") url = given
        else if (flag === "--lease-table") leaseTable = given
        else fencingTable = given
        break
      }
      default:
        return Either.left(`unknown option ${JSON.stringify(arg)}`)
    }
  }
  url ??= env["DATABASE_URL"] === "" ? undefined : env["DATABASE_URL"]
  if (url === undefined) return Either.left("--url is required (or set DATABASE_URL)")
  const badUrl = checkUrl(url)
  if (badUrl !== undefined) return Either.left(badUrl)
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

const report = (command: Extract<Command, { _tag: "Inspect" }>) =>
  Effect.gen(function*() {
    const sql = yield* SqlClient.SqlClient
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

/**
 * Runs the command line and returns the exit status; every expected failure is printed as one
 * line on stderr. Only defects escape.
 */
export const main = (
  argv: ReadonlyArray<string>,
  env: Readonly<Record<string, string | undefined>>
): Effect.Effect<number> =>
  Either.match(parseArgs(argv, env), {
    onLeft: (message) => Effect.as(Console.error(`effect-lock: ${message}\nTry "effect-lock --help".`), ExitCode.usage),
    onRight: (command) =>
      command._tag === "Help" ? Effect.as(Console.log(usage), ExitCode.ok) : report(command).pipe(
        Effect.flatMap((found) => Console.log(command.json ? toJson(found) : toTable(found))),
        Effect.as(ExitCode.ok),
        Effect.scoped,
        Effect.provide(PgClient.layer({
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
  })

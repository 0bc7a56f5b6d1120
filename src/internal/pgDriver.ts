/**
 * The only module that touches node-postgres directly, driver-private fields included
 * (`processID`, `secretKey`, the socket). Everything above it sees opaque clients, promises and
 * classified failures.
 */
import * as Net from "node:net"
import pg from "pg"

/** A statement's failure, classified by what it proves about the session. */
export type StatementFailure =
  /** The server answered with an error: the session is alive and idle (outside a transaction). */
  | { readonly _tag: "Sql"; readonly code: string; readonly error: unknown }
  /** No answer, or the connection ended: what the server did is unknown; the session is unusable. */
  | { readonly _tag: "Connection"; readonly error: unknown }

/** SQLSTATE classes after which the server has closed (or is closing) the session. */
const FATAL_CLASSES = ["08", "57P"]

export const classify = (error: unknown): StatementFailure => {
  const code = typeof error === "object" && error !== null && "code" in error ? error.code : undefined
  if (typeof code === "string" && /^[0-9A-Z]{5}$/.test(code) && !FATAL_CLASSES.some((c) => code.startsWith(c))) {
    return { _tag: "Sql", code, error }
  }
  return { _tag: "Connection", error }
}

/** How to reach the server, resolved once per layer. */
export interface ConnectConfig {
  readonly connectionString: string
  readonly applicationName: string
  readonly connectTimeoutMillis: number
}

/**
 * Builds the client config. An application name given in the URL wins over the default, but an
 * explicit `applicationName` option wins over the URL.
 */
export const clientConfig = (config: ConnectConfig, explicitName: boolean): pg.ClientConfig => {
  let connectionString = config.connectionString
  if (explicitName) {
    try {
      const url = new URL(connectionString)
      if (url.searchParams.has("application_name")) {
        url.searchParams.set("application_name", config.applicationName)
        connectionString = url.toString()
      }
    } catch {
      // Not a URL (a key=value or socket form): pg parses it; the explicit name applies below.
    }
  }
  return {
    connectionString,
    application_name: config.applicationName,
    connectionTimeoutMillis: config.connectTimeoutMillis,
    // TCP keepalive on the client side, so a dead peer is eventually noticed even mid-wait.
    keepAlive: true,
    keepAliveInitialDelayMillis: 5_000
  }
}

/** Callbacks a session owner wants for the life of one client. */
export interface ClientEvents {
  /** The connection is gone ('error' or 'end'): every session lock on it is gone too. */
  readonly onClosed: (error: unknown) => void
  readonly onNotification?: (channel: string, payload: string | undefined) => void
}

/**
 * Connects a raw client. The 'error' listener is attached before connect: without one, a
 * terminated backend would crash the Node process.
 */
export const connect = async (config: pg.ClientConfig, events: ClientEvents): Promise<pg.Client> => {
  const client = new pg.Client(config)
  let connected = false
  client.on("error", (error) => {
    if (connected) events.onClosed(error)
  })
  client.on("end", () => {
    if (connected) events.onClosed(new Error("connection ended"))
  })
  if (events.onNotification !== undefined) {
    const onNotification = events.onNotification
    client.on("notification", (message) => onNotification(message.channel, message.payload))
  }
  try {
    await client.connect()
  } catch (error) {
    destroy(client)
    throw error
  }
  connected = true
  return client
}

/** Runs one statement; a text without values goes over the simple protocol (several statements allowed). */
export const query = (
  client: pg.Client,
  text: string,
  values?: ReadonlyArray<unknown>
): Promise<pg.QueryResult | Array<pg.QueryResult>> =>
  values === undefined ? client.query(text) : client.query(text, [...values])

/** The last result of a (possibly multi-statement) query. */
export const lastResult = (result: pg.QueryResult | Array<pg.QueryResult>): pg.QueryResult | undefined =>
  Array.isArray(result) ? result[result.length - 1] : result

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
 * Closes the socket without waiting for anything: the server ends the backend when it notices,
 * and with it every session lock the backend held.
 */
export const destroy = (client: pg.Client): void => {
  try {
    internals(client).connection?.stream?.destroy?.()
  } catch {
    // already closed
  }
  client.end().catch(() => {})
}

const CANCEL_REQUEST_CODE = 80877102

/**
 * Sends a protocol CancelRequest (process id + secret key) over a throw-away socket: it needs no
 * pool slot and no login. Resolves when the server has closed that socket (by then the cancel
 * signal has been delivered to the backend) or after `timeoutMillis`, whichever is first; it
 * never rejects — the caller decides from the query's outcome, not from this.
 */
export const sendCancel = (client: pg.Client, timeoutMillis: number): Promise<boolean> =>
  new Promise((resolve) => {
    const priv = internals(client)
    const pid = priv.processID
    const secret = priv.secretKey
    const host = priv.connectionParameters?.host
    const port = priv.connectionParameters?.port
    if (typeof pid !== "number" || typeof secret !== "number" || typeof port !== "number") {
      resolve(false)
      return
    }
    const socket = typeof host === "string" && host.startsWith("/")
      ? Net.connect({ path: `${host}/.s.PGSQL.${port}` })
      : Net.connect({ host: typeof host === "string" && host !== "" ? host : "localhost", port })
    let done = false
    const finish = (sent: boolean) => {
      if (done) return
      done = true
      clearTimeout(timer)
      socket.destroy()
      resolve(sent)
    }
    const timer = setTimeout(() => finish(false), timeoutMillis)
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
  })

/** Quotes a text literal for the simple protocol. */
export const literal = (text: string): string => pg.escapeLiteral(text)

/** Quotes an identifier. */
export const identifier = (text: string): string => pg.escapeIdentifier(text)

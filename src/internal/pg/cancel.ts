/**
 * PgAdvisory's piece of the node-postgres edge: the backend key a client was given at startup
 * (BackendKeyData), read from driver-private fields, and the protocol CancelRequest that uses it
 * to stop a blocked lock wait without a pool slot or a login. `driver.ts` re-exports both.
 */
import * as Effect from "effect/Effect"
import * as Net from "node:net"
import type pg from "pg"

/** node-pg's fields behind the backend key and the address (not in its typings). */
interface BackendKey {
  readonly processID?: unknown
  readonly secretKey?: unknown
  readonly connectionParameters?: { readonly host?: unknown; readonly port?: unknown }
}

const backendKey = (client: pg.Client): BackendKey => client as unknown as BackendKey

/**
 * The process id the server announced at startup (BackendKeyData). On a direct connection it
 * equals `pg_backend_pid()`; a pooler announces its own key, so they differ behind one.
 */
export const announcedPid = (client: pg.Client): number | undefined => {
  const pid = backendKey(client).processID
  return typeof pid === "number" ? pid : undefined
}

const CANCEL_REQUEST_CODE = 80877102

/**
 * Sends a protocol CancelRequest (process id + secret key) over a throw-away socket: it needs no
 * pool slot and no login. Completes with true when the server has closed that socket (by then the
 * cancel signal has been delivered to the backend), false when it could not be sent. Never fails
 * and has no bound of its own: the caller bounds it; interrupting it closes the socket.
 */
export const sendCancel = (client: pg.Client): Effect.Effect<boolean> =>
  Effect.async<boolean>((resume) => {
    const key = backendKey(client)
    const pid = key.processID
    const secret = key.secretKey
    const host = key.connectionParameters?.host
    const port = key.connectionParameters?.port
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

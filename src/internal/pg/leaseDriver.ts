/**
 * The PgLease backend's edge to node-postgres: the connections it owns (never the application's
 * pool), each driver call wrapped once as an Effect. `pg` is loaded when a layer is built, not
 * when `effect-lock` is imported, so an application without it can still import the library.
 *
 * Bounds are timers here, at the edge, not racing fibers: a race per statement costs more than
 * the statement. They follow `stallSafe`'s rule: when a timer fires, the event loop first reads
 * the sockets (two hops through the check phase) and only a statement still unanswered then has
 * timed out — after an event-loop stall Node runs due timers before it reads the answers that
 * arrived meanwhile, and a live statement must not be failed for that.
 */
import * as Effect from "effect/Effect"
import type pg from "pg"
import { LockBackendError } from "../../LockError.js"
import { classify, preparedName } from "./driver.js"
import { sqlStateOf } from "../sql/state.js"

/** The driver module, loaded once. */
export type Driver = typeof pg

let loaded: Promise<Driver> | undefined

/** Loads `pg` (once per process); fails with a `LockBackendError` naming the missing package. */
export const load: Effect.Effect<Driver, LockBackendError> = Effect.tryPromise({
  try: () => (loaded ??= import("pg").then((module) => module.default)),
  catch: (cause) =>
    new LockBackendError({
      operation: "configure",
      cause: new Error(`PgLease needs the "pg" package for its own connections: ${String(cause)}`)
    })
})

/** A statement (or connect) that did not answer within its bound. */
export class StatementTimeout extends Error {
  constructor(readonly boundMillis: number) {
    super(`no answer within ${boundMillis} ms`)
  }
}

/** One connection the backend owns. `broken` once its state is unknown: it is then destroyed, never reused. */
export interface Connection {
  readonly client: pg.Client
  broken: boolean
  /** `performance.now()` of the last use, for closing idle connections. */
  lastUsed: number
  /** Shared by the connections of one lane: whether its statements may be prepared. */
  readonly statements: PreparedStatements
}

/**
 * Whether a lane sends its parameterised statements as prepared statements: parsed and planned
 * once per connection, then only bound (PgLease's statements are large CTEs whose planning costs
 * more than running them: measured 5.4 → 1.3 ms for an acquire). Turned off for good the first
 * time the server says a prepared statement is missing or already there — a transaction pooler
 * (PgBouncer before 1.21 in transaction mode) handing the session's statements to another
 * server connection.
 */
export interface PreparedStatements {
  enabled: boolean
}

/** Lane-wide prepared-statement state, on by default. */
export const preparedStatements = (): PreparedStatements => ({ enabled: true })

/**
 * Run once on every new connection: with `client_connection_check_interval` the server notices
 * within half a second that a connection this side destroyed (a statement past its bound) is gone,
 * even while that statement waits for a row lock, and abandons the statement rather than commit
 * it later. Skipped where the server does not know the setting (before PostgreSQL 14). Behind a
 * transaction pooler it lands on whichever server connection runs it, where it is harmless.
 */
const SESSION_SETUP = `select set_config(s.name, s.setting, false) from (values ('client_connection_check_interval', '500')) as s(name, setting)
where exists (select 1 from pg_settings p where p.name = s.name)`

/** SQLSTATEs of a prepared statement its server connection does not have (or already has). */
const PREPARED_LOST: ReadonlySet<string> = new Set(["26000", "42P05"])

/**
 * A stall-safe timer: `onTimeout` runs `millis` after now unless cancelled, but only after the
 * event loop has read the I/O that was ready when the timer fired.
 */
const stallSafeTimer = (millis: number, onTimeout: () => void): () => void => {
  let cancelled = false
  const timer = setTimeout(() => setImmediate(() => setImmediate(() => {
    if (!cancelled) onTimeout()
  })), Math.max(0, millis))
  return () => {
    cancelled = true
    clearTimeout(timer)
  }
}

const newConnection = (driver: Driver, config: pg.ClientConfig, statements: PreparedStatements): Connection => {
  const client = new driver.Client(config)
  const connection: Connection = { client, broken: false, lastUsed: performance.now(), statements }
  // Attached before connect: without an 'error' listener a terminated backend crashes Node.
  const markBroken = () => {
    connection.broken = true
  }
  client.on("error", markBroken)
  client.on("end", markBroken)
  return connection
}

/**
 * Opens a connection within `boundMillis`. Interrupted or timed out, the half-open client is
 * destroyed.
 */
export const connect = (
  driver: Driver,
  config: pg.ClientConfig,
  boundMillis: number,
  statements: PreparedStatements = preparedStatements()
): Effect.Effect<Connection, unknown> =>
  Effect.async<Connection, unknown>((resume) => {
    const connection = newConnection(driver, config, statements)
    let settled = false
    const settle = (outcome: Effect.Effect<Connection, unknown>) => {
      if (settled) return
      settled = true
      cancelTimer()
      resume(outcome)
    }
    const cancelTimer = stallSafeTimer(boundMillis, () => {
      destroyNow(connection)
      settle(Effect.fail(new StatementTimeout(boundMillis)))
    })
    connection.client.connect((error: Error) => {
      if (error) {
        destroyNow(connection)
        settle(Effect.fail(error))
      } else if (settled) {
        destroyNow(connection)
      } else {
        settle(Effect.succeed(connection))
      }
    })
    return Effect.sync(() => {
      if (settled) return
      settled = true
      cancelTimer()
      destroyNow(connection)
    })
  })

/** The server's answer refusing a statement leaves an autocommit session usable; anything else does not. */
const keepsSession = (error: unknown): boolean => classify(error)._tag === "Sql"

/** Closes the socket at once: the server ends the backend (and anything it was doing) when it notices. */
export const destroyNow = (connection: Connection): void => {
  connection.broken = true
  try {
    connection.client.connection.stream.destroy()
  } catch {
    // already closed
  }
  connection.client.end().catch(() => {})
}

export const destroy = (connection: Connection): Effect.Effect<void> => Effect.sync(() => destroyNow(connection))

/** Runs one statement on a connection held by the caller, within `boundMillis` (the connection is destroyed on timeout). */
export const query = <A>(connection: Connection, text: string, params: ReadonlyArray<unknown>, boundMillis: number) =>
  Effect.async<ReadonlyArray<A>, unknown>((resume) => {
    let settled = false
    const cancelTimer = stallSafeTimer(boundMillis, () => {
      if (settled) return
      settled = true
      destroyNow(connection)
      resume(Effect.fail(new StatementTimeout(boundMillis)))
    })
    send(connection, text, params, (outcome) => {
      if (settled) return
      settled = true
      cancelTimer()
      resume(outcome as Effect.Effect<ReadonlyArray<A>, unknown>)
    })
    return Effect.sync(() => {
      if (settled) return
      settled = true
      cancelTimer()
      // Whatever the statement does now, nobody reads it: this session is not reused.
      destroyNow(connection)
    })
  })

const send = (
  connection: Connection,
  text: string,
  params: ReadonlyArray<unknown>,
  done: (outcome: Effect.Effect<ReadonlyArray<unknown>, unknown>) => void
) => {
  const name = params.length > 0 && connection.statements.enabled ? preparedName(text) : undefined
  const callback = (error: Error | undefined, result: pg.QueryResult) => {
    connection.lastUsed = performance.now()
    if (error) {
      const code = sqlStateOf(error)
      if (name !== undefined && code !== undefined && PREPARED_LOST.has(code)) {
        // Refused at bind or parse, so nothing ran: the lane stops preparing and sends it again.
        connection.statements.enabled = false
        return send(connection, text, params, done)
      }
      if (!keepsSession(error)) connection.broken = true
      done(Effect.fail(error))
    } else {
      done(Effect.succeed(result.rows))
    }
  }
  if (name === undefined) connection.client.query(text, params as Array<unknown>, callback as never)
  else connection.client.query({ name, text, values: [...params] }, callback as never)
}

/** At most `size` connections, opened on demand; broken ones destroyed; idle ones closed by `reap`. */
export interface Pool {
  /**
   * One statement on a pooled connection. `boundMillis` covers waiting for a connection, opening
   * it and the statement; past it the statement fails with `StatementTimeout` and its connection,
   * if it was sending, is destroyed.
   */
  readonly statement: <A>(text: string, params: ReadonlyArray<unknown>, boundMillis: number) => Effect.Effect<ReadonlyArray<A>, unknown>
  /** Closes connections idle for longer than `idleMillis`. */
  readonly reap: (idleMillis: number) => void
  /** Destroys every connection; later statements fail. */
  readonly close: () => void
  readonly size: () => number
}

type Waiter = (connection: Connection | undefined) => void

export const makePool = (driver: Driver, config: pg.ClientConfig, max: number): Pool => {
  // One state for the pool's connections: a pooler that loses prepared statements is found once.
  const statements = preparedStatements()
  const idle: Array<Connection> = []
  const waiters: Array<Waiter> = []
  let open = 0
  let closed = false

  const discard = (connection: Connection) => {
    open--
    destroyNow(connection)
  }

  /** A connection is free again: to the first waiter, else idle. */
  const checkin = (connection: Connection) => {
    if (closed || connection.broken) {
      discard(connection)
      // Its slot is free: a waiter gets a fresh connection.
      const waiter = waiters.shift()
      if (waiter !== undefined) waiter(undefined)
      return
    }
    const waiter = waiters.shift()
    if (waiter !== undefined) waiter(connection)
    else idle.push(connection)
  }

  const statement = <A>(text: string, params: ReadonlyArray<unknown>, boundMillis: number) =>
    Effect.async<ReadonlyArray<A>, unknown>((resume) => {
      let settled = false
      let sending: Connection | undefined
      let waiting: Waiter | undefined
      const settle = (outcome: Effect.Effect<ReadonlyArray<unknown>, unknown>) => {
        if (settled) return
        settled = true
        cancelTimer()
        resume(outcome as Effect.Effect<ReadonlyArray<A>, unknown>)
      }
      /** Nobody reads this statement any more. */
      const abandon = () => {
        if (waiting !== undefined) {
          const index = waiters.indexOf(waiting)
          if (index >= 0) waiters.splice(index, 1)
          waiting = undefined
        }
        // A statement in flight may still run and commit: its session is destroyed, never
        // reused (its callback then fails and hands the slot back).
        if (sending !== undefined) destroyNow(sending)
      }
      const cancelTimer = stallSafeTimer(boundMillis, () => {
        if (settled) return
        abandon()
        settle(Effect.fail(new StatementTimeout(boundMillis)))
      })
      const run = (connection: Connection) => {
        if (settled) return checkin(connection)
        sending = connection
        send(connection, text, params, (outcome) => {
          sending = undefined
          checkin(connection)
          settle(outcome)
        })
      }
      const obtain: Waiter = (connection) => {
        waiting = undefined
        if (connection !== undefined) return run(connection)
        // A free slot: open a connection in it (its connect is bounded by connectionTimeoutMillis).
        if (closed) {
          for (const waiter of waiters.splice(0)) waiter(undefined)
          return settle(Effect.fail(new Error("the lock connections were closed")))
        }
        open++
        openConnection(driver, config, statements, (opened, error) => {
          if (opened !== undefined) return run(opened)
          open--
          const waiter = waiters.shift()
          if (waiter !== undefined) waiter(undefined)
          settle(Effect.fail(error))
        })
      }
      const reused = takeIdle()
      if (reused !== undefined) run(reused)
      else if (closed || open < max) obtain(undefined)
      else {
        waiting = obtain
        waiters.push(obtain)
      }
      return Effect.sync(() => {
        if (settled) return
        settled = true
        cancelTimer()
        abandon()
      })
    })

  const takeIdle = (): Connection | undefined => {
    while (idle.length > 0) {
      const connection = idle.pop()!
      if (!connection.broken) return connection
      discard(connection)
    }
    return undefined
  }

  return {
    statement,
    reap: (idleMillis) => {
      const now = performance.now()
      for (let i = idle.length - 1; i >= 0; i--) {
        const connection = idle[i]!
        if (connection.broken || now - connection.lastUsed > idleMillis) {
          idle.splice(i, 1)
          discard(connection)
        }
      }
    },
    close: () => {
      closed = true
      for (const connection of idle.splice(0)) discard(connection)
      for (const waiter of waiters.splice(0)) waiter(undefined)
    },
    size: () => open
  }
}

/** Opens a connection for the pool; its bound is the statement's own (the pool's caller's timer). */
const openConnection = (
  driver: Driver,
  config: pg.ClientConfig,
  statements: PreparedStatements,
  done: (connection: Connection | undefined, error?: unknown) => void
) => {
  const connection = newConnection(driver, config, statements)
  connection.client.connect((error: Error) => {
    if (error) {
      destroyNow(connection)
      return done(undefined, error)
    }
    connection.client.query(SESSION_SETUP, (setupError: Error | undefined) => {
      if (setupError) {
        destroyNow(connection)
        done(undefined, setupError)
      } else {
        done(connection)
      }
    })
  })
}

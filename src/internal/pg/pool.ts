/**
 * PgLease's piece of the node-postgres edge: the connections it owns (never the application's
 * pool) — one connection (`connect`, `query`, `destroy`) and a small pool of them (`makePool`),
 * over the shared edge in `driver.ts` (load, open, bounded statement, destroy, classification).
 * What is PgLease's own here: the session setup of its lock connections, its prepared statements
 * and their fallback behind a transaction pooler, and the pool.
 */
import * as Effect from "effect/Effect"
import type pg from "pg"
import type { LockBackendError } from "../../LockError.js"
import type { BatchSpec, Row } from "../lease/dialect.js"
import {
  destroy as destroyClient,
  type Driver,
  loadFor,
  openClient,
  preparedName,
  send,
  stallSafeTimer,
  StatementTimeout
} from "./driver.js"

export { type Driver, StatementTimeout } from "./driver.js"

/** Loads `pg` (once per process); fails with a `LockBackendError` naming the missing package. */
export const load: Effect.Effect<Driver, LockBackendError> = loadFor("PgLease", "configure")

/** One connection the backend owns. `broken` once its state is unknown: it is then destroyed, never reused. */
export interface Connection {
  readonly client: pg.Client
  broken: boolean
  /** `performance.now()` of the last use, for closing idle connections. */
  lastUsed: number
  /** Shared by the connections of one lane: whether its statements may be prepared. */
  readonly statements: PreparedStatements
  /** Why this side destroyed it mid-statement, when a statement's bound did: what a batch's other members fail with. */
  endedBy?: StatementTimeout | undefined
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
 * Run once on every pooled connection: with `client_connection_check_interval` the server notices
 * within half a second that a connection this side destroyed (a statement past its bound) is gone,
 * even while that statement waits for a row lock, and abandons the statement rather than commit
 * it later. Skipped where the server does not know the setting (before PostgreSQL 14). Behind a
 * transaction pooler it lands on whichever server connection runs it, where it is harmless.
 */
const SESSION_SETUP = `select set_config(s.name, s.setting, false) from (values ('client_connection_check_interval', '500')) as s(name, setting)
where exists (select 1 from pg_settings p where p.name = s.name)`

/** SQLSTATEs of a prepared statement its server connection does not have (or already has). */
const PREPARED_LOST: ReadonlySet<string> = new Set(["26000", "42P05"])

/** Opens a connection (`done` once, with it or with why not); returns the abort, which destroys it. */
const openConnection = (
  driver: Driver,
  config: pg.ClientConfig,
  statements: PreparedStatements,
  setup: string | undefined,
  boundMillis: number | undefined,
  done: (connection: Connection | undefined, error?: unknown) => void
): () => void => {
  let connection: Connection | undefined
  let closed = false
  const onClosed = () => {
    closed = true
    if (connection !== undefined) connection.broken = true
  }
  return openClient(driver, config, { events: { onClosed }, setup, boundMillis }, (opened, error) => {
    if (opened === undefined) return done(undefined, error)
    connection = { client: opened.client, broken: closed, lastUsed: performance.now(), statements }
    done(connection)
  })
}

/**
 * Opens a connection within `boundMillis`. Interrupted or timed out (`StatementTimeout`), the
 * half-open client is destroyed.
 */
export const connect = (
  driver: Driver,
  config: pg.ClientConfig,
  boundMillis: number,
  statements: PreparedStatements = preparedStatements()
): Effect.Effect<Connection, unknown> =>
  Effect.async<Connection, unknown>((resume) => {
    const abort = openConnection(driver, config, statements, undefined, boundMillis, (connection, error) =>
      resume(connection === undefined ? Effect.fail(error) : Effect.succeed(connection)))
    return Effect.sync(abort)
  })

/** Closes the socket at once: the server ends the backend (and anything it was doing) when it notices. */
export const destroyNow = (connection: Connection): void => {
  connection.broken = true
  destroyClient(connection.client)
}

export const destroy = (connection: Connection): Effect.Effect<void> => Effect.sync(() => destroyNow(connection))

/**
 * One statement on a connection, prepared while the lane prepares; `done` once, with the rows or
 * the driver's error (`StatementTimeout` past `boundMillis`). A failure that leaves the session's
 * state unknown marks the connection broken.
 */
const run = (
  connection: Connection,
  text: string,
  params: ReadonlyArray<unknown>,
  boundMillis: number | undefined,
  done: (error: unknown, rows?: ReadonlyArray<unknown>) => void
): () => boolean => {
  const name = params.length > 0 && connection.statements.enabled ? preparedName(text) : undefined
  let abandon = send(connection.client, text, params, name, boundMillis, (failure, result) => {
    connection.lastUsed = performance.now()
    if (failure === undefined) return done(undefined, result!.rows)
    if (name !== undefined && failure._tag === "Sql" && PREPARED_LOST.has(failure.code)) {
      // Refused at bind or parse, so nothing ran: the lane stops preparing and sends it again.
      connection.statements.enabled = false
      abandon = run(connection, text, params, boundMillis, done)
      return
    }
    // Only the server's refusal leaves an autocommit session usable.
    if (failure._tag === "Connection") connection.broken = true
    done(failure.error)
  })
  return () => abandon()
}

/** Runs one statement on a connection held by the caller, within `boundMillis` (the connection is destroyed on timeout). */
export const query = <A>(connection: Connection, text: string, params: ReadonlyArray<unknown>, boundMillis: number) =>
  Effect.async<ReadonlyArray<A>, unknown>((resume) => {
    const abandon = run(connection, text, params, boundMillis, (error, rows) =>
      resume(error === undefined ? Effect.succeed(rows as ReadonlyArray<A>) : Effect.fail(error)))
    return Effect.sync(() => {
      // Whatever the statement does now, nobody reads it: this session is not reused.
      if (abandon()) destroyNow(connection)
    })
  })

/** At most `size` connections, opened on demand; broken ones destroyed; idle ones closed by `reap`. */
export interface Pool {
  /**
   * One statement on a pooled connection. `boundMillis` covers waiting for a connection, opening
   * it and the statement; past it the statement fails with `StatementTimeout` and its connection,
   * if it was sending, is destroyed.
   */
  readonly statement: <A>(text: string, params: ReadonlyArray<unknown>, boundMillis: number) => Effect.Effect<ReadonlyArray<A>, unknown>
  /**
   * `statement` with a callback: `done` is called once, with the rows or the error, from the
   * driver's callback (or the bound's timer). Returns the abandon: nobody reads the statement any
   * more (its connection, if it was sending, is destroyed).
   */
  readonly statementNow: (
    text: string,
    params: ReadonlyArray<unknown>,
    boundMillis: number,
    done: (error: unknown, rows?: ReadonlyArray<unknown>) => void,
    batch?: BatchSpec
  ) => () => void
  /** Closes connections idle for longer than `idleMillis`. */
  readonly reap: (idleMillis: number) => void
  /** Destroys every connection; later statements fail. */
  readonly close: () => void
  readonly size: () => number
  /** How many batches (statements standing for two or more) this pool has sent. */
  readonly batches: () => number
  /** How many statements wait for a connection. */
  readonly queued: () => number
}

/** A statement waiting for a connection. */
interface Waiting {
  /** Its turn: it takes a connection (or waits again). */
  readonly take: () => void
  /** Its parameters, and the kind of batch it may go in while it may (`BatchSpec.key` says whether). */
  readonly params: ReadonlyArray<unknown>
  readonly batch: () => BatchSpec | undefined
  /**
   * It goes out in a batch on `connection` (undefined once the batch answered), with `live`: the
   * batch's members still waiting for its answer.
   */
  readonly sendingOn: (connection: Connection | undefined, live?: Set<Waiting>) => void
  readonly settle: (error: unknown, rows?: ReadonlyArray<unknown>) => void
  /** The batch did not decide it: it sends its own statement. */
  readonly alone: () => void
}

/**
 * Hand-made rather than `effect/Pool`: a statement takes a connection, runs and gives it back in
 * driver callbacks under one timer — no scope, finalizer or fiber on the uncontended path — and
 * the timer destroys a connection in the same synchronous step as it fails the statement.
 */
export const makePool = (driver: Driver, config: pg.ClientConfig, max: number): Pool => {
  // One state for the pool's connections: a pooler that loses prepared statements is found once.
  const statements = preparedStatements()
  // Most recently used last, and taken first: the others idle long enough to be reaped.
  const idle: Array<Connection> = []
  // Statements waiting for a connection or a free slot, first in, first out.
  const waiters: Array<Waiting> = []
  let open = 0
  let closed = false
  let batches = 0
  // pg's own connect timeout also bounds the setup: a slot is never held by a connection that hangs opening.
  const openBound = config.connectionTimeoutMillis !== undefined && config.connectionTimeoutMillis > 0
    ? config.connectionTimeoutMillis
    : undefined

  const discard = (connection: Connection) => {
    open--
    destroyNow(connection)
  }

  /** A connection is done with: kept when usable, its slot freed when not; the first waiter takes either. */
  const checkin = (connection: Connection) => {
    if (closed || connection.broken) discard(connection)
    else idle.push(connection)
    waiters.shift()?.take()
  }

  const takeIdle = (): Connection | undefined => {
    for (let connection = idle.pop(); connection !== undefined; connection = idle.pop()) {
      if (!connection.broken) return connection
      discard(connection)
    }
    return undefined
  }

  /** The waiting statements that may go out with one keyed `key` (its `spec`, other keys), taken off the queue. */
  const gather = (spec: BatchSpec, key: string): Array<Waiting> => {
    const members: Array<Waiting> = []
    const keys = new Set([key])
    for (let i = 0; i < waiters.length && members.length + 1 < spec.max; i++) {
      const waiting = waiters[i]!
      if (waiting.batch() !== spec) continue
      const other = spec.key(waiting.params)
      if (other === undefined || keys.has(other)) continue
      keys.add(other)
      members.push(waiting)
      waiters.splice(i--, 1)
    }
    return members
  }

  /** One statement for every member, on `connection`; each member settles from its own rows, or sends its own statement. */
  const sendBatch = (connection: Connection, spec: BatchSpec, members: ReadonlyArray<Waiting>) => {
    if (members.length > 1) batches++
    // A batch of one (`BatchSpec.alone`) ends with its member, as a statement alone: no set to keep.
    const live = members.length > 1 ? new Set(members) : undefined
    for (const member of members) member.sendingOn(connection, live)
    run(connection, spec.text, spec.encode(members.map((member) => member.params)), undefined, (error, rows) => {
      for (const member of members) member.sendingOn(undefined)
      // The server refused the batch as a whole (a deadlock where its first insert of a name met
      // another's, say): its session is fine and nothing of it committed, so each member goes
      // alone, as it would have.
      const refused = error !== undefined && !connection.broken
      checkin(connection)
      if (error !== undefined) {
        // Ended by one member's bound: the others fail with that timeout, not a bare "destroyed".
        const failure = connection.endedBy ?? error
        for (const member of members) refused ? member.alone() : member.settle(failure)
        return
      }
      const answers = spec.split(rows as ReadonlyArray<Row>, members.length)
      members.forEach((member, i) => {
        const own = answers[i]
        if (own === undefined) member.alone()
        else member.settle(undefined, own)
      })
    })
  }

  const statementNow: Pool["statementNow"] = (text, params, boundMillis, done, batchSpec) => {
    let settled = false
    let sending: Connection | undefined
    /** While it goes out in a batch: the batch's members still waiting for the answer. */
    let batchLive: Set<Waiting> | undefined
    let batch = batchSpec
    const settle = (error: unknown, rows?: ReadonlyArray<unknown>) => {
      if (settled) return
      settled = true
      cancelTimer()
      done(error, rows)
    }
    /** Whether leaving now ends what it was sent in: alone, or the last member of its batch still waiting. */
    const endsItsSend = () =>
      sending !== undefined && (batchLive === undefined || (batchLive.size === 1 && batchLive.has(waiting)))
    /** Nobody reads this statement any more. */
    const leave = () => {
      settled = true
      const index = waiters.indexOf(waiting)
      if (index >= 0) waiters.splice(index, 1)
      if (sending === undefined) return
      // In a batch others still wait for: it goes on for them (a member's bound is its own, not
      // the batch's). This member's outcome is unknown, as with a destroyed session: its owner
      // gives back whatever the batch may grant it (`lease/giveBack`).
      if (!endsItsSend()) return void batchLive!.delete(waiting)
      // A statement in flight may still run and commit: its session is destroyed, never reused
      // (the edge then fails the statement — the batch it went in — which hands the slot back).
      destroyNow(sending)
    }
    const cancelTimer = stallSafeTimer(boundMillis, () => {
      if (settled) return
      const timeout = new StatementTimeout(boundMillis)
      // Ends the batch it is in when no other member still waits (the connection is destroyed below):
      // its bound ran out last, and the batch fails with that timeout.
      if (endsItsSend()) sending!.endedBy = timeout
      leave()
      done(timeout)
    })
    const use = (connection: Connection) => {
      if (settled) return checkin(connection)
      // Only statements that waited for a connection are batched: an idle pool sends each alone,
      // as its own statement unless its batch's is the cheaper one alone too (`BatchSpec.alone`).
      const key = batch !== undefined && (waiters.length > 0 || batch.alone === true) ? batch.key(params) : undefined
      if (key !== undefined) {
        const others = gather(batch!, key)
        if (others.length > 0 || batch!.alone === true) return sendBatch(connection, batch!, [waiting, ...others])
      }
      sending = connection
      run(connection, text, params, undefined, (error, rows) => {
        sending = undefined
        checkin(connection)
        settle(error, rows)
      })
    }
    /** Its turn: an idle connection, else a new one in a free slot, else wait for one. */
    const take = (): void => {
      if (closed) return settle(new Error("the lock connections were closed"))
      const connection = takeIdle()
      if (connection !== undefined) return use(connection)
      if (open >= max) return void waiters.push(waiting)
      open++
      openConnection(driver, config, statements, SESSION_SETUP, openBound, (opened, error) => {
        if (opened !== undefined) return use(opened)
        open--
        waiters.shift()?.take()
        settle(error)
      })
    }
    const waiting: Waiting = {
      take,
      params,
      batch: () => (settled ? undefined : batch),
      sendingOn: (connection, live) => {
        sending = connection
        batchLive = connection === undefined ? undefined : live
      },
      settle,
      alone: () => {
        if (settled) return
        batch = undefined
        take()
      }
    }
    take()
    return () => {
      if (settled) return
      cancelTimer()
      leave()
    }
  }

  const statement = <A>(text: string, params: ReadonlyArray<unknown>, boundMillis: number) =>
    Effect.async<ReadonlyArray<A>, unknown>((resume) => {
      const abandon = statementNow(text, params, boundMillis, (error, rows) =>
        resume(error === undefined ? Effect.succeed(rows as ReadonlyArray<A>) : Effect.fail(error)))
      return Effect.sync(abandon)
    })

  return {
    statement,
    statementNow,
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
      for (const waiter of waiters.splice(0)) waiter.take()
    },
    size: () => open,
    batches: () => batches,
    queued: () => waiters.length
  }
}

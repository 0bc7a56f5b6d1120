/**
 * The SQL text of the advisory engine, in one place. Every statement a lock session runs also
 * returns `pg_backend_pid()` (column `pid`), so the session layer can prove on each answer that
 * the statement ran on the backend the session was opened on — a pooler that moves a session
 * is caught by the very statement that moved.
 */
import type { LockMode } from "../../Lease.js"
import { literal } from "../pgDriver.js"
import type { TableRef } from "../sqlTable.js"

/** Channel of release notifications; the payload is the key in decimal. */
export const CHANNEL = "effect_lock_released"

/** Settings of every lock session (those the server does not know are skipped). */
const SESSION_SETTINGS: ReadonlyArray<readonly [string, string]> = [
  // Fencing tokens must never repeat or go backwards, even across a server crash: every bump's
  // commit waits for its WAL flush, whatever the server, database or role default says (with
  // `off`, a crash could lose bumps that were already handed out as tokens).
  ["synchronous_commit", "on"],
  // These let the server drop a destroyed client's queued wait promptly.
  ["client_connection_check_interval", "500"],
  ["tcp_keepalives_idle", "5"],
  ["tcp_keepalives_interval", "2"],
  ["tcp_keepalives_count", "3"],
  // Heartbeats keep sessions busy enough, but a server-wide idle timeout would drop held locks.
  ["idle_session_timeout", "0"],
  // Statements are bounded on the client; a server-side default must not cut a lock wait short.
  ["statement_timeout", "0"],
  // A fencing-row lock wait (another process's bump in flight) ends in 55P03 before the client-side
  // statement bound would destroy the session; blocking waits set their own lock_timeout per slice.
  ["lock_timeout", "4000"],
  ["idle_in_transaction_session_timeout", "0"]
]

/**
 * Session setup: the settings above, then the backend pid (last result). The home session also
 * LISTENs for release notifications. Simple protocol, one round trip.
 */
export const setupSql = (listen: boolean): string => {
  const values = SESSION_SETTINGS.map(([name, value]) => `(${literal(name)}, ${literal(value)})`)
  const settings = `select set_config(v.name, v.value, false) from (values ${values.join(", ")}) as v(name, value) ` +
    `where exists (select 1 from pg_settings s where s.name = v.name)`
  const listenSql = listen ? `; LISTEN "${CHANNEL}"` : ""
  return `${settings}${listenSql}; select pg_backend_pid() as pid`
}

const suffix = (mode: LockMode) => (mode === "shared" ? "_shared" : "")

/**
 * Try-locks a batch of keys and bumps the fencing counter of each key granted, in one statement
 * and one commit: concurrent grants on a session share a WAL flush. Rows: one per granted key
 * (`key`, `token`), plus one row carrying only `pid`.
 *
 * Parameters: $1 keys (bigint[]), $2 names (text[]), $3 shared flags (boolean[]).
 */
export const tryBatchSql = (table: TableRef): string =>
  `with request as (select * from unnest($1::bigint[], $2::text[], $3::boolean[]) as r(key, name, shared)), ` +
  `attempt as (select key, name, case when shared then pg_try_advisory_lock_shared(key) ` +
  `else pg_try_advisory_lock(key) end as granted from request), ` +
  `bumped as (insert into ${table.sql} as f (key, name, token) select key, name, 1 from attempt where granted ` +
  `on conflict (key) do update set token = f.token + 1, name = excluded.name returning f.key, f.token) ` +
  `select key::text as key, token::text as token, null::int as pid from bumped ` +
  `union all select null, null, pg_backend_pid()`

/**
 * A shared join's fencing bump: only while no exclusive request waits at the server for the key,
 * since PostgreSQL itself queues a new shared request behind a waiting exclusive one. No `token`
 * in the answer: a waiter is queued, so the join must queue at the server too.
 *
 * Parameters: $1 key, $2 name, $3 classid, $4 objid (the key's `pg_locks` halves).
 */
export const joinBumpSql = (table: TableRef): string =>
  `with bumped as (insert into ${table.sql} as f (key, name, token) select $1::bigint, $2::text, 1 ` +
  `where not exists (select 1 from pg_locks l where l.locktype = 'advisory' and l.objsubid = 1 ` +
  `and l.classid = $3::int8::oid and l.objid = $4::int8::oid and not l.granted and l.mode = 'ExclusiveLock' ` +
  `and l.database = (select oid from pg_database where datname = current_database())) ` +
  `on conflict (key) do update set token = f.token + 1, name = excluded.name returning f.token) ` +
  `select (select token::text from bumped) as token, pg_backend_pid() as pid`

/**
 * One slice of a blocking wait, one simple-protocol round trip: bounded wait, grant, bump. The
 * implicit transaction aborts as a whole on 55P03 (the slice's lock_timeout), leaving nothing.
 */
export const waitSql = (table: TableRef, key: bigint, name: string, mode: LockMode, lockTimeoutMillis: number): string =>
  [
    `SET LOCAL lock_timeout = ${lockTimeoutMillis}`,
    `SELECT pg_advisory_lock${suffix(mode)}('${key}'::bigint)`,
    `SET LOCAL lock_timeout TO DEFAULT`,
    `INSERT INTO ${table.sql} AS f (key, name, token) VALUES ('${key}'::bigint, ${literal(name)}, 1) ` +
    `ON CONFLICT (key) DO UPDATE SET token = f.token + 1, name = excluded.name ` +
    `RETURNING f.token::text AS token, pg_backend_pid() AS pid`
  ].join("; ")

/** Namespace of the interest keys (see `releaseSql`). */
export const INTEREST_NAMESPACE = "effect-lock/PgAdvisory/release-interest"

/**
 * Gives a lock back, and tells the processes that wait for it on notifications only — if there
 * are any. Such a waiter holds the key's *interest* lock shared on its home session while it
 * waits (`INTEREST_SQL`); the release tries the interest lock exclusively for its own statement
 * (`pg_try_advisory_xact_lock`, gone at its commit): it fails only when a waiter holds it, and
 * only then is `pg_notify` sent. A release nobody waits for notifies nobody, so its commit is
 * free of NOTIFY's database-wide queue lock. A waiter registers before its last try, so a
 * release either comes before that try (which then succeeds) or sees the interest.
 *
 * Parameters: $1 key, $2 its interest key, $3 channel.
 */
export const releaseSql = (mode: LockMode): string =>
  `select pg_advisory_unlock${suffix(mode)}($1::bigint) as released, pg_backend_pid() as pid, ` +
  `case when pg_try_advisory_xact_lock($2::bigint) then null else pg_notify($3, $1::bigint::text) end as notified`

/** Undoes a grant that was never handed out: nobody can be waiting on its release yet. Parameters: $1 key. */
export const undoSql = (mode: LockMode): string =>
  `select pg_advisory_unlock${suffix(mode)}($1::bigint) as released, pg_backend_pid() as pid`

/**
 * Registers interest in a key's release notifications (see `releaseSql`); never waits: `false`
 * when a release is checking for interest at this very moment (the caller then simply tries the
 * lock again). Parameters: $1 the interest key.
 */
export const INTEREST_SQL = "select pg_try_advisory_lock_shared($1::bigint) as registered, pg_backend_pid() as pid"

/** Withdraws a registered interest. Parameters: $1 the interest key. */
export const UNINTEREST_SQL = "select pg_advisory_unlock_shared($1::bigint) as released, pg_backend_pid() as pid"

/** Drops every session lock of a wait session that held nothing before its wait. */
export const UNLOCK_ALL_SQL = "select pg_advisory_unlock_all(), pg_backend_pid() as pid"

/** A heartbeat: proves the session answers, and that it is still the same backend. */
export const HEARTBEAT_SQL = "select pg_backend_pid() as pid"

/**
 * The SQL text of the advisory engine, in one place. Every statement a lock session runs also
 * returns `pg_backend_pid()` (column `pid`), so the session layer can prove on each answer that
 * the statement ran on the backend the session was opened on — a pooler that moves a session
 * is caught by the very statement that moved.
 */
import type { LockMode } from "../../Lease.js"
import { literal } from "../pg/driver.js"
import type { TableRef } from "../sql/tables.js"

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

/** The server's wall clock in ms since the epoch (the time of the read, not of a transaction's start). */
export const NOW_SQL = "select (extract(epoch from clock_timestamp()) * 1000)::float8 as now, pg_backend_pid() as pid"

// ------------------------------------------------------------------------------------ permits
//
// Semaphores (`permits.ts`). Keys of one semaphore name, all in a key space of their own
// (`permits.ts`' namespaces): the fencing row's key (also the notification payload and the base
// of the interest key), slot `i` = slotBase # i for i < limit (one session lock per permit), and
// the limit marker of limit `L` = markerBase # L, held shared by every holder and waiter of the
// name with limit `L` (`#` is bigint XOR, so the statement can derive a marker from a stored limit).
//
// Every statement below runs on a session that never blocks (the home session) and waits for
// nothing but the semaphore's fencing row, which other attempts hold for one statement at most.

/**
 * Makes sure a semaphore's fencing row exists (token 0, no limit yet): an attempt locks the row
 * with `FOR UPDATE`, which finds nothing to lock on a name's first use. Parameters: $1 key, $2 name.
 */
export const permitRowSql = (table: TableRef): string =>
  `with created as (insert into ${table.sql} (key, name, token) values ($1::bigint, $2::text, 0) ` +
  `on conflict (key) do nothing returning 1) ` +
  `select (select count(*) from created)::int as created, pg_backend_pid() as pid`

/**
 * One permit attempt, in one statement and one commit, all or none. Steps, each a MATERIALIZED
 * CTE fed by the one before so that none is reordered, inlined or skipped:
 *
 * 1. `cur`: locks the semaphore's fencing row (`FOR UPDATE`). Every attempt on the name, in any
 *    process, serializes here, so the limit check and a change of limit below are race-free.
 * 2. `decide`: the limit. A registered waiter already holds its marker (`held`). Otherwise, with
 *    the stored limit equal to ours (or none yet), the request takes its marker shared (`same`).
 *    With another stored limit it tries the *stored* limit's marker exclusively for this
 *    transaction: success proves that no session holds it — no holder, no waiter uses the stored
 *    limit — and none can take it meanwhile (that needs this row lock), so the name is free and
 *    the request takes it over with its own limit (`takeover`, its marker shared; the row gets the
 *    new limit below). Failure: the name is in use with the stored limit (`mismatch`). A marker
 *    found held exclusively is another transaction's probe about to end (`retry`).
 *    (PostgreSQL never lets a session's own locks conflict with its own requests: the caller
 *    refuses another limit itself while this session holds a marker of the name.)
 * 3. `reg`: a request that registers as a waiter takes the interest key shared *before* it tries
 *    the slots, so a release either frees a slot before those tries or sees the interest and
 *    notifies (see `releaseSql`).
 * 4. `slots`: try-locks free slots in order until it has `permits` of them (LIMIT stops the scan),
 *    skipping the slots this session already holds for other requests of this process (a session
 *    is granted its own lock again: without the skip one slot would count twice).
 * 5. `fin`: granted when all `permits` were taken; otherwise every slot taken here is unlocked
 *    again in this same statement, and the marker too unless the request now waits registered.
 *    `failed` when an unlock was refused (the caller then destroys the session).
 * 6. `bumped`: on a grant the counter goes up by `permits` (tokens counter-permits+1 .. counter),
 *    and the row keeps the limit in use.
 *
 * Outcomes: granted | waiting (registered: marker and interest held) | busy | mismatch | retry |
 * missing (no fencing row) | failed. Parameters: $1 key, $2 limit, $3 permits, $4 slot base,
 * $5 marker base, $6 interest key, $7 register as a waiter if busy, $8 already registered,
 * $9 slots this session holds for the name (int[]). Needs PostgreSQL 12+ (MATERIALIZED).
 */
export const permitAttemptSql = (table: TableRef): string =>
  `with cur as materialized (` +
  `select f.token, f.permit_limit from ${table.sql} f where f.key = $1::bigint for update` +
  `), decide as materialized (` +
  `select c.token as counter, c.permit_limit as stored, case ` +
  `when c.token is null then null ` +
  `when $8::boolean then case when c.permit_limit is distinct from $2::int and c.permit_limit is not null ` +
  `then 'mismatch' else 'held' end ` +
  `when c.permit_limit is null or c.permit_limit = $2::int then ` +
  `case when pg_try_advisory_lock_shared($5::bigint # $2::bigint) then 'same' else 'retry' end ` +
  `when pg_try_advisory_xact_lock($5::bigint # c.permit_limit::bigint) then ` +
  `case when pg_try_advisory_lock_shared($5::bigint # $2::bigint) then 'takeover' else 'retry' end ` +
  `else 'mismatch' end as verdict ` +
  `from (values (1)) as one(x) left join cur c on true` +
  `), reg as materialized (` +
  `select d.counter, d.stored, d.verdict, case when d.verdict in ('same', 'takeover') and $7::boolean ` +
  `then pg_try_advisory_lock_shared($6::bigint) end as interested from decide d` +
  `), slots as materialized (` +
  `select g.i from reg r, ` +
  `generate_series(0, case when r.verdict in ('same', 'takeover', 'held') then $2::int - 1 else -1 end) as g(i) ` +
  `where case when g.i = any($9::int[]) then false else pg_try_advisory_lock($4::bigint # g.i::bigint) end ` +
  `limit $3::int` +
  `), tally as materialized (` +
  `select r.counter, r.stored, r.verdict, r.interested, (select count(*) from slots)::int as n, ` +
  `(select coalesce(array_agg(s.i), '{}') from slots s) as taken from reg r` +
  `), fin as materialized (` +
  `select t.counter, t.stored, t.verdict, t.interested, t.n, t.taken, case ` +
  `when t.verdict is null then 'missing' ` +
  `when t.verdict in ('mismatch', 'retry') then t.verdict ` +
  `when t.n = $3::int then case when ($8::boolean or coalesce(t.interested, false)) ` +
  `and not pg_advisory_unlock_shared($6::bigint) then 'failed' else 'granted' end ` +
  `when (select count(*) from slots s where pg_advisory_unlock($4::bigint # s.i::bigint)) <> t.n then 'failed' ` +
  `when $8::boolean then 'busy' ` +
  `when t.interested then 'waiting' ` +
  `when not pg_advisory_unlock_shared($5::bigint # $2::bigint) then 'failed' ` +
  `when t.interested is null then 'busy' ` +
  `else 'retry' end as outcome from tally t` +
  `), bumped as (` +
  `update ${table.sql} f set token = f.token + case when (select outcome from fin) = 'granted' then $3::int else 0 end, ` +
  `permit_limit = $2::int where f.key = $1::bigint and ((select outcome from fin) = 'granted' ` +
  `or ((select outcome from fin) = 'waiting' and (select stored from fin) is distinct from $2::int)) ` +
  `returning f.token` +
  `) select fin.outcome, fin.stored, fin.taken, fin.interested, (select b.token::text from bumped b) as token, ` +
  `pg_backend_pid() as pid from fin`

/**
 * Gives a grant of permits back: unlocks its slots, then its marker, then (as `releaseSql` does
 * for a lock) notifies only when a waiter of another session registered interest. The unlocks
 * run in a fenced subquery, before the interest check: a waiter that registered after that check
 * tries the slots after they were freed.
 *
 * Parameters: $1 slot base, $2 slots (int[]), $3 marker key, $4 interest key, $5 channel, $6 payload.
 */
export const PERMIT_RELEASE_SQL =
  `select x.unlocked, x.marker, case when pg_try_advisory_xact_lock($4::bigint) then null ` +
  `else pg_notify($5::text, $6::text) end as notified, pg_backend_pid() as pid from (` +
  `select (select count(*) from unnest($2::int[]) as u(i) where pg_advisory_unlock($1::bigint # u.i::bigint))::int ` +
  `as unlocked, pg_advisory_unlock_shared($3::bigint) as marker offset 0) as x`

/** A registered permit waiter leaves without a grant. Parameters: $1 marker key, $2 interest key. */
export const PERMIT_UNREGISTER_SQL =
  "select pg_advisory_unlock_shared($1::bigint) as marker, pg_advisory_unlock_shared($2::bigint) as interest, " +
  "pg_backend_pid() as pid"

/**
 * The SQL text of the advisory engine, in one place. Every statement a lock session runs also
 * returns `pg_backend_pid()` (column `pid`), so the session layer can prove on each answer that
 * the statement ran on the backend the session was opened on — a pooler that moves a session
 * is caught by the very statement that moved.
 */
import type { LockMode } from "../../Lease.js"
import { literal } from "../pg/driver.js"
import type { TableRef } from "../sql/tables.js"
import * as Tokens from "../sql/tokens.js"

/** Channel of release notifications; the payload is the key in decimal. */
export const CHANNEL = "effect_lock_released"

/**
 * A lock session's `lock_timeout` outside a blocking wait's slices: a fencing-row lock wait
 * (another process's bump in flight) ends in 55P03 before the client-side statement bound would
 * destroy the session. Set at session open, and set again (not `TO DEFAULT`, which is the role's or
 * server's value) after each wait slice's own.
 */
export const FENCING_LOCK_TIMEOUT_MS = 4_000

/** Settings of every lock session (those the server does not know are skipped). */
const SESSION_SETTINGS: ReadonlyArray<readonly [string, string]> = [
  // Every statement here relies on READ COMMITTED: a row lock wait (fencing bump, permit queue)
  // re-reads the newest row version; a stricter database or role default would fail it with 40001.
  ["default_transaction_isolation", "read committed"],
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
  // See FENCING_LOCK_TIMEOUT_MS; blocking waits set their own lock_timeout per slice.
  ["lock_timeout", String(FENCING_LOCK_TIMEOUT_MS)],
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
 * One text per table, built once: a statement sent on every grant must be the same string each
 * time — a text built anew is flattened and hashed again on each send (prepared-name lookup, the
 * driver's parsed-statement check), a few µs a cycle.
 */
const perTable = (build: (table: TableRef) => string) => {
  const built = new Map<string, string>()
  return (table: TableRef): string => {
    let text = built.get(table.sql)
    if (text === undefined) built.set(table.sql, text = build(table))
    return text
  }
}

/** A new token for `table`'s rows, built once per table: the wait slice's text is built for every wait. */
const drawOf = perTable((table) => Tokens.draw(Tokens.tokenSequence(table)))

/**
 * A bumped row's token: the one drawn from the database's token sequence (`sql/tokens`), or one
 * above the row's when a previous version's per-name count ran ahead of the sequence.
 */
const NEXT = "greatest(f.token + 1, excluded.token)"

/**
 * One round of the idle-name sweep: deletes at most $1 lock rows of the fencing table whose key
 * nobody holds or waits for in this database (`pg_locks`: session and transaction locks, shared
 * or exclusive, granted or not) and whose token the sequence has already passed. Rows another
 * statement has locked are skipped, not waited for. A grant bumps its row only while it holds the
 * key, after its holder before it committed its own bump: a row deleted here meets a later grant
 * whose token is drawn after every token of that row. Semaphore rows (`marker_base`, a limit or
 * a queue) are `permitSweepSql`'s.
 */
export const sweepSql = perTable((table) =>
  `with held as materialized (select ((l.classid::bigint << 32) | l.objid::bigint) as key from pg_locks l ` +
  `where l.locktype = 'advisory' and l.objsubid = 1 and l.database = (select oid from pg_database where datname = current_database())), ` +
  `candidates as materialized (select f.key from ${table.sql} f where f.marker_base is null and f.permit_limit is null ` +
  `and f.permit_queue is null and f.token < ${Tokens.nextUp(Tokens.tokenSequence(table))} and not exists (select 1 from held h where h.key = f.key) ` +
  `limit $1::integer for update of f skip locked), ` +
  `gone as (delete from ${table.sql} f using candidates c where f.key = c.key returning 1) ` +
  // Deletes only what nobody holds: its commit need not wait for the disk.
  `select (select count(*) from gone)::integer as swept, set_config('synchronous_commit', 'off', true) as unflushed, ` +
  `pg_backend_pid() as pid`
)

/**
 * One round of the sweep of semaphore rows: deletes at most $1 rows of semaphores nobody holds or
 * waits for — no session holds the marker of the stored limit (`marker_base # permit_limit`, held
 * shared by every holder and waiter of that limit), and the queue is empty — whose tokens the
 * sequence has passed. An attempt locks its row before it takes the marker, so one that comes
 * after this read either waits for the delete (then finds no row: `missing`, and makes it anew) or
 * has the row locked (skipped here). Rows of the previous version (no `marker_base`) are kept.
 */
export const permitSweepSql = perTable((table) =>
  `with held as materialized (select ((l.classid::bigint << 32) | l.objid::bigint) as key from pg_locks l ` +
  `where l.locktype = 'advisory' and l.objsubid = 1 and l.database = (select oid from pg_database where datname = current_database())), ` +
  `candidates as materialized (select f.key from ${table.sql} f where f.marker_base is not null and f.permit_limit is not null ` +
  `and f.permit_queue is null and f.token < ${Tokens.nextUp(Tokens.tokenSequence(table))} ` +
  `and not exists (select 1 from held h where h.key = (f.marker_base # f.permit_limit::bigint)) ` +
  `limit $1::integer for update of f skip locked), ` +
  `gone as (delete from ${table.sql} f using candidates c where f.key = c.key returning 1) ` +
  `select (select count(*) from gone)::integer as swept, set_config('synchronous_commit', 'off', true) as unflushed, ` +
  `pg_backend_pid() as pid`
)

/**
 * Try-locks a batch of keys and bumps the fencing counter of each key granted, in one statement
 * and one commit: concurrent grants on a session share a WAL flush. Rows: one per granted key
 * (`key`, `token`), plus one row carrying only `pid`.
 *
 * Parameters: $1 keys (bigint[]), $2 names (text[]), $3 shared flags (boolean[]).
 */
export const tryBatchSql = perTable((table) =>
  `with request as (select * from unnest($1::bigint[], $2::text[], $3::boolean[]) as r(key, name, shared)), ` +
  `attempt as (select key, name, case when shared then pg_try_advisory_lock_shared(key) ` +
  `else pg_try_advisory_lock(key) end as granted from request), ` +
  // Drawn only for granted keys, after their lock: a key's draws follow each other in its holders' order.
  `bumped as (insert into ${table.sql} as f (key, name, token) select key, name, ${drawOf(table)} ` +
  `from attempt where granted on conflict (key) do update set token = ${NEXT}, name = excluded.name returning f.key, f.token) ` +
  `select key::text as key, token::text as token, null::int as pid from bumped ` +
  `union all select null, null, pg_backend_pid()`
)

/**
 * A shared join's fencing bump: only while no exclusive request waits at the server for the key,
 * since PostgreSQL itself queues a new shared request behind a waiting exclusive one. No `token`
 * in the answer: a waiter is queued, so the join must queue at the server too.
 *
 * Parameters: $1 key, $2 name, $3 classid, $4 objid (the key's `pg_locks` halves).
 */
export const joinBumpSql = perTable((table) =>
  `with bumped as (insert into ${table.sql} as f (key, name, token) select $1::bigint, $2::text, ${drawOf(table)} ` +
  `where not exists (select 1 from pg_locks l where l.locktype = 'advisory' and l.objsubid = 1 ` +
  `and l.classid = $3::int8::oid and l.objid = $4::int8::oid and not l.granted and l.mode = 'ExclusiveLock' ` +
  `and l.database = (select oid from pg_database where datname = current_database())) ` +
  `on conflict (key) do update set token = ${NEXT}, name = excluded.name returning f.token) ` +
  `select (select token::text from bumped) as token, pg_backend_pid() as pid`
)

/**
 * One slice of a blocking wait, one simple-protocol round trip: bounded wait, grant, bump. The
 * implicit transaction aborts as a whole on 55P03 (the slice's lock_timeout), leaving nothing.
 * The bump's own fencing-row wait is bounded by `bumpLockTimeoutMillis` (at most
 * `FENCING_LOCK_TIMEOUT_MS`; the caller passes less when the slice's client-side bound leaves less
 * after a wait that used its whole slice), set explicitly: `SET LOCAL lock_timeout TO DEFAULT`
 * would be the role's or server's value (often 0, no limit), not the session's.
 */
export const waitSql = (
  table: TableRef,
  key: bigint,
  name: string,
  mode: LockMode,
  lockTimeoutMillis: number,
  bumpLockTimeoutMillis: number = FENCING_LOCK_TIMEOUT_MS
): string =>
  [
    `SET LOCAL lock_timeout = ${lockTimeoutMillis}`,
    `SELECT pg_advisory_lock${suffix(mode)}('${key}'::bigint)`,
    `SET LOCAL lock_timeout = ${Math.max(1, Math.min(FENCING_LOCK_TIMEOUT_MS, Math.floor(bumpLockTimeoutMillis)))}`,
    `INSERT INTO ${table.sql} AS f (key, name, token) VALUES ('${key}'::bigint, ${literal(name)}, ${drawOf(table)}) ` +
    `ON CONFLICT (key) DO UPDATE SET token = ${NEXT}, name = excluded.name ` +
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
export const releaseSql = (mode: LockMode): string => (mode === "shared" ? RELEASE_SHARED_SQL : RELEASE_EXCLUSIVE_SQL)

const releaseText = (mode: LockMode): string =>
  `select pg_advisory_unlock${suffix(mode)}($1::bigint) as released, pg_backend_pid() as pid, ` +
  `case when pg_try_advisory_xact_lock($2::bigint) then null else pg_notify($3, $1::bigint::text) end as notified`
const RELEASE_EXCLUSIVE_SQL = releaseText("exclusive")
const RELEASE_SHARED_SQL = releaseText("shared")

/**
 * `releaseSql` for several keys of one session at once (releases queued behind a running
 * statement go together, as try-locks do): one row per key (a session holds a key once, so keys
 * of one batch are distinct), each unlocking its key before it checks that key's interest. Only for two keys or more: one release is sent as
 * `releaseSql`, the statement the raw floor of the benchmarks sends.
 *
 * Parameters: $1 keys, $2 their interest keys, $3 shared flags, $4 channel.
 */
export const RELEASE_BATCH_SQL =
  `select r.key::text as key, case when r.shared then pg_advisory_unlock_shared(r.key) else pg_advisory_unlock(r.key) end ` +
  `as released, case when pg_try_advisory_xact_lock(r.interest) then null else pg_notify($4, r.key::text) end as notified, ` +
  `pg_backend_pid() as pid from unnest($1::bigint[], $2::bigint[], $3::boolean[]) as r(key, interest, shared)`

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
// (`permits.ts`' namespaces): the fencing row's key (also the base of the interest key), slot `i`
// = slotBase # i for i < limit (one session lock per permit), and the limit marker of limit `L` =
// markerBase # L, held shared by every holder and waiter of the name with limit `L` (`#` is bigint
// XOR, so a statement can derive a marker from a stored limit). Each waiter also holds a random
// key of its own, its *waiter key*, for as long as it waits: its place in the queue is live
// exactly while that key is held, so a waiter whose session died loses its place to the next
// statement that looks.
//
// The queue is the fencing row's `permit_queue`: a JSON array of `{k, p, s}` (waiter key in
// decimal, permits asked, backend pid of its session), first come first; null when empty.
//
// Every statement below runs on a session that never blocks (the home session) and waits for
// nothing but the semaphore's fencing row, which other statements hold for one statement at most.

/** Payload prefix of a permit wake-up: `permit:<row key>:<waiter key>,<waiter key>…`. */
export const PERMIT_WAKE_PREFIX = "permit:"

/** Waiter keys per notification (a payload stays far under NOTIFY's 8000 bytes). */
const WAKE_CHUNK = 200

/**
 * The queue of `source` (a CTE with `queue`), one row per entry with its liveness proven: an entry
 * of this very session (its pid) is live when this process says it waits (`ownKeys`, a bigint[]
 * parameter: the session's own locks never conflict with its own tries, so a try proves nothing
 * there); any other is live while its waiter key is held — a try of it fails. A try that succeeds
 * is a transaction lock, gone at commit.
 */
const queueLineSql = (source: string, ownKeys: string, where: string): string =>
  `select q.pos, e.k, e.p, e.s, case when e.s = pg_backend_pid() then e.k = any(${ownKeys}::bigint[]) ` +
  `else not pg_try_advisory_xact_lock(e.k) end as live ` +
  `from ${source} src, jsonb_array_elements(src.queue) with ordinality as q(e0, pos), ` +
  `lateral (select (q.e0->>'k')::bigint as k, (q.e0->>'p')::int as p, (q.e0->>'s')::int as s) as e where ${where}`

/** The live entries of `line` as a queue value (`null` when none is left). */
const queueValueSql = (line: string, where: string): string =>
  `(select jsonb_agg(jsonb_build_object('k', l.k::text, 'p', l.p, 's', l.s) order by l.pos) from ${line} l where l.live and ${where})`

/**
 * The waiters to wake: the live entries of `line` that `where` keeps, in order, while their
 * permits add up to at most `free` — the head waiters that now fit, and no other — but the entry
 * at position `skip` (the statement's own: it counts in the sum, as its place is still taken, yet
 * is not woken). Those of other sessions are notified (`notified`: how many notifications), those
 * of this session are returned (`wake`, text[]) for the process to wake itself, with no NOTIFY.
 */
const wakeCtesSql = (line: string, where: string, free: string, channel: string, payloadKey: string, skip = "null::bigint"): string =>
  `wake as materialized (` +
  `select w.k, w.s from (select l.k, l.s, l.pos, sum(l.p) over (order by l.pos) as cum from ${line} l where l.live and ${where}) as w ` +
  `where w.cum <= ${free} and w.pos is distinct from ${skip}` +
  `), told as materialized (` +
  `select count(pg_notify(${channel}::text, '${PERMIT_WAKE_PREFIX}' || ${payloadKey}::bigint::text || ':' || c.ks))::int as n ` +
  `from (select string_agg(x.k::text, ',') as ks from (select w.k, row_number() over () as r from wake w ` +
  `where w.s <> pg_backend_pid()) as x group by (x.r - 1) / ${WAKE_CHUNK}) as c)`

const wakeColumnsSql =
  `(select coalesce(array_agg(w.k::text), '{}') from wake w where w.s = pg_backend_pid()) as wake, ` +
  `(select n from told) as notified`

/**
 * Makes sure a semaphore's fencing row exists (no limit yet; its token drawn from the sequence by
 * the table's guard, `sql/tokens`, so a row made anew after the sweep starts above the old one's):
 * an attempt locks the row with `FOR UPDATE`, which finds nothing to lock on a name's first use.
 * `marker_base` marks it a semaphore's row from birth (the lock sweep leaves it alone) and lets the
 * semaphore sweep tell whether anyone holds or waits. Parameters: $1 key, $2 name, $3 marker base.
 */
export const permitRowSql = (table: TableRef): string =>
  `with created as (insert into ${table.sql} (key, name, token, marker_base) values ($1::bigint, $2::text, 0, $3::bigint) ` +
  `on conflict (key) do nothing returning 1) ` +
  `select (select count(*) from created)::int as created, pg_backend_pid() as pid`

/**
 * One permit attempt, in one statement and one commit, all or none. Steps, each a MATERIALIZED
 * CTE fed by the one before so that none is reordered, inlined or skipped:
 *
 * 1. `cur`: locks the semaphore's fencing row (`FOR UPDATE`). Every attempt on the name, in any
 *    process, serializes here (and so do the releases and leaves that look at the queue), so the
 *    limit check, the queue and a change of limit below are race-free.
 * 2. `decide`: the limit. A registered waiter already holds its marker (`held`). Otherwise, with
 *    the stored limit equal to ours (or none yet), the request takes its marker shared (`same`).
 *    With another stored limit it tries the *stored* limit's marker exclusively for this
 *    transaction: success proves that no session holds it — no holder, no waiter uses the stored
 *    limit — and none can take it meanwhile (that needs this row lock), so the name is free and
 *    the request takes it over with its own limit (`takeover`, its marker shared; the row gets the
 *    new limit below, and an empty queue: every waiter of the old limit is gone). Failure: the
 *    name is in use with the stored limit (`mismatch`). A marker found held exclusively is another
 *    transaction's probe about to end (`retry`). (PostgreSQL never lets a session's own locks
 *    conflict with its own requests: the caller refuses another limit itself while this session
 *    holds a marker of the name.)
 * 3. `line`: the queue, each entry's liveness proven (`queueLineSql`); dead ones are dropped below.
 *    `need`: the permits of the live waiters ahead of this request (all of them for a newcomer, or
 *    for a registered waiter whose entry is gone) and of every other live waiter.
 * 4. `reg`: a request that registers as a waiter takes the interest key shared *before* it tries
 *    the slots, so a release either frees a slot before those tries or sees the interest and
 *    looks at the queue (see `permitReleaseSql`).
 * 5. `slots`: try-locks free slots in order, skipping the slots this session already holds for
 *    other requests of this process (a session is granted its own lock again: without the skip
 *    one slot would count twice), until it has `permits` plus the other waiters' permits (LIMIT
 *    stops the scan: with nobody waiting, it stops at `permits`, as with no queue at all).
 * 6. `fin`: **granted** only when the free slots cover this request *and every live waiter ahead
 *    of it* — a request never takes a permit a waiter ahead of it is waiting for, so nobody ahead
 *    waits longer for it (first in, first out; a try, too, finds the permits busy). It keeps the
 *    first `permits` slots; every other slot taken here is unlocked again in this same statement,
 *    and, when not granted, the marker too unless the request now waits registered (its waiter
 *    key taken). A registering request whose waiter key is held elsewhere (it is fresh per
 *    registration, so only by chance) gives its interest and marker back too: `retry`, not a
 *    destroyed session. `failed` when an unlock was refused (the caller then destroys the session).
 * 7. `queue` / `bumped`: the queue without its dead entries, without this request once granted,
 *    with it appended once it registers; on a grant the counter goes up by `permits` (tokens
 *    counter-permits+1 .. counter, a block drawn from the token sequence). The row is written only when the grant, the queue or the limit
 *    in use changes.
 * 8. `wake` / `told`: the head waiters that fit in the free slots this statement counted (an
 *    attempt that finds permits freed by a crashed holder, which notified nobody, or that drops a
 *    dead head, lets the waiters behind know). A registered waiter that stays busy keeps its place:
 *    its permits count first in that sum, so it wakes nobody behind it who still would not fit.
 *
 * Outcomes: granted | waiting (registered: marker, interest and waiter key held, in the queue) |
 * busy | mismatch | retry | missing (no fencing row) | failed. Parameters: $1 key, $2 limit,
 * $3 permits, $4 slot base, $5 marker base, $6 interest key, $7 register as a waiter if busy,
 * $8 already registered, $9 slots this session holds for the name (int[]), $10 the request's
 * waiter key (when it registers or is registered), $11 the waiter keys this process has on this
 * session for the name (bigint[]), $12 channel. Needs PostgreSQL 12+ (MATERIALIZED).
 */
export const permitAttemptSql = (table: TableRef): string =>
  `with cur as materialized (` +
  `select f.token, f.permit_limit, coalesce(f.permit_queue, '[]'::jsonb) as queue from ${table.sql} f ` +
  `where f.key = $1::bigint for update` +
  `), decide as materialized (` +
  `select c.token as counter, c.permit_limit as stored, c.queue, case ` +
  `when c.token is null then null ` +
  `when $8::boolean then case when c.permit_limit is distinct from $2::int and c.permit_limit is not null ` +
  `then 'mismatch' else 'held' end ` +
  `when c.permit_limit is null or c.permit_limit = $2::int then ` +
  `case when pg_try_advisory_lock_shared($5::bigint # $2::bigint) then 'same' else 'retry' end ` +
  `when pg_try_advisory_xact_lock($5::bigint # c.permit_limit::bigint) then ` +
  `case when pg_try_advisory_lock_shared($5::bigint # $2::bigint) then 'takeover' else 'retry' end ` +
  `else 'mismatch' end as verdict ` +
  `from (values (1)) as one(x) left join cur c on true` +
  `), line as materialized (` +
  queueLineSql("decide", "$11", "src.verdict in ('same', 'held')") +
  `), need as materialized (` +
  `select p.*, coalesce((select sum(l.p) from line l where l.live and (p.mine is null or l.pos < p.mine)), 0)::int as ahead, ` +
  `coalesce((select sum(l.p) from line l where l.live and l.pos is distinct from p.mine), 0)::int as others from (` +
  `select d.counter, d.stored, d.verdict, d.queue, ` +
  `(select min(l.pos) from line l where $8::boolean and l.k = $10::bigint) as mine from decide d) as p` +
  `), reg as materialized (` +
  `select n.*, case when n.verdict in ('same', 'takeover') and $7::boolean ` +
  `then pg_try_advisory_lock_shared($6::bigint) end as interested from need n` +
  `), slots as materialized (` +
  `select g.i from reg r, ` +
  `generate_series(0, case when r.verdict in ('same', 'takeover', 'held') then $2::int - 1 else -1 end) as g(i) ` +
  `where case when g.i = any($9::int[]) then false else pg_try_advisory_lock($4::bigint # g.i::bigint) end ` +
  `limit (select $3::int + r2.others from reg r2)` +
  `), tally as materialized (` +
  `select r.*, (select count(*) from slots)::int as n, ` +
  `(select coalesce(array_agg(s.i order by s.i), '{}') from slots s) as found, ` +
  `(r.verdict in ('same', 'takeover', 'held') and (select count(*) from slots) >= r.ahead + $3::int) as fits from reg r` +
  `), fin as materialized (` +
  `select t.counter, t.stored, t.verdict, t.queue, t.mine, t.n, t.fits, t.interested, ` +
  `case when t.fits then t.found[1:$3::int] else '{}'::int[] end as taken, case ` +
  `when t.verdict is null then 'missing' ` +
  `when t.verdict in ('mismatch', 'retry') then t.verdict ` +
  `when (select count(*) from unnest(case when t.fits then t.found[$3::int + 1:] else t.found end) as u(i) ` +
  `where pg_advisory_unlock($4::bigint # u.i::bigint)) <> t.n - case when t.fits then $3::int else 0 end then 'failed' ` +
  `when t.fits then case ` +
  `when ($8::boolean or coalesce(t.interested, false)) and not pg_advisory_unlock_shared($6::bigint) then 'failed' ` +
  `when $8::boolean and not pg_advisory_unlock($10::bigint) then 'failed' ` +
  `else 'granted' end ` +
  `when $8::boolean then 'busy' ` +
  // The waiter key is fresh per registration; should it still be held elsewhere, the interest and
  // marker just taken are given back and the request simply tries again (never 'failed': that
  // destroys this session with every lock on it).
  `when t.interested then case when pg_try_advisory_lock($10::bigint) then 'waiting' ` +
  `when not pg_advisory_unlock_shared($6::bigint) then 'failed' ` +
  `when not pg_advisory_unlock_shared($5::bigint # $2::bigint) then 'failed' else 'retry' end ` +
  `when not pg_advisory_unlock_shared($5::bigint # $2::bigint) then 'failed' ` +
  `when t.interested is null then 'busy' ` +
  `else 'retry' end as outcome from tally t` +
  `), queue as materialized (` +
  `select f.outcome, case when f.outcome in ('granted', 'busy', 'waiting') then ` +
  `coalesce(${queueValueSql("line", "not (f.outcome = 'granted' and l.pos is not distinct from f.mine)")}, '[]'::jsonb) || ` +
  `case when f.outcome = 'waiting' or (f.outcome = 'busy' and $8::boolean and f.mine is null) ` +
  `then jsonb_build_array(jsonb_build_object('k', ($10::bigint)::text, 'p', $3::int, 's', pg_backend_pid())) ` +
  `else '[]'::jsonb end end as next from fin f` +
  `), bumped as (` +
  // A grant's block of \`permits\` tokens: drawn from the sequence (\`sql/tokens\`), above the row's counter.
  `update ${table.sql} f set token = case when q.outcome = 'granted' ` +
  `then greatest(f.token + $3::int, ${Tokens.drawBlock(Tokens.tokenSequence(table), "$3::int")}) else f.token end, ` +
  `permit_limit = $2::int, permit_queue = case when q.next = '[]'::jsonb then null else q.next end, marker_base = $5::bigint ` +
  `from queue q, fin x where f.key = $1::bigint and q.next is not null and (q.outcome = 'granted' ` +
  `or q.next is distinct from x.queue or (q.outcome = 'waiting' and x.stored is distinct from $2::int)) ` +
  `returning f.token` +
  `), ` +
  wakeCtesSql(
    "line",
    // A granted request's entry is gone from the queue; a busy registered one still holds its place
    // ahead of those behind it, so its permits count first (the waiters behind it do not fit sooner).
    "(select f.outcome in ('granted', 'busy', 'waiting') and not (f.outcome = 'granted' and l.pos is not distinct from f.mine) from fin f)",
    "(select case when f.fits then f.n - $3::int else f.n end from fin f)",
    "$12",
    "$1",
    "(select f.mine from fin f)"
  ) +
  ` select fin.outcome, fin.stored, fin.taken, fin.interested, (select b.token::text from bumped b) as token, ` +
  `${wakeColumnsSql}, pg_backend_pid() as pid from fin`

/**
 * The queue of a semaphore and its free slots, once the statement's own locks are given back:
 * the fencing row locked (`cur`, only when `when` holds), the live entries (`line`, without
 * `exclude`'s), and the free slots counted (`free`) by transaction try-locks on the slots this
 * session does not hold (`ownSlots`) — no more than the live waiters ask for.
 */
const queueAndFreeSql = (
  table: TableRef,
  key: string,
  when: string,
  slotBase: string,
  ownSlots: string,
  ownKeys: string,
  exclude: string
): string =>
  `cur as materialized (` +
  `select f.permit_limit, coalesce(f.permit_queue, '[]'::jsonb) as queue from ${table.sql} f ` +
  `where f.key = ${key}::bigint and ${when} for update` +
  `), line as materialized (` +
  queueLineSql("cur", ownKeys, `e.k is distinct from ${exclude}`) +
  `), free as materialized (` +
  `select count(*)::int as n from (select g.i from cur c, generate_series(0, coalesce(c.permit_limit, 0) - 1) as g(i) ` +
  `where case when g.i = any(${ownSlots}::int[]) then false else pg_try_advisory_xact_lock(${slotBase}::bigint # g.i::bigint) end ` +
  `limit (select coalesce(sum(l.p), 0) from line l where l.live)) as s)`

/**
 * Gives a grant of permits back: unlocks its slots, then its marker. Then, as `releaseSql` does
 * for a lock, it tries the interest key for its own transaction: it fails only when a waiter of
 * another session registered interest, and only then — or when this process has waiters of the
 * name itself (`$7`) — does the release look at the queue: it locks the fencing row, counts the
 * free slots and wakes the head waiters that now fit (`wakeCtesSql`), none other. A release nobody
 * waits for costs what it cost before there was a queue: the unlocks and one try. The unlocks run
 * first, in their own CTE: a waiter that registered after the interest check tries the slots after
 * they were freed.
 *
 * Parameters: $1 slot base, $2 slots (int[]), $3 marker key, $4 interest key, $5 channel, $6 the
 * fencing row's key, $7 this process has waiters of the name, $8 slots this session still holds for
 * the name (int[]), $9 the waiter keys this process has on this session for the name (bigint[]).
 */
export const permitReleaseSql = (table: TableRef): string =>
  `with x as materialized (` +
  `select (select count(*) from unnest($2::int[]) as u(i) where pg_advisory_unlock($1::bigint # u.i::bigint))::int ` +
  `as unlocked, pg_advisory_unlock_shared($3::bigint) as marker` +
  `), look as materialized (` +
  `select x.unlocked, x.marker, case when $7::boolean then true else not pg_try_advisory_xact_lock($4::bigint) end ` +
  `as contended from x` +
  `), ` +
  queueAndFreeSql(table, "$6", "(select contended from look)", "$1", "$8", "$9", "null::bigint") +
  `, ` +
  wakeCtesSql("line", "true", "(select n from free)", "$5", "$6") +
  ` select look.unlocked, look.marker, ${wakeColumnsSql}, pg_backend_pid() as pid from look`

/**
 * A registered permit waiter leaves without a grant (its deadline, an interruption): under the
 * fencing row's lock it unlocks its waiter key, marker and interest, takes its entry (and any dead
 * one) out of the queue, and wakes the head waiters that now fit — it may have been the one the
 * others waited behind. Parameters: $1 the fencing row's key, $2 waiter key, $3 marker key,
 * $4 interest key, $5 slot base, $6 slots this session holds for the name (int[]), $7 the other
 * waiter keys this process has on this session for the name (bigint[]), $8 channel.
 */
export const permitLeaveSql = (table: TableRef): string =>
  `with ` +
  queueAndFreeSql(table, "$1", "true", "$5", "$6", "$7", "$2::bigint") +
  `, gone as materialized (` +
  `select pg_advisory_unlock($2::bigint) as waiter, pg_advisory_unlock_shared($3::bigint) as marker, ` +
  `pg_advisory_unlock_shared($4::bigint) as interest from (values (1)) as one(x) left join cur c on true` +
  `), saved as (` +
  `update ${table.sql} f set permit_queue = ${queueValueSql("line", "true")} from cur c ` +
  `where f.key = $1::bigint and ${queueValueSql("line", "true")} is distinct from nullif(c.queue, '[]'::jsonb) returning 1` +
  `), ` +
  wakeCtesSql("line", "true", "(select n from free)", "$8", "$1") +
  ` select g.waiter, g.marker, g.interest, ${wakeColumnsSql}, (select count(*) from saved)::int as saved, ` +
  `pg_backend_pid() as pid from gone g`

/**
 * The SQL of the PgLease backend: identifiers, the DDL, and one statement per operation. Every
 * lock operation is a single autocommit statement (no session state, no explicit transaction, and
 * never inside the caller's), so it is correct behind PgBouncer in `pool_mode = transaction`.
 * Every time comparison uses the server's `now()`; the client's clock never reaches the tables.
 *
 * Two tables. The lease table has one row per lock name in use: the exclusive holder (`owner`,
 * `expires_at`), the last token granted `token` (drawn from the database's token sequence,
 * `sql/tokens`: the row of an idle name is swept, and its next grant still gets a larger token), and for shared holders a count and a bound
 * (`shared_count`, `shared_until`: no shared holder's lease runs past it; `shared_since`: the
 * token that started the current group of shared holders). The queue table
 * (`<table>_queue`) has one row per waiting request — its place (`seq`, in arrival order) held
 * while it is refreshed (`expires_at`) — and one row per shared holder (`token` set).
 *
 * Exclusion is decided on the lease row only: every grant updates it, so concurrent grants
 * serialize on its row lock and each re-checks the row as the previous one left it (READ
 * COMMITTED re-evaluates an UPDATE's conditions on the newest row version; a subquery on another
 * table would read the statement's older snapshot). The queue only decides who may try: a grant
 * goes to a request with no live waiter ahead of it — for an exclusive request any waiter, for a
 * shared one an exclusive waiter — so waiters are served in arrival order and new shared requests
 * queue behind a waiting exclusive one.
 */
import { ensureTableSql, MAX_IDENTIFIER_BYTES, parseTable, type TableRef } from "../../sql/tables.js"
import * as Tokens from "../../sql/tokens.js"
import type { LeaseTables } from "../dialect.js"
import { notRenewed, takeOver } from "../leaseSql.js"
import { PLACE_REFRESH_BELOW, PLACE_TTL_MILLIS } from "../place.js"

export { parseTable, type TableRef }

/** The queue table's name: the lease table's with this suffix, in the same schema. */
const QUEUE_SUFFIX = "_queue"
/**
 * The semaphore table's name (`DistributedSemaphore`, see `pg/permitSql`): the lease table's
 * with this suffix, in the same schema. Shorter than the queue's, so it adds no length limit.
 */
const SEM_SUFFIX = "_sem"

/** The tables of one lease table name: PostgreSQL's are those of every database. */
export type Tables = LeaseTables

/** The tables from a validated lease table (whose name leaves room for the suffixes). */
export const tablesOf = (table: Tables | TableRef): Tables => {
  if ("leases" in table) return table
  const queue = parseTable(`${table.text}${QUEUE_SUFFIX}`)
  if (typeof queue === "string") throw new TypeError(`PgLease: ${queue}`)
  const sem = parseTable(`${table.text}${SEM_SUFFIX}`)
  if (typeof sem === "string") throw new TypeError(`PgLease: ${sem}`)
  return { leases: table, queue, sem }
}

/** The tables for a user-given name, or why it is refused. */
export const parseTables = (input: string): Tables | string => {
  const leases = parseTable(input)
  if (typeof leases === "string") return leases
  if (Buffer.byteLength(leases.relname + QUEUE_SUFFIX, "utf8") > MAX_IDENTIFIER_BYTES) {
    return `"${leases.relname}" is longer than ${MAX_IDENTIFIER_BYTES - QUEUE_SUFFIX.length} bytes (its queue table adds "${QUEUE_SUFFIX}")`
  }
  const queue = parseTable(`${leases.text}${QUEUE_SUFFIX}`)
  if (typeof queue === "string") return queue
  const sem = parseTable(`${leases.text}${SEM_SUFFIX}`)
  return typeof sem === "string" ? sem : { leases, queue, sem }
}

/** Checks a NOTIFY channel name: non-empty, at most 63 bytes (longer names fail in pg_notify). */
export const checkChannel = (channel: string): string | undefined => {
  if (typeof channel !== "string" || channel.length === 0) return "the channel must be a non-empty string"
  if (Buffer.byteLength(channel, "utf8") > MAX_IDENTIFIER_BYTES) {
    return `the channel "${channel}" is longer than ${MAX_IDENTIFIER_BYTES} bytes`
  }
  return undefined
}

const quote = (identifier: string) => `"${identifier.replace(/"/g, "\"\"")}"`
const ms = (param: string) => `${param}::bigint * interval '1 millisecond'`

/**
 * The tables, idempotently (also upgrading a lease table made before shared mode and the queue),
 * the semaphore table included, then the token sequence and its guards (`sql/tokens`). Tokens
 * come from the sequence, not from a row, so the rows of idle names are swept (`sweep`).
 */
export const createTable = (table: Tables | TableRef): string => {
  const tables = tablesOf(table)
  return `${createTableSql(tables)};
${createSemTableSql(tables)};
${Tokens.ensureTokens(Tokens.tokenSequence(tables.leases), [{ table: tables.leases, kind: "lease" }, { table: tables.sem, kind: "sem" }])}`
}

/** The sequence and the lease table's guard, once the lock tables exist (first use). */
export const ensureLockTokens = (table: Tables | TableRef): string => {
  const tables = tablesOf(table)
  return Tokens.ensureTokens(Tokens.tokenSequence(tables.leases), [{ table: tables.leases, kind: "lease" }])
}

/** The sequence and the semaphore table's guard, once it exists (first use). */
export const ensureSemTokens = (table: Tables | TableRef): string => {
  const tables = tablesOf(table)
  return Tokens.ensureTokens(Tokens.tokenSequence(tables.leases), [{ table: tables.sem, kind: "sem" }])
}

/** The lock tables: the lease table and its queue. */
const createTableSql = ({ leases, queue }: Tables): string =>
  `create table if not exists ${leases.sql} (
  name text primary key,
  owner uuid,
  token bigint not null,
  expires_at timestamptz,
  acquired_at timestamptz,
  holder_application text,
  holder_host text,
  holder_pid integer,
  shared_count integer not null default 0,
  shared_until timestamptz,
  shared_since bigint,
  constraint ${quote(`${leases.relname.slice(0, 50)}_owner_expiry`)} check ((owner is null) = (expires_at is null))
);
alter table ${leases.sql} add column if not exists shared_count integer not null default 0;
alter table ${leases.sql} add column if not exists shared_until timestamptz;
alter table ${leases.sql} add column if not exists shared_since bigint;
create table if not exists ${queue.sql} (
  owner uuid primary key,
  name text not null,
  mode text not null check (mode in ('exclusive', 'shared')),
  seq bigint generated by default as identity,
  expires_at timestamptz not null,
  token bigint,
  enqueued_at timestamptz not null,
  holder_application text,
  holder_host text,
  holder_pid integer,
  ttl_ms bigint
);
-- The ttl a waiting place asks for: a release hands the lease over at it. Null for a place of a
-- version before the handover, whose waiter is woken instead (it cannot hear a handover).
alter table ${queue.sql} add column if not exists ttl_ms bigint;
create index if not exists ${quote(`${queue.relname.slice(0, 50)}_name_seq`)} on ${queue.sql} (name, seq)`

/** The semaphore table (`pg/permitSql`): one row per semaphore name. */
const createSemTableSql = ({ sem }: Tables): string =>
  `create table if not exists ${sem.sql} (
  name text primary key,
  permit_limit integer not null,
  token bigint not null,
  holders jsonb not null default '[]',
  waiters jsonb not null default '[]',
  revoked bigint not null default 0
)`

/**
 * First-use creation as ONE statement (so it also runs behind a transaction pooler): an up-to-date
 * schema costs three catalog lookups and needs no privilege; otherwise creators serialize on a
 * transaction advisory lock (concurrent `create table if not exists` can fail on the catalog's
 * unique index) and create or upgrade.
 */
export const ensureTable = (table: Tables | TableRef): string => ensureTableText(tablesOf(table))

/** The namespace of the lock tables' creation lock (a transaction advisory lock on the lease table's name). */
export const DDL_NAMESPACE = "effect-lock/PgLease/ddl"

const ensureTableText = (tables: Tables): string =>
  ensureTableSql(tables.leases, createTableSql(tables), DDL_NAMESPACE, {
    // Either table missing, or a lease table from before shared mode: create or upgrade.
    missing: `to_regclass('${tables.leases.sql}') is null or to_regclass('${tables.queue.sql}') is null
    or not exists (select 1 from pg_attribute where attrelid = to_regclass('${tables.leases.sql}') and attname = 'shared_since' and not attisdropped)
    or not exists (select 1 from pg_attribute where attrelid = to_regclass('${tables.queue.sql}') and attname = 'ttl_ms' and not attisdropped)`
  })

/**
 * First-use creation of the semaphore table, as `ensureTable` for the lock tables and under the
 * same advisory lock; apart from it, so that locks never need the semaphore table (nor the
 * privilege to create it, on a deployment whose lock tables predate it).
 */
export const ensureSemTable = (table: Tables | TableRef): string => {
  const tables = tablesOf(table)
  return ensureTableSql(tables.sem, createSemTableSql(tables), DDL_NAMESPACE, { lockOn: tables.leases })
}

/**
 * A column that lets this statement's own commit return before its WAL reaches disk
 * (`synchronous_commit = off` for its transaction only: `set_config(…, true)` is `set local`,
 * read when the statement's implicit transaction commits) where `condition` holds. Only for
 * commits that grant nothing — a release, a waiting place: a crash may undo them, never a grant,
 * because a grant that saw one is a later commit whose flush carries it to disk too. An undone
 * release leaves the lease to run out at its ttl; an undone place is taken again by the next try.
 * Every commit that bumps a token keeps the session's setting.
 */
export const commitsUnflushed = (condition: string): string =>
  `case when ${condition} then set_config('synchronous_commit', 'off', true) end as unflushed`

/** How many of the oldest places a release looks at to find whom to wake. */
const HEAD_CANDIDATES = 16
/** How many shared places `wakeSharedHeads` wakes at most (the rest retry within 1.5 s). */
export const SHARED_HEADS_MAX = 1_024
/** A release that sent this many notifications may have left shared places behind them that fit too. */
export const WOKEN_CROWD = HEAD_CANDIDATES

/**
 * One grant attempt. A request with no live waiter ahead of it takes the lock if the lease row
 * allows: exclusive when no lease is live (bumping the token and taking the row), shared when no
 * exclusive lease is live (bumping the token, counting itself in and recording its own row). A
 * granted waiter leaves the queue in the same statement. Otherwise a waiting request takes its
 * place at the back of the queue, or keeps it (written again once at most 4/5 of its time is
 * left, `lease/place`), and learns how long until something could change without a
 * notification: the holder's lease or the first live place ahead running out (a crashed waiter
 * sends nothing; a place behind that one running out changes nothing), and whether a live place was ahead of its own (`behind`: then it need not look
 * again after taking its place, `lease/engine`). Nothing is locked or written when the snapshot
 * already shows the lock taken.
 *
 * Parameters: $1 name, $2 owner (of this attempt's grant), $3 waiter (this request's place),
 * $4 mode, $5 ttl ms, $6 place ttl ms, $7 application, $8 host, $9 pid, $10 take a place.
 * Columns are single lowercase words so client-side name transforms cannot rename them.
 */
export const acquire = (table: Tables | TableRef): string => acquireSql(tablesOf(table))

const acquireSql = ({ leases, queue }: Tables): string => {
  const seq = Tokens.tokenSequence(leases)
  const ns = Tokens.sweepGuardNamespace(leases)
  return `with me as (
  select seq from ${queue.sql} where owner = $3::uuid and token is null and expires_at > now()
), mine as (
  -- A lease a release handed to this request's place (see the release statement): it holds it
  -- already — an exclusive one on the lease row, a shared one as its place turned holding row.
  select h.token, h.expires_at from ${leases.sql} h where h.name = $1::text and h.owner = $3::uuid and h.expires_at > now()
  union all
  select q.token, q.expires_at from ${queue.sql} q
  where q.owner = $3::uuid and q.name = $1::text and q.token is not null and q.expires_at > now()
), ahead as (
  -- The first live place ahead that this request must not overtake: only it matters (while it
  -- lives this request waits; a place behind it running out changes nothing). Read in queue order
  -- on (name, seq) and stopped there: N waiters retrying do not each read the N places ahead.
  select w.expires_at as until from ${queue.sql} w
  where w.name = $1::text and w.token is null and w.expires_at > now() and w.owner <> $3::uuid
    and (not exists (select 1 from me) or w.seq < (select seq from me))
    and ($4::text = 'exclusive' or w.mode = 'exclusive')
  order by w.seq
  limit 1
), free as (
  -- Nobody ahead; or this request's place was handed the lease and it ran out before the waiter
  -- heard (a lost notification, a short ttl): its turn still, with a new token.
  select 1 as free where ((select until from ahead) is null
      or exists (select 1 from ${leases.sql} h where h.name = $1::text and h.owner = $3::uuid)
      or exists (select 1 from ${queue.sql} q where q.owner = $3::uuid and q.name = $1::text and q.token is not null))
    -- Never a second lease beside the one handed to this request's place.
    and not exists (select 1 from mine)
    and not exists (
    select 1 from ${leases.sql} h
    where h.name = $1::text and ((h.owner is not null and h.expires_at > now()) or ($4::text = 'exclusive' and h.shared_until > now())))
), guard as materialized (
  -- Taken before the draw: the sweep cannot delete the name's row between the draw and the insert
  -- that meets it (a token drawn before the row's last grant would then become the name's next).
  select ${Tokens.holdGuard(ns, "$1::text")} from free
), drawn as materialized (
  select ${Tokens.draw(seq)} as token from guard
), exclusive as (
  insert into ${leases.sql} as l (name, owner, token, expires_at, acquired_at, holder_application, holder_host, holder_pid)
  select $1::text, $2::uuid, d.token, now() + ${ms("$5")}, now(), $7::text, $8::text, $9::integer
  from drawn d where $4::text = 'exclusive'
  -- Above the row's last token even when a previous version's per-name count ran ahead of the sequence.
  ${takeOver("greatest(l.token + 1, excluded.token)")}
    where (l.owner is null or l.expires_at <= now()) and (l.shared_until is null or l.shared_until <= now())
  returning l.token
), shared as (
  insert into ${leases.sql} as l (name, token, shared_count, shared_until, shared_since)
  select $1::text, d.token, 1, now() + ${ms("$5")}, d.token
  from drawn d where $4::text = 'shared'
  on conflict (name) do update
    set owner = null,
        expires_at = null,
        token = greatest(l.token + 1, excluded.token),
        shared_count = case when l.shared_until > now() then l.shared_count + 1 else 1 end,
        shared_until = greatest(l.shared_until, excluded.shared_until),
        -- A new group of shared holders starts at this grant's token once the last one's bound passed.
        shared_since = case when l.shared_until > now() then l.shared_since else greatest(l.token + 1, excluded.token) end
    where l.owner is null or l.expires_at <= now()
  returning l.token
), granted as (
  select token from exclusive union all select token from shared
), holding as (
  insert into ${queue.sql} (owner, name, mode, expires_at, token, enqueued_at, holder_application, holder_host, holder_pid)
  select $2::uuid, $1::text, 'shared', now() + ${ms("$5")}, token, now(), $7::text, $8::text, $9::integer from shared
), dequeued as (
  -- With a handed lease: a place an attempt that missed the handover took again.
  delete from ${queue.sql} where owner = $3::uuid and token is null and (exists (select 1 from granted) or exists (select 1 from mine))
), to_place as (
  -- This request takes its place, or writes it again once at most 4/5 of its time is left.
  select 1 where $10::boolean and not exists (select 1 from granted) and not exists (select 1 from mine) and not exists (
    select 1 from ${queue.sql} m where m.owner = $3::uuid and m.token is null and m.expires_at > now() + ${ms("$6")} * ${PLACE_REFRESH_BELOW})
), refreshed as (
  -- The place this statement's snapshot has, written again: an update, so that a place a release
  -- deleted meanwhile (handing its waiter the lease) is not taken again, nor a live shared lease
  -- a release handed to it turned back into a place. A place whose handed shared lease ran out
  -- unheard is a place again.
  update ${queue.sql} as q
  set expires_at = now() + ${ms("$6")},
      ttl_ms = $5::bigint,
      token = null,
      seq = case when q.expires_at <= now() then nextval(pg_get_serial_sequence('${queue.sql}', 'seq')) else q.seq end,
      enqueued_at = case when q.expires_at <= now() then now() else q.enqueued_at end
  where q.owner = $3::uuid and exists (select 1 from to_place) and (q.token is null or q.expires_at <= now())
), enqueued as (
  -- A first place: none in this statement's snapshot.
  insert into ${queue.sql} (owner, name, mode, expires_at, enqueued_at, holder_application, holder_host, holder_pid, ttl_ms)
  select $3::uuid, $1::text, $4::text, now() + ${ms("$6")}, now(), $7::text, $8::text, $9::integer, $5::bigint
  where exists (select 1 from to_place) and not exists (select 1 from ${queue.sql} m where m.owner = $3::uuid)
  on conflict (owner) do nothing
)
select coalesce((select token::text from granted), (select token::text from mine)) as token,
  -- Nothing granted: the place (if any) need not wait for the disk (a handed lease's release waited).
  ${commitsUnflushed("not exists (select 1 from granted)")},
  case when exists (select 1 from granted) or exists (select 1 from mine) then null else greatest(0, extract(epoch from least(
    (select case when h.owner is not null and h.expires_at > now() then h.expires_at end from ${leases.sql} h where h.name = $1::text),
    (select case when $4::text = 'exclusive' and h.shared_until > now() then h.shared_until end from ${leases.sql} h where h.name = $1::text),
    (select until from ahead)
  ) - now()) * 1000)::float8 end as wait,
  -- A live place ahead: a release this place's commit raced wakes that one, not this one.
  not exists (select 1 from granted) and not exists (select 1 from mine) and (select until from ahead) is not null as behind,
  -- Handed to this request's place: what is left of its lease (ms), and the server's now() (epoch ms).
  exists (select 1 from mine) as handed,
  (select greatest(0, extract(epoch from expires_at - now()) * 1000)::float8 from mine) as left,
  (extract(epoch from now()) * 1000)::float8 as now`
}

/** The most requests one `acquireBatch` or `releaseBatch` decides. */
export const BATCH_MAX = 32

/**
 * First attempts of exclusive requests for different names, queued together for a lock
 * connection, as one statement (the lane batches them, `pg/pool`): one round trip and one commit
 * — one WAL flush — for all of them, where each alone pays its own. It decides only what it can
 * decide without the queue: a request whose name has no live lease and nobody waiting for it,
 * and which has no place of its own, is granted exactly as `acquire` grants it (the guard, a token
 * drawn, the lease row taken with the same conditions, re-checked on the row's newest version).
 * Every other request gets a null token, and sends `acquire` on its own: it takes its place there,
 * so waiting order, no-overtake and handed leases stay `acquire`'s alone. It never waits for a
 * row another transaction holds: that request goes alone too (only a name's first insert, racing
 * another's, waits for it, as `acquire` does).
 *
 * Parameters (parallel arrays, one entry per request): $1 names, $2 owners, $3 waiters, $4 ttls
 * ms, $5 applications, $6 hosts, $7 pids. Answers one row per request (`idx`, 1-based), with
 * `acquire`'s columns.
 */
export const acquireBatch = (table: Tables | TableRef): string => acquireBatchSql(tablesOf(table))

const acquireBatchSql = ({ leases, queue }: Tables): string => {
  const seq = Tokens.tokenSequence(leases)
  const ns = Tokens.sweepGuardNamespace(leases)
  return `with input as (
  select * from unnest($1::text[], $2::uuid[], $3::uuid[], $4::bigint[], $5::text[], $6::text[], $7::integer[])
    with ordinality as i(name, owner, waiter, ttl, application, host, pid, idx)
), free as (
  -- What this statement decides alone: no live lease, no live place of the name, no place of the request's.
  select i.* from input i
  where not exists (select 1 from ${queue.sql} w where w.name = i.name and w.token is null and w.expires_at > now())
    and not exists (select 1 from ${queue.sql} m where m.owner = i.waiter)
    and not exists (
      select 1 from ${leases.sql} h
      where h.name = i.name and ((h.owner is not null and h.expires_at > now()) or h.shared_until > now()))
), taken as materialized (
  -- The free names' rows, locked now in name order. A row another transaction holds is skipped,
  -- its request left to go alone: a batch never waits for a row lock, so never in a cycle.
  select l.name from ${leases.sql} l join free f on f.name = l.name
  order by l.name
  for no key update of l skip locked
), grantable as (
  -- A name without a row (in this snapshot) is inserted; a concurrent first insert of it is met by the upsert.
  select f.* from free f
  where f.name in (select name from taken) or not exists (select 1 from ${leases.sql} h where h.name = f.name)
), guard as materialized (
  -- Taken before the draw, as \`acquire\` takes it: the sweep cannot delete a row between the draw and the insert.
  select g.*, ${Tokens.holdGuard(ns, "g.name")} as guarded from grantable g
), drawn as materialized (
  select g.*, ${Tokens.draw(seq)} as token from guard g order by g.name
), exclusive as (
  insert into ${leases.sql} as l (name, owner, token, expires_at, acquired_at, holder_application, holder_host, holder_pid)
  -- In name order: the rows are locked in one order by every batch.
  select d.name, d.owner, d.token, now() + ${ms("d.ttl")}, now(), d.application, d.host, d.pid from drawn d order by d.name
  ${takeOver("greatest(l.token + 1, excluded.token)")}
    where (l.owner is null or l.expires_at <= now()) and (l.shared_until is null or l.shared_until <= now())
  returning l.name, l.token
)
select i.idx::integer as idx, e.token::text as token,
  ${commitsUnflushed("not exists (select 1 from exclusive)")},
  null::float8 as wait, false as behind, false as handed, null::float8 as left,
  (extract(epoch from now()) * 1000)::float8 as now
from input i left join exclusive e on e.name = i.name
order by i.idx`
}

/**
 * Give-backs of exclusive leases of different names, as one statement: those queued together for
 * a lock connection (as `acquireBatch`), and a holder's give-back sent alone too, since it sets up
 * a fraction of `release`'s plan (its executor start-up is most of a release's time at the server,
 * bench/README). It decides a give-back whose name nobody waits for (no live place in this
 * snapshot): there `release` would free the lease row and wake nobody, and so does this, its
 * commit not waiting for the disk. And one whose first live place is an exclusive request that
 * surely waits (`handable`), locked here: there `release` would **hand the lease over**, and so
 * does this, alike — the head's place becomes the holder (a token drawn under the guard, its own
 * ttl from now), its place is deleted, it is notified `h<place>:<token>:<expiry epoch ms>`, and
 * the commit waits for the disk. Every other give-back — shared heads, a head not written lately,
 * a live shared bound, a place of the giver's own, a lease row or head another transaction holds
 * right now (a batch never waits for a row lock) — is answered nothing, and sends `release` on
 * its own; where this snapshot already shows it cannot decide, it locks nothing, so a statement
 * that decides nothing writes nothing and its commit waits for no disk. The rows are re-checked
 * on their newest version when locked. The lease row is locked before the place, as `release`
 * locks them. With `tidy` (a layer whose sweep is off), a give-back it decides also removes the
 * name's rows that ran out over a minute ago, as `release` does in passing.
 *
 * Parameters (parallel arrays): $1 names, $2 owners; $3 channel. Answers a row (`idx`, 1-based,
 * `released`, `woken`: its notifications) per give-back it made.
 */
export const releaseBatch = (table: Tables | TableRef, tidy = false): string => releaseBatchSql(tablesOf(table), tidy)

/**
 * A give-back's step \`tidied\`: the rows of crashed waiters and shared holders of the names
 * \`names\` (an SQL condition on \`q.name\`) that ran out over a minute ago, removed in passing,
 * never waited for (skipped when locked). \`release\` always takes it; \`releaseBatch\` only for a
 * layer whose sweep is off — with the sweep on, the sweep removes them, and every give-back is
 * spared the step (about 8 % of an uncontended one at the server).
 */
const tidied = (queue: TableRef, names: string): string => `tidied as (
  delete from ${queue.sql} where owner in (
    select q.owner from ${queue.sql} q where ${names} and q.expires_at < now() - interval '1 minute'
    for update skip locked)
)`

const releaseBatchSql = ({ leases, queue }: Tables, tidy: boolean): string => {
  const seq = Tokens.tokenSequence(leases)
  const ns = Tokens.sweepGuardNamespace(leases)
  return `with input as (
  select * from unnest($1::text[], $2::uuid[]) with ordinality as i(name, owner, idx)
), candidates as materialized (
  -- What this statement may decide, by this snapshot alone (nothing locked yet, so a give-back it
  -- leaves to \`release\` took no lock and writes nothing): nobody waits, or the first live place
  -- is an exclusive request that surely waits. A place that commits later takes its own look.
  select i.name, i.owner, f.owner as head from input i
  left join lateral (
    select q.owner, q.mode, q.ttl_ms, q.expires_at from ${queue.sql} q
    where q.name = i.name and q.token is null and q.expires_at > now()
    order by q.seq limit 1
  ) f on true
  where f.owner is null or (f.mode = 'exclusive' and ${handable("f")})
), locked as materialized (
  -- In name order; a row another transaction holds (a renewal, say) is skipped, its give-back left
  -- to go alone: a batch never waits for a row lock, so never in a cycle and never behind one row.
  select l.name from ${leases.sql} l join candidates c on l.name = c.name and l.owner = c.owner
  where (l.shared_until is null or l.shared_until <= now())
    and not exists (select 1 from ${queue.sql} m where m.owner = c.owner)
  order by l.name
  for no key update of l skip locked
), heads as materialized (
  -- The exclusive heads of the names locked, locked (and re-checked) as \`release\` locks its places.
  select q.name, q.owner, q.ttl_ms, q.holder_application, q.holder_host, q.holder_pid from ${queue.sql} q
  join candidates c on q.owner = c.head
  where c.name in (select name from locked) and q.name = c.name and q.token is null and q.expires_at > now()
    and q.mode = 'exclusive' and ${handable("q")}
  order by q.name
  for update of q skip locked
), decided as materialized (
  select c.name from candidates c
  where c.name in (select name from locked) and (c.head is null or exists (select 1 from heads h where h.name = c.name))
), guard as materialized (
  -- Taken before the draw, as a grant takes it: the sweep cannot delete the row meanwhile.
  select h.*, ${Tokens.holdGuard(ns, "h.name")} as guarded from heads h where h.name in (select name from decided)
), drawn as materialized (
  select g.*, ${Tokens.draw(seq)} as token from guard g order by g.name
), freed as (
  update ${leases.sql} as l set
    owner = d.owner,
    expires_at = now() + ${ms("d.ttl_ms")},
    -- Above the row's last token even when a previous version's per-name count ran ahead of the sequence.
    token = case when d.owner is null then l.token else greatest(l.token + 1, d.token) end,
    acquired_at = case when d.owner is null then l.acquired_at else now() end,
    holder_application = coalesce(d.holder_application, l.holder_application),
    holder_host = coalesce(d.holder_host, l.holder_host),
    holder_pid = coalesce(d.holder_pid, l.holder_pid)
  from input i left join drawn d on d.name = i.name
  where l.name = i.name and l.owner = i.owner and l.name in (select name from decided)
  returning l.name, l.owner, l.token, l.expires_at, d.owner is not null as handed
), dequeued as (
  delete from ${queue.sql} where owner in (select owner from freed where handed) and token is null
)${tidy ? `, ${tidied(queue, "q.name in (select name from decided)")}` : ""}
select i.idx::integer as idx, 1 as released,
  -- A give-back grants nothing: its commit need not wait for the disk. A handover grants: it waits.
  ${commitsUnflushed("not exists (select 1 from freed where handed)")},
  -- count(*) of a subquery of its own: an aggregate over outer columns only would be this query's.
  case when f.handed then (select count(*) from (select pg_notify($3::text, '${HANDED_PREFIX}' || f.owner::text || ':' ||
    f.token::text || ':' || (extract(epoch from f.expires_at) * 1000)::float8::text)) notified) else 0 end as woken
from input i join freed f on f.name = i.name
order by i.idx`
}

/**
 * Renews a whole batch in one statement: every exclusive lease still ours and unexpired gets
 * `now() + ttl`; every shared one still live gets it on its own row, and the name's shared bound
 * moves with it (on the lease row, re-checked there: never once an exclusive lease was granted).
 * For the others it tells why, from the rows as the statement found them: a newer exclusive
 * holder (`stolen`); still ours but expired (`expired`); freed or deleted without a new grant
 * (`revoked`, e.g. by an operator). Known imprecision, accepted: a takeover that commits after
 * the statement's snapshot is reported `expired` rather than `stolen` — lost either way.
 *
 * Parameters: $1 names, $2 owners, $3 tokens, $4 ttls in ms, $5 modes (parallel arrays).
 */
export const renew = (table: Tables | TableRef): string => renewSql(tablesOf(table))

const renewSql = ({ leases, queue }: Tables): string =>
  `with input as (
  select * from unnest($1::text[], $2::uuid[], $3::bigint[], $4::bigint[], $5::text[])
    with ordinality as i(name, owner, token, ttl, mode, idx)
), renewed as (
  update ${leases.sql} as l
  set expires_at = now() + i.ttl * interval '1 millisecond'
  from input i
  -- On the token too: an owner id is a place's when a release handed it the lease, and only
  -- this grant's token is this holder's.
  where i.mode = 'exclusive' and l.name = i.name and l.owner = i.owner and l.token = i.token and l.expires_at > now()
  returning l.name, l.owner
), live_shared as (
  select i.name, max(i.ttl) as ttl from input i
  where i.mode = 'shared' and exists (
    select 1 from ${queue.sql} q where q.owner = i.owner and q.name = i.name and q.token = i.token and q.expires_at > now())
  group by i.name
), bound as (
  update ${leases.sql} as l
  set shared_until = greatest(l.shared_until, now() + s.ttl * interval '1 millisecond')
  from live_shared s
  where l.name = s.name and (l.owner is null or l.expires_at <= now()) and l.shared_count > 0
  returning l.name
), renewed_shared as (
  update ${queue.sql} as q
  set expires_at = now() + i.ttl * interval '1 millisecond'
  from input i
  where i.mode = 'shared' and q.owner = i.owner and q.name = i.name and q.token = i.token and q.expires_at > now()
    and i.name in (select name from bound)
  returning q.owner
)
select i.idx::integer as idx,
  case
    when r.owner is not null or rs.owner is not null then 'renewed'
    ${notRenewed(queue, "    ")}
  end as outcome
from input i
left join renewed r on r.name = i.name and r.owner = i.owner
left join renewed_shared rs on rs.owner = i.owner
left join ${leases.sql} h on h.name = i.name
order by i.idx`

/**
 * A place written within this many ms is a live waiter's (a waiter writes its place again at
 * least every 1.5 s, `lease/place`): a release hands such a head the lease. An older place may be
 * a crashed waiter's, which would keep a handed lease for a whole ttl: it is woken instead.
 */
const FRESH_MS = PLACE_TTL_MILLIS / 2

/** A waiting place (alias `p`) a release may hand a lease to: written in the last `FRESH_MS`, with its ttl. */
const handable = (p: string): string => `(${p}.ttl_ms is not null and ${recent(p)})`

/** The place `p` was written in the last FRESH_MS: a live waiter's (whatever its version). */
const recent = (p: string): string => `${p}.expires_at > now() + ${ms(String(PLACE_TTL_MILLIS - FRESH_MS))}`

/**
 * Gives back what one request holds of `name`: the exclusive lease of `owner` (or of `waiter`, a
 * lease a release handed to its place), or its shared lease (counted out only if it belongs to
 * the current group of shared holders — granted at or after `shared_since`: once a group's bound
 * passed, the next grant started a new count without it), and the waiting place of `waiter`. All
 * owner-scoped: a holder whose lease expired and was taken can never free the new holder's.
 *
 * When it frees an exclusive lease and the head of the queue is an exclusive request whose
 * waiter surely waits (its place written in the last `FRESH_MS`, by a version that records its
 * ttl), the lease is **handed over** in this statement: the head's place becomes the holder
 * (`owner` = its place id, a token drawn as a grant draws it, its own ttl from now), its place is
 * deleted, and it is notified `h<place>:<token>:<expiry epoch ms>`; this commit then waits for
 * the disk, as a grant's does. When the heads are shared requests (every one before the first
 * exclusive place) and each surely waits, freeing a live exclusive lease hands each of them a
 * shared lease alike: its place becomes its holding row (a token each, its own ttl), the lease row
 * counts them as a new group of shared holders, and each is notified `h…`. Otherwise, when this frees the lock, or a place is left while no
 * exclusive lease is live, the waiters now at the head that fit are notified (`w<place>`; an exclusive
 * head only when no shared lease is live either; behind a head not written lately, which may be a
 * crashed waiter's, the waiters up to the first surely waiting one too), in the same
 * statement (sent on commit): only they retry. `woken` counts the notifications: when it
 * reaches `HEAD_CANDIDATES` (every place it looked at was a head: 16 shared requests), shared
 * places behind them may fit as well, and the releasing process sends `wakeSharedHeads`.
 * Queue rows expired for over a minute (crashed
 * waiters and shared holders) are removed in passing.
 *
 * The lease row is locked first, as a granting acquire locks it; then the places, in `seq` order.
 *
 * Parameters: $1 name, $2 owner (or null), $3 waiter (or null), $4 channel.
 */
export const release = (table: Tables | TableRef): string => releaseSql(tablesOf(table))

const releaseSql = ({ leases, queue }: Tables): string => {
  const seq = Tokens.tokenSequence(leases)
  const ns = Tokens.sweepGuardNamespace(leases)
  return `with lease_row as materialized (
  -- Locked first, as a granting acquire locks it, and read as it is NOW, not as in this
  -- statement's snapshot: a lease a release handed to $3 after this statement began is $3's too
  -- (a leave racing its handover frees it). So matched by name only, and by owner after the lock.
  select l.owner, l.token, l.expires_at, l.shared_until from ${leases.sql} l where l.name = $1::text
  for no key update
), held as materialized (
  select expires_at from lease_row where owner in ($2::uuid, $3::uuid)
), shared as (
  -- With $3: a shared lease a release handed to the place of a request that leaves.
  delete from ${queue.sql} where owner in ($2::uuid, $3::uuid) and name = $1::text and token is not null
  returning token
), counted as (
  update ${leases.sql}
  set shared_count = shared_count - 1,
      shared_until = case when shared_count <= 1 then null else shared_until end
  where name = $1::text and shared_count > 0 and exists (select 1 from shared where shared.token >= shared_since)
  returning shared_count
), placed as (
  -- With $2: a handed holder's place, taken again by an attempt that missed the handover.
  delete from ${queue.sql} where owner in ($2::uuid, $3::uuid) and token is null
  returning 1
), ${tidied(queue, "q.name = $1::text")}, freed as (
  select 1 where exists (select 1 from held) or exists (select 1 from counted where shared_count = 0)
    or (exists (select 1 from placed) and not exists (
      select 1 from ${leases.sql} h where h.name = $1::text and h.owner is not null and h.expires_at > now()))
), waiting as (
  select owner, mode, seq, ttl_ms, expires_at, holder_application, holder_host, holder_pid from ${queue.sql}
  where name = $1::text and token is null and expires_at > now() and exists (select 1 from freed)
    and owner is distinct from $2::uuid and owner is distinct from $3::uuid
  order by seq limit ${HEAD_CANDIDATES}
  for update
), shared_live as (
  -- A shared lease still live after this statement (a waiter's leave frees none of it; this
  -- release's own count-out is read from counted, lease_row being the row before it).
  select 1 from lease_row where shared_until > now() and not exists (select 1 from counted where shared_count = 0)
), heads as (
  select owner from waiting
  where (seq = (select min(seq) from waiting)
      or (mode = 'shared' and seq < coalesce((select min(seq) from waiting where mode = 'exclusive'), 9223372036854775807)))
    -- No exclusive head beside a live shared lease: it cannot be granted (an acquire refuses it
    -- while shared_until > now()), so waking it is wasted; the last shared release wakes it.
    and not (mode = 'exclusive' and exists (select 1 from shared_live))
), stale_behind as (
  -- A head not written lately may be a crashed waiter's, which will never act: the waiters behind
  -- the heads, up to the first that surely waits, are woken too, so that each learns when that
  -- place runs out (its attempt's wait: the first live place ahead) instead of at its next retry.
  select w.owner from waiting w, (select max(x.seq) as last from waiting x where x.owner in (select owner from heads)) h
  -- Judged by when each place was written, not by its ttl (a place of a version before the handover has none).
  where exists (select 1 from waiting x where x.owner in (select owner from heads) and not ${recent("x")})
    and w.seq > h.last
    and w.seq <= coalesce((select min(f.seq) from waiting f where f.seq > h.last and ${recent("f")}), 9223372036854775807)
), handing as materialized (
  select w.owner, w.ttl_ms, w.holder_application, w.holder_host, w.holder_pid from waiting w
  where exists (select 1 from held) and w.seq = (select min(seq) from waiting) and w.mode = 'exclusive'
    and ${handable("w")}
), sharing as materialized (
  -- Shared requests at the head (every one before the first exclusive place): each is handed a
  -- shared lease, if every one surely waits. Only from a lease still live here: a shared attempt
  -- that saw it expired may be granted on its own right after this commit, and would hold twice.
  select w.owner, w.ttl_ms, w.seq from waiting w
  where exists (select 1 from held where expires_at > now()) and w.mode = 'shared' and w.owner in (select owner from heads)
    and not exists (
      select 1 from waiting s where s.mode = 'shared' and s.owner in (select owner from heads)
        and not ${handable("s")})
), guard as materialized (
  -- Taken before the draw, as an acquire takes it: the sweep cannot delete the row meanwhile.
  select ${Tokens.holdGuard(ns, "$1::text")} where exists (select 1 from handing) or exists (select 1 from sharing)
), drawn as materialized (
  select h.owner, h.ttl_ms, h.holder_application, h.holder_host, h.holder_pid, ${Tokens.draw(seq)} as token from handing h, guard
), shared_drawn as materialized (
  select s.owner, s.ttl_ms, ${Tokens.draw(seq)} as drawn from sharing s, guard
), shared_tokens as materialized (
  -- Each above the row's last token, as a grant's, and all distinct: both terms rise with the draw.
  select owner, ttl_ms, greatest((select token from lease_row) + row_number() over (order by drawn), drawn) as token from shared_drawn
), exclusive as (
  update ${leases.sql} as l set
    owner = d.owner,
    expires_at = now() + ${ms("d.ttl_ms")},
    -- Above the row's last token even when a previous version's per-name count ran ahead of the sequence.
    token = case when d.owner is not null then greatest(l.token + 1, d.token) when g.n is not null then g.last else l.token end,
    acquired_at = case when d.owner is null then l.acquired_at else now() end,
    holder_application = coalesce(d.holder_application, l.holder_application),
    holder_host = coalesce(d.holder_host, l.holder_host),
    holder_pid = coalesce(d.holder_pid, l.holder_pid),
    -- Handed to shared requests: a new group of shared holders, counted from its first token.
    shared_count = coalesce(g.n, l.shared_count),
    shared_until = case when g.n is null then l.shared_until else now() + ${ms("g.ttl_ms")} end,
    shared_since = case when g.n is null then l.shared_since else g.first end
  from (select 1) as one left join drawn d on true
    left join (select count(*)::integer as n, min(token) as first, max(token) as last, max(ttl_ms) as ttl_ms
      from shared_tokens having count(*) > 0) g on true
  -- Not on the owner: in this statement's snapshot the row may still show the previous holder.
  where l.name = $1::text and exists (select 1 from held)
  returning l.owner, l.token, l.expires_at
), handed as (
  select owner, token, expires_at from exclusive where owner is not null
), dequeued as (
  delete from ${queue.sql} where owner = (select owner from handed) and token is null
), shared_handed as (
  -- Each shared head's place becomes its holding row (as a shared grant's), its lease its own ttl.
  update ${queue.sql} as q set token = t.token, expires_at = now() + ${ms("t.ttl_ms")}
  from shared_tokens t where q.owner = t.owner and q.token is null
  returning q.owner, q.token, q.expires_at
), all_handed as (
  select owner, token, expires_at from handed union all select owner, token, expires_at from shared_handed
)
select (select count(*) from exclusive) + (select count(*) from shared) as released,
  -- A give-back grants nothing: its commit need not wait for the disk. A handover grants: it waits.
  ${commitsUnflushed("not exists (select 1 from all_handed)")},
  (select count(pg_notify($4::text, '${HANDED_PREFIX}' || owner::text || ':' || token::text || ':' ||
     (extract(epoch from expires_at) * 1000)::float8::text)) from all_handed)
  + (select count(pg_notify($4::text, '${WAITER_PREFIX}' || owner::text)) from (select owner from heads union all select owner from stale_behind) woken
     where not exists (select 1 from all_handed)) as woken`
}

/**
 * Wakes the shared places at the head of `name`'s queue, up to the first exclusive one (at most
 * `SHARED_HEADS_MAX`): sent by the releasing process after a release that served 16 shared heads
 * (all the places a release looks at), whose readers behind them fit too and would otherwise wait
 * for their next retry. A statement of its own, not a part of the release: that would cost every
 * handover the setting up of its scan (20–30 µs, bench/README). Also sent after a release retried
 * because its first try failed and that freed nothing (`giveBack`): the first try may have
 * committed a crowd's handover, its answer lost. Nobody is woken while an exclusive lease is live
 * (none would fit). A wake-up grants nothing: read without locks; a place woken for nothing only
 * retries early.
 *
 * Parameters: $1 name, $2 channel.
 */
export const wakeSharedHeads = (table: Tables | TableRef): string => {
  const { leases, queue } = tablesOf(table)
  return `select count(pg_notify($2::text, '${WAITER_PREFIX}' || owner::text)) as woken from (
  select q.owner, bool_or(q.mode = 'exclusive') over (order by q.seq) as blocked from ${queue.sql} q
  where q.name = $1::text and q.token is null and q.expires_at > now()
    -- None fits beside a live exclusive lease (a release retried after a failure may find one).
    and not exists (select 1 from ${leases.sql} l where l.name = $1::text and l.owner is not null and l.expires_at > now())
  order by q.seq limit ${SHARED_HEADS_MAX}
) heads where not blocked`
}

/**
 * One round of the idle-name sweep (`lease/sweep`): deletes at most $1 queue rows whose time ran
 * out (crashed waiters and shared holders), and at most $1 lease rows of names nobody holds or
 * waits for — no live exclusive lease, no live shared bound, no live queue row — whose token the
 * sequence has already passed. Rows another statement has locked are skipped, not waited for; so
 * is a name whose grant is drawing its token right now (`Tokens.tryGuard`, taken only on the few
 * candidates: never on a whole table). A place or holder that commits after this snapshot and
 * finds its lease row gone inserts a new one with a drawn token, larger than the deleted one.
 *
 * Parameters: $1 the most rows to delete per table.
 */
export const sweep = (table: Tables | TableRef): string => sweepSql(tablesOf(table))

const sweepSql = ({ leases, queue }: Tables): string => {
  const ns = Tokens.sweepGuardNamespace(leases)
  return `with dead as (
  delete from ${queue.sql} where owner in (
    select owner from ${queue.sql} where expires_at <= now() limit $1::integer for update skip locked)
  returning 1
), candidates as materialized (
  select l.name from ${leases.sql} l
  where (l.owner is null or l.expires_at <= now()) and (l.shared_until is null or l.shared_until <= now())
    and l.token < ${Tokens.nextUp(Tokens.tokenSequence(leases))}
    and not exists (select 1 from ${queue.sql} q where q.name = l.name and q.expires_at > now())
  limit $1::integer
  for update of l skip locked
), idle as (
  select name from candidates where ${Tokens.tryGuard(ns, "name")}
), gone as (
  delete from ${leases.sql} l using idle i where l.name = i.name
  returning 1
)
select ((select count(*) from gone) + (select count(*) from dead))::integer as swept,
  -- Deletes only what nobody holds: its commit need not wait for the disk.
  ${commitsUnflushed("true")}`
}

/**
 * Frees a lock whoever holds it, exclusive or shared (an operator's tool), and wakes every waiter
 * of it; holders learn at their next renewal.
 *
 * Parameters: $1 name, $2 channel, $3 payload.
 */
export const revoke = (table: Tables | TableRef): string => revokeSql(tablesOf(table))

const revokeSql = ({ leases, queue }: Tables): string =>
  `with exclusive as (
  update ${leases.sql} set owner = null, expires_at = null, shared_count = 0, shared_until = null, shared_since = null
  where name = $1::text and (owner is not null or shared_count > 0)
  returning 1
), shared as (
  -- A holder releasing right now is skipped rather than waited for (its release removes its row).
  delete from ${queue.sql} where owner in (
    select owner from ${queue.sql} where name = $1::text and token is not null for update skip locked)
  returning 1
), revoked as (
  select exists (select 1 from exclusive) or exists (select 1 from shared) as revoked
)
select revoked, case when revoked then pg_notify($2::text, $3::text)::text end as notified from revoked`

/** The live leases (exclusive and shared) of the tables, or of one name when $1 is not null. */
export const holders = (table: Tables | TableRef): string => holdersSql(tablesOf(table))

const holdersSql = ({ leases, queue }: Tables): string =>
  `with live as (
  select name, 'exclusive' as mode, token, expires_at, acquired_at, holder_application, holder_host, holder_pid
  from ${leases.sql} where owner is not null and expires_at > now() and ($1::text is null or name = $1::text)
  union all
  select name, 'shared', token, expires_at, enqueued_at, holder_application, holder_host, holder_pid
  from ${queue.sql} where token is not null and expires_at > now() and ($1::text is null or name = $1::text)
)
select l.name, l.mode, l.token::text as token,
  (extract(epoch from l.expires_at) * 1000)::float8 as expires,
  (extract(epoch from l.acquired_at) * 1000)::float8 as acquired,
  l.holder_application as application, l.holder_host as host, l.holder_pid as pid,
  (select (extract(epoch from min(w.enqueued_at)) * 1000)::float8 from ${queue.sql} w
   where w.name = l.name and w.token is null and w.expires_at > now()) as waiting
from live l
order by l.name, l.token`

/** Whether the lease and queue tables exist. Parameters: $1 the lease table, $2 the queue table (quoted SQL names). */
export const present = "select to_regclass($1::text) is not null and to_regclass($2::text) is not null as present"

/** A wake-up sent through the lock lane, to check that the LISTEN connection still hears. */
export const ping = "select pg_notify($1::text, $2::text)"

/** Payload prefixes on the channel: a revoked lock's name (wake all its waiters), a waiter to wake, a health check. */
export const RELEASED_PREFIX = "r"
export const WAITER_PREFIX = "w"
/** A lease handed to a waiting place by a release: \`h<place>:<token>:<expiry, epoch ms>\`. */
export const HANDED_PREFIX = "h"
export const PING_PREFIX = "p"

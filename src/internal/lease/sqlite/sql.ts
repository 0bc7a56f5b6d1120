/**
 * The SQL of the SqliteLease backend: the lease engine's statements (see `lease/dialect`) in
 * SQLite's dialect, over the same two tables as PgLease — the lease table, one row per lock name
 * in use (holder, last token, shared count and bound), and its queue table (a row per waiting
 * request, its place in arrival order, and a row per shared holder). Tokens come from the file's
 * one counter (`effect_lock_tokens`, see `schema`), so the rows of a name nobody holds or waits
 * for are deleted by the sweep (`sweep`), and a service locking millions of names keeps only
 * those in use.
 *
 * **One statement per operation.** SQLite has no data-modifying CTEs, so an operation that
 * writes several rows (a grant also leaves the queue; a release may count a shared holder out,
 * drop its row and its place) is ONE `insert … returning` into an operations table (`<table>_op`)
 * whose trigger carries the writes out and deletes the row again: the statement decides (it
 * reads the tables and computes the token, the outcome or whom to wake, which it returns), the
 * trigger applies that decision, all within the statement's own write transaction. No explicit
 * transaction is ever open across two driver calls, so SQLite's single write lock is held for
 * the few microseconds of one statement, never across an await.
 *
 * **Why no re-checks.** A write statement takes the database's write lock before it reads, so
 * everything it reads is the newest state and nobody writes until it commits: the decision it
 * makes is still true when its trigger applies it.
 *
 * **Time.** The database's clock, in whole milliseconds since the epoch
 * (`unixepoch('subsec')`, SQLite ≥ 3.42; better-sqlite3 12 bundles 3.5x), the same instant for
 * every use within one statement and its triggers. The client's clock never reaches the tables.
 *
 * Parameters are numbered (`?1` …), in the engine's order; arrays arrive as JSON text and
 * booleans as 0/1 (the dialect, `sqlite/dialect`, encodes them).
 */
import { notRenewed, takeOver } from "../leaseSql.js"
import { PLACE_REFRESH_BELOW } from "../place.js"
import * as Permits from "./permitSql.js"
import {
  COUNTER,
  createTokens,
  NEVER,
  NOW,
  quote,
  raiseCounter,
  raiseToTables,
  RENEW_INPUT,
  type Tables,
  trigger as triggerOf
} from "./schema.js"

export { parseTables, type Tables } from "./schema.js"

/**
 * The version in the triggers' names. Nothing ever drops a trigger, and `create trigger if not
 * exists` keeps the text the file has: bumping this would leave the old triggers firing beside the
 * new ones (a process of the older version re-creates them at start anyway). So the v1 triggers'
 * text is frozen — this version's changes are in the statements (which compute the tokens) and in
 * triggers of new kinds (`counter`, `guard`, `sweep`), which an older process neither knows nor
 * touches.
 */
const TRIGGER_VERSION = "v1"
const trigger = (tables: Tables, kind: string) => triggerOf(tables, kind, TRIGGER_VERSION)

/**
 * The tables, the queue's index, the operations table and its triggers, the file's token counter
 * and its triggers: idempotent statements, run in order. Tokens come from the counter, never from
 * a name's row alone, so a row can go once its name is idle (`sweep`): the name's next grant is
 * still above every token it had, since the sweep only deletes rows whose token the counter has
 * reached. The last statement raises the counter to the tables' tokens (a file of an older
 * version has per-name tokens up to anything).
 *
 * **Beside an older version.** A process of the version before the counter (per-name tokens,
 * `coalesce(row token, 0) + 1`) may run on the same file: its statements run with the triggers
 * the file has, this version's included (it never drops them, and re-creates only its own v1
 * triggers, which are unchanged here). Its grant of a name whose row is there is right (above
 * that name's last token) and goes on; the counter trigger raises the counter to it. Its grant of
 * a name without a row may be of a swept name — it would hand out token 1 again — so the guard
 * refuses it with an error when its token is not above the counter (see `guardTrigger`); that
 * process's acquire then fails rather than hand out a token a `Fence` may have seen.
 */
export const createTable = (tables: Tables): ReadonlyArray<string> => {
  const { leases, queue, op, sem } = tables
  return [
    `create table if not exists ${leases.sql} (
  name text not null primary key,
  owner text,
  token integer not null,
  expires_at integer,
  acquired_at integer,
  holder_application text,
  holder_host text,
  holder_pid integer,
  shared_count integer not null default 0,
  shared_until integer,
  shared_since integer,
  check ((owner is null) = (expires_at is null))
)`,
    `create table if not exists ${queue.sql} (
  owner text not null primary key,
  name text not null,
  mode text not null check (mode in ('exclusive', 'shared')),
  seq integer not null,
  expires_at integer not null,
  token integer,
  enqueued_at integer not null,
  holder_application text,
  holder_host text,
  holder_pid integer
)`,
    `create index if not exists ${quote(`${tables.prefix}_queue_name_seq`)} on ${queue.sql} (name, seq)`,
    `create table if not exists ${op.sql} (
  kind text not null,
  name text,
  owner text,
  waiter text,
  mode text,
  ttl integer,
  place integer,
  application text,
  host text,
  pid integer,
  idx integer,
  now integer not null,
  token integer,
  wait real,
  released integer,
  heads text,
  outcome text
)`,
    acquireTrigger(tables),
    releaseTrigger(tables),
    renewTrigger(tables),
    revokeTrigger(tables),
    `create table if not exists ${sem.sql} (
  name text not null primary key,
  permit_limit integer not null,
  token integer not null,
  holders text not null default '[]',
  waiters text not null default '[]',
  revoked integer not null default 0
)`,
    Permits.renewTrigger(tables),
    createTokens,
    guardTrigger(tables),
    counterTrigger(tables),
    sweepTrigger(tables),
    ...Permits.counterTriggers(tables),
    Permits.sweepTrigger(tables),
    // Last: the triggers above raise it for every grant from now on, this version's or not.
    raiseToTables(tables)
  ]
}

/**
 * A grant attempt. The statement decides: a request with no live waiter ahead of it (for a shared
 * request, no exclusive waiter) takes the lock when no exclusive lease is live (and, for an
 * exclusive request, no shared one), with the next token: one above both the file's counter and
 * the name's row (`counterTrigger` sets the counter to it). Otherwise it reports how long until
 * something could change unannounced (the holder's lease or the place of a waiter ahead running
 * out). A row is written — and the trigger grants, or takes or refreshes this request's place —
 * only when something changes: a grant, or a waiting request whose place is missing or has at
 * most 4/5 of its time left (`lease/place`). A retry that changes nothing writes nothing and returns no row (busy, wait unknown).
 *
 * Parameters: ?1 name, ?2 owner, ?3 waiter, ?4 mode, ?5 ttl ms, ?6 place ttl ms, ?7 application,
 * ?8 host, ?9 pid, ?10 take a place (0/1).
 */
export const acquire = ({ leases, queue, op }: Tables): string =>
  `with n as (
  select ${NOW} as now
), me as (
  select seq, expires_at from ${queue.sql} where owner = ?3 and token is null
), state as (
  select n.now,
    (select h.expires_at from ${leases.sql} h where h.name = ?1 and h.owner is not null and h.expires_at > n.now) as held,
    (select h.shared_until from ${leases.sql} h where ?4 = 'exclusive' and h.name = ?1 and h.shared_until > n.now) as shared,
    (select min(w.expires_at) from ${queue.sql} w
      where w.name = ?1 and w.token is null and w.expires_at > n.now and w.owner <> ?3
        and (not exists (select 1 from me where me.expires_at > n.now) or w.seq < (select seq from me))
        and (?4 = 'exclusive' or w.mode = 'exclusive')) as ahead,
    (select expires_at from me) as mine,
    max(${COUNTER}, coalesce((select h.token from ${leases.sql} h where h.name = ?1), 0)) + 1 as next
  from n
), decided as (
  select now, mine,
    case when held is null and shared is null and ahead is null then next end as token,
    max(0, min(coalesce(held, ${NEVER}), coalesce(shared, ${NEVER}), coalesce(ahead, ${NEVER})) - now) as wait
  from state
)
insert into ${op.sql} (kind, name, owner, waiter, mode, ttl, place, application, host, pid, now, token, wait)
select 'acquire', ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, now, token, case when token is null then wait end
from decided
where token is not null or (?10 and (mine is null or mine <= now + ?6 * ${PLACE_REFRESH_BELOW}))
returning cast(token as text) as token, cast(wait as real) as wait`

const acquireTrigger = (tables: Tables): string => {
  const { leases, queue, op } = tables
  return `create trigger if not exists ${trigger(tables, "acquire")} after insert on ${op.sql}
when new.kind = 'acquire'
begin
  insert into ${leases.sql} (name, owner, token, expires_at, acquired_at, holder_application, holder_host, holder_pid)
  select new.name, new.owner, new.token, new.now + new.ttl, new.now, new.application, new.host, new.pid
  where new.token is not null and new.mode = 'exclusive'
  ${takeOver("excluded.token")};
  insert into ${leases.sql} (name, token, shared_count, shared_until, shared_since)
  select new.name, new.token, 1, new.now + new.ttl, new.token
  where new.token is not null and new.mode = 'shared'
  on conflict (name) do update
    set owner = null,
        expires_at = null,
        token = excluded.token,
        shared_count = case when shared_until > new.now then shared_count + 1 else 1 end,
        shared_until = max(coalesce(shared_until, 0), excluded.shared_until),
        -- A new group of shared holders starts at this grant's token once the last one's bound passed.
        shared_since = case when shared_until > new.now then shared_since else excluded.token end;
  insert into ${queue.sql} (owner, name, mode, seq, expires_at, token, enqueued_at, holder_application, holder_host, holder_pid)
  select new.owner, new.name, 'shared', 0, new.now + new.ttl, new.token, new.now, new.application, new.host, new.pid
  where new.token is not null and new.mode = 'shared';
  delete from ${queue.sql} where new.token is not null and owner = new.waiter and token is null;
  -- A new place goes to the back; a live one keeps its turn, an expired one starts again at the back.
  insert into ${queue.sql} (owner, name, mode, seq, expires_at, enqueued_at, holder_application, holder_host, holder_pid)
  select new.waiter, new.name, new.mode, coalesce((select max(seq) from ${queue.sql} where name = new.name), 0) + 1,
    new.now + new.place, new.now, new.application, new.host, new.pid
  where new.token is null
  on conflict (owner) do update
    set seq = case when expires_at <= new.now then excluded.seq else seq end,
        enqueued_at = case when expires_at <= new.now then excluded.enqueued_at else enqueued_at end,
        expires_at = excluded.expires_at;
  delete from ${op.sql} where rowid = new.rowid;
end`
}

/**
 * Sets the file's counter to the token a lock grant hands out (never lowers it): in the granting
 * statement, after the v1 acquire trigger wrote the lease — of this version's grants (one above
 * the counter) and an older version's (its row's token plus one) alike.
 */
const counterTrigger = (tables: Tables): string => {
  const { op } = tables
  return `create trigger if not exists ${trigger(tables, "counter")} after insert on ${op.sql}
when new.kind = 'acquire' and new.token is not null
begin
  ${raiseCounter("new.token")};
end`
}

/**
 * Refuses a lock grant of a name without a row whose token is not above the counter. This
 * version never makes one (its tokens are above the counter); a process of the version before
 * the counter does, for a name the sweep deleted (or never had): it computes `coalesce(row
 * token, 0) + 1`, i.e. token 1, and its statement returns that value, so no trigger can correct
 * it — refusing the statement is the only safe answer, and that process's acquire fails with the
 * message below. Its grants of a name whose row is there pass (that row has the name's last
 * token). A name's row only ever holds its name's last token, so the rule holds for every name:
 * each grant is above the last token the name got.
 */
const guardTrigger = (tables: Tables): string => {
  const { leases, op } = tables
  return `create trigger if not exists ${trigger(tables, "guard")} before insert on ${op.sql}
when new.kind = 'acquire' and new.token is not null and new.token <= ${COUNTER}
  and not exists (select 1 from ${leases.sql} where name = new.name)
begin
  select raise(abort, 'effect-lock: a grant below the token counter of the file (effect_lock_tokens), refused: an older effect-lock version runs on this SQLite file; upgrade it');
end`
}

/**
 * Deletes up to ?1 rows of each table: places and shared holders' rows (queue) whose time ran
 * out, and lease rows of names nobody holds or waits for — no live exclusive lease, no live
 * shared bound, no live row in the queue — whose token the counter has reached, so the name's
 * next grant still gets a larger one. Times are the database's. The statement decides (the rows,
 * read under the write lock it took first), the trigger deletes exactly those, and it answers
 * one row: how many went (`swept`). Not a plain `delete … returning`: that writes one table and
 * answers a row per deleted row, and this deletes from two and answers a count.
 *
 * Parameters: ?1 the most rows to delete per table.
 */
export const sweep = ({ leases, queue, op }: Tables): string =>
  `with n as (
  select ${NOW} as now, ${COUNTER} as counter
), dead as (
  select q.owner from ${queue.sql} q, n where q.expires_at <= n.now limit ?1
), idle as (
  select h.name from ${leases.sql} h, n
  where (h.owner is null or h.expires_at <= n.now) and (h.shared_until is null or h.shared_until <= n.now)
    and h.token <= n.counter
    and not exists (select 1 from ${queue.sql} q where q.name = h.name and q.expires_at > n.now)
  limit ?1
)
insert into ${op.sql} (kind, now, heads, released)
select 'sweep', n.now,
  json_object('queue', (select json_group_array(owner) from dead), 'leases', (select json_group_array(name) from idle)),
  (select count(*) from dead) + (select count(*) from idle)
from n
returning released as swept`

const sweepTrigger = (tables: Tables): string => {
  const { leases, queue, op } = tables
  return `create trigger if not exists ${trigger(tables, "sweep")} after insert on ${op.sql}
when new.kind = 'sweep'
begin
  delete from ${queue.sql} where owner in (select value from json_each(new.heads, '$.queue'));
  delete from ${leases.sql} where name in (select value from json_each(new.heads, '$.leases'));
  delete from ${op.sql} where rowid = new.rowid;
end`
}

/** How many of the oldest places a release looks at to find whom to wake. */
const HEAD_CANDIDATES = 16

/**
 * Gives back what one request holds of `name`: the exclusive lease of `owner`, or its shared
 * lease (counted out only if it belongs to the current group of shared holders), and the
 * waiting place of `waiter` — all owner-scoped, so a holder whose lease expired and was taken
 * can never free the new holder's. Returns how many leases it released and, when this frees the
 * lock (or leaves a place while no exclusive lease is live), the waiters now at the head as a
 * JSON array: the oldest, and every shared waiter ahead of the oldest exclusive one. Queue rows
 * expired for over a minute (crashed waiters and shared holders) are removed in passing.
 *
 * Parameters: ?1 name, ?2 owner (or null), ?3 waiter (or null).
 */
export const release = ({ leases, queue, op }: Tables): string =>
  `with n as (
  select ${NOW} as now
), waiting as (
  select w.owner, w.mode, w.seq from ${queue.sql} w, n
  where w.name = ?1 and w.token is null and w.expires_at > n.now and w.owner is not ?3
  order by w.seq limit ${HEAD_CANDIDATES}
), freed as (
  select 1 where exists (select 1 from ${leases.sql} where name = ?1 and owner = ?2)
    or exists (
      select 1 from ${leases.sql} h join ${queue.sql} q on q.name = h.name
      where h.name = ?1 and q.owner = ?2 and q.token is not null and h.shared_count = 1 and q.token >= h.shared_since)
    or (exists (select 1 from ${queue.sql} where owner = ?3 and token is null)
      and not exists (select 1 from ${leases.sql} h, n where h.name = ?1 and h.owner is not null and h.expires_at > n.now))
), heads as (
  select owner from waiting
  where exists (select 1 from freed) and (seq = (select min(seq) from waiting)
    or (mode = 'shared' and seq < coalesce((select min(seq) from waiting where mode = 'exclusive'), ${NEVER})))
)
insert into ${op.sql} (kind, name, owner, waiter, now, released, heads)
select 'release', ?1, ?2, ?3, n.now,
  (select count(*) from ${leases.sql} where name = ?1 and owner = ?2)
    + (select count(*) from ${queue.sql} where owner = ?2 and name = ?1 and token is not null),
  (select json_group_array(owner) from heads)
from n
returning released, heads as woken`

const releaseTrigger = (tables: Tables): string => {
  const { leases, queue, op } = tables
  return `create trigger if not exists ${trigger(tables, "release")} after insert on ${op.sql}
when new.kind = 'release'
begin
  update ${leases.sql} set owner = null, expires_at = null where name = new.name and owner = new.owner;
  update ${leases.sql}
  set shared_count = shared_count - 1,
      shared_until = case when shared_count <= 1 then null else shared_until end
  where name = new.name and shared_count > 0 and exists (
    select 1 from ${queue.sql} q
    where q.owner = new.owner and q.name = new.name and q.token is not null and q.token >= ${leases.sql}.shared_since);
  delete from ${queue.sql} where owner = new.owner and name = new.name and token is not null;
  delete from ${queue.sql} where owner = new.waiter and token is null;
  -- Rows of crashed waiters and shared holders, long expired: removed in passing.
  delete from ${queue.sql} where name = new.name and expires_at < new.now - 60000;
  delete from ${op.sql} where rowid = new.rowid;
end`
}

/**
 * Renews a whole batch in one statement: every exclusive lease still ours and unexpired gets
 * now + ttl; every shared one still live gets it on its own row, and the name's shared bound
 * moves with it (never once an exclusive lease was granted). For the others it tells why: a
 * newer exclusive holder (`stolen`); still ours but expired (`expired`); freed without a new
 * grant (`revoked`, e.g. by an operator). The outcomes are decided before any lease is renewed
 * (`materialized`), from the rows as the statement found them.
 *
 * Parameters (JSON arrays, parallel): ?1 names, ?2 owners, ?3 tokens, ?4 ttls in ms, ?5 modes.
 */
export const renew = ({ leases, queue, op }: Tables): string =>
  `with n as (
  select ${NOW} as now
), ${RENEW_INPUT}, decided as materialized (
  select i.idx, i.name, i.owner, i.ttl, i.mode, n.now,
    case
      when i.mode = 'exclusive' and h.owner = i.owner and h.expires_at > n.now then 'renewed'
      when i.mode = 'shared' and (h.owner is null or h.expires_at <= n.now) and h.shared_count > 0 and exists (
        select 1 from ${queue.sql} q where q.owner = i.owner and q.name = i.name and q.token is not null and q.expires_at > n.now)
        then 'renewed'
      ${notRenewed(queue, "      ")}
    end as outcome
  from input i cross join n left join ${leases.sql} h on h.name = i.name
)
insert into ${op.sql} (kind, idx, name, owner, ttl, mode, now, outcome)
select 'renew', idx, name, owner, ttl, mode, now, outcome from decided where true order by idx
returning idx, outcome`

const renewTrigger = (tables: Tables): string => {
  const { leases, queue, op } = tables
  return `create trigger if not exists ${trigger(tables, "renew")} after insert on ${op.sql}
when new.kind = 'renew'
begin
  update ${leases.sql} set expires_at = new.now + new.ttl
  where new.outcome = 'renewed' and new.mode = 'exclusive' and name = new.name and owner = new.owner;
  update ${leases.sql} set shared_until = max(coalesce(shared_until, 0), new.now + new.ttl)
  where new.outcome = 'renewed' and new.mode = 'shared' and name = new.name;
  update ${queue.sql} set expires_at = new.now + new.ttl
  where new.outcome = 'renewed' and new.mode = 'shared' and owner = new.owner;
  delete from ${op.sql} where rowid = new.rowid;
end`
}

/**
 * Frees a lock whoever holds it, exclusive or shared (an operator's tool). Holders learn at their
 * next renewal; waiters of other processes at their next poll. Returns whether a lease was held.
 *
 * Parameters: ?1 name.
 */
export const revoke = ({ leases, queue, op }: Tables): string =>
  `insert into ${op.sql} (kind, name, now, released)
select 'revoke', ?1, ${NOW},
  exists (select 1 from ${leases.sql} where name = ?1 and (owner is not null or shared_count > 0))
    or exists (select 1 from ${queue.sql} where name = ?1 and token is not null)
where true
returning released as revoked`

const revokeTrigger = (tables: Tables): string => {
  const { leases, queue, op } = tables
  return `create trigger if not exists ${trigger(tables, "revoke")} after insert on ${op.sql}
when new.kind = 'revoke'
begin
  update ${leases.sql} set owner = null, expires_at = null, shared_count = 0, shared_until = null, shared_since = null
  where name = new.name and (owner is not null or shared_count > 0);
  delete from ${queue.sql} where name = new.name and token is not null;
  delete from ${op.sql} where rowid = new.rowid;
end`
}

/** The live leases (exclusive and shared), of every name or of ?1 when it is not null. */
export const holders = ({ leases, queue }: Tables): string =>
  `with n as (
  select ${NOW} as now
), live as (
  select name, 'exclusive' as mode, token, expires_at, acquired_at, holder_application, holder_host, holder_pid
  from ${leases.sql}, n where owner is not null and expires_at > n.now and (?1 is null or name = ?1)
  union all
  select name, 'shared', token, expires_at, enqueued_at, holder_application, holder_host, holder_pid
  from ${queue.sql}, n where token is not null and expires_at > n.now and (?1 is null or name = ?1)
)
select l.name, l.mode, cast(l.token as text) as token,
  cast(l.expires_at as real) as expires, cast(l.acquired_at as real) as acquired,
  l.holder_application as application, l.holder_host as host, l.holder_pid as pid,
  (select cast(min(w.enqueued_at) as real) from ${queue.sql} w, n
   where w.name = l.name and w.token is null and w.expires_at > n.now) as waiting
from live l
order by l.name, l.token`

/** Whether the lease and queue tables exist (a missing table holds no lease). */
export const present = ({ leases, queue }: Tables): string =>
  `select count(*) = 2 as present from sqlite_schema where type = 'table' and name in ('${leases.relname}', '${queue.relname}')`

/**
 * The SQL of the PgLease backend: table identifier validation, the DDL, and one statement per
 * operation. Every lock operation is a single autocommit statement (no session state, no
 * explicit transaction — and never inside the caller's), so it is
 * correct behind PgBouncer in `pool_mode = transaction`.
 * Every time comparison uses the server's `now()`; the client's clock never reaches the table.
 */
import { ensureTableSql, MAX_IDENTIFIER_BYTES, parseTable, type TableRef } from "./sqlTable.js"

export { parseTable, type TableRef }

/** Checks a NOTIFY channel name: non-empty, at most 63 bytes (longer names fail in pg_notify). */
export const checkChannel = (channel: string): string | undefined => {
  if (typeof channel !== "string" || channel.length === 0) return "the channel must be a non-empty string"
  if (Buffer.byteLength(channel, "utf8") > MAX_IDENTIFIER_BYTES) {
    return `the channel "${channel}" is longer than ${MAX_IDENTIFIER_BYTES} bytes`
  }
  return undefined
}

/**
 * The table. `owner` is a random token per acquisition (null when free), `token` the fencing
 * counter (never reset: rows are kept after release so tokens stay monotonic — deleting a row
 * would restart its name's tokens at 1), `expires_at`
 * server time. `acquired_at` and the `holder_*` columns say who holds, or last held, the lock.
 * `waiting_since` is set by the first waiter that finds the lock held and cleared by the next
 * grant: a release notifies only when it is set, because transactions that NOTIFY commit one at
 * a time (a global lock), which would cap uncontended release throughput.
 */
export const createTable = (table: TableRef): string =>
  `create table if not exists ${table.sql} (
  name text primary key,
  owner uuid,
  token bigint not null,
  expires_at timestamptz,
  acquired_at timestamptz,
  holder_application text,
  holder_host text,
  holder_pid integer,
  waiting_since timestamptz,
  constraint ${quote(`${table.relname.slice(0, 50)}_owner_expiry`)} check ((owner is null) = (expires_at is null))
)`

const quote = (identifier: string) => `"${identifier.replace(/"/g, "\"\"")}"`

/** First-use creation as ONE autocommit statement (see `ensureTableSql`). */
export const ensureTable = (table: TableRef): string => ensureTableSql(table, createTable(table), "effect-lock/PgLease/ddl")

/**
 * Takes the row when it is free or expired (bumping the token, clearing `waiting_since`) and
 * returns the token. Otherwise returns how long the current holder's lease has left (ms, server
 * time) — or nothing when the statement's snapshot cannot say (a row inserted concurrently) —
 * and, for a waiter, marks the row wanted so that its release will notify.
 *
 * Parameters: $1 name, $2 owner, $3 ttl ms, $4 application, $5 host, $6 pid, $7 mark as wanted.
 * Columns are single lowercase words so client-side name transforms cannot rename them.
 */
export const acquire = (table: TableRef): string =>
  `with attempt as (
  insert into ${table.sql} as l (name, owner, token, expires_at, acquired_at, holder_application, holder_host, holder_pid)
  values ($1::text, $2::uuid, 1, now() + $3::bigint * interval '1 millisecond', now(), $4::text, $5::text, $6::integer)
  on conflict (name) do update
    set owner = excluded.owner,
        token = l.token + 1,
        expires_at = excluded.expires_at,
        acquired_at = excluded.acquired_at,
        holder_application = excluded.holder_application,
        holder_host = excluded.holder_host,
        holder_pid = excluded.holder_pid,
        waiting_since = null
    where l.owner is null or l.expires_at <= now()
  returning l.token
), wanted as (
  update ${table.sql} w set waiting_since = now()
  where $7::boolean and w.name = $1::text and w.waiting_since is null and not exists (select 1 from attempt)
  returning 1
)
select token::text as token, null::float8 as wait from attempt
union all
select null, greatest(0, extract(epoch from (h.expires_at - now())) * 1000)::float8
from ${table.sql} h
where h.name = $1::text and not exists (select 1 from attempt)`

/**
 * Renews a whole batch in one statement: every (name, owner) still ours and unexpired gets
 * `now() + ttl`. For the others it tells why, from the row as the statement found it:
 * a larger token means someone else took it (`stolen`); still ours but expired (`expired`);
 * freed or deleted without a new grant (`revoked`, e.g. by an operator).
 * Known imprecision, accepted: the reason is read from the statement's snapshot, so a takeover
 * that commits after the snapshot (the UPDATE then re-checks the newer row and skips it) is
 * reported `expired` rather than `stolen`. Either way the lease is lost; only the label differs.
 *
 * Parameters: $1 names, $2 owners, $3 tokens, $4 ttls in ms (parallel arrays).
 */
export const renew = (table: TableRef): string =>
  `with input as (
  select * from unnest($1::text[], $2::uuid[], $3::bigint[], $4::bigint[])
    with ordinality as i(name, owner, token, ttl, idx)
), renewed as (
  update ${table.sql} as l
  set expires_at = now() + i.ttl * interval '1 millisecond'
  from input i
  where l.name = i.name and l.owner = i.owner and l.expires_at > now()
  returning l.name, l.owner
)
select i.idx::integer as idx,
  case
    when r.owner is not null then 'renewed'
    when h.name is null then 'revoked'
    when h.token > i.token then 'stolen'
    when h.owner = i.owner then 'expired'
    else 'revoked'
  end as outcome
from input i
left join renewed r on r.name = i.name and r.owner = i.owner
left join ${table.sql} h on h.name = i.name
order by i.idx`

/**
 * Owner-scoped release. When a waiter marked the row, it notifies in the same statement (sent on
 * commit, only when the row was ours). The row, its token and the mark stay: the next grant
 * clears the mark, and a loser of that race marks it again.
 *
 * Parameters: $1 name, $2 owner, $3 channel, $4 payload.
 */
export const release = (table: TableRef): string =>
  `with released as (
  update ${table.sql} set owner = null, expires_at = null
  where name = $1::text and owner = $2::uuid
  returning waiting_since
)
select true as released,
  case when waiting_since is not null then pg_notify($3::text, $4::text)::text end as notified
from released`

/**
 * Frees a lock whoever holds it (an operator's tool); the holder learns at its next renewal.
 *
 * Parameters: $1 name, $2 channel, $3 payload.
 */
export const revoke = (table: TableRef): string =>
  `with revoked as (
  update ${table.sql} set owner = null, expires_at = null
  where name = $1::text and owner is not null
  returning name
)
select true as revoked, pg_notify($2::text, $3::text) from revoked`

/** The live leases of the table (or of one name when $1 is not null). */
export const holders = (table: TableRef): string =>
  `select name, token::text as token,
  (extract(epoch from expires_at) * 1000)::float8 as expires,
  (extract(epoch from acquired_at) * 1000)::float8 as acquired,
  holder_application as application, holder_host as host, holder_pid as pid,
  (extract(epoch from waiting_since) * 1000)::float8 as waiting
from ${table.sql}
where owner is not null and expires_at > now() and ($1::text is null or name = $1::text)
order by name`

/** A wake-up sent through the pool, to check that the LISTEN connection still hears. */
export const ping = "select pg_notify($1::text, $2::text)"

/** Payload prefixes on the channel: a released lock name, or a listener health check. */
export const RELEASED_PREFIX = "r"
export const PING_PREFIX = "p"

/**
 * The SQL of SqliteLease's semaphores (`DistributedSemaphore`): PgLease's semaphore table and
 * statements (`pg/permitSql`) in SQLite's dialect — one row per semaphore name in use in
 * `<table>_sem` with its `permit_limit`, last token handed out `token`, `revoked` bound, and
 * `holders` and `waiters` as JSON arrays (the same entries as on PostgreSQL; times are the
 * database's, in whole milliseconds since the epoch). Tokens come from the file's one counter
 * (`effect_lock_tokens`, see `schema`), so the row of a semaphore nobody holds or waits for is
 * deleted by the sweep (`sweep`).
 *
 * **Why it is exact.** A write statement takes SQLite's write lock before it reads, so each
 * statement below decides on the newest row and nobody writes until it commits: the decision is
 * still true when it is written. Acquire, release and revoke are one `insert … on conflict` or
 * `update … returning` of the row (the row's triggers, `counterTriggers`, move the file's
 * counter); renew, which answers one outcome per lease of a batch, and the sweep, which answers
 * a count, are one `insert … returning` into the operations table, whose triggers carry them out.
 *
 * **Fairness** as on PostgreSQL: a request takes its permits when they fit into what is free
 * after every live waiter ahead of it has taken its own; a newcomer is behind every waiter.
 *
 * Parameters are numbered (`?1` …) in the engine's order; arrays arrive as JSON text and booleans
 * as 0/1 (the dialect, `sqlite/dialect`, encodes them).
 */
import { PLACE_REFRESH_BELOW } from "../place.js"
import { COUNTER, NEVER, NOW, raiseCounter, RENEW_INPUT, type Tables, trigger } from "./schema.js"

/**
 * The version in the triggers' names; the text of a released trigger is frozen (see `schema`'s
 * `trigger`): the v1 renewal trigger is unchanged, this version's are of new kinds.
 */
const TRIGGER_VERSION = "v1"

/** Integer parameters of `acquire`, cast: better-sqlite3 binds a JS number as a REAL. */
const LIMIT = "cast(?4 as integer)"
const PERMITS = "cast(?5 as integer)"
const TTL = "cast(?6 as integer)"
const PLACE_TTL = "cast(?7 as integer)"
const PID = "cast(?10 as integer)"

const field = (element: string, name: string) => `json_extract(${element}, '$.${name}')`

/** The live places at the head of the queue of the row (its columns in scope) that fit, up to the first that does not. */
const heads = `(select json_group_array(x.place) from (
    select ${field("w.value", "place")} as place, sum(${field("w.value", "permits")}) over (order by w.key) as upto
    from json_each(waiters) w where ${field("w.value", "expires")} > ${NOW}
  ) x
  where x.upto <= permit_limit - coalesce((select sum(${field("h.value", "permits")}) from json_each(holders) h
    where ${field("h.value", "expires")} > ${NOW}), 0))`

/**
 * One attempt at `permits` of the semaphore `name`, decided on the row as it is (see the module
 * doc): a mismatch writes the row unchanged and returns its limit; permits that fit are granted
 * the tokens `first .. first + permits - 1`, `first` one above both the file's counter and the
 * row's token (the row's token becomes the last of them, and its trigger sets the counter to it),
 * this request's holder entry is appended, its place leaves the queue, expired entries are
 * dropped; a waiting request takes its place at the back or keeps it (a new row starts at the
 * counter: at or above every token its name had).
 * Only a grant, a mismatch, a new place or one with at most 4/5 of its time left writes; an attempt that changes
 * nothing writes nothing and returns no row (busy, wait unknown).
 *
 * Parameters: ?1 name, ?2 owner, ?3 waiter, ?4 limit, ?5 permits, ?6 ttl ms, ?7 place ttl ms,
 * ?8 application, ?9 host, ?10 pid, ?11 take a place (0/1).
 */
export const acquire = ({ sem }: Tables): string =>
  `with n as (
  select ${NOW} as now
), r as (
  select * from ${sem.sql} where name = ?1
), hl as (
  select j.key as i, j.value as e, ${field("j.value", "permits")} as permits
  from r, json_each(r.holders) j, n where ${field("j.value", "expires")} > n.now
), wl as (
  select j.key as i, j.value as e, ${field("j.value", "place")} as place, ${field("j.value", "permits")} as permits,
    ${field("j.value", "expires")} as expires
  from r, json_each(r.waiters) j, n where ${field("j.value", "expires")} > n.now
), me as (
  select min(i) as at, max(expires) as expires from wl where place = ?3
), d0 as (
  select n.now, r.permit_limit as lim, r.token as rowtoken, max(coalesce(r.token, 0), ${COUNTER}) as counter,
    coalesce(r.revoked, 0) as revoked,
    r.holders as holders, r.waiters as waiters,
    coalesce((select sum(permits) from hl), 0) as held,
    exists (select 1 from hl) or exists (select 1 from wl) as inuse,
    (select at from me) as mineat,
    (select expires from me) as mineexpires,
    coalesce((select sum(permits) from wl where place <> ?3 and i < coalesce((select at from me), ${NEVER})), 0) as ahead,
    (select json_group_array(json(e) order by i) from hl) as liveholders,
    (select json_group_array(json(e) order by i) from wl) as livewaiters,
    (select json_group_array(json(e) order by i) from wl where place <> ?3) as others
  from n left join r on true
), d as (
  -- Read under the write lock this statement took first: the newest row, unchanged until it commits.
  select d0.*, inuse and lim <> ${LIMIT} as mismatch,
    not (inuse and lim <> ${LIMIT}) and ahead + ${PERMITS} <= (case when inuse then lim else ${LIMIT} end) - held as fits
  from d0
)
insert into ${sem.sql} (name, permit_limit, token, holders, waiters, revoked)
select ?1,
  case when mismatch then lim else ${LIMIT} end,
  case when fits then counter + ${PERMITS} else coalesce(rowtoken, counter) end,
  case when mismatch then holders
    when fits then json_insert(liveholders, '$[#]', json_object('owner', ?2, 'permits', ${PERMITS}, 'token', counter + 1,
      'expires', now + ${TTL}, 'acquired', now, 'application', ?8, 'host', ?9, 'pid', ${PID}))
    else liveholders end,
  case when mismatch then waiters
    when fits then others
    when not ?11 then livewaiters
    when mineat is null then json_insert(livewaiters, '$[#]', json_object('place', ?3, 'permits', ${PERMITS}, 'expires', now + ${PLACE_TTL},
      'since', now, 'application', ?8, 'host', ?9, 'pid', ${PID}))
    else (select json_group_array(case when place = ?3 then json(json_set(e, '$.expires', d.now + ${PLACE_TTL})) else json(e) end order by i) from wl)
  end,
  revoked
from d
-- A mismatch writes the row unchanged, only so that the statement returns it (and its limit).
where mismatch or fits or (?11 and (mineat is null or mineexpires <= now + ${PLACE_TTL} * ${PLACE_REFRESH_BELOW}))
on conflict (name) do update set permit_limit = excluded.permit_limit, token = excluded.token, holders = excluded.holders,
  waiters = excluded.waiters
returning
  -- Granted: this attempt's entry is the one it appended last; its tokens end at the counter.
  case when json_extract(holders, '$[#-1].owner') = ?2 then cast(token - ${PERMITS} + 1 as text) end as token,
  case when permit_limit <> ${LIMIT} then permit_limit end as current,
  case when json_extract(holders, '$[#-1].owner') is not ?2 then cast(max(0, min(
    coalesce((select min(${field("h.value", "expires")}) from json_each(holders) h where ${field("h.value", "expires")} > ${NOW}), ${NEVER}),
    coalesce((select min(${field("w.value", "expires")}) from json_each(waiters) w
      where ${field("w.value", "expires")} > ${NOW} and ${field("w.value", "place")} <> ?3), ${NEVER})
  ) - ${NOW}) as real) end as wait`

/**
 * Gives back the holder entry of `owner` and/or the place of `waiter` (owner-scoped), dropping
 * expired entries, and returns the waiters now at the head that fit, as a JSON array (this
 * process wakes its own; others poll). No row when it held neither.
 *
 * Parameters: ?1 name, ?2 owner (or null), ?3 waiter (or null).
 */
export const release = ({ sem }: Tables): string =>
  `update ${sem.sql} set
  -- Owner-scoped: only this acquisition's own entry (and place) goes.
  holders = (select json_group_array(json(j.value) order by j.key) from json_each(${sem.sql}.holders) j
    where ${field("j.value", "expires")} > ${NOW} and ${field("j.value", "owner")} is not ?2),
  waiters = (select json_group_array(json(j.value) order by j.key) from json_each(${sem.sql}.waiters) j
    where ${field("j.value", "expires")} > ${NOW} and ${field("j.value", "place")} is not ?3)
where name = ?1 and (
  exists (select 1 from json_each(${sem.sql}.holders) j where ${field("j.value", "owner")} = ?2)
  or exists (select 1 from json_each(${sem.sql}.waiters) j where ${field("j.value", "place")} = ?3))
returning 1 as released, ${heads} as woken`

/**
 * Renews a whole batch in one statement: the outcomes are decided from the rows as they are
 * (`materialized`, before anything is renewed) — our live entry (`renewed`), our entry there but
 * expired (`expired`), gone with our tokens revoked (`revoked`), gone with a live holder granted
 * after us (`stolen`), gone otherwise (`expired`) — and the trigger sets each renewed entry to
 * now + ttl, dropping expired ones.
 *
 * Parameters (JSON arrays, parallel): ?1 names, ?2 owners, ?3 first tokens, ?4 ttls in ms, ?5 modes (ignored).
 */
export const renew = ({ sem, op }: Tables): string =>
  `with n as (
  select ${NOW} as now
), ${RENEW_INPUT}, decided as materialized (
  select i.idx, i.name, i.owner, i.ttl, n.now,
    case
      when exists (select 1 from json_each(s.holders) j where ${field("j.value", "owner")} = i.owner and ${
    field("j.value", "expires")
  } > n.now)
        then 'renewed'
      when s.name is null then 'revoked'
      when exists (select 1 from json_each(s.holders) j where ${field("j.value", "owner")} = i.owner) then 'expired'
      when s.revoked >= i.token then 'revoked'
      when exists (select 1 from json_each(s.holders) j where ${field("j.value", "expires")} > n.now and ${
    field("j.value", "token")
  } > i.token)
        then 'stolen'
      else 'expired'
    end as outcome
  from input i cross join n left join ${sem.sql} s on s.name = i.name
)
insert into ${op.sql} (kind, idx, name, owner, ttl, now, outcome)
select 'sem-renew', idx, name, owner, ttl, now, outcome from decided where true order by idx
returning idx, outcome`

/** The trigger carrying out a renewal's outcomes (see `renew`). */
export const renewTrigger = (tables: Tables): string => {
  const { sem, op } = tables
  return `create trigger if not exists ${trigger(tables, "sem_renew", TRIGGER_VERSION)} after insert on ${op.sql}
when new.kind = 'sem-renew'
begin
  update ${sem.sql} set holders = (
    select json_group_array(case when ${field("j.value", "owner")} = new.owner
      then json(json_set(j.value, '$.expires', new.now + new.ttl)) else json(j.value) end order by j.key)
    from json_each(${sem.sql}.holders) j where ${field("j.value", "expires")} > new.now)
  where new.outcome = 'renewed' and name = new.name;
  delete from ${op.sql} where rowid = new.rowid;
end`
}

/**
 * The semaphore table's triggers of the file's counter (semaphore grants write the row directly,
 * not through the operations table):
 * - `sem_guard`: refuses a new row granting a token not above the counter. This version never
 *   writes one; the version before the counter does, for a name the sweep deleted (its first
 *   token `coalesce(row token, 0) + 1` is 1 again, and its RETURNING reports that value, so no
 *   trigger can correct it): that process's acquire fails with an error instead.
 * - `sem_counter`: after a new row, raises the counter to its token; a row that starts below the
 *   counter (an older version's waiting request on a swept name: token 0) is raised to it first,
 *   so its later grants (row token + permits) are above every token its name had.
 * - `sem_counter_update`: raises the counter to a row's new token (a grant on an existing row, by
 *   any version; an older version's is above its row's token, its name's last).
 */
export const counterTriggers = (tables: Tables): ReadonlyArray<string> => {
  const { sem } = tables
  return [
    `create trigger if not exists ${trigger(tables, "sem_guard", TRIGGER_VERSION)} before insert on ${sem.sql}
when not exists (select 1 from ${sem.sql} where name = new.name)
  and exists (select 1 from json_each(new.holders) h where ${field("h.value", "token")} <= ${COUNTER})
begin
  select raise(abort, 'effect-lock: a grant below the token counter of the file (effect_lock_tokens), refused: an older effect-lock version runs on this SQLite file; upgrade it');
end`,
    `create trigger if not exists ${trigger(tables, "sem_counter", TRIGGER_VERSION)} after insert on ${sem.sql}
begin
  update ${sem.sql} set token = ${COUNTER} where name = new.name and token < ${COUNTER};
  ${raiseCounter("new.token")};
end`,
    `create trigger if not exists ${trigger(tables, "sem_counter_update", TRIGGER_VERSION)} after update of token on ${sem.sql}
begin
  ${raiseCounter("new.token")};
end`
  ]
}

/**
 * Deletes up to ?1 rows of semaphores nobody holds or waits for (no live holder entry, no live
 * place, by the database's clock) whose token the counter has reached, so the name's next grant
 * still gets larger tokens. The statement decides, the trigger deletes exactly those, and it
 * answers one row: how many went (`swept`) — a plain `delete … returning` answers a row per
 * deleted row instead.
 *
 * Parameters: ?1 the most rows to delete.
 */
export const sweep = ({ sem, op }: Tables): string =>
  `with n as (
  select ${NOW} as now, ${COUNTER} as counter
), idle as (
  select s.name from ${sem.sql} s, n
  where s.token <= n.counter
    and not exists (select 1 from json_each(s.holders) j where ${field("j.value", "expires")} > n.now)
    and not exists (select 1 from json_each(s.waiters) j where ${field("j.value", "expires")} > n.now)
  limit ?1
)
insert into ${op.sql} (kind, now, heads, released)
select 'sem-sweep', n.now, (select json_group_array(name) from idle), (select count(*) from idle)
from n
returning released as swept`

/** The trigger deleting what a sweep decided (see `sweep`). */
export const sweepTrigger = (tables: Tables): string => {
  const { sem, op } = tables
  return `create trigger if not exists ${trigger(tables, "sem_sweep", TRIGGER_VERSION)} after insert on ${op.sql}
when new.kind = 'sem-sweep'
begin
  delete from ${sem.sql} where name in (select value from json_each(new.heads));
  delete from ${op.sql} where rowid = new.rowid;
end`
}

/**
 * Takes every permit of `name` away (an operator's tool): holders learn at their next renewal
 * (`revoked`); waiters take the permits at their next poll. Returns whether a permit was held
 * (no row when none was).
 *
 * Parameters: ?1 name.
 */
export const revoke = ({ sem }: Tables): string =>
  `-- Every token handed out so far is revoked: a holder's renewal says so rather than "expired".
update ${sem.sql} set holders = '[]', revoked = token,
  waiters = (select json_group_array(json(j.value) order by j.key) from json_each(${sem.sql}.waiters) j
    where ${field("j.value", "expires")} > ${NOW})
where name = ?1 and exists (select 1 from json_each(${sem.sql}.holders) j where ${field("j.value", "expires")} > ${NOW})
returning 1 as revoked`

/** The semaphores in use (live holders or waiters), of every name or of ?1 when it is not null. */
export const semaphores = ({ sem }: Tables): string =>
  `select s.name, s.permit_limit as lim,
  (select json_group_array(json(j.value) order by j.key) from json_each(s.holders) j where ${field("j.value", "expires")} > ${NOW})
    as holders,
  (select json_group_array(json(j.value) order by j.key) from json_each(s.waiters) j where ${field("j.value", "expires")} > ${NOW})
    as waiters
from ${sem.sql} s
where (?1 is null or s.name = ?1) and (
  exists (select 1 from json_each(s.holders) j where ${field("j.value", "expires")} > ${NOW})
  or exists (select 1 from json_each(s.waiters) j where ${field("j.value", "expires")} > ${NOW}))
order by s.name`

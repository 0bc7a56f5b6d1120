/**
 * The SQL of PgLease's semaphores (`DistributedSemaphore`): one autocommit statement per
 * operation, the server's `now()` only, like the lock statements beside them (`pg/sql`).
 *
 * **One row per semaphore name** in the semaphore table (`<table>_sem`, created with the lease
 * table): `permit_limit`, `token` (the last token handed out, drawn from the database's token
 * sequence as a block of `permits` consecutive values, `sql/tokens`: the row of a semaphore
 * nobody holds or waits for is swept, and its next grant still gets larger tokens), `holders` — a jsonb array of
 * `{ owner, permits, token (the first of its permits'), expires, acquired, application, host, pid }`
 * — and `waiters`, the queue, a jsonb array in arrival order of
 * `{ place, permits, expires, since, application, host, pid }`; times are the server's, in
 * milliseconds since the epoch. `revoked`: every token up to it was taken away by `revoke`.
 *
 * **Why it is exact.** Everything that decides a grant — the limit, who holds how many permits
 * and until when, who waits ahead — is on that one row, and every grant, place, renewal and
 * release writes it. Concurrent writers of a name serialize on the row's lock, and each decides
 * on the row as the previous one left it: `insert … on conflict do update` evaluates its SET on
 * the newest (locked) row version, and a plain UPDATE re-evaluates its WHERE and SET on the
 * newest version under READ COMMITTED. Those decisions read only the row's own columns — never
 * another table, which would be read in the statement's older snapshot. A snapshot read is used
 * only to skip writing when nothing can change; it can only delay a grant, never make a wrong one
 * (and whatever made it stale notifies, or the retry sees it).
 *
 * **Fairness.** A request takes its permits when they fit into what is free after every live
 * waiter ahead of it has taken its own (a newcomer is behind every waiter): so waiters are served
 * in arrival order, a big request is not starved by small ones behind it, and the waiters at the
 * head that fit can all take their permits at once. A place lasts `place ttl` unless its waiter
 * retries; expired holders and places are dropped by whichever statement next writes the row.
 *
 * Columns of results are single lowercase words so client-side name transforms cannot rename them.
 */
import * as Tokens from "../../sql/tokens.js"
import type { Tables } from "./sql.js"
import { commitsUnflushed, WAITER_PREFIX } from "./sql.js"
import { PLACE_REFRESH_BELOW } from "../place.js"

/** The server's time in milliseconds since the epoch (numeric: microseconds kept). */
const NOW = "(extract(epoch from now()) * 1000)"
const BIG = "9223372036854775807"

const live = (element: string) => `(${element}->>'expires')::numeric > ${NOW}`

/** The live elements of a jsonb array column, in order (an empty array when none). */
const liveArray = (column: string) =>
  `coalesce((select jsonb_agg(x.e order by x.i) from jsonb_array_elements(${column}) with ordinality as x(e, i) where ${
    live("x.e")
  }), '[]'::jsonb)`

/** Whether the row `r` is in use: a live holder or a live waiter. */
const inUse = (r: string) =>
  `(exists (select 1 from jsonb_array_elements(${r}.holders) as x(e) where ${live("x.e")})
    or exists (select 1 from jsonb_array_elements(${r}.waiters) as x(e) where ${live("x.e")}))`

/**
 * What an attempt finds on the row `r` (parameters as in `acquire`): its live holders and the
 * permits they hold, its live waiters (with and without this request's place), where this
 * request's place is, the permits asked by live waiters ahead of it (all of them for a request
 * without a place), whether it is in use with another limit (`mismatch`) and whether this
 * request's permits fit (`fits`).
 */
const decide = (r: string) =>
  `(select q.*, q.inuse and ${r}.permit_limit <> $4::integer as mismatch,
    not (q.inuse and ${r}.permit_limit <> $4::integer)
      and q.ahead + $5::integer <= (case when q.inuse then ${r}.permit_limit else $4::integer end) - q.held as fits
  from (
    select m.*,
      coalesce((select sum((x.e->>'permits')::integer) from jsonb_array_elements(${r}.waiters) with ordinality as x(e, i)
        where ${live("x.e")} and x.e->>'place' <> $3::text and x.i < coalesce(m.mineat, ${BIG})), 0) as ahead
    from (
      select
        ${liveArray(`${r}.holders`)} as liveholders,
        coalesce((select sum((x.e->>'permits')::integer) from jsonb_array_elements(${r}.holders) as x(e) where ${
    live("x.e")
  }), 0) as held,
        ${liveArray(`${r}.waiters`)} as livewaiters,
        coalesce((select jsonb_agg(x.e order by x.i) from jsonb_array_elements(${r}.waiters) with ordinality as x(e, i)
          where ${live("x.e")} and x.e->>'place' <> $3::text), '[]'::jsonb) as others,
        (select min(x.i) from jsonb_array_elements(${r}.waiters) with ordinality as x(e, i)
          where ${live("x.e")} and x.e->>'place' = $3::text) as mineat,
        (select max((x.e->>'expires')::numeric) from jsonb_array_elements(${r}.waiters) as x(e)
          where ${live("x.e")} and x.e->>'place' = $3::text) as mineexpires,
        ${inUse(r)} as inuse
    ) m
  ) q)`

/** This request's holder entry, its permits starting at token `first`. */
const holder = (first: string) =>
  `jsonb_build_object('owner', $2::text, 'permits', $5::integer, 'token', ${first}, 'expires', ${NOW} + $6::bigint,
    'acquired', ${NOW}, 'application', $8::text, 'host', $9::text, 'pid', $10::integer)`

/** This request's place at the back of the queue. */
const place = `jsonb_build_object('place', $3::text, 'permits', $5::integer, 'expires', ${NOW} + $7::bigint,
    'since', ${NOW}, 'application', $8::text, 'host', $9::text, 'pid', $10::integer)`

/** The attempt writes only when it grants, takes a place, or refreshes one with at most 4/5 of its time left (`lease/place`). */
const writes = (d: string) =>
  `(${d}.fits or ($11::boolean and not ${d}.mismatch and (${d}.mineat is null or ${d}.mineexpires <= ${NOW} + $7::bigint * ${PLACE_REFRESH_BELOW})))`

/**
 * One attempt at `permits` of the semaphore `name`. On the newest row: in use with another limit
 * → nothing changes and the current limit is returned; the permits fit (see the module doc) →
 * granted: the counter moves by `permits`, this request's holder entry is appended (expired
 * holders and places dropped), its place, if any, leaves the queue; otherwise a waiting request
 * takes its place at the back (or keeps it, refreshed). Returns the first token granted, else
 * the current limit on a mismatch, else the ms until something could change without a
 * notification (a holder's lease or another waiter's place running out).
 *
 * The snapshot of the row decides only whether to write at all: a retry that can change nothing
 * (its place is fresh, its permits do not fit) locks and writes nothing.
 *
 * Parameters: $1 name, $2 owner (of this attempt's grant), $3 waiter (this request's place),
 * $4 limit, $5 permits, $6 ttl ms, $7 place ttl ms, $8 application, $9 host, $10 pid,
 * $11 take a place.
 */
export const acquire = ({ leases, sem }: Tables): string => {
  const last = "(select last from drawn)"
  // The last of this grant's permits' tokens: above the row's counter (a previous version's
  // per-name count may run ahead of the sequence), else the block drawn.
  const upTo = `greatest(p.token + $5::integer, ${last})`
  return `with s as (
  select * from ${sem.sql} where name = $1::text
), guard as materialized (
  -- Taken before the draw: the sweep cannot delete the name's row between the draw and the insert
  -- that meets it (a block drawn before the row's last grant would then become the name's next).
  select ${Tokens.holdGuard(Tokens.sweepGuardNamespace(leases), "$1::text")}
), drawn as materialized (
  select ${Tokens.drawBlock(Tokens.tokenSequence(leases), "$5::integer")} as last from guard
), u as (
  insert into ${sem.sql} as p (name, permit_limit, token, holders, waiters)
  select $1::text, $4::integer, ${last}, jsonb_build_array(${holder(`${last} - $5::integer + 1`)}), '[]'::jsonb
  -- The snapshot only says whether to write: a stale one skips a write, and what made it stale notifies or is seen by the retry.
  where not exists (select 1 from s) or (select ${writes("d")} from s, lateral ${decide("s")} d)
  on conflict (name) do update set (permit_limit, token, holders, waiters) = (
    -- Decided on p, the newest row version (locked): never on the snapshot.
    select
      case when d.mismatch then p.permit_limit else $4::integer end,
      case when d.fits then ${upTo} else p.token end,
      case when d.mismatch then p.holders
        when d.fits then d.liveholders || jsonb_build_array(${holder(`${upTo} - $5::integer + 1`)})
        else d.liveholders end,
      case when d.mismatch then p.waiters
        when d.fits then d.others
        when not $11::boolean then d.livewaiters
        when d.mineat is null then d.livewaiters || jsonb_build_array(${place})
        else (select jsonb_agg(case when x.e->>'place' = $3::text then jsonb_set(x.e, '{expires}', to_jsonb(${NOW} + $7::bigint)) else x.e end
          order by x.i) from jsonb_array_elements(d.livewaiters) with ordinality as x(e, i))
      end
    from ${decide("p")} d
  )
  returning p.permit_limit, p.token, p.holders, p.waiters
), cur as (
  select permit_limit, holders, waiters from u
  union all
  select permit_limit, holders, waiters from s where not exists (select 1 from u)
), granted as (
  -- This attempt's entry is the one it appended last; its tokens end at the counter.
  select (u.token - $5::integer + 1)::text as token from u where u.holders -> -1 ->> 'owner' = $2::text
)
select (select token from granted) as token,
  -- Nothing granted: the place (if any) need not wait for the disk.
  ${commitsUnflushed("not exists (select 1 from granted)")},
  (select c.permit_limit from cur c where c.permit_limit <> $4::integer and ${inUse("c")}) as current,
  (select greatest(0, least(
      (select min((x.e->>'expires')::numeric) from jsonb_array_elements(c.holders) as x(e) where ${live("x.e")}),
      (select min((x.e->>'expires')::numeric) from jsonb_array_elements(c.waiters) as x(e)
        where ${live("x.e")} and x.e->>'place' <> $3::text)
    ) - ${NOW})::float8 from cur c where not exists (select 1 from granted)) as wait`
}

/**
 * The live places at the head of the queue of the row `r` whose permits fit into what is free,
 * up to the first that does not (permits are at least 1, so the running sum only grows).
 */
const heads = (r: string) =>
  `(select x.e->>'place' as place from (
    select e, sum((e->>'permits')::integer) over (order by i) as upto
    from jsonb_array_elements(${r}.waiters) with ordinality as w(e, i) where ${live("e")}
  ) x
  where x.upto <= ${r}.permit_limit - coalesce((select sum((h->>'permits')::integer) from jsonb_array_elements(${r}.holders) as y(h)
    where ${live("h")}), 0))`

/**
 * Gives back what one request holds of `name`: the holder entry of `owner` and/or the place of
 * `waiter` — owner-scoped, so a holder whose permits expired can never free anyone else's —
 * dropping expired entries in passing. Then the waiters now at the head that fit are notified,
 * in the same statement (sent on commit; none when nobody waits). Decided on the newest row.
 *
 * Parameters: $1 name, $2 owner (or null), $3 waiter (or null), $4 channel.
 */
export const release = ({ sem }: Tables): string =>
  `with u as (
  update ${sem.sql} as p set (holders, waiters) = (
    select
      -- Owner-scoped: only this acquisition's own entry (and place) goes; a taken-over holder's release frees nobody else's.
      coalesce((select jsonb_agg(x.e order by x.i) from jsonb_array_elements(p.holders) with ordinality as x(e, i)
        where ${live("x.e")} and x.e->>'owner' is distinct from $2::text), '[]'::jsonb),
      coalesce((select jsonb_agg(x.e order by x.i) from jsonb_array_elements(p.waiters) with ordinality as x(e, i)
        where ${live("x.e")} and x.e->>'place' is distinct from $3::text), '[]'::jsonb)
  )
  where p.name = $1::text and (
    exists (select 1 from jsonb_array_elements(p.holders) as x(e) where x.e->>'owner' = $2::text)
    or exists (select 1 from jsonb_array_elements(p.waiters) as x(e) where x.e->>'place' = $3::text))
  returning p.permit_limit, p.holders, p.waiters
)
select (select count(*) from u) as released,
  -- A give-back grants nothing: its commit need not wait for the disk.
  ${commitsUnflushed("true")},
  -- Whom to wake is read from the row this statement wrote (still locked): exact, never a stale snapshot.
  (select count(pg_notify($4::text, '${WAITER_PREFIX}' || h.place)) from u, lateral ${heads("u")} h) as woken`

/**
 * Renews a whole batch in one statement: on each name's row (newest version), every live holder
 * entry of the batch gets `now() + ttl` (expired entries are dropped). For the others it tells
 * why, from the row as the statement found it: our entry there but expired (`expired`); gone, with
 * our tokens revoked (`revoked`); gone, with a live holder granted after us (`stolen`); gone
 * otherwise (`expired`: it ran out and was dropped). Known imprecision, as for locks: a change
 * committed after the statement's snapshot may be reported as `expired` — lost either way.
 *
 * Parameters: $1 names, $2 owners, $3 first tokens, $4 ttls in ms, $5 modes (ignored: the lock
 * renewal's parameters, so both renew through the same code).
 */
export const renew = ({ sem }: Tables): string =>
  `with input as (
  select * from unnest($1::text[], $2::uuid[], $3::bigint[], $4::bigint[], $5::text[]) with ordinality as i(name, owner, token, ttl, mode, idx)
), mine as (
  -- One entry per row to update (an UPDATE … FROM applies one source row per target row).
  select name, jsonb_object_agg(owner::text, ttl) as ttls from input group by name
), renewed as (
  update ${sem.sql} as p set holders = (
    select coalesce(jsonb_agg(case when m.ttls -> (x.e->>'owner') is not null
        then jsonb_set(x.e, '{expires}', to_jsonb(${NOW} + (m.ttls ->> (x.e->>'owner'))::numeric)) else x.e end
      order by x.i), '[]'::jsonb)
    from jsonb_array_elements(p.holders) with ordinality as x(e, i) where ${live("x.e")}
  )
  from mine m
  where p.name = m.name and exists (
    select 1 from jsonb_array_elements(p.holders) as x(e) where m.ttls -> (x.e->>'owner') is not null and ${live("x.e")})
  returning p.name, p.holders
)
select i.idx::integer as idx,
  case
    when exists (select 1 from renewed r, jsonb_array_elements(r.holders) as x(e) where r.name = i.name and x.e->>'owner' = i.owner::text)
      then 'renewed'
    when s.name is null then 'revoked'
    when exists (select 1 from jsonb_array_elements(s.holders) as x(e) where x.e->>'owner' = i.owner::text) then 'expired'
    when s.revoked >= i.token then 'revoked'
    when exists (select 1 from jsonb_array_elements(s.holders) as x(e) where ${live("x.e")} and (x.e->>'token')::bigint > i.token)
      then 'stolen'
    else 'expired'
  end as outcome
from input i
left join ${sem.sql} s on s.name = i.name
order by i.idx`

/**
 * One round of the idle-name sweep (`lease/sweep`): deletes at most $1 rows of semaphores with no
 * live holder and no live waiter whose tokens the sequence has already passed, skipping rows
 * another statement has locked and names whose grant is drawing right now (`Tokens.tryGuard`, on
 * the candidates only). Parameters: $1 the most rows to delete.
 */
export const sweep = ({ leases, sem }: Tables): string =>
  `with candidates as materialized (
  select s.name from ${sem.sql} s
  where not ${inUse("s")} and s.token < ${Tokens.nextUp(Tokens.tokenSequence(leases))}
  limit $1::integer
  for update of s skip locked
), idle as (
  select name from candidates where ${Tokens.tryGuard(Tokens.sweepGuardNamespace(leases), "name")}
), gone as (
  delete from ${sem.sql} s using idle i where s.name = i.name
  returning 1
)
select (select count(*) from gone)::integer as swept,
  -- Deletes only what nobody holds: its commit need not wait for the disk.
  ${commitsUnflushed("true")}`

/**
 * Takes every permit of `name` away (an operator's tool): holders learn at their next renewal
 * (`revoked`), and the waiters that now fit are notified. Returns whether a permit was held.
 *
 * Parameters: $1 name, $2 channel.
 */
export const revoke = ({ sem }: Tables): string =>
  `with u as (
  -- Every token handed out so far is revoked: a holder's renewal says so rather than "expired".
  update ${sem.sql} as p set holders = '[]'::jsonb, revoked = p.token, waiters = ${liveArray("p.waiters")}
  where p.name = $1::text and exists (select 1 from jsonb_array_elements(p.holders) as x(e) where ${live("x.e")})
  returning p.permit_limit, p.holders, p.waiters
)
select exists (select 1 from u) as revoked,
  (select count(pg_notify($2::text, '${WAITER_PREFIX}' || h.place)) from u, lateral ${heads("u")} h) as woken`

/**
 * The semaphores in use (live holders or waiters), of every name or of $1 when it is not null:
 * each with its limit, live holders and waiters, for inspection and tests.
 */
export const semaphores = ({ sem }: Tables): string =>
  `select s.name, s.permit_limit as lim, ${liveArray("s.holders")} as holders, ${liveArray("s.waiters")} as waiters
from ${sem.sql} s
where ($1::text is null or s.name = $1::text) and ${inUse("s")}
order by s.name`

/**
 * The SQL both dialects state alike about the lease tables (`pg/sql`, `sqlite/sql`): the same
 * decision written once, spliced into each dialect's statement text as it is.
 */
import type { TableRef } from "../sql/tables.js"

/**
 * An exclusive grant taking over the lease row of its name (`insert … on conflict`): the new
 * holder, `token` as the dialect computes it, and no shared holders left counted.
 */
export const takeOver = (token: string): string =>
  `on conflict (name) do update
    set owner = excluded.owner,
        token = ${token},
        expires_at = excluded.expires_at,
        acquired_at = excluded.acquired_at,
        holder_application = excluded.holder_application,
        holder_host = excluded.holder_host,
        holder_pid = excluded.holder_pid,
        shared_count = 0,
        shared_until = null,
        shared_since = null`

/**
 * Why a lease of a renewal batch (`i`, its lease row `h`) was not renewed, as CASE branches (each
 * line after the first indented by `indent`): the row is gone (`revoked`); a newer exclusive
 * holder took it (`stolen`); still ours but expired (`expired`); a shared holder's own row still
 * there (`expired`); freed without a new grant (`revoked`, e.g. by an operator).
 */
export const notRenewed = (queue: TableRef, indent: string): string =>
  [
    `when h.name is null then 'revoked'`,
    `when h.owner is not null and h.owner <> i.owner and h.token > i.token then 'stolen'`,
    // The same owner id with a newer token: a lease a release handed to the place again.
    `when i.mode = 'exclusive' and h.owner = i.owner and h.token > i.token then 'stolen'`,
    `when i.mode = 'exclusive' and h.owner = i.owner then 'expired'`,
    `when i.mode = 'exclusive' and h.token > i.token then 'stolen'`,
    `when i.mode = 'shared' and exists (select 1 from ${queue.sql} q where q.owner = i.owner and q.token is not null) then 'expired'`,
    `else 'revoked'`
  ].join(`\n${indent}`)

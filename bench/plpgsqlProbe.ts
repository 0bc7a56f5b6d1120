/**
 * `npx tsx bench/plpgsqlProbe.ts [--rounds=R]`
 *
 * What PgLease's give-back would cost at the server as a PL/pgSQL function (the lever its
 * statements' executor set-up points to, bench/README "Where the remaining time goes") against the
 * statement it sends today, `releaseBatch` with one member, on one connection, in alternating
 * rounds: an uncontended give-back (nobody waits: the lease is freed), and a handover (7 exclusive
 * places behind the holder: the head is handed the lease, checked after each). The functions are
 * probes, not the library's: the common paths only (a shared head, a head not written lately or a
 * locked row answer -1, where the library would send `release`), with `release`'s lock order and
 * token rule. The median wall time per round, and the function's share of the statement's.
 * A diagnostic: nothing is written to the report.
 */
import * as Crypto from "node:crypto"
import * as LeaseSql from "../src/internal/lease/pg/sql.js"
import * as Tokens from "../src/internal/sql/tokens.js"
import { mainOnLeaseTables, queuedName } from "./lib/leaseQueue.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const rounds = Number(arg("rounds") ?? "8")
const PER_ROUND = 150

const TABLE = "plpgsql_probe_leases"
const table = LeaseSql.parseTable(TABLE) as LeaseSql.TableRef
const median = (values: ReadonlyArray<number>) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)]!

/** The give-back as one function: free the name nobody waits for, or hand it to a live exclusive head. */
const giveBackFunction = () => {
  const ns = Tokens.sweepGuardNamespace(table)
  const seq = Tokens.tokenSequence(table)
  return `create function plpgsql_probe_give_back(p_name text, p_owner uuid, p_channel text) returns int language plpgsql as $$
declare h record; l record; t bigint;
begin
  select q.owner, q.mode, q.ttl_ms, q.expires_at, q.holder_application, q.holder_host, q.holder_pid into h
    from ${TABLE}_queue q where q.name = p_name and q.token is null and q.expires_at > now() order by q.seq limit 1;
  if found and not (h.mode = 'exclusive' and h.ttl_ms is not null and h.expires_at > now() + interval '2500 milliseconds') then return -1; end if;
  select name, token into l from ${TABLE} where name = p_name and owner = p_owner and (shared_until is null or shared_until <= now())
    for no key update skip locked;
  if not found then return -1; end if;
  if h.owner is null then
    update ${TABLE} set owner = null, expires_at = null where name = p_name;
    perform set_config('synchronous_commit', 'off', true);
    return 0;
  end if;
  perform 1 from ${TABLE}_queue q where q.owner = h.owner and q.token is null and q.expires_at > now() and q.mode = 'exclusive'
    for update skip locked;
  if not found then return -1; end if;
  perform ${Tokens.holdGuard(ns, "p_name")};
  t := greatest(l.token + 1, ${Tokens.draw(seq)});
  update ${TABLE} set owner = h.owner, token = t, expires_at = now() + h.ttl_ms * interval '1 millisecond', acquired_at = now(),
    holder_application = h.holder_application, holder_host = h.holder_host, holder_pid = h.holder_pid where name = p_name;
  delete from ${TABLE}_queue where owner = h.owner and token is null;
  perform pg_notify(p_channel, 'h' || h.owner::text || ':' || t::text);
  return 1;
end $$`
}

type Which = "statement" | "function"

mainOnLeaseTables("plpgsql-probe", table, async (client) => {
  await client.query(giveBackFunction())
  const batch = LeaseSql.releaseBatch(table)
  /** One give-back of `name` by `owner`: its wall time, and what it answered (1 handed, 0 freed). */
  const giveBack = async (which: Which, name: string, owner: string) => {
    const start = performance.now()
    const answer = which === "statement"
      ? await client.query({ name: "statement", text: batch, values: [[name], [owner], TABLE] })
      : await client.query({ name: "function", text: "select plpgsql_probe_give_back($1, $2, $3) as r", values: [name, owner, TABLE] })
    const ms = performance.now() - start
    const row = answer.rows[0]
    const outcome = which === "statement" ? (row === undefined ? -1 : Number(row.woken)) : Number(row.r)
    return { ms, outcome }
  }
  const acquire = LeaseSql.acquire(table)
  const uncontended = async (which: Which, i: number) => {
    const name = `free-${i % 16}`
    const owner = Crypto.randomUUID()
    const granted = await client.query({ name: "acquire", text: acquire, values: [name, owner, Crypto.randomUUID(), "exclusive", 30_000, 5_000, "bench", "host", process.pid, true] })
    if (granted.rows[0]?.token == null) throw new Error(`${which}: ${name} not granted`)
    const { ms, outcome } = await giveBack(which, name, owner)
    if (outcome !== 0) throw new Error(`${which}: uncontended give-back answered ${outcome}`)
    return ms
  }
  const name = "handed"
  const queued = await queuedName(client, table, name, 7)
  const { ask, queue } = queued
  let holder = queued.holder
  const handover = async (which: Which) => {
    const { ms, outcome } = await giveBack(which, name, holder)
    if (outcome !== 1) throw new Error(`${which}: handover answered ${outcome}`)
    const old = holder
    holder = queue.shift()!
    const owner = (await client.query<{ owner: string | null }>(`select owner from ${TABLE} where name = $1`, [name])).rows[0]!.owner
    if (owner !== holder) throw new Error(`${which}: the lease went to ${owner}, not to the head ${holder}`)
    await ask(old)
    queue.push(old)
    return ms
  }
  for (const [label, run] of [["uncontended give-back", uncontended], ["handover", (which: Which) => handover(which)]] as const) {
    for (let i = 0; i < 100; i++) for (const which of ["statement", "function"] as const) await run(which, i)
    const shares: Array<number> = []
    for (let round = 0; round < rounds; round++) {
      const p50: Partial<Record<Which, number>> = {}
      for (const which of (round % 2 === 0 ? ["function", "statement"] : ["statement", "function"]) as Array<Which>) {
        const walls: Array<number> = []
        for (let i = 0; i < PER_ROUND; i++) walls.push(await run(which, i))
        p50[which] = median(walls)
      }
      shares.push(p50.function! / p50.statement!)
      console.log(`${label}, round ${round}: releaseBatch alone p50 ${p50.statement!.toFixed(3)} ms, function p50 ${p50.function!.toFixed(3)} ms`)
    }
    console.log(`${label}: the function takes ${median(shares).toFixed(2)} of the statement's time (rounds ${Math.min(...shares).toFixed(2)}–${Math.max(...shares).toFixed(2)})`)
  }
})

/**
 * PostgreSQL's token source: ONE sequence, `effect_lock_tokens`, in the schema of the tables that
 * draw from it (unqualified tables: wherever `search_path` puts them, so one per database in the
 * usual set-up). PgAdvisory's fencing table, PgLease's lease table and its semaphore table all
 * draw from it. A name's fencing counter therefore does not live in its row: the row of a name
 * nobody holds or waits for can be deleted (the idle-name sweep), and the name's next grant still
 * gets a larger token — provided the sequence is already past the deleted row's token (`nextUp`),
 * which every sweep checks.
 *
 * Durability across a server crash: `nextval` writes a WAL record covering the next 32 values
 * before it hands out the first of them, and gives its transaction an xid when it does, so that
 * transaction's commit flushes the record. Every grant also writes its row in the same
 * transaction and commits with the session's `synchronous_commit` (never `off` for a grant): its
 * commit record comes after the record that covers its token, and flushing WAL up to the commit
 * flushes everything before it. After a crash the sequence resumes at or above every token whose
 * grant was answered — and may skip up to 32 values, which only leaves a gap.
 *
 * The sequence keeps PostgreSQL's default `cache 1`: with a larger cache, sessions would hand out
 * preallocated values below `last_value`, and a swept row's name could get a smaller token.
 *
 * A rolling upgrade: a process of the previous version still counts tokens per name (`token + 1`
 * on an existing row — larger than that name's last token, so correct — and `1` on a new row).
 * A new row it inserts for a name the sweep deleted would restart that name below its last token,
 * so each table gets a `before insert` trigger that draws from the sequence for such a row (`when
 * token = 1`, which the current version writes only for the very first token of an empty
 * database; on the fencing table also 0, where a semaphore's row starts). The sequence is installed above every token already in the table, once, while
 * `alter sequence` holds the lock that `nextval` waits for.
 */
import { advisoryKey } from "../core/lockKey.js"
import { parseTable, type TableRef } from "./tables.js"

/** The sequence's own name, in the schema of the tables it serves. */
export const TOKENS_RELNAME = "effect_lock_tokens"
/** The trigger function's name, in the same schema. */
const GUARD_FUNCTION = "effect_lock_first_token"
/** Serializes installers (a transaction advisory lock), whichever table they install for. */
const DDL_NAMESPACE = "effect-lock/tokens/ddl"

/** The sequence serving `table`: in its schema when it names one. */
export const tokenSequence = (table: TableRef): TableRef => {
  const schema = table.text.includes(".") ? `${table.text.split(".")[0]}.` : ""
  const parsed = parseTable(`${schema}${TOKENS_RELNAME}`)
  // The schema part was validated with the table; the relname is ours.
  if (typeof parsed === "string") throw new TypeError(parsed)
  return parsed
}

const sibling = (seq: TableRef, relname: string): string =>
  seq.text.includes(".") ? `"${seq.text.split(".")[0]}"."${relname}"` : `"${relname}"`

/** The literal a sequence function takes (resolved once, when the statement is planned). */
const regclass = (seq: TableRef) => `'${seq.sql.replace(/'/g, "''")}'`

/** One token: the next value of the sequence. */
export const draw = (seq: TableRef): string => `nextval(${regclass(seq)})`

/**
 * The last of `n` tokens drawn at once (a semaphore grant's block is the `n` values ending at it):
 * `n` distinct values all above the sequence's previous value, so the block starts above it too.
 */
export const drawBlock = (seq: TableRef, n: string): string =>
  `(select max(nextval(${regclass(seq)})) from generate_series(1, ${n}))`

/**
 * The value the sequence hands out next, at the least: a row whose token is below it can be
 * deleted, since every later draw is larger.
 */
export const nextUp = (seq: TableRef): string =>
  `(select last_value + case when is_called then 1 else 0 end from ${seq.sql})`

/** What kind of rows a table keeps: which columns the guard rewrites for a previous version's new row. */
export type Guarded =
  /** PgLease's lease table: `token`, and `shared_since` of a shared grant. */
  | { readonly table: TableRef; readonly kind: "lease" }
  /** PgAdvisory's fencing table: `token`. */
  | { readonly table: TableRef; readonly kind: "fencing" }
  /** PgLease's semaphore table: `token` and the first holder's block. */
  | { readonly table: TableRef; readonly kind: "sem" }

const triggerName = (kind: Guarded["kind"]) => `effect_lock_${kind}_first_token`

/** When the previous version's new row needs the guard: its per-name counting starts at 1. */
const guardWhen = (kind: Guarded["kind"]) =>
  kind === "sem"
    ? `((new.holders -> 0 ->> 'token') = '1')`
    // The fencing table's semaphore rows are made at 0, and their grants add to the row's counter.
    : kind === "fencing"
    ? `(new.token <= 1)`
    : `(new.token = 1)`

/**
 * The sequence, the guard and its triggers for `tables`, as ONE statement (a `do` block, so it also
 * runs behind a transaction pooler and in a migration script). Costs a catalog lookup once installed.
 */
export const ensureTokens = (seq: TableRef, tables: ReadonlyArray<Guarded>): string => {
  const fn = sibling(seq, GUARD_FUNCTION)
  const missing = tables.map(({ table, kind }) =>
    `not exists (select 1 from pg_trigger where tgrelid = to_regclass('${table.sql}') and tgname = '${triggerName(kind)}')`
  )
  const install = tables.map(({ table, kind }, i) =>
    `if ${missing[i]} then
      -- The table's lock first (its grants in flight end, new ones wait), then the sequence's: the
      -- order every grant takes them in, so no grant holds one while it waits for the other.
      begin
        create trigger "${triggerName(kind)}" before insert on ${table.sql}
          for each row when ${guardWhen(kind)} execute function ${fn}('${seq.sql}', '${kind}');
      exception when duplicate_object then
        null; -- made meanwhile by an installer this transaction's snapshot does not see
      end;
      -- Holds the lock nextval waits for until commit: no value is drawn while the start is raised.
      alter sequence ${seq.sql} owned by none;
      -- Above every token the table already has (a previous version's per-name counters).
      perform setval(${regclass(seq)}, greatest((select last_value from ${seq.sql}), (select coalesce(max(token), 0) from ${table.sql})), true);
    end if;`
  ).join("\n    ")
  const anyMissing = `to_regclass('${seq.sql}') is null or ${missing.join(" or ")}`
  return `do $effect_lock_tokens$
begin
  if ${anyMissing} then
    perform pg_advisory_xact_lock(${advisoryKey(seq.text, DDL_NAMESPACE)});
    -- Again under the lock: an installer that waited for another's commit finds nothing to do.
    if ${anyMissing} then
      create sequence if not exists ${seq.sql};
      create or replace function ${fn}() returns trigger language plpgsql as $guard$
      declare
        n bigint;
        last bigint;
      begin
        -- A previous version's new row (its per-name count restarting at 1): drawn from the sequence.
        if tg_argv[1] = 'sem' then
          n := greatest(1, coalesce((new.holders -> 0 ->> 'permits')::bigint, 1));
          select max(v) into last from (select nextval(tg_argv[0]::regclass) as v from generate_series(1, n)) d;
          new.token := last;
          new.holders := jsonb_set(new.holders, '{0,token}', to_jsonb(last - n + 1));
        elsif tg_argv[1] = 'lease' then
          new.token := nextval(tg_argv[0]::regclass);
          if new.shared_since is not null then
            new.shared_since := new.token;
          end if;
        else
          new.token := nextval(tg_argv[0]::regclass);
        end if;
        return new;
      end
      $guard$;
      -- Each table's trigger, re-checked under the lock: a concurrent installer may have made it.
      ${install}
    end if;
  end if;
end
$effect_lock_tokens$`
}

/**
 * The sweep's per-name guard: a grant that draws its token before it finds the name's row takes
 * this lock (shared) first, and the sweep deletes a row only when it gets the lock (exclusive,
 * without waiting) — so a row is never deleted between a draw and the insert that would have met
 * it, which would let a token drawn before the row's last grant become the name's next one. Two-int
 * keys: apart from PgAdvisory's one-bigint keys. `namespace`: an int4 literal, from the table.
 */
export const sweepGuardNamespace = (table: TableRef): number => Number(BigInt.asIntN(32, advisoryKey(table.text, "effect-lock/sweep")))

/** The shared guard a grant takes before drawing (held to the end of its statement's transaction). */
export const holdGuard = (namespace: number, name: string): string =>
  `pg_advisory_xact_lock_shared(${namespace}, hashtext(${name}))`

/** The sweep's try at the exclusive guard of a name (held to the end of the sweep's transaction). */
export const tryGuard = (namespace: number, name: string): string =>
  `pg_try_advisory_xact_lock(${namespace}, hashtext(${name}))`

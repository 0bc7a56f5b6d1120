/**
 * The seam between the lease engine and a database: a `Dialect` is a record of typed statements
 * (`Statement<I, O>`: the SQL text of one operation, how its typed input becomes the driver's
 * parameters, how the rows it answers become a typed result), one statement per operation.
 * PostgreSQL's is `lease/pg/dialect`, SQLite's `lease/sqlite/dialect`.
 *
 * The parameters are positional and in the same order on every database (`params` below); a
 * dialect encodes them as its driver binds them (SQLite: numbered, booleans as 0/1, arrays as
 * JSON text) and may append its own (PostgreSQL: the NOTIFY channel). The answers' columns are
 * the same on every database too, so the decoders here serve both. Expiry is the database's
 * clock only; a statement never runs inside the caller's transaction (the operator statements
 * excepted: they are ordinary statements of the caller's `SqlClient`).
 */
import type { LockMode } from "../../Lease.js"
import type { LockBackendError } from "../../LockError.js"
import type { TableRef } from "../sql/tables.js"
import type { StoredLease, StoredSemaphore } from "./stored.js"
import { storedLease, storedSemaphore } from "./stored.js"

/** The tables of one lease table name, on every database (a dialect may add its own). */
export interface LeaseTables {
  /** One row per lock name in use: its holder, its last token, its shared holders' count and bound. */
  readonly leases: TableRef
  /** A row per waiting request (its place, in arrival order) and per shared holder. */
  readonly queue: TableRef
  /** One row per semaphore name in use: its limit, last token, holders and waiters. */
  readonly sem: TableRef
}

/** A row as a driver answers it. */
export type Row = Readonly<Record<string, unknown>>

/** One operation's statement: its text, its parameters from `I`, its answer as `O`. */
export interface Statement<I, O> {
  /** Names the operation in `LockBackendError { operation }`. */
  readonly operation: string
  readonly text: string
  readonly encode: (input: I) => ReadonlyArray<unknown>
  readonly decode: (rows: ReadonlyArray<Row>) => O
  /** How statements of this kind that wait for a connection together go out as one (on lanes that batch: PgLease's own connections). */
  readonly batch?: BatchSpec | undefined
}

/**
 * Several statements as one: `key` of a statement's encoded parameters is undefined for one that
 * may not go in a batch, else what must differ between the members of one; `encode` turns the
 * members' own parameters into the batch's, `split` the batch's rows into each member's own rows,
 * in order — undefined for a member the batch did not decide, which then sends its own statement.
 */
export interface BatchSpec {
  readonly key: (params: ReadonlyArray<unknown>) => string | undefined
  readonly text: string
  /** The most members of one batch. */
  readonly max: number
  /**
   * Sent for a member alone too, when no other waits to go with it: the batch's statement costs
   * less than the member's own wherever it decides (the member's own still follows where not).
   */
  readonly alone?: boolean | undefined
  readonly encode: (members: ReadonlyArray<ReadonlyArray<unknown>>) => ReadonlyArray<unknown>
  readonly split: (rows: ReadonlyArray<Row>, members: number) => ReadonlyArray<ReadonlyArray<Row> | undefined>
}

/** What every grant attempt sends, a lock's and a semaphore's alike. */
export interface AttemptInput {
  readonly name: string
  /** The owner of this attempt's grant: a random uuid per attempt. */
  readonly owner: string
  /** The request's place in the queue, kept across its attempts. */
  readonly waiter: string
  readonly ttlMillis: number
  /** How long a place lasts unless its waiter retries. */
  readonly placeMillis: number
  readonly application: string
  readonly host: string
  readonly pid: number
  /** Whether the request takes (or keeps) a place when not granted: only a request that waits. */
  readonly takePlace: boolean
}

export interface LockAcquireInput extends AttemptInput {
  readonly mode: LockMode
}

/**
 * A lock attempt's answer: the token granted, else (`token` null) the ms until something could
 * change without a wake-up (the holder's lease or a waiter's place ahead running out; null when
 * unknown), and whether a live waiter's place was ahead of this request's (`behind`; false when
 * the store does not say). Grants go in arrival order.
 */
export interface LockAcquireAnswer {
  readonly token: bigint | null
  readonly wait: number | null
  readonly behind: boolean
  /**
   * The token is of a lease a release handed to this request's place (PgLease, RedisLease): the ms it still
   * had when the store answered. Null otherwise, and on stores that never hand a lease over.
   */
  readonly handedLeft?: number | null | undefined
  /** The store's clock when it answered (epoch ms), on stores that say (PgLease, RedisLease). */
  readonly now?: number | null | undefined
}

export interface PermitAcquireInput extends AttemptInput {
  readonly limit: number
  readonly permits: number
}

/**
 * A permit attempt's answer: the first of the grant's `permits` consecutive tokens; else the
 * limit the name is in use with when it is not the request's (`current`); else `wait` as for locks.
 */
export interface PermitAcquireAnswer extends LockAcquireAnswer {
  readonly current: number | null
}

/** An owner-scoped give-back: `owner`'s lease and/or `waiter`'s place of `name`. */
export interface ReleaseInput {
  readonly name: string
  readonly owner: string | null
  readonly waiter: string | null
}

export interface ReleaseAnswer {
  /** Whether it freed a lease (or a semaphore's holder entry). */
  readonly released: boolean
  /** Places it found at the head, to wake in this process (none where the statement notifies itself). */
  readonly wake: ReadonlyArray<string>
  /**
   * It served every place it looked at (16 shared heads): shared places behind them may fit too,
   * and the statements' `wakeSharedHeads` (where there is one) wakes them.
   */
  readonly crowd?: boolean | undefined
}

/** Which lock the shared places at the head of whose queue to wake. */
export interface WakeSharedInput {
  readonly name: string
}

/** What renewal sends of a grant (a semaphore's permits have no mode; its token is its first). */
export interface RenewInput {
  readonly name: string
  readonly owner: string
  readonly token: bigint
  readonly mode?: LockMode | undefined
  readonly ttlMillis: number
}

/** What became of one lease of a renewal batch. */
export type RenewAnswer = "renewed" | "stolen" | "expired" | "revoked"

/** The statements of one kind of grant (locks, or a semaphore's permits). */
export interface GrantStatements<I, A> {
  readonly acquire: Statement<I, A>
  readonly release: Statement<ReleaseInput, ReleaseAnswer>
  /**
   * Wakes the shared places at the head of a name's queue, up to the first exclusive one: sent
   * after a release that answered `crowd`. Absent where the release wakes them itself (RedisLease's
   * script) or waiters poll often (SqliteLease).
   */
  readonly wakeSharedHeads?: Statement<WakeSharedInput, void> | undefined
  /** A whole batch in one statement; answers in batch order. */
  readonly renew: Statement<ReadonlyArray<RenewInput>, ReadonlyArray<RenewAnswer>>
  /** Creates the tables if needed: idempotent statements, run in order on first use. */
  readonly ensureTable: ReadonlyArray<Statement<void, void>>
  /**
   * Deletes up to `limit` rows of names nobody holds or waits for (and rows of places and shared
   * holders that ran out), only where the store's token source is already past the row's token,
   * so the name's next grant still gets a larger one; answers how many rows went.
   */
  readonly sweep: Statement<SweepInput, number>
}

/** One round of the idle-name sweep: at most `limit` rows of each table. */
export interface SweepInput {
  readonly limit: number
}

/** The operator and inspection statements, run on the caller's `SqlClient`. */
export interface OperatorStatements {
  /** The live leases, of every name or of `name`. */
  readonly holders: Statement<{ readonly name: string | null }, ReadonlyArray<StoredLease>>
  /** Whether the lease tables exist (a missing table holds no lease). */
  readonly present: Statement<void, boolean>
  /** Frees a lock whoever holds it; whether a lease was held. */
  readonly revoke: Statement<{ readonly name: string }, boolean>
  /** The semaphores in use, of every name or of `name`. */
  readonly semaphores: Statement<{ readonly name: string | null }, ReadonlyArray<StoredSemaphore>>
  /** Takes every permit of a semaphore away; whether a permit was held. */
  readonly revokePermits: Statement<{ readonly name: string }, boolean>
}

/** What differs between databases. */
export interface Dialect {
  /** Short name for spans, metrics and `inspect` (`pg-lease`, `sqlite-lease`). */
  readonly backend: string
  readonly locks: GrantStatements<LockAcquireInput, LockAcquireAnswer>
  /** Semaphores (`DistributedSemaphore`): their table is created apart from the lock tables. */
  readonly permits: GrantStatements<PermitAcquireInput, PermitAcquireAnswer>
  readonly operator: OperatorStatements
  /** The database's wall clock, ms since the epoch. */
  readonly now: Statement<void, number>
  /** A failed table creation worth another attempt (a concurrent creator won a race). */
  readonly retryCreate: (error: LockBackendError) => boolean
}

/** An attempt's parameters around the request's own: who asks, then for how long and who it is. */
const asking = (i: AttemptInput) => [i.name, i.owner, i.waiter]
const holding = (i: AttemptInput) => [i.ttlMillis, i.placeMillis, i.application, i.host, i.pid, i.takePlace]

/** The positional parameters, the same list on every database. */
export const params = {
  /** $1 name, $2 owner, $3 waiter, $4 mode, $5 ttl ms, $6 place ttl ms, $7 application, $8 host, $9 pid, $10 take a place. */
  lockAcquire: (i: LockAcquireInput): ReadonlyArray<unknown> => [...asking(i), i.mode, ...holding(i)],
  /** $1 name, $2 owner, $3 waiter, $4 limit, $5 permits, $6 ttl ms, $7 place ttl ms, $8 application, $9 host, $10 pid, $11 take a place. */
  permitAcquire: (i: PermitAcquireInput): ReadonlyArray<unknown> => [...asking(i), i.limit, i.permits, ...holding(i)],
  /** $1 name, $2 owner (or null), $3 waiter (or null). */
  release: (i: ReleaseInput): ReadonlyArray<unknown> => [i.name, i.owner, i.waiter],
  /** Parallel arrays: $1 names, $2 owners, $3 tokens as text, $4 ttls ms, $5 modes (null for permits). */
  renew: (grants: ReadonlyArray<RenewInput>): ReadonlyArray<unknown> => [
    grants.map((g) => g.name),
    grants.map((g) => g.owner),
    grants.map((g) => g.token.toString()),
    grants.map((g) => g.ttlMillis),
    grants.map((g) => g.mode ?? null)
  ],
  /** $1 the most rows to delete per table. */
  sweep: (i: SweepInput): ReadonlyArray<unknown> => [i.limit],
  /** $1 name, or null for every name. */
  named: (i: { readonly name: string | null }): ReadonlyArray<unknown> => [i.name],
  none: (): ReadonlyArray<unknown> => []
} as const

const first = (rows: ReadonlyArray<Row>): Row | undefined => rows[0]
const bigintOrNull = (value: unknown): bigint | null => (value === null || value === undefined ? null : BigInt(value as string))
const numberOrNull = (value: unknown): number | null => (value === null || value === undefined ? null : Number(value))

/** A true flag column of the first row: PostgreSQL's boolean, SQLite's 1; false without a row. */
const flag = (column: string) => (rows: ReadonlyArray<Row>): boolean => {
  const value = first(rows)?.[column]
  return value === true || (typeof value !== "boolean" && Number(value ?? 0) === 1)
}

const behind = flag("behind")
const handed = flag("handed")

/** The answers' decoders, the same on every database (their columns are). */
export const decode = {
  lockAcquire: (rows: ReadonlyArray<Row>): LockAcquireAnswer => ({
    token: bigintOrNull(first(rows)?.["token"]),
    wait: numberOrNull(first(rows)?.["wait"]),
    // A dialect without the column answers false: its waiters keep looking again after taking a place.
    behind: behind(rows),
    handedLeft: handed(rows) ? numberOrNull(first(rows)?.["left"]) ?? 0 : null,
    now: numberOrNull(first(rows)?.["now"])
  }),
  permitAcquire: (rows: ReadonlyArray<Row>): PermitAcquireAnswer => ({
    token: bigintOrNull(first(rows)?.["token"]),
    current: numberOrNull(first(rows)?.["current"]),
    wait: numberOrNull(first(rows)?.["wait"]),
    behind: false
  }),
  /**
   * `wake`: the places to wake in process, read from the answer (a dialect that notifies reads
   * none); `crowdAt`: the count of notifications (`woken`) from which the release served every
   * place it looked at (absent: never).
   */
  release: (wake: (rows: ReadonlyArray<Row>) => ReadonlyArray<string>, crowdAt?: number) => (rows: ReadonlyArray<Row>): ReleaseAnswer => ({
    released: Number(first(rows)?.["released"] ?? 0) > 0,
    wake: wake(rows),
    crowd: crowdAt !== undefined && Number(first(rows)?.["woken"] ?? 0) >= crowdAt
  }),
  /** In batch order, whatever order the database returned them in. */
  renew: (rows: ReadonlyArray<Row>): ReadonlyArray<RenewAnswer> =>
    [...rows].sort((a, b) => Number(a["idx"]) - Number(b["idx"])).map((row) => renewAnswer(row["outcome"])),
  holders: (rows: ReadonlyArray<Row>): ReadonlyArray<StoredLease> => rows.map(storedLease),
  semaphores: (rows: ReadonlyArray<Row>): ReadonlyArray<StoredSemaphore> => rows.map(storedSemaphore),
  present: flag("present"),
  revoked: flag("revoked"),
  now: (rows: ReadonlyArray<Row>): number => Number(first(rows)?.["now"]),
  /** The rows a sweep deleted (`swept`). */
  swept: (rows: ReadonlyArray<Row>): number => Number(first(rows)?.["swept"] ?? 0),
  nothing: (): void => undefined
} as const

const renewAnswer = (outcome: unknown): RenewAnswer =>
  outcome === "renewed" || outcome === "stolen" || outcome === "expired" ? outcome : "revoked"

/** Idempotent DDL texts as statements, run in order. */
export const ddl = (texts: ReadonlyArray<string>, encode: (params: ReadonlyArray<unknown>) => ReadonlyArray<unknown>) =>
  texts.map((text): Statement<void, void> => ({ operation: "create-table", text, encode: () => encode([]), decode: decode.nothing }))

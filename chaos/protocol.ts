/**
 * What the chaos driver and its worker processes say to each other, and the names both use.
 *
 * Workers print one JSON object per stdout line (a `WorkerEvent` stamped with the worker's slot,
 * incarnation, `Date.now()` and its place in the process's output); the driver writes one command
 * per stdin line.
 */

/**
 * The backends a chaos run exercises. `redis` locks on Redis (RedisLease) and writes its fenced
 * rounds to PostgreSQL, as the other two do: the checker reads the same write log.
 */
export const BACKENDS = ["pg-advisory", "pg-lease", "redis"] as const
export type Backend = typeof BACKENDS[number]

export const isBackend = (value: string): value is Backend => (BACKENDS as ReadonlyArray<string>).includes(value)

/** The one lock every worker loops on. */
export const LOCK_NAME = "chaos-round"
/** The `Fence` resource every accepted write is checked against. */
export const FENCE_RESOURCE = "chaos_rounds"
/**
 * The write log: one row per accepted write. No unique constraint on `round`: a double holder must
 * be able to show. `began_at` and `began_n` are the stamp (`t`, `n`) of the worker's `writing`
 * event for this write: when the write began, on the worker's own clock and in its own order.
 * `xid` is the writing transaction's id: with a reader's snapshot (`read` events) it says exactly
 * whether that read saw the row (seq is drawn at insert, and commits may land out of seq order).
 */
export const ROUNDS_TABLE = "chaos_rounds"

export const roundsTableSql = `create table if not exists ${ROUNDS_TABLE} (
  seq bigserial primary key,
  round int not null,
  worker int not null,
  token bigint not null,
  acquisition text not null,
  began_at bigint not null,
  began_n bigint not null,
  written_at timestamptz not null,
  xid bigint not null default (pg_current_xact_id()::text::bigint)
)`

/** A round's work before its read: short (ms) three times in four… */
export const SHORT_WORK_MS = { min: 50, max: 250 } as const
/** …else long, in ttls, so that leases renew while held and faults find holders deep in a round. */
export const LONG_WORK_TTLS = { min: 0.5, max: 1.5, chance: 0.25 } as const
/** The deliberate gap between reading the last round and writing the next one (ms). */
export const GAP_MS = { min: 20, max: 80 } as const
/** Allowance for the read and the fenced write's transaction in a round. */
const STATEMENTS_MS = 200

/** The longest a holder keeps the lock in one round when nothing goes wrong. */
export const longestRoundMs = (ttlMs: number): number => Math.round(LONG_WORK_TTLS.max * ttlMs) + GAP_MS.max + STATEMENTS_MS

/** application_name of a worker's application pool (PgLease's lock statements run on it too). */
export const appName = (slot: number) => `chaos-w${slot}-app`
/** application_name of a worker's PgAdvisory lock sessions; with `redis`, RedisLease's `applicationName` (its connections are `<it>:<role>`). */
export const lockName = (slot: number) => `chaos-w${slot}-lock`
/** application_name of the driver's own statements, so that no fault ever targets them. */
export const DRIVER_APPLICATION = "chaos-driver"

export type WorkerEvent =
  | { readonly e: "ready" }
  /** Granted: `acq` identifies this acquisition in the write log. `mode` absent: exclusive. */
  | { readonly e: "acquired"; readonly acq: string; readonly token: string; readonly mode?: "shared" }
  /** The moment this process learned the lease is gone (its `lost` failed). */
  | { readonly e: "lost"; readonly acq: string; readonly token: string; readonly reason: string }
  /** The lock was released (the scope closed) without a loss. */
  | { readonly e: "released"; readonly acq: string; readonly token: string }
  /**
   * A fenced write begins: printed in the fiber that writes, after the fence check and right before
   * the insert is handed to the driver. Its `t` and `n` are stored in the row it writes.
   */
  | { readonly e: "writing"; readonly acq: string; readonly token: string; readonly round: number }
  /**
   * A reader's look at the write log (its read `which` of two), printed in the body's fiber right
   * after the statement returned: `snapshot` is that statement's `pg_current_snapshot()`
   * (`xmin:xmax:xip,…`), which says exactly which rows it saw; `last` the highest round among them.
   */
  | { readonly e: "read"; readonly acq: string; readonly token: string; readonly which: 1 | 2; readonly snapshot: string; readonly last: number }
  /** The fenced write committed. */
  | { readonly e: "wrote"; readonly acq: string; readonly token: string; readonly round: number; readonly seq: string }
  /** The fence refused the write: a newer token has written. */
  | { readonly e: "refused"; readonly acq: string; readonly token: string; readonly current: string }
  /** Waiting for the lock ran into the worker's own acquire timeout. */
  | { readonly e: "timeout"; readonly waitedMs: number }
  | { readonly e: "error"; readonly acq?: string; readonly tag: string; readonly message: string }
  | { readonly e: "stall-begin"; readonly ms: number }
  | { readonly e: "stall-end"; readonly ms: number }
  | { readonly e: "saturate-begin"; readonly connections: number; readonly ms: number }
  | { readonly e: "saturate-end"; readonly failed: number }

export type Stamped = WorkerEvent & {
  /** `Date.now()` of the worker when it printed the event. */
  readonly t: number
  /** The worker's slot (1..K). */
  readonly w: number
  /** How many times this slot was started before (0 for the first process). */
  readonly i: number
  /**
   * The event's place in its process's output (1, 2, …): exact order within one process, where
   * `t` can tie. Events of different processes (w, i) are not ordered by it.
   */
  readonly n: number
}

/** Driver → worker, one per stdin line. */
export type Command =
  | { readonly c: "stall"; readonly ms: number }
  | { readonly c: "saturate"; readonly ms: number }
  | { readonly c: "stop" }

/** What a worker reads from its environment. */
export interface WorkerConfig {
  readonly url: string
  readonly backend: Backend
  /** `redis` only: the server, and the run's own key prefix (runs may share a server). */
  readonly redis?: { readonly url: string; readonly prefix: string } | undefined
  readonly slot: number
  readonly incarnation: number
  readonly ttlMs: number
  readonly poolSize: number
  readonly seed: number
  /**
   * A deliberately broken worker, to show that the checker catches what it must (never in a real
   * run): `write-after-loss` makes every worker block its own event loop past the lease's safe time
   * in its first round (so that it loses its lease), and, once it has reported a loss, write on a
   * daemon fiber outside the guard, as a program that ignores `LockLost` would; `shared-overlap`
   * (see `BROKEN_WORKERS`) reads without the lock.
   */
  readonly broken?: BrokenWorker | undefined
  /**
   * The chance (0 ≤ p < 1) that a round is a reader's: a `shared` acquisition that reads the write
   * log twice, a gap apart, and writes nothing. Drawn only when above 0, so that runs without
   * readers keep their PRNG streams (and their seeds' replays).
   */
  readonly sharedChance?: number | undefined
}

/**
 * `shared-overlap` makes worker 1's second round a reader that never acquires: it reports a shared
 * grant with a token above any real one, reads, waits until another worker's write has committed,
 * and reads again — the overlap the checker's `shared-overlap` rule must catch.
 */
export const BROKEN_WORKERS = ["write-after-loss", "shared-overlap"] as const
export type BrokenWorker = typeof BROKEN_WORKERS[number]

export const WORKER_ENV = "CHAOS_WORKER_CONFIG"

/** Exit code of a worker whose layers could not be built (a typed failure, e.g. the server was down). */
export const EXIT_LAYER_FAILED = 3

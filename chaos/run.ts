/**
 * One chaos run: for each backend, K worker processes loop on one lock (on PostgreSQL, or on Redis
 * for `redis`), writing their fenced rounds to a fresh PostgreSQL database, while faults are
 * injected one at a time from a seeded PRNG; afterwards the workers are stopped, what is left held
 * is counted, the write log is read back and the checker judges it.
 */
import * as Effect from "effect/Effect"
import * as PgLease from "effect-lock/PgLease"
import * as RedisLease from "effect-lock/RedisLease"
import { Redis } from "ioredis"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import pg from "pg"
import { type Server, startPostgres, withClient } from "../tools/embeddedPostgres.js"
import { type RedisServer, startRedis } from "../tools/redisServer.js"
import { check, type CheckResult, type WriteRow } from "./checker.js"
import { gitRevision } from "./report.js"
import { FAULT_KINDS, type FaultContext, type FaultKind, type FaultRecord, inject, makeDeck } from "./faults.js"
import { type Fleet, makeFleet } from "./fleet.js"
import { deriveSeed, makePrng } from "./prng.js"
import { type Backend, type BrokenWorker, DRIVER_APPLICATION, LOCK_NAME, ROUNDS_TABLE, roundsTableSql, type Stamped } from "./protocol.js"

/**
 * A commit of a write that began after `endedAt`: the recovery the checker counts (it takes commit
 * times). A `wrote` printed after the fault ended may be of a write that committed before it: the
 * next fault would then be injected into the recovery still under way, and make it late.
 */
const wroteAfter = (events: ReadonlyArray<Stamped>, endedAt: number) => (event: Stamped): boolean =>
  event.e === "wrote" &&
  events.some((began) => began.e === "writing" && began.acq === event.acq && began.round === event.round && began.t > endedAt)

export interface ChaosOptions {
  readonly backends: ReadonlyArray<Backend>
  /** Fault injection time per backend; the last fault's recovery may run past it, and every kind is injected at least once. */
  readonly durationMs: number
  readonly seed: number
  readonly workers: number
  /** Lease ttl of every acquisition (PgLease; PgAdvisory ignores it). */
  readonly ttlMs: number
  /** Connections of each worker's own pool. */
  readonly poolSize: number
  /** Progress lines. */
  readonly log: (line: string) => void
  /** Where each backend's worker log (stderr of the workers) is written. */
  readonly logDir: string
  /**
   * After the first phase (`seed`, `durationMs`), one more phase per seed here, each one deck of
   * every kind: a test replays a fixed sequence and explores a random one with one set of workers.
   * A phase's faults are replayed alone by `--seed` with its seed.
   */
  readonly extraSeeds?: ReadonlyArray<number> | undefined
  /** Fault kinds to draw from (default: all). */
  readonly kinds?: ReadonlyArray<FaultKind> | undefined
  /** Deliberately broken workers (protocol.ts `WorkerConfig.broken`): only to show the checker catches them. */
  readonly broken?: BrokenWorker | undefined
  /** The chance that a worker's round is a reader's (protocol.ts `WorkerConfig.sharedChance`); 0 or absent: none. */
  readonly sharedChance?: number | undefined
}

export interface ClockAlignment {
  /** Server clock minus this host's, from the round trip with the smallest delay. */
  readonly measuredOffsetMs: number
  /** Half that round trip: the measurement's uncertainty. */
  readonly uncertaintyMs: number
  /** The offset the checker applies: 0 on an embedded server (same host, same clock). */
  readonly appliedOffsetMs: number
}

export interface BackendRun {
  readonly backend: Backend
  readonly startedAt: number
  readonly stoppedAt: number
  readonly faults: ReadonlyArray<FaultRecord>
  readonly check: CheckResult
  readonly clock: ClockAlignment
  readonly logFile: string
  /** Every worker event, fault and write of the run, one JSON object per line, for a post-mortem. */
  readonly traceFile: string
}

export interface ChaosRun {
  readonly seed: number
  /** The commit the workers ran (short hash, "(src/ modified)" when src/ had changes), read at the start. */
  readonly library: string
  readonly options: Omit<ChaosOptions, "log">
  readonly server: { readonly embedded: boolean; readonly version: string; readonly commitTimestamps: boolean }
  /** The Redis of the `redis` backend, when it ran. */
  readonly redis?: { readonly embedded: boolean; readonly version: string } | undefined
  readonly runs: ReadonlyArray<BackendRun>
  readonly violations: number
}

/** Bound on the workers' start (tsx compiles them on a loaded 2-core machine). */
const READY_TIMEOUT_MS = 90_000
/** Bound on the first accepted write, before any fault. */
const FIRST_WRITE_TIMEOUT_MS = 30_000
/** A worker asked to stop must have released and exited within this. */
const STOP_TIMEOUT_MS = 10_000
/** How long the server may take to end the backends of closed sessions (and drop their locks). */
const SETTLE_TIMEOUT_MS = 3_000
const SETTLE_POLL_MS = 100
const OFFSET_SAMPLES = 5

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms))

const databaseUrl = (base: string, database: string) => {
  const url = new URL(base)
  url.pathname = `/${database}`
  return url.toString()
}

const makeQuery = (url: string) => <R>(text: string, values: ReadonlyArray<unknown> = []): Promise<Array<R>> =>
  withClient(url, DRIVER_APPLICATION, async (client) => (await client.query<R & pg.QueryResultRow>(text, [...values])).rows)

/** Commit timestamps make "written after the loss" exact; they need a restart to switch on. */
const enableCommitTimestamps = async (server: Server, embedded: boolean, log: (line: string) => void): Promise<boolean> => {
  const query = makeQuery(server.url)
  const on = async () => (await query<{ on: string }>("select current_setting('track_commit_timestamp') as on"))[0]?.on === "on"
  if (await on()) return true
  if (!embedded || server.restart === undefined) {
    log("track_commit_timestamp is off on this server: write times are the inserts' clock_timestamp() (a lower bound of the commit)")
    return false
  }
  await query("alter system set track_commit_timestamp = on")
  await server.restart()
  return on()
}

const measureClock = async (url: string, embedded: boolean): Promise<ClockAlignment> => {
  let best: { offset: number; rtt: number } | undefined
  await withClient(url, DRIVER_APPLICATION, async (client) => {
    for (let i = 0; i < OFFSET_SAMPLES; i++) {
      const before = Date.now()
      const { rows } = await client.query<{ now: string }>("select extract(epoch from clock_timestamp()) * 1000 as now")
      const after = Date.now()
      const sample = { offset: Number(rows[0]!.now) - (before + after) / 2, rtt: after - before }
      if (best === undefined || sample.rtt < best.rtt) best = sample
    }
  })
  const measured = best!
  return {
    measuredOffsetMs: measured.offset,
    uncertaintyMs: measured.rtt / 2 + 1,
    appliedOffsetMs: embedded ? 0 : measured.offset
  }
}

const readWrites = async (url: string, commitTimestamps: boolean): Promise<Array<WriteRow>> => {
  const rows = await makeQuery(url)<{
    seq: number
    round: number
    worker: number
    token: string
    acquisition: string
    written: string
    committed: string | null
    began_at: string
    began_n: string
    xid: string
  }>(
    `select seq::int as seq, round, worker, token::text as token, acquisition, began_at::text, began_n::text, xid::text,
       (extract(epoch from written_at) * 1000)::text as written,
       ${commitTimestamps ? "(extract(epoch from pg_xact_commit_timestamp(xmin)) * 1000)::text" : "null"} as committed
     from ${ROUNDS_TABLE} order by seq`
  )
  return rows.map((row) => ({
    seq: row.seq,
    round: row.round,
    worker: row.worker,
    token: BigInt(row.token),
    acquisition: row.acquisition,
    writtenAt: Number(row.written),
    committedAt: row.committed === null ? undefined : Number(row.committed),
    beganAt: Number(row.began_at),
    beganN: Number(row.began_n),
    xid: BigInt(row.xid)
  }))
}

/** A driver's client on the run's Redis (never a fault target: its name is not a worker's). */
const redisDriverClient = (url: string): Redis => {
  const client = new Redis(url, { lazyConnect: true, maxRetriesPerRequest: 3, connectionName: DRIVER_APPLICATION })
  // Without a listener a restart's dropped connection would crash the driver.
  client.on("error", () => {})
  return client
}

/**
 * Advisory locks in the database and unexpired lease rows (with `redis`: live leases of the lock
 * in Redis), once the server has ended the closed sessions' backends.
 */
const leftovers = async (url: string, redis?: { readonly client: Redis; readonly prefix: string }) => {
  const query = makeQuery(url)
  const redisLeases = async () =>
    redis === undefined ? 0 : (await Effect.runPromise(RedisLease.holders(redis.client, LOCK_NAME, { prefix: redis.prefix }))).length
  const count = async () => {
    const [advisory] = await query<{ n: number }>(
      `select count(*)::int as n from pg_locks where locktype = 'advisory'
       and database = (select oid from pg_database where datname = current_database())`
    )
    const [table] = await query<{ present: boolean }>("select to_regclass($1) is not null as present", [PgLease.DEFAULT_TABLE])
    // A shared holder's lease is its row in the queue table (token set), not the lease row.
    const [leases] = table?.present === true
      ? await query<{ n: number }>(
        `select (select count(*) from ${PgLease.DEFAULT_TABLE} where owner is not null and expires_at > now())::int
           + (select count(*) from ${PgLease.DEFAULT_TABLE}_queue where mode = 'shared' and token is not null and expires_at > now())::int as n`
      )
      : [{ n: 0 }]
    return { advisoryLocks: advisory?.n ?? 0, liveLeases: (leases?.n ?? 0) + await redisLeases() }
  }
  const deadline = Date.now() + SETTLE_TIMEOUT_MS
  for (;;) {
    const found = await count()
    if ((found.advisoryLocks === 0 && found.liveLeases === 0) || Date.now() >= deadline) return found
    await sleep(SETTLE_POLL_MS)
  }
}

const writeTrace = (file: string, events: ReadonlyArray<Stamped>, faults: ReadonlyArray<FaultRecord>, writes: ReadonlyArray<WriteRow>) => {
  const lines = [
    ...events.map((event) => ({ at: event.t, event })),
    ...faults.map((fault) => ({ at: fault.startedAt, fault })),
    ...writes.map((write) => ({ at: write.committedAt ?? write.writtenAt, write }))
  ].sort((a, b) => a.at - b.at)
  Fs.writeFileSync(file, lines.map((line) => JSON.stringify(line, (_, v) => (typeof v === "bigint" ? v.toString() : v))).join("\n") + "\n")
}

/** The second read of `broken: "shared-overlap"`'s lockless reader (worker 1), if not in yet. */
const waitForLocklessRead = async (fleet: Fleet): Promise<void> => {
  const secondRead = (event: Stamped) => event.e === "read" && event.which === 2 && event.w === 1
  if (!fleet.events.some(secondRead)) await fleet.waitFor(secondRead, FIRST_WRITE_TIMEOUT_MS)
}

/** Runs started by this process: names each run's database and log. */
let runs = 0

const runBackend = async (
  backend: Backend,
  options: ChaosOptions,
  server: Server & { readonly embedded: boolean },
  commitTimestamps: boolean,
  frozenPids: Set<number>,
  redisServer: RedisServer | undefined
): Promise<BackendRun> => {
  const { log } = options
  // Unique per run, not only per process: runs of one backend may go side by side on one server (the test suite's).
  const run = `${process.pid}_${++runs}`
  const database = `chaos_${backend.replace("-", "_")}_${run}`
  const admin = makeQuery(server.url)
  await admin(`drop database if exists ${database} with (force)`)
  await admin(`create database ${database}`)
  const url = databaseUrl(server.url, database)
  const query = makeQuery(url)
  await query(roundsTableSql)
  const clock = await measureClock(url, server.embedded)
  const logFile = Path.join(options.logDir, `chaos-${backend}-${options.seed}-${run}.log`)
  // The run's own key prefix: runs side by side (the test suite's) or a shared REDIS_URL never meet.
  const redis = backend === "redis" && redisServer !== undefined
    ? { server: redisServer, client: redisDriverClient(redisServer.url), prefix: `chaos-${run}:` }
    : undefined
  if (backend === "redis" && redis === undefined) throw new Error("the redis backend needs a Redis server")
  const fleet = makeFleet({
    workers: options.workers,
    logFile,
    config: {
      url,
      backend,
      redis: redis === undefined ? undefined : { url: redis.server.url, prefix: redis.prefix },
      ttlMs: options.ttlMs,
      poolSize: options.poolSize,
      seed: options.seed,
      broken: options.broken,
      sharedChance: options.sharedChance
    }
  })
  const faults: Array<FaultRecord> = []
  let stoppedAt = Date.now()
  let hungAtStop: ReadonlyArray<number> = []
  let startedAt = Date.now()
  try {
    log(`${backend}: starting ${options.workers} workers (log ${logFile})`)
    await fleet.startAll(READY_TIMEOUT_MS)
    const first = fleet.events.some((e) => e.e === "wrote") || (await fleet.waitFor((e) => e.e === "wrote", FIRST_WRITE_TIMEOUT_MS)) !== undefined
    if (!first) log(`${backend}: no write within ${FIRST_WRITE_TIMEOUT_MS} ms of the start; injecting faults anyway`)
    // A lockless reader's overlap shows only once its second read is in.
    if (options.broken === "shared-overlap") await waitForLocklessRead(fleet)
    startedAt = Date.now()
    const stamp = () => `+${((Date.now() - startedAt) / 1000).toFixed(1).padStart(5)}s`
    const phases = [{ seed: options.seed, durationMs: options.durationMs }, ...(options.extraSeeds ?? []).map((seed) => ({ seed, durationMs: 0 }))]
    for (const phase of phases) {
      const prng = makePrng(deriveSeed(phase.seed, backend))
      const ctx: FaultContext = {
        backend,
        ttlMs: options.ttlMs,
        workers: options.workers,
        prng,
        fleet,
        server,
        query,
        redis,
        frozenPids,
        readers: (options.sharedChance ?? 0) > 0,
        stallAbove: prng.chance(0.5)
      }
      const kinds = options.kinds ?? FAULT_KINDS
      const nextKind = makeDeck(prng, kinds)
      const phaseStart = Date.now()
      if (phases.length > 1) log(`${stamp()} ${backend}: faults from seed ${phase.seed}`)
      // At least one fault of every kind, however short the phase.
      for (let injected = 0; Date.now() - phaseStart < phase.durationMs || injected < kinds.length; injected++) {
        const kind = nextKind()
        const fault: FaultRecord = { ...(await inject(kind, ctx)), seed: phase.seed }
        faults.push(fault)
        if (fault.skipped !== undefined) {
          log(`${stamp()} ${backend}: ${kind} skipped: ${fault.skipped}`)
        } else {
          const recovered = fleet.events.find(wroteAfter(fleet.events, fault.endedAt)) ??
            (await fleet.waitFor(wroteAfter(fleet.events, fault.endedAt), fault.boundMs))
          const after = recovered === undefined ? `NO write within ${fault.boundMs} ms` : `next write after ${recovered.t - fault.endedAt} ms`
          log(`${stamp()} ${backend}: ${kind}: ${fault.detail}${fault.holder === undefined ? "" : ` [holder ${fault.holder.acq}]`}; ${after}`)
        }
        await sleep(prng.int(300, 1_000))
      }
    }
  } finally {
    stoppedAt = Date.now()
    hungAtStop = await fleet.stop(STOP_TIMEOUT_MS)
  }
  const left = await leftovers(url, redis).finally(() => redis?.client.disconnect())
  const writes = await readWrites(url, commitTimestamps)
  const result = check({
    writes,
    events: fleet.events,
    faults,
    leftovers: left,
    hungAtStop,
    exits: fleet.exits,
    serverOffsetMs: clock.appliedOffsetMs,
    stoppedAt
  })
  const traceFile = logFile.replace(/\.log$/, ".trace.jsonl")
  writeTrace(traceFile, fleet.events, faults, writes)
  await admin(`drop database if exists ${database} with (force)`)
  return { backend, startedAt, stoppedAt, faults, check: result, clock, logFile, traceFile }
}

/** Per run in progress, the server processes its `server-freeze` has stopped right now. */
const frozenByRun = new Set<Set<number>>()

const resume = (frozen: Set<number>): void => {
  for (const pid of frozen) {
    try {
      process.kill(pid, "SIGCONT")
    } catch {
      // already gone
    }
  }
  frozen.clear()
}

/**
 * Resumes every server process any run in progress stopped. Called on every way out of the
 * process, signals included: a stopped backend would block the server's shutdown.
 */
export const resumeFrozenServerProcesses = (): void => frozenByRun.forEach(resume)

/**
 * Runs every backend of `options` in turn on one server (started here unless DATABASE_URL is set);
 * with `redis`, also on a Redis (EFFECT_LOCK_REDIS_URL / REDIS_URL, else `redis-server` started
 * here with AOF fsync'ed at every write, so that `db-restart` keeps acknowledged leases as
 * PostgreSQL keeps its rows; a restart without persistence loses every lease by design).
 */
export const runChaos = async (options: ChaosOptions): Promise<ChaosRun> => {
  // Read before the workers start: the report is written minutes later, when HEAD may have moved.
  const library = gitRevision()
  const redisServer = options.backends.includes("redis") ? await startRedis({ aof: true }) : undefined
  const server = await startPostgres().catch(async (error) => {
    await redisServer?.stop()
    throw error
  })
  // This run's own: runs side by side (the test suite's) resume only what they stopped.
  const frozen = new Set<number>()
  frozenByRun.add(frozen)
  process.once("exit", resumeFrozenServerProcesses)
  try {
    const commitTimestamps = await enableCommitTimestamps(server, server.embedded, options.log)
    const [version] = await makeQuery(server.url)<{ v: string }>("select current_setting('server_version') as v")
    const runs: Array<BackendRun> = []
    for (const backend of options.backends) {
      runs.push(await runBackend(backend, options, server, commitTimestamps, frozen, redisServer))
    }
    const redisVersion = redisServer === undefined ? undefined : await redisInfoVersion(redisServer.url)
    const { log: _log, ...rest } = options
    return {
      seed: options.seed,
      library,
      options: rest,
      server: { embedded: server.embedded, version: version?.v ?? "unknown", commitTimestamps },
      redis: redisServer === undefined ? undefined : { embedded: redisServer.embedded, version: redisVersion ?? "unknown" },
      runs,
      violations: runs.reduce((n, run) => n + run.check.violations.length, 0)
    }
  } finally {
    resume(frozen)
    frozenByRun.delete(frozen)
    process.removeListener("exit", resumeFrozenServerProcesses)
    await server.stop().finally(() => redisServer?.stop())
  }
}

/** `redis_version` from INFO server. */
const redisInfoVersion = async (url: string): Promise<string | undefined> => {
  const client = redisDriverClient(url)
  try {
    return /redis_version:(\S+)/.exec(await client.info("server"))?.[1]
  } catch {
    return undefined
  } finally {
    client.disconnect()
  }
}

/** Defaults of `npm run chaos`. */
export const DEFAULTS = {
  minutes: 2,
  workers: 4,
  ttlMs: 2_000,
  poolSize: 4,
  logDir: Os.tmpdir()
} as const

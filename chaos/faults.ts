/**
 * The faults a chaos run injects, one at a time, each with the bound within which the cluster
 * must have recovered (a new accepted write) after the fault ended.
 */
import { PLACE_TTL_MILLIS } from "effect-lock/internal/lease/place"
import * as PgAdvisory from "effect-lock/PgAdvisory"
import type { Redis } from "ioredis"
import * as Fs from "node:fs"
import type { Server } from "../tools/embeddedPostgres.js"
import type { RedisServer } from "../tools/redisServer.js"
import type { Fleet, Holder } from "./fleet.js"
import type { Prng } from "./prng.js"
import { appName, type Backend, LOCK_NAME, lockName, longestRoundMs } from "./protocol.js"

export const FAULT_KINDS = [
  "worker-kill",
  "worker-freeze",
  "worker-stall",
  "session-terminate",
  "server-freeze",
  "db-restart",
  "pool-saturation"
] as const
export type FaultKind = typeof FAULT_KINDS[number]

/** Slack for a worker's error backoff, reconnecting after a restart, and a loaded 2-core machine. */
export const RECOVERY_SLACK_MS = 3_000

/**
 * How long after a fault ended a new write must have been accepted: what the library promises,
 * plus the longest round of whoever takes the lock first (it writes at the end of its round),
 * plus slack. A lease (PgLease) held by a process that died or froze is taken over once it
 * expires: at most one ttl after the holder's last renewal, which is at most one ttl before the
 * fault ended. A session advisory lock (PgAdvisory) goes when its session does — at once for a
 * killed process or a terminated or restarted backend — and a frozen advisory holder keeps it
 * until it is resumed, by design (README "Not a lease"), so the bound counts from the resume.
 * A Redis lease (RedisLease) is a lease as PgLease's: taken over at most one ttl after. A killed
 * process that was waiting on a lease store leaves its place in the queue, which those behind it
 * may not overtake until it runs out: at most `PLACE_TTL_MILLIS` (5 s) after its last retry.
 * With `readers` one more longest round: whoever takes the lock first may be a reader, whose round
 * writes nothing, and the writer waiting behind it (shared requests queue behind a waiting
 * exclusive one) writes at the end of its own.
 */
export const recoveryBoundMs = (kind: FaultKind, backend: Backend, ttlMs: number, readers = false): number =>
  Math.max(backend === "pg-advisory" ? 0 : ttlMs, kind === "worker-kill" && backend !== "pg-advisory" ? PLACE_TTL_MILLIS : 0) +
  longestRoundMs(ttlMs) * (readers ? 2 : 1) + RECOVERY_SLACK_MS

/**
 * What each fault does, for the report. On `redis` the lock's server is Redis: `session-terminate`,
 * `server-freeze` and `db-restart` act on it (the PostgreSQL of the write log is left alone);
 * `pool-saturation` still fills the worker's PostgreSQL pool, which its fenced writes use.
 */
export const FAULT_DESCRIPTIONS: Readonly<Record<FaultKind, string>> = {
  "worker-kill": "SIGKILL of a worker, restarted at once",
  "worker-freeze": "SIGSTOP of a worker for 0.3–2.5 × ttl, then SIGCONT",
  "worker-stall": "the worker's event loop busy for 0.15–0.3 × ttl (below the lease's safe time) or 1.2–2 × ttl (above it), alternating",
  "session-terminate": "pg_terminate_backend of the worker's lock sessions (PgAdvisory's own sessions; PgLease's: its pool, LISTEN included); redis: CLIENT KILL ID of each of the worker's RedisLease connections (lock commands, renewals, subscriber)",
  "server-freeze": "SIGSTOP of server processes for 1–3 × ttl: the backend holding the advisory lock (PgAdvisory), every backend of the holder's pool (PgLease), redis-server itself (redis)",
  "db-restart": "fast shutdown of the server (every session terminated), down 0.3–2 s, started again on the same port and data; redis: SIGTERM of redis-server (AOF, appendfsync always), down 0.3–2 s, started again on the same port and AOF",
  "pool-saturation": "every connection of the worker's own pool busy in pg_sleep for 3 × ttl"
}

/** Why each fault's recovery starts when it does, per backend: the library's part of the bound. */
export const RECOVERY_REASONS: Readonly<Record<FaultKind, Readonly<Record<Backend, string>>>> = {
  "worker-kill": {
    "pg-advisory": "the kernel closes the dead process's sockets; the server drops its locks at once",
    "pg-lease": "the dead holder's row expires at most one ttl after its last renewal; a dead waiter's place at most 5 s after its last retry",
    "redis": "the dead holder's keys expire at most one ttl after its last renewal; a dead waiter's place at most 5 s after its last retry"
  },
  "worker-freeze": {
    "pg-advisory": "a frozen client keeps its lock while its connection lives (\"Not a lease\"): counted from the resume",
    "pg-lease": "the frozen holder's row expires within one ttl; after the resume it must stop at once",
    "redis": "the frozen holder's lease expires within one ttl (Redis's clock); after the resume it must stop at once"
  },
  "worker-stall": {
    "pg-advisory": "the stalled process keeps its lock and goes on after the stall",
    "pg-lease": "below the safe time the holder goes on; above it the row expires within one ttl",
    "redis": "below the safe time the holder goes on; above it the lease expires within one ttl"
  },
  "session-terminate": {
    "pg-advisory": "the terminated session's locks are dropped by the server at once",
    "pg-lease": "the lease lives in a row: the pool reconnects and the holder goes on",
    "redis": "the lease lives in keys: the connections reconnect and the holder goes on"
  },
  "server-freeze": {
    "pg-advisory": "the frozen backend keeps the lock at the server until it is resumed; then it ends or goes on",
    "pg-lease": "statements on the frozen backends hang until the resume; the row may expire within one ttl",
    "redis": "every command hangs until the resume or its bound; the holder gives up before its lease can run out, which it may meanwhile"
  },
  "db-restart": {
    "pg-advisory": "every session died with the server: locks are free once it is up",
    "pg-lease": "rows survive the restart; a lease not renewed meanwhile expires within one ttl",
    "redis": "the AOF brings back every acknowledged lease; one not renewed meanwhile expires within one ttl"
  },
  "pool-saturation": {
    "pg-advisory": "lock sessions are not in the app's pool: the holder waits for a connection for its write (up to 5 s), others for the lock",
    "pg-lease": "renewals must not queue behind the app's statements; the holder's write waits for a connection (up to 5 s)",
    "redis": "the lock is not in the app's PostgreSQL pool: renewals go on; the holder's write waits for a connection (up to 5 s)"
  }
}

/** One injected fault, as the checker and the report see it. Times are `Date.now()` of the driver. */
export interface FaultRecord {
  readonly kind: FaultKind
  /** The worker slot hit, if the fault targets one. */
  readonly target?: number | undefined
  /** The acquisition holding the lock in the targeted worker when the fault began, if any. */
  readonly holder?: Holder | undefined
  readonly detail: string
  readonly startedAt: number
  /** When the fault stopped acting (SIGCONT sent, stall over, server up again, …). */
  readonly endedAt: number
  /** Recovery (a new accepted write) is due within this many ms of `endedAt`. */
  readonly boundMs: number
  /** Why the fault could not be injected (e.g. no restart on an external server). */
  readonly skipped?: string | undefined
  /** The library promises that this fault costs the holder nothing: a loss it reports is a violation. */
  readonly costsNoLock: boolean
  /** The seed of the phase that drew it (`--seed` replays that sequence). */
  readonly seed?: number | undefined
}

export interface FaultContext {
  readonly backend: Backend
  readonly ttlMs: number
  readonly workers: number
  readonly prng: Prng
  readonly fleet: Fleet
  /** The server; `restart` only for an embedded one. */
  readonly server: Server
  /** `redis` only: the lock's server (`restart` and `pid` only for one the run started) and a driver's client on it. */
  readonly redis?: { readonly server: RedisServer; readonly client: Redis } | undefined
  /** A statement on the run's database, as the driver (never a fault target). */
  readonly query: <R>(text: string, values?: ReadonlyArray<unknown>) => Promise<Array<R>>
  /** Server processes stopped right now: the driver resumes them on every way out. */
  readonly frozenPids: Set<number>
  /** Some rounds are readers' (`sharedChance` > 0): the recovery bound allows one reader's round first. */
  readonly readers: boolean
  /** Alternates the stall between below and above the lease's safe time. */
  stallAbove: boolean
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms))

/** Longest wait for a fresh grant to aim a fault at; with nobody granted by then, any worker is hit. */
const AIM_TIMEOUT_MS = 3_000
/** A fault aimed at a holder lands this far (at random) into its round: before, in or after the read-to-write gap. */
const AIM_DELAY_MAX_MS = 350

/**
 * The worker to hit: 4 times in 5 the next worker granted the lock, a random 0–350 ms into its
 * round (a round reads, waits its gap and writes in about that time), else any worker. The next
 * grant may be a reader's (a shared holder, maybe one of several): a fault must not cost it its
 * lock any more than a writer's, so it is aimed at as any holder.
 */
const pickTarget = async (ctx: FaultContext): Promise<{ readonly target: number; readonly holder: Holder | undefined }> => {
  // Every draw is made every time, so the PRNG stream does not depend on who holds the lock.
  const preferHolder = ctx.prng.chance(0.8)
  const anySlot = ctx.prng.int(1, ctx.workers)
  const delay = ctx.prng.int(0, AIM_DELAY_MAX_MS)
  if (preferHolder) {
    const granted = await ctx.fleet.waitFor((e) => e.e === "acquired", AIM_TIMEOUT_MS)
    if (granted?.e === "acquired") {
      await sleep(delay)
      return { target: granted.w, holder: { slot: granted.w, incarnation: granted.i, acq: granted.acq, token: BigInt(granted.token) } }
    }
  }
  const holder = ctx.fleet.holder()
  return { target: anySlot, holder: holder?.slot === anySlot ? holder : undefined }
}

const isLocalPostgres = (pid: number): boolean => {
  try {
    return Fs.readFileSync(`/proc/${pid}/comm`, "utf8").trim().startsWith("postgres")
  } catch {
    return false
  }
}

/** The server process holding the chaos lock as a session advisory lock, if any. */
const advisoryHolderPid = async (ctx: FaultContext): Promise<number | undefined> => {
  const key = PgAdvisory.keyOf(LOCK_NAME)
  const classid = Number((key >> 32n) & 0xffff_ffffn)
  const objid = Number(key & 0xffff_ffffn)
  const rows = await ctx.query<{ pid: number }>(
    `select pid from pg_locks
     where locktype = 'advisory' and granted and objsubid = 1 and classid = $1::oid and objid = $2::oid
       and database = (select oid from pg_database where datname = current_database())`,
    [classid, objid]
  )
  return rows[0]?.pid
}

const backendsOf = (ctx: FaultContext, applicationName: string) =>
  ctx.query<{ pid: number }>(
    "select pid from pg_stat_activity where datname = current_database() and application_name = $1",
    [applicationName]
  ).then((rows) => rows.map((row) => row.pid))

/** A targeted pool without server processes (just terminated) is looked up again this often. */
const SERVER_FREEZE_RETRIES = 10
const SERVER_FREEZE_RETRY_MS = 200

type Injected = Omit<FaultRecord, "kind" | "boundMs" | "costsNoLock"> & { readonly stall?: "below" | "above" }

/**
 * Faults after which the holder must still hold its lock, as DESIGN.md and issue 10 promise:
 * renewals never queue behind the app's own pool, so saturating it costs nothing; an event-loop
 * stall below a lease's safe time costs nothing, and none costs a session advisory lock whose
 * session is alive (its answers are read late, not lost); a frozen advisory client keeps its
 * lock ("Not a lease"); a lease lives in a row (PgLease) or in keys (RedisLease), not in the
 * connections that were terminated or killed.
 */
export const costsNoLock = (kind: FaultKind, backend: Backend, stall: "below" | "above" | undefined): boolean => {
  switch (kind) {
    case "pool-saturation":
      return true
    case "worker-stall":
      return backend === "pg-advisory" || stall === "below"
    case "worker-freeze":
      return backend === "pg-advisory"
    case "session-terminate":
      return backend !== "pg-advisory"
    default:
      return false
  }
}

/** The ids of the Redis connections of a worker's RedisLease layer (named `<lockName>:<role>`). */
const redisConnectionsOf = async (client: Redis, slot: number): Promise<Array<string>> => {
  const list = (await client.call("client", "list")) as string
  return list.split("\n").flatMap((line) => {
    const id = /(?:^| )id=(\d+)/.exec(line)?.[1]
    const name = /(?:^| )name=(\S*)/.exec(line)?.[1] ?? ""
    return id !== undefined && name.startsWith(`${lockName(slot)}:`) ? [id] : []
  })
}

/**
 * `session-terminate` on Redis: CLIENT KILL of every connection of the target's layer, by id
 * (`CLIENT KILL TYPE normal` would hit every worker and the driver too).
 */
const redisClientKill = async (ctx: FaultContext, client: Redis): Promise<Injected> => {
  const { target, holder } = await pickTarget(ctx)
  const startedAt = Date.now()
  const ids = await redisConnectionsOf(client, target)
  let killed = 0
  for (const id of ids) {
    // A connection that closed since the listing answers "No such client": nothing to kill.
    killed += Number(await client.call("client", "kill", "id", id).catch(() => 0))
  }
  return { target, holder, detail: `CLIENT KILL of ${killed} connection(s) of ${lockName(target)}`, startedAt, endedAt: Date.now() }
}

const injectors: Readonly<Record<FaultKind, (ctx: FaultContext) => Promise<Injected>>> = {
  "worker-kill": async (ctx) => {
    const { target, holder } = await pickTarget(ctx)
    const startedAt = Date.now()
    await ctx.fleet.kill(target)
    return { target, holder, detail: `SIGKILL w${target}`, startedAt, endedAt: startedAt }
  },

  "worker-freeze": async (ctx) => {
    const ms = ctx.prng.int(Math.round(0.3 * ctx.ttlMs), Math.round(2.5 * ctx.ttlMs))
    const { target, holder } = await pickTarget(ctx)
    const startedAt = Date.now()
    ctx.fleet.signal(target, "SIGSTOP")
    try {
      await sleep(ms)
    } finally {
      ctx.fleet.signal(target, "SIGCONT")
    }
    return { target, holder, detail: `SIGSTOP w${target} for ${ms} ms`, startedAt, endedAt: Date.now() }
  },

  "worker-stall": async (ctx) => {
    const above = ctx.stallAbove
    ctx.stallAbove = !above
    const ms = above
      ? ctx.prng.int(Math.round(1.2 * ctx.ttlMs), 2 * ctx.ttlMs)
      : ctx.prng.int(Math.round(0.15 * ctx.ttlMs), Math.round(0.3 * ctx.ttlMs))
    const { target, holder } = await pickTarget(ctx)
    const startedAt = Date.now()
    const ended = ctx.fleet.waitFor((e) => e.w === target && e.e === "stall-end", ms + RECOVERY_SLACK_MS)
    ctx.fleet.send(target, { c: "stall", ms })
    const end = await ended
    return {
      target,
      holder,
      stall: above ? "above" : "below",
      detail: `event loop of w${target} blocked ${ms} ms (${above ? "above" : "below"} the safe time)${end === undefined ? "; no stall-end seen" : ""}`,
      startedAt,
      endedAt: end?.t ?? Date.now()
    }
  },

  "session-terminate": async (ctx) => {
    if (ctx.redis !== undefined) return redisClientKill(ctx, ctx.redis.client)
    const { target, holder } = await pickTarget(ctx)
    const name = ctx.backend === "pg-advisory" ? lockName(target) : appName(target)
    const startedAt = Date.now()
    const rows = await ctx.query<{ n: number }>(
      `select count(pg_terminate_backend(pid))::int as n from pg_stat_activity
       where datname = current_database() and application_name = $1`,
      [name]
    )
    return { target, holder, detail: `terminated ${rows[0]?.n ?? 0} session(s) of ${name}`, startedAt, endedAt: Date.now() }
  },

  "server-freeze": async (ctx) => {
    const ms = ctx.prng.int(ctx.ttlMs, 3 * ctx.ttlMs)
    const { target, holder } = await pickTarget(ctx)
    let pids: Array<number>
    let what: string
    if (ctx.redis !== undefined) {
      const pid = ctx.redis.server.pid()
      if (pid === undefined) {
        const now = Date.now()
        return { target, holder, detail: "skipped", startedAt: now, endedAt: now, skipped: "REDIS_URL is set: the run does not stop a server it did not start" }
      }
      pids = [pid]
      what = "redis-server"
    } else if (ctx.backend === "pg-advisory") {
      const pid = await advisoryHolderPid(ctx)
      pids = pid !== undefined ? [pid] : (await backendsOf(ctx, lockName(target))).slice(0, 1)
      what = pid !== undefined ? "the backend holding the lock" : `a lock session of w${target} (nobody held the lock)`
    } else {
      pids = await backendsOf(ctx, appName(target))
      what = `every backend of w${target}'s pool`
      // A pool whose sessions were just terminated reconnects on its next statement: wait for it.
      for (let retry = 0; pids.length === 0 && retry < SERVER_FREEZE_RETRIES; retry++) {
        await sleep(SERVER_FREEZE_RETRY_MS)
        pids = await backendsOf(ctx, appName(target))
      }
    }
    if (ctx.redis === undefined) pids = pids.filter(isLocalPostgres)
    if (pids.length === 0) {
      const now = Date.now()
      return { target, holder, detail: "no local server process found", startedAt: now, endedAt: now, skipped: "no local server process to stop" }
    }
    const startedAt = Date.now()
    // A backend may end between the listing and the signal, or while stopped (the server's
    // postmaster kills its children when one of them crashes): such a pid is reported, not fatal.
    let gone = 0
    const signal = (pid: number, name: "SIGSTOP" | "SIGCONT"): boolean => {
      try {
        process.kill(pid, name)
        return true
      } catch (error) {
        if ((error as { code?: unknown }).code !== "ESRCH") throw error
        gone++
        return false
      }
    }
    const stopped: Array<number> = []
    for (const pid of pids) {
      // Recorded before the signal, so that any way out of the run resumes it.
      ctx.frozenPids.add(pid)
      if (signal(pid, "SIGSTOP")) stopped.push(pid)
      else ctx.frozenPids.delete(pid)
    }
    try {
      await sleep(ms)
    } finally {
      for (const pid of stopped) {
        signal(pid, "SIGCONT")
        ctx.frozenPids.delete(pid)
      }
    }
    const holderPid = ctx.backend === "pg-lease" ? ` (${pids.length} pids)` : ` (pid ${pids.join(", ")})`
    const vanished = gone === 0 ? "" : `; ${gone} of them ended before SIGCONT`
    return { target, holder, detail: `SIGSTOP ${what}${holderPid} for ${ms} ms${vanished}`, startedAt, endedAt: Date.now() }
  },

  "db-restart": async (ctx) => {
    const downMillis = ctx.prng.int(300, 2_000)
    const { holder } = await pickTarget(ctx)
    const startedAt = Date.now()
    // On redis the lock's server is restarted, not the write log's.
    const restart = ctx.redis !== undefined ? ctx.redis.server.restart : ctx.server.restart
    if (restart === undefined) {
      const which = ctx.redis !== undefined ? "REDIS_URL is set" : "DATABASE_URL is set"
      return { holder, detail: "skipped", startedAt, endedAt: startedAt, skipped: `${which}: the run does not restart a server it did not start` }
    }
    await restart({ downMillis })
    return { holder, detail: `restart, down ${downMillis} ms`, startedAt, endedAt: Date.now() }
  },

  "pool-saturation": async (ctx) => {
    const ms = 3 * ctx.ttlMs
    const { target, holder } = await pickTarget(ctx)
    const startedAt = Date.now()
    const ended = ctx.fleet.waitFor((e) => e.w === target && e.e === "saturate-end", ms + 3 * RECOVERY_SLACK_MS)
    ctx.fleet.send(target, { c: "saturate", ms })
    const end = await ended
    const failed = end?.e === "saturate-end" ? end.failed : undefined
    return {
      target,
      holder,
      detail: `w${target}'s pool busy in pg_sleep for ${ms} ms${
        end === undefined ? "; no saturate-end seen" : failed !== undefined && failed > 0 ? `; ${failed} sleep(s) failed` : ""
      }`,
      startedAt,
      endedAt: end?.t ?? Date.now()
    }
  }
}

/** Injects one fault and returns once it stopped acting. */
export const inject = async (kind: FaultKind, ctx: FaultContext): Promise<FaultRecord> => {
  const { stall, ...injected } = await injectors[kind](ctx)
  return { kind, boundMs: recoveryBoundMs(kind, ctx.backend, ctx.ttlMs, ctx.readers), costsNoLock: costsNoLock(kind, ctx.backend, stall), ...injected }
}

/** The kinds in a seeded order where each appears once per deck, so a short run still has every kind. */
export const makeDeck = (prng: Prng, kinds: ReadonlyArray<FaultKind> = FAULT_KINDS): (() => FaultKind) => {
  let deck: Array<FaultKind> = []
  return () => {
    if (deck.length === 0) deck = prng.shuffle(kinds)
    return deck.shift()!
  }
}

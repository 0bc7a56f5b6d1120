/**
 * `npm run demo`: three worker processes compete for one lock; each round ends in a fenced
 * write. Midway the holder's database sessions are killed (with `--backend redis`: its Redis
 * connections, by CLIENT KILL; with `--backend sqlite`, which has no sessions: the holder process
 * is killed with SIGKILL, as a crash, and restarted); later the
 * holder is frozen (SIGSTOP) past its lease and resumed. The timeline shows who holds the lock and
 * with which token, the takeovers, and the stale write the fence rejects; the summary checks every
 * guarantee held, and the timeline is drawn as an SVG (its path is printed last).
 *
 *   npm run demo [-- --backend lease|advisory|sqlite|redis] [--seconds 30] [--svg path/to/timeline.svg]
 *
 * `lease` and `advisory` run on PostgreSQL (DATABASE_URL, else an embedded server); `sqlite` on a
 * database file in a fresh temp directory, removed afterwards; `redis` locks on Redis
 * (EFFECT_LOCK_REDIS_URL or REDIS_URL, else `redis-server` from the PATH on a free port, stopped
 * afterwards) and writes its fenced rounds to PostgreSQL, as an application would.
 */
import { type ChildProcess, spawn } from "node:child_process"
import Database from "better-sqlite3"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import * as Readline from "node:readline"
import { fileURLToPath } from "node:url"
import { Effect } from "effect"
import { RedisLease } from "effect-lock"
import { Redis } from "ioredis"
import pg from "pg"
import { redactUrl, startPostgres, withClient } from "../tools/embeddedPostgres.js"
import { redactRedisUrl, redisAvailable, INSTALL_HINT, type RedisServer, startRedis } from "../tools/redisServer.js"
import { applicationName, FENCE_RESOURCE, LOCK_NAME, type Stamped } from "./events.js"
import { emptyTimeline, openHold, renderTimeline } from "./timeline.js"
import { nodeArgsFor } from "../tools/children.js"

const argument = (flag: string, fallback: string) => {
  const index = process.argv.indexOf(flag)
  return index >= 0 && process.argv[index + 1] !== undefined ? process.argv[index + 1]! : fallback
}
const backend = argument("--backend", "lease")
const seconds = Number(argument("--seconds", "30"))
if (backend !== "lease" && backend !== "advisory" && backend !== "sqlite" && backend !== "redis") {
  throw new Error(`--backend is lease, advisory, sqlite or redis, not ${backend}`)
}
if (!(seconds >= 8)) throw new Error("--seconds must be at least 8")
// A git-ignored folder of the repository unless told otherwise: the picture is never committed.
const svgPath = Path.resolve(argument("--svg", fileURLToPath(new URL(`../.tmp/demo/timeline-${backend}.svg`, import.meta.url))))

const WORKERS = 3
/** How long after its sessions were killed a worker's failed round is put down to the kill. */
const KILL_AFTERMATH_MS = 3000
const TTL_MS = 2000
const WORK_MS = 400
/** How long a round's write is in flight: the freeze hits a holder in that window. */
const SEND_MS = 300
/** A round takes about WORK_MS + SEND_MS; a disruption gives up when no grant or write came for this long. */
const EVENT_WITHIN_MS = 15_000
const FREEZE_MS = 2 * TTL_MS

const started = Date.now()
const stamp = (t: number) => `+${((t - started) / 1000).toFixed(2).padStart(6)}s`
const say = (line: string) => console.log(`${stamp(Date.now())}  ${line}`)

const query = <R extends pg.QueryResultRow>(url: string, text: string, values: Array<unknown> = []) =>
  withClient(url, "effect-lock-demo", async (client) => (await client.query<R>(text, values)).rows)

interface Holder {
  readonly worker: number
  readonly token: bigint
  readonly since: number
}

/** Where the workers' lock and rounds live, and what the summary reads from it. */
interface Store {
  /** The first lines of the report. */
  readonly banner: string
  /** The workers' environment for reaching it. */
  readonly env: Readonly<Record<string, string>>
  readonly rounds: () => Promise<ReadonlyArray<{ readonly round: number; readonly copies: number }>>
  readonly highestToken: () => Promise<string | null>
  /** Locks still held once the workers stopped (advisory locks, live leases). */
  readonly locksLeft: () => Promise<number>
  readonly close: () => Promise<void>
}

const postgresStore = async (): Promise<Store & { readonly url: string }> => {
  const server = await startPostgres()
  const database = `effect_lock_demo_${process.pid}`
  const adminUrl = server.url
  const url = (() => {
    const parsed = new URL(adminUrl)
    parsed.pathname = `/${database}`
    return parsed.toString()
  })()
  const close = async () => {
    await query(adminUrl, `drop database if exists ${database} with (force)`).catch(() => {})
    await server.stop()
  }
  try {
    await query(adminUrl, `create database ${database}`)
    await query(url, `create table demo_rounds (round int not null, worker int not null, token bigint not null,
      at timestamptz not null default clock_timestamp())`)
  } catch (error) {
    await close()
    throw error
  }
  return {
    url,
    banner: `PostgreSQL: ${server.embedded ? "embedded" : "DATABASE_URL"} ${redactUrl(adminUrl)}`,
    env: { DEMO_URL: url },
    rounds: () => query<{ round: number; copies: number }>(url, "select round, count(*)::int as copies from demo_rounds group by round order by round"),
    highestToken: async () => (await query<{ token: string | null }>(url, "select max(token)::text as token from demo_rounds"))[0]?.token ?? null,
    locksLeft: async () => {
      const advisory = await query<{ n: number }>(
        url,
        "select count(*)::int as n from pg_locks where locktype = 'advisory' and database = (select oid from pg_database where datname = current_database())"
      )
      const leases = backend === "lease"
        ? await query<{ n: number }>(url, "select count(*)::int as n from effect_lock_leases where owner is not null and expires_at > now()")
        : [{ n: 0 }]
      return advisory[0]!.n + leases[0]!.n
    },
    close
  }
}

/** The demo's own key prefix: a shared Redis (REDIS_URL) may hold other locks of the same name. */
const REDIS_PREFIX = `effect-lock-demo-${process.pid}:`

/** A raw ioredis client of the orchestrator (never a disruption's target), connected on first use. */
const redisClient = (url: string) => {
  const client = new Redis(url, { lazyConnect: true, maxRetriesPerRequest: 1, connectionName: "effect-lock-demo-driver" })
  // Without a listener a dropped connection's 'error' would crash the orchestrator.
  client.on("error", () => {})
  return client
}

/** The Redis connections of one worker's layer (named `<applicationName>:<role>`), by id. */
const redisConnectionsOf = async (client: Redis, worker: number): Promise<Array<string>> => {
  const list = (await client.call("client", "list")) as string
  return list.split("\n").flatMap((line) => {
    const id = /(?:^| )id=(\d+)/.exec(line)?.[1]
    const name = /(?:^| )name=(\S*)/.exec(line)?.[1] ?? ""
    return id !== undefined && name.startsWith(`${applicationName(worker)}:`) ? [id] : []
  })
}

/** Locks on PostgreSQL (the rounds), the lock on Redis. */
const redisStore = async (): Promise<Store & { readonly url: string; readonly redis: RedisServer; readonly client: Redis }> => {
  // Before PostgreSQL is started: without a Redis there is nothing to show.
  if (!redisAvailable()) throw new Error(INSTALL_HINT)
  const redis = await startRedis()
  const client = redisClient(redis.url)
  let base: Store & { readonly url: string }
  try {
    base = await postgresStore()
  } catch (error) {
    client.disconnect()
    await redis.stop()
    throw error
  }
  return {
    ...base,
    redis,
    client,
    banner: `Redis: ${redis.embedded ? "redis-server" : "EFFECT_LOCK_REDIS_URL/REDIS_URL"} ${redactRedisUrl(redis.url)} (the lock)\n${base.banner} (the fenced rounds)`,
    env: { ...base.env, DEMO_REDIS_URL: redis.url, DEMO_REDIS_PREFIX: REDIS_PREFIX },
    locksLeft: async () =>
      (await Effect.runPromise(RedisLease.holders(client, LOCK_NAME, { prefix: REDIS_PREFIX }))).length,
    close: async () => {
      client.disconnect()
      await base.close().finally(() => redis.stop())
    }
  }
}

const sqliteStore = (): Store => {
  const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-demo-"))
  const filename = Path.join(dir, "demo.db")
  const db = new Database(filename)
  db.pragma("journal_mode = WAL")
  db.exec(`create table demo_rounds (round integer not null, worker integer not null, token integer not null,
    at integer not null default (cast(unixepoch('subsec') * 1000 as integer)))`)
  return {
    banner: `SQLite: ${filename}`,
    env: { DEMO_FILE: filename },
    rounds: async () => db.prepare("select round, count(*) as copies from demo_rounds group by round order by round").all() as Array<{ round: number; copies: number }>,
    highestToken: async () => (db.prepare("select cast(max(token) as text) as token from demo_rounds").get() as { token: string | null }).token,
    locksLeft: async () => {
      const present = db.prepare("select 1 from sqlite_schema where type = 'table' and name = 'effect_lock_leases'").get()
      if (present === undefined) return 0
      const now = "cast(round(unixepoch('subsec') * 1000) as integer)"
      return (db.prepare(
        `select (select count(*) from effect_lock_leases where owner is not null and expires_at > ${now})
          + (select count(*) from effect_lock_leases_queue where token is not null and expires_at > ${now}) as n`
      ).get() as { n: number }).n
    },
    close: async () => {
      db.close()
      Fs.rmSync(dir, { recursive: true, force: true })
    }
  }
}

const main = async () => {
  const redisStoreOf = backend === "redis" ? await redisStore() : undefined
  const pgStore = backend === "sqlite" ? undefined : redisStoreOf ?? await postgresStore()
  const store: Store = pgStore ?? sqliteStore()
  const children: Array<ChildProcess> = []
  let failure: string | undefined
  try {
    console.log(`effect-lock demo — backend ${backend}, ${WORKERS} worker processes, lease ttl ${TTL_MS} ms`)
    console.log(`${store.banner}\n`)

    let holder: Holder | undefined
    const takeovers: Array<{ readonly cause: string; readonly ms: number }> = []
    let pendingDisruption: { readonly cause: string; readonly at: number; readonly from: number } | undefined
    let staleRejected = 0
    let writes = 0
    const lostBy: Array<string> = []
    const lostTokens = new Set<string>()
    let errors = 0
    /** The last session kill: a round of that worker failing right after it is the kill's doing, not an error. */
    let lastKill: { readonly worker: number; readonly at: number } | undefined
    let ready = 0
    const timeline = emptyTimeline(backend, WORKERS, TTL_MS, Date.now())
    /** Told of the next grant or write, when a disruption waits for one to aim at. */
    const waiting = new Map<"acquired" | "writing", (worker: number, token: string) => void>()
    const tell = (kind: "acquired" | "writing", worker: number, token: string) => {
      const resolve = waiting.get(kind)
      waiting.delete(kind)
      resolve?.(worker, token)
    }

    const onEvent = (event: Stamped) => {
      const who = `worker ${event.w}`
      switch (event.e) {
        case "ready":
          // The picture starts when the first worker is up.
          if (ready++ === 0) timeline.start = event.t
          return
        case "writing":
          tell("writing", event.w, event.token)
          return
        case "acquired": {
          holder = { worker: event.w, token: BigInt(event.token), since: event.t }
          timeline.holds.push({ worker: event.w, token: event.token, start: event.t })
          if (pendingDisruption !== undefined && event.w !== pendingDisruption.from) {
            const ms = event.t - pendingDisruption.at
            takeovers.push({ cause: pendingDisruption.cause, ms })
            timeline.takeovers.push({ worker: event.w, at: event.t, cause: pendingDisruption.cause, ms })
            say(`${who} TAKES OVER with token ${event.token}, ${ms} ms after the ${pendingDisruption.cause}`)
            pendingDisruption = undefined
          } else {
            say(`${who} holds the lock, token ${event.token}`)
          }
          tell("acquired", event.w, event.token)
          return
        }
        case "wrote":
          writes++
          timeline.writes.push({ worker: event.w, at: event.t, round: event.round })
          return say(`${who}   round ${event.round} written with token ${event.token}`)
        case "released": {
          if (holder?.worker === event.w && holder.token === BigInt(event.token)) holder = undefined
          const hold = openHold(timeline, event.w, event.token)
          if (hold !== undefined) hold.end = event.t
          if (pendingDisruption?.from === event.w && !lostTokens.has(event.token)) {
            say(
              pendingDisruption.cause === "freeze"
                ? `${who} kept its lock through the freeze: a session advisory lock does not expire, the others waited`
                : backend === "advisory"
                ? `${who} released before the kill reached its sessions` // the kill is aimed at a fresh grant; this says when it missed
                : backend === "redis"
                ? `${who} finished its round through the connection kill: the lease lives in Redis keys, its connections reconnected`
                : `${who} finished its round through the session kill: a lease does not live in a session`
            )
            pendingDisruption = undefined
          }
          return
        }
        case "lost": {
          lostBy.push(event.reason)
          lostTokens.add(event.token)
          const hold = openHold(timeline, event.w, event.token)
          if (hold !== undefined) {
            hold.end = event.t
            hold.lost = event.reason
          }
          return say(`${who} LOST its lock (token ${event.token}): ${event.reason}`)
        }
        case "stale-rejected":
          staleRejected++
          timeline.refused.push({ worker: event.w, at: event.t, token: event.token, current: event.current })
          return say(
            `${who} woke up and tried to write with token ${event.token}: REJECTED by the fence (current ${event.current})`
          )
        case "error":
          if (lastKill?.worker === event.w && event.t >= lastKill.at && event.t - lastKill.at < KILL_AFTERMATH_MS) {
            return say(`${who}'s round failed with its killed sessions: ${event.message.split("\n")[0]}`)
          }
          errors++
          return say(`${who} error: ${event.message}`)
      }
    }

    const spawnWorker = (worker: number) => {
      const child = spawn(process.execPath, [...nodeArgsFor(fileURLToPath(new URL("./worker.ts", import.meta.url)))], {
        env: {
          ...process.env,
          ...store.env,
          DEMO_WORKER: String(worker),
          DEMO_BACKEND: backend,
          DEMO_TTL_MS: String(TTL_MS),
          DEMO_WORK_MS: String(WORK_MS),
          DEMO_SEND_MS: String(SEND_MS)
        },
        stdio: ["ignore", "pipe", "inherit"]
      })
      children[worker - 1] = child
      Readline.createInterface({ input: child.stdout! }).on("line", (line) => {
        try {
          onEvent(JSON.parse(line) as Stamped)
        } catch {
          console.log(`   [worker ${worker}] ${line}`)
        }
      })
    }
    for (let worker = 1; worker <= WORKERS; worker++) spawnWorker(worker)

    const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))
    /** The next grant or write: a disruption aimed at it lands inside the hold, not after its release. */
    const next = (kind: "acquired" | "writing") =>
      new Promise<{ readonly worker: number; readonly token: string }>((resolve, reject) => {
        const bound = setTimeout(() => reject(new Error(`no worker reported "${kind}" within ${EVENT_WITHIN_MS} ms`)), EVENT_WITHIN_MS)
        waiting.set(kind, (worker, token) => {
          clearTimeout(bound)
          resolve({ worker, token })
        })
      })

    while (ready < WORKERS) await sleep(20)
    const scenarioStart = Date.now()
    say(`all ${WORKERS} workers are up; they compete for "${LOCK_NAME}"`)
    await sleep((seconds * 1000) / 3)
    if (redisStoreOf !== undefined) {
      // Aimed at a fresh grant, as the session kill below: the holder's Redis connections (lock
      // commands, renewals, wake-ups) are killed by the server; the lease itself is in keys.
      const victim = await next("acquired")
      const killAt = Date.now()
      pendingDisruption = { cause: "connection kill", at: killAt, from: victim.worker }
      const ids = await redisConnectionsOf(redisStoreOf.client, victim.worker)
      let killed = 0
      for (const id of ids) {
        // An id that closed since the listing answers an error: nothing to kill, not a failure.
        killed += Number(await redisStoreOf.client.call("client", "kill", "id", id).catch(() => 0))
      }
      lastKill = { worker: victim.worker, at: killAt }
      timeline.kills.push({ worker: victim.worker, at: killAt, label: `connection kill: worker ${victim.worker}'s ${killed} Redis connection(s)` })
      say(`>>> killing worker ${victim.worker}'s ${killed} Redis connection(s) (CLIENT KILL) while it holds token ${victim.token}`)
    } else if (pgStore !== undefined) {
      // Aimed at a fresh grant, with a whole round (WORK_MS + SEND_MS) ahead of it: the holder seen
      // at some moment may be releasing already, and the kill would hit a worker that holds nothing.
      const victim = await next("acquired")
      const killAt = Date.now()
      // Set before the kill is sent: the next holder's grant can be reported before the terminate's
      // answer is, and its takeover is measured from the moment the kill began.
      pendingDisruption = { cause: "session kill", at: killAt, from: victim.worker }
      const killed = await query<{ n: number }>(
        pgStore.url,
        `select count(pg_terminate_backend(pid))::int as n from pg_stat_activity
         where datname = current_database() and application_name = $1`,
        [applicationName(victim.worker)]
      )
      lastKill = { worker: victim.worker, at: killAt }
      timeline.kills.push({ worker: victim.worker, at: killAt, label: `session kill: worker ${victim.worker}'s ${killed[0]!.n} session(s)` })
      say(`>>> killing worker ${victim.worker}'s ${killed[0]!.n} database session(s) while it holds token ${victim.token}`)
    } else {
      // SQLite has no sessions to kill: the holder process itself dies (a crash), and is restarted.
      const victim = await next("acquired")
      const child = children[victim.worker - 1]!
      const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()))
      child.kill("SIGKILL")
      pendingDisruption = { cause: "crash", at: Date.now(), from: victim.worker }
      timeline.kills.push({ worker: victim.worker, at: pendingDisruption.at, label: `crash (SIGKILL): worker ${victim.worker}` })
      say(`>>> killing worker ${victim.worker} (SIGKILL) while it holds token ${victim.token}; its lease runs out after the ttl`)
      await exited
      const hold = openHold(timeline, victim.worker, String(victim.token))
      if (hold !== undefined) hold.end = pendingDisruption.at
      if (holder?.worker === victim.worker) holder = undefined
      spawnWorker(victim.worker)
      say(`>>> worker ${victim.worker} restarted`)
    }

    await sleep((seconds * 1000) / 3)
    {
      // Freeze a holder whose write is on its way: the write reaches the database after the freeze.
      const victim = await next("writing")
      const child = children[victim.worker - 1]!
      child.kill("SIGSTOP")
      pendingDisruption = { cause: "freeze", at: Date.now(), from: victim.worker }
      const freeze: { readonly worker: number; readonly from: number; to?: number } = { worker: victim.worker, from: pendingDisruption.at }
      timeline.freezes.push(freeze)
      say(
        `>>> freezing worker ${victim.worker} (SIGSTOP) for ${FREEZE_MS} ms with its write on the way, lease ttl ${TTL_MS} ms, token ${victim.token}`
      )
      await sleep(FREEZE_MS)
      child.kill("SIGCONT")
      freeze.to = Date.now()
      say(`>>> resuming worker ${victim.worker} (SIGCONT)`)
    }

    await sleep(Math.max(1000, seconds * 1000 - (Date.now() - scenarioStart)))
    say("stopping the workers (SIGTERM: each releases what it holds)")
    await Promise.all(
      children.map((child) =>
        new Promise<void>((resolve) => {
          if (child.exitCode !== null) return resolve()
          child.once("exit", () => resolve())
          child.kill("SIGTERM")
          setTimeout(() => child.kill("SIGKILL"), 5000).unref()
        })
      )
    )

    const rounds = await store.rounds()
    const duplicated = rounds.filter((r) => r.copies > 1).length
    const gaps = rounds.filter((r, i) => r.round !== i + 1).length
    const highestToken = await store.highestToken()
    const locksLeft = await store.locksLeft()

    const checks: Array<readonly [string, string, boolean]> = [
      ["rounds completed", String(rounds.length), rounds.length > 0],
      ["rounds done more than once", String(duplicated), duplicated === 0],
      ["gaps in the round sequence", String(gaps), gaps === 0],
      ["writes reported by workers", String(writes), writes === rounds.reduce((n, r) => n + r.copies, 0)],
      [
        "takeovers (ms after the disruption)",
        takeovers.map((t) => `${t.cause}: ${t.ms}`).join(", ") || "none",
        true
      ],
      ["leases lost (reasons)", lostBy.join(", ") || "none", true],
      [
        "stale writes rejected by the fence",
        String(staleRejected),
        // A frozen lease holder is taken over and its late write must be refused; a session
        // advisory lock is not a lease, so a frozen holder keeps it and writes nothing stale.
        backend === "advisory" ? true : staleRejected >= 1
      ],
      ["worker errors", String(errors), errors === 0],
      ["locks left held", String(locksLeft), locksLeft === 0],
      ["highest token written", highestToken ?? "-", true]
    ]
    console.log(`\nsummary (lock "${LOCK_NAME}", fence resource "${FENCE_RESOURCE}")`)
    const width = Math.max(...checks.map(([label]) => label.length))
    for (const [label, value, ok] of checks) console.log(`  ${ok ? "ok  " : "FAIL"}  ${label.padEnd(width)}  ${value}`)
    const failed = checks.filter(([, , ok]) => !ok).map(([label]) => label)
    if (failed.length > 0) failure = `guarantees that did not hold: ${failed.join("; ")}`

    timeline.end = Date.now()
    Fs.mkdirSync(Path.dirname(svgPath), { recursive: true })
    Fs.writeFileSync(svgPath, renderTimeline(timeline))
    console.log(`\ntimeline drawn: ${svgPath}`)
  } finally {
    for (const child of children) if (child.exitCode === null) child.kill("SIGKILL")
    await store.close()
  }
  if (failure !== undefined) {
    console.error(`\nFAILED: ${failure}`)
    process.exit(1)
  }
  console.log("\nevery guarantee held.")
}

main().catch((error) => {
  // A missing Redis is the user's to fix, not a bug: the hint alone, without a stack.
  console.error(error instanceof Error && error.message === INSTALL_HINT ? error.message : error)
  process.exit(1)
})

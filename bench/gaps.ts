/**
 * `npx tsx --import ./bench/lib/built.mjs bench/gaps.ts [--seconds=S] [--rounds=R] [--spins=0,50,100] [--only=compare|spin|redis]`
 *
 * How long this process works between hearing an answer and sending its next statement, per
 * uncontended cycle by one worker: the library's PgLease and PgAdvisory loops next to their raw
 * floors (the bench's own subjects, `scenarios/uncontended.ts`), in alternating rounds. Timed at
 * node-postgres's edge: from a statement's answer (its callback, or its promise settling) to the
 * next `Client.query` call of the process, medians over every cycle. With one worker that gap is
 * the whole of the process's work on the cycle's critical path; the rest is the server and the
 * wire.
 *
 * The same for RedisLease next to raw ioredis sending its scripts, timed at ioredis's edge (a
 * command's reply resolving it, to the next `sendCommand`), when a Redis is at hand (see
 * `tools/redisServer.ts`).
 *
 * Then what such a gap costs: the raw PgLease loop again with S µs of busy CPU after each answer
 * (`--spins`, default 0, 50, 100). On this machine the cost is more than S, since a server backend that idled the
 * while takes longer to wake (see bench/README.md, "Where the remaining time goes").
 */
import pg from "pg"
import { createRequire } from "node:module"
import * as LeaseSql from "../src/internal/lease/pg/sql.js"
import { runMain, withScratchDatabase } from "./lib/postgres.js"
import type { Subject } from "./lib/rounds.js"
import { redisAvailable, startRedis } from "../tools/redisServer.js"
import { FACTORIES as REDIS } from "./scenarios/redis.js"
import { type LeaseQuery, leaseStatements, pgAdvisorySubject, pgLeaseSubject, rawAdvisoryFenced, rawLease } from "./scenarios/uncontended.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const seconds = Number(arg("seconds") ?? "2")
const rounds = Number(arg("rounds") ?? "4")
const spins = (arg("spins") ?? "0,50,100").split(",").map(Number)
const only = arg("only")

/** Gaps (µs) of the subject being measured; undefined while nothing is measured. */
let recording: Array<number> | undefined
/** `performance.now()` of the process's last answer; undefined until one came in this round. */
let lastAnswer: number | undefined

const heard = () => {
  lastAnswer = performance.now()
}
const query = pg.Client.prototype.query as (...args: Array<unknown>) => unknown
pg.Client.prototype.query = function(this: pg.Client, ...args: Array<unknown>) {
  if (recording !== undefined && lastAnswer !== undefined) recording.push((performance.now() - lastAnswer) * 1000)
  const at = args.findIndex((a) => typeof a === "function")
  if (at >= 0) {
    const callback = args[at] as (...a: Array<unknown>) => unknown
    args[at] = function(this: unknown, ...a: Array<unknown>) {
      heard()
      return callback.apply(this, a)
    }
    return query.apply(this, args)
  }
  const answered = query.apply(this, args) as Promise<unknown>
  return answered.then((value) => {
    heard()
    return value
  })
} as never

/**
 * ioredis's `sendCommand`, timed as `Client.query` is: the bench's copy (bench/node_modules) and
 * the library's (the root's), where they differ.
 */
interface RedisCommand {
  resolve: (value: unknown) => unknown
}
const redisClasses = new Set(
  [createRequire(import.meta.url), createRequire(new URL("../src/", import.meta.url))].map((require) =>
    (require("ioredis") as { readonly Redis: { prototype: { sendCommand: (...args: Array<unknown>) => unknown } } }).Redis
  )
)
for (const Redis of redisClasses) {
  const sendCommand = Redis.prototype.sendCommand
  Redis.prototype.sendCommand = function(this: unknown, command: RedisCommand, ...rest: Array<unknown>) {
    if (recording !== undefined && lastAnswer !== undefined) recording.push((performance.now() - lastAnswer) * 1000)
    const resolve = command.resolve
    command.resolve = (value) => {
      heard()
      return resolve(value)
    }
    return sendCommand.call(this, command, ...rest)
  } as never
}

const median = (values: ReadonlyArray<number>) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)] ?? NaN

interface Row {
  readonly label: string
  readonly subject: Subject<unknown>
}

/** Alternating rounds of each row; per row: cycles/s and the median gap per statement sent. */
const compare = async (title: string, rows: ReadonlyArray<Row>) => {
  const opened = []
  for (const row of rows) {
    const trial = await row.subject.open()
    await trial.run({ warmup: true })
    opened.push({ ...row, trial, gaps: [] as Array<number>, cycles: 0 })
  }
  for (let round = 0; round < rounds; round++) {
    for (const row of round % 2 === 0 ? opened : [...opened].reverse()) {
      recording = row.gaps
      lastAnswer = undefined
      const result = await row.trial.run({ warmup: false }) as { readonly cycles: number }
      recording = undefined
      row.cycles += result.cycles
    }
  }
  console.log(title)
  for (const row of opened) {
    console.log(`  ${row.label.padEnd(34)} ${(row.cycles / (rounds * seconds)).toFixed(0).padStart(6)} cycles/s; answer → next statement ${median(row.gaps).toFixed(1).padStart(6)} µs (median of ${row.gaps.length})`)
    await row.trial.close()
  }
}

const spin = (micros: number) => {
  const until = performance.now() + micros / 1000
  while (performance.now() < until) {
    // busy: the CPU work a library would do between an answer and its next statement
  }
}

/** The raw PgLease cycle with `micros` of CPU after each answer. */
const spun = async (url: string, micros: ReadonlyArray<number>) => {
  const statements = leaseStatements(LeaseSql.parseTable("bench_gap_leases") as LeaseSql.TableRef, "bench-gaps")
  const client = new pg.Client({ connectionString: url, application_name: "bench-gaps" })
  await client.connect()
  await client.query(statements.createTable)
  // Prepared, as PgLease's own connections send them.
  const names = new Map<string, string>()
  const query: LeaseQuery = (text, values) => {
    let name = names.get(text)
    if (name === undefined) names.set(text, name = `gap_${names.size}`)
    return client.query({ name, text, values: [...values] })
  }
  const loop = async (ms: number, gap: number) => {
    const end = performance.now() + ms
    let n = 0
    while (performance.now() < end) {
      const owner = await statements.acquire(query, "gap")
      spin(gap)
      await statements.release(query, "gap", owner)
      spin(gap)
      n++
    }
    return n
  }
  await loop(1_000, 0)
  const cycles = new Map(micros.map((m) => [m, 0]))
  for (let round = 0; round < rounds; round++) {
    for (const m of round % 2 === 0 ? micros : [...micros].reverse()) cycles.set(m, cycles.get(m)! + await loop(seconds * 1000, m))
  }
  await client.end()
  console.log("raw PgLease cycle with CPU spent after each of its 2 answers")
  const base = (rounds * seconds * 1e6) / cycles.get(micros[0]!)!
  for (const m of micros) {
    const perCycle = (rounds * seconds * 1e6) / cycles.get(m)!
    console.log(`  ${String(m).padStart(4)} µs after each answer: ${perCycle.toFixed(0).padStart(5)} µs per cycle (+${(perCycle - base).toFixed(0)} µs for ${2 * m} µs of CPU)`)
  }
}

runMain(() =>
  withScratchDatabase("gaps", async (db) => {
    const ms = seconds * 1000
    if (only === undefined || only === "compare") {
      await compare("PgLease, 1 worker", [
        { label: "raw pg, PgLease's statements", subject: rawLease(db, 1, ms) },
        { label: "PgLease.layer", subject: pgLeaseSubject(db, 1, ms) }
      ])
      await compare("PgAdvisory, 1 worker", [
        { label: "raw pg, fenced advisory", subject: rawAdvisoryFenced(db, 1, 1, ms) },
        { label: "PgAdvisory.layer", subject: pgAdvisorySubject(db, 1, ms) }
      ])
    }
    if (only === undefined || only === "redis") {
      if (!redisAvailable()) console.log("RedisLease: skipped, no redis-server on the PATH and no REDIS_URL")
      else {
        const redis = await startRedis()
        try {
          await compare("RedisLease, 1 worker", [
            { label: "raw ioredis, RedisLease's scripts", subject: REDIS.rawRedisLease(undefined, redis.url, 1, ms) },
            { label: "RedisLease.layer", subject: REDIS.redisLeaseSubject(undefined, redis.url, 1, ms) }
          ])
        } finally {
          await redis.stop()
        }
      }
    }
    if (only === undefined || only === "spin") await spun(db.url, spins)
  })
)

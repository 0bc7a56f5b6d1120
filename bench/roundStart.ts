/**
 * `npx tsx --import ./bench/lib/built.mjs bench/roundStart.ts [--idle=MS] [--check=DURATION] [--rounds=R] [--verbose]`
 *
 * What the start of a PgLease handoff round costs after a quiet spell: the bench's handoff row
 * `pg-lease-notify` (8 contenders on one name, 8 layers in this process, hold 1 ms), each round
 * of 300 ms started after `--idle` ms with nobody waiting (default 10,000: about what the full
 * bench's interleave leaves between a row's rounds), the layers' `listenCheckInterval` set by
 * `--check` (default: the layer's). Per round it prints the longest wait and handoff p50, the
 * event loop's stalls over 4 ms in the first 150 ms, and the median time of the give-back
 * statements sent in each stretch of the round; `--verbose` prints every statement (sent →
 * answered, connection, kind), ask and grant of the first 90 ms. A diagnostic: nothing is written
 * to the report.
 */
import { PgClient } from "@effect/sql-pg"
import * as Layer from "effect/Layer"
import * as Redacted from "effect/Redacted"
import pg from "pg"
import * as PgLease from "../src/PgLease.js"
import { Recorder } from "./lib/handoff.js"
import { runMain, withScratchDatabase } from "./lib/postgres.js"
import { now } from "./lib/timing.js"
import { lockHandoff } from "./scenarios/handoff.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const idleMs = Number(arg("idle") ?? "10000")
const check = arg("check")
const rounds = Number(arg("rounds") ?? "2")
const verbose = process.argv.includes("--verbose")

let t0 = 0
let recording = false
const events: Array<{ readonly at: number; readonly line: string; readonly release?: number }> = []
const at = (ms: number) => ms.toFixed(1).padStart(6)

// Every statement's send and answer, by connection: the release statement is the one that notifies a handover.
const ids = new WeakMap<object, number>()
let nextId = 0
const kindOf = (text: string) =>
  text.includes("pg_notify($4::text") || text.includes("pg_notify($3::text, 'h'")
    ? "give-back"
    : /^\s*select pg_notify\(\$1::text, \$2::text\)/.test(text)
    ? "ping"
    : /^\s*listen/i.test(text)
    ? "listen"
    : "other"
const client = pg.Client.prototype as unknown as { query: (...args: Array<unknown>) => unknown }
const query = client.query
client.query = function(this: object, ...args: Array<unknown>) {
  const config = args[0]
  const text = typeof config === "string" ? config : (config as { text?: string } | undefined)?.text ?? ""
  if (!ids.has(this)) ids.set(this, nextId++)
  const connection = ids.get(this)
  const callback = args[args.length - 1]
  if (recording && typeof callback === "function") {
    const sent = now() - t0
    const kind = kindOf(text)
    args[args.length - 1] = (...result: Array<unknown>) => {
      const answered = now() - t0
      events.push({ at: sent, line: `${at(sent)} → ${at(answered)} c${connection} ${kind}`, ...(kind === "give-back" ? { release: answered - sent } : {}) })
      return (callback as (...a: Array<unknown>) => unknown)(...result)
    }
  }
  return query.apply(this, args)
}
const recorder = Recorder.prototype as unknown as { asking(who: number): void; granted(who: number): void }
for (const step of ["asking", "granted"] as const) {
  const original = recorder[step]
  recorder[step] = function(this: unknown, who: number) {
    if (recording) events.push({ at: now() - t0, line: `${at(now() - t0)}   ${step} ${who}` })
    return original.call(this, who)
  }
}

const STRETCHES = [0, 50, 100, 200, 300]

runMain(() =>
  withScratchDatabase("round-start", async (database) => {
    const subject = lockHandoff(
      "pg-lease-round-start",
      8,
      (i) =>
        Layer.provide(
          PgLease.layer({ listen: true, ...(check === undefined ? {} : { listenCheckInterval: check as PgLease.Options["listenCheckInterval"] }) }),
          PgClient.layer({ url: Redacted.make(database.url), applicationName: `bench-round-start-${i}` })
        ),
      300
    )
    const trial = await subject.open()
    try {
      await trial.run({ warmup: true })
      for (let round = 0; round < rounds; round++) {
        await new Promise((resolve) => setTimeout(resolve, idleMs))
        events.length = 0
        t0 = now()
        recording = true
        let last = now()
        const stalls: Array<string> = []
        const loop = setInterval(() => {
          const t = now()
          if (t - last > 4) stalls.push(`${(t - last).toFixed(1)} ms at ${(last - t0).toFixed(0)}`)
          last = t
        }, 1)
        setTimeout(() => clearInterval(loop), 150)
        const result = await trial.run({ warmup: false })
        recording = false
        console.log(`round ${round}: longest wait ${result.longestWaitMs.toFixed(1)} ms, handoff p50 ${result.handoffP50Ms.toFixed(2)} ms`)
        console.log(`  event loop stalls over 4 ms in the first 150 ms: ${stalls.join(", ") || "none"}`)
        console.log(`  pings sent: ${events.filter((e) => e.line.endsWith(" ping")).length}`)
        const medians = STRETCHES.slice(0, -1).map((from, i) => {
          const times = events.filter((e) => e.release !== undefined && e.at >= from && e.at < STRETCHES[i + 1]!).map((e) => e.release!).sort((a, b) => a - b)
          return `${from}–${STRETCHES[i + 1]} ms: ${times.length === 0 ? "-" : times[Math.floor(times.length / 2)]!.toFixed(1)} (${times.length})`
        })
        console.log(`  give-back statement, median ms, by when it was sent: ${medians.join(", ")}`)
        if (verbose) console.log(events.filter((e) => e.at < 90).sort((a, b) => a.at - b.at).map((e) => e.line).join("\n"))
      }
    } finally {
      await trial.close()
    }
  })
)

/**
 * `npx tsx --import ./bench/lib/built.mjs bench/leaseTimeline.ts [--seconds=S] [--rounds=R] [--set=guc=value,...]`
 *
 * Where a PgLease handoff's time goes: the bench's handoff row `pg-lease-notify` (8 contenders on
 * one name, 8 layers in this process, hold 1 ms, `scenarios/handoff.ts`), each handoff cut into
 * the moments this process sees:
 *
 *   releasing → release sent → first notification heard → granted,   release sent → its answer
 *
 * "releasing" and "granted" are the bench recorder's; "release sent" is node-postgres's `query`
 * call of PgLease's release statement, its answer that query's callback; the notification is
 * the first `notification` event any listen connection of the process emits after the send.
 * A moment is when this process's JavaScript ran, so a stage also holds whatever else the thread
 * did meanwhile. Medians over the handoffs matched, per round. A diagnostic: nothing is written
 * to the report.
 */
import pg from "pg"
import { Recorder } from "./lib/handoff.js"
import { runMain, withScratchDatabase } from "./lib/postgres.js"
import { now } from "./lib/timing.js"
import { pgLeaseHandoff } from "./scenarios/handoff.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const seconds = Number(arg("seconds") ?? "3")
const rounds = Number(arg("rounds") ?? "3")

interface Handoff {
  /** Other statements of the process in flight when the release was sent (a place's insert, a renewal). */
  inFlight?: number
  releasing: number
  sent?: number
  answered?: number
  heard?: number
  granted?: number
}
let current: Handoff | undefined
const done: Array<Handoff> = []
let releases = 0
let others = 0

// The release statement is the one that hands over (its text names the handed prefix's notify):
// `release`, or `releaseBatch`, which a holder's lone give-back goes as.
const isRelease = (text: string) => text.includes("pg_notify($4::text") || text.includes("pg_notify($3::text, 'h'")
const clientProto = pg.Client.prototype as unknown as { query: (...args: Array<unknown>) => unknown; emit: (event: string, ...args: Array<unknown>) => boolean }
const query = clientProto.query
clientProto.query = function(this: unknown, ...args: Array<unknown>) {
  const config = args[0]
  const text = typeof config === "string" ? config : (config as { text?: string } | undefined)?.text ?? ""
  const callback = args[args.length - 1]
  if (typeof callback === "function" && !isRelease(text) && !/^\s*(listen|unlisten)/i.test(text)) {
    others++
    args[args.length - 1] = (...result: Array<unknown>) => {
      others--
      return (callback as (...a: Array<unknown>) => unknown)(...result)
    }
  } else if (isRelease(text) && typeof callback === "function" && current !== undefined && current.sent === undefined) {
    releases++
    const handoff = current
    handoff.sent = now()
    handoff.inFlight = others
    args[args.length - 1] = (...result: Array<unknown>) => {
      handoff.answered = now()
      return (callback as (...a: Array<unknown>) => unknown)(...result)
    }
  }
  return query.apply(this, args)
}
const emit = clientProto.emit
clientProto.emit = function(this: unknown, event: string, ...args: Array<unknown>) {
  if (event === "notification" && current?.sent !== undefined && current.heard === undefined) current.heard = now()
  return emit.call(this, event, ...args)
}
const recorder = Recorder.prototype as unknown as { releasing(who: number): void; granted(who: number): void }
const releasing = recorder.releasing
const granted = recorder.granted
recorder.releasing = function(this: Recorder, who: number) {
  current = { releasing: now() }
  releasing.call(this, who)
}
recorder.granted = function(this: Recorder, who: number) {
  if (current !== undefined && current.granted === undefined) {
    current.granted = now()
    done.push(current)
  }
  current = undefined
  granted.call(this, who)
}

const median = (values: Array<number>) => {
  const sorted = values.filter((v) => Number.isFinite(v)).sort((a, b) => a - b)
  return sorted.length === 0 ? NaN : sorted[Math.floor(sorted.length / 2)]!
}

runMain(() =>
  withScratchDatabase("lease-timeline", async (database) => {
    const settings = arg("set")?.split(",") ?? []
    if (settings.length > 0) {
      // Every connection opened from now on runs with these settings (an experiment: what a stage is made of).
      const admin = new pg.Client({ connectionString: database.url })
      await admin.connect()
      for (const setting of settings) {
        const [key, value] = setting.split("=")
        await admin.query(`alter database "${database.name}" set ${key} = ${value}`)
      }
      await admin.end()
    }
    const trial = await pgLeaseHandoff(database, seconds * 1000, true).open()
    try {
      await trial.run({ warmup: true })
      for (let round = 0; round < rounds; round++) {
        done.length = 0
        releases = 0
        const result = await trial.run({ warmup: false })
        const full = done.filter((h) => h.sent !== undefined && h.heard !== undefined && h.answered !== undefined)
        const stage = (f: (h: Handoff) => number) => median(full.map(f)).toFixed(2)
        console.log(
          `round ${round}: handoff p50 ${result.handoffP50Ms.toFixed(2)} ms, longest wait ${result.longestWaitMs.toFixed(1)} ms; ` +
            `${full.length} of ${done.length} handoffs matched (${releases} release statements seen). Medians, ms: ` +
            `releasing → release sent ${stage((h) => h.sent! - h.releasing)}, ` +
            `sent → notification heard ${stage((h) => h.heard! - h.sent!)}, ` +
            `heard → granted ${stage((h) => h.granted! - h.heard!)}, ` +
            `sent → release answered ${stage((h) => h.answered! - h.sent!)}, ` +
            `releasing → granted ${stage((h) => h.granted! - h.releasing)}`
        )
        const alone = full.filter((h) => h.inFlight === 0)
        const beside = full.filter((h) => h.inFlight! > 0)
        const answer = (hs: Array<Handoff>) => median(hs.map((h) => h.answered! - h.sent!)).toFixed(2)
        console.log(
          `         release sent with no other statement of the process in flight: ${alone.length}, answered in ${answer(alone)} ms (median); ` +
            `with one or more: ${beside.length}, answered in ${answer(beside)} ms`
        )
      }
    } finally {
      await trial.close()
    }
  })
)

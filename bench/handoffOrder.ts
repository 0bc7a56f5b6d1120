/**
 * `npx tsx --import ./bench/lib/built.mjs bench/handoffOrder.ts [--seconds=S] [--rounds=R] [--only=<id>[,<id>]] [--first=N]`
 * (ids: raw, raw-fenced, pg-advisory-8, pg-advisory-1, pg-lease-notify; default all)
 *
 * What a round's longest wait is made of: the bench's PostgreSQL handoff rows (scenario 2: 8
 * contenders on one name, hold 1 ms, `scenarios/handoff.ts`), rounds alternating between rows,
 * with every grant recorded. Per round and row it prints:
 *
 * - the longest wait and the handoff p50, as the bench reports them;
 * - how many grants went to other contenders while each grant waited (a histogram). With 8
 *   contenders in first-in-first-out order that is at most 7; more is an overtake;
 * - the longest waits with the time into the round they ended at: waits that end close together
 *   are one slow stretch (the server's disk, a pause of this process) that every waiter in the
 *   queue at the time sat through, not one waiter left behind.
 *
 * A diagnostic, not a target: nothing here is written to the report.
 */
import pg from "pg"
import { CONTENDERS, Recorder } from "./lib/handoff.js"
import { runMain, withScratchDatabase } from "./lib/postgres.js"
import type { Trial } from "./lib/rounds.js"
import type { HandoffRound } from "./lib/handoff.js"
import { now } from "./lib/timing.js"
import { pgAdvisoryHandoff, pgLeaseHandoff, rawHandoff } from "./scenarios/handoff.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const seconds = Number(arg("seconds") ?? "3")
const rounds = Number(arg("rounds") ?? "3")
const only = arg("only")?.split(",")
/** `--first=N`: also print when the round's first N grants came. */
const first = Number(arg("first") ?? "0")

interface Grant {
  readonly wait: number
  /** Grants to other contenders between this one's asking and its grant. */
  readonly between: number
  /** Ms into the round. */
  readonly at: number
}

/** Every grant of the rounds running now: the recorder's own moments, seen from a wrapper around it. */
const grants: Array<Grant> = []
let grantCount = 0
const askedAtCount = new Map<number, number>()
const recorder = Recorder.prototype as unknown as {
  asking(who: number): void
  granted(who: number): void
}
const asking = recorder.asking
const granted = recorder.granted
recorder.asking = function(this: Recorder, who: number) {
  askedAtCount.set(who, grantCount)
  asking.call(this, who)
}
recorder.granted = function(this: Recorder, who: number) {
  // The recorder's own record of when `who` asked (private to it; read, never written).
  const askedAt = (this as unknown as { readonly asked: Array<number | undefined> }).asked[who]
  const at = now()
  // As the recorder counts: grants after the round's end are its drain.
  if (askedAt !== undefined && at <= this.stopAt) {
    grants.push({ wait: at - askedAt, between: grantCount - (askedAtCount.get(who) ?? grantCount), at: at - this.startedAt })
  }
  grantCount++
  granted.call(this, who)
}

runMain(() =>
  withScratchDatabase("handoff-order", async (database) => {
    const ms = seconds * 1000
    const subjects = [
      rawHandoff(database, ms, false),
      rawHandoff(database, ms, true),
      pgAdvisoryHandoff(database, ms, 8),
      pgAdvisoryHandoff(database, ms, 1),
      pgLeaseHandoff(database, ms, true)
    ].filter((s) => only === undefined || only.some((id) => s.id.startsWith(id) && (id !== "raw" || s.id === "raw-handoff")))
    const trials: Array<{ readonly id: string; readonly trial: Trial<HandoffRound> }> = []
    const admin = new pg.Client({ connectionString: database.url })
    await admin.connect()
    try {
      for (const subject of subjects) trials.push({ id: subject.id, trial: await subject.open() })
      for (const { trial } of trials) await trial.run({ warmup: true })
      for (let round = 0; round < rounds; round++) {
        for (const { id, trial } of trials) {
          grants.length = 0
          const startedAt = new Date()
          const result = await trial.run({ warmup: false })
          const opened = await admin.query<{ n: number }>(
            "select count(*)::int as n from pg_stat_activity where datname = current_database() and application_name like 'bench-%' and backend_start >= $1",
            [startedAt]
          )
          const histogram = new Map<number, number>()
          for (const g of grants) histogram.set(g.between, (histogram.get(g.between) ?? 0) + 1)
          const overtaken = grants.filter((g) => g.between > CONTENDERS - 1).length
          const longest = [...grants].sort((a, b) => b.wait - a.wait).slice(0, 5)
          console.log(
            `${id.padEnd(20)} round ${round}: longest wait ${result.longestWaitMs.toFixed(1)} ms, handoff p50 ${result.handoffP50Ms.toFixed(2)} ms, ` +
              `${grants.length} grants, overtaken ${overtaken}, sessions opened ${opened.rows[0]?.n}; grants to others while waiting: ` +
              [...histogram].sort((a, b) => a[0] - b[0]).map(([k, v]) => `${k}:${v}`).join(" ")
          )
          if (first > 0) console.log(`${"".padEnd(20)} first grants (ms into the round): ${grants.slice(0, first).map((g) => g.at.toFixed(1)).join(", ")}`)
          console.log(`${"".padEnd(20)} longest: ${longest.map((g) => `${g.wait.toFixed(1)} ms (${g.between} between, ended at ${g.at.toFixed(0)} ms)`).join(", ")}`)
        }
      }
    } finally {
      for (const { trial } of trials) await trial.close()
      await admin.end()
    }
  })
)

/**
 * `npx tsx --import ./bench/lib/built.mjs bench/advisoryTimeline.ts [--seconds=S] [--rounds=R]`
 *
 * Where a PgAdvisory handoff's time goes: the bench's handoff rows (scenario 2: 8 contenders on one
 * name, hold 1 ms, `scenarios/handoff.ts`) — PgAdvisory with 8 layers and raw pg waiters with the
 * fencing write — in alternating rounds in this process, every handoff cut at the moments the
 * process sees: the recorder's release (its `release()` call, or the instant the holder's scope
 * starts closing), the unlock statement handed to node-postgres, the next holder's lock statement
 * answered (its callback or promise), and the recorder's grant. Per round: the medians of the
 * three stretches. The first and the last are the library's own steps; the middle one is the
 * server, the network, and this process's event loop before it reads the answer.
 * A diagnostic: nothing is written to the report.
 */
import pg from "pg"
import { Recorder } from "./lib/handoff.js"
import { runMain, withScratchDatabase } from "./lib/postgres.js"
import type { Subject } from "./lib/rounds.js"
import type { HandoffRound } from "./lib/handoff.js"
import { now } from "./lib/timing.js"
import { pgAdvisoryHandoff, rawHandoff } from "./scenarios/handoff.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const seconds = Number(arg("seconds") ?? "2")
const rounds = Number(arg("rounds") ?? "3")

/** The moments of the handoff under way; `undefined` until seen. */
let released: number | undefined
let unlockSent: number | undefined
let lockAnswered: number | undefined
/** Per handoff: release → unlock sent, unlock sent → the next holder's lock answered, answer → granted. */
const handoffs: Array<readonly [number, number, number]> = []

const recorder = Recorder.prototype as unknown as { releasing(who: number): void; granted(who: number): void }
const releasing = recorder.releasing
const granted = recorder.granted
recorder.releasing = function(this: Recorder, who: number) {
  released = now()
  unlockSent = lockAnswered = undefined
  releasing.call(this, who)
}
recorder.granted = function(this: Recorder, who: number) {
  const at = now()
  if (released !== undefined && unlockSent !== undefined && lockAnswered !== undefined) {
    handoffs.push([unlockSent - released, lockAnswered - unlockSent, at - lockAnswered])
  }
  released = undefined
  granted.call(this, who)
}

// Every client's statements: the unlock's send, and the first lock statement answered after it.
const query = pg.Client.prototype.query as unknown as (...args: Array<unknown>) => unknown
;(pg.Client.prototype as unknown as { query: (...args: Array<unknown>) => unknown }).query = function(this: pg.Client, ...args: Array<unknown>) {
  const config = args[0] as string | { readonly text?: string } | undefined
  const text = typeof config === "string" ? config : config?.text ?? ""
  const isLock = /pg_advisory_lock\(/i.test(text)
  if (/pg_advisory_unlock\(/i.test(text) && released !== undefined && unlockSent === undefined) unlockSent = now()
  const answered = () => {
    if (isLock && unlockSent !== undefined && lockAnswered === undefined) lockAnswered = now()
  }
  const last = args[args.length - 1]
  if (typeof last === "function") {
    args[args.length - 1] = (...results: Array<unknown>) => {
      answered()
      return (last as (...r: Array<unknown>) => unknown)(...results)
    }
    return query.apply(this, args)
  }
  const result = query.apply(this, args) as Promise<unknown> | undefined
  return result !== undefined && typeof result.then === "function" ? result.then((value) => (answered(), value)) : result
}

const median = (values: ReadonlyArray<number>) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)]!

runMain(() =>
  withScratchDatabase("advisory-timeline", async (database) => {
    const ms = seconds * 1000
    const subjects: ReadonlyArray<Subject<HandoffRound>> = [rawHandoff(database, ms, true), pgAdvisoryHandoff(database, ms, 8)]
    const trials = []
    for (const subject of subjects) trials.push({ id: subject.id, trial: await subject.open() })
    try {
      for (const { trial } of trials) await trial.run({ warmup: true })
      for (let round = 0; round < rounds; round++) {
        for (const { id, trial } of trials) {
          handoffs.length = 0
          const result = await trial.run({ warmup: false })
          const column = (i: number) => median(handoffs.map((h) => h[i]!)).toFixed(3)
          console.log(
            `${id.padEnd(20)} round ${round}: handoff p50 ${result.handoffP50Ms.toFixed(2)} ms; medians of ${handoffs.length} (ms): ` +
              `release → unlock sent ${column(0)}, unlock sent → next holder's lock answered ${column(1)}, answer → granted ${column(2)}`
          )
        }
      }
    } finally {
      for (const { trial } of trials) await trial.close()
    }
  })
)

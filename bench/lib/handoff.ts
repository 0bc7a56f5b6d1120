/**
 * Handoff rounds (scenario 2 and the peers): N contenders loop on ONE name — acquire, hold
 * 1 ms, release — for a fixed time. The recorder sees three moments per cycle: asking, granted,
 * and the moment the holder starts releasing (its `release()` call, or the first instant its
 * scope starts closing). A handoff is the time from one holder's release moment to the next
 * grant, counted only when the next holder is a different contender; a grant to the releaser
 * itself is a self re-acquire. Waits are from asking to grant; a contender still waiting when
 * the round ends counts with the time it has waited so far, so starvation cannot hide.
 */
import * as Effect from "effect/Effect"
import type * as Scope from "effect/Scope"
import type { Context } from "./context.js"
import * as Report from "./report.js"
import { interleave, type Subject } from "./rounds.js"
import { max, min, percentileOfTyped, Samples, spread, type Spread } from "./stats.js"
import { now, sleep } from "./timing.js"

/** How long the holder keeps the lock in every cycle. */
export const HOLD_MS = 1
export const CONTENDERS = 8

export interface HandoffRound {
  readonly seconds: number
  readonly grants: number
  readonly handoffs: number
  readonly selfReacquires: number
  readonly handoffP50Ms: number
  readonly handoffP99Ms: number
  readonly perContender: ReadonlyArray<number>
  readonly longestWaitMs: number
  readonly waitP99Ms: number
}

export class Recorder {
  private last: { readonly who: number; readonly at: number } | undefined
  private readonly asked: Array<number | undefined>
  private readonly handoffs = new Samples()
  private readonly waits = new Samples()
  private readonly perContender: Array<number>
  private selfReacquires = 0
  private grants = 0
  private longestWait = 0
  readonly startedAt = now()
  readonly stopAt: number

  constructor(readonly contenders: number, durationMs: number) {
    this.asked = Array.from({ length: contenders }, () => undefined)
    this.perContender = Array.from({ length: contenders }, () => 0)
    this.stopAt = this.startedAt + durationMs
  }

  get running(): boolean {
    return now() < this.stopAt
  }

  asking(who: number): void {
    this.asked[who] = now()
  }

  granted(who: number): void {
    const at = now()
    const askedAt = this.asked[who]
    this.asked[who] = undefined
    const previous = this.last
    this.last = undefined
    // Grants after the end are the drain of the round, not part of it.
    if (at > this.stopAt || askedAt === undefined) return
    this.grants++
    this.perContender[who] = (this.perContender[who] ?? 0) + 1
    const wait = at - askedAt
    this.waits.push(wait)
    if (wait > this.longestWait) this.longestWait = wait
    if (previous === undefined) return
    if (previous.who === who) this.selfReacquires++
    else this.handoffs.push(at - previous.at)
  }

  releasing(who: number): void {
    this.last = { who, at: now() }
  }

  finish(): HandoffRound {
    // Contenders still waiting at the end have waited at least this long.
    for (const askedAt of this.asked) {
      if (askedAt !== undefined && askedAt < this.stopAt) this.longestWait = Math.max(this.longestWait, this.stopAt - askedAt)
    }
    const handoffs = this.handoffs.sorted()
    return {
      seconds: (this.stopAt - this.startedAt) / 1000,
      grants: this.grants,
      handoffs: handoffs.length,
      selfReacquires: this.selfReacquires,
      handoffP50Ms: percentileOfTyped(handoffs, 50),
      handoffP99Ms: percentileOfTyped(handoffs, 99),
      perContender: [...this.perContender],
      longestWaitMs: this.longestWait,
      waitP99Ms: percentileOfTyped(this.waits.sorted(), 99)
    }
  }
}

/** A contender whose lock is a promise pair: `acquire` resolves to the release function. */
export const promiseContender = async (
  recorder: Recorder,
  who: number,
  acquire: () => Promise<() => Promise<unknown>>
): Promise<void> => {
  while (recorder.running) {
    recorder.asking(who)
    const release = await acquire()
    recorder.granted(who)
    await sleep(HOLD_MS)
    recorder.releasing(who)
    await release()
  }
}

/** A contender whose lock is a scoped Effect: the scope closes right after `releasing`. */
export const effectContender = <E, R>(
  recorder: Recorder,
  who: number,
  acquire: Effect.Effect<unknown, E, R>
): Effect.Effect<void, E, Exclude<R, Scope.Scope>> =>
  Effect.gen(function*() {
    while (recorder.running) {
      recorder.asking(who)
      yield* Effect.scoped(
        Effect.gen(function*() {
          yield* acquire
          recorder.granted(who)
          yield* Effect.sleep(HOLD_MS)
          recorder.releasing(who)
        })
      )
    }
  })

// ---------------------------------------------------------------- rows

export interface HandoffSpec {
  readonly id: string
  readonly label: string
  readonly setup: string
  readonly baseline?: string | undefined
  readonly subject: Subject<HandoffRound>
}

export interface HandoffSummary {
  readonly rounds: ReadonlyArray<HandoffRound>
  readonly handoffs: number
  readonly grantsPerSecond: Spread
  readonly p50Ms: Spread
  readonly p99Ms: Spread
  readonly selfReacquireShare: Spread
  readonly acquisitionsMin: number
  readonly acquisitionsMax: number
  readonly longestWaitMs: Spread
  readonly waitP99Ms: Spread
  readonly p50Ratio?: number | undefined
  readonly longestWaitRatio?: number | undefined
}

export interface HandoffRow {
  readonly id: string
  readonly label: string
  readonly setup: string
  readonly baseline?: string | undefined
  readonly result: ({ readonly _tag: "Measured" } & HandoffSummary) | { readonly _tag: "Skipped"; readonly reason: string }
}

/** Rounds in which nothing was handed over have no handoff percentiles; they are left out. */
const finite = (values: ReadonlyArray<number>): Array<number> => values.filter(Number.isFinite)

const summarise = (rounds: ReadonlyArray<HandoffRound>): HandoffSummary => ({
  rounds,
  handoffs: rounds.reduce((n, r) => n + r.handoffs, 0),
  grantsPerSecond: spread(rounds.map((r) => r.grants / r.seconds)),
  p50Ms: spread(finite(rounds.map((r) => r.handoffP50Ms))),
  p99Ms: spread(finite(rounds.map((r) => r.handoffP99Ms))),
  selfReacquireShare: spread(rounds.map((r) => r.selfReacquires / Math.max(1, r.selfReacquires + r.handoffs))),
  acquisitionsMin: min(rounds.map((r) => min(r.perContender))),
  acquisitionsMax: max(rounds.map((r) => max(r.perContender))),
  longestWaitMs: spread(rounds.map((r) => r.longestWaitMs)),
  waitP99Ms: spread(rounds.map((r) => r.waitP99Ms))
})

export const measureHandoff = async (
  context: Context,
  group: string,
  specs: ReadonlyArray<HandoffSpec>
): Promise<Array<HandoffRow>> => {
  context.log(`${group}: ${specs.length} rows, ${context.settings.rounds} rounds of ${context.settings.handoffMs} ms`)
  const outcomes = await interleave(specs.map((s) => s.subject), { rounds: context.settings.rounds, log: context.log, group })
  const summaries = new Map<string, HandoffSummary>()
  for (const spec of specs) {
    const outcome = outcomes.get(spec.subject.id)
    if (outcome?._tag === "Measured" && outcome.rounds.length > 0) summaries.set(spec.id, summarise(outcome.rounds))
  }
  return specs.map((spec): HandoffRow => {
    const summary = summaries.get(spec.id)
    const base = { id: spec.id, label: spec.label, setup: spec.setup, baseline: spec.baseline }
    if (summary === undefined) {
      const outcome = outcomes.get(spec.subject.id)
      return { ...base, result: { _tag: "Skipped", reason: outcome?._tag === "Skipped" ? outcome.reason : "no measured round" } }
    }
    const baseline = spec.baseline === undefined ? undefined : summaries.get(spec.baseline)
    return {
      ...base,
      result: {
        _tag: "Measured",
        ...summary,
        p50Ratio: baseline === undefined ? undefined : summary.p50Ms.median / baseline.p50Ms.median,
        longestWaitRatio: baseline === undefined ? undefined : summary.longestWaitMs.median / baseline.longestWaitMs.median
      }
    }
  })
}

export const renderHandoff = (rows: ReadonlyArray<HandoffRow>): string =>
  Report.table(
    [
      "Row",
      "Setup",
      "handoffs",
      "handoff p50 ms (min–max)",
      "handoff p99 ms (min–max)",
      "× raw p50",
      "self re-acquire",
      "grants/s",
      "acq. per contender min–max",
      "longest wait ms (max)",
      "× raw longest"
    ],
    rows.map((row) => {
      if (row.result._tag === "Skipped") return [row.label, row.setup, "skipped", row.result.reason, "", "", "", "", "", "", ""]
      const r = row.result
      return [
        row.label,
        row.setup,
        Report.integer(r.handoffs),
        `${Report.ms(r.p50Ms.median)} (${Report.range(r.p50Ms, Report.ms)})`,
        `${Report.ms(r.p99Ms.median)} (${Report.range(r.p99Ms, Report.ms)})`,
        r.p50Ratio === undefined ? "" : Report.ratio(r.p50Ratio),
        Report.percent(r.selfReacquireShare.median),
        Report.rate(r.grantsPerSecond.median),
        `${r.acquisitionsMin}–${r.acquisitionsMax}`,
        `${Report.ms(r.longestWaitMs.median)} (${Report.ms(r.longestWaitMs.max)})`,
        r.longestWaitRatio === undefined ? "" : Report.ratio(r.longestWaitRatio)
      ]
    }),
    ["l", "l", "r", "r", "r", "r", "r", "r", "r", "r", "r"]
  )


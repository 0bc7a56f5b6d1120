/**
 * Throughput rows (scenario 1 and the peers): measured interleaved, summarised as cycles/s per
 * round (median, min–max), cycle latency pooled over all measured rounds (p50, p99), and the
 * ratio to the row's baseline: median over median, with the per-round ratios (round r of the
 * row over round r of the baseline, run back to back) as its range.
 */
import type { Context } from "./context.js"
import type { ThroughputSample } from "./loops.js"
import * as Report from "./report.js"
import { interleave, type Subject } from "./rounds.js"
import { percentileOfTyped, spread, type Spread } from "./stats.js"

export interface ThroughputSpec {
  readonly id: string
  readonly label: string
  /** Server connections the row uses, as a person would say it ("16", "1 (home session)"). */
  readonly connections: string
  readonly concurrency: number
  /** Id of the row this one is divided by. */
  readonly baseline?: string | undefined
  /** Rows of one block (a row and its baselines) run back to back in every round. */
  readonly block?: string | undefined
  readonly subject: Subject<ThroughputSample>
}

export type ThroughputResult =
  | {
    readonly _tag: "Measured"
    readonly cyclesPerSecond: Spread
    readonly p50Ms: number
    readonly p99Ms: number
    readonly cycles: number
    /** Median of the row over median of the baseline; `paired` are the per-round ratios. */
    readonly ratio?: { readonly to: string; readonly median: number; readonly paired: Spread } | undefined
  }
  | { readonly _tag: "Skipped"; readonly reason: string }

export interface ThroughputRow {
  readonly id: string
  readonly label: string
  readonly connections: string
  readonly concurrency: number
  readonly baseline?: string | undefined
  readonly result: ThroughputResult
}

const summarise = (rounds: ReadonlyArray<ThroughputSample>) => {
  const rates = rounds.map((r) => r.cycles / r.seconds)
  const total = rounds.reduce((n, r) => n + r.latencies.length, 0)
  const pooled = new Float64Array(total)
  let offset = 0
  for (const r of rounds) {
    pooled.set(r.latencies.sorted(), offset)
    offset += r.latencies.length
  }
  pooled.sort()
  return {
    rates,
    cyclesPerSecond: spread(rates),
    p50Ms: percentileOfTyped(pooled, 50),
    p99Ms: percentileOfTyped(pooled, 99),
    cycles: rounds.reduce((n, r) => n + r.cycles, 0)
  }
}

/** Measures `specs` interleaved (one group) and summarises each row. */
export const measureThroughput = async (
  context: Context,
  group: string,
  specs: ReadonlyArray<ThroughputSpec>
): Promise<Array<ThroughputRow>> => {
  context.log(`${group}: ${specs.length} rows, ${context.settings.rounds} rounds`)
  const subjects = specs.map((s) => (s.block === undefined ? s.subject : { ...s.subject, block: s.block }))
  const outcomes = await interleave(subjects, { rounds: context.settings.rounds, log: context.log, group })
  const summaries = new Map<string, ReturnType<typeof summarise>>()
  for (const spec of specs) {
    const outcome = outcomes.get(spec.subject.id)
    if (outcome?._tag === "Measured" && outcome.rounds.length > 0) summaries.set(spec.id, summarise(outcome.rounds))
  }
  return specs.map((spec): ThroughputRow => {
    const outcome = outcomes.get(spec.subject.id)
    const summary = summaries.get(spec.id)
    const base = { id: spec.id, label: spec.label, connections: spec.connections, concurrency: spec.concurrency, baseline: spec.baseline }
    if (summary === undefined) {
      return { ...base, result: { _tag: "Skipped", reason: outcome?._tag === "Skipped" ? outcome.reason : "no measured round" } }
    }
    const baseline = spec.baseline === undefined ? undefined : summaries.get(spec.baseline)
    const paired = baseline === undefined
      ? undefined
      : summary.rates.slice(0, baseline.rates.length).map((rate, i) => rate / baseline.rates[i]!)
    return {
      ...base,
      result: {
        _tag: "Measured",
        cyclesPerSecond: summary.cyclesPerSecond,
        p50Ms: summary.p50Ms,
        p99Ms: summary.p99Ms,
        cycles: summary.cycles,
        ratio: paired === undefined || baseline === undefined || spec.baseline === undefined
          ? undefined
          : { to: spec.baseline, median: summary.cyclesPerSecond.median / baseline.cyclesPerSecond.median, paired: spread(paired) }
      }
    }
  })
}

export const ratioOf = (row: ThroughputRow | undefined): number | undefined =>
  row?.result._tag === "Measured" ? row.result.ratio?.median : undefined

export const medianRate = (row: ThroughputRow | undefined): number | undefined =>
  row?.result._tag === "Measured" ? row.result.cyclesPerSecond.median : undefined

/** One table of throughput rows. */
export const renderThroughput = (rows: ReadonlyArray<ThroughputRow>): string => {
  const labels = new Map(rows.map((r) => [r.id, r.label]))
  return Report.table(
    ["Row", "Conns", "cycles/s (median)", "min–max over rounds", "cycle p50 ms", "cycle p99 ms", "× baseline (per-round min–max)", "baseline"],
    rows.map((row) => {
      if (row.result._tag === "Skipped") {
        return [row.label, row.connections, "skipped", row.result.reason, "", "", "", ""]
      }
      const r = row.result
      return [
        row.label,
        row.connections,
        Report.rate(r.cyclesPerSecond.median),
        Report.range(r.cyclesPerSecond, Report.rate),
        Report.ms(r.p50Ms),
        Report.ms(r.p99Ms),
        r.ratio === undefined ? "" : `${Report.ratio(r.ratio.median)} (${Report.range(r.ratio.paired, Report.ratio)})`,
        r.ratio === undefined ? "" : labels.get(r.ratio.to) ?? r.ratio.to
      ]
    }),
    ["l", "r", "r", "r", "r", "r", "r", "l"]
  )
}


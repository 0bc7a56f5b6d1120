/**
 * The report's charts, drawn from the same figures as its tables (a run's results, or the
 * committed results.json): throughput as a multiple of each store's raw floor, the handoff
 * latency distribution, and the longest wait of each contender.
 */
import type { HandoffResult } from "../scenarios/handoff.js"
import type { PeersResult } from "../scenarios/peers.js"
import type { UncontendedResult } from "../scenarios/uncontended.js"
import type { HandoffRow } from "./handoff.js"
import { type Frame, document, el, legend, linear, log, logDomain, type Node, PALETTE, text, title, xAxis, yAxis } from "./svg.js"
import type { ThroughputRow } from "./throughput.js"

/** The scenario results a chart may need; any of them may be missing from a partial run. */
export interface ChartInputs {
  readonly uncontended?: UncontendedResult | undefined
  readonly handoff?: HandoffResult | undefined
  readonly peers?: PeersResult | undefined
}

export interface Chart {
  /** File name without directory, e.g. `chart-throughput.svg`. */
  readonly file: string
  /** Alt text of the image in the report. */
  readonly alt: string
  readonly svg: string
}

const WIDTH = 920

/** One colour per library or store, the same in every chart; a second variant of one is dashed. */
const colorOf = (id: string): string => {
  if (id.startsWith("raw")) return PALETTE.grey
  if (id.startsWith("pg-advisory")) return PALETTE.blue
  if (id.startsWith("pg-lease")) return PALETTE.green
  if (id === "pg-xact") return PALETTE.cyan
  if (id === "memory") return PALETTE.purple
  if (id.startsWith("advisory-lock")) return PALETTE.yellow
  if (id.startsWith("edl")) return PALETTE.red
  return PALETTE.dark
}
const dashedVariant = (id: string): boolean =>
  id === "raw-fenced" || id === "pg-advisory-1" || id === "pg-lease-poll" || id === "edl-poll"

/** A row's label in two lines: what it is, and how it was set up. */
const rowLabel = (x: number, y: number, name: string, detail: string): ReadonlyArray<Node> => [
  text(x, y, name, { anchor: "end", weight: "bold", size: 11 }),
  text(x, y + 13, detail, { anchor: "end", size: 10, fill: "#555555" })
]

// ---------------------------------------------------------------- 1. throughput × floor

interface ThroughputEntry {
  readonly name: string
  readonly floor: string
  readonly id: string
  readonly rows: ReadonlyArray<{ readonly workers: number; readonly row: ThroughputRow | undefined }>
}

const throughputEntries = (inputs: ChartInputs): ReadonlyArray<ThroughputEntry> => {
  const library = (id: string, c: number) => {
    const level = inputs.uncontended?.byConcurrency.find((l) => l.concurrency === c)
    return [...(level?.memory ?? []), ...(level?.postgres ?? [])].find((r) => r.id === id)
  }
  const peer = (id: string, c: number) => inputs.peers?.uncontended.find((l) => l.concurrency === c)?.rows.find((r) => r.id === id)
  const levels = [1, 16]
  const entry = (name: string, floor: string, id: string, find: (id: string, c: number) => ThroughputRow | undefined) => ({
    name,
    floor,
    id,
    rows: levels.map((workers) => ({ workers, row: find(id, workers) }))
  })
  // The rows of the report's side-by-side table, in its order.
  return [
    entry("PgAdvisory.layer", "raw pg, same fenced statements", "pg-advisory", library),
    entry("PgLease.layer", "raw pg, same statements", "pg-lease", library),
    entry("PgAdvisory.withXactLock", "raw pg, same 5 statements", "pg-xact", library),
    entry("MemoryBackend.layer", "Effect.makeSemaphore", "memory", library),
    entry("advisory-lock", "raw pg lock + unlock", "advisory-lock", peer),
    entry("effect-distributed-lock", "raw Redis SET NX PX + CAD", "edl-push", peer)
  ].filter((e) => e.rows.some((r) => r.row?.result._tag === "Measured"))
}

const ratioOf = (row: ThroughputRow | undefined) =>
  row?.result._tag === "Measured" && row.result.ratio !== undefined
    ? { ratio: row.result.ratio.median, min: row.result.ratio.paired.min, max: row.result.ratio.paired.max, rate: row.result.cyclesPerSecond.median }
    : undefined

export const throughputChart = (inputs: ChartInputs): Chart | undefined => {
  const entries = throughputEntries(inputs)
  if (entries.length === 0) return undefined
  const BAR = 13
  const ROW = 2 * BAR + 24
  // The right margin holds the value labels.
  const frame: Frame = { left: 230, top: 76, right: WIDTH - 230, bottom: 76 + entries.length * ROW }
  const ratios = entries.flatMap((e) => e.rows.flatMap((r) => {
    const found = ratioOf(r.row)
    return found === undefined ? [] : [found.max, found.ratio]
  }))
  const x = linear([0, Math.max(1.2, ...ratios) * 1.05], [frame.left, frame.right], 8)
  const shade = (workers: number) => (workers === 1 ? 0.55 : 1)
  const rows = entries.flatMap((entry, i) => {
    const y0 = frame.top + i * ROW + 10
    const color = colorOf(entry.id)
    return [
      ...rowLabel(frame.left - 10, y0 + BAR - 1, entry.name, `vs ${entry.floor}`),
      ...entry.rows.flatMap((r, j) => {
        const found = ratioOf(r.row)
        const y = y0 + j * (BAR + 2)
        if (found === undefined) return [text(frame.left + 4, y + BAR - 2, `${r.workers} worker(s): not measured`, { size: 10 })]
        const end = x.map(found.ratio)
        return [
          el("rect", { x: frame.left, y, width: Math.max(1, end - frame.left), height: BAR, fill: color, "fill-opacity": shade(r.workers) }),
          // The range of the per-round ratios: how much one round can differ from another.
          el("line", { x1: x.map(found.min), x2: x.map(found.max), y1: y + BAR / 2, y2: y + BAR / 2, stroke: PALETTE.dark }),
          el("line", { x1: x.map(found.min), x2: x.map(found.min), y1: y + 3, y2: y + BAR - 3, stroke: PALETTE.dark }),
          el("line", { x1: x.map(found.max), x2: x.map(found.max), y1: y + 3, y2: y + BAR - 3, stroke: PALETTE.dark }),
          text(Math.max(end, x.map(found.max)) + 6, y + BAR - 2, `${found.ratio.toFixed(2)}× (${Math.round(found.rate).toLocaleString("en-US")}/s, ${r.workers === 1 ? "1 worker" : `${r.workers} workers`})`, { size: 10 })
        ]
      })
    ]
  })
  const floorLine = [
    el("line", { x1: x.map(1), x2: x.map(1), y1: frame.top - 6, y2: frame.bottom, stroke: PALETTE.dark, "stroke-dasharray": "5 3" }),
    text(x.map(1), frame.top - 10, "1.00× = the raw floor", { anchor: "middle", size: 10 })
  ]
  const height = frame.bottom + 50
  return {
    file: "chart-throughput.svg",
    alt: "Uncontended cycles per second of each backend and peer as a multiple of its own store's raw floor, 1 and 16 workers",
    svg: document(WIDTH, height, "Throughput as a multiple of the raw floor", [
      ...title(
        WIDTH,
        "Uncontended throughput as a multiple of the raw floor",
        "upper, lighter bar: 1 worker; lower bar: 16 workers; median over rounds; whiskers: per-round ratios (min–max); higher is better"
      ),
      ...xAxis(frame, x, "× the floor of the same store, measured in the same rounds"),
      ...floorLine,
      ...rows
    ])
  }
}

// ---------------------------------------------------------------- 2 and 3: handoff rows

interface HandoffSubject {
  readonly id: string
  readonly label: string
  readonly setup: string
  readonly row: HandoffRow & { readonly result: Extract<HandoffRow["result"], { readonly _tag: "Measured" }> }
}

const handoffSubjects = (inputs: ChartInputs): ReadonlyArray<HandoffSubject> => {
  const measured = (row: HandoffRow): row is HandoffSubject["row"] => row.result._tag === "Measured"
  const own = (inputs.handoff?.rows ?? []).filter(measured).map((row) => ({ id: row.id, label: row.label, setup: row.setup, row }))
  // The peers' run measures its own raw floor; it is the same store as scenario 2's, so one is enough.
  const peers = (inputs.peers?.handoff ?? [])
    .filter(measured)
    .filter((row) => !(row.id === "raw" && own.some((o) => o.id === "raw")))
    .map((row) => ({ id: row.id, label: row.label, setup: row.setup, row }))
  return [...own, ...peers]
}

/**
 * A round's latency quantiles, when the handoff recorder keeps them: `handoffQuantilesMs[i]` is
 * the i-th percentile (0..100) of the round's handoffs. Rounds without them have p50 and p99 only.
 */
interface WithQuantiles {
  readonly handoffQuantilesMs?: ReadonlyArray<number> | undefined
}

/** The median round's value at each percentile, when every round has its quantiles. */
const medianCurve = (subject: HandoffSubject): ReadonlyArray<number> | undefined => {
  const rounds = subject.row.result.rounds as ReadonlyArray<WithQuantiles>
  const all = rounds.map((r) => r.handoffQuantilesMs)
  if (all.length === 0 || all.some((q) => q === undefined || q.length !== 101)) return undefined
  return Array.from({ length: 101 }, (_, p) => {
    const values = all.map((q) => q![p]!).sort((a, b) => a - b)
    return values[Math.floor(values.length / 2)]!
  })
}

export const handoffCdfChart = (inputs: ChartInputs): Chart | undefined => {
  const subjects = handoffSubjects(inputs)
  if (subjects.length === 0) return undefined
  const frame: Frame = { left: 80, top: 60, right: WIDTH - 60, bottom: 400 }
  const curvesOf = new Map(subjects.map((s) => [s.id, medianCurve(s)]))
  const complete = subjects.every((s) => curvesOf.get(s.id) !== undefined)
  const values = subjects.flatMap((s) => [...s.row.result.p50Ms.rounds, ...s.row.result.p99Ms.rounds, ...(curvesOf.get(s.id) ?? [])])
  const x = log(logDomain(values), [frame.left, frame.right])
  const y = linear([0, 1], [frame.bottom, frame.top])
  const curves = subjects.flatMap((s) => {
    const color = colorOf(s.id)
    const r = s.row.result
    const dash = dashedVariant(s.id) ? "2 3" : undefined
    const curve = curvesOf.get(s.id)
    const points = [
      ...r.p50Ms.rounds.map((ms) => ({ ms, q: 0.5 })),
      ...r.p99Ms.rounds.map((ms) => ({ ms, q: 0.99 }))
    ]
    return [
      curve === undefined
        // Between p50 and p99 nothing was recorded: a straight dashed line, not a measured curve.
        ? el("line", {
          x1: x.map(r.p50Ms.median),
          y1: y.map(0.5),
          x2: x.map(r.p99Ms.median),
          y2: y.map(0.99),
          stroke: color,
          "stroke-width": 2,
          "stroke-dasharray": dash ?? "7 3"
        })
        : el("polyline", {
          points: curve.map((ms, p) => `${x.map(ms).toFixed(1)},${y.map(p / 100).toFixed(1)}`).join(" "),
          fill: "none",
          stroke: color,
          "stroke-width": 2,
          "stroke-dasharray": dash
        }),
      ...points.map((p) => el("circle", { cx: x.map(p.ms), cy: y.map(p.q), r: 3, fill: color, "fill-opacity": 0.35 })),
      el("circle", { cx: x.map(r.p50Ms.median), cy: y.map(0.5), r: 5, fill: color, stroke: "#ffffff" }),
      el("circle", { cx: x.map(r.p99Ms.median), cy: y.map(0.99), r: 5, fill: color, stroke: "#ffffff" })
    ]
  })
  const marks = [
    text(frame.right + 6, y.map(0.5) + 4, "p50", { size: 11 }),
    text(frame.right + 6, y.map(0.99) + 4, "p99", { size: 11 })
  ]
  const perRow = 2
  const legendTop = frame.bottom + 62
  const height = legendTop + Math.ceil(subjects.length / perRow) * 18 + 12
  const subtitle = complete
    ? "8 contenders on one name; lines: the median round's distribution; dots: each round's p50 and p99; log scale"
    : "8 contenders on one name; the runs recorded p50 and p99 only: small dots each round, large dots the median round, dashed between them; log scale"
  return {
    file: "chart-handoff-latency.svg",
    alt: "Handoff latency distribution of each backend and peer: p50 and p99 of every round, on a log scale",
    svg: document(WIDTH, height, "Handoff latency distribution", [
      ...title(WIDTH, "Handoff latency distribution (CDF)", subtitle),
      ...xAxis(frame, x, "handoff latency, ms (release → next holder's grant)"),
      ...yAxis(frame, y, "share of handoffs at most this long"),
      ...marks,
      ...curves,
      ...legend(
        frame.left - 40,
        legendTop,
        subjects.map((s) => ({ label: `${s.label} (${s.setup})`, color: colorOf(s.id), dashed: dashedVariant(s.id) })),
        440,
        perRow
      )
    ])
  }
}

export const longestWaitChart = (inputs: ChartInputs): Chart | undefined => {
  const subjects = handoffSubjects(inputs)
  if (subjects.length === 0) return undefined
  const ROW = 32
  const frame: Frame = { left: 375, top: 60, right: WIDTH - 70, bottom: 60 + subjects.length * ROW + 6 }
  const values = subjects.flatMap((s) => s.row.result.longestWaitMs.rounds)
  const x = log(logDomain(values), [frame.left, frame.right])
  const rows = subjects.flatMap((s, i): ReadonlyArray<Node> => {
    const r = s.row.result.longestWaitMs
    const y = frame.top + 6 + i * ROW
    const color = colorOf(s.id)
    return [
      ...rowLabel(frame.left - 10, y + 10, s.label, s.setup),
      el("rect", { x: frame.left, y: y + 3, width: Math.max(1, x.map(r.median) - frame.left), height: 14, fill: color, "fill-opacity": dashedVariant(s.id) ? 0.55 : 1 }),
      // Every round's longest wait, so the worst round is visible too.
      ...r.rounds.map((ms) => el("circle", { cx: x.map(ms), cy: y + 10, r: 2.5, fill: PALETTE.dark })),
      text(Math.max(x.map(r.median), x.map(r.max)) + 6, y + 14, `${Math.round(r.median).toLocaleString("en-US")} ms`, { size: 10 })
    ]
  })
  const height = frame.bottom + 52
  return {
    file: "chart-longest-wait.svg",
    alt: "Longest wait of any contender for each backend and peer: the median round as a bar, every round as a dot, log scale",
    svg: document(WIDTH, height, "Longest wait per contender", [
      ...title(WIDTH, "Longest wait of any contender, asking → grant", "8 contenders on one name; bar: the median round; dots: every round; log scale; lower is fairer"),
      ...xAxis(frame, x, "longest wait in a round, ms"),
      ...rows
    ])
  }
}

/** Every chart the inputs have figures for. */
export const charts = (inputs: ChartInputs): ReadonlyArray<Chart> =>
  [throughputChart(inputs), handoffCdfChart(inputs), longestWaitChart(inputs)].filter((c): c is Chart => c !== undefined)

/** Markers around the charts section of a report, so `--charts-only` can replace it in place. */
export const CHARTS_START = "<!-- charts: drawn by bench/lib/svgCharts.ts from results.json -->"
export const CHARTS_END = "<!-- /charts -->"

/** The report's charts section; `prefix` is prepended to each file name (for partial runs). */
export const renderChartsSection = (list: ReadonlyArray<Chart>, prefix = ""): string =>
  list.length === 0 ? "" : [
    "## Charts",
    "",
    CHARTS_START,
    ...list.flatMap((c) => [`![${c.alt}](${prefix}${c.file})`, ""]),
    CHARTS_END
  ].join("\n")

/**
 * A report with its charts section put in place of the old one, or, in a report that has none,
 * before its first numbered scenario section (after the side-by-side table).
 */
export const withChartsSection = (report: string, section: string): string => {
  const start = report.indexOf("## Charts\n\n" + CHARTS_START)
  const end = report.indexOf(CHARTS_END)
  if (start >= 0 && end > start) return report.slice(0, start) + section + report.slice(end + CHARTS_END.length)
  const anchor = report.search(/^## 1\. /m)
  if (anchor < 0) return `${report.trimEnd()}\n\n${section}\n`
  return `${report.slice(0, anchor)}${section}\n\n${report.slice(anchor)}`
}

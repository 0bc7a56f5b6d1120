/**
 * The demo's timeline as a picture: one lane per worker process, a bar for each time it held the
 * lock (its token on the bar, red where it ended lost), a tick for each fenced write, the session
 * kill (or, on SQLite, the holder's crash), the freeze, and the write the fence refused.
 */
import { document, el, legend, linear, type Node, PALETTE, text, title, xAxis } from "../bench/lib/svg.js"

/** One grant, from the worker's report of it to its release or loss. */
export interface Hold {
  readonly worker: number
  readonly token: string
  readonly start: number
  end?: number
  lost?: string
}

const BACKEND_NAMES: Readonly<Record<string, string>> = { advisory: "PgAdvisory", lease: "PgLease", sqlite: "SqliteLease", redis: "RedisLease" }

/** Everything the picture shows; times are epoch milliseconds. */
export interface Timeline {
  readonly backend: string
  readonly workers: number
  readonly ttlMs: number
  start: number
  end: number
  readonly holds: Array<Hold>
  readonly writes: Array<{ readonly worker: number; readonly at: number; readonly round: number }>
  /** The first disruption: a session kill (PostgreSQL), or a crash of the holder process (SQLite). */
  readonly kills: Array<{ readonly worker: number; readonly at: number; readonly label: string }>
  readonly freezes: Array<{ readonly worker: number; readonly from: number; to?: number }>
  readonly refused: Array<{ readonly worker: number; readonly at: number; readonly token: string; readonly current: string }>
  readonly takeovers: Array<{ readonly worker: number; readonly at: number; readonly cause: string; readonly ms: number }>
}

export const emptyTimeline = (backend: string, workers: number, ttlMs: number, start: number): Timeline => ({
  backend,
  workers,
  ttlMs,
  start,
  end: start,
  holds: [],
  writes: [],
  kills: [],
  freezes: [],
  refused: [],
  takeovers: []
})

/** The grant `worker` holds with `token`, if it is still open. */
export const openHold = (timeline: Timeline, worker: number, token: string): Hold | undefined =>
  timeline.holds.find((h) => h.worker === worker && h.token === token && h.end === undefined)

const WIDTH = 1000
const LANE = 54
const BAR = 22
/** Roughly the width of a character of the 10 px labels, to keep them inside the picture. */
const CHAR_WIDTH = 5.6

export const renderTimeline = (timeline: Timeline): string => {
  const frame = { left: 90, top: 70, right: WIDTH - 30, bottom: 70 + timeline.workers * LANE }
  const seconds = (t: number) => (t - timeline.start) / 1000
  const x = linear([0, Math.max(1, seconds(timeline.end))], [frame.left, frame.right], 10)
  const at = (t: number) => x.map(seconds(t))
  const laneTop = (worker: number) => frame.top + (worker - 1) * LANE
  const barY = (worker: number) => laneTop(worker) + (LANE - BAR) / 2
  /** A 10 px label right of `x0`, or left of it when it would run past the picture's edge. */
  const label = (x0: number, y: number, content: string, fill: string): Node =>
    x0 + 3 + content.length * CHAR_WIDTH > WIDTH - 4
      ? text(x0 - 3, y, content, { anchor: "end", size: 10, fill })
      : text(x0 + 3, y, content, { size: 10, fill })

  const lanes = Array.from({ length: timeline.workers }, (_, i): ReadonlyArray<Node> => [
    el("rect", { x: frame.left, y: laneTop(i + 1), width: frame.right - frame.left, height: LANE, fill: i % 2 === 0 ? "#fafafa" : "#ffffff" }),
    text(frame.left - 10, laneTop(i + 1) + LANE / 2 + 4, `worker ${i + 1}`, { anchor: "end", weight: "bold" })
  ]).flat()

  /** The token on the bar; for a lost grant the reason too, beside the bar when the bar is short. */
  const barText = (x0: number, x1: number, y: number, token: string, full: string): ReadonlyArray<Node> => {
    const inside = (content: string) => text((x0 + x1) / 2, y + BAR / 2 + 4, content, { anchor: "middle", size: 10, fill: "#ffffff" })
    if (x1 - x0 > full.length * CHAR_WIDTH + 8) return [inside(full)]
    const rest = full === token ? [] : [label(x1, y - 3, full.slice(token.length + 3), PALETTE.red)]
    return [...(x1 - x0 > token.length * CHAR_WIDTH + 8 ? [inside(token)] : []), ...rest]
  }

  const holds = timeline.holds.flatMap((hold): ReadonlyArray<Node> => {
    const x0 = at(hold.start)
    const x1 = at(hold.end ?? timeline.end)
    const y = barY(hold.worker)
    const lost = hold.lost !== undefined
    return [
      el("rect", {
        x: x0,
        y,
        width: Math.max(1.5, x1 - x0),
        height: BAR,
        fill: lost ? PALETTE.red : PALETTE.blue,
        "fill-opacity": lost ? 0.85 : 0.75
      }),
      ...barText(x0, x1, y, hold.token, lost ? `${hold.token} · lost: ${hold.lost}` : hold.token)
    ]
  })

  const writes = timeline.writes.map((w) =>
    el("line", { x1: at(w.at), x2: at(w.at), y1: barY(w.worker) + BAR + 2, y2: barY(w.worker) + BAR + 8, stroke: PALETTE.dark })
  )

  const freezes = timeline.freezes.flatMap((f): ReadonlyArray<Node> => {
    const x0 = at(f.from)
    const x1 = at(f.to ?? timeline.end)
    return [
      el("rect", {
        x: x0,
        y: laneTop(f.worker) + 2,
        width: Math.max(1, x1 - x0),
        height: LANE - 4,
        fill: PALETTE.grey,
        "fill-opacity": 0.35,
        stroke: PALETTE.grey,
        "stroke-dasharray": "4 2"
      }),
      text((x0 + x1) / 2, laneTop(f.worker) + 12, `frozen (SIGSTOP) ${Math.round((f.to ?? timeline.end) - f.from)} ms`, {
        anchor: "middle",
        size: 10
      })
    ]
  })

  const kills = timeline.kills.flatMap((k): ReadonlyArray<Node> => [
    el("line", { x1: at(k.at), x2: at(k.at), y1: frame.top - 14, y2: frame.bottom, stroke: PALETTE.red, "stroke-width": 2 }),
    label(at(k.at), frame.top - 4, k.label, PALETTE.red)
  ])

  const refused = timeline.refused.flatMap((r): ReadonlyArray<Node> => {
    const cx = at(r.at)
    const cy = barY(r.worker) + BAR / 2
    return [
      el("path", {
        d: `M${cx - 7} ${cy - 7} L${cx + 7} ${cy + 7} M${cx - 7} ${cy + 7} L${cx + 7} ${cy - 7}`,
        stroke: PALETTE.purple,
        "stroke-width": 3
      }),
      label(cx + 7, laneTop(r.worker) + LANE - 3, `write with token ${r.token} refused by the fence (current ${r.current})`, PALETTE.purple)
    ]
  })

  const takeovers = timeline.takeovers.map((t) =>
    label(at(t.at), barY(t.worker) - 3, `takes over ${t.ms} ms after the ${t.cause}`, PALETTE.blue)
  )

  const height = frame.bottom + 84
  return document(WIDTH, height, `effect-lock demo timeline (${timeline.backend})`, [
    ...title(
      WIDTH,
      `effect-lock demo: ${timeline.workers} worker processes, ${BACKEND_NAMES[timeline.backend] ?? timeline.backend} backend`,
      timeline.backend === "advisory"
        ? "who holds the lock over time, with its fencing token; session advisory locks (no ttl)"
        : `who holds the lock over time, with its fencing token; lease ttl ${timeline.ttlMs} ms`
    ),
    ...lanes,
    ...xAxis(frame, x, "seconds since the demo started"),
    ...freezes,
    ...holds,
    ...writes,
    ...kills,
    ...takeovers,
    ...refused,
    ...legend(frame.left, height - 14, [
      { label: "holds the lock (token)", color: PALETTE.blue, shape: "box" },
      { label: "held until lost", color: PALETTE.red, shape: "box" },
      { label: "frozen", color: PALETTE.grey, shape: "box" },
      { label: timeline.backend === "sqlite" ? "crash (SIGKILL)" : timeline.backend === "redis" ? "connection kill" : "session kill", color: PALETTE.red },
      { label: "refused write (✕)", color: PALETTE.purple },
      { label: "fenced write (tick)", color: PALETTE.dark }
    ], 150, 6)
  ])
}

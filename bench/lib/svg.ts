/**
 * A small SVG writer for the benchmark charts and the demo's timeline: elements as values,
 * escaped text, linear and logarithmic scales with readable ticks, and the frame of a chart
 * (title, axes, grid, legend). No chart library: the pictures are simple and must stay
 * reproducible from the committed figures.
 */

/** An element: a tag, its attributes (undefined ones are left out) and its children. */
export interface Node {
  readonly tag: string
  readonly attrs: Readonly<Record<string, string | number | undefined>>
  readonly children: ReadonlyArray<Node | string>
}

export const el = (
  tag: string,
  attrs: Readonly<Record<string, string | number | undefined>> = {},
  ...children: ReadonlyArray<Node | string | ReadonlyArray<Node | string>>
): Node => ({ tag, attrs, children: children.flat() })

const escape = (text: string): string =>
  text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;")

/** Numbers in attributes: two decimals at most, so files stay small and diffs stable. */
const attrValue = (value: string | number): string =>
  typeof value === "number" ? String(Math.round(value * 100) / 100) : escape(value)

export const render = (node: Node | string, indent = ""): string => {
  if (typeof node === "string") return `${indent}${escape(node)}`
  const attrs = Object.entries(node.attrs)
    .filter((entry): entry is [string, string | number] => entry[1] !== undefined)
    .map(([key, value]) => ` ${key}="${attrValue(value)}"`)
    .join("")
  if (node.children.length === 0) return `${indent}<${node.tag}${attrs}/>`
  // Text stays on the element's line: whitespace inside <text> would be rendered.
  if (node.children.every((child) => typeof child === "string")) {
    return `${indent}<${node.tag}${attrs}>${node.children.map((c) => escape(c as string)).join("")}</${node.tag}>`
  }
  const inner = node.children.map((child) => render(child, `${indent}  `)).join("\n")
  return `${indent}<${node.tag}${attrs}>\n${inner}\n${indent}</${node.tag}>`
}

/** A whole document; `title` is what screen readers and tooltips get. */
export const document = (width: number, height: number, title: string, children: ReadonlyArray<Node>): string =>
  `${render(
    el(
      "svg",
      {
        xmlns: "http://www.w3.org/2000/svg",
        width,
        height,
        viewBox: `0 0 ${width} ${height}`,
        "font-family": "DejaVu Sans, Helvetica, Arial, sans-serif",
        "font-size": 12,
        role: "img"
      },
      el("title", {}, title),
      el("rect", { x: 0, y: 0, width, height, fill: "#ffffff" }),
      ...children
    )
  )}\n`

// ---------------------------------------------------------------- scales

export interface Scale {
  readonly map: (value: number) => number
  readonly ticks: ReadonlyArray<number>
  readonly format: (value: number) => string
}

/** Ticks at 1, 2 or 5 × a power of ten, about `count` of them, covering [lo, hi]. */
export const niceTicks = (lo: number, hi: number, count = 5): Array<number> => {
  if (!(hi > lo)) return [lo]
  const raw = (hi - lo) / count
  const power = 10 ** Math.floor(Math.log10(raw))
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) ?? 10 * power
  const ticks: Array<number> = []
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Math.round(t / step) * step)
  return ticks
}

export const formatNumber = (value: number): string => {
  if (value === 0) return "0"
  const abs = Math.abs(value)
  if (abs >= 1000) return value.toLocaleString("en-US", { maximumFractionDigits: 0 })
  if (abs >= 10) return String(Math.round(value * 10) / 10)
  if (abs >= 1) return String(Math.round(value * 100) / 100)
  return String(Number(value.toPrecision(2)))
}

export const linear = (domain: readonly [number, number], range: readonly [number, number], count = 5): Scale => {
  const [d0, d1] = domain
  const [r0, r1] = range
  const span = d1 - d0 === 0 ? 1 : d1 - d0
  return {
    map: (value) => r0 + ((value - d0) / span) * (r1 - r0),
    ticks: niceTicks(d0, d1, count),
    format: formatNumber
  }
}

/** A log10 scale; ticks at 1, 2 and 5 of each decade (only 1 when the span is wide). */
export const log = (domain: readonly [number, number], range: readonly [number, number]): Scale => {
  const [d0, d1] = domain.map((d) => Math.log10(d)) as [number, number]
  const [r0, r1] = range
  const span = d1 - d0 === 0 ? 1 : d1 - d0
  // 1-2-5 ticks crowd each other beyond three decades: then one per decade.
  const steps = d1 - d0 > 3 ? [1] : [1, 2, 5]
  const ticks: Array<number> = []
  for (let decade = Math.floor(d0); decade <= Math.ceil(d1); decade++) {
    for (const m of steps) {
      const t = m * 10 ** decade
      if (Math.log10(t) >= d0 - 1e-9 && Math.log10(t) <= d1 + 1e-9) ticks.push(t)
    }
  }
  return {
    map: (value) => r0 + ((Math.log10(Math.max(value, 1e-12)) - d0) / span) * (r1 - r0),
    ticks,
    format: formatNumber
  }
}

/** The domain of a log axis: whole decades around the values. */
export const logDomain = (values: ReadonlyArray<number>): [number, number] => {
  const finite = values.filter((v) => Number.isFinite(v) && v > 0)
  if (finite.length === 0) return [1, 10]
  return [10 ** Math.floor(Math.log10(Math.min(...finite))), 10 ** Math.ceil(Math.log10(Math.max(...finite)))]
}

// ---------------------------------------------------------------- chart frame

/** Colours that stay distinct for colour-blind readers (Paul Tol's "bright" scheme) and a grey. */
export const PALETTE = {
  blue: "#4477AA",
  cyan: "#66CCEE",
  green: "#228833",
  yellow: "#CCBB44",
  red: "#EE6677",
  purple: "#AA3377",
  grey: "#888888",
  dark: "#333333",
  faint: "#e6e6e6"
} as const

/** The plotting area inside a chart's margins. */
export interface Frame {
  readonly left: number
  readonly top: number
  readonly right: number
  readonly bottom: number
}

export const text = (
  x: number,
  y: number,
  content: string,
  options: { readonly anchor?: "start" | "middle" | "end"; readonly size?: number; readonly weight?: string; readonly fill?: string; readonly rotate?: number } = {}
): Node =>
  el(
    "text",
    {
      x,
      y,
      "text-anchor": options.anchor ?? "start",
      "font-size": options.size,
      "font-weight": options.weight,
      fill: options.fill ?? PALETTE.dark,
      transform: options.rotate === undefined ? undefined : `rotate(${options.rotate} ${x} ${y})`
    },
    content
  )

export const title = (width: number, heading: string, subtitle?: string): ReadonlyArray<Node> => [
  text(width / 2, 22, heading, { anchor: "middle", size: 15, weight: "bold" }),
  ...(subtitle === undefined ? [] : [text(width / 2, 40, subtitle, { anchor: "middle", size: 11, fill: "#555555" })])
]

/** Vertical grid lines and labels of a horizontal value axis at the bottom of the frame. */
export const xAxis = (frame: Frame, scale: Scale, label: string): ReadonlyArray<Node> => [
  ...scale.ticks.flatMap((t) => [
    el("line", { x1: scale.map(t), x2: scale.map(t), y1: frame.top, y2: frame.bottom, stroke: PALETTE.faint }),
    text(scale.map(t), frame.bottom + 16, scale.format(t), { anchor: "middle", size: 11 })
  ]),
  el("line", { x1: frame.left, x2: frame.right, y1: frame.bottom, y2: frame.bottom, stroke: PALETTE.dark }),
  text((frame.left + frame.right) / 2, frame.bottom + 36, label, { anchor: "middle" })
]

/** Horizontal grid lines and labels of a vertical value axis at the left of the frame. */
export const yAxis = (frame: Frame, scale: Scale, label: string): ReadonlyArray<Node> => [
  ...scale.ticks.flatMap((t) => [
    el("line", { x1: frame.left, x2: frame.right, y1: scale.map(t), y2: scale.map(t), stroke: PALETTE.faint }),
    text(frame.left - 6, scale.map(t) + 4, scale.format(t), { anchor: "end", size: 11 })
  ]),
  el("line", { x1: frame.left, x2: frame.left, y1: frame.top, y2: frame.bottom, stroke: PALETTE.dark }),
  text(frame.left - 44, (frame.top + frame.bottom) / 2, label, { anchor: "middle", rotate: -90 })
]

export interface LegendItem {
  readonly label: string
  readonly color: string
  readonly dashed?: boolean
  readonly shape?: "line" | "box"
}

/** A legend laid out in rows of up to `perRow` items starting at (x, y). */
export const legend = (x: number, y: number, items: ReadonlyArray<LegendItem>, columnWidth: number, perRow: number): ReadonlyArray<Node> =>
  items.flatMap((item, i) => {
    const cx = x + (i % perRow) * columnWidth
    const cy = y + Math.floor(i / perRow) * 18
    const mark = item.shape === "box"
      ? el("rect", { x: cx, y: cy - 9, width: 14, height: 10, fill: item.color })
      : el("line", {
        x1: cx,
        x2: cx + 18,
        y1: cy - 4,
        y2: cy - 4,
        stroke: item.color,
        "stroke-width": 2.5,
        "stroke-dasharray": item.dashed === true ? "5 3" : undefined
      })
    return [mark, text(cx + 24, cy, item.label, { size: 11 })]
  })

/**
 * Markdown rendering for RESULTS.md: tables, number formats, targets.
 */
import type { Spread } from "./stats.js"

export type Status = "PASS" | "MISS" | "N/A"

/** One target of the issue, judged from figures of this run. */
export interface Target {
  readonly target: string
  readonly subject: string
  readonly status: Status
  /** The measured figures the verdict rests on. */
  readonly detail: string
}

const escapeCell = (cell: string): string => cell.replace(/\|/g, "\\|").replace(/\n/g, " ")

/** A GitHub-flavoured markdown table; `align` per column, "r" for numbers. */
export const table = (headers: ReadonlyArray<string>, rows: ReadonlyArray<ReadonlyArray<string>>, align?: ReadonlyArray<"l" | "r">): string => {
  const rule = headers.map((_, i) => (align?.[i] === "r" ? "---:" : "---"))
  return [headers, rule, ...rows].map((row) => `| ${row.map(escapeCell).join(" | ")} |`).join("\n")
}

const group = (n: number, digits: number): string =>
  n.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits })

/** Operations per second: 3 significant figures, thousands grouped. */
export const rate = (n: number): string => {
  if (!Number.isFinite(n)) return "–"
  if (n >= 100) return group(Math.round(n), 0)
  if (n >= 10) return group(n, 1)
  return group(n, 2)
}

/** Milliseconds with a precision that suits their size. */
export const ms = (n: number): string => {
  if (!Number.isFinite(n)) return "–"
  if (n < 0.1) return n.toFixed(3)
  if (n < 10) return n.toFixed(2)
  if (n < 100) return n.toFixed(1)
  return group(Math.round(n), 0)
}

export const ratio = (n: number): string => (Number.isFinite(n) ? `${n.toFixed(2)}×` : "–")

export const percent = (n: number): string => (Number.isFinite(n) ? `${(n * 100).toFixed(1)}%` : "–")

export const mib = (bytes: number): string => (Number.isFinite(bytes) ? `${(bytes / (1024 * 1024)).toFixed(1)} MiB` : "–")

export const integer = (n: number): string => (Number.isFinite(n) ? group(Math.round(n), 0) : "–")

/** `min–max` of a spread, formatted. */
export const range = (s: Spread, format: (n: number) => string): string =>
  s.rounds.length === 0 ? "–" : `${format(s.min)}–${format(s.max)}`

export const renderTargets = (targets: ReadonlyArray<Target>): string =>
  table(
    ["Target", "Subject", "Result", "Measured"],
    targets.map((t) => [t.target, t.subject, t.status === "PASS" ? "**PASS**" : t.status === "MISS" ? "**MISS**" : "n/a", t.detail])
  )

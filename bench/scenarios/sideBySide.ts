/**
 * The side-by-side table at the top of the report: effect-lock's backends and the peers, each
 * as a ratio to the floor of its own store measured in the same rounds (scenarios 1, 2 and 4).
 */
import * as Report from "../lib/report.js"
import type { HandoffRow } from "../lib/handoff.js"
import type { ThroughputRow } from "../lib/throughput.js"
import type { HandoffResult } from "./handoff.js"
import type { PeersResult } from "./peers.js"
import type { UncontendedResult } from "./uncontended.js"

interface Entry {
  readonly name: string
  readonly floor: string
  readonly throughput: (concurrency: number) => ThroughputRow | undefined
  readonly handoff: HandoffRow | undefined
}

const cycles = (row: ThroughputRow | undefined): string => {
  if (row === undefined) return "–"
  if (row.result._tag === "Skipped") return "skipped"
  const ratio = row.result.ratio === undefined ? "" : ` (${Report.ratio(row.result.ratio.median)})`
  return `${Report.rate(row.result.cyclesPerSecond.median)}${ratio}`
}

const handoff = (row: HandoffRow | undefined, pick: "p50" | "longest" | "self"): string => {
  if (row === undefined) return "–"
  if (row.result._tag === "Skipped") return "skipped"
  const r = row.result
  switch (pick) {
    case "p50":
      return `${Report.ms(r.p50Ms.median)} (${r.p50Ratio === undefined ? "–" : Report.ratio(r.p50Ratio)})`
    case "longest":
      return `${Report.ms(r.longestWaitMs.median)} (${r.longestWaitRatio === undefined ? "–" : Report.ratio(r.longestWaitRatio)})`
    case "self":
      return Report.percent(r.selfReacquireShare.median)
  }
}

export const renderSideBySide = (
  uncontended: UncontendedResult | undefined,
  handoffs: HandoffResult | undefined,
  peers: PeersResult | undefined
): string | undefined => {
  if (uncontended === undefined && handoffs === undefined && peers === undefined) return undefined
  const library = (id: string) => (c: number) => {
    const level = uncontended?.byConcurrency.find((l) => l.concurrency === c)
    return [...(level?.memory ?? []), ...(level?.postgres ?? [])].find((r) => r.id === id)
  }
  const peer = (id: string) => (c: number) => peers?.uncontended.find((l) => l.concurrency === c)?.rows.find((r) => r.id === id)
  const libraryHandoff = (id: string) => handoffs?.rows.find((r) => r.id === id)
  const peerHandoff = (id: string) => peers?.handoff.find((r) => r.id === id)
  const entries: ReadonlyArray<Entry> = [
    { name: "effect-lock PgAdvisory.layer", floor: "raw pg, same fenced statements", throughput: library("pg-advisory"), handoff: libraryHandoff("pg-advisory-8") },
    { name: "effect-lock PgLease.layer", floor: "raw pg, same statements", throughput: library("pg-lease"), handoff: libraryHandoff("pg-lease-notify") },
    { name: "effect-lock PgAdvisory.withXactLock", floor: "@effect/sql-pg withTransaction, same statements", throughput: library("pg-xact"), handoff: undefined },
    { name: "effect-lock MemoryBackend.layer", floor: "Effect.makeSemaphore", throughput: library("memory"), handoff: undefined },
    { name: "advisory-lock", floor: "raw pg lock + unlock", throughput: peer("advisory-lock"), handoff: peerHandoff("advisory-lock") },
    { name: "effect-distributed-lock (defaults)", floor: "raw Redis SET NX PX + CAD", throughput: peer("edl-push"), handoff: peerHandoff("edl-push") }
  ]
  return Report.table(
    ["Library / backend", "cycles/s floor", "1 worker cycles/s (× floor)", "16 workers cycles/s (× floor)", "handoff p50 ms (× raw pg)", "longest wait ms (× raw pg)", "self re-acquire"],
    entries.map((e) => [
      e.name,
      e.floor,
      cycles(e.throughput(1)),
      cycles(e.throughput(16)),
      handoff(e.handoff, "p50"),
      handoff(e.handoff, "longest"),
      handoff(e.handoff, "self")
    ]),
    ["l", "l", "r", "r", "r", "r", "r"]
  )
}

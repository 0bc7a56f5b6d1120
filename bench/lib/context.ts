/** What every scenario receives from the orchestrator. */
import type { Target } from "./report.js"

export interface Settings {
  readonly quick: boolean
  /** Measured rounds per subject (after one warm-up). */
  readonly rounds: number
  /** Length of one throughput round against PostgreSQL. */
  readonly throughputMs: number
  /** Length of one throughput round of the in-memory rows. */
  readonly memoryThroughputMs: number
  /** Length of one handoff round. */
  readonly handoffMs: number
  /** Lock counts of the scale scenario. */
  readonly scaleCounts: ReadonlyArray<number>
  /** Largest advisory lock count attempted in the scale scenario. */
  readonly scaleAdvisoryMax: number
}

export interface Context {
  readonly adminUrl: string
  readonly settings: Settings
  readonly log: (message: string) => void
}

/** A scenario module: runs, then renders its own section of RESULTS.md and judges its targets. */
export interface Scenario<R> {
  readonly name: string
  readonly title: string
  readonly run: (context: Context) => Promise<R>
  readonly render: (result: R) => string
  readonly targets: (result: R) => ReadonlyArray<Target>
}

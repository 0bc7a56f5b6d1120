/** What a demo worker tells the orchestrator, one JSON object per stdout line. */
export type WorkerEvent =
  | { readonly e: "ready" }
  | { readonly e: "acquired"; readonly token: string }
  /** The round's write is on its way to the database (it can no longer be called back). */
  | { readonly e: "writing"; readonly token: string }
  | { readonly e: "wrote"; readonly token: string; readonly round: number }
  | { readonly e: "released"; readonly token: string }
  | { readonly e: "lost"; readonly token: string; readonly reason: string }
  | { readonly e: "stale-rejected"; readonly token: string; readonly current: string }
  | { readonly e: "error"; readonly message: string }

export type Stamped = WorkerEvent & { readonly t: number; readonly w: number }

export const LOCK_NAME = "demo-nightly-job"
export const FENCE_RESOURCE = "demo_rounds"
export const applicationName = (worker: number) => `effect-lock-demo-w${worker}`

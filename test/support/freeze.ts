/**
 * Freezing server processes (SIGSTOP) in tests, and always continuing them: a test that times out
 * may never close its scope, so whatever a file stopped is continued after the file (its
 * `afterAll`) and when the test process exits.
 */
import { Effect, type Scope } from "effect"
import { afterAll } from "vitest"

const stopped = new Set<number>()

/** Continues a stopped process (SIGCONT); a process that is gone is ignored. */
export const thaw = (pid: number): void => {
  stopped.delete(pid)
  try {
    process.kill(pid, "SIGCONT")
  } catch {
    // already gone
  }
}

/** Stops a process (SIGSTOP) until `thaw`, the file's end or the test process's exit. */
export const stop = (pid: number): void => {
  stopped.add(pid)
  process.kill(pid, "SIGSTOP")
}

afterAll(() => stopped.forEach(thaw))
process.once("exit", () => stopped.forEach(thaw))

/** SIGSTOPs server processes for as long as the scope lasts; SIGCONT on close, whatever happened. */
export const frozen = (pids: ReadonlyArray<number>): Effect.Effect<void, never, Scope.Scope> =>
  Effect.acquireRelease(Effect.sync(() => pids.forEach(stop)), () => Effect.sync(() => pids.forEach(thaw))).pipe(Effect.asVoid)

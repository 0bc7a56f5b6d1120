/**
 * A subject measured in a process of its own (a throughput row, or a handoff row: `isolatedRounds`). The parent keeps the interleaving (a row
 * and its baselines still run round after round, seconds apart, under the same background load),
 * but no subject's JIT state, heap or background work taxes another's: in one process, the rows of
 * every backend, the raw clients and the peers share V8's inline caches (every Effect program's
 * steps pass through the same runtime functions, which then see every shape at once) and each
 * other's garbage and timers. An application holds one lock layer, not all of them; JMH forks a
 * JVM per benchmark for the same reason.
 *
 * The child (`isolatedChild.ts`) builds the subject with the same factory and arguments and
 * answers one JSON line per command: open, run a round, profile a round, close.
 */
import { spawn } from "node:child_process"
import * as Readline from "node:readline"
import { fileURLToPath } from "node:url"
import type { ThroughputSample } from "./loops.js"
import type { Database } from "./postgres.js"
import type { Allocated, Profiled } from "./profiling.js"
import type { Subject, Trial } from "./rounds.js"
import { countLogLines } from "./runtime.js"
import { Samples } from "./stats.js"

const CHILD = fileURLToPath(new URL("./isolatedChild.ts", import.meta.url))

/** Starts every answer line of the child: any other line is the subject's own output, passed on. */
export const ANSWER_MARK = "\u0001effect-lock-bench-answer "

/** What the child is asked to build: `FACTORIES[factory]` (or `[table][factory]`) of `module`, called with the database (or `undefined`) and `args`. */
export interface Recipe {
  readonly module: string
  readonly factory: string
  /** The module's export that holds the factory (default `FACTORIES`). */
  readonly table?: string | undefined
  readonly database?: Pick<Database, "name" | "url"> | undefined
  readonly args: ReadonlyArray<unknown>
  /** "rounds": the subject's rounds are plain JSON (a handoff round) and come back as they are; default a throughput sample. */
  readonly kind?: "throughput" | "rounds" | undefined
}

/** A trial that can also profile one round where it runs (see `profiling.ts`). */
export interface ProfilingTrial<R> extends Trial<R> {
  readonly profile?: () => Promise<Profiled>
  /** Samples one round's allocations where it runs (see `profiling.ts`). */
  readonly allocations?: () => Promise<Allocated>
}

interface Answer {
  readonly ok: boolean
  readonly error?: string
  readonly sample?: { readonly cycles: number; readonly seconds: number; readonly latencies: Array<number>; readonly cpuMs?: number }
  readonly round?: unknown
  readonly profiled?: Profiled
  readonly allocated?: Allocated
  readonly logLines?: number
}

const revive = (sample: NonNullable<Answer["sample"]>): ThroughputSample => {
  const latencies = new Samples()
  for (const value of sample.latencies) latencies.push(value)
  return { cycles: sample.cycles, seconds: sample.seconds, latencies, ...(sample.cpuMs === undefined ? {} : { cpuMs: sample.cpuMs }) }
}

/** `subject`, measured in a child process that builds it from `recipe`. */
export const isolated = (subject: Subject<ThroughputSample>, recipe: Recipe): Subject<ThroughputSample> =>
  inChild(subject, { ...recipe, kind: "throughput" }, (answer) => revive(answer.sample!))

/**
 * A subject whose rounds are plain JSON (a handoff round), measured in a child process that
 * builds it from `recipe`: the round comes back as the child recorded it.
 */
export const isolatedRounds = <R>(subject: Subject<R>, recipe: Omit<Recipe, "kind">): Subject<R> =>
  inChild(subject, { ...recipe, kind: "rounds" }, (answer) => nonFinite(answer.round) as R)

/**
 * A round as the child recorded it: JSON wrote its non-finite numbers (a round without handoffs
 * has no percentiles: NaN) as `null`, which the summaries would read as 0.
 */
const nonFinite = (value: unknown): unknown =>
  value === null
    ? Number.NaN
    : Array.isArray(value)
    ? value.map(nonFinite)
    : typeof value === "object" && value !== undefined
    ? Object.fromEntries(Object.entries(value).map(([key, field]) => [key, nonFinite(field)]))
    : value

const inChild = <R>(subject: Subject<R>, recipe: Recipe, read: (answer: Answer) => R): Subject<R> => ({
  ...subject,
  open: async (): Promise<ProfilingTrial<R>> => {
    // The parent's loaders (tsx, and the library's build when the bench runs on it) and environment.
    const child = spawn(process.execPath, [...process.execArgv, CHILD, JSON.stringify(recipe)], { stdio: ["pipe", "pipe", "inherit"] })
    const pending: Array<(answer: Answer) => void> = []
    let exited: string | undefined
    Readline.createInterface({ input: child.stdout, crlfDelay: Infinity }).on("line", (line) => {
      if (!line.startsWith(ANSWER_MARK)) return void process.stdout.write(`  [${subject.id}] ${line}\n`)
      let answer: Answer
      try {
        answer = JSON.parse(line.slice(ANSWER_MARK.length)) as Answer
      } catch (error) {
        answer = { ok: false, error: `an answer that does not parse: ${String(error)}` }
      }
      pending.shift()?.(answer)
    })
    // "close", not "exit": the child's last answer may still be in its stdout when it exits.
    child.on("close", (code, signal) => {
      exited = `the process of ${subject.id} ended (${signal ?? code})`
      for (const answer of pending.splice(0)) answer({ ok: false, error: exited })
    })
    // A write to a child that died meanwhile fails its command (above), not the bench.
    child.stdin.on("error", () => {})
    const ask = (command: object): Promise<Answer> =>
      new Promise((resolve, reject) => {
        if (exited !== undefined) return reject(new Error(exited))
        pending.push((answer) => (answer.ok ? resolve(answer) : reject(new Error(answer.error ?? "failed"))))
        child.stdin.write(`${JSON.stringify(command)}\n`)
      })
    try {
      await ask({ op: "open" })
    } catch (error) {
      child.kill()
      throw error
    }
    return {
      run: async (round) => read(await ask({ op: "run", warmup: round.warmup })),
      // Profiling counts a throughput sample's cycles: a rounds subject has none to count.
      ...(recipe.kind === "rounds" ? {} : {
        profile: async () => (await ask({ op: "profile" })).profiled!,
        allocations: async () => (await ask({ op: "allocations" })).allocated!
      }),
      close: async () => {
        const answer = await ask({ op: "close" }).catch(() => undefined)
        countLogLines(answer?.logLines ?? 0)
        child.stdin.end()
      }
    }
  }
})

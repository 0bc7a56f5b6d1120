/**
 * The child process of `isolated.ts`: builds one subject from its recipe (argv[2]) and
 * answers the parent's commands, one marked JSON line each, on stdout.
 */
import * as Readline from "node:readline"
import { ANSWER_MARK, type Recipe } from "./isolated.js"
import type { ThroughputSample } from "./loops.js"
import { allocationRound, profileRound } from "./profiling.js"
import { reasonOf, type Subject, type Trial } from "./rounds.js"
import { libraryLogLines } from "./runtime.js"

// Answers go to stdout, one marked line each; whatever else prints, from here on, goes to stderr.
const stdout = process.stdout.write.bind(process.stdout)
process.stdout.write = ((chunk: unknown, ...rest: Array<unknown>) => (process.stderr.write as (...args: Array<unknown>) => boolean)(chunk, ...rest)) as typeof process.stdout.write
const answer = (value: object, then?: () => void) => stdout(`${ANSWER_MARK}${JSON.stringify(value)}\n`, then)

const recipe = JSON.parse(process.argv[2]!) as Recipe
const module = (await import(recipe.module)) as Record<string, Record<string, (...args: Array<unknown>) => Subject<unknown>> | undefined>
const database = recipe.database === undefined
  ? undefined
  : { ...recipe.database, drop: () => Promise.reject(new Error("the parent drops the database")) }
const table = recipe.table ?? "FACTORIES"
const made = module[table]?.[recipe.factory]
if (made === undefined) throw new Error(`${recipe.module} has no factory ${table}.${recipe.factory}`)
// Which it is, the recipe says: a throughput sample (encoded below) or a plain JSON round.
const subject = made(database, ...recipe.args) as Subject<ThroughputSample>
const plainRounds = recipe.kind === "rounds"

let trial: Trial<ThroughputSample> | undefined
let closing = false
const commands = Readline.createInterface({ input: process.stdin, crlfDelay: Infinity })
for await (const line of commands) {
  const command = JSON.parse(line) as { readonly op: string; readonly warmup?: boolean }
  try {
    if (command.op === "open") {
      trial = await subject.open()
      answer({ ok: true })
    } else if (command.op === "run") {
      // The process's own CPU clock over the round: the subject is all this process runs.
      const before = process.cpuUsage()
      const sample = await trial!.run({ warmup: command.warmup === true })
      const cpu = process.cpuUsage(before)
      if (plainRounds) answer({ ok: true, round: sample })
      else answer({
        ok: true,
        sample: { cycles: sample.cycles, seconds: sample.seconds, latencies: sample.latencies.values(), cpuMs: (cpu.user + cpu.system) / 1000 }
      })
    } else if (command.op === "profile") {
      const run = trial!.run
      answer({ ok: true, profiled: await profileRound(subject.id, () => run({ warmup: false }), (sample) => sample.cycles) })
    } else if (command.op === "allocations") {
      const run = trial!.run
      answer({ ok: true, allocated: await allocationRound(subject.id, () => run({ warmup: false }), (sample) => sample.cycles) })
    } else if (command.op === "close") {
      closing = true
      await trial?.close()
      // Exits once the last answer is written out.
      answer({ ok: true, logLines: libraryLogLines() }, () => process.exit(0))
      break
    }
  } catch (error) {
    answer({ ok: false, error: reasonOf(error) })
  }
}
// The parent is gone without a "close": nothing is left to measure for (open layers would keep this process alive).
if (!closing) process.exit(1)

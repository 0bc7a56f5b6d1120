/**
 * The child process of `isolated.ts`: builds one throughput subject from its recipe (argv[2]) and
 * answers the parent's commands, one JSON line each, on stdout.
 */
import * as Readline from "node:readline"
import type { Recipe } from "./isolated.js"
import type { ThroughputSample } from "./loops.js"
import { profileRound } from "./profiling.js"
import { reasonOf, type Subject, type Trial } from "./rounds.js"
import { libraryLogLines } from "./runtime.js"

const recipe = JSON.parse(process.argv[2]!) as Recipe
const module = (await import(recipe.module)) as { readonly FACTORIES: Record<string, (...args: Array<unknown>) => Subject<ThroughputSample>> }
const database = recipe.database === undefined
  ? undefined
  : { ...recipe.database, drop: () => Promise.reject(new Error("the parent drops the database")) }
const subject = module.FACTORIES[recipe.factory]!(database, ...recipe.args)

// Answers go to stdout, one line each; anything else the subject prints goes to stderr.
const answer = (value: object) => process.stdout.write(`${JSON.stringify(value)}\n`)
console.log = (...args: Array<unknown>) => console.error(...args)

let trial: Trial<ThroughputSample> | undefined
const commands = Readline.createInterface({ input: process.stdin, crlfDelay: Infinity })
for await (const line of commands) {
  const command = JSON.parse(line) as { readonly op: string; readonly warmup?: boolean }
  try {
    if (command.op === "open") {
      trial = await subject.open()
      answer({ ok: true })
    } else if (command.op === "run") {
      const sample = await trial!.run({ warmup: command.warmup === true })
      answer({ ok: true, sample: { cycles: sample.cycles, seconds: sample.seconds, latencies: sample.latencies.values() } })
    } else if (command.op === "profile") {
      const run = trial!.run
      answer({ ok: true, profiled: await profileRound(subject.id, () => run({ warmup: false }), (sample) => sample.cycles) })
    } else if (command.op === "close") {
      await trial?.close()
      answer({ ok: true, logLines: libraryLogLines() })
      break
    }
  } catch (error) {
    answer({ ok: false, error: reasonOf(error) })
  }
}
process.exit(0)

// Writes test/durations.json (seconds per test file, one decimal, longest first) from a
// `vitest run --reporter=json --outputFile=report.json` report, made in any clone:
//   node tools/durations.mjs report.json
// test/support/sequencer.ts starts the longest files first by it.
import * as Fs from "node:fs"
import * as Path from "node:path"

const report = JSON.parse(Fs.readFileSync(process.argv[2], "utf8"))
const root = Path.resolve(import.meta.dirname, "..")
const entries = report.testResults.flatMap((file) => {
  // The path from the repository root, whatever clone the report was made in.
  const relative = /(?:^|\/)((?:test|examples)\/.+)$/.exec(file.name)?.[1]
  return relative === undefined ? [] : [[relative, Math.round((file.endTime - file.startTime) / 100) / 10]]
})
const durations = Object.fromEntries(entries.sort((a, b) => b[1] - a[1]))
Fs.writeFileSync(Path.join(root, "test", "durations.json"), JSON.stringify(durations, null, 2) + "\n")
console.log(`test/durations.json: ${entries.length} files`)

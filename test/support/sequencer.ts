/**
 * The order test files start in: longest first, by the durations of a committed run
 * (`test/durations.json`, seconds per file; refresh it with `node tools/durations.mjs <report.json>`
 * from `vitest run --reporter=json`). Two workers take files in this order, so the longest go
 * first and the short ones fill in at the end: the run ends close to (total ÷ workers), not one
 * long file after everything else. Vitest's own order needs its results cache, which a fresh
 * clone (CI) does not have: there it runs the largest files first, and a small file that waits
 * on real time (the package installs, the chaos decks) may start last.
 */
import * as Fs from "node:fs"
import * as Path from "node:path"
import { BaseSequencer, type TestSpecification } from "vitest/node"

/** A file the committed run did not have: about a median file. */
const UNKNOWN_SECONDS = 8

const durationsOf = (root: string): Readonly<Record<string, number>> => {
  try {
    return JSON.parse(Fs.readFileSync(Path.join(root, "test", "durations.json"), "utf8")) as Record<string, number>
  } catch {
    // No list (or a broken one): every file counts the same, and the sort keeps vitest's order.
    return {}
  }
}

export class LongestFirst extends BaseSequencer {
  override async sort(files: Array<TestSpecification>): Promise<Array<TestSpecification>> {
    const ordered = await super.sort(files)
    const root = this.ctx.config.root
    const durations = durationsOf(root)
    const seconds = (spec: TestSpecification) => durations[Path.relative(root, spec.moduleId).split(Path.sep).join("/")] ?? UNKNOWN_SECONDS
    // A stable sort: equal durations keep vitest's order.
    return ordered.map((spec, i) => ({ spec, i, s: seconds(spec) })).sort((a, b) => b.s - a.s || a.i - b.i).map(({ spec }) => spec)
  }
}

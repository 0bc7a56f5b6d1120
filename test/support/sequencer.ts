/**
 * The order of the test files: longest first, so that the workers finish together. Without
 * timings of its own (a fresh clone, CI) vitest runs larger files first, and the files of the
 * contract suites are short files that wait out real ttls for 15-45 s: they came last, one or two
 * alone on a worker for the run's final half-minute (a fresh-clone run: 331 s, its last 36 s
 * PgLease.contract alone).
 *
 * The files below go first, in this order: the ones that took 10 s or more in a fresh-clone run
 * (at 4106d7d), longest first, except that the package test's npm installs run beside the
 * contract suites, not beside PgLease.test.ts, whose polling-handoff timing they once stretched
 * (492da05). The order only decides how long a run takes, never what it checks. Every other file
 * keeps vitest's order after them (larger first, or by its own timings once it has them).
 */
import { BaseSequencer, type TestSpecification } from "vitest/node"

const FIRST: ReadonlyArray<string> = [
  "RedisLease.contract.test.ts",
  "PgLease.contract.test.ts",
  "package.test.ts",
  "PgLease.semaphore.test.ts",
  "SqliteLease.test.ts",
  "PgLease.test.ts",
  "chaos.test.ts",
  "PgAdvisory.faults.test.ts",
  "MemoryBackend.test.ts",
  "PgAdvisory.test.ts",
  "demo.test.ts",
  "isolation.test.ts",
  "SqliteLease.semaphore.test.ts",
  "PgAdvisory.semaphore.contract.test.ts",
  "PgAdvisory.contract.test.ts",
  "schedule.process.test.ts",
  "PgTokens.test.ts",
  "schedule.test.ts",
  "SqliteLease.process.test.ts"
].map((file) => `/test/${file}`)

const rank = (file: TestSpecification): number => {
  const at = FIRST.findIndex((path) => file.moduleId.endsWith(path))
  return at === -1 ? FIRST.length : at
}

export default class Sequencer extends BaseSequencer {
  override async sort(files: Array<TestSpecification>): Promise<Array<TestSpecification>> {
    const sorted = await super.sort(files)
    // Stable: the files not named keep vitest's order among themselves.
    return sorted.map((file, index) => ({ file, index }))
      .sort((a, b) => rank(a.file) - rank(b.file) || a.index - b.index)
      .map(({ file }) => file)
  }
}

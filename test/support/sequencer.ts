/**
 * The order of the test files. Without timings of its own (a fresh clone, CI), vitest runs larger
 * files first; the contract files are short files whose cases wait out real ttls for 35-45 s, so
 * they came last, alone on a worker for the run's final half-minute (a fresh-clone run on two
 * workers: 331 s, its last 36 s PgLease.contract alone; 321 s with these two first). They go first here; every other
 * file keeps vitest's order (larger first, or by its own timings once it has them). A longer list,
 * every file of 10 s or more longest first, measured no better (333 s). The order only decides how
 * long a run takes, never what it checks.
 */
import { BaseSequencer, type TestSpecification } from "vitest/node"

const FIRST: ReadonlyArray<string> = ["RedisLease.contract.test.ts", "PgLease.contract.test.ts"].map((file) => `/test/${file}`)

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

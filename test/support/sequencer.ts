/**
 * The order of the test files. Without timings of its own (a fresh clone, CI), vitest runs larger
 * files first; the contract files are short files whose cases wait out real ttls for 35-45 s, so
 * they came last, each alone on a worker for the run's final half-minute (a fresh-clone run: 331 s,
 * of which the last 36 s PgLease.contract alone). They go first here; every other file keeps
 * vitest's order (larger first, or its own timings once it has them).
 */
import { BaseSequencer, type TestSpecification } from "vitest/node"

const FIRST: ReadonlyArray<string> = ["test/RedisLease.contract.test.ts", "test/PgLease.contract.test.ts"]

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

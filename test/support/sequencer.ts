/**
 * The order of the test files. Without timings of its own (a fresh clone, CI), vitest runs larger
 * files first; the contract files are short files whose cases wait out real ttls for 35-45 s, so
 * they came last, alone on a worker for the run's final half-minute (a fresh-clone run on two
 * workers: 331 s, its last 36 s PgLease.contract alone; 321 s with these two first). They go first here; every other
 * file keeps vitest's order (larger first, or by its own timings once it has them). A longer list,
 * every file of 10 s or more longest first, measured no better (333 s). The order only decides how
 * long a run takes, never what it checks.
 *
 * Two more files have places, for CPU. SqliteLease.test.ts suffers most from a busy machine:
 * better-sqlite3 is synchronous, so its five concurrent cases come as bursts of 150-400 ms of CPU,
 * and a burst that waits for a core (0.5-2.4 s runnable but not running, measured with 5-8
 * runnable tasks on 2 cores) delays the renewals its timing cases check. package.test.ts is the
 * run's heaviest user of CPU (npm pack and its build, installs, a type-check: 50-65 s of CPU,
 * 60-115 s long), so the two must not overlap. Third after the contract files and package.test.ts,
 * SqliteLease.test.ts started beside package.test.ts all the same (98 s in, on a loaded machine:
 * ten stalls of 1-2.3 s, three renewal cases failed). So SqliteLease.test.ts starts at once, beside
 * the contract files (their cases wait on sockets and get a core back at once), and
 * package.test.ts sixth: the two files before it start when the contract files end, so it starts
 * when SqliteLease.test.ts ends or after (measured: on SqliteLease.test.ts's worker as it ended).
 */
import { BaseSequencer, type TestSpecification } from "vitest/node"

/** A file's place in the order (its index), by the end of its path. */
const PLACES: ReadonlyArray<readonly [string, number]> = [
  ["/test/RedisLease.contract.test.ts", 0],
  ["/test/PgLease.contract.test.ts", 1],
  ["/test/SqliteLease.test.ts", 2],
  ["/test/package.test.ts", 5]
]

const placeOf = (file: TestSpecification): number | undefined =>
  PLACES.find(([path]) => file.moduleId.endsWith(path))?.[1]

export default class Sequencer extends BaseSequencer {
  override async sort(files: Array<TestSpecification>): Promise<Array<TestSpecification>> {
    // The files without a place keep vitest's order; each placed file goes in at its index.
    const sorted = (await super.sort(files)).filter((file) => placeOf(file) === undefined)
    const placed = files.filter((file) => placeOf(file) !== undefined).sort((a, b) => placeOf(a)! - placeOf(b)!)
    for (const file of placed) sorted.splice(Math.min(placeOf(file)!, sorted.length), 0, file)
    return sorted
  }
}

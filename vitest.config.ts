import { fileURLToPath } from "node:url"
import { defineConfig } from "vitest/config"
import Sequencer from "./test/support/sequencer.js"

export default defineConfig({
  resolve: {
    alias: [
      { find: /^effect-lock$/, replacement: fileURLToPath(new URL("./src/index.ts", import.meta.url)) },
      { find: /^effect-lock\/(.*)$/, replacement: fileURLToPath(new URL("./src/", import.meta.url)) + "$1.ts" }
    ]
  },
  test: {
    include: ["test/**/*.test.ts", "examples/**/*.test.ts"],
    // tsc over the whole project (tsconfig.json), side by side with the tests: a type error in any
    // file fails the run; test/*.test-d.ts hold the public API's type-level tests.
    typecheck: { enabled: true, include: ["test/**/*.test-d.ts"], tsconfig: "tsconfig.json" },
    globalSetup: ["test/support/globalSetup.ts"],
    // Test files share their worker process (and its loaded modules): importing effect and the
    // drivers anew for each of ~40 files cost a minute of CPU. Per-file state a test needs is its own.
    isolate: false,
    // STALL_MONITOR=<dir> logs each worker's event-loop stalls and where the time went: see test/support/stallMonitor.ts.
    setupFiles: ["test/support/pristineIt.ts", ...(process.env["STALL_MONITOR"] ? ["test/support/stallMonitor.ts"] : [])],
    testTimeout: 30_000,
    hookTimeout: 60_000,
    // Four test files at once on the 2-core machine: most files spend their time waiting out real
    // ttls and bounds. Two workers took 308-339 s in a fresh clone (63 % of the cores), three
    // 291-313 s, four 260 s with the cores 65 % busy on average (12-06). The live contract suites'
    // leases are 3 s so that their renewals keep up with that load.
    // As many workers at the least as at the most: with fewer, tinypool ended idle workers
    // ("Terminating worker thread") and one run stopped early.
    maxWorkers: 4,
    minWorkers: 4,
    // The long contract files first: see test/support/sequencer.ts.
    sequence: { sequencer: Sequencer }
  }
})

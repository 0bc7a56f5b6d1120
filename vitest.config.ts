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
    setupFiles: ["test/support/pristineIt.ts"],
    testTimeout: 30_000,
    hookTimeout: 60_000,
    // PostgreSQL tests share one server; two workers match the 2-core machine. Three took 260 s
    // instead of 321-333 s in a fresh clone, but starved the renewal cases of 2 s leases: 2 and 3
    // of them failed in two runs of three (PgLease, SqliteLease: renewals past the safety deadline).
    maxWorkers: 2,
    // Concurrent cases at once per file (vitest's default is 5). The live contract suites' cases
    // spend their time waiting out ttls: with 10 the lock and semaphore contract files took 1.5-5 s
    // less each (4 files side by side on 2 workers).
    maxConcurrency: 10,
    minWorkers: 1,
    // The long contract files first: see test/support/sequencer.ts.
    sequence: { sequencer: Sequencer }
  }
})

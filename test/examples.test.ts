import { describe, expect, it } from "@effect/vitest"
import { execFile } from "node:child_process"
import { fileURLToPath } from "node:url"
import { promisify } from "node:util"
import { useTestDatabase } from "./support/pg.js"

const db = useTestDatabase("examples")
const root = fileURLToPath(new URL("..", import.meta.url))

/** Runs an example as a user would, against this file's database; returns what it logged. */
const run = async (file: string): Promise<string> => {
  const { stdout, stderr } = await promisify(execFile)(process.execPath, ["--import", "tsx", `examples/${file}`], {
    cwd: root,
    env: { ...process.env, DATABASE_URL: db.url },
    timeout: 60_000
  })
  return stdout + stderr
}

describe.concurrent("examples run against a real PostgreSQL", () => {
  it("quick-start.ts", async () => {
    const out = await run("quick-start.ts")
    expect(out).toContain("holding nightly with fencing token 1")
    expect(out).toContain("runs once across replicas")
  })

  it("migration-lock.ts applies the migration exactly once across three replicas", async () => {
    const out = await run("migration-lock.ts")
    expect(out.match(/applied migration 1/g)).toHaveLength(1)
    expect(out.match(/already applied/g)).toHaveLength(2)
    expect(out).toContain("applied exactly 1 time(s)")
  })

  it("cron-singleton.ts runs the job on one replica, then the other takes over", async () => {
    const out = await run("cron-singleton.ts")
    const lines = out.split("\n").filter((line) => line.includes("building the report"))
    const firstB = lines.findIndex((line) => line.includes("replica-b"))
    expect(lines[0]).toContain("replica-a")
    expect(firstB).toBeGreaterThan(0)
    // Once replica-b leads, replica-a never runs again: never two leaders.
    expect(lines.slice(firstB).every((line) => line.includes("replica-b"))).toBe(true)
  })

  it("fenced-write.ts refuses the stale holder's write", async () => {
    const out = await run("fenced-write.ts")
    expect(out).toContain("wrote balance 100")
    expect(out).toContain("was refused: stale fencing token")
    expect(out).toContain("balance is 100")
  })

  it("dedicated-lock-pool.ts finishes 200 locked bodies on a 4-connection pool", async () => {
    const out = await run("dedicated-lock-pool.ts")
    expect(out).toContain("200 locked bodies finished")
  })
})

import { describe, expect, it } from "@effect/vitest"
import { execFile } from "node:child_process"
import { fileURLToPath } from "node:url"
import { promisify } from "node:util"
import { adminUrl } from "./support/pg.js"

const root = fileURLToPath(new URL("..", import.meta.url))

/** `npm run demo`, shortened, against the test server (the demo makes and drops its own database). */
const demo = async (backend: "lease" | "advisory") => {
  const { stdout } = await promisify(execFile)(
    process.execPath,
    ["--import", "tsx", "demo/main.ts", "--backend", backend, "--seconds", "9"],
    { cwd: root, env: { ...process.env, DATABASE_URL: adminUrl() }, timeout: 90_000 }
  )
  return stdout
}

describe.concurrent("npm run demo", () => {
  it("lease backend: takeover after the freeze, the stale write refused, nothing left held", { timeout: 120_000 }, async () => {
    const out = await demo("lease")
    expect(out).toContain("every guarantee held.")
    expect(out).toMatch(/TAKES OVER with token \d+, \d+ ms after the freeze/)
    expect(out).toMatch(/REJECTED by the fence/)
    expect(out).toMatch(/ok\s+locks left held\s+0/)
  })

  it("advisory backend: a killed session loses the lock and another worker takes over", { timeout: 120_000 }, async () => {
    const out = await demo("advisory")
    expect(out).toContain("every guarantee held.")
    expect(out).toMatch(/LOST its lock \(token \d+\): connection-lost/)
    expect(out).toMatch(/TAKES OVER with token \d+, \d+ ms after the session kill/)
    expect(out).toMatch(/ok\s+rounds done more than once\s+0/)
  })
})

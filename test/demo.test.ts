import { describe, expect, it } from "@effect/vitest"
import { execFile } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import { fileURLToPath } from "node:url"
import { promisify } from "node:util"
import { adminUrl } from "./support/pg.js"
import { nodeArgsFor } from "../tools/children.js"
import { INSTALL_HINT, redisAvailable } from "../tools/redisServer.js"

const root = fileURLToPath(new URL("..", import.meta.url))

/** `npm run demo`, shortened, against the test server (the demo makes and drops its own database; sqlite: a temp file). */
const demo = async (backend: "lease" | "advisory" | "sqlite" | "redis") => {
  const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-demo-"))
  const svgPath = Path.join(dir, `timeline-${backend}.svg`)
  try {
    const { stdout } = await promisify(execFile)(
      process.execPath,
      [...nodeArgsFor(Path.join(root, "demo/main.ts")), "--backend", backend, "--seconds", "9", "--svg", svgPath],
      { cwd: root, env: { ...process.env, DATABASE_URL: adminUrl() }, timeout: 90_000 }
    )
    const svg = Fs.existsSync(svgPath) ? Fs.readFileSync(svgPath, "utf8") : undefined
    return { stdout, svgPath, svg }
  } finally {
    Fs.rmSync(dir, { recursive: true, force: true })
  }
}

const noRedis = !redisAvailable()
if (noRedis) console.warn(`skipping the demo's redis backend: ${INSTALL_HINT}`)

/** The texts an SVG shows. */
const textsOf = (svg: string) => Array.from(svg.matchAll(/<text[^>]*>([^<]*)<\/text>/g), (m) => m[1]!.replace(/&#39;|&apos;/g, "'"))

describe.concurrent("npm run demo", () => {
  it("lease backend: takeover after the freeze, the stale write refused, nothing left held, the timeline drawn", { timeout: 120_000 }, async () => {
    const { stdout: out, svgPath, svg } = await demo("lease")
    expect(out).toContain("every guarantee held.")
    expect(out).toMatch(/TAKES OVER with token \d+, \d+ ms after the freeze/)
    expect(out).toMatch(/REJECTED by the fence/)
    expect(out).toMatch(/ok\s+locks left held\s+0/)
    expect(out).toContain(`timeline drawn: ${svgPath}`)
    expect(svg).toMatch(/^<svg xmlns="http:\/\/www.w3.org\/2000\/svg"/)
    const texts = textsOf(svg!)
    expect(texts).toEqual(expect.arrayContaining(["worker 1", "worker 2", "worker 3"]))
    expect(texts.some((t) => t.startsWith("session kill: worker "))).toBe(true)
    expect(texts.some((t) => t.startsWith("frozen (SIGSTOP) "))).toBe(true)
    expect(texts.some((t) => /^write with token \d+ refused by the fence \(current \d+\)$/.test(t))).toBe(true)
    expect(texts.some((t) => /^takes over \d+ ms after the freeze$/.test(t))).toBe(true)
  })

  it("sqlite backend: a crashed holder is taken over after its ttl, the stale write refused, nothing left held, the timeline drawn", { timeout: 120_000 }, async () => {
    const { stdout: out, svgPath, svg } = await demo("sqlite")
    expect(out).toContain("every guarantee held.")
    expect(out).toMatch(/SQLite: .*demo\.db/)
    expect(out).toMatch(/TAKES OVER with token \d+, \d+ ms after the crash/)
    expect(out).toMatch(/TAKES OVER with token \d+, \d+ ms after the freeze/)
    expect(out).toMatch(/REJECTED by the fence/)
    expect(out).toMatch(/ok\s+locks left held\s+0/)
    expect(out).toContain(`timeline drawn: ${svgPath}`)
    const texts = textsOf(svg!)
    expect(texts.some((t) => t.startsWith("crash (SIGKILL): worker "))).toBe(true)
    expect(texts.some((t) => /^write with token \d+ refused by the fence \(current \d+\)$/.test(t))).toBe(true)
  })

  it("advisory backend: a killed session loses the lock and another worker takes over, the timeline drawn", { timeout: 120_000 }, async () => {
    const { stdout: out, svgPath, svg } = await demo("advisory")
    expect(out).toContain("every guarantee held.")
    expect(out).toMatch(/LOST its lock \(token \d+\): connection-lost/)
    expect(out).toMatch(/TAKES OVER with token \d+, \d+ ms after the session kill/)
    expect(out).toMatch(/ok\s+rounds done more than once\s+0/)
    expect(out).toContain(`timeline drawn: ${svgPath}`)
    const texts = textsOf(svg!)
    expect(texts.some((t) => t.startsWith("session kill: worker "))).toBe(true)
    expect(texts.some((t) => /lost: connection-lost$/.test(t))).toBe(true)
    expect(texts.some((t) => /^takes over \d+ ms after the session kill$/.test(t))).toBe(true)
    expect(texts.some((t) => t.startsWith("frozen (SIGSTOP) "))).toBe(true)
  })

  it.skipIf(noRedis)("redis backend: the holder keeps its lease through a CLIENT KILL, takeover after the freeze, the stale write refused, the timeline drawn", { timeout: 120_000 }, async () => {
    const { stdout: out, svgPath, svg } = await demo("redis")
    expect(out).toContain("every guarantee held.")
    expect(out).toMatch(/>>> killing worker \d's [1-9]\d* Redis connection\(s\) \(CLIENT KILL\)/)
    expect(out).toMatch(/TAKES OVER with token \d+, \d+ ms after the freeze/)
    expect(out).toMatch(/REJECTED by the fence/)
    expect(out).toMatch(/ok\s+locks left held\s+0/)
    expect(out).toContain(`timeline drawn: ${svgPath}`)
    const texts = textsOf(svg!)
    expect(texts.some((t) => t.startsWith("connection kill: worker "))).toBe(true)
    expect(texts.some((t) => /^write with token \d+ refused by the fence \(current \d+\)$/.test(t))).toBe(true)
  })
})

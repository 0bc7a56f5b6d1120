import { describe, expect, it, layer, vi } from "@effect/vitest"
import { Context, Effect, Either, Layer } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as PgAdvisory from "effect-lock/PgAdvisory"
import * as PgLease from "effect-lock/PgLease"
import { main, parseArgs } from "../src/bin/inspect.js"
import { PgTest, useTestDatabase } from "./support/pg.js"
import { runCli } from "./support/cli.js"

// First, so that its afterAll (no advisory locks, no held leases; drop) runs after every layer is closed.
const db = useTestDatabase("cli")

const cli = runCli

const advisory = (applicationName: string) =>
  Layer.build(PgAdvisory.layer({ url: db.url, applicationName })).pipe(
    Effect.map(Context.get(DistributedLock.DistributedLock))
  )

/** The first name with this prefix whose advisory key is negative. */
const negativeName = (prefix: string): string => {
  for (let i = 0;; i++) if (PgAdvisory.keyOf(`${prefix}-${i}`) < 0n) return `${prefix}-${i}`
}

layer(PgTest.layer(db), { excludeTestServices: true })("effect-lock inspect", (it) => {
  it.scoped("prints the advisory and lease holders as a table and as JSON", () =>
    Effect.gen(function*() {
      const exclusive = negativeName("cli/exclusive")
      const shared = "cli/shared"
      const locks = yield* advisory("cli-advisory-app")
      yield* locks.acquire(exclusive)
      yield* locks.acquire(shared, { mode: "shared" })
      const leases = yield* Layer.build(PgLease.layer({ applicationName: "cli-lease-app" })).pipe(
        Effect.map(Context.get(DistributedLock.DistributedLock))
      )
      const lease = yield* leases.acquire("cli/lease")

      const [text, json] = yield* Effect.all([
        cli(["inspect", "--url", db.url]),
        cli(["inspect", `--url=${db.url}`, "--json", "--lease-table", PgLease.DEFAULT_TABLE])
      ], { concurrency: "unbounded" })

      expect(text.stderr).toBe("")
      expect(text.code).toBe(0)
      expect(text.stdout).toContain(`Advisory locks in database "${db.name}": 2 held, 0 waiting`)
      const exclusiveLine = text.stdout.split("\n").find((line) => line.includes(exclusive))
      expect(exclusiveLine).toMatch(new RegExp(`^${PgAdvisory.keyOf(exclusive)}\\s+${exclusive}\\s+exclusive\\s+held\\s+\\d+\\s+cli-advisory-app\\s`))
      expect(text.stdout).toMatch(/cli\/shared\s+shared\s+held/)
      expect(text.stdout).toMatch(/Leases in table effect_lock_leases: 1 held/)
      expect(text.stdout).toMatch(new RegExp(`cli/lease\\s+${lease.token}\\s+cli-lease-app\\s+\\S+\\s+${process.pid}\\s`))

      expect(json.code).toBe(0)
      const parsed = JSON.parse(json.stdout)
      expect(parsed.database).toBe(db.name)
      expect(parsed.advisory).toEqual(expect.arrayContaining([
        expect.objectContaining({
          key: PgAdvisory.keyOf(exclusive).toString(),
          name: exclusive,
          mode: "exclusive",
          granted: true,
          applicationName: "cli-advisory-app"
        }),
        expect.objectContaining({ key: PgAdvisory.keyOf(shared).toString(), name: shared, mode: "shared", granted: true })
      ]))
      expect(parsed.advisory).toHaveLength(2)
      expect(parsed.leases).toEqual({
        table: PgLease.DEFAULT_TABLE,
        held: [expect.objectContaining({
          name: "cli/lease",
          token: lease.token.toString(),
          application: "cli-lease-app",
          pid: process.pid,
          waitingSince: null
        })]
      })
      expect(new Date(parsed.leases.held[0].expiresAt).getTime()).toBeGreaterThan(Date.now() - 60_000)
    }))
})

describe("effect-lock command line", () => {
  it.live("--help exits 0; an unreachable database exits 1 with a message that hides the password", () =>
    Effect.gen(function*() {
      const [help, unreachable] = yield* Effect.all([
        cli(["--help"]),
        // Port 1 on loopback: nothing listens there, the connection is refused at once.
        cli(["inspect", "--url", "postgres://someone:s3cret@127.0.0.1:1/nowhere"])
      ], { concurrency: "unbounded" })

      expect(help).toMatchObject({ code: 0, stderr: "" })
      expect(help.stdout).toContain("Usage: effect-lock inspect")

      expect(unreachable.code).toBe(1)
      expect(unreachable.stdout).toBe("")
      expect(unreachable.stderr).toContain("cannot connect to postgres://someone:***@127.0.0.1:1/nowhere")
      expect(unreachable.stderr).toContain("ECONNREFUSED")
      expect(unreachable.stderr).not.toContain("s3cret")
    }))

  // In process: the exit status is main's result, which the spawned runs above show reaching the shell.
  const usageError = (args: ReadonlyArray<string>, env: Record<string, string> = {}) =>
    Effect.gen(function*() {
      const errors: Array<string> = []
      const spy = vi.spyOn(console, "error").mockImplementation((...line: Array<unknown>) => {
        errors.push(line.join(" "))
      })
      const code = yield* main(args, env).pipe(Effect.ensuring(Effect.sync(() => spy.mockRestore())))
      return { code, stderr: errors.join("\n") }
    })

  it.effect("a malformed command line exits 2 and says what is wrong", () =>
    Effect.gen(function*() {
      const cases: ReadonlyArray<[ReadonlyArray<string>, string]> = [
        [["inspect", "--url", "not a url"], "--url is not a URL"],
        [["inspect", "--url", "mysql://db/app"], "--url must start with postgres:// or postgresql://"],
        [["inspect"], "--url is required (or set DATABASE_URL)"],
        [["inspect", "--url"], "--url needs a value"],
        [["inspect", "--url", "postgres://h/d", "--lease-table", "a;b"], "--lease-table: \"a;b\" is not a plain identifier"],
        [["inspect", "--url", "postgres://h/d", "--verbose"], "unknown option \"--verbose\""],
        [["frobnicate"], "unknown command \"frobnicate\""],
        [[], "no command given"]
      ]
      for (const [args, message] of cases) {
        const run = yield* usageError(args)
        expect(run.code, args.join(" ")).toBe(2)
        expect(run.stderr).toContain(message)
        expect(run.stderr).toContain("effect-lock --help")
      }
    }))

  it("reads the URL from DATABASE_URL when --url is absent", () => {
    const parsed = parseArgs(["inspect", "--json"], { DATABASE_URL: "postgres://h/d" })
    expect(Either.isRight(parsed) && parsed.right._tag === "Inspect" && parsed.right.json).toBe(true)
  })
})

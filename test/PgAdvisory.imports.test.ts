/**
 * Importing PgAdvisory loads no driver: `pg` is imported when a layer is built, and the
 * `SqlClient` tag is referenced by its key, so `@effect/sql` is not loaded either (both are
 * optional peers for users of other backends).
 */
import { describe, expect, it } from "@effect/vitest"
import { spawnSync } from "node:child_process"
import { fileURLToPath } from "node:url"
import { importEntry } from "../tools/children.js"

const repoRoot = fileURLToPath(new URL("..", import.meta.url))

/** A resolve hook that refuses the driver packages, so that loading one fails the import. */
const blocker = `
import { register } from "node:module"
register("data:text/javascript," + encodeURIComponent(
  "export async function resolve(specifier, context, next) {" +
  "  if (specifier === 'pg' || specifier.startsWith('pg/') || specifier.startsWith('@effect/sql'))" +
  "    throw new Error('blocked: ' + specifier);" +
  "  return next(specifier, context) }"
))
`

/** The entry as built for import checks (its packages left to Node), else the source through tsx. */
const entry = importEntry(repoRoot, "src/PgAdvisory.ts")

const importWithBlocker = (script: string) =>
  spawnSync(
    process.execPath,
    [...entry.nodeArgs, "--import", `data:text/javascript,${encodeURIComponent(blocker)}`, "--input-type=module", "-e", script],
    { cwd: repoRoot, encoding: "utf8", timeout: 30_000 }
  )

describe("PgAdvisory imports", () => {
  it("importing PgAdvisory loads neither pg nor @effect/sql", () => {
    const run = importWithBlocker(`
      const PgAdvisory = await import(${JSON.stringify(entry.path)})
      console.log("imported", typeof PgAdvisory.layer, String(PgAdvisory.keyOf("x")))
    `)
    expect(run.stderr).not.toMatch(/blocked/)
    expect(run.stdout).toMatch(/imported function/)
  })

  it("control: the blocker does refuse pg when a layer is built", () => {
    const run = importWithBlocker(`
      const { Effect, Layer, Exit, Cause } = await import("effect")
      const PgAdvisory = await import(${JSON.stringify(entry.path)})
      const exit = await Effect.runPromiseExit(Effect.scoped(Layer.build(PgAdvisory.layer({ url: "postgres://127.0.0.1:1/x" }))))
      console.log(Exit.isFailure(exit) ? Cause.pretty(exit.cause) : "built")
    `)
    // Building loads the driver lazily; refused, it fails typed, naming the package.
    expect(run.stdout).toMatch(/LockBackendError/)
    expect(run.stdout).toMatch(/needs the "pg" package/)
  })
})

/**
 * `effect-lock ...args` as a child process, the way `npx effect-lock` runs the built file, with
 * no server URL from the environment (DATABASE_URL, REDIS_URL, EFFECT_LOCK_REDIS_URL): every run
 * says which server it means. Resolves with the exit code (null when killed) and both outputs.
 */
import * as Effect from "effect/Effect"
import { execFile } from "node:child_process"
import * as Path from "node:path"
import { fileURLToPath } from "node:url"
import { nodeArgsFor } from "../../tools/children.js"

const root = fileURLToPath(new URL("../..", import.meta.url))

export interface CliRun {
  readonly code: number | null
  readonly stdout: string
  readonly stderr: string
}

export const runCli = (args: ReadonlyArray<string>): Effect.Effect<CliRun> =>
  Effect.async<CliRun>((resume) => {
    const { DATABASE_URL: _d, REDIS_URL: _r, EFFECT_LOCK_REDIS_URL: _e, ...env } = process.env
    const child = execFile(
      process.execPath,
      [...nodeArgsFor(Path.join(root, "src/bin/effect-lock.ts")), ...args],
      { cwd: root, env, timeout: 30_000 },
      (error, stdout, stderr) => {
        const code = error === null ? 0 : typeof error.code === "number" ? error.code : null
        resume(Effect.succeed({ code, stdout, stderr }))
      }
    )
    // Interrupted: the child goes with the test.
    return Effect.sync(() => child.kill())
  })

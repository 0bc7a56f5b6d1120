/**
 * Worker processes of the tests that speak a line protocol: commands on stdin, one line per
 * event on stdout, "ready" once connected, "exit" to stop. Started through `nodeArgsFor` (the
 * run's bundle, else tsx); a worker that exits early fails whatever waits on it, with the tail of
 * its stderr.
 */
import { spawn } from "node:child_process"
import * as Readline from "node:readline"
import { fileURLToPath } from "node:url"
import { nodeArgsFor } from "../../tools/children.js"

const repoRoot = fileURLToPath(new URL("../..", import.meta.url))

export interface LineWorker {
  /** Resolves with the worker's first "ready" line. */
  readonly ready: Promise<string>
  /** Writes `line`; resolves with the first later stdout line `expect` accepts (a string: that exact line). */
  readonly command: (line: string, expect: string | ((line: string) => boolean)) => Promise<string>
  /** Sends "exit" and resolves with the exit code. */
  readonly exit: () => Promise<number | null>
  /** SIGKILL, as a crash would end it; resolves once it is gone. */
  readonly kill: () => Promise<void>
}

/** Accepts a line that starts with `prefix`. */
export const startingWith = (prefix: string) => (line: string): boolean => line.startsWith(prefix)

/** Starts `entry` (a path under the repository) with `args`. */
export const startLineWorker = (entry: string, args: ReadonlyArray<string>): LineWorker => {
  const child = spawn(process.execPath, [...nodeArgsFor(`${repoRoot}${entry}`), ...args], {
    cwd: repoRoot,
    stdio: ["pipe", "pipe", "pipe"]
  })
  let stderr = ""
  child.stderr.on("data", (chunk: Buffer) => (stderr = (stderr + chunk.toString()).slice(-4_000)))
  const waiters: Array<{ readonly accepts: (line: string) => boolean; readonly resolve: (line: string) => void }> = []
  Readline.createInterface({ input: child.stdout }).on("line", (raw) => {
    const line = raw.trim()
    const index = waiters.findIndex((w) => w.accepts(line))
    if (index >= 0) waiters.splice(index, 1)[0]!.resolve(line)
  })
  const exited = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)))
  const expectLine = (expect: string | ((line: string) => boolean)) =>
    new Promise<string>((resolve, reject) => {
      waiters.push({ accepts: typeof expect === "string" ? (line) => line === expect : expect, resolve })
      void exited.then((code) => reject(new Error(`${entry} exited (${code}) before "${String(expect)}":\n${stderr}`)))
    })
  return {
    ready: expectLine(startingWith("ready")),
    command: (line, expect) => {
      const answered = expectLine(expect)
      child.stdin.write(`${line}\n`)
      return answered
    },
    exit: () => {
      child.stdin.end("exit\n")
      return exited
    },
    kill: async () => {
      if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL")
      await exited
    }
  }
}

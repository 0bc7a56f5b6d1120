/**
 * A watchdog for a server this process started, for when this process dies without stopping it (a
 * crashed or killed test run, demo or chaos run): a detached shell reads its stdin, a pipe from
 * this process, with the builtin `read` (no process of its own to leave behind), until this
 * process is gone: the pipe's end comes with its death, whether it is reaped or not, and never
 * with another process's. Then it signals the process named on the first line of `pidFile` (read
 * only then, so a server restarted since is stopped too), only if that process's name is
 * `command`, SIGKILL after 10 s, and deletes `paths`. A server stopped as usual stops its watchdog
 * (the function returned).
 */
import { spawn } from "node:child_process"

export interface Watched {
  /** The file whose first line is the server's process id. */
  readonly pidFile: string
  /** The server's process name (`/proc/<pid>/comm`): another process that took the id is left alone. */
  readonly command: string
  /** How to ask it to stop: PostgreSQL's fast shutdown is SIGINT, Redis's SIGTERM. */
  readonly signal: "INT" | "TERM"
  /** Deleted once it stopped: its data directory, its log. */
  readonly paths: ReadonlyArray<string>
}

const SCRIPT = `
while read -r _; do :; done
pid=$(head -n 1 "$1" 2>/dev/null | tr -dc 0-9)
if [ -n "$pid" ] && [ "$(cat /proc/$pid/comm 2>/dev/null)" = "$2" ]; then
  kill -"$3" "$pid" 2>/dev/null
  i=0
  while kill -0 "$pid" 2>/dev/null && [ "$i" -lt 20 ]; do sleep 0.5; i=$((i + 1)); done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null; fi
fi
shift 3
rm -rf "$@"
`

/** Starts the watchdog of `watched`; the function returned stops it (the server was stopped as usual). */
export const watchServer = (watched: Watched): () => void => {
  // Detached and unreferenced, stdin and all: it outlives this process and never holds its exit up.
  const child = spawn("sh", ["-c", SCRIPT, "effect-lock-watchdog", watched.pidFile, watched.command, watched.signal, ...watched.paths], {
    detached: true,
    stdio: ["pipe", "ignore", "ignore"]
  })
  child.on("error", () => {})
  child.stdin?.on("error", () => {})
  ;(child.stdin as unknown as { unref?: () => void } | null)?.unref?.()
  child.unref()
  return () => {
    child.kill("SIGKILL")
  }
}

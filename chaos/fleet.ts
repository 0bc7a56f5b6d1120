/**
 * The driver's side of the worker processes: starts K workers on one backend, restarts the ones
 * that die, collects their events, sends them commands, signals them, and stops them cleanly.
 */
import { type ChildProcess, spawn } from "node:child_process"
import * as Fs from "node:fs"
import * as Readline from "node:readline"
import { fileURLToPath } from "node:url"
import { type Command, EXIT_LAYER_FAILED, type Stamped, WORKER_ENV, type WorkerConfig } from "./protocol.js"
import { nodeArgsFor } from "../tools/children.js"

const WORKER_SCRIPT = fileURLToPath(new URL("./worker.ts", import.meta.url))
const ROOT = fileURLToPath(new URL("..", import.meta.url))
/** A worker that died on its own is started again after this pause (the server may be restarting). */
const RESPAWN_DELAY_MS = 500
/** Lines of a dead worker's stderr kept with its exit record. */
const STDERR_TAIL_LINES = 8

/** How a worker process ended. */
export interface WorkerExit {
  readonly slot: number
  readonly incarnation: number
  readonly at: number
  readonly code: number | null
  readonly signal: NodeJS.Signals | null
  /**
   * `killed`: by the driver (a fault, or a worker that did not stop); `stopped`: asked to stop;
   * `layer-failed`: its layers could not be built (a typed error, e.g. the server was down);
   * `crashed`: anything else — an uncaught error in the process.
   */
  readonly cause: "killed" | "stopped" | "layer-failed" | "crashed"
  readonly stderrTail: string
}

export interface Holder {
  readonly slot: number
  readonly incarnation: number
  readonly acq: string
  readonly token: bigint
}

interface Running {
  readonly slot: number
  readonly incarnation: number
  readonly child: ChildProcess
  readonly exited: Promise<void>
  readonly stderr: Array<string>
  expectedExit?: "killed" | "stopped"
}

export interface FleetOptions {
  readonly workers: number
  readonly config: Omit<WorkerConfig, "slot" | "incarnation">
  /** Where workers' stderr and stray stdout go. */
  readonly logFile: string
}

export interface Fleet {
  readonly events: ReadonlyArray<Stamped>
  readonly exits: ReadonlyArray<WorkerExit>
  /** Starts every slot and waits until each said `ready` (or fails after `timeoutMs`). */
  readonly startAll: (timeoutMs: number) => Promise<void>
  /** SIGKILL, wait for the exit, start the slot again (not waiting for it to be ready). */
  readonly kill: (slot: number) => Promise<void>
  readonly signal: (slot: number, signal: "SIGSTOP" | "SIGCONT") => void
  readonly send: (slot: number, command: Command) => void
  /** The next event (after this call) matching `predicate`, or undefined after `timeoutMs`. */
  readonly waitFor: (predicate: (event: Stamped) => boolean, timeoutMs: number) => Promise<Stamped | undefined>
  /**
   * The live acquisition with the highest token, as the events tell it: the latest grant, reader or
   * writer. Readers may hold side by side; the others are not returned, so a fault that hits a
   * worker at random names a holder only when it hit the latest one (an older holder may be one
   * whose lease is gone unnoticed, which a no-loss fault must not be blamed for).
   */
  readonly holder: () => Holder | undefined
  /** Asks every worker to stop, SIGKILLs those still running after `timeoutMs`; returns their slots. */
  readonly stop: (timeoutMs: number) => Promise<ReadonlyArray<number>>
}

export const makeFleet = (options: FleetOptions): Fleet => {
  const log = Fs.openSync(options.logFile, "a")
  const write = (line: string) => {
    try {
      Fs.writeSync(log, `${new Date().toISOString()} ${line}\n`)
    } catch {
      // a line arriving after the log was closed is dropped, never a crash of the driver
    }
  }
  const events: Array<Stamped> = []
  const exits: Array<WorkerExit> = []
  const running = new Map<number, Running>()
  const incarnations = new Map<number, number>()
  const held = new Map<string, Holder>()
  const listeners = new Set<(event: Stamped) => void>()
  let stopping = false

  const onEvent = (event: Stamped) => {
    events.push(event)
    switch (event.e) {
      case "acquired":
        held.set(event.acq, { slot: event.w, incarnation: event.i, acq: event.acq, token: BigInt(event.token) })
        break
      case "lost":
      case "released":
        held.delete(event.acq)
        break
    }
    for (const listener of listeners) listener(event)
  }

  const start = (slot: number): Running => {
    const incarnation = incarnations.get(slot) ?? 0
    incarnations.set(slot, incarnation + 1)
    const config: WorkerConfig = { ...options.config, slot, incarnation }
    const child = spawn(process.execPath, [...nodeArgsFor(WORKER_SCRIPT)], {
      cwd: ROOT,
      env: { ...process.env, [WORKER_ENV]: JSON.stringify(config) },
      stdio: ["pipe", "pipe", "pipe"]
    })
    const label = `[w${slot}.${incarnation}]`
    const stderr: Array<string> = []
    // A worker that died must not crash the driver when it is written to.
    child.stdin!.on("error", () => {})
    Readline.createInterface({ input: child.stdout! }).on("line", (line) => {
      let event: Stamped | undefined
      try {
        event = JSON.parse(line) as Stamped
      } catch {
        write(`${label} stdout: ${line}`)
      }
      if (event !== undefined) onEvent(event)
    })
    Readline.createInterface({ input: child.stderr! }).on("line", (line) => {
      stderr.push(line)
      if (stderr.length > STDERR_TAIL_LINES) stderr.shift()
      write(`${label} ${line}`)
    })
    const exited = new Promise<void>((resolve) => {
      child.once("exit", (code, signal) => {
        const self = running.get(slot)
        const expected = self?.child === child ? self.expectedExit : undefined
        const cause = expected === "killed"
          ? "killed"
          : code === EXIT_LAYER_FAILED
          ? "layer-failed"
          : code === 0 && (expected === "stopped" || stopping)
          ? "stopped"
          : "crashed"
        exits.push({ slot, incarnation, at: Date.now(), code, signal, cause, stderrTail: stderr.join("\n") })
        write(`${label} exited: code ${code} signal ${signal} (${cause})`)
        for (const [acq, holder] of held) if (holder.slot === slot && holder.incarnation === incarnation) held.delete(acq)
        if (running.get(slot)?.child === child) running.delete(slot)
        resolve()
        if (!stopping && expected === undefined) {
          setTimeout(() => {
            if (!stopping && !running.has(slot)) running.set(slot, start(slot))
          }, RESPAWN_DELAY_MS)
        }
      })
    })
    return { slot, incarnation, child, exited, stderr }
  }

  const waitFor = (predicate: (event: Stamped) => boolean, timeoutMs: number) =>
    new Promise<Stamped | undefined>((resolve) => {
      const listener = (event: Stamped) => {
        if (!predicate(event)) return
        clearTimeout(timer)
        listeners.delete(listener)
        resolve(event)
      }
      const timer = setTimeout(() => {
        listeners.delete(listener)
        resolve(undefined)
      }, timeoutMs)
      listeners.add(listener)
    })

  const slots = Array.from({ length: options.workers }, (_, i) => i + 1)

  return {
    events,
    exits,
    startAll: async (timeoutMs) => {
      const ready = new Set<number>()
      const all = new Promise<void>((resolve) => {
        const listener = (event: Stamped) => {
          if (event.e === "ready") ready.add(event.w)
          if (ready.size === slots.length) {
            listeners.delete(listener)
            resolve()
          }
        }
        listeners.add(listener)
      })
      for (const slot of slots) running.set(slot, start(slot))
      let timer: NodeJS.Timeout | undefined
      const timedOut = new Promise<never>((_, reject) => {
        timer = setTimeout(
          () => reject(new Error(`workers not ready within ${timeoutMs} ms (ready: ${[...ready].join(", ") || "none"}); see ${options.logFile}`)),
          timeoutMs
        )
      })
      await Promise.race([all, timedOut]).finally(() => clearTimeout(timer))
    },
    kill: async (slot) => {
      const worker = running.get(slot)
      if (worker === undefined) return
      worker.expectedExit = "killed"
      worker.child.kill("SIGKILL")
      await worker.exited
      if (!stopping) running.set(slot, start(slot))
    },
    signal: (slot, signal) => {
      running.get(slot)?.child.kill(signal)
    },
    send: (slot, command) => {
      running.get(slot)?.child.stdin!.write(`${JSON.stringify(command)}\n`)
    },
    waitFor,
    holder: () => {
      let best: Holder | undefined
      for (const holder of held.values()) if (best === undefined || holder.token > best.token) best = holder
      return best
    },
    stop: async (timeoutMs) => {
      stopping = true
      const workers = [...running.values()]
      for (const worker of workers) {
        worker.expectedExit = "stopped"
        worker.child.kill("SIGCONT")
        worker.child.stdin!.write(`${JSON.stringify({ c: "stop" } satisfies Command)}\n`)
      }
      const hung: Array<number> = []
      await Promise.all(workers.map(async (worker) => {
        let timer: NodeJS.Timeout | undefined
        const late = new Promise<"late">((resolve) => {
          timer = setTimeout(() => resolve("late"), timeoutMs)
        })
        if ((await Promise.race([worker.exited, late])) === "late") {
          hung.push(worker.slot)
          worker.expectedExit = "killed"
          worker.child.kill("SIGKILL")
          await worker.exited
        }
        clearTimeout(timer)
      }))
      Fs.closeSync(log)
      return hung.sort((a, b) => a - b)
    }
  }
}

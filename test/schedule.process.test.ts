/**
 * DistributedLock.schedule across three OS processes on PgLease, in real time: every process runs
 * the same every-second schedule; each occurrence it wins inserts a row keyed by the occurrence's
 * scheduled time (primary key), so a second run of any occurrence fails that process.
 */
import { afterAll, describe, expect, it } from "@effect/vitest"
import { spawn } from "node:child_process"
import * as Path from "node:path"
import * as Readline from "node:readline"
import { fileURLToPath } from "node:url"
import { useTestDatabase, withClient } from "./support/pg.js"
import { nodeArgsFor } from "../tools/children.js"

// First, so that its afterAll (leak check: no lease row left held) runs after the workers stopped.
const db = useTestDatabase("schedule_process")

const repoRoot = fileURLToPath(new URL("..", import.meta.url))
const WORKER = Path.join(repoRoot, "test/fixtures/schedule-worker.ts")
/** Each replica's wall clock is behind real time by this much (its sleeps are not). */
const REPLICAS = [["a", 0], ["b", 250], ["c", 500]] as const
/** atLeastFor of every replica; `SCHEDULE_AT_LEAST_FOR=0` shows the test failing without the hold. */
const AT_LEAST_FOR = process.env.SCHEDULE_AT_LEAST_FOR ?? "800"
/** Occurrences to watch once every replica runs (one per second). */
const OCCURRENCES = 10

interface Worker {
  readonly name: string
  readonly ready: Promise<void>
  readonly ran: Array<number>
  /** Occurrences it reached only past their claim window, and how late (it said so). */
  readonly skipped: Map<number, number>
  readonly stop: () => Promise<{ readonly code: number | null; readonly output: string }>
}

const startWorker = ([name, behind]: readonly [string, number]): Worker => {
  const child = spawn(process.execPath, [...nodeArgsFor(WORKER), db.url, name, String(behind), AT_LEAST_FOR], {
    cwd: repoRoot,
    stdio: ["pipe", "pipe", "pipe"]
  })
  let output = ""
  child.stderr.on("data", (chunk: Buffer) => (output = (output + chunk.toString()).slice(-4_000)))
  const ran: Array<number> = []
  const skipped = new Map<number, number>()
  const exited = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)))
  const ready = new Promise<void>((resolve, reject) => {
    Readline.createInterface({ input: child.stdout }).on("line", (line) => {
      output = (output + line + "\n").slice(-4_000)
      if (line === "ready") resolve()
      const at = /^ran (\d+)$/.exec(line)?.[1]
      if (at !== undefined) ran.push(Number(at))
      const late = /^skipped (\d+) (-?\d+)$/.exec(line)
      if (late !== null) skipped.set(Number(late[1]), Number(late[2]))
    })
    void exited.then((code) => reject(new Error(`replica ${name} exited (${code}) before it was ready:\n${output}`)))
  })
  return {
    name,
    ready,
    ran,
    skipped,
    stop: async () => {
      if (child.exitCode === null && child.signalCode === null) child.stdin.write("exit\n")
      // Bounded: a replica that does not stop within 10 s is killed (and the test fails on its exit code).
      const timer = setTimeout(() => child.kill("SIGKILL"), 10_000)
      const code = await exited
      clearTimeout(timer)
      return { code, output }
    }
  }
}

const rows = () =>
  withClient(db.url, async (client) =>
    (await client.query<{ occurrence: string; replica: string }>("select occurrence::text, replica from schedule_runs order by occurrence"))
      .rows.map((row) => ({ occurrence: Number(row.occurrence), replica: row.replica })))

describe("DistributedLock.schedule across OS processes on PgLease", () => {
  let workers: ReadonlyArray<Worker> = []
  afterAll(async () => {
    await Promise.all(workers.map((w) => w.stop()))
  })

  it(`three processes with clocks 0, 250 and 500 ms behind, an every-second schedule: each of ${OCCURRENCES} consecutive occurrences ran once, or was skipped as claimed past its claim window`, async () => {
    await withClient(db.url, (client) =>
      client.query("create table schedule_runs (occurrence bigint primary key, replica text not null, token bigint not null)"))
    workers = REPLICAS.map(startWorker)
    await Promise.all(workers.map((w) => w.ready))
    // The first occurrence every replica was waiting for: the next whole second after all were ready.
    const first = Math.ceil(Date.now() / 1_000) * 1_000 + 1_000
    const last = first + (OCCURRENCES - 1) * 1_000
    // Wait (bounded) until the last watched occurrence ran somewhere, and a second more.
    const deadline = Date.now() + (OCCURRENCES + 15) * 1_000
    while (!(await rows()).some((row) => row.occurrence >= last)) {
      if (Date.now() > deadline) throw new Error(`occurrence ${last} never ran: ${JSON.stringify(await rows())}`)
      await new Promise((resolve) => setTimeout(resolve, 200))
    }
    await new Promise((resolve) => setTimeout(resolve, 1_000))
    const stopped = await Promise.all(workers.map((w) => w.stop()))
    // No replica failed: a duplicate run would have failed its insert (primary key) and its process.
    for (const [i, { code, output }] of stopped.entries()) {
      expect(code, `replica ${REPLICAS[i]![0]} exit code; its output:\n${output}`).toBe(0)
    }
    const all = await rows()
    const watched = all.filter((row) => row.occurrence >= first && row.occurrence <= last)
    const ranAt = new Set(watched.map((row) => row.occurrence))
    // At most once (the primary key). An occurrence that ran nowhere was skipped because it was
    // claimed too late (the README: skipped, never run late): a busy host can make the winner's
    // grant, or every replica, come past the claim window (atLeastFor). At least one replica must
    // say so, and how late it was; the others found the lock held by that late winner.
    const missed = Array.from({ length: OCCURRENCES }, (_, i) => first + i * 1_000).filter((at) => !ranAt.has(at))
    for (const at of missed) {
      const lateness = workers.map((w) => w.skipped.get(at))
      const said = `occurrence ${at} ran nowhere; how late replicas a, b, c said they were: ${JSON.stringify(lateness)}`
      expect(lateness.some((late) => late !== undefined), said).toBe(true)
      for (const late of lateness) if (late !== undefined) expect(late, said).toBeGreaterThanOrEqual(Number(AT_LEAST_FOR))
    }
    // Each process says what it ran: together, exactly the table's rows, none twice.
    const said = workers.flatMap((w) => w.ran).sort((a, b) => a - b)
    expect(said).toEqual(all.map((row) => row.occurrence))
    console.log(`occurrences ${first}..${last} by replica: ${watched.map((row) => row.replica).join("")}; skipped as late: ${missed.length}`)
  }, 60_000)
})

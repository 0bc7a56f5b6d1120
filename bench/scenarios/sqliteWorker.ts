/**
 * One OS process of the `sqlite` bench scenario, on the database file the others share. Driven
 * over stdin, one command per line, so that every process of a group starts a round together:
 *
 *   cycles <ms> <name>    acquire + release of `name` (this process's own) until <ms> passed;
 *                         prints {"cycles":n}
 *   handoff <ms> <name>   competes for `name` with the others: acquire, hold 1 ms, release, until
 *                         <ms> passed; prints {"grants":[[acquiredAt, releaseAt, 0], …]} (epoch
 *                         ms, sub-ms precision: comparable across the processes of one host)
 *   local <ms> <name> <n> the same with <n> fibers of this process (one layer): the third figure
 *                         of a grant is the fiber
 *   exit
 *
 * `node --import tsx sqliteWorker.ts <lib|raw> <file> <pollMs>`: `lib` runs SqliteLease through
 * DistributedLock; `raw` sends the same two statements (src/internal/lease/sqlite/sql.ts) on one
 * better-sqlite3 connection with the same busy_timeout, and does no waiting (cycles only).
 * Prints "ready" once set up.
 */
import Database from "better-sqlite3"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Logger from "effect/Logger"
import * as LogLevel from "effect/LogLevel"
import * as ManagedRuntime from "effect/ManagedRuntime"
import * as Crypto from "node:crypto"
import * as Os from "node:os"
import * as Readline from "node:readline"
import * as DistributedLock from "../../src/DistributedLock.js"
import * as Sql from "../../src/internal/lease/sqlite/sql.js"
import * as SqliteLease from "../../src/SqliteLease.js"

const [mode, filename, pollArg] = process.argv.slice(2)
if ((mode !== "lib" && mode !== "raw") || filename === undefined) {
  console.error("usage: sqliteWorker.ts <lib|raw> <file> <pollMs>")
  process.exit(2)
}

/** Epoch milliseconds with sub-millisecond precision, comparable between processes of one host. */
const now = () => performance.timeOrigin + performance.now()

const HOLD = Duration.millis(1)

const libWorker = async () => {
  const runtime = ManagedRuntime.make(
    SqliteLease.layer({ filename, pollInterval: Duration.millis(Number(pollArg ?? 50)) }).pipe(
      Layer.provide(Logger.minimumLogLevel(LogLevel.Error))
    )
  )
  await runtime.runPromise(Effect.void)
  const cycles = (ms: number, name: string) =>
    Effect.gen(function*() {
      const end = now() + ms
      let n = 0
      while (now() < end) {
        yield* Effect.scoped(DistributedLock.acquire(name))
        n++
      }
      return { cycles: n }
    })
  const contender = (end: number, name: string, who: number, grants: Array<readonly [number, number, number]>) =>
    Effect.gen(function*() {
      while (now() < end) {
        let acquiredAt = 0
        let releaseAt = 0
        yield* Effect.scoped(
          Effect.gen(function*() {
            yield* DistributedLock.acquire(name, { timeout: Duration.millis(Math.max(0, end - now())) })
            acquiredAt = now()
            yield* Effect.sleep(HOLD)
            releaseAt = now()
          })
        ).pipe(Effect.exit)
        if (acquiredAt > 0) grants.push([acquiredAt, releaseAt, who])
      }
    })
  const handoff = (ms: number, name: string, fibers: number) =>
    Effect.gen(function*() {
      const end = now() + ms
      const grants: Array<readonly [number, number, number]> = []
      yield* Effect.forEach(Array.from({ length: fibers }, (_, who) => who), (who) => contender(end, name, who, grants), {
        concurrency: "unbounded",
        discard: true
      })
      return { grants }
    })
  return {
    run: (command: string, ms: number, name: string, fibers: number) =>
      runtime.runPromiseExit<object, unknown>(command === "cycles" ? cycles(ms, name) : handoff(ms, name, command === "local" ? fibers : 1)).then((exit) =>
        Exit.isSuccess(exit) ? exit.value : { error: String(exit.cause) }
      ),
    close: () => runtime.dispose()
  }
}

const rawWorker = async () => {
  const db = new Database(filename)
  db.pragma("journal_mode = WAL")
  db.pragma(`busy_timeout = ${Duration.toMillis(SqliteLease.defaults.busyTimeout)}`)
  const tables = Sql.parseTables(SqliteLease.DEFAULT_TABLE) as Sql.Tables
  for (const statement of Sql.createTable(tables)) db.prepare(statement).run()
  const acquire = db.prepare(Sql.acquire(tables))
  const release = db.prepare(Sql.release(tables))
  const host = Os.hostname()
  const bind = (...params: ReadonlyArray<unknown>) => Object.fromEntries(params.map((p, i) => [String(i + 1), p]))
  /** As the library's lane: a try that found the write lock taken past busy_timeout is tried again. */
  const retried = <A>(f: () => A): A => {
    while (true) {
      try {
        return f()
      } catch (error) {
        if (!String((error as { code?: unknown }).code).startsWith("SQLITE_BUSY")) throw error
      }
    }
  }
  const cycles = (ms: number, name: string) => {
    const end = now() + ms
    let n = 0
    while (now() < end) {
      const owner = Crypto.randomUUID()
      const params = bind(name, owner, Crypto.randomUUID(), "exclusive", 30_000, 5_000, "bench-raw", host, process.pid, 0)
      const rows = retried(() => acquire.all(params)) as Array<{ token: string | null }>
      if (rows[0]?.token == null) throw new Error(`raw acquire of ${name} was not granted`)
      retried(() => release.all(bind(name, owner, null)))
      n++
    }
    return { cycles: n }
  }
  return {
    run: async (command: string, ms: number, name: string, _fibers: number) =>
      command === "cycles" ? cycles(ms, name) : { error: "raw does not wait: cycles only" },
    close: async () => db.close()
  }
}

const main = async () => {
  const worker = mode === "lib" ? await libWorker() : await rawWorker()
  console.log("ready")
  for await (const line of Readline.createInterface({ input: process.stdin })) {
    const [command, ms, name, fibers] = line.trim().split(/\s+/)
    if (command === "exit" || command === undefined) break
    console.log(JSON.stringify(await worker.run(command, Number(ms), name ?? "bench", Number(fibers ?? 1))))
  }
  await worker.close()
  process.exit(0)
}

main().catch((error) => {
  console.error(error)
  process.exit(1)
})

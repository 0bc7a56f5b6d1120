/**
 * `npx tsx --import ./bench/lib/built.mjs bench/pathCost.ts [--cycles=N] [--rounds=R]`
 *
 * The CPU of a lock cycle's own path, without a network: PgAdvisory's whole stack (the core, the
 * engine, its sessions and statement queue, the driver edge) over a stand-in for node-postgres's
 * Client that answers every statement on the next turn of the event loop (`setImmediate`), next to
 * `Effect.scoped(Effect.acquireRelease(...))` of two such statements — the least an Effect
 * program that takes and gives back a resource can do — and the memory backend. No server, no
 * socket: the figures hold only what runs in this process, and they are steady to a microsecond,
 * which the figures against a real server (±10 % between runs) are not.
 */
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as ManagedRuntime from "effect/ManagedRuntime"
import * as DistributedLock from "../src/DistributedLock.js"
import { makeWith } from "../src/internal/advisory/engine.js"
import type { BackendOptions } from "../src/internal/advisory/state.js"
import type { Driver } from "../src/internal/pg/driver.js"
import { parseTable, type TableRef } from "../src/internal/sql/tables.js"
import * as MemoryBackend from "../src/MemoryBackend.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const cycles = Number(arg("cycles") ?? "20000")
const rounds = Number(arg("rounds") ?? "7")

const PID = 4242
type Callback = (error: Error | null, result?: { rows: Array<Record<string, unknown>> }) => void

/** node-postgres's Client as far as PgAdvisory uses it: every lock granted, every unlock proven, on the next turn. */
class InstantClient {
  readonly processID = PID
  readonly secretKey = 1
  readonly connectionParameters = { host: "in-process", port: 1 }
  readonly connection = { stream: { destroy: () => {} } }
  on() {
    return this
  }
  connect(callback: (error?: Error) => void) {
    setImmediate(() => callback())
  }
  getTransactionStatus() {
    return "I"
  }
  end() {
    return Promise.resolve()
  }
  query(textOrConfig: string | { readonly text: string; readonly values: Array<Array<string>> }, valuesOrCallback: unknown, maybeCallback?: Callback) {
    const text = typeof textOrConfig === "string" ? textOrConfig : textOrConfig.text
    const callback = (typeof valuesOrCallback === "function" ? valuesOrCallback : maybeCallback) as Callback
    let rows: Array<Record<string, unknown>>
    if (text.startsWith("with request as")) {
      const keys = (textOrConfig as { readonly values: Array<Array<string>> }).values[0]!
      rows = [...keys.map((key) => ({ key, token: "1", pid: null })), { key: null, token: null, pid: PID }]
    } else if (text.startsWith("select pg_advisory_unlock")) {
      rows = [{ released: true, pid: PID, notified: null }]
    } else {
      rows = [{ pid: PID }]
    }
    setImmediate(() => callback(null, { rows }))
  }
}

const options: BackendOptions = {
  connect: { client: { host: "in-process" }, applicationName: "pathCost", connectTimeoutMillis: 5_000, explicitApplicationName: false },
  maxSessions: 4,
  namespace: "",
  fencingTable: parseTable("effect_lock_fencing") as TableRef,
  createTables: true,
  heartbeatIntervalMillis: 60_000,
  heartbeatTimeoutMillis: 60_000,
  // No sweep: the fake server answers no SQL of it.
  sweepIntervalMillis: 0
}

const pgAdvisory = Layer.scoped(
  DistributedLock.DistributedLock,
  Effect.flatMap(makeWith(options, { Client: InstantClient } as unknown as Driver), (backend) => DistributedLock.make(backend))
)

/** One statement answered on the next turn, as the stand-in answers. */
const statement = Effect.async<void>((resume) => {
  setImmediate(() => resume(Effect.void))
})

const median = (xs: ReadonlyArray<number>) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!

const measure = async <R>(label: string, runtime: ManagedRuntime.ManagedRuntime<R, unknown>, cycle: Effect.Effect<unknown, unknown, R>) => {
  const cpu: Array<number> = []
  const loop = Effect.repeatN(cycle, cycles - 1)
  await runtime.runPromise(loop) // warm-up
  for (let round = 0; round < rounds; round++) {
    const before = process.cpuUsage()
    await runtime.runPromise(loop)
    const used = process.cpuUsage(before)
    cpu.push((used.user + used.system) / cycles)
  }
  const us = median(cpu)
  console.log(`${label.padEnd(58)} ${us.toFixed(1).padStart(6)} µs CPU per cycle (rounds ${Math.min(...cpu).toFixed(1)}–${Math.max(...cpu).toFixed(1)})`)
  return us
}

const plain = ManagedRuntime.make(Layer.empty)
const advisory = ManagedRuntime.make(pgAdvisory)
const memory = ManagedRuntime.make(MemoryBackend.layer())
console.log(`${cycles} cycles per round, ${rounds} rounds, median; each statement answered on the next event-loop turn\n`)
const floor = await measure("two statements, no Effect.scoped", plain, Effect.zipRight(statement, statement))
const scoped = await measure("Effect.scoped(Effect.acquireRelease(statement, statement))", plain, Effect.scoped(Effect.acquireRelease(statement, () => statement)))
const lock = await measure("Effect.scoped(DistributedLock.acquire) on PgAdvisory", advisory, Effect.scoped(DistributedLock.acquire("path-cost")))
await measure("Effect.scoped(DistributedLock.acquire) on MemoryBackend", memory, Effect.scoped(DistributedLock.acquire("path-cost")))
console.log(
  `\nPgAdvisory's own path: ${(lock - scoped).toFixed(1)} µs a cycle beyond the acquireRelease floor, ` +
    `which is itself ${(scoped - floor).toFixed(1)} µs beyond the two bare statements`
)
await advisory.dispose()
await memory.dispose()
await plain.dispose()

/**
 * `npx tsx --import ./bench/lib/built.mjs bench/sockets.ts [--seconds=S]`
 *
 * Where the extra socket work of a lock cycle comes from. The CPU profile (`bench/profile.ts`)
 * puts 2–4 times the raw rows' time in Node's socket writes for the same statements; this counts
 * what is written and times it:
 *
 * 1. For each backend's uncontended loop (one worker) and its raw floor: socket writes and reads
 *    per cycle, and the µs spent inside the writes (`Socket._writev` / `_write`, the syscall
 *    included). Equal counts mean the library sends nothing more, in no more pieces.
 * 2. One raw connection sending the same prepared statement back to back, with a gap of CPU work
 *    between statements: idle spinning, or allocating short-lived objects as a fiber-heavy path
 *    does. The µs per write and the round trip show what the work between statements costs the
 *    socket path itself.
 */
import * as Net from "node:net"
import pg from "pg"
import { createDatabase, startPostgres } from "./lib/postgres.js"
import type { Subject } from "./lib/rounds.js"
import { pgAdvisorySubject, pgLeaseSubject, rawAdvisoryFenced, rawLease } from "./scenarios/uncontended.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const ms = Number(arg("seconds") ?? "3") * 1000

const counted = { writes: 0, reads: 0, ns: 0n }
const reset = () => Object.assign(counted, { writes: 0, reads: 0, ns: 0n })

// Counts every socket of the process (the server's are in another process): writes and the time in them, reads.
const socket = Net.Socket.prototype as unknown as Record<string, (...args: Array<unknown>) => unknown>
for (const method of ["_writev", "_write"]) {
  const original = socket[method]!
  socket[method] = function(this: unknown, ...args: Array<unknown>) {
    counted.writes++
    const start = process.hrtime.bigint()
    try {
      return original.apply(this, args)
    } finally {
      counted.ns += process.hrtime.bigint() - start
    }
  }
}
const push = socket.push!
socket.push = function(this: unknown, chunk: unknown, ...rest: Array<unknown>) {
  if (chunk !== null && chunk !== undefined) counted.reads++
  return push.call(this, chunk, ...rest)
}

const perCycle = async (label: string, subject: Subject<{ readonly cycles: number }>) => {
  const trial = await subject.open()
  try {
    await trial.run({ warmup: true })
    reset()
    const { cycles } = await trial.run({ warmup: false })
    const each = (n: number) => (n / cycles).toFixed(2)
    console.log(
      `${label.padEnd(28)} ${String(cycles).padStart(6)} cycles; per cycle: ${each(counted.writes)} writes, ${each(counted.reads)} reads, ` +
        `${(Number(counted.ns) / 1000 / cycles).toFixed(1)} µs in writes`
    )
  } finally {
    await trial.close()
  }
}

const retained: Array<unknown> = []
/** `us` of CPU work: spinning, or allocating short-lived objects (as a fiber-heavy path does). */
const work = (us: number, allocate: boolean) => {
  const end = process.hrtime.bigint() + BigInt(us * 1000)
  while (process.hrtime.bigint() < end) {
    if (allocate) {
      retained.push({ values: [1, 2, 3], text: `x${retained.length}` })
      if (retained.length > 20_000) retained.length = 0
    }
  }
}

const gaps = async (url: string) => {
  const client = new pg.Client({ connectionString: url })
  await client.connect()
  try {
    const query = (i: number) => client.query({ name: "sockets_probe", text: "select $1::int as x", values: [i] })
    for (let i = 0; i < 500; i++) await query(i)
    for (const [gap, allocate] of [[0, false], [400, false], [400, true], [800, true]] as const) {
      reset()
      const n = 2_000
      const started = performance.now()
      for (let i = 0; i < n; i++) {
        await query(i)
        work(gap, allocate)
      }
      const roundTrip = ((performance.now() - started) * 1000) / n - gap
      console.log(
        `gap ${String(gap).padStart(3)} µs ${allocate ? "allocating" : "spinning  "}: ${(Number(counted.ns) / 1000 / counted.writes).toFixed(1)} µs per write, ` +
          `round trip ${roundTrip.toFixed(0)} µs`
      )
    }
  } finally {
    await client.end()
  }
}

const main = async () => {
  const server = await startPostgres()
  try {
    const database = await createDatabase(server.adminUrl, "sockets")
    await perCycle("raw pg, PgAdvisory's", rawAdvisoryFenced(database, 1, 1, ms))
    await perCycle("PgAdvisory.layer", pgAdvisorySubject(database, 1, ms))
    await perCycle("raw pg, PgLease's", rawLease(database, 1, ms))
    await perCycle("PgLease.layer", pgLeaseSubject(database, 1, ms))
    console.log("")
    await gaps(server.adminUrl)
  } finally {
    await server.stop()
  }
}

main().catch((error) => {
  console.error(error)
  process.exitCode = 1
})

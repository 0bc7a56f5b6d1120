/**
 * Prepared-statement names mean one text everywhere (issue 34, point 2).
 *
 * node-pg parses a named statement once per client connection and afterwards only binds it.
 * Behind PgBouncer in transaction mode (before 1.21) that bind can land on any server connection;
 * if another process prepared the same name there with another text, PostgreSQL runs that text
 * with our parameters. Names taken by first use in the process (`effect_lock_1`, …) differ between
 * processes that meet the statements in another order; names from a hash of the text do not.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest"
import pg from "pg"
import { preparedName } from "../src/internal/pg/driver.js"
import { useTestDatabase } from "./support/pg.js"
import { noPgBouncer, type PgBouncer, startPgBouncer } from "./support/pgbouncer.js"
import { type LineWorker, startingWith, startLineWorker } from "./support/workers.js"

// First, so that its afterAll (leak check, drop) runs after everything else of this file is closed.
const db = useTestDatabase("pglease_prepared_names")

describe("preparedName", () => {
  it("is the same for equal texts, differs for different texts, fits an identifier and is stable", () => {
    const text = "select $1::text as r"
    expect(preparedName(text)).toBe(preparedName(`select $1::text ${"as r"}`))
    expect(preparedName(text)).not.toBe(preparedName("select $1::text as s"))
    // Frozen: `printf '%s' 'select $1::text as r' | sha256sum | cut -c1-32`. A name must not change
    // between library versions either: processes of two versions share a pooler's server connections.
    expect(preparedName(text)).toBe("effect_lock_722d271c7341cb2814feda150468d565")
    const long = `select ${"x".repeat(10_000)} where $1::int = 1`
    for (const t of [text, long, ""]) {
      expect(Buffer.byteLength(preparedName(t))).toBeLessThanOrEqual(63)
      expect(preparedName(t)).toMatch(/^[a-z_][a-z0-9_]*$/)
    }
  })
})

/** A worker process that met the texts in `order`; its "ready" line carries its names for A and B. */
const startWorker = async (url: string, order: "AB" | "BA") => {
  const worker = startLineWorker("test/fixtures/prepared-name-worker.ts", [url, order])
  const [, nameA, nameB] = (await worker.ready).split(" ")
  return { worker, names: { A: nameA!, B: nameB! } }
}

/** Runs text `key` with `value` in the worker: which text answered, and on which server connection. */
const run = async (worker: LineWorker, key: "A" | "B", value: string) => {
  const line = await worker.command(`run ${key} ${value}`, (l) => startingWith("result")(l) || startingWith("error")(l))
  const [kind, answer, pid, statements] = line.split(" ")
  if (kind !== "result") throw new Error(`run ${key} failed in the worker: ${line}`)
  return { answer: answer!, pid: Number(pid), statements: statements! }
}

/** Raw clients of `pin`, ended after the tests whatever happened. */
const pinned: Array<pg.Client> = []

/** A raw client through the pooler that holds a server connection with an open transaction. */
const pin = async (url: string) => {
  const client = new pg.Client({ connectionString: url })
  client.on("error", () => {})
  pinned.push(client)
  await client.connect()
  await client.query("begin")
  const pid = (await client.query<{ pid: number }>("select pg_backend_pid() as pid")).rows[0]!.pid
  return {
    pid,
    release: async () => {
      await client.query("commit")
      await client.end()
    }
  }
}

describe.skipIf(noPgBouncer())("prepared statements behind PgBouncer 1.18 in transaction mode", () => {
  let bouncer: PgBouncer | undefined
  const workers: Array<LineWorker> = []
  beforeAll(async () => {
    // Two server connections: with one of them pinned by an open transaction, every other
    // transaction goes to the other one.
    bouncer = await startPgBouncer({ targetUrl: db.url, poolMode: "transaction", defaultPoolSize: 2 })
  })
  afterAll(async () => {
    await Promise.all(workers.map((w) => w.kill()))
    await Promise.all(pinned.map((client) => client.end().catch(() => {})))
    await bouncer?.stop()
  })

  it("a process never runs another text under a name it prepared, whatever order processes met the statements in", async () => {
    const url = bouncer!.url
    // X met A first (a lock first), Y met B first (a semaphore first).
    const x = await startWorker(url, "AB")
    const y = await startWorker(url, "BA")
    workers.push(x.worker, y.worker)

    // Y prepares B on server connection S2 while S1 is pinned; node-pg now only binds it on Y's connection.
    const s1 = await pin(url)
    const first = await run(y.worker, "B", "y1")
    expect(first).toEqual({ answer: "B:y1", pid: expect.any(Number), statements: "named" })
    expect(first.pid).not.toBe(s1.pid)
    // Pin S2 and free S1: X prepares A on S1.
    const s2 = await pin(url)
    expect(s2.pid).toBe(first.pid)
    await s1.release()
    const ofX = await run(x.worker, "A", "x1")
    expect(ofX).toEqual({ answer: "A:x1", pid: s1.pid, statements: "named" })
    // Y's next bind of its B can only land on S1, where X prepared A.
    const second = await run(y.worker, "B", "y2")
    await s2.release()
    expect(second.pid, "the bind was steered onto the server connection where X prepared A").toBe(s1.pid)
    expect(
      second.answer,
      `Y ran its text B as "${y.names.B}" on server connection ${second.pid}, where X had prepared its text A as ` +
        `"${x.names.A}" (an answer "A:y2" is X's text A run with Y's parameters; Y's connection then sent ` +
        `${second.statements} statements)`
    ).toBe("B:y2")
    // On PgBouncer 1.18 the fixed names make that bind fail with 26000 (S1 lacks Y's name), and
    // Y's connection sent B again unnamed: second.statements is "unnamed". A PgBouncer that tracks
    // prepared statements itself (1.21+ with max_prepared_statements) would keep it "named".
    // And X, asked for B, still gets B.
    expect((await run(x.worker, "B", "x2")).answer).toBe("B:x2")

    expect(await x.worker.exit()).toBe(0)
    expect(await y.worker.exit()).toBe(0)
  })
})

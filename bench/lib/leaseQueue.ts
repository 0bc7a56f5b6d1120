/**
 * For the diagnostics that time PgLease's statements at the server (`releaseCost.ts`,
 * `releaseAlone.ts`, `plpgsqlProbe.ts`): their main on one connection to a scratch database with
 * the lease tables, and a name held with exclusive places queued behind it.
 */
import * as Crypto from "node:crypto"
import pg from "pg"
import * as LeaseSql from "../../src/internal/lease/pg/sql.js"
import { type Database, runMain, withScratchDatabase } from "./postgres.js"

/** Runs `run` as the process's main, on one connection to a scratch database (`label`) that has PgLease's tables `table`. */
export const mainOnLeaseTables = (
  label: string,
  table: LeaseSql.TableRef,
  run: (client: pg.Client, database: Database) => Promise<void>
): void =>
  runMain(() =>
    withScratchDatabase(label, async (database) => {
      const client = new pg.Client({ connectionString: database.url })
      await client.connect()
      try {
        await client.query(LeaseSql.createTable(table))
        await run(client, database)
      } finally {
        await client.end()
      }
    })
  )

/**
 * A name held with `places` exclusive places queued behind it: the holder, the places in queue
 * order (each place's id is its owner's), and `ask`, a waiting acquire of the name (granted when
 * it is free, else it takes a place).
 */

export const queuedName = async (client: pg.Client, table: LeaseSql.TableRef, name: string, places: number) => {
  const acquire = LeaseSql.acquire(table)
  const ask = (owner: string) =>
    client.query({ name: "acquire", text: acquire, values: [name, owner, owner, "exclusive", 60_000, 60_000, "bench", "host", process.pid, true] })
  const holder: string = Crypto.randomUUID()
  await ask(holder)
  const queue: Array<string> = []
  for (let i = 0; i < places; i++) {
    const owner = Crypto.randomUUID()
    await ask(owner)
    queue.push(owner)
  }
  return { ask, holder, queue }
}

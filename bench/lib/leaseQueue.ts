/**
 * A PgLease name held with exclusive places queued behind it, for the diagnostics that time a
 * release at the server (`releaseCost.ts`, `releaseAlone.ts`): the holder, the places in queue
 * order (each place's id is its owner's), and `ask`, a waiting acquire of the name (granted when
 * it is free, else it takes a place).
 */
import * as Crypto from "node:crypto"
import type pg from "pg"
import * as LeaseSql from "../../src/internal/lease/pg/sql.js"

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

/**
 * `npx tsx bench/releaseAlone.ts [--rounds=R] [--releases=N]`
 *
 * What a holder's lone give-back costs at the server as PgLease sends it (`releaseBatch` with one
 * member) against the full `release` statement, on one connection, in alternating rounds of N:
 * - a handover: the name is held with 7 exclusive places behind it, so every give-back hands the
 *   lease to the head (checked: the head holds it after), and the old holder takes a place again;
 * - an uncontended give-back: nobody waits, the lease is freed.
 * The median wall time of the statement, per round. A diagnostic: nothing is written to the report.
 */
import * as Crypto from "node:crypto"
import * as LeaseSql from "../src/internal/lease/pg/sql.js"
import { mainOnLeaseTables, queuedName } from "./lib/leaseQueue.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const rounds = Number(arg("rounds") ?? "4")
const releases = Number(arg("releases") ?? "300")

const TABLE = "release_alone_leases"
const table = LeaseSql.parseTable(TABLE) as LeaseSql.TableRef
const median = (values: Array<number>) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)]!

type Which = "release" | "alone"

mainOnLeaseTables("release-alone", table, async (client) => {
  const release = LeaseSql.release(table)
  const alone = LeaseSql.releaseBatch(table)
  const name = "release-alone"
  const giveBack = (which: Which, owner: string) =>
    which === "release"
      ? client.query({ name: "release", text: release, values: [name, owner, null, TABLE] })
      : client.query({ name: "alone", text: alone, values: [[name], [owner], TABLE] })
  const ownerNow = async () => (await client.query<{ owner: string | null }>(`select owner from ${TABLE} where name = $1`, [name])).rows[0]!.owner

  const queued = await queuedName(client, table, name, 7)
  const { ask, queue } = queued
  let holder = queued.holder
  /** `n` give-backs, each handing the lease to the head; the old holder queues again. Median ms. */
  const handovers = async (which: Which, n: number) => {
    const walls: Array<number> = []
    for (let i = 0; i < n; i++) {
      const start = performance.now()
      const answer = await giveBack(which, holder)
      walls.push(performance.now() - start)
      if (String(answer.rows[0]?.released) !== "1") throw new Error(`${which} ${i}: not given back (${JSON.stringify(answer.rows)})`)
      const old = holder
      holder = queue.shift()!
      const owner = await ownerNow()
      if (owner !== holder) throw new Error(`${which} ${i}: the lease went to ${owner}, not to the head ${holder}`)
      await ask(old)
      queue.push(old)
    }
    return median(walls)
  }
  /** `n` uncontended cycles (nobody waits); the give-back's median ms. */
  const uncontended = async (which: Which, n: number) => {
    const walls: Array<number> = []
    for (let i = 0; i < n; i++) {
      const owner = Crypto.randomUUID()
      await ask(owner)
      const start = performance.now()
      const answer = await giveBack(which, owner)
      walls.push(performance.now() - start)
      if (String(answer.rows[0]?.released) !== "1") throw new Error(`${which} uncontended ${i}: not given back (${JSON.stringify(answer.rows)})`)
    }
    return median(walls)
  }
  await handovers("release", 100)
  await handovers("alone", 100)
  for (let round = 0; round < rounds; round++) {
    const full = await handovers("release", releases)
    const one = await handovers("alone", releases)
    console.log(`handover, round ${round}: release p50 ${full.toFixed(3)} ms, releaseBatch alone p50 ${one.toFixed(3)} ms`)
  }
  // Nobody waits from here on: the places go, the holder gives back.
  await client.query(`delete from ${TABLE}_queue`)
  await giveBack("release", holder)
  for (let round = 0; round < rounds; round++) {
    const full = await uncontended("release", releases)
    const one = await uncontended("alone", releases)
    console.log(`uncontended, round ${round}: release p50 ${full.toFixed(3)} ms, releaseBatch alone p50 ${one.toFixed(3)} ms`)
  }
})

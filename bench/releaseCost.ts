/**
 * `npx tsx bench/releaseCost.ts [--listeners=0,8,16] [--handovers=N]`
 *
 * What PgLease's handover costs at the server, alone: one connection sends PgLease's release
 * (`src/internal/lease/pg/sql.ts`) for a name held with 7 places behind it, so that every release
 * hands the lease to the head of the queue (a durable commit and a NOTIFY), and the old holder
 * takes a place again; the median wall time of a release, then the same with N other connections
 * listening — on the lease table's channel (each is sent every notification) and on another
 * channel (none is sent one). Also the release's server time from `EXPLAIN ANALYZE` in a
 * rolled-back transaction. A diagnostic: nothing is written to the report.
 */
import pg from "pg"
import * as LeaseSql from "../src/internal/lease/pg/sql.js"
import { mainOnLeaseTables, queuedName } from "./lib/leaseQueue.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const listenerCounts = (arg("listeners") ?? "0,8,16").split(",").map(Number)
const handovers = Number(arg("handovers") ?? "300")

const TABLE = "release_cost_leases"
const table = LeaseSql.parseTable(TABLE) as LeaseSql.TableRef
const median = (values: Array<number>) => [...values].sort((a, b) => a - b)[Math.floor(values.length / 2)]!

mainOnLeaseTables("release-cost", table, async (client, database) => {
  const release = LeaseSql.release(table)
  const name = "release-cost"
  const queued = await queuedName(client, table, name, 7)
  const { ask, queue } = queued
  let holder = queued.holder
  await client.query(`prepare release_cost as ${release}`)
  const explained: Array<string> = []
  for (let i = 0; i < 12; i++) {
    await client.query("begin")
    const plan = await client.query(`explain (analyze, timing off, summary on) execute release_cost('${name}', '${holder}', null, '${TABLE}')`)
    await client.query("rollback")
    if (i >= 6) explained.push(...plan.rows.map((r) => String(r["QUERY PLAN"])).filter((line) => /Planning|Execution/.test(line)))
  }
  console.log(`release, EXPLAIN ANALYZE (rolled back): ${explained.slice(-4).join("; ")}`)
  /** `handovers` releases, each handing over to the head; the old holder queues again. Median ms. */
  const hand = async () => {
    const walls: Array<number> = []
    for (let i = 0; i < handovers; i++) {
      const start = performance.now()
      const answer = await client.query({ name: "release", text: release, values: [name, holder, null, TABLE] })
      walls.push(performance.now() - start)
      if (answer.rows[0]?.released !== "1") throw new Error(`release ${i}: not released (${JSON.stringify(answer.rows[0])})`)
      const old = holder
      holder = queue.shift()!
      await ask(old)
      queue.push(old)
    }
    return median(walls)
  }
  await hand()
  for (const count of listenerCounts) {
    for (const channel of count === 0 ? [TABLE] : [TABLE, "another_channel"]) {
      const listeners = await Promise.all(Array.from({ length: count }, async () => {
        const listener = new pg.Client({ connectionString: database.url })
        await listener.connect()
        await listener.query(`listen "${channel}"`)
        return listener
      }))
      let heard = 0
      for (const listener of listeners) listener.on("notification", () => void heard++)
      const ms = await hand()
      console.log(
        `${String(count).padStart(2)} listeners${count === 0 ? "" : channel === TABLE ? " on the lease table's channel" : " on another channel"}: ` +
          `handover release p50 ${ms.toFixed(3)} ms (${heard} notifications heard)`
      )
      await Promise.all(listeners.map((listener) => listener.end()))
    }
  }
})

/**
 * `npx tsx --import ./bench/lib/built.mjs bench/statementCost.ts`
 *
 * What PgLease's statements cost at the server, one connection, nothing else running:
 * 1. its acquire and release on one name, back to back, prepared (p50 of 3,000 after 500), under
 *    `plan_cache_mode` auto and `force_generic_plan`, alternating;
 * 2. `EXPLAIN (ANALYZE)` of each as a generic plan: `Execution Time` (executor set-up, run and
 *    tear-down) beside the number of plan lines;
 * 3. a statement of N copies of one indexed read as CTEs (N = 1 … 32), generic plan, p50 of 2,000:
 *    what each CTE costs the executor whether or not it returns a row.
 */
import * as Crypto from "node:crypto"
import pg from "pg"
import * as LeaseSql from "../src/internal/lease/pg/sql.js"
import { createDatabase, runMain, startPostgres } from "./lib/postgres.js"

const p50 = (values: Array<number>) => [...values].sort((a, b) => a - b)[values.length >> 1]!

const timed = async (f: () => Promise<unknown>): Promise<number> => {
  const started = performance.now()
  await f()
  return performance.now() - started
}

runMain(async () => {
  const server = await startPostgres()
  try {
    const database = await createDatabase(server.adminUrl, "statement_cost")
    const client = new pg.Client({ connectionString: database.url })
    await client.connect()
    try {
      const table = LeaseSql.parseTable("cost_leases") as LeaseSql.TableRef
      await client.query(LeaseSql.createTable(table))
      const acquire = LeaseSql.acquire(table)
      const release = LeaseSql.release(table)
      const acquireParams = (owner: string) => ["x", owner, Crypto.randomUUID(), "exclusive", 30_000, 5_000, "cost", "host", 1, true]
      for (const mode of ["auto", "force_generic_plan", "auto", "force_generic_plan"]) {
        await client.query(`set plan_cache_mode = ${mode}`)
        const took = { acquire: [] as Array<number>, release: [] as Array<number> }
        for (let i = 0; i < 3_500; i++) {
          const owner = Crypto.randomUUID()
          const a = await timed(() => client.query({ name: "cost_acquire", text: acquire, values: acquireParams(owner) }))
          const r = await timed(() => client.query({ name: "cost_release", text: release, values: ["x", owner, null, "cost_leases"] }))
          if (i >= 500) took.acquire.push(a), took.release.push(r)
        }
        console.log(`${mode.padEnd(18)} acquire p50 ${p50(took.acquire).toFixed(3)} ms, release p50 ${p50(took.release).toFixed(3)} ms`)
      }
      await client.query("set plan_cache_mode = force_generic_plan")
      await client.query(`prepare explain_acquire as ${acquire}`)
      await client.query(`prepare explain_release as ${release}`)
      const literal = (values: ReadonlyArray<unknown>) => values.map((v) => (v === null ? "null" : typeof v === "string" ? `'${v}'` : String(v))).join(", ")
      for (let i = 0; i < 3; i++) {
        const owner = Crypto.randomUUID()
        const plans = [
          await client.query(`explain (analyze, summary) execute explain_acquire(${literal(acquireParams(owner))})`),
          await client.query(`explain (analyze, summary) execute explain_release(${literal(["x", owner, null, "cost_leases"])})`)
        ]
        console.log(plans.map((plan, k) => {
          const lines = plan.rows.map((row: Record<string, string>) => row["QUERY PLAN"]!)
          return `${k === 0 ? "acquire" : "release"}: ${lines.length} plan lines, top node ${/actual time=[\d.]+\.\.([\d.]+)/.exec(lines[0]!)?.[1]} ms, ${lines.find((l) => l.startsWith("Execution Time"))}`
        }).join("; "))
      }
      await client.query("insert into cost_leases (name, token) values ('x', 1) on conflict do nothing")
      for (const n of [1, 4, 8, 16, 32]) {
        const ctes = Array.from({ length: n }, (_, i) => `c${i} as (select owner from cost_leases where name = $1::text)`)
        const text = `with ${ctes.join(", ")} select ${ctes.map((_, i) => `(select count(*) from c${i})`).join(" + ")} as n`
        const took: Array<number> = []
        for (let i = 0; i < 2_500; i++) {
          const t = await timed(() => client.query({ name: `cost_ctes_${n}`, text, values: ["x"] }))
          if (i >= 500) took.push(t)
        }
        console.log(`${String(n).padStart(2)} CTEs: p50 ${(p50(took) * 1000).toFixed(0)} µs`)
      }
    } finally {
      await client.end()
      await database.drop()
    }
  } finally {
    await server.stop()
  }
})

/**
 * PgLease's connections, under the name `lease/pg/lane.ts` imports: everything here is
 * `pool.ts` (PgLease's own connections and their pool, over the shared edge in `driver.ts`).
 * New code imports `pool.ts`.
 */
export * from "./pool.js"

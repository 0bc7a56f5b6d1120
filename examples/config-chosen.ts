/**
 * The backend chosen by configuration: `LockConfig.layer` reads `EFFECT_LOCK_BACKEND`
 * (`memory`, `pg-advisory`, `pg-lease` or `sqlite`) and that backend's settings from the
 * environment (or any `ConfigProvider`), so one program runs on memory in tests and on PostgreSQL
 * or SQLite in production without a line changed.
 *
 *   EFFECT_LOCK_BACKEND=pg-lease DATABASE_URL=postgres://… npx tsx examples/config-chosen.ts
 */
import { Effect } from "effect"
import { DistributedLock, LockConfig } from "effect-lock"

const program = Effect.gen(function*() {
  const lock = yield* DistributedLock.DistributedLock
  yield* Effect.log(`locking on ${lock.backend}`)
  yield* Effect.log("migrating, once across replicas").pipe(DistributedLock.withLock("migrations"))
})

program.pipe(Effect.provide(LockConfig.layer), Effect.runPromise)

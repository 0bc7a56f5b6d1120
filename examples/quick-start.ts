import { Effect } from "effect"
import { DistributedLock, MemoryBackend } from "effect-lock"

const nightly = Effect.gen(function*() {
  const lease = yield* DistributedLock.acquire("nightly", { timeout: "5 seconds" })
  yield* Effect.log(`holding ${lease.name} with fencing token ${lease.token}`)
}).pipe(Effect.scoped) // the lock is released when the scope closes

const guarded = Effect.log("runs once across replicas").pipe(DistributedLock.withLock("report"))

Effect.runPromise(Effect.zipRight(nightly, guarded).pipe(Effect.provide(MemoryBackend.layer())))

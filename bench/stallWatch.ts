/**
 * The stall watch's per-operation check, measured: a loop of Effect.sync steps run bare and
 * inside withLock on the memory backend (bench/README.md). Not part of `npm run bench`.
 */
import { Effect, Duration } from "effect"
import * as DistributedLock from "../src/DistributedLock.js"
import * as MemoryBackend from "../src/MemoryBackend.js"
const N = 1_000_000
const body = Effect.gen(function*() { let x = 0; for (let i = 0; i < N; i++) x += yield* Effect.sync(() => i) ; return x })
const program = Effect.gen(function*() {
  for (let round = 0; round < 5; round++) {
    let t = performance.now()
    yield* body
    const bare = performance.now() - t
    t = performance.now()
    yield* DistributedLock.withLock(body, "x", { ttl: Duration.seconds(30) })
    const guarded = performance.now() - t
    console.log(`bare ${(bare / N * 1e6).toFixed(0)} ns/iter, guarded ${(guarded / N * 1e6).toFixed(0)} ns/iter`)
  }
}).pipe(Effect.provide(MemoryBackend.layer()))
Effect.runPromise(program)

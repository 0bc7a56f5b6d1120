/**
 * `node --expose-gc --import tsx bench/memoryNames.ts [--names=N]`
 *
 * What an idle name costs: N distinct names each locked once and released, then the heap
 * (`process.memoryUsage().heapUsed` after `gc()`) against the heap before. Two runs, each on a
 * fresh store: the backend alone (the store's own state, `MemoryBackend.makeBackend` called
 * directly) and the whole service (`DistributedLock.withLock`, the core's per-name state
 * included). Not a test: prints bytes per name.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as DistributedLock from "../src/DistributedLock.js"
import * as MemoryBackend from "../src/MemoryBackend.js"

const arg = (name: string, fallback: number): number => {
  const found = process.argv.find((a) => a.startsWith(`--${name}=`))
  return found === undefined ? fallback : Number(found.slice(name.length + 3))
}

const gc = (globalThis as { gc?: () => void }).gc
if (gc === undefined) throw new Error("run with --expose-gc (node --expose-gc --import tsx bench/memoryNames.ts)")

const heap = (): number => {
  for (let i = 0; i < 4; i++) gc()
  return process.memoryUsage().heapUsed
}

const N = arg("names", 100_000)

/** Heap growth per name over `n` distinct names, measured inside the store's/layer's lifetime. */
const measure = (label: string, cycle: (name: string) => Effect.Effect<void>, setup: <A>(self: Effect.Effect<A>) => Effect.Effect<A>) =>
  Effect.gen(function*() {
    // Warm-up on names of its own, so code paths and caches that do not grow per name are built.
    for (let i = 0; i < 1_000; i++) yield* cycle(`warm-${label}-${i}`)
    const before = heap()
    for (let i = 0; i < N; i++) yield* cycle(`acct-${label}-${i}`)
    const after = heap()
    console.log(`${label.padEnd(8)} ${N} names: heap +${((after - before) / 1024 / 1024).toFixed(2)} MB, ${((after - before) / N).toFixed(1)} bytes per idle name`)
  }).pipe(setup)

const backendRun = Effect.scoped(Effect.gen(function*() {
  const backend = yield* MemoryBackend.makeBackend()
  const request = (name: string) => ({
    name,
    mode: "exclusive" as const,
    attempt: "once" as const,
    ttl: Duration.seconds(30),
    deadline: Option.none(),
    interruptible: <A, E, R>(step: Effect.Effect<A, E, R>) => step,
    waitUntilDeadline: <A, E, R>(step: Effect.Effect<A, E, R>) => Effect.map(step, Option.some),
    onLost: () => Effect.void
  })
  yield* measure("backend", (name) =>
    Effect.orDie(Effect.flatMap(backend.acquire(request(name)), (result) =>
      result._tag === "Granted" ? result.grant.release : Effect.die(`not granted: ${name}`))), (self) => self)
}))

const serviceRun = measure(
  "service",
  (name) => DistributedLock.withLock(name)(Effect.void) as Effect.Effect<void>,
  (self) => Effect.provide(self, MemoryBackend.layer())
)

Effect.runPromise(Effect.zipRight(backendRun, serviceRun)).catch((e) => {
  console.error(e)
  process.exit(1)
})

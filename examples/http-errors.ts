/**
 * Lock errors in an `HttpApi`: an endpoint that declares `LockError.LockTimeout` answers a busy
 * lock with 503 and a JSON body naming the lock, without any mapping of its own. Here another
 * replica holds the lock while a request comes in, then lets go; the requests go through the
 * API's real web handler (in production: `HttpApiBuilder.serve` on your HTTP server).
 *
 *   npx tsx examples/http-errors.ts
 */
import { HttpApi, HttpApiBuilder, HttpApiEndpoint, HttpApiGroup, HttpServer } from "@effect/platform"
import { Deferred, Effect, Fiber, Layer } from "effect"
import { DistributedLock, LockError, MemoryBackend } from "effect-lock"

class Reports extends HttpApiGroup.make("reports")
  .add(HttpApiEndpoint.post("build", "/reports/build"))
  .addError(LockError.LockTimeout) // 503 { name, waited, retryAfter }
  .addError(LockError.LockLost) // 503 { name, token, reason, retryAfter }
  .addError(LockError.InvalidLockName) // 400 { name, reason }
  .addError(LockError.LockBackendError) // 503; its body has the driver's message: internal APIs only
{}

class Api extends HttpApi.make("app").add(Reports) {}

const handlers = HttpApiBuilder.group(Api, "reports", (handlers) =>
  handlers.handle("build", () =>
    Effect.log("building the report").pipe(DistributedLock.withLock("report-build", { timeout: "200 millis" }))))

const program = Effect.gen(function*() {
  // Two replicas: this API's, and another one that holds the lock for a while.
  const store = yield* MemoryBackend.makeStore
  const web = HttpApiBuilder.toWebHandler(
    Layer.mergeAll(
      HttpApiBuilder.api(Api).pipe(Layer.provide(handlers), Layer.provide(MemoryBackend.layer({ store }))),
      HttpServer.layerContext
    )
  )
  const post = Effect.promise(async () => {
    const response = await web.handler(new Request("http://localhost/reports/build", { method: "POST" }))
    const body = await response.text()
    return body === "" ? `${response.status}` : `${response.status} ${body}`
  })
  const holding = yield* Deferred.make<void>()
  const other = yield* Effect.fork(
    Effect.zipRight(Deferred.succeed(holding, undefined), Effect.never).pipe(
      DistributedLock.withLock("report-build"),
      Effect.provide(MemoryBackend.layer({ store }))
    )
  )
  yield* Deferred.await(holding)
  yield* Effect.log(`while another replica builds: ${yield* post}`)
  yield* Fiber.interrupt(other)
  yield* Effect.log(`once it is done: ${yield* post}`)
  yield* Effect.promise(() => web.dispose())
})

Effect.runPromise(program)

/**
 * Lock errors through a real `HttpApi` server on a loopback port, asked by real HTTP clients
 * (fetch for the raw status, headers and body; `HttpApiClient` for what an Effect client decodes).
 * Each endpoint produces its error the way an application would meet it: a lock that stays busy,
 * a lease taken away mid-request, an empty name, a stale token at a real fence, a missing table.
 */
import {
  FetchHttpClient,
  HttpApi,
  HttpApiBuilder,
  HttpApiClient,
  HttpApiEndpoint,
  HttpApiGroup,
  HttpApiSchema,
  HttpServer
} from "@effect/platform"
import { describe, expect, it } from "@effect/vitest"
import { Effect, Layer } from "effect"
import * as DistributedLock from "effect-lock/DistributedLock"
import * as Fence from "effect-lock/Fence"
import * as FencingToken from "effect-lock/FencingToken"
import * as LockError from "effect-lock/LockError"
import * as MemoryBackend from "effect-lock/MemoryBackend"
import * as Http from "node:http"
import type { AddressInfo } from "node:net"
import { PgTest, useTestDatabase } from "./support/pg.js"

// First, so that its afterAll (leak check, drop) runs after the server's pool is closed.
const db = useTestDatabase("http_api")

/** What an application declares: the lock errors its lock-using endpoints can fail with. */
class Locks extends HttpApiGroup.make("locks")
  .add(HttpApiEndpoint.post("timeout", "/timeout"))
  .add(HttpApiEndpoint.post("lost", "/lost"))
  .add(HttpApiEndpoint.post("invalidName", "/invalid-name"))
  .add(HttpApiEndpoint.post("backend", "/backend"))
  .add(HttpApiEndpoint.post("unsafePooling", "/unsafe-pooling"))
  // Declared on the endpoint itself, the other way an HttpApi states its errors.
  .add(HttpApiEndpoint.post("stale", "/stale").addError(LockError.StaleFencingToken))
  .addError(LockError.LockTimeout)
  .addError(LockError.LockLost)
  .addError(LockError.InvalidLockName)
  .addError(LockError.LockBackendError)
  .addError(LockError.UnsafeConnectionPooling)
{}

class Api extends HttpApi.make("app").add(Locks) {}

const token = (n: bigint) => FencingToken.make(n)

/** The handlers: each request meets one error for real. */
const handlers = (store: MemoryBackend.Store) =>
  HttpApiBuilder.group(Api, "locks", (handlers) =>
    handlers
      .handle("timeout", () =>
        Effect.scoped(
          Effect.gen(function*() {
            yield* DistributedLock.acquire("http/busy")
            // Locks are not re-entrant: a second request for a held name waits like any other.
            yield* Effect.scoped(DistributedLock.acquire("http/busy", { timeout: "100 millis" }))
          })
        ))
      .handle("lost", () =>
        // The lease is taken away while the work runs: withLock interrupts it with LockLost.
        DistributedLock.withLock(Effect.zipRight(MemoryBackend.revoke(store, "http/report"), Effect.never), "http/report"))
      .handle("invalidName", () => Effect.scoped(Effect.asVoid(DistributedLock.acquire(""))))
      .handle("stale", () =>
        Effect.gen(function*() {
          yield* Fence.check("http-orders", token(5n))
          yield* Fence.check("http-orders", token(3n))
        }))
      .handle("backend", () =>
        Effect.flatMap(
          Fence.make({ table: "http_never_created", createTable: false }),
          // A missing table fails before any token is compared.
          (fence) => Effect.catchTag(fence.check("http-orders", token(1n)), "StaleFencingToken", Effect.die)
        ))
      .handle("unsafePooling", () =>
        // Only a transaction-mode pooler produces it, when PgAdvisory.layer is built; an app that
        // declares it anyway answers as for a server fault.
        Effect.fail(new LockError.UnsafeConnectionPooling({ detail: "two statements ran on two backends" })))
  ).pipe(Layer.provide(Layer.mergeAll(MemoryBackend.layer({ store }), PgTest.layer(db))))

/** The API behind a plain `node:http` server on 127.0.0.1, closed (and its pool with it) with the scope. */
const serve = (store: MemoryBackend.Store) =>
  Effect.acquireRelease(
    Effect.async<{ readonly base: string; readonly close: () => Promise<void> }>((resume) => {
      const web = HttpApiBuilder.toWebHandler(
        Layer.mergeAll(HttpApiBuilder.api(Api).pipe(Layer.provide(handlers(store))), HttpServer.layerContext)
      )
      const server = Http.createServer((req, res) => {
        const chunks: Array<Buffer> = []
        req.on("data", (chunk: Buffer) => chunks.push(chunk))
        req.on("end", () => {
          const { port } = server.address() as AddressInfo
          const body = req.method === "GET" || req.method === "HEAD" ? undefined : Buffer.concat(chunks)
          const headers = new Headers()
          for (const [key, value] of Object.entries(req.headers)) {
            if (typeof value === "string") headers.set(key, value)
          }
          void web.handler(new Request(`http://127.0.0.1:${port}${req.url}`, { method: req.method!, headers, body: body ?? null }))
            .then(async (response) => {
              res.writeHead(response.status, Object.fromEntries(response.headers))
              res.end(Buffer.from(await response.arrayBuffer()))
            })
            .catch((error: unknown) => {
              res.writeHead(599)
              res.end(String(error))
            })
        })
      })
      server.listen(0, "127.0.0.1", () => {
        const { port } = server.address() as AddressInfo
        resume(Effect.succeed({
          base: `http://127.0.0.1:${port}`,
          close: () =>
            new Promise<void>((resolve) => server.close(() => resolve())).then(() => web.dispose())
        }))
      })
    }),
    (server) => Effect.promise(server.close)
  )

interface Answer {
  readonly status: number
  readonly contentType: string | null
  readonly body: Record<string, unknown>
}

/** A plain HTTP request, as any client in any language would send it. */
const post = (base: string, path: string): Effect.Effect<Answer> =>
  Effect.promise(async () => {
    const response = await fetch(`${base}${path}`, { method: "POST" })
    const text = await response.text()
    return { status: response.status, contentType: response.headers.get("content-type"), body: JSON.parse(text) }
  })

describe("lock errors over HttpApi", () => {
  it("the errors carry @effect/platform's status annotation under its own key", () => {
    expect(LockError.HttpStatusAnnotation).toBe(HttpApiSchema.AnnotationStatus)
    const statusOf = (schema: { readonly ast: Parameters<typeof HttpApiSchema.getStatusErrorAST>[0] }) =>
      HttpApiSchema.getStatusErrorAST(schema.ast)
    expect(statusOf(LockError.LockTimeout)).toBe(503)
    expect(statusOf(LockError.LockLost)).toBe(503)
    expect(statusOf(LockError.LockBackendError)).toBe(503)
    expect(statusOf(LockError.InvalidLockName)).toBe(400)
    expect(statusOf(LockError.StaleFencingToken)).toBe(409)
    expect(statusOf(LockError.UnsafeConnectionPooling)).toBe(500)
  })

  it.live("each endpoint answers with its error's status and a JSON body naming the lock and token", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const { base } = yield* serve(store)

      const timeout = yield* post(base, "/timeout")
      expect(timeout.status).toBe(503)
      expect(timeout.contentType).toMatch(/^application\/json/)
      expect(timeout.body).toEqual({ _tag: "LockTimeout", name: "http/busy", waited: expect.any(Number), retryAfter: 1 })
      // `waited` is in milliseconds, and the wait lasted at least the timeout the handler gave.
      expect(timeout.body["waited"]).toBeGreaterThanOrEqual(100)

      const lost = yield* post(base, "/lost")
      expect(lost.status).toBe(503)
      // The token is the store's (one counter for every name of the app's memory store): a decimal string.
      expect(lost.body).toEqual({ _tag: "LockLost", name: "http/report", token: expect.stringMatching(/^[1-9][0-9]*$/), reason: "revoked", retryAfter: 1 })

      const invalid = yield* post(base, "/invalid-name")
      expect(invalid.status).toBe(400)
      expect(invalid.body).toMatchObject({ _tag: "InvalidLockName", name: "" })
      expect(invalid.body["reason"]).toMatch(/empty/)
      expect(invalid.body).not.toHaveProperty("retryAfter")

      const stale = yield* post(base, "/stale")
      expect(stale.status).toBe(409)
      expect(stale.body).toEqual({ _tag: "StaleFencingToken", resource: "http-orders", presented: "3", current: "5" })

      const backend = yield* post(base, "/backend")
      expect(backend.status).toBe(503)
      expect(backend.body).toMatchObject({ _tag: "LockBackendError", operation: "fence-check", name: "http-orders", retryAfter: 1 })
      // The driver error travels as its name and message only, never its stack.
      expect(backend.body["cause"]).toEqual({ name: "SqlError", message: expect.any(String) })

      const unsafe = yield* post(base, "/unsafe-pooling")
      expect(unsafe.status).toBe(500)
      expect(unsafe.body).toEqual({ _tag: "UnsafeConnectionPooling", detail: "two statements ran on two backends" })
    }).pipe(Effect.scoped), 30_000)

  it.live("an HttpApiClient gets the same typed errors back, tokens as bigints", () =>
    Effect.gen(function*() {
      const store = yield* MemoryBackend.makeStore
      const { base } = yield* serve(store)
      const client = yield* HttpApiClient.make(Api, { baseUrl: base })

      const timeout = yield* Effect.flip(client.locks.timeout())
      expect(timeout).toBeInstanceOf(LockError.LockTimeout)
      expect(timeout).toMatchObject({ name: "http/busy", retryAfter: 1 })
      expect(timeout.message).toMatch(/^timed out after 1\d\dms.* acquiring lock "http\/busy"$/)

      const lost = yield* Effect.flip(client.locks.lost())
      expect(lost).toBeInstanceOf(LockError.LockLost)
      expect(lost).toMatchObject({ name: "http/report", reason: "revoked", retryAfter: 1 })
      expect(lost._tag === "LockLost" && lost.token > 0n).toBe(true)

      const stale = yield* Effect.flip(client.locks.stale())
      expect(stale).toBeInstanceOf(LockError.StaleFencingToken)
      expect(stale).toMatchObject({ resource: "http-orders", presented: 3n, current: 5n })

      expect(yield* Effect.flip(client.locks.invalidName())).toBeInstanceOf(LockError.InvalidLockName)
      expect(yield* Effect.flip(client.locks.backend())).toBeInstanceOf(LockError.LockBackendError)
    }).pipe(Effect.scoped, Effect.provide(FetchHttpClient.layer)), 30_000)
})

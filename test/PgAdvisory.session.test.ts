/**
 * The session logic of PgAdvisory on the TestClock, over a fake driver edge (a stand-in for
 * node-pg's Client that answers, or withholds, each statement on the test's command). The same
 * guarantees are tested against the real server in PgAdvisory.test.ts and
 * PgAdvisory.faults.test.ts; here time is the test's, so the bounds are exact.
 */
import { describe, expect, it } from "@effect/vitest"
import { Duration, Effect, Fiber, Option, TestClock } from "effect"
import type { AcquireRequest } from "../src/LockBackend.js"
import type { LostReason } from "../src/LockError.js"
import { makeWith } from "../src/internal/advisory/engine.js"
import type { BackendOptions } from "../src/internal/advisory/state.js"
import type { Driver } from "../src/internal/pg/driver.js"
import { parseTable, type TableRef } from "../src/internal/sql/tables.js"

type Callback = (error: Error | null, result?: { rows: Array<Record<string, unknown>> }) => void

/** What the fake server does with heartbeats: answer at once, or hold the answer back. */
interface Script {
  holdHeartbeats: boolean
  readonly held: Array<() => void>
  heartbeats: number
  /** Keys of the try-lock statements the fake server received. */
  readonly tried: Array<string>
  /** When set, try-locks are answered by another backend, as after a pooler moved the session. */
  movedTo?: number
  /** When set, a try-lock's answer lists the row with the backend pid before the keys' rows. */
  pidRowFirst?: boolean
}

const PID = 4242

/** A fake node-pg module: one backend pid, every lock granted, heartbeats answered as scripted. */
const fakeDriver = (script: Script): Driver => {
  class FakeClient {
    readonly processID = PID
    readonly secretKey = 1
    readonly connectionParameters = { host: "fake", port: 1 }
    readonly connection = { stream: { destroy: () => this.close() } }
    private readonly listeners = new Map<string, Array<(arg?: unknown) => void>>()
    private closed = false
    on(event: string, listener: (arg?: unknown) => void) {
      this.listeners.set(event, [...(this.listeners.get(event) ?? []), listener])
      return this
    }
    connect(callback: (error?: Error) => void) {
      queueMicrotask(() => callback())
    }
    getTransactionStatus() {
      return "I"
    }
    end() {
      this.close()
      return Promise.resolve()
    }
    private close() {
      if (this.closed) return
      this.closed = true
      for (const listener of this.listeners.get("end") ?? []) listener()
    }
    query(textOrConfig: string | { readonly text: string; readonly values: unknown }, valuesOrCallback: unknown, maybeCallback?: Callback) {
      // node-pg's forms: (text, callback), (text, values, callback), ({ name, text, values }, callback).
      const text = typeof textOrConfig === "string" ? textOrConfig : textOrConfig.text
      const callback = (typeof valuesOrCallback === "function" ? valuesOrCallback : maybeCallback) as Callback
      const values = (typeof textOrConfig === "string"
        ? typeof valuesOrCallback === "function" ? undefined : valuesOrCallback
        : textOrConfig.values) as Array<Array<string>> | undefined
      const answer = (rows: Array<Record<string, unknown>>) => queueMicrotask(() => callback(null, { rows }))
      if (text.startsWith("select pg_backend_pid() as pid")) {
        script.heartbeats++
        if (script.holdHeartbeats) script.held.push(() => callback(null, { rows: [{ pid: PID }] }))
        else answer([{ pid: PID }])
      } else if (text.startsWith("with request as")) {
        const keys = values![0]!
        script.tried.push(...keys)
        const granted = keys.map((key) => ({ key, token: "1", pid: null }))
        const pidRow = { key: null, token: null, pid: script.movedTo ?? PID }
        answer(script.pidRowFirst === true ? [pidRow, ...granted] : [...granted, pidRow])
      } else if (text.startsWith("select pg_advisory_unlock")) {
        answer([{ released: true, pid: PID }])
      } else {
        // Session setup (its last result is the pid) and the fencing table's DDL.
        answer([{ pid: PID }])
      }
    }
  }
  return { Client: FakeClient } as unknown as Driver
}

const options: BackendOptions = {
  connect: { client: { host: "fake" }, applicationName: "fake", connectTimeoutMillis: 5_000, explicitApplicationName: false },
  maxSessions: 2,
  namespace: "",
  fencingTable: parseTable("effect_lock_fencing") as TableRef,
  createTables: true,
  heartbeatIntervalMillis: 500,
  heartbeatTimeoutMillis: 1_000,
  // No sweep: the fake server answers no SQL of it.
  sweepIntervalMillis: 0
}

const request = (name: string, lost: Array<LostReason>): AcquireRequest => ({
  name,
  mode: "exclusive",
  attempt: "wait",
  ttl: Duration.seconds(30),
  deadline: Option.none(),
  interruptible: (step) => step,
  waitUntilDeadline: (step) => Effect.asSome(step),
  onLost: (reason) => Effect.sync(() => lost.push(reason))
})

/** Lets every fiber that can run, run (the engine's steps are microtasks and immediates). */
const settle = Effect.promise(() => new Promise((resolve) => setImmediate(() => setImmediate(resolve))))

describe("PgAdvisory session logic on the TestClock", () => {
  it.scoped("a heartbeat left unanswered past its timeout destroys the session and tells its lease, not before", () =>
    Effect.gen(function*() {
      const script: Script = { holdHeartbeats: false, held: [], heartbeats: 0, tried: [] }
      const backend = yield* makeWith(options, fakeDriver(script))
      const lost: Array<LostReason> = []
      const granted = yield* backend.acquire(request("beat", lost))
      expect(granted._tag).toBe("Granted")
      script.holdHeartbeats = true
      // The next heartbeat goes out at the interval and gets no answer.
      yield* TestClock.adjust(Duration.millis(500))
      yield* settle
      expect(script.held.length).toBe(1)
      // Just under the timeout (plus the watchdog's tick): still held.
      yield* TestClock.adjust(Duration.millis(900))
      yield* settle
      expect(lost).toEqual([])
      // Past it: destroyed, the lease told.
      yield* TestClock.adjust(Duration.millis(300))
      yield* settle
      yield* settle
      expect(lost).toEqual(["connection-lost"])
    }))

  it.scoped("a waiting try-lock is taken back when its caller is interrupted before it was sent", () =>
    Effect.gen(function*() {
      const script: Script = { holdHeartbeats: true, held: [], heartbeats: 0, tried: [] }
      const backend = yield* makeWith(options, fakeDriver(script))
      // The home session's worker is busy with a held heartbeat: a try queues behind it.
      yield* TestClock.adjust(Duration.millis(500))
      yield* settle
      expect(script.held.length).toBe(1)
      const lost: Array<LostReason> = []
      const fiber = yield* Effect.fork(backend.acquire({ ...request("queued", lost), interruptible: (step) => step }))
      yield* settle
      yield* Fiber.interrupt(fiber)
      script.held.shift()!()
      yield* settle
      // Taken back: never sent to the server.
      expect(script.tried).toEqual([])
      // And nothing local was left: a fresh acquire of the same key is granted.
      script.holdHeartbeats = false
      const again = yield* backend.acquire(request("queued", lost))
      expect(again._tag).toBe("Granted")
      if (again._tag === "Granted") yield* again.grant.release
    }))

  it.scoped("a try-lock's answer is read by key, in whatever order the server lists its rows", () =>
    Effect.gen(function*() {
      // SQL gives a union no order: the row carrying the pid may come first. A grant read from the
      // wrong row would be taken for busy, and its lock left held by nobody.
      const script: Script = { holdHeartbeats: false, held: [], heartbeats: 0, tried: [], pidRowFirst: true }
      const backend = yield* makeWith(options, fakeDriver(script))
      const granted = yield* backend.acquire({ ...request("pid-first", []), attempt: "once" })
      expect(granted._tag).toBe("Granted")
      if (granted._tag === "Granted") expect(granted.grant.token).toBe(1n)
    }))

  it.scoped("a statement answered by another backend (a pooler moved the session) fails the acquire loudly and tells the other leases", () =>
    Effect.gen(function*() {
      const script: Script = { holdHeartbeats: false, held: [], heartbeats: 0, tried: [] }
      const backend = yield* makeWith(options, fakeDriver(script))
      const lost: Array<LostReason> = []
      const first = yield* backend.acquire(request("before-move", lost))
      expect(first._tag).toBe("Granted")
      script.movedTo = PID + 1
      const error = yield* Effect.flip(backend.acquire(request("after-move", [])))
      expect(error).toMatchObject({ _tag: "LockBackendError", operation: "acquire", name: "after-move" })
      expect(String(error.message)).toMatch(/session affinity/)
      yield* settle
      // The moved session was destroyed: the lock granted on it before is gone, and its holder told.
      expect(lost).toEqual(["connection-lost"])
    }))
})

/**
 * The pooler check does not depend on which server connection a pooler hands out: PgBouncer in
 * transaction mode with `server_round_robin = 1` (each transaction may go to another server
 * connection) is refused like plain transaction mode, and session mode works.
 */
import { expect, it } from "@effect/vitest"
import { Cause, Context, Effect, Exit, Fiber, Layer, Option, Scope } from "effect"
import * as DistributedLock from "../src/DistributedLock.js"
import { spawn } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import pg from "pg"
import { UnsafeConnectionPooling } from "../src/LockError.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import { freeLoopbackPort } from "../tools/embeddedPostgres.js"
import { useTestDatabase } from "./support/pg.js"
import { DEFAULT_IGNORE_STARTUP_PARAMETERS, describeWithPgBouncer, pgbouncerPath } from "./support/pgbouncer.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("pg_advisory_pooler")

const READY_TIMEOUT_MS = 10_000

/**
 * A PgBouncer with settings test/support/pgbouncer.ts does not offer (`server_round_robin`), for
 * as long as the scope lasts.
 */
const bouncer = (poolMode: "session" | "transaction", extra: ReadonlyArray<string>) =>
  Effect.acquireRelease(
    Effect.promise(async () => {
      const target = new URL(db.url)
      const database = decodeURIComponent(target.pathname.replace(/^\//, ""))
      const port = await freeLoopbackPort()
      const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-pgbouncer-rr-"))
      Fs.chmodSync(dir, 0o755)
      const userlist = Path.join(dir, "userlist.txt")
      const ini = Path.join(dir, "pgbouncer.ini")
      Fs.writeFileSync(userlist, `"${decodeURIComponent(target.username)}" "${decodeURIComponent(target.password)}"\n`, { mode: 0o644 })
      Fs.writeFileSync(
        ini,
        [
          "[databases]",
          `${database} = host=${target.hostname} port=${target.port} dbname=${database}`,
          "[pgbouncer]",
          "listen_addr = 127.0.0.1",
          `listen_port = ${port}`,
          "unix_socket_dir =",
          "auth_type = trust",
          `auth_file = ${userlist}`,
          `pool_mode = ${poolMode}`,
          "default_pool_size = 10",
          `ignore_startup_parameters = ${DEFAULT_IGNORE_STARTUP_PARAMETERS.join(",")}`,
          ...extra,
          ""
        ].join("\n"),
        { mode: 0o644 }
      )
      const asRoot = typeof process.getuid === "function" && process.getuid() === 0
      const child = spawn(pgbouncerPath()!, [...(asRoot ? ["-u", "nobody"] : []), ini], { stdio: "ignore" })
      const url = new URL(db.url)
      url.hostname = "127.0.0.1"
      url.port = String(port)
      const deadline = Date.now() + READY_TIMEOUT_MS
      for (;;) {
        const client = new pg.Client({ connectionString: url.toString(), connectionTimeoutMillis: 1_000 })
        client.on("error", () => {})
        const ready = await client.connect().then(() => client.query("select 1")).then(() => true, () => false)
        await client.end().catch(() => {})
        if (ready) break
        if (Date.now() > deadline) throw new Error("pgbouncer did not start")
        await new Promise((resolve) => setTimeout(resolve, 50))
      }
      return { url: url.toString(), child, dir }
    }),
    ({ child, dir }) =>
      Effect.promise(async () => {
        const exited = new Promise((resolve) => child.once("exit", resolve))
        child.kill("SIGTERM")
        await exited
        Fs.rmSync(dir, { recursive: true, force: true })
      })
  )

describeWithPgBouncer("PgAdvisory behind a round-robin pooler", () => {
  it.scopedLive("transaction pooling with server_round_robin = 1: building the layer fails with UnsafeConnectionPooling", () =>
    Effect.gen(function*() {
      const pooler = yield* bouncer("transaction", ["server_round_robin = 1"])
      // Every build sees a different set of idle server connections; the first probe's design
      // (one other client's transaction, one statement) passed on the second build here.
      for (let attempt = 0; attempt < 5; attempt++) {
        const exit = yield* Effect.exit(
          Layer.build(PgAdvisory.layer({ url: pooler.url, applicationName: "adv-rr-tx" })).pipe(Effect.scoped)
        )
        const error = Exit.isFailure(exit) ? Option.getOrUndefined(Cause.failureOption(exit.cause)) : undefined
        expect(error).toBeInstanceOf(UnsafeConnectionPooling)
      }
    }))

  it.scopedLive("session pooling with server_round_robin = 1: every session passes its probe and locks work", () =>
    Effect.gen(function*() {
      const pooler = yield* bouncer("session", ["server_round_robin = 1"])
      const lock = yield* Layer.build(PgAdvisory.layer({ url: pooler.url, applicationName: "adv-rr-s", maxSessions: 3 })).pipe(
        Effect.map(Context.get(DistributedLock.DistributedLock))
      )
      const direct = yield* Layer.build(PgAdvisory.layer({ url: db.url, applicationName: "adv-rr-direct" })).pipe(
        Effect.map(Context.get(DistributedLock.DistributedLock))
      )
      const held = yield* Scope.make()
      yield* direct.acquire("rr-contended").pipe(Scope.extend(held))
      // A contended wait opens (and probes) a wait session through the pooler.
      const waiting = yield* Effect.fork(Effect.scoped(Effect.map(lock.acquire("rr-contended"), (lease) => lease.token)))
      yield* Effect.scoped(lock.acquire("rr-free", { timeout: "5 seconds" }))
      yield* Scope.close(held, Exit.void)
      expect(yield* Fiber.join(waiting)).toBeGreaterThan(0n)
    }))
})

/**
 * PgAdvisory's connection options beyond a URL: fields, a password as `Redacted` or a function,
 * TLS with a custom CA, the app's `PgClient` config, and `createTables: false` with `migration()`.
 */
import { describe, expect, it } from "@effect/vitest"
import { Cause, Context, Effect, Exit, Layer, Option, Redacted } from "effect"
import { execFileSync } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import * as DistributedLock from "../src/DistributedLock.js"
import * as PgAdvisory from "../src/PgAdvisory.js"
import { startEmbedded } from "../tools/embeddedPostgres.js"
import { createTestDatabase, PgTest, useTestDatabase, withClient } from "./support/pg.js"

// First, so that its afterAll (leak check, drop) runs after every layer of this file is closed.
const db = useTestDatabase("pg_advisory_connection")

const lockOf = <E, R>(layer: Layer.Layer<DistributedLock.DistributedLock, E, R>) =>
  Effect.map(Layer.build(layer), Context.get(DistributedLock.DistributedLock))

/** Takes and gives back a lock: the layer works end to end. */
const works = (lock: DistributedLock.Service, name: string) =>
  Effect.scoped(Effect.map(lock.acquire(name, { timeout: "5 seconds" }), (lease) => lease.token))

const failureOf = <A, E>(exit: Exit.Exit<A, E>) => (Exit.isFailure(exit) ? Option.getOrUndefined(Cause.failureOption(exit.cause)) : undefined)

describe("PgAdvisory connection options", () => {
  it.scopedLive("host, port, database, user and a Redacted password instead of a URL", () =>
    Effect.gen(function*() {
      const url = new URL(db.url)
      const lock = yield* lockOf(PgAdvisory.layer({
        host: url.hostname,
        port: Number(url.port),
        database: decodeURIComponent(url.pathname.slice(1)),
        user: decodeURIComponent(url.username),
        password: Redacted.make(decodeURIComponent(url.password)),
        applicationName: "adv-fields"
      }))
      expect(yield* works(lock, "fields")).toBeGreaterThan(0n)
    }))

  it.scopedLive("a password function is asked at each connect", () =>
    Effect.gen(function*() {
      const url = new URL(db.url)
      const secret = decodeURIComponent(url.password)
      url.password = ""
      let asked = 0
      const lock = yield* lockOf(PgAdvisory.layer({
        url: url.toString(),
        password: async () => {
          asked++
          return secret
        },
        applicationName: "adv-password-fn",
        maxSessions: 2
      }))
      expect(yield* works(lock, "password-fn")).toBeGreaterThan(0n)
      expect(asked).toBeGreaterThanOrEqual(1)
    }))

  it.scopedLive("neither url nor host is a configuration error, not a defect", () =>
    Effect.gen(function*() {
      const exit = yield* Effect.exit(Layer.build(PgAdvisory.layer({ database: "x" })))
      expect(failureOf(exit)).toMatchObject({ _tag: "LockBackendError", operation: "configure" })
    }))

  it.scopedLive("layerFromPgClient connects where the app's PgClient does, on sessions of its own", () =>
    Effect.gen(function*() {
      const lock = yield* lockOf(
        PgAdvisory.layerFromPgClient({ applicationName: "adv-from-pgclient" }).pipe(
          Layer.provide(PgTest.layer(db, { applicationName: "adv-app-pool" }))
        )
      )
      expect(yield* works(lock, "from-pgclient")).toBeGreaterThan(0n)
      const names = yield* Effect.promise(() =>
        withClient(db.url, async (client) =>
          (await client.query<{ name: string }>(
            "select distinct application_name as name from pg_stat_activity where datname = current_database()"
          )).rows.map((row) => row.name)
        )
      )
      expect(names).toContain("adv-from-pgclient")
    }))

  it.scopedLive("createTables: false refuses a missing fencing table, naming migration(); after it, the layer works", () =>
    Effect.gen(function*() {
      const fresh = yield* Effect.acquireRelease(
        Effect.promise(() => createTestDatabase("pg_advisory_no_ddl")),
        (database) => Effect.promise(() => database.drop())
      )
      const build = Layer.build(PgAdvisory.layer({ url: fresh.url, applicationName: "adv-no-ddl", createTables: false }))
      const refused = failureOf(yield* Effect.exit(Effect.scoped(build)))
      expect(refused).toMatchObject({ _tag: "LockBackendError", operation: "create fencing table" })
      expect(String(refused?.message)).toMatch(/migration\(\)/)
      yield* Effect.promise(() => withClient(fresh.url, (client) => client.query(PgAdvisory.migration())))
      const lock = Context.get(yield* build, DistributedLock.DistributedLock)
      expect(yield* works(lock, "after-migration")).toBeGreaterThan(0n)
      expect(() => PgAdvisory.migration({ fencingTable: "bad name" })).toThrow(RangeError)
    }))
})

describe("PgAdvisory over TLS", () => {
  it.scopedLive("ssl with a custom CA connects over TLS; a different CA is refused", () =>
    Effect.gen(function*() {
      const dir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-tls-"))
      yield* Effect.addFinalizer(() => Effect.sync(() => Fs.rmSync(dir, { recursive: true, force: true })))
      const openssl = (...args: Array<string>) => execFileSync("openssl", args, { cwd: dir, stdio: "pipe" })
      // A CA, and a server certificate for 127.0.0.1 signed by it; a second CA that signed nothing.
      for (const ca of ["ca", "other-ca"]) {
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", `/CN=${ca}`, "-keyout", `${ca}.key`, "-out", `${ca}.crt`)
      }
      openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
      Fs.writeFileSync(Path.join(dir, "san.ext"), "subjectAltName=IP:127.0.0.1\n")
      openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", "server.crt")
      // The server runs as the `postgres` OS user, which must own its key (mode 0600).
      const uid = Number(execFileSync("id", ["-u", "postgres"]).toString().trim())
      const gid = Number(execFileSync("id", ["-g", "postgres"]).toString().trim())
      Fs.chmodSync(dir, 0o755)
      for (const file of ["server.crt", "server.key"]) Fs.chownSync(Path.join(dir, file), uid, gid)
      Fs.chmodSync(Path.join(dir, "server.key"), 0o600)

      const server = yield* Effect.acquireRelease(Effect.promise(() => startEmbedded()), (s) => Effect.promise(() => s.stop()))
      yield* Effect.promise(() =>
        withClient(server.url, async (client) => {
          await client.query(`alter system set ssl_cert_file = '${Path.join(dir, "server.crt")}'`)
          await client.query(`alter system set ssl_key_file = '${Path.join(dir, "server.key")}'`)
          await client.query("alter system set ssl = on")
          await client.query("select pg_reload_conf()")
        })
      )
      const url = new URL(server.url)
      const settings = {
        host: "127.0.0.1",
        port: Number(url.port),
        database: "postgres",
        user: decodeURIComponent(url.username),
        password: Redacted.make(decodeURIComponent(url.password)),
        applicationName: "adv-tls",
        connectTimeout: "5 seconds"
      } as const
      const ca = Fs.readFileSync(Path.join(dir, "ca.crt"), "utf8")
      const lock = yield* lockOf(PgAdvisory.layer({ ...settings, ssl: { ca } }))
      expect(yield* works(lock, "tls")).toBeGreaterThan(0n)
      const encrypted = yield* Effect.promise(() =>
        withClient(server.url, async (client) =>
          (await client.query<{ ssl: boolean }>(
            "select s.ssl from pg_stat_ssl s join pg_stat_activity a using (pid) where a.application_name = 'adv-tls'"
          )).rows.map((row) => row.ssl)
        )
      )
      expect(encrypted.length).toBeGreaterThan(0)
      expect(encrypted.every((ssl) => ssl)).toBe(true)

      const otherCa = Fs.readFileSync(Path.join(dir, "other-ca.crt"), "utf8")
      const refused = failureOf(yield* Effect.exit(Effect.scoped(Layer.build(PgAdvisory.layer({ ...settings, ssl: { ca: otherCa } })))))
      expect(refused).toMatchObject({ _tag: "LockBackendError", operation: "connect" })
    }), 60_000)
})

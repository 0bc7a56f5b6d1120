/**
 * The published package, as users install it: `npm pack` (its `prepack` builds dist/), the
 * tarball installed from the registry's peers into empty ESM apps in a temp directory, a
 * TypeScript consumer type-checked against the installed types (NodeNext), programs run against
 * the test PostgreSQL, and the installed `npx effect-lock inspect --json`.
 *
 * Three apps, one per kind of user: everything (PgAdvisory, PgLease, the CLI), lease rows only
 * (`effect @effect/sql @effect/sql-pg`) and memory only (`effect`). For the last two the
 * tarball must add itself and nothing else to what the app already installed.
 *
 * Registry downloads are cached by npm (`--prefer-offline`), so after the first run the whole
 * file takes the build plus a few seconds per install.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { execFile, spawn } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import * as Readline from "node:readline"
import { fileURLToPath } from "node:url"
import { promisify } from "node:util"
import { useTestDatabase } from "./support/pg.js"

const db = useTestDatabase("package")

const root = fileURLToPath(new URL("..", import.meta.url))
const rootPackage = JSON.parse(Fs.readFileSync(Path.join(root, "package.json"), "utf8")) as {
  readonly devDependencies: Readonly<Record<string, string>>
}
/** The peers at the versions this repository is tested with. */
const pinned = (name: string): string => `${name}@${rootPackage.devDependencies[name]}`
const tsc = Path.join(root, "node_modules", "typescript", "bin", "tsc")

/** Build, pack, install and type-check are each bounded; the machine may be loaded. */
const STEP_TIMEOUT_MS = 120_000

/** The environment of a child: no npm settings inherited from `npm test`, no DATABASE_URL unless given. */
const childEnv = (extra: Readonly<Record<string, string>> = {}): NodeJS.ProcessEnv => {
  const env: NodeJS.ProcessEnv = {}
  for (const [key, value] of Object.entries(process.env)) {
    if (!key.toLowerCase().startsWith("npm_") && key !== "DATABASE_URL" && key !== "INIT_CWD") env[key] = value
  }
  return { ...env, ...extra }
}

interface Ran {
  readonly stdout: string
  readonly stderr: string
}

/** Runs a command to completion; a non-zero exit fails with its output. */
const run = async (
  command: string,
  args: ReadonlyArray<string>,
  cwd: string,
  extraEnv?: Readonly<Record<string, string>>
): Promise<Ran> => {
  try {
    const { stdout, stderr } = await promisify(execFile)(command, [...args], {
      cwd,
      env: childEnv(extraEnv),
      timeout: STEP_TIMEOUT_MS,
      maxBuffer: 16 * 1024 * 1024
    })
    return { stdout, stderr }
  } catch (error) {
    const e = error as { stdout?: string; stderr?: string; message: string }
    throw new Error(`${command} ${args.join(" ")} failed in ${cwd}: ${e.message}\n${e.stdout ?? ""}\n${e.stderr ?? ""}`)
  }
}

const npm = (args: ReadonlyArray<string>, cwd: string) => run("npm", args, cwd)
const npmInstall = (packages: ReadonlyArray<string>, cwd: string) =>
  // No install scripts: nothing this package or its peers need is built at install time.
  npm(["install", "--prefer-offline", "--no-audit", "--no-fund", "--ignore-scripts", "--save-exact", ...packages], cwd)

/** Every package directory under the app's node_modules (scoped ones as @scope/name). */
const installedPackages = (app: string): ReadonlyArray<string> => {
  const modules = Path.join(app, "node_modules")
  const found: Array<string> = []
  for (const entry of Fs.readdirSync(modules)) {
    if (entry.startsWith(".")) continue
    if (entry.startsWith("@")) {
      for (const inner of Fs.readdirSync(Path.join(modules, entry))) found.push(`${entry}/${inner}`)
    } else found.push(entry)
  }
  return found.sort()
}

let work: string
/** The tarball; packed while the apps install their own dependencies. */
let tarball: Promise<string>

/** An empty ESM app with these files. */
const makeApp = (name: string, files: Readonly<Record<string, string>>): string => {
  const app = Path.join(work, name)
  Fs.mkdirSync(app, { recursive: true })
  Fs.writeFileSync(Path.join(app, "package.json"), JSON.stringify({ name, private: true, type: "module" }, null, 2))
  for (const [file, text] of Object.entries(files)) Fs.writeFileSync(Path.join(app, file), text)
  return app
}

/** Installs the app's own dependencies first, then the tarball; returns what the tarball added. */
const installAlongside = async (app: string, peers: ReadonlyArray<string>): Promise<ReadonlyArray<string>> => {
  await npmInstall(peers, app)
  const before = new Set(installedPackages(app))
  await npmInstall([await tarball], app)
  return installedPackages(app).filter((name) => !before.has(name))
}

beforeAll(() => {
  work = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-package-"))
  // A clean build: output of files since deleted must not be packed.
  Fs.rmSync(Path.join(root, "dist"), { recursive: true, force: true })
  tarball = npm(["pack", "--pack-destination", work, "--json"], root).then((packed) => {
    const [{ filename }] = JSON.parse(packed.stdout) as Array<{ readonly filename: string }>
    return Path.join(work, filename)
  })
  // Awaited by the tests; this only keeps a failed pack from being reported as unhandled.
  tarball.catch(() => {})
})

afterAll(async () => {
  await tarball.catch(() => {})
  if (work !== undefined) Fs.rmSync(work, { recursive: true, force: true })
})

const TSCONFIG = JSON.stringify(
  {
    compilerOptions: {
      target: "ES2022",
      module: "NodeNext",
      moduleResolution: "NodeNext",
      strict: true,
      exactOptionalPropertyTypes: true,
      // As Effect's app templates do; the @ts-expect-error lines below prove the types are not `any`.
      skipLibCheck: true,
      types: ["node"],
      outDir: "out"
    },
    include: ["main.ts"]
  },
  null,
  2
)

/**
 * The consumer of the full install: a memory lock, an advisory lock and a lease held at once,
 * until the test closes its stdin, so that `effect-lock inspect` can see them.
 */
const FULL_MAIN = `import { PgClient } from "@effect/sql-pg"
import { Config, Effect, Layer } from "effect"
import { DistributedLock, type FencingToken, LockError, MemoryBackend, PgLease } from "effect-lock"
import * as PgAdvisory from "effect-lock/PgAdvisory"

// The installed types are real types, not \`any\`: wrong arguments do not compile.
// @ts-expect-error a lock name is a string
DistributedLock.acquire(42)
// @ts-expect-error a url is a string or a Redacted
PgAdvisory.layer({ url: 42 })
// @ts-expect-error a lease is not a number
const notANumber: number = Effect.runSync(Effect.scoped(DistributedLock.acquire("x").pipe(Effect.provide(MemoryBackend.layer()))))

const tokenOf = (name: string): Effect.Effect<
  FencingToken.FencingToken,
  LockError.LockTimeout | LockError.LockBackendError | LockError.InvalidLockName,
  DistributedLock.DistributedLock
> => Effect.scoped(Effect.map(DistributedLock.acquire(name, { timeout: "5 seconds" }), (lease) => lease.token))

const stdinClosed = Effect.async<void>((resume) => {
  process.stdin.on("data", () => {})
  process.stdin.once("end", () => resume(Effect.void))
})

const program = Effect.gen(function*() {
  const url = yield* Config.redacted("DATABASE_URL")
  const memory = yield* tokenOf("package/memory").pipe(Effect.provide(MemoryBackend.layer()))
  const advisory = PgAdvisory.layer({ url, applicationName: "package-test-advisory" })
  const lease = PgLease.layer().pipe(Layer.provide(PgClient.layer({ url, applicationName: "package-test-lease" })))
  // Each layer is provided around the scope its lock lives in, so it outlives the lock.
  const holdLease = (advisoryToken: FencingToken.FencingToken) =>
    Effect.gen(function*() {
      const l = yield* DistributedLock.acquire("package/lease")
      console.log(JSON.stringify({ event: "holding", memory: String(memory), advisory: String(advisoryToken), lease: String(l.token) }))
      yield* stdinClosed
      return { advisory: String(advisoryToken), lease: String(l.token) }
    }).pipe(Effect.scoped, Effect.provide(lease))
  const tokens = yield* Effect.flatMap(DistributedLock.acquire("package/advisory"), (a) => holdLease(a.token)).pipe(
    Effect.scoped,
    Effect.provide(advisory)
  )
  const invalid = yield* Effect.flip(tokenOf("").pipe(Effect.provide(MemoryBackend.layer())))
  console.log(JSON.stringify({ event: "released", ...tokens, invalidName: invalid instanceof LockError.InvalidLockName }))
})

Effect.runPromise(program).then(
  () => process.exit(0),
  (error: unknown) => {
    console.error(error)
    process.exit(1)
  }
)
void notANumber
`

/** The lease-only consumer: a lease from the root entry, no PgAdvisory, no pg of its own. */
const LEASE_MAIN = `import { PgClient } from "@effect/sql-pg"
import { Config, Effect, Layer } from "effect"
import { DistributedLock, PgLease } from "effect-lock"

const program = Effect.gen(function*() {
  const url = yield* Config.redacted("DATABASE_URL")
  const layer = PgLease.layer({ table: "package_lease_only" }).pipe(Layer.provide(PgClient.layer({ url })))
  const token = yield* Effect.scoped(Effect.map(DistributedLock.acquire("package/lease-only"), (lease) => lease.token))
    .pipe(Effect.provide(layer))
  console.log(\`lease token \${token}\`)
})
Effect.runPromise(program).then(() => process.exit(0), (error) => { console.error(error); process.exit(1) })
`

/** The memory-only consumer, exactly the import the README shows. */
const MEMORY_MAIN = `import { Effect } from "effect"
import { DistributedLock, MemoryBackend } from "effect-lock"

const program = Effect.gen(function*() {
  const first = yield* Effect.scoped(Effect.map(DistributedLock.acquire("job"), (lease) => lease.token))
  const second = yield* Effect.scoped(Effect.map(DistributedLock.acquire("job"), (lease) => lease.token))
  console.log(\`memory tokens \${first} \${second}\`)
})
Effect.runPromise(program.pipe(Effect.provide(MemoryBackend.layer()))).then(() => process.exit(0), (error) => { console.error(error); process.exit(1) })
`

/** Starts the full consumer and resolves once it holds its locks; `release` closes its stdin. */
const startHolder = (app: string, url: string) =>
  new Promise<{ readonly holding: Record<string, string>; readonly release: () => Promise<{ code: number | null; lines: Array<string> }> }>(
    (resolve, reject) => {
      const child = spawn(process.execPath, ["out/main.js"], { cwd: app, env: childEnv({ DATABASE_URL: url }) })
      const lines: Array<string> = []
      let stderr = ""
      child.stderr.on("data", (chunk: Buffer) => (stderr += chunk.toString()))
      const exited = new Promise<number | null>((done) => child.once("exit", (code) => done(code)))
      const bound = setTimeout(() => {
        child.kill("SIGKILL")
        reject(new Error(`the consumer did not report its locks within ${STEP_TIMEOUT_MS} ms: ${lines.join("\n")}\n${stderr}`))
      }, STEP_TIMEOUT_MS)
      void exited.then((code) => reject(new Error(`the consumer exited (${code}) before holding its locks:\n${lines.join("\n")}\n${stderr}`)))
      Readline.createInterface({ input: child.stdout }).on("line", (line) => {
        lines.push(line)
        if (!line.includes(`"holding"`)) return
        clearTimeout(bound)
        resolve({
          holding: JSON.parse(line) as Record<string, string>,
          release: async () => {
            child.stdin.end()
            const code = await Promise.race([
              exited,
              new Promise<null>((done) => setTimeout(() => done(null), STEP_TIMEOUT_MS).unref())
            ])
            if (code === null) child.kill("SIGKILL")
            return { code, lines: [...lines, ...stderr.split("\n").filter((l) => l !== "")] }
          }
        })
      })
    }
  )

describe.concurrent("the packed package, installed into an empty ESM app", () => {
  it("with every peer: type-checks (NodeNext), runs effect-lock and effect-lock/PgAdvisory, and npx effect-lock inspect --json sees the locks", async () => {
    const app = makeApp("full", { "main.ts": FULL_MAIN, "tsconfig.json": TSCONFIG })
    const added = await installAlongside(app, [
      pinned("effect"),
      pinned("@effect/sql"),
      pinned("@effect/sql-pg"),
      pinned("@effect/platform"),
      pinned("@effect/experimental"),
      pinned("pg"),
      pinned("@types/node")
    ])
    expect(added).toEqual(["effect-lock"])
    // Only what the exports map publishes: internals stay private.
    const installed = JSON.parse(Fs.readFileSync(Path.join(app, "node_modules/effect-lock/package.json"), "utf8"))
    expect(installed.exports["./internal/*"]).toBeNull()

    await run(process.execPath, [tsc, "-p", "tsconfig.json"], app)

    const holder = await startHolder(app, db.url)
    expect(holder.holding).toEqual({ event: "holding", memory: "1", advisory: expect.stringMatching(/^\d+$/), lease: "1" })
    const inspected = await run("npx", ["--no", "effect-lock", "inspect", "--json", "--url", db.url], app)
    const report = JSON.parse(inspected.stdout) as {
      advisory: Array<{ name: string | null; granted: boolean; applicationName: string | null }>
      leases: { held: Array<{ name: string; token: string }> }
    }
    expect(report.advisory).toContainEqual(
      expect.objectContaining({ name: "package/advisory", granted: true, applicationName: "package-test-advisory" })
    )
    expect(report.leases.held).toContainEqual(expect.objectContaining({ name: "package/lease", token: "1" }))

    const { code, lines } = await holder.release()
    expect(code, lines.join("\n")).toBe(0)
    expect(lines).toContain(
      JSON.stringify({ event: "released", advisory: holder.holding["advisory"], lease: "1", invalidName: true })
    )
  }, 4 * STEP_TIMEOUT_MS)

  it("lease rows only (effect, @effect/sql, @effect/sql-pg): the tarball adds only itself, and a lease runs", async () => {
    const app = makeApp("lease-only", { "main.js": LEASE_MAIN })
    const added = await installAlongside(app, [pinned("effect"), pinned("@effect/sql"), pinned("@effect/sql-pg")])
    expect(added).toEqual(["effect-lock"])
    const { stdout } = await run(process.execPath, ["main.js"], app, { DATABASE_URL: db.url })
    expect(stdout).toContain("lease token 1")
  }, 4 * STEP_TIMEOUT_MS)

  it("memory only (effect): no pg or @effect/sql installed, and the root entry's DistributedLock and MemoryBackend work", async () => {
    const app = makeApp("memory-only", { "main.js": MEMORY_MAIN })
    const added = await installAlongside(app, [pinned("effect")])
    expect(added).toEqual(["effect-lock"])
    expect(installedPackages(app)).not.toContain("pg")
    expect(installedPackages(app)).not.toContain("@effect/sql")
    const { stdout } = await run(process.execPath, ["main.js"], app)
    expect(stdout).toContain("memory tokens 1 2")
  }, 4 * STEP_TIMEOUT_MS)
})

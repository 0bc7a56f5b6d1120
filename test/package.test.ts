/**
 * The published package, as users install it: `npm pack` (its `prepack` builds dist/), then the
 * README's own install lines, read from README.md and run as they stand through a shell (only
 * `effect-lock`, not on the registry, replaced by the tarball's path), each in an empty ESM app,
 * against the registry. Each app then runs what its line installs: a MemoryBackend program always,
 * a PgLease or PgAdvisory program against the test PostgreSQL, a SqliteLease program on a file. The
 * app of the PostgreSQL line then runs the pg line too, as the README tells a user of PgLease and
 * PgAdvisory.layer both: a TypeScript consumer is type-checked against the installed types
 * (NodeNext) and holds locks of both while the installed `npx effect-lock inspect --json` sees them.
 * The Redis line runs in the MemoryBackend line's app after that line was checked: two RedisLease
 * grants against the test's redis-server, and `npx effect-lock inspect` without @effect/platform.
 *
 * The peer ranges refuse an install that mixes in Effect 4: npm fails it at install time with its
 * ERESOLVE peer message, and nothing is installed that could load half-working.
 *
 * Registry downloads are cached by npm (`prefer-offline`, set through the environment so the lines
 * run unchanged), so after the first run the whole file takes the build plus a few seconds per
 * install.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { spawn } from "node:child_process"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import * as Readline from "node:readline"
import { fileURLToPath } from "node:url"
import { useTestDatabase } from "./support/pg.js"
import { noRedis, useRedis } from "./support/redis.js"

const db = useTestDatabase("package")
/** The Redis line's program runs against it; without redis-server (or REDIS_URL) that program skips, saying why. */
const redis = useRedis()

const root = fileURLToPath(new URL("..", import.meta.url))
const rootPackage = JSON.parse(Fs.readFileSync(Path.join(root, "package.json"), "utf8")) as {
  readonly version: string
  readonly peerDependencies: Readonly<Record<string, string>>
}
const readme = Fs.readFileSync(Path.join(root, "README.md"), "utf8")
const tsc = Path.join(root, "node_modules", "typescript", "bin", "tsc")

/** Pack, type-check and each program run are bounded; the machine may be loaded. */
const STEP_TIMEOUT_MS = 120_000
/**
 * An install is bounded more loosely: should the SQLite line resolve a better-sqlite3 other than the
 * repository's, its install script compiles it (see `offerLocalPrebuild`).
 */
const INSTALL_TIMEOUT_MS = 300_000

/** One install line of the README. */
interface InstallLine {
  /** The line as it stands in the README. */
  readonly line: string
  /** What the shell runs: the line without its comment. */
  readonly command: string
  /** The names of the packages it installs, versions dropped (`@effect/sql@0.52` is `@effect/sql`). */
  readonly names: ReadonlyArray<string>
  /** The packages as the line names them. */
  readonly specs: ReadonlyArray<string>
}

const nameOf = (spec: string): string => {
  const at = spec.indexOf("@", 1)
  return at === -1 ? spec : spec.slice(0, at)
}

/** Every line of a ```sh block that starts with `npm install ` and names effect-lock. */
const installLinesOf = (text: string): ReadonlyArray<InstallLine> =>
  Array.from(text.matchAll(/^```sh\n([\s\S]*?)^```/gm), (block) => block[1]!.split("\n"))
    .flat()
    .filter((line) => line.startsWith("npm install "))
    .map((line) => {
      const command = line.replace(/\s+#.*$/, "").trim()
      const specs = command.split(/\s+/).slice(2).filter((arg) => !arg.startsWith("-"))
      return { line, command, specs, names: specs.map(nameOf) }
    })
    .filter((line) => line.names.includes("effect-lock"))

const installLines = installLinesOf(readme)
const names = (line: InstallLine, name: string): boolean => line.names.includes(name)

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

/**
 * Settings for every npm process here (pack, the install lines, `npm ls`, `npx`), through the
 * environment; neither changes what npm resolves, installs, runs or reports on stdout and stderr.
 */
const npmEnv: Readonly<Record<string, string>> = {
  // No debug log file under ~/.npm/_logs: npm writes every silly line of an install to it (its
  // error output, which a failed step reports, still comes on stderr); a cost, not a check.
  npm_config_logs_max: "0",
  // One libuv worker thread per process: an install's unpacking then does not hand its file and zlib
  // work among four threads on two cores (fewer futex wake-ups: 7-18 % less CPU per install, measured).
  UV_THREADPOOL_SIZE: "1"
}

/**
 * At most this many of the file's child processes run at once (the consumer started by
 * `startHolder` is not counted: `npx effect-lock inspect` runs while it holds its locks). On the
 * 2-core machine, six npm processes at once only take turns, each costing more CPU (measured);
 * every step still runs, in its test's order.
 */
const CHILDREN_AT_ONCE = 2
let childrenRunning = 0
const waitingForChild: Array<() => void> = []
/**
 * The app of the PostgreSQL test: its steps are the file's longest chain (two installs, type-check,
 * holder, inspect, one after another), so a free slot goes to its waiting step before the others'
 * (shorter chains, which then fill the slots it leaves free). Only the order of waiting steps
 * changes; every step runs, bounded as before. Measured with the file alone: that test's `npm ls`
 * waited 13.5 s behind other lines' installs, and the file took 76-80 s; with this, 60-61 s.
 */
const URGENT_APP = "postgres"
const inChildSlot = async <A>(task: () => Promise<A>, urgent = false): Promise<A> => {
  if (childrenRunning < CHILDREN_AT_ONCE) childrenRunning++
  else await new Promise<void>((resolve) => (urgent ? waitingForChild.unshift(resolve) : waitingForChild.push(resolve)))
  try {
    return await task()
  } finally {
    // The slot goes to the next waiting step, if any.
    const next = waitingForChild.shift()
    if (next !== undefined) next()
    else childrenRunning--
  }
}

const lowerPriority = (pid: number): void => {
  try {
    Os.setPriority(pid, 19)
  } catch {
    // Gone already (it failed to start: its error event says why), or not allowed: it runs at nice 0.
  }
}

/**
 * `command` to its end, in a process group of its own: past `timeout` the whole group is killed,
 * not only the process started (`sh -c "npm install …"` leaves npm running when only sh is).
 * Fails with its output on a non-zero exit, a signal or the timeout.
 */
const runToEnd = (
  command: string,
  args: ReadonlyArray<string>,
  cwd: string,
  env: NodeJS.ProcessEnv,
  timeout: number
): Promise<Ran> =>
  new Promise((resolve, reject) => {
    const child = spawn(command, [...args], { cwd, env, detached: true, stdio: ["ignore", "pipe", "pipe"] })
    // Nice 19, before it can fork (its node is still starting): npm, tsc and what they start take
    // only the CPU the other files' timing cases leave idle. At nice 0 on 2 cores, a SqliteLease
    // renewal case beside these installs waited 1.4 s for a CPU and was told of its loss too late.
    if (child.pid !== undefined) lowerPriority(child.pid)
    let stdout = ""
    let stderr = ""
    child.stdout.setEncoding("utf8").on("data", (chunk: string) => (stdout += chunk))
    child.stderr.setEncoding("utf8").on("data", (chunk: string) => (stderr += chunk))
    let timedOut = false
    const timer = setTimeout(() => {
      timedOut = true
      // The negative pid: every process of the group (detached made the child its leader).
      try {
        process.kill(-child.pid!, "SIGKILL")
      } catch {
        // Already gone.
      }
    }, timeout)
    child.once("error", (error) => {
      clearTimeout(timer)
      reject(Object.assign(error, { stdout, stderr }))
    })
    child.once("close", (code, signal) => {
      clearTimeout(timer)
      if (code === 0 && !timedOut) return resolve({ stdout, stderr })
      const why = timedOut ? `timed out after ${timeout} ms (its process group killed)` : `exited with ${code ?? signal}`
      reject(Object.assign(new Error(`Command failed: ${why}`), { stdout, stderr }))
    })
  })

/** Runs a command to completion; a non-zero exit fails with its output. */
const run = async (
  command: string,
  args: ReadonlyArray<string>,
  cwd: string,
  extraEnv?: Readonly<Record<string, string>>,
  timeout = STEP_TIMEOUT_MS
): Promise<Ran> => {
  try {
    return await inChildSlot(() => runToEnd(command, args, cwd, childEnv(extraEnv), timeout), Path.basename(cwd) === URGENT_APP)
  } catch (error) {
    const e = error as { stdout?: string; stderr?: string; message: string }
    throw new Error(`${command} ${args.join(" ")} failed in ${cwd}: ${e.message}\n${e.stdout ?? ""}\n${e.stderr ?? ""}`)
  }
}

/** Every package directory under the app's node_modules (scoped ones as @scope/name). */
const installedPackages = (app: string): ReadonlyArray<string> => {
  const modules = Path.join(app, "node_modules")
  if (!Fs.existsSync(modules)) return []
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
/** The tarball, packed in the background; every install waits for it. */
let tarball: Promise<string>
/**
 * npm settings for the installs, through the environment so that the lines run as they stand:
 * none changes what a line asks for or whether install scripts run (`prefer_offline` lets npm take
 * registry metadata from its cache when it has it, as the previous test's installs did).
 */
let installEnv: Record<string, string>

const shellQuote = (text: string): string => `'${text.replace(/'/g, `'\\''`)}'`

/**
 * Runs a README line in the app through a shell, as a user pasting it would, with the word
 * `effect-lock` replaced by the tarball's path and nothing else changed.
 */
const runLine = async (line: InstallLine, app: string): Promise<Ran> => {
  const path = await tarball
  const command = line.command.replace(/(^|\s)effect-lock(?=\s|$)/, (_, space: string) => `${space}${shellQuote(path)}`)
  return run("sh", ["-c", command], app, installEnv, INSTALL_TIMEOUT_MS)
}

/**
 * better-sqlite3's install script (`prebuild-install || node-gyp rebuild`) first looks for
 * `better-sqlite3-v<version>-node-v<abi>-<platform>-<arch>.tar.gz` in its local prebuilds directory
 * (`npm_config_better_sqlite3_local_prebuilds`), then downloads one from GitHub, then compiles. The
 * repository's own build of the same version for this Node is offered there, so the SQLite line
 * runs with its install script, as a user's would, without depending on GitHub or spending a minute
 * of CPU compiling. A line resolving another version (or a musl or non-Linux build name) finds no
 * file there and goes on as a user's install does.
 */
const offerLocalPrebuild = async (): Promise<Record<string, string>> => {
  const packageDir = Path.join(root, "node_modules", "better-sqlite3")
  const binary = "build/Release/better_sqlite3.node"
  if (!Fs.existsSync(Path.join(packageDir, binary))) return {}
  const { version } = JSON.parse(Fs.readFileSync(Path.join(packageDir, "package.json"), "utf8")) as { version: string }
  const dir = Path.join(work, "prebuilds")
  Fs.mkdirSync(dir)
  const file = `better-sqlite3-v${version}-node-v${process.versions.modules}-${process.platform}-${process.arch}.tar.gz`
  await run("tar", ["-czf", Path.join(dir, file), "-C", packageDir, binary], root)
  return { npm_config_better_sqlite3_local_prebuilds: dir }
}

/** An empty ESM app with these files (and package.json fields). */
const makeApp = (
  name: string,
  files: Readonly<Record<string, string>>,
  fields: Readonly<Record<string, unknown>> = {}
): string => {
  const app = Path.join(work, name)
  Fs.mkdirSync(app, { recursive: true })
  Fs.writeFileSync(Path.join(app, "package.json"), JSON.stringify({ name, private: true, type: "module", ...fields }, null, 2))
  for (const [file, text] of Object.entries(files)) Fs.writeFileSync(Path.join(app, file), text)
  return app
}

beforeAll(async () => {
  work = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-package-"))
  // A clean build: output of files since deleted must not be packed.
  Fs.rmSync(Path.join(root, "dist"), { recursive: true, force: true })
  tarball = run("npm", ["pack", "--pack-destination", work, "--json"], root, npmEnv).then((packed) => {
    const [{ filename }] = JSON.parse(packed.stdout) as Array<{ readonly filename: string }>
    return Path.join(work, filename)
  })
  // Awaited by the tests; this only keeps a failed pack from being reported as unhandled.
  tarball.catch(() => {})
  installEnv = {
    npm_config_prefer_offline: "true",
    npm_config_audit: "false",
    npm_config_fund: "false",
    npm_config_update_notifier: "false",
    ...npmEnv,
    ...(await offerLocalPrebuild())
  }
})

afterAll(async () => {
  await tarball.catch(() => {})
  if (work !== undefined) Fs.rmSync(work, { recursive: true, force: true })
})

const tsconfig = (): string =>
  JSON.stringify(
    {
      compilerOptions: {
        target: "ES2022",
        module: "NodeNext",
        moduleResolution: "NodeNext",
        strict: true,
        exactOptionalPropertyTypes: true,
        // As Effect's app templates do; the @ts-expect-error lines below prove the types are not `any`.
        skipLibCheck: true,
        // Node's types are the app's own business, not the README line's: the repository's serve.
        typeRoots: [Path.join(root, "node_modules", "@types")],
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

/** How a program ends: exit 0 once done, 1 with the error. */
const RUN = `.then(() => process.exit(0), (error) => { console.error(error); process.exit(1) })`

/** The memory consumer, exactly the import the README shows; every line installs effect, all it needs. */
const MEMORY_MAIN = `import { Effect } from "effect"
import { DistributedLock, MemoryBackend } from "effect-lock"

const program = Effect.gen(function*() {
  const first = yield* Effect.scoped(Effect.map(DistributedLock.acquire("job"), (lease) => lease.token))
  const second = yield* Effect.scoped(Effect.map(DistributedLock.acquire("job"), (lease) => lease.token))
  console.log(\`memory tokens \${first} \${second}\`)
})
Effect.runPromise(program.pipe(Effect.provide(MemoryBackend.layer())))${RUN}
`

/** A lease on the app's own table (LEASE_TABLE), from the root entry, on the app's PgClient. */
const LEASE_MAIN = `import { PgClient } from "@effect/sql-pg"
import { Config, Effect, Layer } from "effect"
import { DistributedLock, PgLease } from "effect-lock"

const program = Effect.gen(function*() {
  const url = yield* Config.redacted("DATABASE_URL")
  const table = yield* Config.string("LEASE_TABLE")
  const layer = PgLease.layer({ table }).pipe(Layer.provide(PgClient.layer({ url })))
  const token = yield* Effect.scoped(Effect.map(DistributedLock.acquire("package/lease-only"), (lease) => lease.token))
    .pipe(Effect.provide(layer))
  console.log(\`lease token \${token}\`)
})
Effect.runPromise(program)${RUN}
`

/** An advisory lock from the root entry, with nothing but pg beside effect-lock and effect. */
const ADVISORY_MAIN = `import { Config, Effect } from "effect"
import { DistributedLock, PgAdvisory } from "effect-lock"

const program = Effect.gen(function*() {
  const url = yield* Config.redacted("DATABASE_URL")
  const name = yield* Config.string("LOCK_NAME")
  const token = yield* Effect.scoped(Effect.map(DistributedLock.acquire(name, { timeout: "5 seconds" }), (lease) => lease.token))
    .pipe(Effect.provide(PgAdvisory.layer({ url, applicationName: "package-test-advisory-only" })))
  console.log(\`advisory token \${token}\`)
})
Effect.runPromise(program)${RUN}
`

/** Two leases in a fresh SQLite file of the app's directory. */
const SQLITE_MAIN = `import { Effect } from "effect"
import { DistributedLock, SqliteLease } from "effect-lock"

const tokenOf = Effect.scoped(Effect.map(DistributedLock.acquire("job"), (lease) => lease.token))
const program = Effect.gen(function*() {
  const first = yield* tokenOf
  const second = yield* tokenOf
  console.log(\`sqlite tokens \${first} \${second}\`)
})
Effect.runPromise(program.pipe(Effect.provide(SqliteLease.layer({ filename: "locks.db" }))))${RUN}
`

/** Two leases of one name in Redis (REDIS_URL), from the root entry: the second token is the larger. */
const REDIS_MAIN = `import { Config, Effect } from "effect"
import { DistributedLock, RedisLease } from "effect-lock"

const tokenOf = Effect.scoped(Effect.map(DistributedLock.acquire("job"), (lease) => lease.token))
const program = Effect.gen(function*() {
  const url = yield* Config.string("REDIS_URL")
  const prefix = yield* Config.string("REDIS_PREFIX")
  const [first, second] = yield* Effect.all([tokenOf, tokenOf]).pipe(Effect.provide(RedisLease.layer({ url, prefix })))
  console.log(\`redis tokens \${second > first ? "increase" : "repeat"} \${first} \${second}\`)
})
Effect.runPromise(program)${RUN}
`

interface Program {
  readonly file: string
  readonly text: string
  readonly expected: RegExp
}

/** The programs a line's packages make runnable: memory always, each backend whose packages it names. */
const programsFor = (line: InstallLine): ReadonlyArray<Program> => [
  { file: "memory.js", text: MEMORY_MAIN, expected: /^memory tokens 1 2$/m },
  ...(names(line, "@effect/sql-pg") ? [{ file: "lease.js", text: LEASE_MAIN, expected: /^lease token [1-9][0-9]*$/m }] : []),
  ...(names(line, "pg") ? [{ file: "advisory.js", text: ADVISORY_MAIN, expected: /^advisory token \d+$/m }] : []),
  ...(names(line, "@effect/sql-sqlite-node")
    ? [{ file: "sqlite.js", text: SQLITE_MAIN, expected: /^sqlite tokens 1 2$/m }]
    : []),
  // noRedis() prints why once: the line's install and its other programs still run.
  ...(names(line, "ioredis") && !noRedis()
    ? [{ file: "redis.js", text: REDIS_MAIN, expected: /^redis tokens increase \d+ \d+$/m }]
    : [])
]

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

describe("the README's install lines", () => {
  it.each([
    ["PostgreSQL on your SqlClient", "@effect/sql-pg"],
    ["pg, for PgAdvisory.layer", "pg"],
    ["SQLite", "@effect/sql-sqlite-node"],
    ["Redis", "ioredis"]
  ] as const)("include one for %s (naming %s)", (_, name) => {
    expect(installLines.filter((line) => names(line, name)).map((line) => line.line)).toHaveLength(1)
  })

  // An unpinned name resolves to the registry's `latest`: Effect 4 for effect and @effect/sql-pg.
  it.each(installLines.map((line) => [line.command, line] as const))("pin a version of every peer: %s", (_, line) => {
    for (const spec of line.specs) {
      if (spec !== "effect-lock") expect(spec, line.line).toMatch(/^(@[^/@]+\/)?[^@]+@\d/)
    }
  })
})

/**
 * After `line` ran in the empty `app`: npm sees every dependency and peer valid, the optional peers
 * of a backend the line does not name are absent, and the programs its packages allow all run.
 */
const checkLine = async (line: InstallLine, app: string, index: number): Promise<void> => {
  // `npm ls` fails on a missing or invalid dependency or peer anywhere in the tree. It only reads
  // the app, as the programs below do: it runs beside them, and is awaited with them.
  const listed = run("npm", ["ls", "--all"], app, npmEnv)
  // Awaited below; this only keeps a failure meanwhile from being reported as unhandled.
  listed.catch(() => {})
  const installed = installedPackages(app)
  expect(installed).toContain("effect-lock")
  if (!names(line, "pg") && !names(line, "@effect/sql-pg")) expect(installed).not.toContain("pg")
  if (!line.names.some((name) => name.startsWith("@effect/sql"))) expect(installed).not.toContain("@effect/sql")
  if (!names(line, "ioredis")) expect(installed).not.toContain("ioredis")
  const programs = programsFor(line)
  for (const program of programs) Fs.writeFileSync(Path.join(app, program.file), program.text)
  await Promise.all([listed, ...programs.map(async (program) => {
    const { stdout } = await run(process.execPath, [program.file], app, {
      DATABASE_URL: db.url,
      LEASE_TABLE: `package_lease_${index}`,
      LOCK_NAME: `package/advisory/${index}`,
      ...(program.file === "redis.js" ? { REDIS_URL: redis.url(), REDIS_PREFIX: `package-${process.pid}-${index}:` } : {})
    })
    expect(stdout, program.file).toMatch(program.expected)
  })])
  if (names(line, "ioredis") && !noRedis()) {
    // The command runs on what the Redis line installs: effect and ioredis, no @effect/platform.
    expect(installed).not.toContain("@effect/platform")
    const prefix = `package-${process.pid}-${index}:`
    const { stdout } = await run("npx", ["--no", "effect-lock", "inspect", "--json", "--url", redis.url(), "--prefix", prefix], app, npmEnv)
    const report = JSON.parse(stdout) as { redis: { prefix: string; leases: ReadonlyArray<unknown>; truncated: boolean } }
    // The program above released its leases: the listing of its prefix is empty and complete.
    expect(report.redis).toMatchObject({ prefix, leases: [], truncated: false })
  }
}

/** The README's PostgreSQL lines: on your SqlClient (PgLease …), and pg for PgAdvisory.layer. */
const leaseLine = installLines.find((line) => names(line, "@effect/sql-pg"))
const advisoryLine = installLines.find((line) => names(line, "pg"))
/** The Redis line goes on in the app of the MemoryBackend line (effect-lock and effect already there): one npm install fewer beside the others. */
const redisLine = installLines.find((line) => names(line, "ioredis"))
const memoryLine = installLines.find((line) => line.names.length === 2 && names(line, "effect"))

describe.concurrent("the packed package, installed by the README's lines into an empty ESM app", () => {
  // The PostgreSQL line is checked in the app of the test below, which goes on with the pg line;
  // the Redis line in the MemoryBackend line's app, once that line has been checked on its own.
  const goesOn = memoryLine !== undefined && redisLine !== undefined
  it.each(
    installLines.flatMap((line, index) =>
      line === leaseLine || (goesOn && line === redisLine) ? [] : [[line.command, line, index] as const]
    )
  )("%s: installs, with every peer valid, and runs", async (_, line, index) => {
    const app = makeApp(`line-${index}`, {})
    await runLine(line, app)
    await checkLine(line, app, index)
    if (goesOn && line === memoryLine) {
      await runLine(redisLine, app)
      await checkLine(redisLine, app, installLines.indexOf(redisLine))
    }
  }, 2 * INSTALL_TIMEOUT_MS + 6 * STEP_TIMEOUT_MS)

  it("the PostgreSQL line installs and runs; with the pg line too (PgLease and PgAdvisory.layer), a consumer type-checks (NodeNext), runs effect-lock and effect-lock/PgAdvisory, and npx effect-lock inspect --json sees the locks", async () => {
    if (leaseLine === undefined || advisoryLine === undefined) {
      throw new Error("the README has no PostgreSQL (@effect/sql-pg) or no pg install line")
    }
    const app = makeApp("postgres", { "main.ts": FULL_MAIN, "tsconfig.json": tsconfig() })
    await runLine(leaseLine, app)
    await checkLine(leaseLine, app, installLines.indexOf(leaseLine))
    await runLine(advisoryLine, app)
    // `npm ls` and the type-check only read the installed tree (tsc writes out/ only): side by side.
    const listed = run("npm", ["ls", "--all"], app, npmEnv)
    const typeChecked = run(process.execPath, [tsc, "-p", "tsconfig.json"], app)
    // Awaited below; this only keeps a failure meanwhile from being reported as unhandled.
    listed.catch(() => {})
    typeChecked.catch(() => {})
    // Only what the exports map publishes: internals stay private.
    const installed = JSON.parse(Fs.readFileSync(Path.join(app, "node_modules/effect-lock/package.json"), "utf8"))
    expect(installed.exports["./internal/*"]).toBeNull()
    await Promise.all([listed, typeChecked])

    const holder = await startHolder(app, db.url)
    expect(holder.holding).toEqual({ event: "holding", memory: "1", advisory: expect.stringMatching(/^\d+$/), lease: expect.stringMatching(/^\d+$/) })
    const inspected = await run("npx", ["--no", "effect-lock", "inspect", "--json", "--url", db.url], app, npmEnv)
    const report = JSON.parse(inspected.stdout) as {
      advisory: Array<{ name: string | null; granted: boolean; applicationName: string | null }>
      leases: { held: Array<{ name: string; token: string }> }
    }
    expect(report.advisory).toContainEqual(
      expect.objectContaining({ name: "package/advisory", granted: true, applicationName: "package-test-advisory" })
    )
    expect(report.leases.held).toContainEqual(expect.objectContaining({ name: "package/lease", token: expect.stringMatching(/^\d+$/) }))

    const { code, lines } = await holder.release()
    expect(code, lines.join("\n")).toBe(0)
    expect(lines).toContain(
      JSON.stringify({ event: "released", advisory: holder.holding["advisory"], lease: holder.holding["lease"], invalidName: true })
    )
  }, 2 * INSTALL_TIMEOUT_MS + 6 * STEP_TIMEOUT_MS)
})

describe.concurrent("an install that mixes in Effect 4", () => {
  /** The part of npm's ERESOLVE report that names effect-lock's peer; the README quotes it. */
  const refusal = `peer effect@"${rootPackage.peerDependencies["effect"]}" from effect-lock`

  it.each([
    ["effect@4 on the same line", "npm install effect-lock effect@4", {}],
    ["an app already on Effect 4", "npm install effect-lock", { dependencies: { effect: "^4.0.0" } }]
  ] as const)("%s: npm refuses it at install time with its ERESOLVE peer message, and installs nothing", async (label, command, fields) => {
    const app = makeApp(`effect-4-${label.replace(/\W+/g, "-")}`, {}, fields)
    const before = Fs.readFileSync(Path.join(app, "package.json"), "utf8")
    const line: InstallLine = { line: command, command, specs: [], names: [] }
    const failure = await runLine(line, app).then(
      () => undefined,
      (error: Error) => error.message
    )
    expect(failure, "the install succeeded").toBeDefined()
    expect(failure).toContain("npm error code ERESOLVE")
    expect(failure).toContain(`${refusal}@${rootPackage.version}`)
    expect(readme).toContain(refusal)
    expect(installedPackages(app)).toEqual([])
    expect(Fs.readFileSync(Path.join(app, "package.json"), "utf8")).toBe(before)
  }, INSTALL_TIMEOUT_MS)
})

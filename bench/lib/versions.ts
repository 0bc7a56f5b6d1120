/** Versions of what a run measured with, read from the installed packages. */
import * as Fs from "node:fs"
import * as Path from "node:path"
import { fileURLToPath } from "node:url"

/** The repository root (bench/lib/../..). */
export const ROOT = fileURLToPath(new URL("../../", import.meta.url))
/** Where `npm run bench` installs the peer libraries. */
export const BENCH_DIR = Path.join(ROOT, "bench")

/** Version of an installed package under `base`/node_modules, or undefined when it is not installed. */
export const installedVersion = (name: string, base: string = ROOT): string | undefined => {
  try {
    const text = Fs.readFileSync(Path.join(base, "node_modules", name, "package.json"), "utf8")
    return (JSON.parse(text) as { version?: string }).version
  } catch {
    return undefined
  }
}

export const packageVersion = (name: string, base: string = ROOT): string => installedVersion(name, base) ?? "not installed"

/**
 * Runs before every test file (vitest `setupFiles`). @effect/vitest's `layer(...)` assigns its own
 * `effect`/`scoped`/`prop`/`flakyTest`/`layer` onto vitest's one shared `it` object: test files
 * share a worker process (`isolate: false`), so without this every file after one that used
 * `layer(..., { excludeTestServices: true })` would run its `it.scoped` tests without the
 * TestClock. The methods as @effect/vitest first defined them are kept once per worker and put back.
 */
import { it } from "@effect/vitest"

const KEY = Symbol.for("effect-lock/test/pristine-it")
type Methods = Pick<typeof it, "effect" | "scoped" | "prop" | "flakyTest" | "layer">
const store = globalThis as { [KEY]?: Methods }
store[KEY] ??= { effect: it.effect, scoped: it.scoped, prop: it.prop, flakyTest: it.flakyTest, layer: it.layer }
Object.assign(it, store[KEY])

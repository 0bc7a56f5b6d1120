/**
 * Heap and RSS readings taken after a full garbage collection, so that "memory used by 10,000
 * held locks" is live memory, not garbage that happened not to be collected yet.
 */
import * as V8 from "node:v8"
import * as Vm from "node:vm"

let collect: (() => void) | undefined

/**
 * The `gc()` function, exposed at run time: `npm run bench` starts Node without `--expose-gc`,
 * and setting the flag before the first context is created makes `gc` available in a new one.
 */
const gc = (): (() => void) => {
  if (collect !== undefined) return collect
  const existing = (globalThis as { gc?: () => void }).gc
  if (typeof existing === "function") {
    collect = existing
    return collect
  }
  V8.setFlagsFromString("--expose-gc")
  collect = Vm.runInNewContext("gc") as () => void
  return collect
}

export interface MemoryReading {
  readonly heapUsedBytes: number
  readonly rssBytes: number
}

/** Collects garbage (twice: weak callbacks free more on the second pass) and reads memory. */
export const readMemory = (): MemoryReading => {
  const run = gc()
  run()
  run()
  const usage = process.memoryUsage()
  return { heapUsedBytes: usage.heapUsed, rssBytes: usage.rss }
}

export const mib = (bytes: number): number => bytes / (1024 * 1024)

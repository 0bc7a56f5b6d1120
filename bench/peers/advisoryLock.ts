/**
 * The `advisory-lock` npm package (PostgreSQL session advisory locks), loaded from
 * bench/node_modules at run time. It ships no types for this project to check against, so its
 * surface is declared here as used: `advisoryLock(url)(name)` → `{ lock, tryLock, withLock }`,
 * where `lock()` opens a new connection, waits in `pg_advisory_lock`, and resolves to `unlock`
 * (which unlocks and ends that connection).
 */
export interface Mutex {
  readonly lock: () => Promise<() => Promise<void>>
  readonly tryLock: () => Promise<(() => Promise<void>) | undefined>
}

export type CreateMutex = (name: string) => Mutex

type Factory = (connectionString: string) => CreateMutex

/** The package's default export, or a reason it cannot be used. */
export const load = async (): Promise<Factory> => {
  // A computed specifier: resolved at run time from bench/peers, so it finds bench/node_modules.
  const specifier = "advisory-lock"
  const module = (await import(specifier)) as { default?: unknown }
  const exported = module.default as { default?: unknown } | Factory | undefined
  const factory = typeof exported === "function" ? exported : exported?.default
  if (typeof factory !== "function") throw new Error("advisory-lock: no default export function")
  return factory as Factory
}

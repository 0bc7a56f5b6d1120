/**
 * Raw node-postgres sessions for the baselines: what a hand-written program would do with the
 * same statements, with nothing of effect-lock in between.
 */
import pg from "pg"

export const connect = async (url: string, applicationName: string): Promise<pg.Client> => {
  const client = new pg.Client({ connectionString: url, application_name: applicationName })
  // Without an 'error' listener a terminated backend would crash the process.
  client.on("error", () => {})
  await client.connect()
  return client
}

/** `n` sessions, opened one after another (a burst of SCRAM logins would only measure the login). */
export const connectMany = async (url: string, n: number, applicationName: string): Promise<Array<pg.Client>> => {
  const clients: Array<pg.Client> = []
  try {
    for (let i = 0; i < n; i++) clients.push(await connect(url, applicationName))
  } catch (error) {
    await closeAll(clients)
    throw error
  }
  return clients
}

export const closeAll = async (clients: ReadonlyArray<pg.Client>): Promise<void> => {
  await Promise.all(clients.map((client) => client.end().catch(() => {})))
}

/**
 * Several callers sharing one session, one statement at a time in call order: what node-postgres
 * does with overlapping `query()` calls, done explicitly (pg 8 deprecates relying on it).
 */
export const serialized = (client: pg.Client) => {
  let tail: Promise<unknown> = Promise.resolve()
  return <R extends pg.QueryResultRow>(text: string, values?: ReadonlyArray<unknown>): Promise<pg.QueryResult<R>> => {
    const next = tail.then(() => client.query<R>(text, values === undefined ? undefined : [...values]))
    tail = next.catch(() => {})
    return next
  }
}

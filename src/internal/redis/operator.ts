/**
 * RedisLease's operator functions, on any ioredis client the caller gives (not the layer's):
 * the live leases of a name, and an operator's revoke. Each is one script, EVALSHA then EVAL on
 * NOSCRIPT, bounded. Phase 2 turns these into `RedisLease.holders`/`revoke` and the inspect CLI.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type { Redis } from "ioredis"
import { LockBackendError } from "../../LockError.js"
import type { Row, Statement } from "../lease/dialect.js"
import type { StoredLease } from "../lease/stored.js"
import * as Dialect from "./dialect.js"
import * as Keys from "./keys.js"
import { shaOf } from "./lane.js"

const BOUND = Duration.seconds(5)

export interface OperatorOptions {
  readonly prefix?: string | undefined
}

const run = <I, O>(client: Redis, statement: Statement<I, O>, input: I, name: string): Effect.Effect<O, LockBackendError> =>
  Effect.tryPromise({
    try: async () => {
      const args = statement.encode(input) as ReadonlyArray<string | number>
      const reply = await client.call("evalsha", [shaOf(statement.text), ...args]).catch((error: unknown) => {
        if (error instanceof Error && error.message.startsWith("NOSCRIPT")) return client.call("eval", [statement.text, ...args])
        throw error
      })
      return statement.decode([{ reply } as Row])
    },
    catch: (cause) => new LockBackendError({ operation: statement.operation, name, cause })
  }).pipe(
    Effect.timeoutFail({
      duration: BOUND,
      onTimeout: () => new LockBackendError({ operation: statement.operation, name, cause: new Error("no answer from Redis within 5 s") })
    })
  )

const statements = (options: OperatorOptions | undefined) => {
  const prefix = options?.prefix ?? Keys.DEFAULT_PREFIX
  return Dialect.operator(prefix, Keys.channelOf(prefix))
}

/** The live leases of `name` (exclusive, or each shared holder), read on `client`. */
export const holders = (client: Redis, name: string, options?: OperatorOptions): Effect.Effect<ReadonlyArray<StoredLease>, LockBackendError> =>
  run(client, statements(options).holders, { name }, name)

/** Takes the lock `name` away from whoever holds it and wakes its waiters; whether a lease was held. */
export const revoke = (client: Redis, name: string, options?: OperatorOptions): Effect.Effect<boolean, LockBackendError> =>
  run(client, statements(options).revoke, { name }, name)

#!/usr/bin/env node
/**
 * The `effect-lock` command: `effect-lock inspect --url postgres://…` lists the locks held in a
 * database. See `effect-lock --help`.
 *
 * @since 0.1.0
 */
import * as Cause from "effect/Cause"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import { ExitCode, main } from "./inspect.js"

/** Conventional status of a process ended by SIGINT. */
const INTERRUPTED = 130
/** Bound on draining stdout and closing the pool once the program is done. */
const EXIT_GRACE_MS = 2_000

/** The program's own status; a defect is a failure, an interruption (Ctrl-C) is 130. */
const statusOf = (exit: Exit.Exit<unknown, unknown>): number =>
  Exit.isSuccess(exit)
    ? (typeof exit.value === "number" ? exit.value : ExitCode.ok)
    : Cause.isInterruptedOnly(exit.cause)
    ? INTERRUPTED
    : ExitCode.failure

/**
 * What `NodeRuntime.runMain` of @effect/platform-node does, written out: the command then runs on
 * `effect` alone, in an app that installed only a Redis or SQLite line (no @effect/platform).
 * SIGINT/SIGTERM interrupt the program (its finalizers close the pool); a failure is logged.
 */
const runMain = <A, E>(program: Effect.Effect<A, E>): void => {
  const fiber = Effect.runFork(
    Effect.tapErrorCause(program, (cause) => (Cause.isInterruptedOnly(cause) ? Effect.void : Effect.logError(cause)))
  )
  const keepAlive = setInterval(() => {}, 2 ** 31 - 1)
  const onSignal = () => fiber.unsafeInterruptAsFork(fiber.id())
  process.once("SIGINT", onSignal)
  process.once("SIGTERM", onSignal)
  fiber.addObserver((exit) => {
    clearInterval(keepAlive)
    process.removeListener("SIGINT", onSignal)
    process.removeListener("SIGTERM", onSignal)
    const code = statusOf(exit)
    // Exit on an empty event loop, so piped output is never cut; force it only if a socket lingers.
    process.exitCode = code
    setTimeout(() => process.exit(code), EXIT_GRACE_MS).unref()
  })
}

runMain(main(process.argv.slice(2), process.env))

#!/usr/bin/env node
/**
 * The `effect-lock` command: `effect-lock inspect --url postgres://…` lists the locks held in a
 * database. See `effect-lock --help`.
 *
 * @since 0.1.0
 */
import { makeRunMain, type Teardown } from "@effect/platform/Runtime"
import * as Cause from "effect/Cause"
import * as Exit from "effect/Exit"
import { ExitCode, main } from "./inspect.js"

/** Conventional status of a process ended by SIGINT. */
const INTERRUPTED = 130
/** Bound on draining stdout and closing the pool once the program is done. */
const EXIT_GRACE_MS = 2_000

/** The program's own status; a defect is a failure, an interruption (Ctrl-C) is 130. */
const teardown: Teardown = (exit, onExit) =>
  onExit(
    Exit.isSuccess(exit)
      ? (typeof exit.value === "number" ? exit.value : ExitCode.ok)
      : Cause.isInterruptedOnly(exit.cause)
      ? INTERRUPTED
      : ExitCode.failure
  )

/**
 * `NodeRuntime.runMain` of @effect/platform-node, on the primitive it is built on (already a
 * peer of this package), so the command adds no dependency: SIGINT/SIGTERM interrupt the program
 * (its finalizers close the pool) and the exit status comes from `teardown`.
 */
const runMain = makeRunMain(({ fiber, teardown }) => {
  const keepAlive = setInterval(() => {}, 2 ** 31 - 1)
  const onSignal = () => fiber.unsafeInterruptAsFork(fiber.id())
  process.once("SIGINT", onSignal)
  process.once("SIGTERM", onSignal)
  fiber.addObserver((exit) => {
    clearInterval(keepAlive)
    process.removeListener("SIGINT", onSignal)
    process.removeListener("SIGTERM", onSignal)
    teardown(exit, (code) => {
      // Exit on an empty event loop, so piped output is never cut; force it only if a socket lingers.
      process.exitCode = code
      setTimeout(() => process.exit(code), EXIT_GRACE_MS).unref()
    })
  })
})

runMain(main(process.argv.slice(2), process.env), { teardown, disablePrettyLogger: true })

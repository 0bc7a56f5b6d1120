/**
 * The chaos run's report: the checker's table per backend, the faults and their bounds, every
 * violation with the rows and events behind it, the fault sequence, and the run's parameters —
 * as markdown for bench/CHAOS.md, and a short summary for the console.
 */
import { execFileSync } from "node:child_process"
import * as Os from "node:os"
import { fileURLToPath } from "node:url"
import { packageVersion } from "../bench/lib/versions.js"
import { type CheckResult, VIOLATION_KINDS, type ViolationKind } from "./checker.js"
import {
  costsNoLock,
  FAULT_DESCRIPTIONS,
  FAULT_KINDS,
  type FaultKind,
  RECOVERY_REASONS,
  RECOVERY_SLACK_MS,
  recoveryBoundMs
} from "./faults.js"
import { type Backend, LONG_WORK_TTLS, longestRoundMs, SHORT_WORK_MS } from "./protocol.js"
import type { BackendRun, ChaosRun } from "./run.js"

/** Violations listed in full per backend; the rest are counted. */
const MAX_LISTED_VIOLATIONS = 40

const ROOT = fileURLToPath(new URL("..", import.meta.url))

const escapeCell = (cell: string): string => cell.replace(/\|/g, "\\|").replace(/\n/g, " ")

export const table = (headers: ReadonlyArray<string>, rows: ReadonlyArray<ReadonlyArray<string>>): string =>
  [headers, headers.map(() => "---"), ...rows].map((row) => `| ${row.map(escapeCell).join(" | ")} |`).join("\n")

const tally = (counts: Readonly<Record<string, number>>): string => {
  const entries = Object.entries(counts).filter(([, n]) => n > 0)
  return entries.length === 0 ? "0" : entries.map(([key, n]) => `${n} ${key}`).join(", ")
}

const sum = (counts: Readonly<Record<string, number>>) => Object.values(counts).reduce((a, b) => a + b, 0)

const VIOLATION_MEANING: Readonly<Record<ViolationKind, string>> = {
  "token-order": "accepted writes, in commit order, whose token did not strictly increase",
  "round-duplicate": "a round written more than once (two holders read the same last round)",
  "round-skipped": "a round with no row below the highest one",
  "write-after-loss": "a write begun after its holder reported the loss (one begun before may commit after: in flight, still fenced)",
  "shared-overlap": "a write committed between a reader's two reads (the second before its loss report) by a later grant, or by a holder that released normally: a reader and a writer held at once",
  "needless-loss": "a holder lost its lock to a fault that must cost none (pool saturation, a short stall, …)",
  "write-missing": "a write a worker saw commit that is not in the log",
  "no-recovery": "a fault not followed by an accepted write within its bound",
  "left-held": "an advisory lock or a live lease row left after every worker stopped",
  "stop-hang": "a worker that did not stop (release and exit) within 10 s when asked",
  "crash": "a worker process that died on its own (not a typed failure to start)"
}

const noLossNote = (kind: FaultKind, backend: Backend): string => {
  const below = costsNoLock(kind, backend, "below")
  const above = costsNoLock(kind, backend, "above")
  return below && above ? "; no loss" : below ? "; no loss below the safe time" : ""
}

export const gitRevision = (): string => {
  try {
    const head = execFileSync("git", ["rev-parse", "--short", "HEAD"], { cwd: ROOT, encoding: "utf8" }).trim()
    const dirty = execFileSync("git", ["status", "--porcelain", "--", "src"], { cwd: ROOT, encoding: "utf8" }).trim() !== ""
    return dirty ? `${head} (src/ modified)` : head
  } catch {
    return "unknown"
  }
}

/** Whether some rounds were readers' (`--shared`). */
const readersOn = (run: ChaosRun): boolean => (run.options.sharedChance ?? 0) > 0

const command = (run: ChaosRun): string => {
  const backend = run.options.backends.length > 1 ? "all" : run.options.backends[0]
  const extra = run.options.extraSeeds ?? []
  const then = extra.length === 0 ? "" : ` (this run then drew one deck of faults from each of the seeds ${extra.join(", ")}: replay one with its own --seed)`
  const broken = run.options.broken === undefined ? "" : ` --broken ${run.options.broken}`
  const shared = readersOn(run) ? ` --shared ${run.options.sharedChance}` : ""
  return `\`npm run chaos -- --backend ${backend} --minutes ${run.options.durationMs / 60_000} --seed ${run.seed} --workers ${run.options.workers} --ttl-ms ${run.options.ttlMs}${shared}${broken}\`${then}`
}

const resultRows = (runs: ReadonlyArray<BackendRun>): Array<Array<string>> => {
  const row = (label: string, f: (c: CheckResult, run: BackendRun) => string) => [label, ...runs.map((run) => f(run.check, run))]
  return [
    row("faults injected", (c) => String(FAULT_KINDS.reduce((n, kind) => n + c.faultsByKind[kind].injected, 0))),
    row("rounds (accepted writes)", (c) => String(c.rounds)),
    row("acquisitions", (c) => String(c.acquisitions)),
    row("reader rounds (shared acquisitions)", (c) => String(c.readerRounds)),
    row("reads judged (a reader's two reads compared, the second before any loss report)", (c) => String(c.readsJudged)),
    row("takeovers (grant logged before the previous holder logged its release: after a lost lease, or a handover, which grants inside the release)", (c) => String(c.takeovers)),
    row("writes refused by the fence", (c) => String(c.refusals)),
    row("losses reported, by reason", (c) => tally(c.lossesByReason)),
    row("worker errors, by tag", (c) => tally(c.errorsByTag)),
    row("acquire timeouts (30 s)", (c) => String(c.acquireTimeouts)),
    row("worker exits, by cause", (c) => tally(c.exitsByCause)),
    row("**violations**", (c) => `**${c.violations.length}**`)
  ]
}

const faultRows = (runs: ReadonlyArray<BackendRun>): Array<Array<string>> =>
  FAULT_KINDS.map((kind) => [
    `\`${kind}\``,
    ...runs.map((run) => {
      const k = run.check.faultsByKind[kind]
      const told = run.check.faultOutcomes.filter((o) => o.fault.kind === kind && o.holderToldAfterMs !== undefined)
      const parts = [
        `${k.injected} injected${k.skipped > 0 ? ` (${k.skipped} skipped)` : ""}`,
        `${k.recovered} recovered`,
        k.worstRecoveryMs === undefined ? "" : `worst ${k.worstRecoveryMs} ms`,
        k.boundMs === undefined ? "" : `bound ${k.boundMs} ms`,
        told.length === 0 ? "" : `holder told ${told.length}× (after ${told.map((o) => o.holderToldAfterMs).join(", ")} ms)`
      ]
      return parts.filter((p) => p !== "").join("; ")
    })
  ])

const violationSection = (run: BackendRun): string => {
  const { violations } = run.check
  if (violations.length === 0) return `### ${run.backend}: no violation\n`
  const listed = violations.slice(0, MAX_LISTED_VIOLATIONS).map((v) => `- **${v.kind}**: ${v.detail}`)
  const more = violations.length > MAX_LISTED_VIOLATIONS ? [`- … and ${violations.length - MAX_LISTED_VIOLATIONS} more`] : []
  return [
    `### ${run.backend}: ${violations.length} violation(s)`,
    "",
    table(["kind", "count", "meaning"], VIOLATION_KINDS.filter((k) => run.check.violationsByKind[k] > 0).map((k) => [k, String(run.check.violationsByKind[k]), VIOLATION_MEANING[k]])),
    "",
    ...listed,
    ...more,
    ""
  ].join("\n")
}

const sequenceSection = (run: BackendRun, phased: boolean): string =>
  [
    `### ${run.backend}`,
    "",
    table(
      ["#", ...(phased ? ["seed"] : []), "at", "fault", "target (holder)", "what", "recovery", "holder told"],
      run.check.faultOutcomes.map((o, i) => [
        String(i + 1),
        ...(phased ? [String(o.fault.seed ?? "")] : []),
        `+${((o.fault.startedAt - run.startedAt) / 1000).toFixed(1)} s`,
        o.fault.kind,
        o.fault.target === undefined ? "–" : `w${o.fault.target}${o.fault.holder === undefined ? "" : ` (${o.fault.holder.acq}, token ${o.fault.holder.token})`}`,
        o.fault.skipped ?? o.fault.detail,
        o.status === "skipped" ? "skipped" : `${o.recoveredAfterMs === undefined ? "none" : `${o.recoveredAfterMs} ms`} (${o.status})`,
        o.holderToldAfterMs === undefined ? "–" : `${o.holderToldAfterMs} ms`
      ])
    ),
    ""
  ].join("\n")

export const renderMarkdown = (run: ChaosRun): string => {
  const { runs } = run
  const minutes = run.options.durationMs / 60_000
  const cpus = Os.cpus()
  const clock = runs.map((r) =>
    `${r.backend}: measured offset ${r.clock.measuredOffsetMs.toFixed(2)} ms ± ${r.clock.uncertaintyMs.toFixed(2)} ms, applied ${r.clock.appliedOffsetMs.toFixed(2)} ms`
  ).join("; ")
  return [
    "# Chaos run",
    "",
    `Written by \`npm run chaos\` (chaos/main.ts). Re-run: ${command(run)} — the seed replays the same`,
    "fault sequence (kinds, order, durations, which worker is preferred); where each fault lands in a",
    "worker's round depends on timing and differs between runs.",
    "",
    run.violations === 0 ? "**Result: no violation.**" : `**Result: ${run.violations} violation(s)** — listed below with the rows and events behind each.`,
    "",
    "## Parameters",
    "",
    table(["", ""], [
      ["seed", String(run.seed)],
      ...(run.options.broken === undefined ? [] : [["broken workers (on purpose: the checker must flag them)", run.options.broken]]),
      ["backends", run.options.backends.join(", ")],
      ["fault injection per backend", `${minutes} min, and at least one fault of each kind (the last fault's recovery may run past it)`],
      ["workers (OS processes) per backend", String(run.options.workers)],
      ...(readersOn(run) ? [["reader rounds (`shared`, two reads, no write)", `${run.options.sharedChance} of rounds, drawn per round`]] : []),
      ["lease ttl (PgLease, RedisLease)", `${run.options.ttlMs} ms`],
      ["worker pool (`PgClient` maxConnections)", String(run.options.poolSize)],
      ["server", `PostgreSQL ${run.server.version}, ${run.server.embedded ? "embedded (started by the run; restarts injected)" : "DATABASE_URL (restarts skipped)"}`],
      ...(run.redis === undefined ? [] : [[
        "redis server (the lock of `redis`; its rounds are written to the PostgreSQL above)",
        `Redis ${run.redis.version}, ${run.redis.embedded ? "redis-server started by the run, AOF appendfsync always (restarts and freezes injected)" : "EFFECT_LOCK_REDIS_URL/REDIS_URL (restarts and freezes skipped)"}`
      ]]),
      ["write times", run.server.commitTimestamps ? "commit timestamps (track_commit_timestamp = on)" : "the inserts' clock_timestamp() (commit timestamps off: a lower bound of the commit)"],
      ["clock alignment", clock],
      ["library", `effect-lock ${run.library}`],
      ["versions", `node ${process.version}, effect ${packageVersion("effect")}, @effect/sql ${packageVersion("@effect/sql")}, @effect/sql-pg ${packageVersion("@effect/sql-pg")}, pg ${packageVersion("pg")}${run.redis === undefined ? "" : `, ioredis ${packageVersion("ioredis")}`}`],
      ["machine", `${cpus.length} × ${cpus[0]?.model ?? "unknown CPU"}, ${(Os.totalmem() / 2 ** 30).toFixed(1)} GiB, ${Os.type()} ${Os.release()}`],
      ["date", new Date().toISOString()]
    ]),
    "",
    "## Results",
    "",
    table(["", ...runs.map((r) => r.backend)], resultRows(runs)),
    "",
    "## Faults per kind",
    "",
    "Recovery is the first write accepted (committed) after the fault ended; \"holder told\" is how long",
    "after the fault began the holder it hit reported `LockLost` (when it did).",
    "",
    table(["fault", ...runs.map((r) => r.backend)], faultRows(runs)),
    "",
    "## Violations",
    "",
    ...runs.map(violationSection),
    "## Fault sequence",
    "",
    ...runs.map((r) => sequenceSection(r, (run.options.extraSeeds ?? []).length > 0)),
    "## What the run does",
    "",
    `Per backend, ${run.options.workers} worker processes (chaos/worker.ts) loop on one lock in a fresh database. Each round,`,
    `holding the lock under \`DistributedLock.guard\` (what \`withLock\` uses), a worker works (${SHORT_WORK_MS.min}–${SHORT_WORK_MS.max} ms, or ${LONG_WORK_TTLS.min}–${LONG_WORK_TTLS.max} × ttl`,
    "one round in four, so leases renew while held), reads the last round of the write",
    "log, waits a deliberate 20–80 ms gap, then in one transaction runs `Fence.check` with the lease's token and",
    "inserts round + 1 (worker, token, acquisition id, when the write began, `clock_timestamp()`). A double holder would write a round",
    "twice; a stale holder is refused by the fence. The driver (chaos/run.ts) injects one fault at a time, waits",
    "for a write after it (or its bound), pauses 0.3–1 s, and draws the next kind from a seeded deck holding",
    "every kind once, so a short run still has them all. Four faults in five are aimed at the next worker granted",
    "the lock, a random 0–350 ms into its round (before, inside or after its read-to-write gap); the fifth hits any",
    "worker.",
    ...(readersOn(run)
      ? [
        "",
        `Readers: a round is a reader's with chance ${run.options.sharedChance}. It takes the lock \`shared\`, works as a writer`,
        "does, reads the write log (one statement returning its snapshot, `pg_current_snapshot()`), waits the same",
        "gap, reads again and writes nothing. Each row carries its transaction's id, so the checker knows exactly",
        "which writes each read saw."
      ]
      : []),
    "",
    table(["fault", "what it does"], FAULT_KINDS.map((kind) => [`\`${kind}\``, FAULT_DESCRIPTIONS[kind]])),
    "",
    "## What the checker proves (chaos/checker.ts)",
    "",
    "- **Token order**: the accepted writes, in commit order, carry strictly increasing tokens (one write per grant).",
    "- **Rounds**: rounds 1..n, one row each: no round done twice, none skipped.",
    "- **No write begun after a reported loss**: a worker prints `lost` the moment its `lease.lost` fails, and",
    "  `writing` when a fenced write begins (after `Fence.check`, right before the insert goes to the driver), whose",
    "  stamp is stored in the row. A row of that acquisition whose write began after the `lost` report is a violation,",
    "  judged by the worker's own event order (exact: one process, no clock involved). A write that began before the",
    "  report and committed after it is not: it was in flight, its outcome unknown to the holder as with any database",
    "  client (a statement sent to a server that then froze may still commit when it resumes), and it is still",
    "  fenced — the token-order check holds it to that. Rows without a begin stamp (old logs) are judged by their commit.",
    ...(readersOn(run)
      ? [
        "- **No reader beside a writer**: a write that a reader's second read saw and its first did not (the second",
        "  printed before any loss report of its own) committed while the reader held. It is a violation if its token",
        "  is above the reader's (granted after the reader, while the reader held and had not been told) or if its",
        "  holder released normally (it held after the reader's grant). A lower token of a holder that had reported",
        "  its loss, or died, is a stale holder's write in flight: allowed (readers do not fence)."
      ]
      : []),
    "- **Nothing lost**: every write a worker saw commit is in the log (restarts included).",
    "- **No needless loss**: a holder hit by a fault the library promises costs nothing reports no `LockLost`",
    "  during it or within 2 s after it (DESIGN.md non-negotiables, issue 10): pool saturation (renewals never queue",
    "  behind the app's statements), a stall below the lease's safe time, any stall or freeze of a PgAdvisory client",
    "  (its live session's answers are read late, not lost; \"Not a lease\"), terminated pool sessions under PgLease",
    "  (the lease lives in a row).",
    `- **Recovery**: after each fault ends, a write is accepted within its bound: what the library promises (below),`,
    `  plus the longest round of whoever takes the lock first (1.5 × ttl + ${longestRoundMs(0)} ms: it writes at the end${
      readersOn(run) ? "; twice with readers, as a reader taking it first writes nothing" : ""
    }),`,
    `  plus ${RECOVERY_SLACK_MS} ms for a worker's error backoff, reconnecting after a restart and a loaded 2-core machine.`,
    "",
    table(
      ["fault", ...run.options.backends.map((b) => `${b}: bound from the fault's end (ms)`), "why"],
      FAULT_KINDS.map((kind) => [
        `\`${kind}\``,
        ...run.options.backends.map((b) => `${recoveryBoundMs(kind, b, run.options.ttlMs, readersOn(run))}${noLossNote(kind, b)}`),
        run.options.backends.map((b) => `${b}: ${RECOVERY_REASONS[kind][b]}`).join("; ")
      ])
    ),
    "",
    "  (\"no loss\": the fault must not cost the holder its lock — see *No needless loss*.)",
    "",
    "- **Nothing left held**: after every worker was asked to stop, no advisory lock in `pg_locks` and no live",
    "  lease row; every worker stopped within 10 s; no worker died on its own.",
    ""
  ].join("\n")
}

/** The console summary: the results and fault tables, then the violations. */
export const renderSummary = (run: ChaosRun): string =>
  [
    "",
    table(["", ...run.runs.map((r) => r.backend)], resultRows(run.runs)),
    "",
    table(["fault", ...run.runs.map((r) => r.backend)], faultRows(run.runs)),
    "",
    ...run.runs.flatMap((r) =>
      r.check.violations.length === 0
        ? [`${r.backend}: no violation (trace ${r.traceFile})`]
        : [
          `${r.backend}: ${r.check.violations.length} violation(s) (trace ${r.traceFile}, log ${r.logFile}):`,
          ...r.check.violations.slice(0, MAX_LISTED_VIOLATIONS).map((v) => `  ${v.kind}: ${v.detail}`)
        ]
    ),
    "",
    `total: ${sum(Object.fromEntries(run.runs.map((r) => [r.backend, r.check.violations.length])))} violation(s); seed ${run.seed}`
  ].join("\n")

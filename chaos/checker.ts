/**
 * The chaos run's checker: from the database's write log, the workers' events and the faults the
 * driver injected, it proves — or refutes with the rows and events at fault — what a lock with
 * fencing tokens promises. Pure: `test/chaos.test.ts` runs it on hand-made logs.
 *
 * Writes after a loss. The guarantee checked is the one the README states: a write that *began*
 * before its holder reported the loss has an unknown outcome, like any statement in flight when a
 * database client gives up — it may commit later, and is still fenced (the token-order check holds
 * it to that); a write that *began* after the report is a violation (`write-after-loss`). The
 * worker stamps a write's begin by printing a `writing` event in the fiber that writes, right
 * before the insert is handed to the driver, and stores that event's stamp in the row (`beganAt`,
 * `beganN`). The `lost` event comes from the same process, so the two are compared by the
 * process's own event order `n` — exact, with no clock involved (`t` is only shown). A row without
 * a begin stamp (a log from before the stamp existed) is judged by the old, stricter rule: a
 * commit after the report is flagged, in-flight or not, and the detail says so.
 *
 * Clocks. Events and faults are stamped with `Date.now()` on this host; commit times come from the
 * server (`pg_xact_commit_timestamp`, or the insert's `clock_timestamp()` when commit timestamps
 * are off) and order the writes for the token check and time the recoveries. On one host both
 * read the same system clock, so no alignment is needed (`serverOffsetMs` 0); for a remote server
 * the driver measures the offset (server − local) and it is subtracted from the server's times. A
 * server time is floored to the millisecond before it is compared with `Date.now()` (which is
 * floored too).
 *
 * Readers. A reader (a `shared` acquisition) reads the write log twice, a gap apart, and writes
 * nothing; each read's snapshot says exactly which writes it saw (by their transactions' `xid`).
 * A write that read 2 saw and read 1 did not committed while the reader held — if the reader still
 * held at read 2, i.e. it printed read 2 before any `lost` of its own (`shared-overlap`). Such a
 * write is a violation when its token is above the reader's (an exclusive grant made after the
 * reader's, while the reader held and had not been told), or when its holder ended with a normal
 * release (it held the lock at a moment after the reader's grant). A write whose holder had
 * reported its loss, or died, and whose token is below the reader's is an in-flight write of a
 * stale holder: allowed, as readers do not fence. The other rules are about writes and read
 * readers as follows: rounds, token order, writes after a loss and missing writes see only rows
 * and `wrote` events, which readers never make; a reader's grant counts as an acquisition, and a
 * loss a no-loss fault costs a reader is as needless as a writer's; recovery still waits for a
 * write (its bound allows a reader's round first, faults.ts); a grant is a takeover only over an
 * earlier holder it excludes (two readers hold side by side); leftovers count shared leases too.
 */
import { FAULT_KINDS, type FaultKind, type FaultRecord } from "./faults.js"
import type { WorkerExit } from "./fleet.js"
import type { Stamped } from "./protocol.js"

/** One accepted write, as read back from the write log. */
export interface WriteRow {
  readonly seq: number
  readonly round: number
  readonly worker: number
  readonly token: bigint
  readonly acquisition: string
  /** Server time (ms since the epoch, fractional) of the insert. */
  readonly writtenAt: number
  /** Server time of the commit, when the server tracks commit timestamps. */
  readonly committedAt?: number | undefined
  /** `Date.now()` of the writing worker when the write began (its `writing` event's `t`). */
  readonly beganAt?: number | undefined
  /** The writing worker's `writing` event's `n`: its place in that process's event order. */
  readonly beganN?: number | undefined
  /** The writing transaction's id: which readers' snapshots saw this row (absent in old logs). */
  readonly xid?: bigint | undefined
}

export interface CheckInput {
  readonly writes: ReadonlyArray<WriteRow>
  readonly events: ReadonlyArray<Stamped>
  readonly faults: ReadonlyArray<FaultRecord>
  /** What was still held after every worker stopped. */
  readonly leftovers: { readonly advisoryLocks: number; readonly liveLeases: number }
  /** Workers that did not stop when asked within the driver's bound and had to be killed. */
  readonly hungAtStop: ReadonlyArray<number>
  readonly exits: ReadonlyArray<WorkerExit>
  /** Server clock minus this host's clock, in ms (0 on one host). */
  readonly serverOffsetMs: number
  /** When the driver told the workers to stop: a recovery due after it cannot be checked. */
  readonly stoppedAt: number
}

export const VIOLATION_KINDS = [
  "token-order",
  "round-duplicate",
  "round-skipped",
  "write-after-loss",
  "shared-overlap",
  "needless-loss",
  "write-missing",
  "no-recovery",
  "left-held",
  "stop-hang",
  "crash"
] as const
export type ViolationKind = typeof VIOLATION_KINDS[number]

export interface Violation {
  readonly kind: ViolationKind
  readonly detail: string
}

export interface FaultOutcome {
  readonly fault: FaultRecord
  /** ms from the fault's end to the first write committed after it; undefined when none came. */
  readonly recoveredAfterMs: number | undefined
  /** `ok`, `late` (after the bound), `none` (no write at all), `unchecked` (the run stopped first), `skipped`. */
  readonly status: "ok" | "late" | "none" | "unchecked" | "skipped"
  /** ms from the fault's start until the targeted holder reported its loss, if it did. */
  readonly holderToldAfterMs: number | undefined
}

export interface KindSummary {
  readonly injected: number
  readonly skipped: number
  readonly recovered: number
  readonly worstRecoveryMs: number | undefined
  readonly boundMs: number | undefined
}

export interface CheckResult {
  /** Accepted writes (rows of the write log). */
  readonly rounds: number
  readonly acquisitions: number
  /** Acquisitions in `shared` mode: readers' rounds. */
  readonly readerRounds: number
  /** Readers whose two reads were compared (both printed, the second before any loss report). */
  readonly readsJudged: number
  /** Grants made while the previous grant (by token) had not been released: after a loss or a death. */
  readonly takeovers: number
  /** Writes the fence refused (a newer token had written). */
  readonly refusals: number
  readonly lossesByReason: Readonly<Record<string, number>>
  readonly errorsByTag: Readonly<Record<string, number>>
  readonly acquireTimeouts: number
  readonly exitsByCause: Readonly<Record<string, number>>
  readonly faultsByKind: Readonly<Record<FaultKind, KindSummary>>
  readonly faultOutcomes: ReadonlyArray<FaultOutcome>
  readonly violations: ReadonlyArray<Violation>
  readonly violationsByKind: Readonly<Record<ViolationKind, number>>
  /** Which server time the write checks used. */
  readonly commitTimes: "commit timestamps" | "insert times (commit timestamps off)" | "no writes"
}

const count = (into: Record<string, number>, key: string) => {
  into[key] = (into[key] ?? 0) + 1
}

/** A server time on this host's timeline, floored to the millisecond like `Date.now()`. */
const localMillis = (serverMillis: number, offsetMs: number) => Math.floor(serverMillis - offsetMs)

const commitOf = (row: WriteRow) => row.committedAt ?? row.writtenAt

const iso = (millis: number) => new Date(millis).toISOString().slice(11, 23)

const describeRow = (row: WriteRow) => `seq ${row.seq} round ${row.round} token ${row.token} by ${row.acquisition}`

/** Accepted writes in the order the resource accepted them must carry strictly increasing tokens. */
const checkTokenOrder = (writes: ReadonlyArray<WriteRow>): Array<Violation> => {
  const ordered = [...writes].sort((a, b) => commitOf(a) - commitOf(b) || a.seq - b.seq)
  const violations: Array<Violation> = []
  for (let i = 1; i < ordered.length; i++) {
    const before = ordered[i - 1]!
    const after = ordered[i]!
    if (after.token <= before.token) {
      violations.push({
        kind: "token-order",
        detail: `${describeRow(after)} was accepted after ${describeRow(before)}: token ${after.token === before.token ? "repeated" : "went backwards"}`
      })
    }
  }
  return violations
}

/** Rounds 1..n, one row each: a double holder writes a round twice, a lost write leaves a hole. */
const checkRounds = (writes: ReadonlyArray<WriteRow>): Array<Violation> => {
  const byRound = new Map<number, Array<WriteRow>>()
  for (const row of writes) byRound.set(row.round, [...(byRound.get(row.round) ?? []), row])
  const highest = Math.max(0, ...byRound.keys())
  const violations: Array<Violation> = []
  for (let round = 1; round <= highest; round++) {
    const rows = byRound.get(round) ?? []
    if (rows.length === 0) violations.push({ kind: "round-skipped", detail: `round ${round} has no row (rounds go up to ${highest})` })
    if (rows.length > 1) {
      violations.push({ kind: "round-duplicate", detail: `round ${round} written ${rows.length} times: ${rows.map(describeRow).join("; ")}` })
    }
  }
  for (const round of byRound.keys()) {
    if (!(Number.isInteger(round) && round >= 1)) violations.push({ kind: "round-skipped", detail: `round ${round} is not a round number` })
  }
  return violations
}

/** Each acquisition's first `lost` event: when its process learned of the loss. */
const firstLossByAcq = (events: ReadonlyArray<Stamped>): Map<string, Stamped & { readonly e: "lost" }> => {
  const lost = new Map<string, Stamped & { readonly e: "lost" }>()
  for (const event of events) if (event.e === "lost" && !lost.has(event.acq)) lost.set(event.acq, event)
  return lost
}

/**
 * A holder that reported its loss must begin no write after that report: a row whose begin comes
 * after its acquisition's `lost` event in the worker's own event order is a violation. One begun
 * before may commit after (in flight: outcome unknown, still fenced). A row without a begin stamp
 * falls back to its commit time.
 */
const checkWritesAfterLoss = (input: CheckInput): Array<Violation> => {
  const lostAt = firstLossByAcq(input.events)
  const violations: Array<Violation> = []
  for (const row of input.writes) {
    const lost = lostAt.get(row.acquisition)
    if (lost === undefined) continue
    const reported = `w${lost.w} reported the loss (${lost.reason}) at ${iso(lost.t)} (its event ${lost.n})`
    if (row.beganN !== undefined) {
      if (row.beganN > lost.n) {
        const began = row.beganAt === undefined ? "" : ` at ${iso(row.beganAt)}, ${row.beganAt - lost.t} ms`
        violations.push({
          kind: "write-after-loss",
          detail: `${describeRow(row)} began${began} after ${reported}: its begin is event ${row.beganN}`
        })
      }
      continue
    }
    const committed = localMillis(commitOf(row), input.serverOffsetMs)
    if (committed > lost.t) {
      violations.push({
        kind: "write-after-loss",
        detail: `${describeRow(row)} committed at ${iso(committed)}, ${committed - lost.t} ms after ${reported}; the row has no begin stamp, so its commit was judged`
      })
    }
  }
  return violations
}

/** A `pg_current_snapshot()`: transactions below `xmin` are done, from `xmax` on not yet begun, `xip` in progress. */
interface Snapshot {
  readonly text: string
  readonly xmin: bigint
  readonly xmax: bigint
  readonly xip: ReadonlySet<bigint>
}

/** `xmin:xmax:xip,…` as PostgreSQL prints it; undefined for anything else. */
export const parseSnapshot = (text: string): Snapshot | undefined => {
  const match = /^(\d+):(\d+):([\d,]*)$/.exec(text)
  if (match === null) return undefined
  const xip = match[3] === "" ? [] : match[3]!.split(",").map(BigInt)
  return { text, xmin: BigInt(match[1]!), xmax: BigInt(match[2]!), xip: new Set(xip) }
}

/** Whether a statement with `snapshot` saw the (committed) row written by transaction `xid`. */
export const saw = (snapshot: Snapshot, xid: bigint): boolean =>
  xid < snapshot.xmin || (xid < snapshot.xmax && !snapshot.xip.has(xid))

type ReadEvent = Stamped & { readonly e: "read" }

/** A reader's two reads, as printed (the first of each per acquisition). */
interface ReaderReads {
  readonly first: ReadEvent
  readonly second: ReadEvent
}

const readersOf = (events: ReadonlyArray<Stamped>): Array<ReaderReads> => {
  const reads = new Map<string, { first?: ReadEvent; second?: ReadEvent }>()
  for (const event of events) {
    if (event.e !== "read") continue
    const pair = reads.get(event.acq) ?? {}
    if (event.which === 1) pair.first ??= event
    else pair.second ??= event
    reads.set(event.acq, pair)
  }
  return [...reads.values()].flatMap((pair) => (pair.first !== undefined && pair.second !== undefined ? [{ first: pair.first, second: pair.second }] : []))
}

/**
 * Readers and writers never hold at once. For each reader whose second read counts (printed
 * before its own `lost`, by `n`: the same process), every write that read saw and the first did
 * not committed while the reader held. It is a violation if its token is above the reader's (a
 * grant made after the reader's: tokens strictly increase per name), or if its holder released
 * normally (no loss, no death: it still held after the reader's grant). A lower token whose holder
 * reported its loss, or died without a release, is a stale holder's write in flight: allowed.
 */
const checkSharedOverlaps = (input: CheckInput): { readonly judged: number; readonly violations: Array<Violation> } => {
  const lost = firstLossByAcq(input.events)
  const released = new Set(input.events.flatMap((e) => (e.e === "released" ? [e.acq] : [])))
  const writes = input.writes.filter((row): row is WriteRow & { readonly xid: bigint } => row.xid !== undefined)
  let judged = 0
  const violations: Array<Violation> = []
  for (const { first, second } of readersOf(input.events)) {
    const loss = lost.get(second.acq)
    if (loss !== undefined && second.n > loss.n) continue
    const before = parseSnapshot(first.snapshot)
    const after = parseSnapshot(second.snapshot)
    if (before === undefined || after === undefined) continue
    judged++
    const token = BigInt(second.token)
    for (const row of writes) {
      if (!saw(after, row.xid) || saw(before, row.xid)) continue
      const newer = row.token > token
      const heldOn = !lost.has(row.acquisition) && released.has(row.acquisition)
      if (!newer && !heldOn) continue
      const why = newer
        ? `its token is above the reader's: granted after the reader, while the reader held and had not been told`
        : `its holder never reported a loss and released normally: it held the lock after the reader's grant`
      violations.push({
        kind: "shared-overlap",
        detail: `reader ${second.acq} (token ${token}) saw ${describeRow(row)} commit between its read 1 (snapshot ${before.text}, event ${first.n} at ${
          iso(first.t)
        }) and read 2 (snapshot ${after.text}, event ${second.n} at ${iso(second.t)})${loss === undefined ? "" : `, before its loss report (event ${loss.n})`}: ${why}`
      })
    }
  }
  return { judged, violations }
}

/** Every write a worker reported as committed must be in the log (a restart must not lose it). */
const checkReportedWrites = (input: CheckInput): Array<Violation> => {
  const seqs = new Set(input.writes.map((row) => String(row.seq)))
  return input.events.flatMap((event): Array<Violation> =>
    event.e === "wrote" && !seqs.has(event.seq)
      ? [{ kind: "write-missing", detail: `w${event.w} reported round ${event.round} (seq ${event.seq}, token ${event.token}) committed at ${iso(event.t)}; the log has no such row` }]
      : []
  )
}

/** A loss reported this soon after a fault ended is the fault's doing (the process reports it when it resumes). */
export const LOSS_ATTRIBUTION_MS = 2_000

/**
 * A fault the library promises costs nothing (`costsNoLock`) must not make the holder it hit
 * report a loss — during the fault, or within `LOSS_ATTRIBUTION_MS` after it (before the next one).
 */
const checkNeedlessLosses = (input: CheckInput): Array<Violation> =>
  input.faults.flatMap((fault, index): Array<Violation> => {
    if (!fault.costsNoLock || fault.holder === undefined || fault.skipped !== undefined) return []
    const until = Math.min(fault.endedAt + LOSS_ATTRIBUTION_MS, input.faults[index + 1]?.startedAt ?? Infinity)
    const lost = input.events.find((e) => e.e === "lost" && e.acq === fault.holder!.acq && e.t >= fault.startedAt && e.t <= until)
    if (lost?.e !== "lost") return []
    // When the store let the next holder in says how long it still granted the lease given up.
    const next = input.events.find((e): e is Stamped & { readonly e: "acquired" } => e.e === "acquired" && BigInt(e.token) > BigInt(lost.token))
    const nextGrant = next === undefined ? "no later grant" : `the next grant (token ${next.token}) came ${next.t - lost.t} ms after the loss`
    return [{
      kind: "needless-loss",
      detail: `${fault.kind} (${fault.detail}) at ${iso(fault.startedAt)}: holder ${lost.acq} (token ${lost.token}) reported LockLost (${lost.reason}) ${lost.t - fault.startedAt} ms after it began, although this fault must cost no lock; ${nextGrant}`
    }]
  })

const recoveryOf = (input: CheckInput, commits: ReadonlyArray<number>, fault: FaultRecord): FaultOutcome => {
  const lost = fault.holder === undefined
    ? undefined
    : input.events.find((e) => e.e === "lost" && e.acq === fault.holder!.acq && e.t >= fault.startedAt)
  const holderToldAfterMs = lost === undefined ? undefined : lost.t - fault.startedAt
  if (fault.skipped !== undefined) return { fault, recoveredAfterMs: undefined, status: "skipped", holderToldAfterMs }
  const next = commits.find((t) => t > fault.endedAt)
  const recoveredAfterMs = next === undefined ? undefined : next - fault.endedAt
  const status = recoveredAfterMs !== undefined && recoveredAfterMs <= fault.boundMs
    ? "ok"
    : fault.endedAt + fault.boundMs > input.stoppedAt
    ? "unchecked"
    : recoveredAfterMs === undefined
    ? "none"
    : "late"
  return { fault, recoveredAfterMs, status, holderToldAfterMs }
}

type Grant = Stamped & { readonly e: "acquired" }

/**
 * Grants (in token order) made while the grant(s) they follow had not logged their release: after
 * a loss, a death, or a handover. Without readers a grant follows the previous one. A reader
 * follows the last writer, and only the first reader of a group counts (the others join it); a
 * writer follows the readers granted since the last writer (released in any order), if any, else
 * that writer.
 */
const countTakeovers = (acquired: ReadonlyArray<Grant>, releasedAt: ReadonlyMap<string, number>): number => {
  let takeovers = 0
  let writer: Grant | undefined
  let readers: Array<Grant> = []
  for (const grant of acquired) {
    const shared = grant.mode === "shared"
    const follows = shared ? (readers.length > 0 ? [] : [writer]) : readers.length > 0 ? readers : [writer]
    if (follows.some((earlier) => earlier !== undefined && (releasedAt.get(earlier.acq) ?? Infinity) > grant.t)) takeovers++
    if (shared) {
      readers.push(grant)
    } else {
      writer = grant
      readers = []
    }
  }
  return takeovers
}

export const check = (input: CheckInput): CheckResult => {
  const commits = input.writes.map((row) => localMillis(commitOf(row), input.serverOffsetMs)).sort((a, b) => a - b)
  const faultOutcomes = input.faults.map((fault) => recoveryOf(input, commits, fault))
  const shared = checkSharedOverlaps(input)

  const violations: Array<Violation> = [
    ...checkTokenOrder(input.writes),
    ...checkRounds(input.writes),
    ...checkWritesAfterLoss(input),
    ...shared.violations,
    ...checkNeedlessLosses(input),
    ...checkReportedWrites(input),
    ...faultOutcomes.flatMap((o): Array<Violation> =>
      o.status === "none" || o.status === "late"
        ? [{
          kind: "no-recovery",
          detail: `${o.fault.kind} (${o.fault.detail}) ended at ${iso(o.fault.endedAt)}: ${
            o.recoveredAfterMs === undefined ? "no write accepted after it" : `first write accepted ${o.recoveredAfterMs} ms after it`
          }, bound ${o.fault.boundMs} ms`
        }]
        : []
    ),
    ...(input.leftovers.advisoryLocks > 0
      ? [{ kind: "left-held" as const, detail: `${input.leftovers.advisoryLocks} advisory lock(s) in pg_locks after every worker stopped` }]
      : []),
    ...(input.leftovers.liveLeases > 0
      ? [{ kind: "left-held" as const, detail: `${input.leftovers.liveLeases} live lease row(s) after every worker stopped` }]
      : []),
    ...input.hungAtStop.map((slot) => ({ kind: "stop-hang" as const, detail: `w${slot} did not stop when asked and was killed` })),
    ...input.exits.filter((exit) => exit.cause === "crashed").map((exit) => ({
      kind: "crash" as const,
      detail: `w${exit.slot}.${exit.incarnation} exited on its own at ${iso(exit.at)} (code ${exit.code}, signal ${exit.signal}): ${exit.stderrTail.split("\n").slice(-3).join(" / ")}`
    }))
  ]

  const lossesByReason: Record<string, number> = {}
  const errorsByTag: Record<string, number> = {}
  const exitsByCause: Record<string, number> = {}
  let refusals = 0
  let acquireTimeouts = 0
  const acquired: Array<Stamped & { readonly e: "acquired" }> = []
  const releasedAt = new Map<string, number>()
  for (const event of input.events) {
    switch (event.e) {
      case "acquired":
        acquired.push(event)
        break
      case "released":
        releasedAt.set(event.acq, event.t)
        break
      case "lost":
        count(lossesByReason, event.reason)
        break
      case "refused":
        refusals++
        break
      case "timeout":
        acquireTimeouts++
        break
      case "error":
        count(errorsByTag, event.tag)
        break
    }
  }
  for (const exit of input.exits) count(exitsByCause, exit.cause)
  acquired.sort((a, b) => (BigInt(a.token) < BigInt(b.token) ? -1 : 1))
  const takeovers = countTakeovers(acquired, releasedAt)

  const faultsByKind = Object.fromEntries(FAULT_KINDS.map((kind) => {
    const outcomes = faultOutcomes.filter((o) => o.fault.kind === kind)
    const recovered = outcomes.filter((o) => o.status === "ok")
    const times = recovered.flatMap((o) => (o.recoveredAfterMs === undefined ? [] : [o.recoveredAfterMs]))
    return [kind, {
      injected: outcomes.filter((o) => o.status !== "skipped").length,
      skipped: outcomes.filter((o) => o.status === "skipped").length,
      recovered: recovered.length,
      worstRecoveryMs: times.length === 0 ? undefined : Math.max(...times),
      boundMs: outcomes[0]?.fault.boundMs
    }]
  })) as Record<FaultKind, KindSummary>

  const violationsByKind = Object.fromEntries(VIOLATION_KINDS.map((kind) => [kind, violations.filter((v) => v.kind === kind).length])) as Record<
    ViolationKind,
    number
  >

  return {
    rounds: input.writes.length,
    acquisitions: acquired.length,
    readerRounds: acquired.filter((a) => a.mode === "shared").length,
    readsJudged: shared.judged,
    takeovers,
    refusals,
    lossesByReason,
    errorsByTag,
    acquireTimeouts,
    exitsByCause,
    faultsByKind,
    faultOutcomes,
    violations,
    violationsByKind,
    commitTimes: input.writes.length === 0
      ? "no writes"
      : input.writes.every((row) => row.committedAt !== undefined)
      ? "commit timestamps"
      : "insert times (commit timestamps off)"
  }
}

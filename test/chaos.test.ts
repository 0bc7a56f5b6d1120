import { describe, expect, it } from "@effect/vitest"
import * as Fs from "node:fs"
import * as Os from "node:os"
import * as Path from "node:path"
import { check, type CheckInput, type CheckResult, type ViolationKind, type WriteRow } from "../chaos/checker.js"
import { FAULT_KINDS, type FaultRecord } from "../chaos/faults.js"
import type { WorkerExit } from "../chaos/fleet.js"
import { randomSeed } from "../chaos/prng.js"
import type { Backend, BrokenWorker, Stamped, WorkerEvent } from "../chaos/protocol.js"
import { renderMarkdown } from "../chaos/report.js"
import { DEFAULTS, runChaos } from "../chaos/run.js"

// --- the checker on hand-made logs ---------------------------------------------------------------

/**
 * A row committed at `at` (ms, this host's clock; the server's is the same), whose write began at
 * `began`. In these hand-made logs a worker's event order `n` is its time `t` unless a test says otherwise.
 */
const row = (seq: number, round: number, token: number, acquisition: string, at: number, began = at - 5): WriteRow => ({
  seq,
  round,
  worker: Number(acquisition.split(".")[0]),
  token: BigInt(token),
  acquisition,
  writtenAt: at - 0.6,
  committedAt: at + 0.4,
  beganAt: began,
  beganN: began
})

/** A log from before writes carried their begin. */
const unstamped = ({ beganAt: _at, beganN: _n, ...rest }: WriteRow): WriteRow => rest

const event = (t: number, w: number, e: WorkerEvent, n = t): Stamped => ({ ...e, t, w, i: 0, n })

/** One clean round: acquire, write, release. */
const round = (w: number, n: number, token: number, at: number, seq: number, roundNo: number) => {
  const acq = `${w}.0.${n}`
  return {
    row: row(seq, roundNo, token, acq, at + 50),
    events: [
      event(at, w, { e: "acquired", acq, token: String(token) }),
      event(at + 45, w, { e: "writing", acq, token: String(token), round: roundNo }),
      event(at + 51, w, { e: "wrote", acq, token: String(token), round: roundNo, seq: String(seq) }),
      event(at + 60, w, { e: "released", acq, token: String(token) })
    ]
  }
}

const kill: FaultRecord = {
  kind: "worker-kill",
  target: 3,
  detail: "SIGKILL w3",
  startedAt: 1_000,
  endedAt: 1_000,
  boundMs: 5_000,
  costsNoLock: false
}

/** Rounds 1–3 by w1, w2, w4, w3 killed at 1000 while waiting, w4's write at 1450 is the recovery. */
const cleanLog = (): CheckInput => {
  const rounds = [round(1, 1, 1, 100, 1, 1), round(2, 1, 2, 300, 2, 2), round(4, 1, 4, 1_400, 3, 3)]
  return {
    writes: rounds.map((r) => r.row),
    events: [...rounds.flatMap((r) => r.events), event(1_500, 3, { e: "refused", acq: "3.0.1", token: "3", current: "4" })],
    faults: [kill],
    leftovers: { advisoryLocks: 0, liveLeases: 0 },
    hungAtStop: [],
    exits: [],
    serverOffsetMs: 0,
    stoppedAt: 10_000
  }
}

const kinds = (input: CheckInput): Array<ViolationKind> => check(input).violations.map((v) => v.kind)

describe("chaos checker", () => {
  it("finds no violation in a clean log and counts rounds, refusals and the recovery", () => {
    const result = check(cleanLog())
    expect(result.violations).toEqual([])
    expect(result.rounds).toBe(3)
    expect(result.refusals).toBe(1)
    expect(result.takeovers).toBe(0)
    expect(result.faultOutcomes[0]).toMatchObject({ status: "ok", recoveredAfterMs: 450 })
    expect(result.commitTimes).toBe("commit timestamps")
  })

  it("flags a round written twice", () => {
    const log = cleanLog()
    const result = check({ ...log, writes: [...log.writes, row(4, 3, 5, "3.0.2", 1_500)] })
    expect(result.violations.map((v) => v.kind)).toEqual(["round-duplicate"])
    expect(result.violations[0]!.detail).toContain("round 3 written 2 times")
  })

  it("flags a token going backwards in commit order, and a token accepted twice", () => {
    const log = cleanLog()
    expect(kinds({ ...log, writes: [...log.writes, row(4, 4, 3, "3.0.2", 1_500)] })).toEqual(["token-order"])
    expect(kinds({ ...log, writes: [...log.writes, row(4, 4, 4, "4.0.1", 1_500)] })).toEqual(["token-order"])
  })

  // The guarantee (README): a write that began before the loss was reported has an unknown
  // outcome and is still fenced; a write begun after the report is a violation.
  describe("writes and a reported loss", () => {
    /** cleanLog with w2's write (round 2, token 2) begun at `began` and committed at `committed`, and w2's loss reported at `lost`. */
    const lostDuringWrite = (began: number, lost: number, committed: number, lostN = lost): CheckInput => {
      const log = cleanLog()
      return {
        ...log,
        writes: log.writes.map((r) => (r.round === 2 ? row(r.seq, 2, 2, "2.0.1", committed, began) : r)),
        events: [
          ...log.events.filter((e) => !(e.w === 2 && (e.e === "wrote" || e.e === "released"))),
          event(lost, 2, { e: "lost", acq: "2.0.1", token: "2", reason: "renewal-failed" }, lostN)
        ]
      }
    }

    it("allows a write begun before the loss was reported that committed 434 ms after it (in flight)", () => {
      // The failure of issue 21: the write was in flight on a frozen server when the holder reported the loss.
      const result = check(lostDuringWrite(340, 345, 345 + 434))
      expect(result.violations).toEqual([])
      expect(result.lossesByReason).toEqual({ "renewal-failed": 1 })
    })

    it("still holds a write in flight to the fence: committed after a newer token's write, it breaks token order", () => {
      // Committed after w4's write (token 4, committed at 1450.4) with token 2: accepted out of order.
      expect(kinds(lostDuringWrite(340, 345, 1_500))).toEqual(["token-order"])
    })

    it("flags a write begun 1 ms after its holder reported the loss", () => {
      const result = check(lostDuringWrite(346, 345, 400))
      expect(result.violations.map((v) => v.kind)).toEqual(["write-after-loss"])
      expect(result.violations[0]!.detail).toContain("seq 2 round 2 token 2 by 2.0.1 began at")
      expect(result.violations[0]!.detail).toContain("1 ms after w2 reported the loss (renewal-failed)")
    })

    it("orders a begin and a loss report of the same millisecond by the worker's own event order", () => {
      // Both stamped at 345: the report is the worker's event 7; the write began as event 8 (after) or 6 (before).
      const sameMs = (beganN: number) => {
        const input = lostDuringWrite(345, 345, 400, 7)
        return { ...input, writes: input.writes.map((r) => (r.round === 2 ? { ...r, beganN } : r)) }
      }
      expect(kinds(sameMs(8))).toEqual(["write-after-loss"])
      expect(check(sameMs(8)).violations[0]!.detail).toContain("0 ms after w2 reported the loss")
      expect(kinds(sameMs(6))).toEqual([])
    })

    it("judges a row without a begin stamp (an old log) by its commit: flagged after the report, not in the same millisecond", () => {
      const log = cleanLog()
      // w2's write (round 2) committed at 350.4; the loss was reported at 350 (same ms) or 349 (before).
      const lostAt = (t: number) => ({
        ...log,
        writes: log.writes.map(unstamped),
        events: [...log.events, event(t, 2, { e: "lost", acq: "2.0.1", token: "2", reason: "expired" })]
      })
      expect(kinds(lostAt(350))).toEqual([])
      const late = check(lostAt(349))
      expect(late.violations.map((v) => v.kind)).toEqual(["write-after-loss"])
      expect(late.violations[0]!.detail).toContain("1 ms after w2 reported the loss (expired)")
      expect(late.violations[0]!.detail).toContain("no begin stamp")
      expect(late.lossesByReason).toEqual({ expired: 1 })
    })
  })

  it("flags a fault not followed by an accepted write within its bound, unless the run stopped first", () => {
    const log = cleanLog()
    const noneAfter = { ...log, faults: [{ ...kill, startedAt: 2_000, endedAt: 2_000 }] }
    expect(check(noneAfter).faultOutcomes[0]!.status).toBe("none")
    expect(kinds(noneAfter)).toEqual(["no-recovery"])
    const late = { ...log, faults: [{ ...kill, boundMs: 400 }] }
    expect(check(late).faultOutcomes[0]).toMatchObject({ status: "late", recoveredAfterMs: 450 })
    expect(kinds(late)).toEqual(["no-recovery"])
    expect(kinds({ ...noneAfter, stoppedAt: 6_000 })).toEqual([])
    expect(kinds({ ...noneAfter, faults: [{ ...noneAfter.faults[0]!, skipped: "no server process" }] })).toEqual([])
  })

  it("flags a skipped round, a reported write missing from the log, locks left held, a hung stop and a crash", () => {
    const log = cleanLog()
    const crash: WorkerExit = { slot: 2, incarnation: 0, at: 900, code: 1, signal: null, cause: "crashed", stderrTail: "TypeError: boom" }
    const result = check({
      ...log,
      writes: log.writes.filter((r) => r.round !== 2),
      leftovers: { advisoryLocks: 1, liveLeases: 1 },
      hungAtStop: [4],
      exits: [crash, { ...crash, slot: 3, cause: "killed" }]
    })
    expect(result.violations.map((v) => v.kind).sort()).toEqual(
      ["crash", "left-held", "left-held", "round-skipped", "stop-hang", "write-missing"].sort()
    )
    expect(result.exitsByCause).toEqual({ crashed: 1, killed: 1 })
  })

  it("flags a loss caused by a fault that must cost no lock, not one that may", () => {
    const log = cleanLog()
    const saturation: FaultRecord = {
      kind: "pool-saturation",
      target: 2,
      holder: { slot: 2, incarnation: 0, acq: "2.0.1", token: 2n },
      detail: "w2's pool busy",
      startedAt: 320,
      endedAt: 1_300,
      boundMs: 5_000,
      costsNoLock: true
    }
    const lost = event(355, 2, { e: "lost", acq: "2.0.1", token: "2", reason: "renewal-failed" })
    const input = { ...log, faults: [saturation], events: [...log.events, lost] }
    const result = check(input)
    expect(result.violations.map((v) => v.kind)).toEqual(["needless-loss"])
    expect(result.violations[0]!.detail).toContain("holder 2.0.1 (token 2) reported LockLost (renewal-failed) 35 ms after it began")
    expect(result.violations[0]!.detail).toContain("the next grant (token 4) came 1045 ms after the loss")
    expect(kinds({ ...input, faults: [{ ...saturation, costsNoLock: false }] })).toEqual([])
    expect(kinds({ ...input, faults: [{ ...saturation, startedAt: 356 }] })).toEqual([])
  })

  it("counts a grant made before the previous holder released, or with no release at all, as a takeover", () => {
    const log = cleanLog()
    const events = log.events.filter((e) => !(e.e === "released" && e.acq === "2.0.1"))
    expect(check({ ...log, events }).takeovers).toBe(1)
    // w2 reports its release only after w4 (acquired at 1400) was granted.
    const late = [...events, event(1_401, 2, { e: "released", acq: "2.0.1", token: "2" })]
    expect(check({ ...log, events: late }).takeovers).toBe(1)
    const inTime = [...events, event(1_399, 2, { e: "released", acq: "2.0.1", token: "2" })]
    expect(check({ ...log, events: inTime }).takeovers).toBe(0)
  })

  // Readers (shared acquisitions) read the log twice; a write committed between the two reads
  // committed while the reader held. Rows carry their transaction's id, reads their snapshot.
  describe("readers and writers", () => {
    /** A reader's round: granted `shared` at `at`, its reads' snapshots, released unless `released` is false. */
    const reader = (w: number, n: number, token: number, at: number, snapshots: readonly [string, string], released = true) => {
      const acq = `${w}.0.${n}`
      return [
        event(at, w, { e: "acquired", acq, token: String(token), mode: "shared" }),
        event(at + 20, w, { e: "read", acq, token: String(token), which: 1, snapshot: snapshots[0], last: 0 }),
        event(at + 70, w, { e: "read", acq, token: String(token), which: 2, snapshot: snapshots[1], last: 0 }),
        ...(released ? [event(at + 80, w, { e: "released", acq, token: String(token) })] : [])
      ]
    }
    /** A writer's round as `round` makes it, its row written by transaction `xid`. */
    const writer = (w: number, n: number, token: number, at: number, seq: number, roundNo: number, xid: number) => {
      const r = round(w, n, token, at, seq, roundNo)
      return { row: { ...r.row, xid: BigInt(xid) }, events: r.events }
    }
    const input = (writes: ReadonlyArray<WriteRow>, events: ReadonlyArray<Stamped>): CheckInput => ({
      ...cleanLog(),
      writes,
      events,
      faults: []
    })

    /**
     * Reader w2 (token 3) granted at 200 and w4's write (round 2) at issue; `w4` says how w4's
     * round (acquired 230, writing 275, committed 280, transaction 102) ended and with which token.
     * w2's read 1 (220) saw only round 1 (transaction 101), its read 2 (290) saw round 2 too.
     */
    const overlap = (w4: { readonly token: number; readonly end: "released" | "lost" | "died" }) => {
      const first = writer(1, 1, 1, 100, 1, 1, 101)
      const acq = "4.0.1"
      const token = String(w4.token)
      const events = [
        ...first.events,
        event(200, 2, { e: "acquired", acq: "2.0.1", token: "3", mode: "shared" }),
        event(220, 2, { e: "read", acq: "2.0.1", token: "3", which: 1, snapshot: "102:102:", last: 1 }),
        event(230, 4, { e: "acquired", acq, token }),
        event(275, 4, { e: "writing", acq, token, round: 2 }),
        event(281, 4, { e: "wrote", acq, token, round: 2, seq: "2" }),
        ...(w4.end === "released" ? [event(285, 4, { e: "released", acq, token })] : []),
        ...(w4.end === "lost" ? [event(286, 4, { e: "lost", acq, token, reason: "expired" })] : []),
        event(290, 2, { e: "read", acq: "2.0.1", token: "3", which: 2, snapshot: "103:103:", last: 2 }),
        event(300, 2, { e: "released", acq: "2.0.1", token: "3" })
      ]
      return input([first.row, { ...row(2, 2, w4.token, acq, 280, 275), xid: 102n }], events)
    }

    it("finds nothing in a clean log of readers and writers, and counts reader rounds, reads judged and no takeover", () => {
      const w1 = writer(1, 1, 1, 100, 1, 1, 101)
      const w4 = writer(4, 1, 4, 400, 2, 2, 102)
      const w3 = writer(3, 2, 7, 800, 3, 3, 104)
      const events = [
        ...w1.events,
        // Two readers side by side after round 1: both saw transaction 101 only.
        ...reader(2, 1, 2, 200, ["102:102:", "102:102:"]),
        ...reader(3, 1, 3, 210, ["102:103:", "102:103:"]),
        ...w4.events,
        // After round 2; transaction 103 (not a round) in progress at read 1, done by read 2.
        ...reader(1, 2, 5, 500, ["103:104:103", "104:104:"]),
        ...reader(2, 2, 6, 510, ["103:104:103", "104:104:"]),
        ...w3.events
      ]
      const result = check(input([w1.row, w4.row, w3.row], events))
      expect(result.violations).toEqual([])
      expect(result.readerRounds).toBe(4)
      expect(result.readsJudged).toBe(4)
      expect(result.takeovers).toBe(0)
      expect(result.acquisitions).toBe(7)
    })

    it("flags a write between a reader's reads whose token is above the reader's: granted after it, while it held", () => {
      // w4 reported a loss afterwards: only its token convicts it.
      const result = check(overlap({ token: 4, end: "lost" }))
      expect(result.violations.map((v) => v.kind)).toEqual(["shared-overlap"])
      expect(result.violations[0]!.detail).toContain("reader 2.0.1 (token 3) saw seq 2 round 2 token 4 by 4.0.1 commit between its read 1 (snapshot 102:102:")
      expect(result.violations[0]!.detail).toContain("read 2 (snapshot 103:103:")
      expect(result.violations[0]!.detail).toContain("its token is above the reader's")
      expect(result.readsJudged).toBe(1)
    })

    it("flags a write between a reader's reads by an older holder that released normally: both held at once", () => {
      // w4's grant (token 2 here) came before the reader's (token 3); it never reported a loss.
      const result = check(overlap({ token: 2, end: "released" }))
      expect(result.violations.map((v) => v.kind)).toEqual(["shared-overlap"])
      expect(result.violations[0]!.detail).toContain("its holder never reported a loss and released normally")
      // Seen as in progress at read 1 (in xip, below xmax), committed by read 2.
      const inProgress = overlap({ token: 2, end: "released" })
      const events = inProgress.events.map((e) => (e.e === "read" && e.which === 1 ? { ...e, snapshot: "102:103:102" } : e))
      expect(kinds({ ...inProgress, events })).toEqual(["shared-overlap"])
    })

    it("allows the in-flight write of a stale holder (lower token, loss reported or process dead) between a reader's reads", () => {
      const lost = check(overlap({ token: 2, end: "lost" }))
      expect(lost.violations).toEqual([])
      expect(lost.readsJudged).toBe(1)
      expect(kinds(overlap({ token: 2, end: "died" }))).toEqual([])
    })

    it("does not judge a read 2 the reader printed after its own loss report, by its event order", () => {
      const lostAt = (n: number) => {
        const log = overlap({ token: 4, end: "lost" })
        // A reader that reported its loss prints no release.
        const events = log.events.filter((e) => !(e.e === "released" && e.acq === "2.0.1"))
        return { ...log, events: [...events, event(290, 2, { e: "lost", acq: "2.0.1", token: "3", reason: "expired" }, n)] }
      }
      // read 2 is w2's event 290: a report as event 289 (before it, same ms) voids it; as event 291 (after), it counts.
      const voided = check(lostAt(289))
      expect(voided.violations).toEqual([])
      expect(voided.readsJudged).toBe(0)
      expect(kinds(lostAt(291))).toEqual(["shared-overlap"])
    })
  })
})

// --- a shortened chaos run -------------------------------------------------------------------

/**
 * A run's logs go to a directory of its own, removed once its checks passed; a failing run keeps
 * it, and its message names the log file.
 */
const withLogDir = async (run: (logDir: string) => Promise<void>): Promise<void> => {
  const logDir = Fs.mkdtempSync(Path.join(Os.tmpdir(), "effect-lock-chaos-"))
  await run(logDir)
  Fs.rmSync(logDir, { recursive: true, force: true })
}

/**
 * No minimum time: the seed draws one deck (every kind once). The ttl is `npm run chaos`'s 2 s: at
 * 1 s a stall below the safe time (0.15–0.3 × ttl) left the holder's renewal 200–400 ms, and a
 * fresh-clone CI run, the deck's first fault landing as the workers started, lost the lease to it
 * ("needless-loss", renewal-failed 482 ms into a 262 ms stall). Every bound scales with the ttl.
 */
const DURATION_MS = 0
const TTL_MS = 2_000
/** A share of rounds that are readers': shared mode under the same faults, at no extra run time. */
const SHARED_CHANCE = 0.3

/**
 * The deck's seed: CHAOS_TEST_SEED when set (to replay a failure), else a new random one, printed
 * first and named in the failure. One deck per backend keeps the suite within its time budget;
 * `npm run chaos` runs the long, many-deck version.
 */
const deckSeed = (): number => {
  const fromEnv = process.env["CHAOS_TEST_SEED"]
  return fromEnv !== undefined && fromEnv !== "" ? Number(fromEnv) : randomSeed()
}

/** One set of workers per backend, one deck of faults. */
const shortRun = (backend: Backend) => withLogDir(async (logDir) => {
  const seed = deckSeed()
  console.log(
    `chaos ${backend}: seed ${seed} (re-run with CHAOS_TEST_SEED=${seed}, or npm run chaos -- --backend ${backend} --minutes 0 --ttl-ms ${TTL_MS} --shared ${SHARED_CHANCE} --seed ${seed})`
  )
  const lines: Array<string> = []
  const run = await runChaos({
    backends: [backend],
    durationMs: DURATION_MS,
    seed,
    workers: DEFAULTS.workers,
    ttlMs: TTL_MS,
    poolSize: DEFAULTS.poolSize,
    sharedChance: SHARED_CHANCE,
    logDir,
    log: (line) => lines.push(line)
  })
  const result = run.runs[0]!
  // Printed on failure: the seed replays the fault sequence, the report says what happened.
  const context = `chaos ${backend} seed ${seed} (CHAOS_TEST_SEED=${seed})\n${lines.join("\n")}\n\n${renderMarkdown(run)}`
  expect(result.check.violations, context).toEqual([])
  // Without a server of its own (DATABASE_URL; for redis, REDIS_URL) a run cannot restart or stop server processes.
  const ownServer = backend === "redis" ? run.redis?.embedded === true : run.server.embedded
  const allowedMissing: ReadonlyArray<string> = ownServer ? [] : ["db-restart", "server-freeze"]
  const injected = new Set(result.faults.filter((f) => f.skipped === undefined).map((f) => f.kind))
  expect(FAULT_KINDS.filter((kind) => !injected.has(kind) && !allowedMissing.includes(kind)), context).toEqual([])
  expect(result.check.rounds, context).toBeGreaterThan(7)
  // Readers ran and their reads were compared: the shared-overlap rule was not vacuous.
  expect(result.check.readerRounds, context).toBeGreaterThan(0)
  expect(result.check.readsJudged, context).toBeGreaterThan(0)
})

// --- the checker stays sharp on a real run ---------------------------------------------------

/**
 * Deliberately broken workers (protocol.ts `WorkerConfig.broken`): each blocks its event loop past
 * the lease's safe time in its first round, so it loses its lease, and after reporting the loss
 * writes on a daemon fiber outside the guard — what the library's stall watch and guard keep a
 * correct program from doing. No faults: the run stops after the first accepted write, which is
 * such a write. By hand: npm run chaos -- --backend pg-lease --minutes 0 --ttl-ms 1000 --broken write-after-loss --no-report
 */
const brokenRun = (broken: BrokenWorker, judge: (result: CheckResult, context: string) => void) => withLogDir(async (logDir) => {
  const seed = deckSeed()
  const lines: Array<string> = []
  const run = await runChaos({
    backends: ["pg-lease"],
    durationMs: 0,
    seed,
    workers: 2,
    ttlMs: TTL_MS,
    poolSize: DEFAULTS.poolSize,
    logDir,
    kinds: [],
    broken,
    log: (line) => lines.push(line)
  })
  judge(run.runs[0]!.check, `broken (${broken}) chaos pg-lease seed ${seed}\n${lines.join("\n")}\n\n${renderMarkdown(run)}`)
})

const writesAfterLoss = (result: CheckResult, context: string) => {
  const afterLoss = result.violations.filter((v) => v.kind === "write-after-loss")
  expect(afterLoss.length, context).toBeGreaterThan(0)
  // Judged by the stamp the worker put in the row, not by the commit time.
  for (const v of afterLoss) expect(v.detail, context).toMatch(/ began at .* after w\d reported the loss/)
}

// The backends run side by side (each its own server and workers): the file takes one deck's time.
describe.concurrent("npm run chaos, shortened", () => {
  // Redis's deck is not here: a third deck of worker processes beside these two slowed the whole
  // suite (the file alone went from 36 s to 52 s); `npm run chaos -- --backend redis` runs it.
  for (const backend of ["pg-advisory", "pg-lease"] as const) {
    it(
      `${backend}: every fault kind from a seeded deck, no violation`,
      { timeout: 240_000 },
      () => shortRun(backend)
    )
  }
  // Beside the decks (its own server and workers): the file takes one deck's time, not a deck's and this run's.
  it("pg-lease with a worker that writes after its loss: the checker reports write-after-loss", { timeout: 120_000 }, () => brokenRun("write-after-loss", writesAfterLoss))
})

/**
 * Interleaved rounds: every subject of a group is opened once, warmed up once, then measured
 * round-robin by blocks (round r starts at block r, so no block always runs first). A row and
 * its baselines form one block and run back to back, under the same background load, which is
 * what makes a ratio between them meaningful on a machine shared with other work.
 */

/** Which round a trial runs: the warm-up, or one that is measured. */
export interface Round {
  readonly warmup: boolean
}

/**
 * How long a warm-up lasts at least: until V8 has optimised the subject's hot paths. Measured with
 * rounds of 1 s after a 0.5 s warm-up, PgAdvisory and its raw floor alternating, each in its own
 * process (at 006b933): PgAdvisory's first round ran at 50–60 % of its steady rate, its second at
 * 85 %, and it was steady from its fourth second on; the raw pg loop was steady from its first.
 */
export const WARMUP_MS = 4_000

/** The length of a round lasting `ms` when measured. */
export const lengthOf = (round: Round, ms: number): number => (round.warmup ? Math.max(ms, WARMUP_MS) : ms)

/** One opened subject: `run` measures one round, `close` releases everything it opened. */
export interface Trial<R> {
  readonly run: (round: Round) => Promise<R>
  readonly close: () => Promise<void>
}

/** Something to measure. `open` may fail (a module not there yet, a peer not installed): then it is skipped. */
export interface Subject<R> {
  readonly id: string
  readonly open: () => Promise<Trial<R>>
  /** Run one unmeasured round first (default true). */
  readonly warmup?: boolean
  /**
   * Subjects of one block (a row and its baselines) always run back to back; blocks rotate.
   * Default: the subject is a block of its own.
   */
  readonly block?: string
}

export type Outcome<R> =
  | { readonly _tag: "Measured"; readonly rounds: ReadonlyArray<R> }
  | { readonly _tag: "Skipped"; readonly reason: string }

export interface InterleaveOptions {
  readonly rounds: number
  readonly log: (message: string) => void
  /** A label for progress lines. */
  readonly group: string
}

export const reasonOf = (error: unknown): string => {
  if (error instanceof Error) return error.message.split("\n")[0] ?? error.name
  if (typeof error === "object" && error !== null && "_tag" in error) {
    const tagged = error as { _tag: unknown; message?: unknown }
    return typeof tagged.message === "string" && tagged.message !== "" ? `${String(tagged._tag)}: ${tagged.message}` : String(tagged._tag)
  }
  return String(error)
}

interface Open<R> {
  readonly subject: Subject<R>
  readonly trial: Trial<R>
  readonly rounds: Array<R>
  failed: string | undefined
}

const toBlocks = <R>(entries: ReadonlyArray<Open<R>>): Array<Array<Open<R>>> => {
  const blocks = new Map<string, Array<Open<R>>>()
  for (const entry of entries) {
    const key = entry.subject.block ?? `subject:${entry.subject.id}`
    const block = blocks.get(key)
    if (block === undefined) blocks.set(key, [entry])
    else block.push(entry)
  }
  return Array.from(blocks.values())
}

export const interleave = async <R>(
  subjects: ReadonlyArray<Subject<R>>,
  options: InterleaveOptions
): Promise<Map<string, Outcome<R>>> => {
  const outcomes = new Map<string, Outcome<R>>()
  const open: Array<Open<R>> = []
  try {
    for (const subject of subjects) {
      try {
        open.push({ subject, trial: await subject.open(), rounds: [], failed: undefined })
      } catch (error) {
        options.log(`  ${options.group}: ${subject.id} skipped: ${reasonOf(error)}`)
        outcomes.set(subject.id, { _tag: "Skipped", reason: reasonOf(error) })
      }
    }
    const attempt = async (entry: Open<R>, what: string): Promise<R | undefined> => {
      if (entry.failed !== undefined) return undefined
      try {
        return await entry.trial.run({ warmup: what === "warm-up" })
      } catch (error) {
        entry.failed = `failed during ${what}: ${reasonOf(error)}`
        options.log(`  ${options.group}: ${entry.subject.id} ${entry.failed}`)
        return undefined
      }
    }
    for (const entry of open) {
      if (entry.subject.warmup !== false) await attempt(entry, "warm-up")
    }
    const blocks = toBlocks(open)
    for (let round = 0; round < options.rounds; round++) {
      for (let i = 0; i < blocks.length; i++) {
        const block = blocks[(i + round) % blocks.length]!
        // Within a block the order flips every round, so neither the row nor its baseline
        // always runs first after a switch.
        for (const entry of round % 2 === 0 ? block : [...block].reverse()) {
          const result = await attempt(entry, `round ${round + 1}`)
          if (result !== undefined) entry.rounds.push(result)
        }
      }
      options.log(`  ${options.group}: round ${round + 1}/${options.rounds} done`)
    }
  } finally {
    for (const entry of open) {
      await entry.trial.close().catch((error: unknown) => {
        options.log(`  ${options.group}: closing ${entry.subject.id} failed: ${reasonOf(error)}`)
      })
      outcomes.set(
        entry.subject.id,
        entry.failed !== undefined
          ? { _tag: "Skipped", reason: entry.failed }
          : { _tag: "Measured", rounds: entry.rounds }
      )
    }
  }
  return outcomes
}

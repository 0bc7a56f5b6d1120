/**
 * `npx tsx --import ./bench/lib/built.mjs bench/handoffTimeline.ts [--seconds=S] [--rounds=R]`
 *
 * Where a Redis handoff's time goes: the bench's handoff rows (`scenarios/redis.ts`: 8
 * contenders on one name, hold 1 ms; RedisLease with 8 layers in this process, and raw ioredis
 * sending RedisLease's scripts), each handoff cut into the moments this process sees:
 *
 *   releasing → release sent → release's reply → wake-up message → waiter's acquire sent →
 *   its reply → granted
 *
 * or, when the release handed the lease over: release's reply → handover message → granted.
 *
 * "releasing" and "granted" are the bench recorder's; the sends are ioredis `sendCommand` calls
 * of the acquire and release scripts (EVALSHA/EVAL); a reply is ioredis resolving that command;
 * the message is a subscriber's `message` event naming the waiter that is granted next. A
 * moment is when this process's JavaScript ran, so a stage also holds whatever else the thread
 * did meanwhile (the releaser's own next acquire, other contenders' replies). Medians over every
 * handoff matched, rounds alternating raw and library. Needs a redis-server (see
 * `tools/redisServer.ts`, or REDIS_URL).
 */
import * as Crypto from "node:crypto"
import { createRequire } from "node:module"
import * as Scripts from "../src/internal/redis/scripts.js"
import { redisAvailable, startRedis } from "../tools/redisServer.js"
import { Recorder } from "./lib/handoff.js"
import { runMain } from "./lib/postgres.js"
import { now } from "./lib/timing.js"
import { handoffSpecs } from "./scenarios/redis.js"

const arg = (name: string): string | undefined => process.argv.find((a) => a.startsWith(`--${name}=`))?.slice(name.length + 3)
const seconds = Number(arg("seconds") ?? "2")
const rounds = Number(arg("rounds") ?? "3")

type Kind = "acquireSent" | "acquireReply" | "releaseSent" | "releaseReply" | "message" | "handed" | "releasing" | "granted"
/** One moment: its kind, when, and whose (the waiter's place of an acquire or message, the owner of a release; a contender's index). */
interface Moment {
  readonly kind: Kind
  readonly at: number
  readonly id: string
}

/** Moments of the round being measured; undefined while nothing is measured. */
let recording: Array<Moment> | undefined
const mark = (kind: Kind, id: string) => recording?.push({ kind, at: now(), id })

const sha1 = (text: string) => Crypto.createHash("sha1").update(text).digest("hex")
const ACQUIRE = sha1(Scripts.acquire)
const RELEASE = sha1(Scripts.release)

interface Command {
  readonly name: string
  readonly args: ReadonlyArray<unknown>
  resolve: (value: unknown) => void
}

/** Both copies of ioredis: the library's (the root's node_modules) and the bench's raw rows' (bench/node_modules). */
const copies = [createRequire(new URL("../package.json", import.meta.url))("ioredis"), createRequire(new URL("./package.json", import.meta.url))("ioredis")]
for (const proto of new Set(copies.map((m: { Redis: { prototype: object } }) => m.Redis.prototype))) {
  const target = proto as { sendCommand: (command: Command, ...rest: Array<unknown>) => unknown; emit: (event: string, ...rest: Array<unknown>) => boolean }
  const send = target.sendCommand
  target.sendCommand = function(this: unknown, command: Command, ...rest: Array<unknown>) {
    const script = recording !== undefined && (command.name === "evalsha" || command.name === "eval") ? String(command.args[0]) : ""
    const which = script === ACQUIRE || script === Scripts.acquire ? "acquire" : script === RELEASE || script === Scripts.release ? "release" : undefined
    if (which !== undefined) {
      // ARGV after the keys: acquire's 3rd is its waiter's place, release's 2nd its owner.
      const keys = Number(command.args[1])
      const id = String(command.args[2 + keys + (which === "acquire" ? 2 : 1)])
      mark(which === "acquire" ? "acquireSent" : "releaseSent", id)
      const resolve = command.resolve
      command.resolve = (value: unknown) => {
        mark(which === "acquire" ? "acquireReply" : "releaseReply", id)
        resolve(value)
      }
    }
    return send.call(this, command, ...rest)
  }
  const emit = target.emit
  target.emit = function(this: unknown, event: string, ...rest: Array<unknown>) {
    // A wake-up is `w<place>`; a handover `h<place>:<token>:<expiry>`.
    if (event === "message") {
      const payload = String(rest[1])
      mark(payload.startsWith("h") ? "handed" : "message", payload.slice(1).split(":")[0]!)
    }
    return emit.call(this, event, ...rest)
  }
}
const releasing = Recorder.prototype.releasing
Recorder.prototype.releasing = function(this: Recorder, who: number) {
  mark("releasing", String(who))
  releasing.call(this, who)
}
const granted = Recorder.prototype.granted
Recorder.prototype.granted = function(this: Recorder, who: number) {
  mark("granted", String(who))
  granted.call(this, who)
}

const STAGES = [
  "releasing → release sent",
  "release sent → its reply",
  "its reply → wake-up heard",
  "wake-up → acquire sent",
  "acquire sent → its reply",
  "its reply → granted",
  "its reply → handover heard",
  "handover heard → granted",
  "handoff",
  "(release's reply → another acquire sent before the wake-up)"
] as const
type Stages = Record<(typeof STAGES)[number], Array<number>>

const us = (from: Moment, to: Moment) => (to.at - from.at) * 1000

/** Each handoff of the round (releasing, then a grant to another contender) cut into its stages, in µs. */
const cut = (moments: ReadonlyArray<Moment>, into: Stages, wakeFirst: [number]) => {
  for (let i = 0; i < moments.length; i++) {
    const start = moments[i]!
    if (start.kind !== "releasing") continue
    const end = moments.findIndex((m, j) => j > i && m.kind === "granted")
    if (end < 0 || moments[end]!.id === start.id) continue
    const granted = moments[end]!
    const between = moments.slice(i + 1, end)
    const sent = between.find((m) => m.kind === "releaseSent")
    if (sent === undefined) continue
    const reply = moments.find((m, j) => j > i && m.kind === "releaseReply" && m.id === sent.id)
    // Handed over by the release: granted from the message (its first copy read), no attempt.
    const handed = between.find((m) => m.kind === "handed" && m.at > sent.at)
    const replies = between.filter((m) => m.kind === "acquireReply")
    const lastReply = replies[replies.length - 1]
    // Else the grant's own attempt (the last one of its request sent before that reply), and the
    // first copy read of the wake-up that named its place (each layer's subscriber gets one).
    const acquireSent = lastReply === undefined
      ? undefined
      : between.filter((m) => m.kind === "acquireSent" && m.id === lastReply.id && m.at < lastReply.at).pop()
    const message = handed ?? (lastReply === undefined ? undefined : between.find((m) => m.kind === "message" && m.id === lastReply.id && m.at > sent.at))
    if (reply === undefined || message === undefined || (handed === undefined && (acquireSent === undefined || lastReply === undefined))) continue
    // Read before the release's own reply: counted apart, not cut into the stages below.
    if (reply.at > message.at) {
      wakeFirst[0]++
      continue
    }
    into["releasing → release sent"].push(us(start, sent))
    into["release sent → its reply"].push(us(sent, reply))
    if (handed !== undefined) {
      into["its reply → handover heard"].push(us(reply, handed))
      into["handover heard → granted"].push(us(handed, granted))
    } else {
      into["its reply → wake-up heard"].push(us(reply, message))
      into["wake-up → acquire sent"].push(us(message, acquireSent!))
      into["acquire sent → its reply"].push(us(acquireSent!, lastReply!))
      into["its reply → granted"].push(us(lastReply!, granted))
    }
    into.handoff.push(us(start, granted))
    // The releaser's own next acquire, when the thread sent it before it read the message.
    const other = moments.find((m) => m.kind === "acquireSent" && m.at > reply.at && m.at < message.at)
    if (other !== undefined) into["(release's reply → another acquire sent before the wake-up)"].push(us(reply, other))
  }
}

const median = (values: ReadonlyArray<number>) => {
  const sorted = [...values].sort((a, b) => a - b)
  return sorted.length === 0 ? Number.NaN : sorted[Math.floor(sorted.length / 2)]!
}

runMain(async () => {
  if (!redisAvailable()) {
    console.log("skipped: no redis-server on the PATH and no REDIS_URL")
    return
  }
  const redis = await startRedis()
  try {
    const specs = handoffSpecs({ url: redis.url }, seconds * 1000, true)
    const rows = [
      { label: "raw ioredis", spec: specs.find((s) => s.id === "raw")! },
      { label: "RedisLease, 8 layers", spec: specs.find((s) => s.id === "redis-lease-8")! }
    ]
    const opened = []
    for (const row of rows) opened.push(await row.spec.subject.open())
    const stages = rows.map(() => Object.fromEntries(STAGES.map((s) => [s, [] as Array<number>])) as Stages)
    const handoffs = rows.map(() => 0)
    const wakeFirst = rows.map((): [number] => [0])
    try {
      // A warm-up round each, then alternating measured rounds.
      for (const subject of opened) await subject.run({ warmup: true })
      for (let round = 1; round <= rounds; round++) {
        for (const [i, subject] of opened.entries()) {
          recording = []
          const result = await subject.run({ warmup: false })
          const moments = recording
          recording = undefined
          cut(moments, stages[i]!, wakeFirst[i]!)
          handoffs[i] += result.handoffs
        }
      }
    } finally {
      for (const subject of opened) await subject.close()
    }
    console.log(`Redis handoff, ${rounds} rounds of ${seconds} s, medians in µs (handoffs matched / counted by the recorder)`)
    console.log(`| stage | ${rows.map((r) => r.label).join(" | ")} |`)
    console.log(`|---|${rows.map(() => "---:").join("|")}|`)
    for (const stage of STAGES) console.log(`| ${stage} | ${stages.map((s) => median(s[stage]).toFixed(0)).join(" | ")} |`)
    console.log(`| matched | ${stages.map((s, i) => `${s.handoff.length} / ${handoffs[i]}`).join(" | ")} |`)
    console.log(`| handoffs whose wake-up was read before the release's reply (not cut) | ${wakeFirst.map((w) => w[0]).join(" | ")} |`)
    const early = "(release's reply → another acquire sent before the wake-up)" as const
    console.log(`| handoffs with such an acquire | ${stages.map((s) => `${Math.round((100 * s[early].length) / Math.max(1, s.handoff.length))} %`).join(" | ")} |`)
  } finally {
    await redis.stop()
  }
})

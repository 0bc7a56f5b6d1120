/**
 * The Lua scripts of RedisLease: one script per operation, each over the keys of ONE name (one
 * hash slot, `keys.ts`), run with EVALSHA (EVAL when the server answers NOSCRIPT, `lane.ts`).
 *
 * **Time.** Every script reads the server's clock (`TIME`) and nothing else: the client's clock
 * never reaches the keys. A script that reads `TIME` and then writes needs script effects
 * replication (Redis ≥ 5 can, Redis 7 only does that): `redis.replicate_commands()` is called
 * where it exists, so Redis 3.2–6 replicate the effects too.
 *
 * **Fencing tokens.** `token = max(last + 1, serverMicros)`, where `last` is the name's last
 * token (a field of its lease hash, while the name's keys exist) and `serverMicros` is `TIME` in
 * microseconds (about 1.8e15 today: below 2^53, so exact in Lua's doubles and in the JSON/string
 * forms below, always formatted with `%.0f`). Why it strictly increases, even after the name's
 * keys expired while idle and after a restart that lost every key (no persistence):
 * - While the keys exist, `last + 1` alone makes it increase.
 * - Every grant is a script execution, and two scripts never run within the same microsecond on
 *   one server (each takes microseconds): so a token is at most its grant's `serverMicros` (plus
 *   the grants crowded into one microsecond, in practice none).
 * - The lease hash holding `last` lives until the server's clock is past `last` in µs: the
 *   lease's expiry while it is held (at least its ttl, ≥ 1 s, past the latest grant or renewal);
 *   once a release leaves the name with no holder and no waiter, `last / 1000 + 2` ms (`release`).
 *   By the time it is gone, `serverMicros` is past every token ever granted for the name.
 * - A restart without persistence loses `last` too, but not the clock: the same argument holds.
 * What breaks it is the server's clock stepping back by more than the time since the last grant
 * (an NTP step; a failover to a replica whose clock is behind): a replica promoted with a clock
 * behind by D can grant a token already granted within the last D (if its copy of `last` was
 * lost or never replicated: asynchronous replication can lose the last writes). README material:
 * keep the servers' clocks synchronised (slewed, not stepped), and see `WAIT` (phase 2) for
 * replication before a grant is answered.
 *
 * **Waiting order** (as PgLease's `acquire`, `lease/pg/sql`): a request with no live waiter ahead
 * of it — for an exclusive request any waiter, for a shared one an exclusive waiter — takes the
 * lock if the lease allows; otherwise a request that waits takes (or keeps, writing it again once
 * at most 4/5 of its time is left) its place at the back of the queue, and learns how long until
 * something could change without a wake-up. Places are scored `max(lastScore + 1, serverMicros)`:
 * arrival order, and never below a place still queued even if the queue's keys had expired. A
 * place that ran out (its waiter died) is dropped when a script walks past it; its waiter, if
 * alive after all, queues again at the back.
 *
 * **Answers.** Lua `false` is a nil reply; numbers are integer replies; tokens are strings.
 */

import { PLACE_REFRESH_BELOW, PLACE_TTL_MILLIS } from "../lease/place.js"

/** Helpers every script starts with: the server's time, and keeping a key alive until a moment. */
export const prelude = `
if redis.replicate_commands then pcall(redis.replicate_commands) end
local clock = redis.call('TIME')
local nowMs = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local nowUs = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local function fmt(x) return string.format('%.0f', x) end
-- Extends the key's life to at least the moment at (ms since the epoch); never shortens it.
local function keepUntil(key, at)
  local left = redis.call('PTTL', key)
  if left == -2 then return end
  if left < 0 or nowMs + left < at then redis.call('PEXPIREAT', key, fmt(at)) end
end
local function num(x) if x then return tonumber(x) or 0 end return 0 end
`

/**
 * A place written within this many ms is a live waiter's (a waiter writes its place again at
 * least every 1.5 s, `lease/place`): a release hands such a head the lease. An older place may
 * be a crashed waiter's, which would keep a handed lease for a whole ttl: it is woken instead.
 */
const FRESH_MS = PLACE_TTL_MILLIS / 2

/** Reading the shared holders and the queue of one name (KEYS: lease, queue, places, shared). */
const lockHelpers = `
local leaseKey, queueKey, placesKey, sharedKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
-- The live shared holders: how many, and when the last of them runs out. Only read when the
-- bound of their leases (suntil) is still ahead: otherwise none can be live.
local function liveShared()
  if num(redis.call('HGET', leaseKey, 'suntil')) <= nowMs then return 0, 0 end
  local all = redis.call('HGETALL', sharedKey)
  local n, last = 0, 0
  for i = 2, #all, 2 do
    local e = cjson.decode(all[i])
    if e.expires > nowMs then
      n = n + 1
      if e.expires > last then last = e.expires end
    end
  end
  return n, last
end
local function placeOf(id)
  local raw = redis.call('HGET', placesKey, id)
  if raw then return cjson.decode(raw) end
  return nil
end
-- Written in the last FRESH_MS: a live waiter's (it writes its place again at least every 1.5 s).
local function recent(p) return p.expires > nowMs + ${PLACE_TTL_MILLIS - FRESH_MS} end
local function dropPlace(id)
  redis.call('ZREM', queueKey, id)
  redis.call('HDEL', placesKey, id)
end
`

/** Places an attempt reads from the queue at a time. */
const AHEAD_CHUNK = 128
/** How many live places at the head a release looks at to find whom to wake. */
const HEAD_CANDIDATES = 16
/** Places a release reads at a time from the front of the queue. */
const HEAD_SCAN = HEAD_CANDIDATES * 4
/** Dead places one release (or attempt) drops at most while looking for a live place (the rest, the next one). */
const MAX_DEAD_SCAN = 1_024
/** Dead places at the front an attempt behind a live exclusive lease drops at most. */
const DEAD_FRONT_DROP = 64
/** How many places behind 16 shared heads a release looks at for shared ones to wake (the rest retry within 1.5 s). */
const SHARED_BEHIND_MAX = 1_024
/** How many waiters behind a head that may be dead a release wakes at most (up to the first surely waiting). */
const BEHIND_STALE = HEAD_CANDIDATES

/**
 * One grant attempt.
 * KEYS: lease, queue, places, shared.
 * ARGV: 1 name, 2 owner, 3 waiter, 4 mode, 5 ttl ms, 6 place ms, 7 application, 8 host, 9 pid, 10 take a place ("1"/"0"),
 * 11 "0" for a place a release never hands the lease to (absent: it may).
 * Answer: { token (string) | nil, wait (ms) | nil, handed (1 | nil), left (ms) | nil, now (ms) }:
 * `handed` when the token is of a lease a release handed to this request's place, `left` what
 * it still has; `now` the server's clock, always (a waiter times a handed lease by it, `lease/handover`).
 */
export const acquire = `${prelude}${lockHelpers}
local name, owner, waiter, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ttl, placeMs = tonumber(ARGV[5]), tonumber(ARGV[6])
local application, host, pid, takePlace = ARGV[7], ARGV[8], ARGV[9], ARGV[10] == '1'
-- A place without its ttl is woken, never handed the lease (its layer WAITs for each grant).
local placeTtl = ttl
if ARGV[11] == '0' then placeTtl = nil end

local h = redis.call('HMGET', leaseKey, 'owner', 'expires', 'last', 'token')
local holderExpires = num(h[2])
local exclusiveLive = h[1] and holderExpires > nowMs
local last = num(h[3])

-- A lease a release handed to this request's place (see \`release\`): it holds it already. A place
-- an attempt that missed the handover took again goes.
if exclusiveLive and h[1] == waiter then
  dropPlace(waiter)
  return { h[4], false, 1, holderExpires - nowMs, nowMs }
end
-- Handed to this place and run out before the waiter heard (a lost wake-up, a short ttl): its
-- turn still, ahead of the places behind it.
local handedOut = h[1] == waiter
if mode == 'shared' then
  -- A shared lease a release handed to this request's place: it holds it already, and never
  -- takes a second beside it. Run out unheard: its turn still, as above.
  local raw = redis.call('HGET', sharedKey, waiter)
  if raw then
    local e = cjson.decode(raw)
    if e.expires > nowMs then
      dropPlace(waiter)
      return { e.token, false, 1, e.expires - nowMs, nowMs }
    end
    redis.call('HDEL', sharedKey, waiter)
    handedOut = true
  end
end

-- This request's place, if it is still live (a place that ran out lost its position).
local mine = placeOf(waiter)
local myScore = nil
if mine and mine.expires > nowMs then
  myScore = redis.call('ZSCORE', queueKey, waiter)
  if myScore then myScore = tonumber(myScore) else mine = nil end
else
  mine = nil
end

-- The first live place ahead that this request must not overtake: any for an exclusive request,
-- an exclusive one for a shared request. Only it matters: while it lives this request waits, and
-- a place behind it running out changes nothing (a release that wakes a head which may be dead
-- wakes those behind it too, \`release\`). Places that ran out are dropped on the way, at most
-- MAX_DEAD_SCAN per attempt of a waiting request: past that it cannot know what is ahead, and
-- tries again at once (each attempt bounded, the backlog shrinking).
-- While an exclusive lease is live nothing ahead matters either: this request cannot be granted,
-- and learns of the release by a wake-up or by the lease's expiry (its wait). Only the dead
-- places at the front go (at most DEAD_FRONT_DROP), so that none pile up during a long hold; the
-- rest of the queue is not read (N waiters behind a holder retrying would read O(N) places each).
local aheadUntil = nil
if exclusiveLive then
  -- The first place read alone: behind a holder it is almost always live.
  local first = redis.call('ZRANGE', queueKey, 0, 0)[1]
  local p = first and placeOf(first)
  if first and not (p and p.expires > nowMs) then
    dropPlace(first)
    for _, id in ipairs(redis.call('ZRANGE', queueKey, 0, ${DEAD_FRONT_DROP - 2})) do
      local q = placeOf(id)
      if q and q.expires > nowMs then break end
      dropPlace(id)
    end
  end
else
  -- Read in chunks: a shared request reads on past shared places for an exclusive one, up to
  -- the first. \`offset\` counts the places kept before the next unread one (a dropped place
  -- shifts those after it down by one).
  local offset, dropped = 0, 0
  repeat
    local members
    if myScore then
      members = redis.call('ZRANGEBYSCORE', queueKey, '-inf', '(' .. fmt(myScore), 'LIMIT', offset, ${AHEAD_CHUNK})
    else
      members = redis.call('ZRANGE', queueKey, offset, offset + ${AHEAD_CHUNK - 1})
    end
    for _, id in ipairs(members) do
      offset = offset + 1
      if id ~= waiter then
        local p = placeOf(id)
        if not p or p.expires <= nowMs then
          dropPlace(id)
          offset = offset - 1
          dropped = dropped + 1
          -- Not read to the end: something may be ahead; a waiting request tries again at once. A
          -- try has no next attempt: it reads on (a free lock is granted to a try).
          if dropped >= ${MAX_DEAD_SCAN} and takePlace then aheadUntil = nowMs break end
        elseif mode == 'exclusive' or p.mode == 'exclusive' then
          aheadUntil = p.expires
          break
        end
      end
    end
  until aheadUntil or #members < ${AHEAD_CHUNK}
end

local sharedCount, sharedUntil = 0, 0
if mode == 'exclusive' and not exclusiveLive then sharedCount, sharedUntil = liveShared() end

if (not aheadUntil or handedOut) and not exclusiveLive and (mode == 'shared' or sharedCount == 0) then
  local token = math.max(last + 1, nowUs)
  local expires = nowMs + ttl
  if mode == 'exclusive' then
    redis.call('HSET', leaseKey, 'name', name, 'owner', owner, 'token', fmt(token), 'last', fmt(token),
      'expires', fmt(expires), 'acquired', fmt(nowMs), 'application', application, 'host', host, 'pid', pid)
    -- No shared holder is live (checked above): their entries and bound go.
    redis.call('HDEL', leaseKey, 'suntil')
    redis.call('DEL', sharedKey)
  else
    redis.call('HDEL', leaseKey, 'owner', 'token', 'expires', 'acquired', 'application', 'host', 'pid')
    local bound = math.max(num(redis.call('HGET', leaseKey, 'suntil')), expires)
    redis.call('HSET', leaseKey, 'name', name, 'last', fmt(token), 'suntil', fmt(bound))
    redis.call('HSET', sharedKey, owner, cjson.encode({ token = fmt(token), expires = expires, acquired = nowMs,
      application = application, host = host, pid = pid }))
    keepUntil(sharedKey, expires)
  end
  keepUntil(leaseKey, expires)
  dropPlace(waiter)
  return { fmt(token), false, false, false, nowMs }
end

if takePlace then
  local placeUntil = nowMs + placeMs
  if mine then
    -- Kept: written again once at most 4/5 of its time is left (lease/place).
    if mine.expires <= nowMs + placeMs * ${PLACE_REFRESH_BELOW} then
      mine.expires = placeUntil
      mine.ttl = placeTtl
      redis.call('HSET', placesKey, waiter, cjson.encode(mine))
      keepUntil(placesKey, placeUntil)
      keepUntil(queueKey, placeUntil)
    end
  else
    local tail = redis.call('ZRANGE', queueKey, -1, -1, 'WITHSCORES')
    local score = nowUs
    if tail[2] then score = math.max(score, tonumber(tail[2]) + 1) end
    redis.call('ZADD', queueKey, fmt(score), waiter)
    -- ttl: the lease a release hands this place (none on a place of a version before the handover).
    redis.call('HSET', placesKey, waiter, cjson.encode({ mode = mode, expires = placeUntil, since = nowMs,
      application = application, host = host, pid = pid, ttl = placeTtl }))
    keepUntil(placesKey, placeUntil)
    keepUntil(queueKey, placeUntil)
  end
end

-- Until something could change without a wake-up: the holder's lease, the shared holders' (for
-- an exclusive request), or a place ahead running out.
local changeAt = nil
if exclusiveLive then changeAt = holderExpires end
if sharedCount > 0 and (not changeAt or sharedUntil < changeAt) then changeAt = sharedUntil end
if aheadUntil and (not changeAt or aheadUntil < changeAt) then changeAt = aheadUntil end
if changeAt then return { false, math.max(0, changeAt - nowMs), false, false, nowMs } end
return { false, false, false, false, nowMs }
`

/**
 * Gives back what one request holds of a name: the exclusive lease of `owner` (or of `waiter`: a
 * lease a release handed to its place), its shared lease, and the place of `waiter` (or of
 * `owner`: a handed holder's place, taken again by an attempt that missed the handover) — all
 * owner-scoped.
 *
 * When it frees an exclusive lease and the waiters at the head surely wait (each place written
 * in the last `FRESH_MS`, by a version that records its ttl), the lease is **handed over** in this
 * script: to the oldest place when it is exclusive, else a shared lease to every shared place
 * ahead of the first exclusive one (at most `HEAD_CANDIDATES`). Each place becomes a holder
 * (`owner` = its id, or its id's entry among the shared holders; a token as a grant's, its own
 * ttl from now), its place goes, and `h<place>:<token>:<expiry ms>` is published: the waiter
 * holds the lease with no command of its own. Otherwise, when this frees the lock (or leaves a
 * place while no exclusive lease is live), the same waiters are woken on the channel (`w<place>`).
 * With `HEAD_CANDIDATES` shared heads, the shared places right behind them (up to the first
 * exclusive one, among at most `SHARED_BEHIND_MAX` places) fit as well and are woken too (`w<place>`).
 * KEYS: lease, queue, places, shared. ARGV: 1 name, 2 owner ('' for none), 3 waiter ('' for none), 4 channel.
 * Answer: { released (0/1), woken (count) }.
 */
export const release = `${prelude}${lockHelpers}
local name, owner, waiter, channel = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local released, freed, held = 0, false, false
local holder = redis.call('HGET', leaseKey, 'owner')
-- By owner, or by place: a leave racing the handover to its own place frees what it was handed.
if holder and ((owner ~= '' and holder == owner) or (waiter ~= '' and holder == waiter)) then
  redis.call('HDEL', leaseKey, 'owner', 'token', 'expires', 'acquired', 'application', 'host', 'pid')
  released, freed, held = 1, true, true
  -- A handed holder's place, taken again by an attempt that missed the handover.
  if holder == owner and redis.call('ZREM', queueKey, owner) == 1 then redis.call('HDEL', placesKey, owner) end
end
-- The shared lease of the owner, or of the place (handed to it, the leave racing the handover).
local sharedGone = false
for _, id in ipairs({ owner, waiter }) do
  if id ~= '' and redis.call('HDEL', sharedKey, id) == 1 then sharedGone = true end
end
-- The shared holders left live, read once: whether this frees the lock, whom a wake-up may serve,
-- whether the name is idle.
local sharedLive = liveShared()
if sharedGone then
  released = 1
  if sharedLive == 0 then
    redis.call('HDEL', leaseKey, 'suntil')
    freed = true
  end
end
if waiter ~= '' and redis.call('ZREM', queueKey, waiter) == 1 then
  redis.call('HDEL', placesKey, waiter)
  local h = redis.call('HMGET', leaseKey, 'owner', 'expires')
  if not (h[1] and num(h[2]) > nowMs) then freed = true end
elseif waiter ~= '' then
  redis.call('HDEL', placesKey, waiter)
end
local woken, handed = 0, false
if freed then
  -- The live places at the head: the oldest, and the shared ones right behind it until the first
  -- exclusive. Each surely waits when its place was written in the last FRESH_MS with its ttl.
  -- Beside live shared holders (a waiter's leave frees nothing of theirs) an exclusive head does not fit.
  local heads, allFresh, anyStale, dropped, done = {}, true, false, 0, false
  -- Past every dead place at the front, however many ran out since the live head's last retry
  -- (a crashed process's waiters): the scan goes on while it finds none alive, bounded.
  repeat
    local ids = redis.call('ZRANGE', queueKey, 0, ${HEAD_SCAN - 1})
    for _, id in ipairs(ids) do
      local p = placeOf(id)
      if not p or p.expires <= nowMs then
        dropPlace(id)
        dropped = dropped + 1
      else
        if p.mode == 'exclusive' and (#heads > 0 or sharedLive > 0) then done = true break end
        table.insert(heads, { id = id, p = p })
        if not (p.ttl and recent(p)) then allFresh = false end
        if not recent(p) then anyStale = true end
        if p.mode == 'exclusive' or #heads >= ${HEAD_CANDIDATES} then done = true break end
      end
    end
  until done or #heads > 0 or #ids < ${HEAD_SCAN} or dropped >= ${MAX_DEAD_SCAN}
  if held and #heads > 0 and allFresh then
    -- Handed over: each head's place holds a lease from now on, as a grant of its own would: the
    -- exclusive head the lease, or every shared head a shared lease (no shared lease is live: the
    -- freed exclusive one's grant deleted them), tokens drawn one after another. The keys outlive
    -- the handed leases by a place's time: a waiter that did not hear of its lease before it ran
    -- out finds it at its next attempt (at most 1.5 s apart) and keeps its turn.
    handed = true
    local last = num(redis.call('HGET', leaseKey, 'last'))
    local bound = 0
    for _, head in ipairs(heads) do
      local id, p = head.id, head.p
      local token = math.max(last + 1, nowUs)
      last = token
      local expires = nowMs + p.ttl
      if p.mode == 'exclusive' then
        redis.call('HSET', leaseKey, 'name', name, 'owner', id, 'token', fmt(token), 'last', fmt(token),
          'expires', fmt(expires), 'acquired', fmt(nowMs), 'application', p.application or '', 'host', p.host or '', 'pid', p.pid or 0)
      else
        redis.call('HSET', sharedKey, id, cjson.encode({ token = fmt(token), expires = expires, acquired = nowMs,
          application = p.application or '', host = p.host or '', pid = p.pid or 0 }))
        if expires > bound then bound = expires end
      end
      keepUntil(leaseKey, expires + ${PLACE_TTL_MILLIS})
      dropPlace(id)
      redis.call('PUBLISH', channel, 'h' .. id .. ':' .. fmt(token) .. ':' .. fmt(expires))
      woken = woken + 1
    end
    if bound > 0 then
      redis.call('HSET', leaseKey, 'name', name, 'last', fmt(last), 'suntil', fmt(bound))
      keepUntil(sharedKey, bound + ${PLACE_TTL_MILLIS})
    end
  else
    for _, head in ipairs(heads) do
      redis.call('PUBLISH', channel, 'w' .. head.id)
      woken = woken + 1
    end
    -- A head not written lately may be a crashed waiter's, which will never act: the waiters
    -- behind it, up to the first that surely waits, are woken too, so that each learns when that
    -- place runs out (its wait) instead of finding out at its next retry (up to 1.5 s later).
    -- Judged by when each place was written, not by its ttl (a layer that WAITs writes none).
    -- Dead places in between do not count against the bound.
    if anyStale then
      local ids = redis.call('ZRANGE', queueKey, #heads, #heads + ${HEAD_SCAN - 1})
      local behind = 0
      for _, id in ipairs(ids) do
        local p = placeOf(id)
        if p and p.expires > nowMs then
          redis.call('PUBLISH', channel, 'w' .. id)
          woken = woken + 1
          behind = behind + 1
          if recent(p) or behind >= ${BEHIND_STALE} then break end
        end
      end
    end
  end
  -- Every place looked at is a shared head: the shared places right behind them (up to the first
  -- exclusive one) fit as well, and are woken to take theirs by an attempt, not at their next retry.
  -- Handed heads have left the queue; woken ones are still at its front.
  if #heads >= ${HEAD_CANDIDATES} then
    local from, scanned, stop = handed and 0 or #heads, 0, false
    repeat
      local ids = redis.call('ZRANGE', queueKey, from, from + ${HEAD_SCAN - 1})
      for _, id in ipairs(ids) do
        scanned = scanned + 1
        local p = placeOf(id)
        if p and p.expires > nowMs and id ~= owner and id ~= waiter then
          if p.mode == 'exclusive' then stop = true break end
          redis.call('PUBLISH', channel, 'w' .. id)
          woken = woken + 1
        end
        if scanned >= ${SHARED_BEHIND_MAX} then stop = true break end
      end
      from = from + #ids
    until stop or #ids < ${HEAD_SCAN}
  end
end
-- No key outlives its use: when a release (or the last waiter's leave) leaves the name with no
-- holder and no waiter, its lease hash (the last token) is kept only until the server's µs clock
-- is past that token, as a semaphore's hash is (permitScripts): the name's next grant then draws
-- a larger token without it.
if not handed and sharedLive == 0 and not redis.call('HGET', leaseKey, 'owner') and redis.call('ZCARD', queueKey) == 0 then
  local untilMs = math.floor(num(redis.call('HGET', leaseKey, 'last')) / 1000) + 2
  if untilMs <= nowMs then
    redis.call('DEL', leaseKey, sharedKey)
  else
    local left = redis.call('PTTL', leaseKey)
    -- Only ever shortened.
    if left == -1 or nowMs + left > untilMs then redis.call('PEXPIREAT', leaseKey, fmt(untilMs)) end
    redis.call('DEL', sharedKey)
  end
end
return { released, woken }
`

/**
 * Renews ONE lease (a batch is one call per lease in one pipeline: a script over several names'
 * keys would cross hash slots). KEYS: lease, shared. ARGV: 1 owner, 2 token, 3 ttl ms, 4 mode.
 * Answer: `renewed`, or why not: `stolen` (a newer holder), `expired` (ran out, its keys too),
 * `revoked` (freed without a newer grant, e.g. by an operator).
 */
export const renew = `${prelude}
local leaseKey, sharedKey = KEYS[1], KEYS[2]
local owner, token, ttl, mode = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local h = redis.call('HMGET', leaseKey, 'owner', 'expires', 'last', 'token')
local exists = redis.call('EXISTS', leaseKey) == 1
local expires = nowMs + ttl
if mode == 'exclusive' then
  -- On the token too: an owner id is a place's when a release handed it the lease.
  if h[1] == owner and num(h[4]) == token and num(h[2]) > nowMs then
    redis.call('HSET', leaseKey, 'expires', fmt(expires))
    keepUntil(leaseKey, expires)
    return 'renewed'
  end
  if h[1] == owner and num(h[4]) > token then return 'stolen' end
  if not exists or h[1] == owner then return 'expired' end
  if num(h[3]) > token then return 'stolen' end
  return 'revoked'
end
local raw = redis.call('HGET', sharedKey, owner)
if raw then
  local e = cjson.decode(raw)
  if num(e.token) > token then return 'stolen' end
  if e.expires > nowMs and not h[1] and num(e.token) == token then
    e.expires = expires
    redis.call('HSET', sharedKey, owner, cjson.encode(e))
    local bound = math.max(num(redis.call('HGET', leaseKey, 'suntil')), expires)
    redis.call('HSET', leaseKey, 'suntil', fmt(bound))
    keepUntil(sharedKey, expires)
    keepUntil(leaseKey, expires)
    return 'renewed'
  end
  return 'expired'
end
if not exists then return 'expired' end
if h[1] and num(h[3]) > token then return 'stolen' end
return 'revoked'
`

/**
 * Frees a lock whoever holds it, exclusive or shared (an operator's tool), and wakes every waiter
 * of it (`r` + name). KEYS: lease, shared. ARGV: 1 name, 2 channel. Answer: 1 when a lease was held.
 */
export const revoke = `${prelude}
local leaseKey, sharedKey = KEYS[1], KEYS[2]
local had = 0
if redis.call('HGET', leaseKey, 'owner') then
  redis.call('HDEL', leaseKey, 'owner', 'token', 'expires', 'acquired', 'application', 'host', 'pid')
  had = 1
end
if redis.call('EXISTS', sharedKey) == 1 then
  redis.call('DEL', sharedKey)
  had = 1
end
redis.call('HDEL', leaseKey, 'suntil')
if had == 1 then redis.call('PUBLISH', ARGV[2], 'r' .. ARGV[1]) end
return had
`

/**
 * The live leases of one name, exclusive and shared, as JSON texts
 * ({ name, mode, token, expires, acquired, application, host, pid, waiting }).
 * KEYS: lease, queue, places, shared. ARGV: 1 name.
 */
export const holders = `${prelude}${lockHelpers}
local out = {}
local waiting = nil
for _, id in ipairs(redis.call('ZRANGE', queueKey, 0, -1)) do
  local p = placeOf(id)
  if p and p.expires > nowMs and (not waiting or p.since < waiting) then waiting = p.since end
end
local h = redis.call('HMGET', leaseKey, 'owner', 'token', 'expires', 'acquired', 'application', 'host', 'pid')
if h[1] and num(h[3]) > nowMs then
  table.insert(out, cjson.encode({ name = ARGV[1], mode = 'exclusive', token = h[2], expires = num(h[3]), acquired = num(h[4]),
    application = h[5] or cjson.null, host = h[6] or cjson.null, pid = num(h[7]), waiting = waiting or cjson.null }))
end
local all = redis.call('HGETALL', sharedKey)
for i = 2, #all, 2 do
  local e = cjson.decode(all[i])
  if e.expires > nowMs then
    table.insert(out, cjson.encode({ name = ARGV[1], mode = 'shared', token = e.token, expires = e.expires, acquired = e.acquired,
      application = e.application, host = e.host, pid = tonumber(e.pid) or 0, waiting = waiting or cjson.null }))
  end
end
return out
`

/** The server's wall clock, ms since the epoch. */
export const now = `${prelude}
return nowMs
`

/** A wake-up through the lock connection (the hub's health check). ARGV: 1 channel, 2 payload. */
export const publish = `return redis.call('PUBLISH', ARGV[1], ARGV[2])`

/** Nothing to sweep: every key expires by itself (the engine's sweep is off by default). */
export const sweep = `return 0`


/**
 * Who waits for one name, read by its keys alone (inspection lists names by their tag, and a
 * name only waited for may have no lease hash, hence no readable name): the readable name if
 * the lease hash keeps it, the live places by mode and the oldest place's arrival. Reads only.
 * KEYS: lease, queue, places. Answer: { name | nil, exclusive places, shared places, oldest since (ms) | nil }.
 */
export const waiting = `${prelude}
local leaseKey, queueKey, placesKey = KEYS[1], KEYS[2], KEYS[3]
local name = redis.call('HGET', leaseKey, 'name')
local exclusive, shared, since = 0, 0, false
for _, id in ipairs(redis.call('ZRANGE', queueKey, 0, -1)) do
  local raw = redis.call('HGET', placesKey, id)
  if raw then
    local p = cjson.decode(raw)
    if p.expires > nowMs then
      if p.mode == 'exclusive' then exclusive = exclusive + 1 else shared = shared + 1 end
      if not since or p.since < since then since = p.since end
    end
  end
end
return { name, exclusive, shared, since }
`

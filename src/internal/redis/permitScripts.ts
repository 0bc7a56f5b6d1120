/**
 * The Lua scripts of RedisLease's semaphores (`DistributedSemaphore`): one script per operation,
 * the server's `TIME` only, as the lock scripts beside them (`scripts.ts`, whose prelude they
 * share). The model is PgLease's permit SQL (`lease/pg/permitSql`), with its row as one hash.
 *
 * **One hash per semaphore name**, `<prefix>{<tag>}:sem` (`keys.ts`: the same slot as the lock
 * of that name, never the same key), with the fields
 * - `name` (readable), `limit`, `last` (the last token handed out), `revoked` (every token up to
 *   it was taken away by `revoke`) and `runtil` (when the revoked holders' leases would have run
 *   out: until then their renewals are told `revoked`);
 * - `holders`: JSON array of `{ owner, permits, token (the first of its permits', a string),
 *   expires, acquired, application, host, pid }`;
 * - `waiters`: the queue, JSON array in arrival order of `{ place, permits, expires, since,
 *   application, host, pid }`. Times are the server's, in ms since the epoch.
 * Everything that decides a grant is in that one key, and a script runs alone on the server:
 * every decision is made on the newest state.
 *
 * **Fairness** (as PgLease): a request takes its permits when they fit into what is free after
 * every live waiter ahead of it has taken its own (a newcomer is behind every waiter); a place
 * lasts `place ttl` unless its waiter retries; expired holders and places are dropped by
 * whichever script next writes the hash. Asking with another limit while the name is in use
 * (a live holder or waiter) answers the current limit and changes nothing.
 *
 * **Tokens.** A grant of n permits takes the n consecutive tokens from `max(last + 1, server µs)`.
 * **No key outlives its use**: every write sets the hash's expiry to the latest moment anything
 * in it matters — a live holder's or place's end, `runtil`, and the moment the server's clock
 * passes `last` in µs (the lock scripts' floor, exact here whatever the permits) — and deletes
 * it when that moment has passed. So a semaphore nobody holds or waits for leaves no key within
 * a ttl, and when its hash is gone the server's µs clock is past every token it handed out: its
 * next grant's tokens are larger (same caveat as locks: a server clock stepping back).
 */
import { PLACE_REFRESH_BELOW } from "../lease/place.js"
import { prelude } from "./scripts.js"

/** Loading and saving the hash of one semaphore (KEYS[1]); only live entries are kept. */
const semHelpers = `
local semKey = KEYS[1]
local function liveOf(raw)
  local out = {}
  if raw then
    for _, e in ipairs(cjson.decode(raw)) do
      if e.expires > nowMs then table.insert(out, e) end
    end
  end
  return out
end
local f = redis.call('HMGET', semKey, 'limit', 'last', 'holders', 'waiters', 'revoked', 'runtil')
local stored = f[1] ~= false
local limit, last, revoked, runtil = num(f[1]), num(f[2]), num(f[5]), num(f[6])
local holders, waiters = liveOf(f[3]), liveOf(f[4])
local function sumPermits(list)
  local n = 0
  for _, e in ipairs(list) do n = n + e.permits end
  return n
end
-- Writes the state back and makes the key expire exactly when nothing in it matters any more.
local function save(name)
  -- Until the server's µs clock is past the last token: a later grant without this key still gets larger tokens.
  local untilMs = math.floor(last / 1000) + 2
  if runtil > untilMs then untilMs = runtil end
  for _, e in ipairs(holders) do if e.expires > untilMs then untilMs = e.expires end end
  for _, e in ipairs(waiters) do if e.expires > untilMs then untilMs = e.expires end end
  if untilMs <= nowMs then
    -- Nothing live, and the clock is past the last token: the name's next grant needs nothing of it.
    redis.call('DEL', semKey)
    return
  end
  redis.call('HSET', semKey, 'limit', limit, 'last', fmt(last), 'revoked', fmt(revoked), 'runtil', fmt(runtil),
    'holders', cjson.encode(holders), 'waiters', cjson.encode(waiters))
  if name then redis.call('HSET', semKey, 'name', name) end
  -- May shorten the key's life: the computed moment is exact, as everything of the name is in it.
  redis.call('PEXPIREAT', semKey, fmt(untilMs))
end
-- Wakes the live waiters at the head whose permits fit into what is free, up to the first that does not.
local function wakeHeads(channel)
  local free = limit - sumPermits(holders)
  local upto, woken = 0, 0
  for _, w in ipairs(waiters) do
    upto = upto + w.permits
    if upto > free then break end
    redis.call('PUBLISH', channel, 'w' .. w.place)
    woken = woken + 1
  end
  return woken
end
`

/**
 * One attempt at `permits` of a semaphore.
 * KEYS: sem. ARGV: 1 name, 2 owner, 3 waiter, 4 limit, 5 permits, 6 ttl ms, 7 place ms,
 * 8 application, 9 host, 10 pid, 11 take a place ("1"/"0").
 * Answer: { first token (string) | nil, current limit on a mismatch | nil, wait (ms) | nil }.
 */
export const acquire = `${prelude}${semHelpers}
local name, owner, waiter = ARGV[1], ARGV[2], ARGV[3]
local askLimit, permits, ttl, placeMs = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local application, host, pid, takePlace = ARGV[8], ARGV[9], ARGV[10], ARGV[11] == '1'

local inUse = #holders > 0 or #waiters > 0
if inUse and limit ~= askLimit then return { false, limit, false } end

-- This request's place, and the permits asked by the live waiters ahead of it (all of them without a place).
local mineAt, ahead = nil, 0
local others = {}
for i, w in ipairs(waiters) do
  if w.place == waiter then
    mineAt = i
  else
    if not mineAt then ahead = ahead + w.permits end
    table.insert(others, w)
  end
end

if ahead + permits <= askLimit - sumPermits(holders) then
  local first = math.max(last + 1, nowUs)
  last = first + permits - 1
  limit = askLimit
  table.insert(holders, { owner = owner, permits = permits, token = fmt(first), expires = nowMs + ttl, acquired = nowMs,
    application = application, host = host, pid = pid })
  waiters = others
  save(name)
  return { fmt(first), false, false }
end

if takePlace then
  local placeUntil = nowMs + placeMs
  if not mineAt then
    limit = askLimit
    table.insert(waiters, { place = waiter, permits = permits, expires = placeUntil, since = nowMs,
      application = application, host = host, pid = pid })
    save(name)
  elseif waiters[mineAt].expires <= nowMs + placeMs * ${PLACE_REFRESH_BELOW} then
    -- Kept: written again once at most 4/5 of its time is left (lease/place).
    waiters[mineAt].expires = placeUntil
    save(name)
  end
end

-- Until something could change without a wake-up: a holder's lease or another waiter's place running out.
local changeAt = nil
for _, e in ipairs(holders) do if not changeAt or e.expires < changeAt then changeAt = e.expires end end
for _, e in ipairs(others) do if not changeAt or e.expires < changeAt then changeAt = e.expires end end
if changeAt then return { false, false, math.max(0, changeAt - nowMs) } end
return { false, false, false }
`

/**
 * Gives back what one request holds of a semaphore: the holder entry of `owner` and/or the place
 * of `waiter` — owner-scoped, so a holder whose permits expired can never free anyone else's.
 * Then the waiters now at the head that fit are woken on the channel.
 * KEYS: sem. ARGV: 1 owner ('' for none), 2 waiter ('' for none), 3 channel.
 * Answer: { released (0/1: an entry or place of the request was there), woken (count) }.
 */
export const release = `${prelude}${semHelpers}
local owner, waiter, channel = ARGV[1], ARGV[2], ARGV[3]
if not stored then return { 0, 0 } end
local found = false
local keptHolders, keptWaiters = {}, {}
for _, e in ipairs(holders) do
  if owner ~= '' and e.owner == owner then found = true else table.insert(keptHolders, e) end
end
for _, w in ipairs(waiters) do
  if waiter ~= '' and w.place == waiter then found = true else table.insert(keptWaiters, w) end
end
-- An expired entry of the request counts as found too (it is gone either way), as on PgLease.
if not found then
  for _, e in ipairs(cjson.decode(f[3] or '[]')) do if owner ~= '' and e.owner == owner then found = true end end
  for _, w in ipairs(cjson.decode(f[4] or '[]')) do if waiter ~= '' and w.place == waiter then found = true end end
end
if not found then return { 0, 0 } end
holders, waiters = keptHolders, keptWaiters
local woken = wakeHeads(channel)
save(nil)
return { 1, woken }
`

/**
 * Renews ONE grant (a batch is one call per grant in one pipeline, as for locks).
 * KEYS: sem. ARGV: 1 owner, 2 first token, 3 ttl ms.
 * Answer: `renewed`, or why not: `expired` (its entry ran out, or the hash is gone), `revoked`
 * (taken away by an operator), `stolen` (gone, with a live holder granted after it).
 */
export const renew = `${prelude}${semHelpers}
local owner, token, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if not stored then return 'expired' end
for _, e in ipairs(holders) do
  if e.owner == owner then
    e.expires = nowMs + ttl
    save(nil)
    return 'renewed'
  end
end
for _, e in ipairs(cjson.decode(f[3] or '[]')) do if e.owner == owner then return 'expired' end end
if revoked >= token then return 'revoked' end
for _, e in ipairs(holders) do if tonumber(e.token) > token then return 'stolen' end end
return 'expired'
`

/**
 * Takes every permit of a semaphore away (an operator's tool): holders learn at their next
 * renewal (`revoked`), and the waiters that now fit are woken. KEYS: sem. ARGV: 1 channel.
 * Answer: 1 when a permit was held.
 */
export const revoke = `${prelude}${semHelpers}
if #holders == 0 then return 0 end
revoked = last
for _, e in ipairs(holders) do if e.expires > runtil then runtil = e.expires end end
holders = {}
wakeHeads(ARGV[1])
save(nil)
return 1
`

/**
 * The semaphore as JSON text `{ name, lim, holders, waiters }` (live entries only), or nil when
 * it is not in use. KEYS: sem. ARGV: 1 name.
 */
export const semaphore = `${prelude}${semHelpers}
if #holders == 0 and #waiters == 0 then return false end
return cjson.encode({ name = ARGV[1], lim = limit, holders = holders, waiters = waiters })
`

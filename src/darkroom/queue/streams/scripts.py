"""The Lua scripts `Streams` runs where two commands must act as one: each checks who holds
an entry (or whether a letter is still there) and acts in the same step, over keys of one
hash slot, so it is atomic on a single node, behind Sentinel and on a Cluster alike (the
asyncio cluster client of the older redis-py versions pyproject allows refuses MULTI).
"""

from __future__ import annotations

# Heartbeat and backoff touch only entries this consumer still owns: a stale worker must
# not take back an entry another consumer has reclaimed. XPENDING + XCLAIM in one script.
# KEYS[1] stream; ARGV group, consumer, idle ms ('' = now), ids... Returns the ids it
# refreshed.
REFRESH_OWNED_LUA = """
local owned = {}
for i = 4, #ARGV do
  local row = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if type(row) == 'table' and row.err then
    if string.find(row.err, 'NOGROUP', 1, true) then return {} end
    return row
  end
  if row[1] and row[1][2] == ARGV[2] then owned[#owned + 1] = ARGV[i] end
end
if #owned == 0 then return {} end
local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for _, id in ipairs(owned) do args[#args + 1] = id end
if ARGV[3] ~= '' then args[#args + 1] = 'IDLE'; args[#args + 1] = ARGV[3] end
args[#args + 1] = 'JUSTID'
return redis.call(unpack(args))
"""

# Hand an entry this consumer holds back to the live owner of its job (it reclaimed the
# entry after a Redis outage ate the owner's heartbeat): XCLAIM to that consumer, JUSTID, so
# no delivery is counted and the owner's heartbeat keeps it again. The entry moves only if
# this consumer still holds it. KEYS[1] stream; ARGV group, this consumer, the owner, id.
# Returns 1 if it moved.
HAND_BACK_LUA = """
local row = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[4], 1)
if type(row) == 'table' and row.err then
  if string.find(row.err, 'NOGROUP', 1, true) then return 0 end
  return row
end
if not row[1] or row[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[4], 'JUSTID')
return 1
"""

# XACK runs under pcall so that, as in a MULTI, the rest runs when the group is gone; its
# error is handed back for the caller to judge (a lost group is no error).
ACK_LUA = """
local acked = redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if type(acked) == 'table' and acked.err then return redis.error_reply(acked.err) end
return acked
"""

# KEYS: dead stream, work stream, the entry's mark; ARGV: maxlen, group, entry id, consumer,
# mark TTL s, field, value, ...
# One letter per entry, however often the call is sent: a client that lost the reply and
# sends it again (redis-py retries once on a dropped connection) finds the mark and gets the
# first letter's id; the entry, acked and deleted by then, cannot tell it (it is pending with
# nobody, which a lost group looks like too). An entry pending with another consumer is not
# ours to dead-letter: it reclaimed the entry while this one was slow, and will dead-letter
# it itself. An entry pending with nobody (the group lost in a restart) gets its letter.
DEAD_LETTER_LUA = """
local done = redis.call('GET', KEYS[3])
if done then return {done, ''} end
local row = redis.pcall('XPENDING', KEYS[2], ARGV[2], ARGV[3], ARGV[3], 1)
if type(row) == 'table' and not row.err and row[1] and row[1][2] ~= ARGV[4] then
  return {'', 'not_owner'}
end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 6))
redis.call('SET', KEYS[3], id, 'EX', ARGV[5])
local acked = redis.pcall('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
if type(acked) == 'table' and acked.err then return {id, acked.err} end
return {id, ''}
"""
# How long an entry's mark outlives its letter: far past any resend of the same call (one
# immediate retry here; a cluster client's few, within seconds), short enough that marks
# cost little memory (about 100 bytes each) after a burst of failures.
LETTERED_TTL_S = 3600

# The ids among ARGV that are not in the stream KEYS[1] (one key: valid on a cluster).
MISSING_LUA = """
local gone = {}
for _, id in ipairs(ARGV) do
    if #redis.call('XRANGE', KEYS[1], id, id, 'COUNT', 1) == 0 then gone[#gone + 1] = id end
end
return gone
"""

# KEYS[1] dead-letter stream, KEYS[2] work stream (one hash slot); ARGV[1] letter id, then
# the new entry's fields. Returns the new entry id, or false if the letter was gone.
REPLAY_IF_PRESENT_LUA = """
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return false end
return redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
"""

# KEYS[1] stream; ARGV group. XLEN less the group's pending count (0 without the group).
UNDELIVERED_LUA = """
local summary = redis.pcall('XPENDING', KEYS[1], ARGV[1])
if type(summary) == 'table' and summary.err then return 0 end
return redis.call('XLEN', KEYS[1]) - summary[1]
"""

# XGROUP DELCONSUMER discards the consumer's pending entries: the check (nothing pending,
# idle long enough) and the delete run in one step, so an entry delivered in between cannot
# be lost. KEYS[1] stream; ARGV group, consumer, min idle ms. Returns 1 removed, 0 kept,
# -1 unknown.
DELCONSUMER_IF_IDLE_LUA = """
local rows = redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
for _, row in ipairs(rows) do
  local c = {}
  for i = 1, #row, 2 do c[row[i]] = row[i + 1] end
  if c['name'] == ARGV[2] then
    if tonumber(c['pending']) == 0 and tonumber(c['idle']) >= tonumber(ARGV[3]) then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
      return 1
    end
    return 0
  end
end
return -1
"""

# What the PostgreSQL intake needs to know whether an entry may still wait: the stream's last
# generated id, and the id of the first entry the group has not delivered (false: none
# waits). Without the stream: {'0-0', false}; without the group (it would read from the
# start) every entry waits. KEYS[1] stream; ARGV group.
DELIVERY_POINT_LUA = """
local info = redis.pcall('XINFO', 'STREAM', KEYS[1])
if info.err then return {'0-0', false} end
local last = '0-0'
for i = 1, #info, 2 do if info[i] == 'last-generated-id' then last = info[i + 1] end end
local from = '-'
for _, row in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local g = {}
  for i = 1, #row, 2 do g[row[i]] = row[i + 1] end
  if g['name'] == ARGV[1] then from = '(' .. g['last-delivered-id'] end
end
local first = redis.call('XRANGE', KEYS[1], from, '+', 'COUNT', 1)
if first[1] then return {last, first[1][1]} end
return {last, false}
"""

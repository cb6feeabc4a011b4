#!lua name=kvplane_v6
--[[
kvplane's shared prefix index as a Redis Functions library (loaded by indexer/redis_backend.py
with FUNCTION LOAD REPLACE on every primary). The library's name and its functions' names end
with its ABI version (`_v6`): a change of any function's arguments, replies or flags, of
what it records for its callers to read back, or a function added, takes the next one (v4:
kvp_release, kvp_renew, kvp_probe, allow-oom, and a write whose mark is not above the stored
one refused, KVP_STALE, see check_boot; v5: the outcome of a call that refused a batch, or
claimed a lost call's mark, recorded for its process, see record_outcome; v6: a worker's
`c` flag, which kvp_prefix and kvp_scan read to fail a legacy worker closed on component
detail past its run, and kvp_scan's reply ends with those workers), so that
processes of two kvplane versions sharing a Redis in a rolling upgrade each call
their own library (a library's REPLACE would otherwise swap the other version's functions
under it); the key layout below is shared by every version. docs/redis.md describes the layout; in short, for
one partition whose keys all share the hash tag in KEYS[1] = "<prefix>:{<model>:<part>}:m":

  <base>:m          HASH  meta: boot token, nw (highest worker id given out), fr (removed
                          ids are freed), gcg/swg/swc/pg (sweeper), lw:<writer> (the mark
                          of each writing process's latest write, see check_boot),
                          lo:<writer> (what its latest call that refused a batch, or
                          claimed a mark, did, see record_outcome)
  <base>:wi         HASH  registered worker name -> small int id
  <base>:ws         SET   ids of registered workers
  <base>:wf         LIST  ids of removed workers, free for new names (oldest first)
  <base>:w:<id>     HASH  n name, a address, s packed spec ("" = legacy), e<t> epoch and
                          n<t> live placement count per tier t (a free id keeps only e<t>),
                          c "1" once it reported a non-zero component mask (never cleared
                          while it is registered: it only tells a prefix scan where a legacy
                          worker may hold component data past its run)
  <base>:b:<bucket> HASH  8-byte block key -> block record (below)
  <base>:h:<bucket> HASH  8-byte block key -> hit count
  <base>:l:<engine> STRING the writer lease of an engine's workers: the id of the one
                          replica (controller or indexer) that writes them (kvp_lease), with
                          an expiry
  <base>:r:<engine> STRING a resync of the engine asked of a replica that does not hold its
                          lease, for the holder ("all", or "lost": only if its stream is
                          lost; kvp_lease), expiring with the lease

Block record: flags(1: bit 0 = has parent) token_count(u32) [parent(8)] then 13-byte
placements: worker id(u16) tier(u8) epoch(u32) component mask(u32) copies(u16), in
first-placed order.

A placement is live iff its epoch equals its worker's current epoch at its tier. CLEAR and
worker removal bump epochs (O(1), atomic); dead records are dropped whenever a record is
rewritten and by kvp_sweep in bounded chunks. A removed worker's id goes to a later new name
with its bumped epochs, so the records that still carry it stay dead for its new owner (a
reused id is a CLEAR at every tier, as far as old records can tell). Hence an id means a
worker only inside one call: replies name the workers of the ids they return. A block without
live placements does not exist: its hit count, token count and parent are forgotten (a later
REPORT starts it afresh).

Block keys are opaque 8-byte strings here: Lua numbers are doubles and cannot hold them.
]]

local REC = 13 -- bytes per stored placement
-- Returned placements are 9 bytes: worker id(u16) tier(u8) mask(u32) copies(u16).

local function u16(s, i)
  local a, b = string.byte(s, i, i + 1)
  return a * 256 + b
end

local function u32(s, i)
  local a, b, c, d = string.byte(s, i, i + 3)
  return ((a * 256 + b) * 256 + c) * 256 + d
end

local function p16(n)
  return string.char(math.floor(n / 256) % 256, n % 256)
end

local SMALL32 = {} -- p32 of 0..255, filled on first use (no string library at load time)

local function p32(n)
  if n < 256 then
    local packed = SMALL32[n]
    if not packed then
      packed = '\0\0\0' .. string.char(n)
      SMALL32[n] = packed
    end
    return packed
  end
  return string.char(math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
    math.floor(n / 256) % 256, n % 256)
end

-- Redis Cluster moves a slot key by key (MIGRATE), and Redis checks the keys a function
-- declares (KEYS[1] only) against a moving slot, not the bucket and worker keys it reaches
-- undeclared: on the node the slot leaves, a call would find some keys gone (a script error
-- after its earlier writes); on the node it reaches (redirected there by ASK once the meta key
-- moved), it would miss the keys not moved yet, or create them and make their MIGRATE fail.
-- So while the partition's slot is moving, every call is refused before it reads anything, and
-- the client retries once the move is done. The probe: two keys of the partition that never
-- exist, read in one command. Where the slot is settled that reads 0; a node sending the slot
-- answers ASK for missing keys, and a node receiving it answers TRYAGAIN for a multi-key
-- command missing any (Redis's own rules for a moving slot), which a script sees as an error.
local function check_slot_settled(key)
  local base = string.sub(key, 1, -3)
  local probe = redis.pcall('EXISTS', base .. ':moving:probe1', base .. ':moving:probe2')
  if type(probe) == 'table' and probe.err then
    error({ err = 'KVP_MOVING the cluster slot of this partition is being moved to another '
      .. 'node (' .. probe.err .. ')' })
  end
end

local function new_ctx(keys, args)
  check_slot_settled(keys[1])
  local base = string.sub(keys[1], 1, -3)
  return { base = base, b = base .. ':b:', h = base .. ':h:', nb = tonumber(args[1]),
    ep = {}, dn = {} }
end

local function bucket_of(ctx, k)
  local a, b, c = string.byte(k, 6, 8)
  return ((a * 256 + b) * 256 + c) % ctx.nb
end

local function epoch_of(ctx, wid, tier)
  local slot = wid * 4 + tier
  local e = ctx.ep[slot]
  if e == nil then
    e = tonumber(redis.call('HGET', ctx.base .. ':w:' .. wid, 'e' .. tier)) or 0
    ctx.ep[slot] = e
  end
  return e
end

local function header_len(v)
  if string.byte(v, 1) % 2 == 1 then return 13 end
  return 5
end

local function parent_of(v)
  if string.byte(v, 1) % 2 == 1 then return string.sub(v, 6, 13) end
  return ''
end

local function header(tokens, parent)
  if parent ~= '' then return '\1' .. p32(tokens) .. parent end
  return '\0' .. p32(tokens)
end

-- Live placements of a record as 9-byte strings (in stored order).
local function live_out(ctx, v)
  local out = {}
  for pos = header_len(v) + 1, #v, REC do
    local wid = u16(v, pos)
    local tier = string.byte(v, pos + 2)
    if u32(v, pos + 3) == epoch_of(ctx, wid, tier) then
      out[#out + 1] = string.sub(v, pos, pos + 2) .. string.sub(v, pos + 7, pos + 12)
    end
  end
  return out
end

local function add_delta(ctx, wid, tier, d)
  local slot = wid * 4 + tier
  ctx.dn[slot] = (ctx.dn[slot] or 0) + d
end

local function flush_deltas(ctx)
  for slot, d in pairs(ctx.dn) do
    if d ~= 0 then
      local wid = math.floor(slot / 4)
      redis.call('HINCRBY', ctx.base .. ':w:' .. wid, 'n' .. (slot % 4), d)
    end
  end
end

-- Rewrites a record keeping its live placements. `self` (wid * 4 + tier) is handed to
-- `edit(old)` (old = its live record or nil), whose result replaces it in place (appended
-- when it was absent; nil drops it). Returns the new placement pieces, self's old record and
-- the number of other live placements.
local function rewrite(ctx, v, self, edit)
  local parts = {}
  local old = nil
  local others = 0
  for pos = header_len(v) + 1, #v, REC do
    local wid = u16(v, pos)
    local tier = string.byte(v, pos + 2)
    if u32(v, pos + 3) == epoch_of(ctx, wid, tier) then
      local rec = string.sub(v, pos, pos + REC - 1)
      if wid * 4 + tier == self then
        old = rec
        local new = edit(old)
        if new then parts[#parts + 1] = new end
      else
        others = others + 1
        parts[#parts + 1] = rec
      end
    end
  end
  if old == nil and edit then
    local new = edit(nil)
    if new then parts[#parts + 1] = new end
  end
  return parts, old, others
end

-- Position of the (wid, tier) record in v (or nil), reading record heads only.
local function find(v, from, wid, tier)
  local hi, lo = math.floor(wid / 256), wid % 256
  for pos = from, #v, REC do
    local a, b, t = string.byte(v, pos, pos + 2)
    if a == hi and b == lo and t == tier then return pos end
  end
  return nil
end

local function is_live(ctx, v, pos)
  local a, b, t, e1, e2, e3, e4 = string.byte(v, pos, pos + 6)
  return ((e1 * 256 + e2) * 256 + e3) * 256 + e4 == epoch_of(ctx, a * 256 + b, t)
end

-- Whether v holds a live placement other than the record at `skip`.
local function other_live(ctx, v, from, skip)
  for pos = from, #v, REC do
    if pos ~= skip and is_live(ctx, v, pos) then return true end
  end
  return false
end

-- REPORT of one block: the placement's mask is replaced; with `copies` a placement that is
-- already live gains a physical copy. Token count replaced only by a non-zero size; parent
-- replaced only by a known one. `head` = the record's id, tier and epoch bytes.
local function report(ctx, wid, tier, head, k, mask, tokens, parent, copies)
  local bucket = bucket_of(ctx, k)
  local bkey = ctx.b .. bucket
  local v = redis.call('HGET', bkey, k)
  local with_mask = head .. p32(mask)
  if v then
    local from = header_len(v) + 1
    local pos = find(v, from, wid, tier)
    local live_self = pos ~= nil and is_live(ctx, v, pos)
    if live_self or other_live(ctx, v, from, pos) then
      local n = 1
      if live_self then
        n = u16(v, pos + 11)
        if copies and n < 65535 then n = n + 1 end
      else
        add_delta(ctx, wid, tier, 1)
      end
      local body
      if pos then
        body = string.sub(v, from, pos - 1) .. with_mask .. p16(n) .. string.sub(v, pos + REC)
      else
        body = string.sub(v, from) .. with_mask .. '\0\1'
      end
      if tokens == 0 then tokens = u32(v, 2) end
      if parent == '' then parent = parent_of(v) end
      redis.call('HSET', bkey, k, header(tokens, parent) .. body)
      return
    end
    -- Only dead placements: the block starts afresh, without its old hit count.
    redis.call('HDEL', ctx.h .. bucket, k)
  end
  add_delta(ctx, wid, tier, 1)
  redis.call('HSET', bkey, k, header(tokens, parent) .. with_mask .. '\0\1')
end

-- REVOKE of one block: drops the placement, or with `copies` one physical copy of it.
local function revoke(ctx, wid, tier, k, copies)
  local bucket = bucket_of(ctx, k)
  local bkey = ctx.b .. bucket
  local v = redis.call('HGET', bkey, k)
  if not v then return end
  local from = header_len(v) + 1
  local pos = find(v, from, wid, tier)
  if pos and is_live(ctx, v, pos) then
    local n = u16(v, pos + 11)
    if copies and n > 1 then
      redis.call('HSET', bkey, k, string.sub(v, 1, pos + 10) .. p16(n - 1) .. string.sub(v, pos + REC))
      return
    end
    add_delta(ctx, wid, tier, -1)
    if other_live(ctx, v, from, pos) then
      redis.call('HSET', bkey, k, string.sub(v, 1, pos - 1) .. string.sub(v, pos + REC))
      return
    end
  elseif other_live(ctx, v, from, nil) then
    return
  end
  redis.call('HDEL', bkey, k)
  redis.call('HDEL', ctx.h .. bucket, k)
end

local function clear_tier(ctx, wid, tier)
  local wkey = ctx.base .. ':w:' .. wid
  if (tonumber(redis.call('HGET', wkey, 'n' .. tier)) or 0) + (ctx.dn[wid * 4 + tier] or 0) == 0 then
    return
  end
  ctx.ep[wid * 4 + tier] = redis.call('HINCRBY', wkey, 'e' .. tier, 1)
  redis.call('HSET', wkey, 'n' .. tier, 0)
  ctx.dn[wid * 4 + tier] = 0
  redis.call('HINCRBY', ctx.base .. ':m', 'gcg', 1)
end

-- The id of `name`, registering it: a free id first (the oldest freed, so the sweeper has most
-- likely dropped its dead records already), a new one only when none is free. Reusing first
-- keeps the ids and their hashes bounded by the most workers registered at once, and the
-- reuse path runs in every fleet that replaces a worker, not first after 65,535 names.
local function intern(ctx, name)
  local wid = redis.call('HGET', ctx.base .. ':wi', name)
  if wid then return tonumber(wid) end
  wid = redis.call('LPOP', ctx.base .. ':wf')
  if wid then
    wid = tonumber(wid)
  else
    if (tonumber(redis.call('HGET', ctx.base .. ':m', 'nw')) or 0) >= 65535 then
      return 'KVP_WORKERS more than 65535 registered workers in one partition'
    end
    wid = redis.call('HINCRBY', ctx.base .. ':m', 'nw', 1)
  end
  redis.call('HSET', ctx.base .. ':wi', name, wid)
  redis.call('HSET', ctx.base .. ':w:' .. wid, 'n', name)
  return wid
end

-- `arg`: "<boot token> <writer> <floor> <mark>". The token tells a partition that lost its
-- data. A Redis can also come back with older data that still holds the token (an RDB
-- snapshot, an AOF without its last second, a replica promoted before every write reached it:
-- replication is asynchronous), so each writing process (`writer`) keeps a mark in the meta
-- hash, raised by each of its writes: a mark below the highest one the process saw
-- acknowledged (`floor`) means some of its acknowledged writes are gone.
local function check_boot(ctx, arg)
  local boot, writer, floor, mark = string.match(arg, '^(%S*) (%S+) (%d+) (%d+)$')
  local mkey = ctx.base .. ':m'
  local current = redis.call('HGET', mkey, 'boot')
  if current ~= boot then
    return redis.error_reply('KVP_BOOT index state was lost or replaced (boot token mismatch)')
  end
  local field = 'lw:' .. writer
  local stored = tonumber(redis.call('HGET', mkey, field)) or 0
  if stored < tonumber(floor) then
    return redis.error_reply('KVP_LOST acknowledged writes of this process are gone (Redis '
      .. 'came back with older data)')
  end
  -- A process sends its marked calls one at a time, in mark order, so a mark not above the
  -- stored one is a copy of a call that ran (a client's resend after a lost reply) or one
  -- that reached Redis only after the process settled it as not run (redis_backend.py
  -- `_settle_held`, which resends its mark on an empty kvp_release): either must not run.
  if tonumber(mark) <= stored then
    return redis.error_reply('KVP_STALE this write ran already or was settled as not run')
  end
  redis.call('HSET', mkey, field, mark)
  ctx.writer = writer
  ctx.mark = tonumber(mark)
  return nil
end

-- What a marked kvp_apply / kvp_release did, for the process to read back should its reply be
-- lost (redis_backend.py `_settle_held`, which reads it with the stored mark): `lo:<writer>` in
-- the meta hash, JSON `[mark, [index, status, ...]]` with the call's refused batches (1-based),
-- or `[mark]` for the empty kvp_release that claims a lost call's mark (it did not run). Only
-- a call that refused a batch, or claims, writes it (one field per process, overwritten): a
-- stored mark at or above a call's mark with another mark here means every batch applied.
local function record_outcome(ctx, statuses)
  local outcome = { ctx.mark }
  if #statuses > 0 then
    local refused = {}
    for j, status in ipairs(statuses) do
      if status ~= 1 then
        refused[#refused + 1] = j
        refused[#refused + 1] = status
      end
    end
    if #refused == 0 then return end
    outcome[2] = refused
  end
  redis.call('HSET', ctx.base .. ':m', 'lo:' .. ctx.writer, cjson.encode(outcome))
end

-- `fence`: "" (an unconditional write: the KVIndexer API's, seed 004), or "<holder> <engine>"
-- for a controller replica following an engine: the write is refused unless `holder` holds
-- the engine's writer lease (kvp_lease) now, so that a replica that lost it (paused past its
-- expiry, cut off from Redis) cannot write over the one that took it over. Returns nil or
-- the refusal.
local function check_fence(ctx, fence)
  if fence == '' then return nil end
  local holder, engine = string.match(fence, '^(%S+) (.+)$')
  if redis.call('GET', ctx.base .. ':l:' .. engine) ~= holder then
    return 'KVP_FENCED this replica does not hold the writer lease of engine ' .. engine
  end
  return nil
end

-- Applies one batch whose arguments start at args[i]: worker, address, spec, fence (see
-- check_fence), number of actions, then seven per action: type, tier, hashes, masks, sizes,
-- parent, copies (blobs of big-endian int64 / uint32; "" = absent; copies "1" or "0").
-- Returns the status (1, or an error message that nothing of this batch was written) and the
-- index after the batch.
local function apply_one(ctx, args, i)
  local num_actions = tonumber(args[i + 4])
  local after = i + 5 + 7 * num_actions
  local fenced = check_fence(ctx, args[i + 3])
  if fenced then return fenced, after end
  local wid = intern(ctx, args[i])
  if type(wid) == 'string' then return wid, after end
  local wkey = ctx.base .. ':w:' .. wid
  redis.call('HSET', wkey, 'a', args[i + 1], 's', args[i + 2])
  redis.call('SADD', ctx.base .. ':ws', wid)
  for a = i + 5, after - 1, 7 do
    local kind = tonumber(args[a])
    local tier = tonumber(args[a + 1])
    local hashes = args[a + 2]
    local copies = args[a + 6] == '1'
    if kind == 3 then
      clear_tier(ctx, wid, tier)
    elseif kind == 1 then
      local masks, sizes, parent = args[a + 3], args[a + 4], args[a + 5]
      if string.find(masks, '[^%z]') then redis.call('HSET', wkey, 'c', '1') end
      local head = p16(wid) .. string.char(tier) .. p32(epoch_of(ctx, wid, tier))
      for j = 1, #hashes / 8 do
        local k = string.sub(hashes, j * 8 - 7, j * 8)
        local mask, tokens = 0, 0
        if masks ~= '' then mask = u32(masks, j * 4 - 3) end
        if sizes ~= '' then tokens = u32(sizes, j * 4 - 3) end
        report(ctx, wid, tier, head, k, mask, tokens, parent, copies)
        parent = k
      end
    elseif kind == 2 then
      for j = 1, #hashes / 8 do
        revoke(ctx, wid, tier, string.sub(hashes, j * 8 - 7, j * 8), copies)
      end
    end
  end
  return 1, after
end

-- Whether the batch at args[i] (see apply_one) could grow the index: a REPORT, or a worker
-- that is not registered under its name with this address and spec (apply_one would register
-- it, or store them anew). REVOKE and CLEAR only shorten or delete records, or bump epochs
-- and counters that already exist.
local function may_grow(ctx, args, i)
  local after = i + 5 + 7 * tonumber(args[i + 4])
  for a = i + 5, after - 1, 7 do
    if tonumber(args[a]) == 1 then return true end
  end
  local wid = redis.call('HGET', ctx.base .. ':wi', args[i])
  if not wid then return true end
  local row = redis.call('HMGET', ctx.base .. ':w:' .. wid, 'a', 's')
  return row[1] ~= args[i + 1] or (row[2] or '') ~= args[i + 2]
end

-- ARGV: nb, boot, then batches (see apply_one), applied in order, all in this one atomic
-- call. Returns one status per batch. With `only_freeing` (kvp_release) a batch that
-- could grow the index (may_grow) is not applied, and neither is any later batch of its
-- worker in this call (a worker's batches apply in order): its status says so.
local function apply_batches(keys, args, only_freeing)
  local ctx = new_ctx(keys, args)
  local err = check_boot(ctx, args[2])
  if err then return err end
  local statuses = {}
  local held = {}
  local i = 3
  while i <= #args do
    local status
    if only_freeing and (held[args[i]] or may_grow(ctx, args, i)) then
      held[args[i]] = true
      status = 'KVP_GROWS this batch could grow the index'
      i = i + 5 + 7 * tonumber(args[i + 4])
    else
      status, i = apply_one(ctx, args, i)
    end
    statuses[#statuses + 1] = status
  end
  flush_deltas(ctx)
  record_outcome(ctx, statuses)
  return statuses
end

local function kvp_apply(keys, args) return apply_batches(keys, args, false) end

-- kvp_apply for batches that only free memory (REVOKE, CLEAR), run even while Redis is at
-- its maxmemory (allow-oom): an index that filled Redis shrinks back under it as engines
-- evict blocks. Every other batch is left for kvp_apply (KVP_GROWS).
local function kvp_release(keys, args) return apply_batches(keys, args, true) end

-- Worker table entries for the ids in `seen` (a list): id, name, address, spec.
local function worker_rows(ctx, seen, out)
  for _, wid in ipairs(seen) do
    local row = redis.call('HMGET', ctx.base .. ':w:' .. wid, 'n', 'a', 's')
    out[#out + 1] = wid
    out[#out + 1] = row[1] or ''
    out[#out + 1] = row[2] or ''
    out[#out + 1] = row[3] or ''
  end
  return out
end

-- Appends to `seen` the ids of the 9-byte `live` records not in `known` yet.
local function note_workers(live, seen, known)
  for _, rec in ipairs(live) do
    local wid = u16(rec, 1)
    if not known[wid] then
      known[wid] = true
      seen[#seen + 1] = wid
    end
  end
end

-- ARGV: nb, hashes (distinct), count_as_hit. Returns: per hash its token count and live
-- placements (u32 .. 9-byte records; "" when absent), then worker rows.
local function match(keys, args, count)
  local ctx = new_ctx(keys, args)
  local hashes = args[2]
  local n = #hashes / 8
  local out = {}
  local seen, known = {}, {}
  for j = 1, n do
    local k = string.sub(hashes, j * 8 - 7, j * 8)
    local bucket = bucket_of(ctx, k)
    local v = redis.call('HGET', ctx.b .. bucket, k)
    local item = ''
    if v then
      local live = live_out(ctx, v)
      if #live > 0 then
        item = string.sub(v, 2, 5) .. table.concat(live)
        note_workers(live, seen, known)
        if count then redis.call('HINCRBY', ctx.h .. bucket, k, 1) end
      end
    end
    out[j] = item
  end
  return worker_rows(ctx, seen, out)
end

local function kvp_match(keys, args) return match(keys, args, args[3] == '1') end
local function kvp_match_ro(keys, args) return match(keys, args, false) end

-- ARGV: nb, hashes (distinct). Returns per hash its hit count, or -1 without a counter.
local function kvp_hits(keys, args)
  local ctx = new_ctx(keys, args)
  local hashes = args[2]
  local out = {}
  for j = 1, #hashes / 8 do
    local k = string.sub(hashes, j * 8 - 7, j * 8)
    local bucket = bucket_of(ctx, k)
    local hits = redis.call('HGET', ctx.h .. bucket, k)
    local result = -1
    if hits then
      local v = redis.call('HGET', ctx.b .. bucket, k)
      if v and #live_out(ctx, v) > 0 then result = tonumber(hits) end
    end
    out[j] = result
  end
  return out
end

-- Unpacks a spec string into a table, or nil for legacy workers.
local function spec_of(s)
  if s == nil or s == '' then return nil end
  return {
    version = u32(s, 1), components = u32(s, 5), window = u32(s, 9),
    full = u32(s, 13), swa = u32(s, 17), mamba = u32(s, 21),
  }
end

local function spec_valid(sp)
  if sp.components == 0 or sp.version > 1 then return false end
  if bit.band(sp.components, 2) ~= 0 and sp.window == 0 then return false end
  return true
end

-- One block's live placements grouped by worker: wid -> list of {tier, mask}, plus order.
local function placements_by_worker(ctx, v)
  local by = {}
  local order = {}
  for pos = header_len(v) + 1, #v, REC do
    local wid = u16(v, pos)
    local tier = string.byte(v, pos + 2)
    if u32(v, pos + 3) == epoch_of(ctx, wid, tier) then
      local list = by[wid]
      if not list then
        list = {}
        by[wid] = list
        order[#order + 1] = wid
      end
      list[#list + 1] = { tier, u32(v, pos + 7) }
    end
  end
  return by, order
end

-- Candidate states from the first block: live holders with an address, in record order.
-- Each carries its expected epochs per tier, so the scan checks liveness without lookups.
local function candidates(ctx, v)
  local by, states = {}, {}
  for pos = header_len(v) + 1, #v, REC do
    local wid = u16(v, pos)
    if by[wid] == nil and is_live(ctx, v, pos) then
      local row = redis.call('HMGET', ctx.base .. ':w:' .. wid, 'n', 'a', 's', 'e1', 'e2', 'e3',
        'c')
      if row[2] and row[2] ~= '' then
        local st = { wid = wid, name = row[1] or '', addr = row[2], spec = spec_of(row[3]),
          ep = { tonumber(row[4]) or 0, tonumber(row[5]) or 0, tonumber(row[6]) or 0 },
          best = 0, run = 0, broken = false, poisoned = false, seen = 0, f = 0, s = 0, m = 0,
          c = row[7] == '1', watch = false }
        st.on = st.spec == nil or spec_valid(st.spec)
        by[wid] = st
        states[#states + 1] = st
      else
        by[wid] = false
      end
    end
  end
  return by, states
end

-- Notes what block `i` holds for each scanning candidate: present (seen), component detail
-- on a legacy worker (poisoned), FULL/SWA/MAMBA on a tier its spec serves them from.
-- Legacy candidates advance here (best = i). A watched legacy candidate (past its run) is
-- only checked for component detail. Returns how many distinct scanning candidates it saw
-- and how many watched ones it poisoned.
local function observe(by, v, i)
  local byte = string.byte
  local seen, poisoned = 0, 0
  for pos = header_len(v) + 1, #v, REC do
    local a, b, t, e1, e2, e3, e4, m1, m2, m3, m4 = byte(v, pos, pos + 10)
    local st = by[a * 256 + b]
    if st and st.watch and st.ep[t] == ((e1 * 256 + e2) * 256 + e3) * 256 + e4 then
      if m1 + m2 + m3 + m4 ~= 0 then
        st.poisoned = true
        st.watch = false
        poisoned = poisoned + 1
      end
    elseif st and st.on and st.ep[t] == ((e1 * 256 + e2) * 256 + e3) * 256 + e4 then
      if st.seen ~= i then
        st.seen = i
        seen = seen + 1
      end
      local sp = st.spec
      if sp == nil then
        st.best = i
        if m1 + m2 + m3 + m4 ~= 0 then st.poisoned = true end
      elseif t == 1 or t == 2 then
        local mask = ((m1 * 256 + m2) * 256 + m3) * 256 + m4
        local tb = bit.lshift(1, t)
        if bit.band(mask, 1) ~= 0 and bit.band(sp.full, tb) ~= 0 then st.f = i end
        if bit.band(mask, 2) ~= 0 and bit.band(sp.swa, tb) ~= 0 then st.s = i end
        if bit.band(mask, 4) ~= 0 and bit.band(sp.mamba, tb) ~= 0 then st.m = i end
      end
    end
  end
  return seen, poisoned
end

-- Advances a spec'd candidate over block `i` (WIRE.md section 2's rules); false ends its
-- scan. (Legacy candidates are advanced inline in kvp_prefix.)
local function step_spec(st, sp, i, tokens)
  if st.f ~= i then return false end
  local ok = true
  if bit.band(sp.components, 2) ~= 0 then
    if st.s == i then
      st.run = st.run + tokens
      ok = (not st.broken) or st.run >= sp.window
    else
      st.run = 0
      st.broken = true
      ok = false
    end
  end
  if ok and bit.band(sp.components, 4) ~= 0 then ok = st.m == i end
  if ok then st.best = i end
  return true
end

-- Ends a legacy candidate's run: it is watched on (to the end of the window) if it ever
-- reported component detail, which fails it closed on any later block too. Returns 1 if so.
local function watch(st)
  st.on = false
  if st.spec == nil and st.c and not st.poisoned then
    st.watch = true
    return 1
  end
  return 0
end

-- MatchExternalKvPrefix. ARGV: nb, hashes, limit. Candidates: workers with an address that
-- hold the first block. Returns blocks_read, then per worker with a non-zero prefix (in
-- first-block record order; the caller sorts): id, name, address, matched_prefix_blocks.
-- A legacy worker with component detail on any block of the window fails closed (prefix 0):
-- it is scanned on past its run as SGLang's indexer does, the blocks past every run only for
-- such workers (the `c` flag) and not counted in blocks_read (so it agrees with the memory
-- backend's).
local function kvp_prefix(keys, args)
  local ctx = new_ctx(keys, args)
  local hashes = args[2]
  local limit = tonumber(args[3])
  local by, states
  local active = {}
  local num_spec = 0 -- spec'd candidates still scanning
  local num_watch = 0 -- legacy candidates past their run, still to check for component detail
  local scanning = true
  local blocks_read = 0
  for i = 1, limit do
    local k = string.sub(hashes, i * 8 - 7, i * 8)
    local v = redis.call('HGET', ctx.b .. bucket_of(ctx, k), k)
    if not scanning then
      if v then
        local _, poisoned = observe(by, v, i)
        num_watch = num_watch - poisoned
      end
    elseif not v then
      blocks_read = i
      scanning = false
      for _, st in ipairs(active) do num_watch = num_watch + watch(st) end
    else
      blocks_read = i
      if i == 1 then
        by, states = candidates(ctx, v)
        for _, st in ipairs(states) do
          if st.on then
            active[#active + 1] = st
            if st.spec then num_spec = num_spec + 1 end
          end
        end
        if #active == 0 then break end
      end
      local seen, poisoned = observe(by, v, i)
      num_watch = num_watch - poisoned
      -- Everyone still on and all legacy: nothing to decide beyond what observe did.
      if seen < #active or num_spec > 0 then
        local tokens = u32(v, 2)
        local kept = 0
        for j = 1, #active do
          local st = active[j]
          local sp = st.spec
          local on = st.seen == i
          if on and sp then on = step_spec(st, sp, i, tokens) end
          if on then
            kept = kept + 1
            active[kept] = st
          elseif sp then
            st.on = false
            num_spec = num_spec - 1
          else
            num_watch = num_watch + watch(st)
          end
        end
        for j = #active, kept + 1, -1 do active[j] = nil end
        if kept == 0 then scanning = false end
      end
    end
    if not scanning and num_watch == 0 then break end
  end
  local out = { blocks_read }
  for _, st in ipairs(states or {}) do
    if st.best > 0 and not st.poisoned then
      out[#out + 1] = st.wid
      out[#out + 1] = st.name
      out[#out + 1] = st.addr
      out[#out + 1] = st.best
    end
  end
  return out
end

-- Watches worker `wid` past its run if it is legacy and ever reported component detail (the
-- `c` flag): kvp_scan then reports it when a later block carries some. Returns 1 if so.
local function watch_wid(ctx, wid, watched)
  local row = redis.call('HMGET', ctx.base .. ':w:' .. wid, 's', 'c')
  if (row[1] or '') == '' and row[2] == '1' then
    watched[wid] = true
    return 1
  end
  return 0
end

-- Moves the watched workers with a live non-zero mask in `v` to `poisoned`; returns how many.
local function poison_watched(ctx, v, watched, poisoned)
  local n = 0
  for pos = header_len(v) + 1, #v, REC do
    local wid = u16(v, pos)
    if watched[wid] and u32(v, pos + 7) ~= 0
        and u32(v, pos + 3) == epoch_of(ctx, wid, string.byte(v, pos + 2)) then
      watched[wid] = nil
      poisoned[#poisoned + 1] = wid
      n = n + 1
    end
  end
  return n
end

-- Raw prefix scan: ARGV nb, hashes, limit. Returns per leading block, while some worker that
-- holds the first block still holds every block so far, its token count and those workers'
-- live placements (u32 .. 7-byte records: id u16, tier u8, mask u32); then "" and the
-- worker rows of the first block's holders; then the ids of the legacy ones among them with
-- component detail on a block of the window past their run (the legacy rule fails them
-- closed, as SGLang's indexer does), and last how many such ids there are.
local function kvp_scan(keys, args)
  local ctx = new_ctx(keys, args)
  local hashes = args[2]
  local limit = tonumber(args[3])
  local out = {}
  local active = nil
  local seen = {}
  local watched, poisoned = {}, {}
  local num_watch = 0
  local scanning = true
  for i = 1, limit do
    local k = string.sub(hashes, i * 8 - 7, i * 8)
    local v = redis.call('HGET', ctx.b .. bucket_of(ctx, k), k)
    if not scanning then
      if v then num_watch = num_watch - poison_watched(ctx, v, watched, poisoned) end
    elseif not v then
      scanning = false
      for _, wid in ipairs(active or {}) do num_watch = num_watch + watch_wid(ctx, wid, watched) end
    else
      local by, order = placements_by_worker(ctx, v)
      if active == nil then
        active = order
        seen = order
      end
      if num_watch > 0 then num_watch = num_watch - poison_watched(ctx, v, watched, poisoned) end
      local still = {}
      local parts = {}
      for _, wid in ipairs(active) do
        local placed = by[wid]
        if placed then
          still[#still + 1] = wid
          for _, p in ipairs(placed) do
            parts[#parts + 1] = p16(wid) .. string.char(p[1]) .. p32(p[2])
          end
        else
          num_watch = num_watch + watch_wid(ctx, wid, watched)
        end
      end
      active = still
      if #active == 0 then
        scanning = false
      else
        out[#out + 1] = string.sub(v, 2, 5) .. table.concat(parts)
      end
    end
    if not scanning and num_watch == 0 then break end
  end
  out[#out + 1] = ''
  worker_rows(ctx, seen, out)
  for _, wid in ipairs(poisoned) do out[#out + 1] = wid end
  out[#out + 1] = #poisoned
  return out
end

-- Registered workers: id, name, address, spec, live placements at tiers 1..3.
local function kvp_workers(keys, args)
  local ctx = new_ctx(keys, args)
  local out = {}
  local ids = redis.call('SMEMBERS', ctx.base .. ':ws')
  for _, id in ipairs(ids) do
    local row = redis.call('HMGET', ctx.base .. ':w:' .. id, 'n', 'a', 's', 'n1', 'n2', 'n3')
    out[#out + 1] = tonumber(id)
    for f = 1, 3 do out[#out + 1] = row[f] or '' end
    for f = 4, 6 do out[#out + 1] = tonumber(row[f]) or 0 end
  end
  return out
end

-- ARGV: nb, boot, worker name, fence (see check_fence). Forgets the worker and all its
-- placements (epochs bumped) and frees its id, which keeps its epochs for its next worker.
-- Returns the number of live placements it had.
local function kvp_remove(keys, args)
  local ctx = new_ctx(keys, args)
  local err = check_boot(ctx, args[2])
  if err then return err end
  local fenced = check_fence(ctx, args[4] or '')
  if fenced then return redis.error_reply(fenced) end
  local wid = redis.call('HGET', ctx.base .. ':wi', args[3])
  if not wid then return 0 end
  redis.call('HDEL', ctx.base .. ':wi', args[3])
  redis.call('SREM', ctx.base .. ':ws', wid)
  redis.call('RPUSH', ctx.base .. ':wf', wid)
  local wkey = ctx.base .. ':w:' .. wid
  local row = redis.call('HMGET', wkey, 'n1', 'n2', 'n3')
  local removed = 0
  for t = 1, 3 do
    -- Bumped at every tier, held or not: the id's next worker then owns no record made
    -- before, whatever the counts say. A sweep pass only where there is something to drop.
    redis.call('HINCRBY', wkey, 'e' .. t, 1)
    local live = tonumber(row[t]) or 0
    if live > 0 then
      removed = removed + live
      redis.call('HINCRBY', ctx.base .. ':m', 'gcg', 1)
    end
  end
  redis.call('HDEL', wkey, 'n', 'a', 's', 'c', 'n1', 'n2', 'n3')
  return removed
end

-- ARGV: nb, first bucket, number of buckets. Returns two lists: live blocks (key, token count,
-- parent ("" = root), live placements as 9-byte records), and the worker rows of their ids
-- (a caller reading in several calls must not take an id for the worker it named before).
local function kvp_dump(keys, args)
  local ctx = new_ctx(keys, args)
  local first = tonumber(args[2])
  local last = math.min(first + tonumber(args[3]), ctx.nb) - 1
  local out = {}
  local seen, known = {}, {}
  for b = first, last do
    local flat = redis.call('HGETALL', ctx.b .. b)
    for j = 1, #flat, 2 do
      local v = flat[j + 1]
      local live = live_out(ctx, v)
      if #live > 0 then
        out[#out + 1] = flat[j]
        out[#out + 1] = u32(v, 2)
        out[#out + 1] = parent_of(v)
        out[#out + 1] = table.concat(live)
        note_workers(live, seen, known)
      end
    end
  end
  return { out, worker_rows(ctx, seen, {}) }
end

-- Drops dead placements and blocks, `count` buckets per call, sharing one cursor between all
-- indexers. Returns 1 while a sweep is pending, 0 when everything is clean.
local function kvp_sweep(keys, args)
  local ctx = new_ctx(keys, args)
  local mkey = ctx.base .. ':m'
  local m = redis.call('HMGET', mkey, 'gcg', 'swg', 'swc', 'pg')
  local gcg, swg = tonumber(m[1]) or 0, tonumber(m[2]) or 0
  local cursor, pass = tonumber(m[3]) or 0, tonumber(m[4]) or 0
  if cursor == 0 then
    if gcg == swg then return 0 end
    pass = gcg
  end
  local last = math.min(cursor + tonumber(args[2]), ctx.nb) - 1
  for b = cursor, last do
    local bkey = ctx.b .. b
    local flat = redis.call('HGETALL', bkey)
    for j = 1, #flat, 2 do
      local k, v = flat[j], flat[j + 1]
      local parts, _, others = rewrite(ctx, v, -1, false)
      if others == 0 then
        redis.call('HDEL', bkey, k)
        redis.call('HDEL', ctx.h .. b, k)
      elseif others * REC + header_len(v) ~= #v then
        redis.call('HSET', bkey, k, string.sub(v, 1, header_len(v)) .. table.concat(parts))
      end
    end
  end
  cursor = last + 1
  if cursor >= ctx.nb then
    cursor = 0
    swg = pass
  end
  redis.call('HSET', mkey, 'swc', cursor, 'pg', pass, 'swg', swg)
  if cursor == 0 and gcg == swg then return 0 end
  return 1
end

-- A partition written before removal freed ids still names its removed workers in wi (their
-- ids out of ws): free those ids once, as kvp_remove would have.
local function free_removed_ids(base)
  local flat = redis.call('HGETALL', base .. ':wi')
  for j = 1, #flat, 2 do
    local wid = flat[j + 1]
    if redis.call('SISMEMBER', base .. ':ws', wid) == 0 then
      redis.call('HDEL', base .. ':wi', flat[j])
      redis.call('HDEL', base .. ':w:' .. wid, 'n')
      redis.call('RPUSH', base .. ':wf', wid)
    end
  end
end

-- Writes nothing, and is refused like kvp_apply while Redis is at its maxmemory (it declares
-- no flags): tells a process whether Redis takes the writes that grow the index.
local function kvp_probe(keys, args)
  check_slot_settled(keys[1])
  return 1
end

-- ARGV: nb, token. Claims an empty partition (boot token) and returns the current token.
local function kvp_boot(keys, args)
  check_slot_settled(keys[1])
  local base = string.sub(keys[1], 1, -3)
  local mkey = base .. ':m'
  redis.call('HSETNX', mkey, 'boot', args[2])
  if redis.call('HSETNX', mkey, 'fr', 1) == 1 then free_removed_ids(base) end
  local nb = redis.call('HGET', mkey, 'nb')
  if not nb then
    redis.call('HSET', mkey, 'nb', args[1])
    nb = args[1]
  end
  return { redis.call('HGET', mkey, 'boot'), tonumber(nb) }
end

-- A holder is "<replica>/<process>": a replica restarted is a new process of the same replica.
local function replica_of(holder)
  return string.match(holder, '^(.*)/[^/]*$') or holder
end

-- ARGV: nb, engine, holder, milliseconds. The engine's writer lease: taken by `holder` when
-- nobody holds it, or when a previous process of its replica does (the replica restarted: it
-- need not wait for the expiry, and the fence refuses the previous process's writes from
-- then on) (returns 1: the holder must rebuild the engine's workers, since writes made or
-- refused while it did not hold it are unknown to it), kept for another `milliseconds` when
-- `holder` holds it (2; 3 when another replica handed it a resync of the engine since its
-- last renewal, 4 when that resync is only if its stream is lost: see below), left alone
-- when another replica does (0). With "release" for milliseconds, `holder` gives it up (a
-- replica leaving: the next one need not wait for the expiry). Redis's clock alone decides
-- the expiry: the replicas' clocks never meet.
--
-- ARGV: nb, engine, holder, milliseconds, "resync", "all" | "lost": a resync of the engine
-- (ResyncEngine) asked of `holder`. When another replica holds the lease, the resync is
-- recorded for it (<base>:r:<engine>, which its next renewal takes: 3 or 4 above; "all" is
-- never lowered to "lost"; it expires with the lease, whose next taker rebuilds anyway)
-- and the reply is {0, <the holder's id>}; otherwise the lease is taken or kept as above,
-- {1 or 2, ""}, and `holder` resyncs the engine itself (a recorded resync stays for its
-- next renewal).
--
-- With `rewrite_only` (kvp_renew, run even at maxmemory) only what rewrites the existing
-- lease key (its expiry, or its holder for a restarted replica's process), deletes, or only
-- reads is done; what could create a key (taking a lease nobody holds, recording a resync
-- for another holder) is refused, nothing written: KVP_GROWS.
local function lease(keys, args, rewrite_only)
  check_slot_settled(keys[1])
  local base = string.sub(keys[1], 1, -3)
  local key = base .. ':l:' .. args[2]
  local asked = base .. ':r:' .. args[2]
  local current = redis.call('GET', key)
  if args[4] == 'release' then
    if current == args[3] then redis.call('DEL', key) end
    return 0
  end
  local resync = args[5] == 'resync'
  if not current or (current ~= args[3] and replica_of(current) == replica_of(args[3])) then
    if rewrite_only and not current then
      return redis.error_reply('KVP_GROWS taking a lease nobody holds creates its key')
    end
    redis.call('SET', key, args[3], 'PX', args[4])
    redis.call('DEL', asked) -- the taker rebuilds the engine from scratch
    if resync then return { 1, '' } end
    return 1
  end
  if current == args[3] then
    redis.call('PEXPIRE', key, args[4])
    if resync then return { 2, '' } end
    local pending = redis.call('GET', asked)
    if not pending then return 2 end
    redis.call('DEL', asked)
    if pending == 'lost' then return 4 end
    return 3
  end
  if resync then
    if rewrite_only then
      return redis.error_reply('KVP_GROWS recording a resync for the holder may create its key')
    end
    if args[6] == 'all' or redis.call('GET', asked) ~= 'all' then
      redis.call('SET', asked, args[6])
    end
    redis.call('PEXPIRE', asked, math.max(1, redis.call('PTTL', key)))
    return { 0, current }
  end
  return 0
end

local function kvp_lease(keys, args) return lease(keys, args, false) end

-- kvp_lease for a lease key that exists (renewed by its holder, taken over by its replica's
-- new process, released), run even while Redis is at its maxmemory (allow-oom): a writer
-- under leases keeps them there, so its removals, which free memory, are not fenced once a
-- lease's term has passed. Everything else is left for kvp_lease (KVP_GROWS).
local function kvp_renew(keys, args) return lease(keys, args, true) end

-- Every name ends with the ABI version, as the library's own (first line).
local ABI = '_v6'
redis.register_function('kvp_apply' .. ABI, kvp_apply)
redis.register_function('kvp_lease' .. ABI, kvp_lease)
redis.register_function('kvp_match' .. ABI, kvp_match)
redis.register_function('kvp_probe' .. ABI, kvp_probe)
-- Run even while Redis is at its maxmemory (allow-oom): they delete and shorten records, or
-- write a few bytes of counters, marks and outcomes (record_outcome) that mostly exist
-- already (kvp_boot writes only into an empty partition; kvp_renew only rewrites an existing
-- lease key), so that the index can shrink back under the cap by itself.
redis.register_function{ function_name = 'kvp_release' .. ABI, callback = kvp_release,
  flags = { 'allow-oom' } }
redis.register_function{ function_name = 'kvp_renew' .. ABI, callback = kvp_renew,
  flags = { 'allow-oom' } }
redis.register_function{ function_name = 'kvp_remove' .. ABI, callback = kvp_remove,
  flags = { 'allow-oom' } }
redis.register_function{ function_name = 'kvp_sweep' .. ABI, callback = kvp_sweep,
  flags = { 'allow-oom' } }
redis.register_function{ function_name = 'kvp_boot' .. ABI, callback = kvp_boot,
  flags = { 'allow-oom' } }
redis.register_function{ function_name = 'kvp_match_ro' .. ABI, callback = kvp_match_ro,
  flags = { 'no-writes' } }
redis.register_function{ function_name = 'kvp_hits' .. ABI, callback = kvp_hits, flags = { 'no-writes' } }
redis.register_function{ function_name = 'kvp_prefix' .. ABI, callback = kvp_prefix,
  flags = { 'no-writes' } }
redis.register_function{ function_name = 'kvp_scan' .. ABI, callback = kvp_scan, flags = { 'no-writes' } }
redis.register_function{ function_name = 'kvp_workers' .. ABI, callback = kvp_workers,
  flags = { 'no-writes' } }
redis.register_function{ function_name = 'kvp_dump' .. ABI, callback = kvp_dump, flags = { 'no-writes' } }

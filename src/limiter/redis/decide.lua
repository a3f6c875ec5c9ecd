-- tollgate's decisions: for each decision, check every window of every
-- counter, then charge all its counters or none (a rejected request
-- consumes nothing). Several decisions may come in one call; they are
-- decided one after the other, each atomically, so later ones see earlier
-- charges exactly as if they had come in separate calls.
--
-- A busy counter is a stream whose entries carry n (the cost of one
-- admitted request) and c (the running total of n). The count inside a
-- window is
--   c(last entry) - c(first entry in the window) + n(that entry)
-- so a window costs two COUNT 1 seeks however many entries it holds.
--
-- A stream costs Redis ~500 B however little it holds, and most counters
-- hold one or two requests (a caller's few requests per window; a flood
-- of fresh keys). So a counter starts compact: a string of its entries,
-- read whole, and becomes a stream only when a write would leave it more
-- than ARGV[2] entries. The string is `ms*n` for the first entry and
-- `delta_ms*n` for the next ones, comma-separated; one entry of one unit
-- is just its 13-digit ms, and two of one unit each less than 100 s apart
-- the first's ms followed by the delta: Redis keeps such a value as an
-- integer, in no more memory than a fixed-window counter's.
--
-- Redis's own work per command is small next to what a redis.call() costs
-- a script (argument objects, the reply turned into Lua tables), so a
-- counter is read at most once per call: the clock is the same for every
-- decision in the call, and what this script appends is known without
-- reading it back. Every entry a call appends carries the call's clock, so
-- all of them fall into or out of any window together: a call writes one
-- entry per counter, n being the sum of the costs it admitted there, after
-- the last decision. A hot counter shared by a batch of decisions costs one
-- XADD, one trim and one expiry per call, whatever the batch size.
--
-- KEYS     every decision's counters, decision after decision (a run's once),
--          then the rings of its bucketed windows (declared for Redis
--          Cluster; found by name)
-- ARGV[1]  a pinned clock in ms for tests, or 0 for the server's TIME
-- ARGV[2]  the most entries a compact counter keeps (0: streams only)
-- ARGV[3]  the number of check shapes, then each: cost, role (bit 1:
--          shadow, never refuses; bit 2: quota, refuses only when no quota
--          key of the decision has room), window count, and (limit,
--          period_ms, precision_ms) triples (precision 0: an exact window;
--          otherwise a bucketed one, see below)
-- then     the number of decision shapes, then each: dry run (0/1: check
--          with the real costs but charge nothing), key count, and the
--          check shape of each key
-- then     the number of entries, then each: a decision's shape, or a run:
--          -n followed by a decision shape, for n decisions of that shape in
--          a row on one counter (one key, exact windows only, neither
--          shadow nor quota, a cost above 0), sent with its key once
-- last     a time in ms on this server's clock after which the call is too
--          late to charge (0: none): its callers have given up on it and
--          applied their failure mode (a Redis paused or stopped ran it
--          when it came back), so it decides but charges nothing
-- Every argument costs Redis about as much as a few lines of this script,
-- and the decisions of a batch are mostly alike: what they share is sent
-- once per call, and a decision is its keys and one number.
--
-- Reply, per decision: admitted (0/1), then per key: charged (0/1), then per
-- window: used (before this request, with what earlier keys of the same
-- decision take from the same counter), reset_ms (until the oldest counted
-- unit leaves), retry_ms (until this cost fits; -1 when it fits now, -2 when
-- it never will: it asks more than the window's whole limit); last, the
-- clock the call decided at (which the caller learns this server's clock
-- from, for the bound above). A run's decisions, one after the other, are
-- a prefix admitted and the rest refused (a refusal charges nothing, so
-- the ones after it meet the same counts): its reply is how many were
-- admitted, whether they were charged (0 when dry or late), then per
-- window: used before the first, reset_ms (the same for all: a window's
-- first entry stays while the run admits), and the refused ones' retry_ms
-- (-1 when none was refused). Their used grows by the cost per charge.
-- A hot counter's decisions then cost Redis a few lines each rather than
-- two arguments and five reply integers.
--
-- A bucketed window (a `precision`) is not kept in the counter's entries
-- but in a ring of its own, key `<counter>|<period>/<precision>` (the same
-- hash tag, so the same Cluster slot): a string of fixed-width counts read
-- and written with BITFIELD, one per bucket of `precision` ms, holding the
-- buckets a unit is counted in (ceil(period / precision) + 1 of them: a unit
-- counts for at least `period`, less than `period + precision`). Its header:
-- u8 width of a count (plus 64: the ring keeps block sums), u48 newest
-- bucket, u48 sum of the counts, u48 oldest bucket that may hold a count;
-- then the counts, then one sum per block of about sqrt(len) counts. Its
-- memory is fixed by the window, not the traffic: 100,000 a day at 1 minute
-- is 1,441 counts and 37 block sums of 17 bits, ~3 KB.
--
-- Running totals are kept modulo M and only ever subtracted from one another:
-- a window's count stays exact (limits and costs are capped far below M by
-- the caller), and a long-lived counter never outgrows a Lua number's 2^53.

local call = redis.call
local M = 1125899906842624 -- 2^50
local tonumber = tonumber
local find, sub, gmatch = string.find, string.sub, string.gmatch

-- Decisions in one call repeat the same few argument strings (limits,
-- periods, costs), and converting a string costs Lua two strtod calls:
-- each distinct string is converted once per call, and the commonest are
-- converted already.
local nums = { ['0'] = 0, ['1'] = 1 }
local function num(s)
  local v = nums[s]
  if v == nil then
    v = tonumber(s)
    nums[s] = v
  end
  return v
end

-- A number handed to redis.call is formatted with %.17g; %d is far cheaper.
local format = string.format
local function int(n)
  return format('%d', n)
end

local pinned = num(ARGV[1])
local now
if pinned > 0 then
  now = pinned
else
  local t = call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- n and c of a stream entry { id, { field, value, ... } }.
local function amounts(key, entry)
  local f = entry[2]
  local n, c
  for i = 1, #f, 2 do
    local name = f[i]
    if name == 'n' then
      -- Mostly a request's cost, the same few values.
      n = num(f[i + 1])
    elseif name == 'c' then
      c = tonumber(f[i + 1])
    end
  end
  -- Another program's stream under our key: said as such, not counted
  -- from, nor Lua's arithmetic on nil.
  if not n or not c then
    return error('counter ' .. key .. ' holds a stream that is not a tollgate counter')
  end
  return n, c
end

-- The ms and sequence parts of a stream entry ID `ms-seq`.
local function id_parts(id)
  local dash = find(id, '-', 1, true)
  return tonumber(sub(id, 1, dash - 1)), tonumber(sub(id, dash + 1))
end

-- The ms part alone (each conversion is a strtod).
local function id_ms(id)
  return tonumber(sub(id, 1, find(id, '-', 1, true) - 1))
end

local compact_max = num(ARGV[2])

-- A compact counter's entries: times, costs and running totals; nil for
-- a string that is not one (another program's value under our key): said
-- as such, not as Lua's arithmetic on nil.
local function parse(v)
  local ms, n, c = {}, {}, {}
  if not find(v, '*', 1, true) then
    -- A 13-digit ms, maybe followed by a delta: digits only (`12345`,
    -- `-5` or `3.5` are no counter of ours).
    if #v < 13 or find(v, '%D') then return nil end
    local t = tonumber(sub(v, 1, 13))
    if not t then return nil end
    ms[1], n[1], c[1] = t, 1, 1
    if #v > 13 then
      local d = tonumber(sub(v, 14))
      if not d then return nil end
      ms[2], n[2], c[2] = t + d, 1, 2
    end
  else
    local t, total, i = 0, 0, 0
    for entry in gmatch(v, '[^,]+') do
      if not find(entry, '^%d+%*%d+$') then return nil end
      local star = find(entry, '*', 1, true)
      local d, cost = tonumber(sub(entry, 1, star - 1)), tonumber(sub(entry, star + 1))
      if not d or not cost then return nil end
      i = i + 1
      t = t + d
      total = total + cost
      ms[i], n[i], c[i] = t, cost, total
    end
    if i == 0 then return nil end
  end
  return { ms = ms, n = n, c = c }
end

local function encode(ms, n)
  local count = #ms
  if n[1] == 1 and ms[1] >= 1e12 and ms[1] < 1e13 then
    if count == 1 then return int(ms[1]) end
    if count == 2 and n[2] == 1 and ms[2] - ms[1] < 100000 then
      return int(ms[1]) .. int(ms[2] - ms[1])
    end
  end
  local parts = { int(ms[1]) .. '*' .. int(n[1]) }
  for i = 2, count do
    parts[i] = int(ms[i] - ms[i - 1]) .. '*' .. int(n[i])
  end
  return table.concat(parts, ',')
end

-- What this call knows of each counter: the running total, the running
-- total and time of its last written entry, per period the first entry inside the window ({ c, n, ms }, or
-- false when none), the entry this call will append (pend_n units, 0 while
-- none, under the ID pend_ms-pend_seq) and the longest window it charged.
local counters = {}
local touched = {}

local function counter(key)
  local s = counters[key]
  if s then return s end
  local total, last_ms, last_seq, compact = 0, -1, 0, nil
  -- TYPE, not a failing XREVRANGE: errors inside a script count in the
  -- server's error statistics, which operators alert on.
  local kind = call('TYPE', key).ok
  if kind == 'stream' then
    local last = call('XREVRANGE', key, '+', '-', 'COUNT', '1')[1]
    if last then
      local _, c = amounts(key, last)
      total = c
      last_ms, last_seq = id_parts(last[1])
    end
  elseif kind == 'string' then
    compact = parse(call('GET', key))
    if not compact then return error('counter ' .. key .. ' holds a string that is not a tollgate counter') end
    local count = #compact.ms
    total, last_ms = compact.c[count], compact.ms[count]
  elseif kind == 'none' then
    if compact_max > 0 then compact = { ms = {}, n = {}, c = {} } end
  else
    return error('counter ' .. key .. ' holds a ' .. kind)
  end
  s = { total = total, written = total, last_ms = last_ms, last_seq = last_seq, first = {},
        empty = false, pend_n = 0, pend_ms = 0, pend_seq = 0, longest = 0, compact = compact }
  counters[key] = s
  return s
end

local function first_in_window(key, s, period)
  local f = s.first[period]
  if f ~= nil then return f end
  f = false
  if s.compact then
    local cm, start = s.compact, now - period + 1
    for i = 1, #cm.ms do
      if cm.ms[i] >= start then
        -- The fourth field, the entry's index, marks a compact counter's.
        f = { cm.c[i], cm.n[i], cm.ms[i], i }
        break
      end
    end
  elseif s.last_ms >= 0 then
    local start = now - period + 1
    if start < 0 then start = 0 end
    local e = call('XRANGE', key, int(start), '+', 'COUNT', '1')[1]
    if e then
      local n, c = amounts(key, e)
      f = { c, n, id_ms(e[1]) }
    end
  end
  if not f and s.pend_n > 0 then
    -- Only what this call admitted, not written yet: c - n is the total
    -- before it, however much more the call goes on to admit.
    f = { s.total, s.pend_n, s.pend_ms }
  end
  if not f then s.empty = true end
  s.first[period] = f
  return f
end

-- When `excess` units of the window whose first entry is f have left it.
-- Running totals grow entry by entry, so the entry that frees enough is found
-- by a binary search over time (one COUNT 1 seek per step), never by reading
-- the entries one by one: its cost does not grow with the request's cost.
local function retry_after(key, s, f, period, excess)
  local base = f[1] - f[2]
  local at
  if f[2] >= excess then
    at = f[3]
  elseif s.last_ms < 0 or (s.written - base) % M < excess or (s.compact and not f[4]) then
    -- Only what this call admitted is left to leave; it is the newest.
    at = s.pend_ms
  elseif s.compact then
    local cm = s.compact
    at = s.pend_ms
    for i = f[4], #cm.ms do
      if cm.c[i] - base >= excess then
        at = cm.ms[i]
        break
      end
    end
  else
    -- Invariant: the entries up to lo free less than excess; the one at hi
    -- frees enough.
    local lo, hi = f[3] - 1, s.last_ms
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      local e = call('XREVRANGE', key, int(mid), '-', 'COUNT', '1')[1]
      local c = base
      if e then c = select(2, amounts(key, e)) end
      if e and (c - base) % M >= excess then
        hi = id_ms(e[1])
      else
        lo = mid
      end
    end
    at = hi
  end
  return math.min(at + period - now, period)
end

-- Bucketed windows ------------------------------------------------------

-- Defined on a call's first bucketed window only: a script's body runs on
-- every call, and making these closures would cost every exact decision.
local ring, ring_window, ring_charge, ring_flush
local ring_order = false
local function rings_setup()
  local RING = 152 -- bits before the first count: the header
  local CHUNK = 200 -- BITFIELD operations per call (unpack's stack is small)
  local BLOCKED = 64 -- added to the header's width: the ring keeps block sums
  local rings = {}
  ring_order = {}

  -- Bits that hold every count up to `limit`.
  local function bits_for(limit)
    local w = 1
    while 2 ^ w <= limit do w = w + 1 end
    return w
  end

  -- Buckets per block (0: none). A ring also keeps each block's sum, so a
  -- walk or a long advance reads one sum per block where it would read
  -- every count: about sqrt(len) blocks of sqrt(len) buckets, a multiple of
  -- 8 so that a block's counts are whole bytes (zeroed by one SETRANGE).
  -- The sum of the newest bucket's block leaves out what was charged since
  -- the ring entered that block (a charge writes only its count; keeping
  -- the sum too cost every charge ~7%); it is summed again when the ring
  -- moves on, and never read before.
  local function block_size(len)
    if len < 24 then return 0 end
    return 8 * math.ceil(math.sqrt(len) / 8)
  end

  local function slot(s, j)
    return RING + (j % s.len) * s.w
  end

  -- What a call needs only when a ring is made, moves to a new bucket or
  -- refuses: defined on first need (making closures costs every call).
  local block_of, block_sum, whole_block, fields, slots, pending
  local ring_find, clear, advance, make, rewrite
  local function cold()
    if advance then return end

    function block_of(s, j)
      return math.floor((j % s.len) / s.b)
    end

    function block_sum(s, blk)
      return RING + (s.len + blk) * s.w
    end

    -- Whether buckets j..j+b-1 are one whole block, inside j..to.
    function whole_block(s, j, to)
      local x = j % s.len
      return s.b > 0 and x % s.b == 0 and x + s.b <= s.len and j + s.b - 1 <= to
    end

    -- Runs BITFIELD `op` at the bit offsets `at` (op 'GET', or 'SET' to
    -- `values`, in order, or to 0; 'INCRBY' by `values`), in chunks; returns
    -- the counts they held.
    function fields(s, op, at, values)
      local out = {}
      local i = 1
      while i <= #at do
        local upto = math.min(#at, i + CHUNK - 1)
        local args = {}
        for x = i, upto do
          args[#args + 1] = op
          args[#args + 1] = s.type
          args[#args + 1] = at[x]
          if op ~= 'GET' then args[#args + 1] = values and values[x] or 0 end
        end
        local got = call('BITFIELD', s.key, unpack(args))
        for y = 1, #got do out[#out + 1] = got[y] end
        i = upto + 1
      end
      return out
    end

    function slots(s, from, to)
      local at = {}
      for j = from, to do at[#at + 1] = slot(s, j) end
      return at
    end

    -- The count of bucket j, with what this call charged to it.
    function pending(s, j)
      if j == s.cur then return s.pend end
      return 0
    end

    -- The first bucket from..to at which the counts from `from` on (with
    -- this call's charge) reach `need` (>= 1), or nil. Read in chunks
    -- growing from 8, a whole block as its sum: the answer is usually among
    -- the oldest few buckets, and a walk must not read the whole ring for it.
    function ring_find(s, from, to, need)
      local got, j, n = 0, from, 8
      while j <= to do
        -- Each unit is a bucket, or a block by its sum (not the newest
        -- bucket's, whose sum is behind).
        local starts, blocks, at = {}, {}, {}
        while j <= to and #at < n do
          starts[#starts + 1] = j
          if whole_block(s, j, to) and j + s.b - 1 < s.cur then
            blocks[#at + 1] = true
            at[#at + 1] = block_sum(s, block_of(s, j))
            j = j + s.b
          else
            at[#at + 1] = slot(s, j)
            j = j + 1
          end
        end
        local counts = fields(s, 'GET', at)
        for i = 1, #at do
          local c = counts[i] + pending(s, starts[i])
          if got + c >= need then
            if not blocks[i] then return starts[i] end
            local inner = fields(s, 'GET', slots(s, starts[i], starts[i] + s.b - 1))
            for m = 1, #inner do
              got = got + inner[m]
              if got >= need then return starts[i] + m - 1 end
            end
            return starts[i] + s.b - 1
          end
          got = got + c
        end
        n = math.min(n * 8, CHUNK)
      end
      return nil
    end

    -- Zeroes buckets from..to (fewer than len) and returns what they held:
    -- a whole block by its sum and one SETRANGE, the buckets around it one
    -- by one with their blocks' sums lowered.
    function clear(s, from, to)
      local gone, j = 0, from
      local singles, bucket, blocks = {}, {}, {}
      while j <= to do
        if whole_block(s, j, to) then
          blocks[#blocks + 1] = block_of(s, j)
          j = j + s.b
        else
          singles[#singles + 1] = slot(s, j)
          bucket[#bucket + 1] = j
          j = j + 1
        end
      end
      if #singles > 0 then
        local olds = fields(s, 'SET', singles)
        local deltas, order = {}, {}
        for i = 1, #olds do
          gone = gone + olds[i]
          if s.b > 0 and olds[i] > 0 then
            local blk = block_of(s, bucket[i])
            if not deltas[blk] then
              deltas[blk] = 0
              order[#order + 1] = blk
            end
            deltas[blk] = deltas[blk] - olds[i]
          end
        end
        if #order > 0 then
          local at, by = {}, {}
          for i, blk in ipairs(order) do
            at[i], by[i] = block_sum(s, blk), deltas[blk]
          end
          fields(s, 'INCRBY', at, by)
        end
      end
      if #blocks > 0 then
        local at = {}
        for i, blk in ipairs(blocks) do at[i] = block_sum(s, blk) end
        local sums = fields(s, 'SET', at)
        for i = 1, #sums do gone = gone + sums[i] end
        local bytes = s.b * s.w / 8
        local i = 1
        while i <= #blocks do
          -- Blocks next to each other are zeroed together.
          local run = 1
          while blocks[i + run] == blocks[i] + run do run = run + 1 end
          call('SETRANGE', s.key, RING / 8 + blocks[i] * bytes, string.rep('\0', run * bytes))
          i = i + run
        end
      end
      return gone
    end

    -- Moves the ring to bucket b: buckets that left the window are subtracted
    -- from the sum and zeroed (their slots become the new buckets').
    function advance(s, b)
      if s.sum == 0 or b - s.cur >= s.len then
        -- Every count left (block sums too, the newest one's included).
        call('DEL', s.key)
        s.sum, s.first, s.fresh = 0, b, true
      else
        -- Bucket j's slot held bucket j - len; those before `first` are zero.
        local from = math.max(s.cur + 1, s.first + s.len)
        if from <= b then s.sum = s.sum - clear(s, from, b) end
        if s.b > 0 and (b - s.cur >= s.b or block_of(s, b) ~= block_of(s, s.cur)) then
          -- Leaving the newest bucket's block: its sum, from its counts.
          local blk = block_of(s, s.cur)
          local start = s.cur - (s.cur % s.len - blk * s.b)
          local counts = fields(s, 'GET', slots(s, start, start + math.min(s.b, s.len - blk * s.b) - 1))
          local sum = 0
          for i = 1, #counts do sum = sum + counts[i] end
          fields(s, 'SET', { block_sum(s, blk) }, { sum })
        end
        if s.first <= b - s.len then
          -- The oldest counted bucket left: the next one that holds a count.
          s.first = ring_find(s, b - s.len + 1, s.cur, 1) or b
        end
      end
      s.cur = b
      s.dirty = true
    end

    -- Creates the ring's string at its whole size: one allocation of the
    -- size it needs, where growing it a write at a time would leave Redis's
    -- doubling (twice the memory) behind.
    function make(s)
      local nb = 0
      if s.b > 0 then nb = math.ceil(s.len / s.b) end
      call('SETRANGE', s.key, math.ceil((RING + (s.len + nb) * s.w) / 8) - 1, '\0')
      s.fresh = false
    end

    -- Rewrites the ring with counts of `w` bits (a limit raised past its
    -- width, or a ring written before block sums), and its block sums.
    function rewrite(s, w)
      local from = math.max(s.first, s.cur - s.len + 1)
      local counts = {}
      if s.sum > 0 then counts = fields(s, 'GET', slots(s, from, s.cur)) end
      call('DEL', s.key)
      s.w, s.type = w, 'u' .. w
      s.fresh = true
      if s.sum > 0 then
        make(s)
        fields(s, 'SET', slots(s, from, s.cur), counts)
        if s.b > 0 then
          local sums, at, by = {}, {}, {}
          for i = 1, #counts do
            local blk = block_of(s, from + i - 1)
            sums[blk] = (sums[blk] or 0) + counts[i]
          end
          for blk, n in pairs(sums) do
            at[#at + 1], by[#by + 1] = block_sum(s, blk), n
          end
          fields(s, 'SET', at, by)
        end
      end
      s.dirty = true
    end
  end

  function ring(key, limit, period, precision)
    local rkey = key .. '|' .. int(period) .. '/' .. int(precision)
    local s = rings[rkey]
    if not s then
      local b = math.floor(now / precision)
      local h = redis.pcall('BITFIELD', rkey, 'GET', 'u8', 0, 'GET', 'u48', 8, 'GET', 'u48', 56, 'GET', 'u48', 104)
      if h.err then return error('ring ' .. rkey .. ' holds a ' .. call('TYPE', rkey).ok) end
      local len = math.floor((period + precision - 1) / precision) + 1
      s = { key = rkey, len = len, b = block_size(len), p = precision, period = period, pend = 0, dirty = false,
            fresh = h[1] == 0 }
      if h[1] == 0 then
        s.w, s.cur, s.sum, s.first = bits_for(limit), b, 0, b
        s.type = 'u' .. s.w
      else
        s.w, s.cur, s.sum, s.first = h[1] % BLOCKED, h[2], h[3], h[4]
        -- Another program's value under the ring's key: said as such, not
        -- read as counts (a newest bucket millions of years ahead made a
        -- retry time of as many years). A clock stepped back leaves the
        -- newest bucket ahead by less than a window.
        if h[1] >= 2 * BLOCKED or s.w == 0 or s.w > 52 or s.cur > b + len or s.first > s.cur then
          return error('ring ' .. rkey .. ' holds a value that is not a tollgate ring')
        end
        s.type = 'u' .. s.w
        if (h[1] < BLOCKED and s.b > 0) or b > s.cur then cold() end
        if h[1] < BLOCKED and s.b > 0 then rewrite(s, s.w) end
        -- A clock stepped back stays in the newest bucket.
        if b > s.cur then advance(s, b) end
      end
      rings[rkey] = s
      ring_order[#ring_order + 1] = s
    end
    local need = bits_for(limit)
    if need > s.w then
      cold()
      rewrite(s, need)
    end
    return s
  end

  -- When units of bucket j stop counting.
  local function leaves(s, j)
    return (j + s.len) * s.p - now
  end

  -- used, reset_ms, retry_ms of a bucketed window, as for an exact one.
  function ring_window(s, limit, claim, cost)
    local used = s.sum + claim
    -- Empty: when a unit admitted now would leave.
    local reset = leaves(s, s.cur)
    if s.sum > 0 then reset = leaves(s, s.first) end
    local retry = -1
    if used + cost > limit then
      if claim + cost > limit then
        retry = -2
      else
        -- Buckets leave oldest first: the one whose leaving frees enough,
        -- most often among the oldest 8, read here without the walk's
        -- machinery.
        local need = used + cost - limit
        local upto = math.min(s.cur, s.first + 7)
        local args = {}
        for x = s.first, upto do
          args[#args + 1] = 'GET'
          args[#args + 1] = s.type
          args[#args + 1] = slot(s, x)
        end
        local counts = call('BITFIELD', s.key, unpack(args))
        local got, j = 0, nil
        for i = 1, #counts do
          local at = s.first + i - 1
          got = got + counts[i]
          if at == s.cur then got = got + s.pend end
          if got >= need then
            j = at
            break
          end
        end
        if not j and upto < s.cur then
          cold()
          j = ring_find(s, upto + 1, s.cur, need - got)
        end
        retry = leaves(s, j or s.cur)
      end
    end
    return used, reset, retry
  end

  function ring_charge(s, cost)
    if s.sum == 0 then s.first = s.cur end
    s.sum = s.sum + cost
    s.pend = s.pend + cost
  end

  -- Writes every ring this call read or charged.
  function ring_flush()
    for _, s in ipairs(ring_order) do
      if s.sum == 0 then
        -- A ring without counts is as good as none.
        if not s.fresh then call('DEL', s.key) end
      elseif s.dirty or s.pend > 0 then
        if s.fresh then
          cold()
          make(s)
        end
        local args = { 'SET', 'u8', 0, s.w + BLOCKED, 'SET', 'u48', 8, s.cur, 'SET', 'u48', 56, s.sum,
                       'SET', 'u48', 104, s.first }
        if s.pend > 0 then
          args[#args + 1] = 'INCRBY'
          args[#args + 1] = s.type
          args[#args + 1] = slot(s, s.cur)
          args[#args + 1] = s.pend
        end
        call('BITFIELD', s.key, unpack(args))
        if pinned == 0 then call('PEXPIRE', s.key, int(s.len * s.p)) end
      end
    end
  end
end

-- The shapes of this call's checks and decisions, each one array (read
-- by index, the cheapest table access Lua has):
--   check shape: cost, shadow, quota, longest exact window (which the
--   counter must outlive), window count, then limit, period, precision
--   per window
--   decision shape: dry run, then its keys' check shapes
local not_after = num(ARGV[#ARGV])
local late = not_after > 0 and now > not_after
local a = 4
local shapes = {}
for i = 1, num(ARGV[3]) do
  local role, nwin = num(ARGV[a + 1]), num(ARGV[a + 2])
  local shape = { num(ARGV[a]), role % 2 == 1, role >= 2, 0, nwin }
  a = a + 3
  for w = 1, nwin do
    local period, precision = num(ARGV[a + 1]), num(ARGV[a + 2])
    shape[3 * w + 3], shape[3 * w + 4], shape[3 * w + 5] = num(ARGV[a]), period, precision
    if precision == 0 and period > shape[4] then shape[4] = period end
    a = a + 3
  end
  shapes[i] = shape
end
local kinds = {}
for i = 1, num(ARGV[a]) do
  local kind = { ARGV[a + 1] == '1' }
  for j = 1, num(ARGV[a + 2]) do kind[j + 1] = shapes[num(ARGV[a + 2 + j])] end
  kinds[i] = kind
  a = a + 2 + #kind - 1
end
a = a + 1 -- the number of entries

-- Before the call's first charge of `cost` to counter s (`key`): the entry
-- this call appends, and the first entry of windows that had none (a
-- counter is only found empty before its first charge). The charge itself is
-- inlined where it is made (a Lua call costs as much as the charge).
local function open(key, s, cost)
  if s.pend_n == 0 then
    -- The entry carries this call's clock (never before the last entry,
    -- which a clock step back could otherwise ask for), so no later call
    -- can see an entry from its own future. The whole ID is spelled out:
    -- `ms-*` would need Redis 7.
    local ms, seq = now, 0
    if s.last_ms >= ms then
      ms, seq = s.last_ms, s.last_seq + 1
    end
    s.pend_ms, s.pend_seq = ms, seq
    touched[#touched + 1] = key
  end
  -- Every window of this counter that had no entry has this one now,
  -- including windows other decisions in this call asked about. Its c - n
  -- stays the total before this call's first charge, which is what counts
  -- from it: the first charge's total and cost.
  if s.empty then
    local first_total = (s.total + cost) % M
    for period, f in pairs(s.first) do
      if f == false then s.first[period] = { first_total, cost, s.pend_ms } end
    end
    s.empty = false
  end
end

-- A dry run charges nothing, but where a real call would write it makes
-- one write that changes nothing: SETRANGE of nothing to a key no counter
-- or ring can be named (a counter's key ends its last component with `|`,
-- so `|dry` could only begin another, which starts with digits), in the
-- counter's hash tag. A Redis that refuses writes (out of memory under
-- noeviction, a read-only replica, a failed save) refuses it as it
-- refuses the real call's first write, so a dry run (explain) answers
-- what a real decision gets. Once per call is enough.
local probed = false
local function probe(key)
  if not probed then
    probed = true
    call('SETRANGE', key .. '|dry', 0, '')
  end
end

-- Per key of the decision being made, three slots each (its counter,
-- whether it fits, its rings), reused from decision to decision.
local held = {}
local reply = {}
local r = 0
local k = 0
-- Where the next entry's arguments begin.
local e = a + 1
for _ = 1, num(ARGV[a]) do
  local x = num(ARGV[e])
  e = e + 1
  if x < 0 then
    -- A run of -x decisions of one shape on KEYS[k + 1], decided as that
    -- many one after the other would be (see the reply above). Only the
    -- caller checks that the shape may make a run (script.rs, `runnable`):
    -- a cost of 0, or a shadow, quota or bucketed check, would be answered
    -- wrongly here.
    local kind = kinds[num(ARGV[e])]
    e = e + 1
    local n = -x
    local key = KEYS[k + 1]
    local shape = kind[2]
    local cost = shape[1]
    local s = counter(key)
    local room = n
    -- Filled in order: a table written past its end keeps it in a hash.
    reply[r + 1], reply[r + 2] = 0, 0
    for w = 1, shape[5] do
      local limit, period = shape[3 * w + 3], shape[3 * w + 4]
      local f = first_in_window(key, s, period)
      local used, reset = 0, period
      if f then
        used = (s.total - f[1]) % M + f[2]
        reset = math.min(f[3] + period - now, period)
      end
      local fit = 0
      if used + cost <= limit then fit = math.floor((limit - used) / cost) end
      if fit < room then room = fit end
      reply[r + 3 * w], reply[r + 3 * w + 1], reply[r + 3 * w + 2] = used, reset, -1
    end
    local charged = 0
    if kind[1] or late then
      -- Nothing is charged: each meets the counts the first met.
      if room > 0 then
        room = n
        if not late then probe(key) end
      end
    elseif room > 0 then
      charged = 1
      if s.pend_n == 0 then open(key, s, cost) end
      s.pend_n = s.pend_n + room * cost
      s.total = (s.total + room * cost) % M
      if shape[4] > s.longest then s.longest = shape[4] end
    end
    reply[r + 1] = room
    reply[r + 2] = charged
    for w = 1, shape[5] do
      local retry = -1
      if room < n then
        local limit, period = shape[3 * w + 3], shape[3 * w + 4]
        local used = reply[r + 3 * w] + charged * room * cost
        if used + cost > limit then
          if cost > limit then
            retry = -2
          else
            retry = retry_after(key, s, first_in_window(key, s, period), period, used + cost - limit)
          end
        end
      end
      reply[r + 3 * w + 2] = retry
    end
    r = r + 2 + 3 * shape[5]
    k = k + 1
  else
    local kind = kinds[x]
    local dry = kind[1] or late
    local nkeys = #kind - 1
    local admitted = 1
    local quotas, quota_room = false, false
    local base = r + 1
    r = r + 1
    -- Units earlier keys of this decision take from a counter: a counter
    -- named twice is checked against both costs, not twice against one.
    local claims = false
    if nkeys > 1 then claims = {} end
    for i = 1, nkeys do
      local key = KEYS[k + i]
      local shape = kind[i + 1]
      local cost = shape[1]
      local s = false
      local claim = claims and claims[key] or 0
      local fits = true
      local bucketed = false
      r = r + 1 -- charged, filled in below
      for w = 1, shape[5] do
        local limit, period, precision = shape[3 * w + 3], shape[3 * w + 4], shape[3 * w + 5]
        local used, reset, retry = claim, period, -1
        if precision > 0 then
          if not ring then rings_setup() end
          local rs = ring(key, limit, period, precision)
          if not bucketed then bucketed = {} end
          bucketed[#bucketed + 1] = rs
          used, reset, retry = ring_window(rs, limit, claim, cost)
          if retry ~= -1 then fits = false end
        else
          -- The entries are read only for a key with an exact window.
          if not s then s = counter(key) end
          local f = first_in_window(key, s, period)
          if f then
            used = (s.total - f[1]) % M + f[2] + claim
            -- Never past a whole period, even if the clock stepped back.
            reset = math.min(f[3] + period - now, period)
          end
          if used + cost > limit then
            fits = false
            if claim + cost > limit then
              retry = -2
            else
              retry = retry_after(key, s, f, period, used + cost - limit)
            end
          end
        end
        reply[r + 1] = used
        reply[r + 2] = reset
        reply[r + 3] = retry
        r = r + 3
      end
      if shape[3] then
        quotas = true
        if fits or shape[2] then quota_room = true end
      elseif not fits and not shape[2] then
        admitted = 0
      end
      if fits and claims then claims[key] = claim + cost end
      local h = 3 * i
      held[h - 2], held[h - 1], held[h] = s, fits, bucketed
    end

    if quotas and not quota_room then admitted = 0 end
    reply[base] = admitted
    -- Each key's charged flag comes before its windows.
    local at = base + 1
    for i = 1, nkeys do
      local h = 3 * i
      local s, fits, bucketed = held[h - 2], held[h - 1], held[h]
      local shape = kind[i + 1]
      local cost = shape[1]
      local charged = 0
      if admitted == 1 and not dry and fits and cost > 0 then
        charged = 1
        if bucketed then
          for _, rs in ipairs(bucketed) do ring_charge(rs, cost) end
        end
        if s then
          if s.pend_n == 0 then open(KEYS[k + i], s, cost) end
          s.pend_n = s.pend_n + cost
          s.total = (s.total + cost) % M
          if shape[4] > s.longest then s.longest = shape[4] end
        end
      end
      if admitted == 1 and dry and not late and fits and cost > 0 then probe(KEYS[k + i]) end
      reply[at] = charged
      at = at + 1 + 3 * shape[5]
    end
    k = k + nkeys
  end
end

-- A pinned clock runs apart from real time; its keys are the test's to delete.
local function expire(key, s)
  if pinned == 0 then call('PEXPIRE', key, int(s.longest)) end
end

for _, key in ipairs(touched) do
  local s = counters[key]
  local cm = s.compact
  if cm then
    -- Entries no window of this call can see again are dropped, as the
    -- stream's MINID trim drops them.
    local keep, ms, n = now - s.longest + 1, {}, {}
    for i = 1, #cm.ms do
      if cm.ms[i] >= keep then
        ms[#ms + 1], n[#n + 1] = cm.ms[i], cm.n[i]
      end
    end
    if ms[#ms] == s.pend_ms then
      n[#n] = n[#n] + s.pend_n
    else
      ms[#ms + 1], n[#n + 1] = s.pend_ms, s.pend_n
    end
    if #ms <= compact_max then
      if pinned == 0 then
        call('SET', key, encode(ms, n), 'PX', int(s.longest))
      else
        call('SET', key, encode(ms, n))
      end
    else
      -- Grown past the compact form: the same entries, as a stream.
      call('DEL', key)
      local c = 0
      for i = 1, #ms do
        c = c + n[i]
        call('XADD', key, format('%d-0', ms[i]), 'n', int(n[i]), 'c', int(c))
      end
      expire(key, s)
    end
  else
    call('XADD', key, 'MINID', '~', int(now - s.longest + 1), format('%d-%d', s.pend_ms, s.pend_seq),
         'n', int(s.pend_n), 'c', int(s.total))
    expire(key, s)
  end
end
if ring_order then ring_flush() end
reply[#reply + 1] = now
return reply

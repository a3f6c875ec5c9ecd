-- tollgate's decisions: for each decision, check every window of every
-- counter, then charge all its counters or none (a rejected request
-- consumes nothing). Several decisions may come in one call; they are
-- decided one after the other, each atomically, so later ones see earlier
-- charges exactly as if they had come in separate calls.
--
-- Each counter is a stream whose entries carry n (the cost of one admitted
-- request) and c (the running total of n). The count inside a window is
--   c(last entry) - c(first entry in the window) + n(that entry)
-- so a window costs two COUNT 1 seeks however many entries it holds.
--
-- KEYS     every decision's counters, decision after decision
-- ARGV[1]  a pinned clock in ms for tests, or 0 for the server's TIME
-- ARGV[2]  the number of decisions
-- then per decision: its key count, dry run (0/1: check with the real costs
-- but charge nothing), and per key: cost, shadow (0/1), window count, and
-- (limit, period_ms) pairs
--
-- Reply, per decision: admitted (0/1), then per key: charged (0/1), then per
-- window: used (before this request), reset_ms (until the oldest counted
-- unit leaves), retry_ms (until this cost fits; -1 when it fits now).

local pinned = tonumber(ARGV[1])
local now
if pinned > 0 then
  now = pinned
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function field(entry, name)
  local f = entry[2]
  for i = 1, #f, 2 do
    if f[i] == name then return tonumber(f[i + 1]) end
  end
  return 0
end

local function id_ms(id)
  return tonumber(string.match(id, '^(%d+)'))
end

local reply = {}
local k = 1
local a = 3
for _ = 1, tonumber(ARGV[2]) do
  local nkeys = tonumber(ARGV[a])
  local dry = ARGV[a + 1] == '1'
  a = a + 2
  local plans = {}
  local admitted = 1
  for i = 1, nkeys do
    local key = KEYS[k + i - 1]
    local cost = tonumber(ARGV[a])
    local shadow = ARGV[a + 1] == '1'
    local nwin = tonumber(ARGV[a + 2])
    a = a + 3
    local total = 0
    local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
    if last[1] then total = field(last[1], 'c') end
    local fits = true
    local longest = 0
    local wins = {}
    for w = 1, nwin do
      local limit = tonumber(ARGV[a])
      local period = tonumber(ARGV[a + 1])
      a = a + 2
      if period > longest then longest = period end
      local start = now - period + 1
      if start < 0 then start = 0 end
      local used, reset, retry = 0, period, -1
      if total > 0 then
        local first = redis.call('XRANGE', key, start, '+', 'COUNT', 1)
        if first[1] then
          used = total - field(first[1], 'c') + field(first[1], 'n')
          reset = id_ms(first[1][1]) + period - now
        end
      end
      if used + cost > limit then
        fits = false
        if cost > limit then
          retry = period
        else
          -- Entries leave oldest first: walk until `excess` units have left.
          local excess = used + cost - limit
          local run = 0
          for _, e in ipairs(redis.call('XRANGE', key, start, '+', 'COUNT', excess)) do
            run = run + field(e, 'n')
            if run >= excess then
              retry = id_ms(e[1]) + period - now
              break
            end
          end
        end
      end
      wins[w] = { used, reset, retry }
    end
    if not fits and not shadow then admitted = 0 end
    plans[i] = { key = key, fits = fits, cost = cost, total = total, longest = longest, wins = wins }
  end

  reply[#reply + 1] = admitted
  for i = 1, nkeys do
    local p = plans[i]
    local charged = 0
    if admitted == 1 and not dry and p.fits and p.cost > 0 then
      local id = '*'
      if pinned > 0 then id = now .. '-*' end
      redis.call('XADD', p.key, 'MINID', '~', now - p.longest + 1, id, 'n', p.cost, 'c', p.total + p.cost)
      -- A pinned clock runs apart from real time; its keys are the test's to delete.
      if pinned == 0 then redis.call('PEXPIRE', p.key, p.longest) end
      charged = 1
    end
    reply[#reply + 1] = charged
    for _, w in ipairs(p.wins) do
      reply[#reply + 1] = w[1]
      reply[#reply + 1] = w[2]
      reply[#reply + 1] = w[3]
    end
  end
  k = k + nkeys
end
return reply

-- The baseline tollgate is measured against in bench/run: the published way
-- of counting with streams, which reads every entry of the window and sums
-- it. Same arguments as decide.lua for one decision of one key and window.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cost = tonumber(ARGV[5])
local limit = tonumber(ARGV[8])
local period = tonumber(ARGV[9])
local used = 0
for _, e in ipairs(redis.call('XRANGE', KEYS[1], now - period + 1, '+')) do
  used = used + tonumber(e[2][2])
end
if used + cost > limit then return { 0 } end
if cost == 0 then return { 1 } end
redis.call('XADD', KEYS[1], '*', 'n', cost, 'c', 0)
redis.call('PEXPIRE', KEYS[1], period)
return { 1 }

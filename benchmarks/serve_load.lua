-- wrk script: POST /v1/ads for random users at a fixed per-connection rate; prints JSON at the end.
-- env: RATE (requests/s over all connections), CONNS (wrk -c), USERS (user pool), K, SLOT
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_usec; } timeval;
int gettimeofday(timeval *tv, void *tz);
]]
local tv = ffi.new("timeval")
local function now_ms()
  ffi.C.gettimeofday(tv, nil)
  return tonumber(tv.tv_sec) * 1000 + tonumber(tv.tv_usec) / 1000
end

local rate = tonumber(os.getenv("RATE") or "100")
local conns = tonumber(os.getenv("CONNS") or "10")
local users = tonumber(os.getenv("USERS") or "5000")
local k = tonumber(os.getenv("K") or "10")
local slots = {"feed", "search", "splash"}
-- one wrk thread (-t1) runs every connection, so pacing this thread paces the whole load
local interval = 1000.0 / rate
local next_at = nil
local counter = 0

function init(args)
  math.randomseed(os.time() + tonumber(tostring(wrk.thread):match("0x(%x+)") or "0", 16) % 100000)
end

function delay()
  local t = now_ms()
  if next_at == nil then next_at = t + math.random() * interval end
  local d = next_at - t
  next_at = math.max(next_at, t) + interval
  if d < 0 then return 0 end
  return d
end

function request()
  counter = counter + 1
  local body = string.format('{"user_id":"u%d","slot":"%s","k":%d}', math.random(users), slots[math.random(3)], k)
  return wrk.format("POST", "/v1/ads", {["Content-Type"] = "application/json"}, body)
end


function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,' ..
    '"err_connect":%d,"err_read":%d,"err_write":%d,"err_status":%d,"err_timeout":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end

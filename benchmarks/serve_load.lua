-- wrk script: POST /v1/ads for random users at a fixed per-connection rate; prints JSON at the end.
-- env: RATE (requests/s over all threads), BODIES and PATHNAME (below), THREADS (wrk -t, default 1), CONNS (wrk -c), USERS
-- (user pool), K, QOS (the requests' `qos` class; unset: none, the slot's default), DEADLINE_MS
-- (the requests' `deadline_ms`; unset: none, the class's deadline)
-- With one connection per thread (-tN -cN) each thread times its own requests, so the output also
-- has status counts and the P99 of the 200s alone (`ok_p99_us`): a shed 503 answers fast and would
-- pull wrk's overall percentiles down.
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
local threads_n = tonumber(os.getenv("THREADS") or "1")
local users = tonumber(os.getenv("USERS") or "5000")
local k = tonumber(os.getenv("K") or "10")
local qos = os.getenv("QOS") or ""
local deadline_ms = os.getenv("DEADLINE_MS") or ""
local slots = {"feed", "search", "splash"}
-- BODIES: a file of request bodies, one JSON per line, sent at random to PATHNAME (default
-- /v1/ads) instead of the generated /v1/ads requests (`benchmarks/serve_routes.py`)
local path = os.getenv("PATHNAME") or "/v1/ads"
local bodies = {}
if (os.getenv("BODIES") or "") ~= "" then
  for line in io.lines(os.getenv("BODIES")) do table.insert(bodies, line) end
end
-- each thread paces its connections, so all threads together send RATE requests/s
local interval = 1000.0 * threads_n / rate
local next_at = nil
local sent_at = nil
-- globals, not locals: done() reads them from each thread with thread:get
ok_ms = {}
codes = {}
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

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
  if #bodies > 0 then
    sent_at = now_ms()
    return wrk.format("POST", path, {["Content-Type"] = "application/json"}, bodies[math.random(#bodies)])
  end
  local extra = ""
  if qos ~= "" then extra = string.format(',"qos":"%s"', qos) end
  if deadline_ms ~= "" then extra = extra .. string.format(',"deadline_ms":%s', deadline_ms) end
  local body = string.format('{"user_id":"u%d","slot":"%s","k":%d%s}', math.random(users), slots[math.random(3)], k, extra)
  sent_at = now_ms()
  return wrk.format("POST", "/v1/ads", {["Content-Type"] = "application/json"}, body)
end

function response(status, headers, body)
  local key = tostring(status)
  codes[key] = (codes[key] or 0) + 1
  if status == 200 and sent_at ~= nil then
    table.insert(ok_ms, now_ms() - sent_at)
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  local all_ok = {}
  local all_codes = {}
  for _, thread in ipairs(threads) do
    for _, v in ipairs(thread:get("ok_ms") or {}) do table.insert(all_ok, v) end
    for c, n in pairs(thread:get("codes") or {}) do all_codes[c] = (all_codes[c] or 0) + n end
  end
  table.sort(all_ok)
  local ok_p99 = -1
  local ok_p50 = -1
  if #all_ok > 0 then
    ok_p99 = all_ok[math.max(1, math.ceil(#all_ok * 0.99))] * 1000
    ok_p50 = all_ok[math.max(1, math.ceil(#all_ok * 0.5))] * 1000
  end
  local parts = {}
  for c, n in pairs(all_codes) do table.insert(parts, string.format('"%s":%d', c, n)) end
  -- every latency wrk recorded, as (value in us, count) pairs: callers pool repeats and
  -- bootstrap a percentile's interval (wrk's stats object: #latency distinct values, latency(i))
  local hist = {}
  for i = 1, #latency do
    local v, n = latency(i)
    table.insert(hist, string.format("[%d,%d]", v, n))
  end
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"mean_us":%d,' ..
    '"err_connect":%d,"err_read":%d,"err_write":%d,"err_status":%d,"err_timeout":%d,' ..
    '"ok_p50_us":%d,"ok_p99_us":%d,"codes":{%s},"hist":[%s]}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean, e.connect, e.read, e.write, e.status, e.timeout,
    ok_p50, ok_p99, table.concat(parts, ","), table.concat(hist, ",")))
end

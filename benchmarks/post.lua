-- wrk script: POST one small OpenAI chat-completion request per call, over keep-alive.
--
--   BENCH_MODEL=bench BENCH_KEY=sk-... wrk -t1 -c64 -d5s --latency -s post.lua \
--       http://127.0.0.1:PORT/v1/chat/completions
--
-- The body is the same for every target; only "model" differs (the name the target routes on).
-- At the end it prints one machine-readable line, "WRKJSON {...}", with latency percentiles in
-- microseconds straight from wrk's histogram (no parsing of "1.23ms"-style text needed).

local model = os.getenv("BENCH_MODEL") or "bench"
local key = os.getenv("BENCH_KEY") or ""

wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
if key ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. key
end
wrk.body = '{"model":"' .. model .. '","messages":[{"role":"user","content":"Say hello"}],'
  .. '"max_tokens":16}'

-- No response() callback: wrk then skips calling into Lua per reply, and summary.errors.status
-- already counts answers with status >= 400.

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"err_connect":%d,"err_read":%d,'
      .. '"err_write":%d,"err_status":%d,"err_timeout":%d,"mean_us":%.2f,"stdev_us":%.2f,'
      .. '"p50_us":%.2f,"p90_us":%.2f,"p99_us":%.2f,"p999_us":%.2f,"max_us":%.2f}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency.mean, latency.stdev, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9), latency.max))
end

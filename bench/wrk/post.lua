-- wrk script: POST the JSON body in WRK_BODY_FILE with the bearer key in WRK_KEY, and print
-- the run's figures as one JSON line at the end (wrk's own summary stops at p99).
local body_file = os.getenv("WRK_BODY_FILE")
local key = os.getenv("WRK_KEY") or ""
local f = assert(io.open(body_file, "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
if key ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. key
end

-- A body with "{n}" in it is sent with "{n}" made unique per request (WRK_RUN, unique to a run,
-- the thread's number and a count): no server can answer or count a request from a copy of one
-- it saw before, in this run or an earlier one.
local template = wrk.body
local run = os.getenv("WRK_RUN") or tostring(os.time())
if string.find(template, "{n}", 1, true) then
  local threads = 0
  setup = function(thread)
    threads = threads + 1
    thread:set("id", threads)
  end
  local count = 0
  request = function()
    count = count + 1
    local unique = string.gsub(template, "{n}", run .. "-" .. tostring(id) .. "-" .. tostring(count))
    return wrk.format(nil, nil, nil, unique)
  end
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,"connect_errors":%d,"read_errors":%d,' ..
    '"write_errors":%d,"timeouts":%d,"status_errors":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,' ..
    '"p999_us":%d,"max_us":%d,"mean_us":%.1f}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
    latency.max, latency.mean))
end

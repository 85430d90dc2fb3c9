-- The ledger: admission and settlement of one request, atomically, on Redis server time.
-- Loaded by billing/ledger.py; see docs/architecture.md ("The ledger") for the keys.
--
-- Every scope (the key, its organisation) has:
--   <p>:rpm, <p>:tpm, <p>:ipm  token buckets {tokens, ts}; capacity = the per-minute limit,
--                        refilled continuously at capacity/60 per second
--   <p>:conc             sorted set of in-flight request ids, scored by when they expire
--   <p>:b:<YYYY-MM>      the month's budget counters: ut/rt (used/reserved tokens),
--                        us/rs (used/reserved spend, micro-units), at/as (alert sent)
-- and the model has <model>:inflight, a sorted set like <p>:conc.

-- Integers go to Redis as plain digits (Lua would write large numbers as 1e+15; and
-- never "-0", which Redis refuses as an integer).
local function int(x)
  if x == 0 then
    return "0"
  end
  return string.format("%.0f", x)
end

-- Redis's own clock: the same for every gateway and the sweeper, whatever their hosts' clocks say.
local function real_now()
  local t = redis.call("TIME")
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- The limiter's clock: real time, or a test's frozen clock (LIMITS_TEST_CLOCK only).
local function now_seconds(clock_key)
  if clock_key ~= "" then
    local override = redis.call("GET", clock_key)
    if override then
      return tonumber(override)
    end
  end
  return real_now()
end

-- Days since 1970-01-01 of a civil date, and back (Howard Hinnant's algorithms).
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = (m > 2) and (m - 3) or (m + 9)
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = (mp < 10) and (mp + 3) or (mp - 9)
  if m <= 2 then y = y + 1 end
  return y, m
end

-- "YYYY-MM" of a unix time, and the seconds left until the next month begins (UTC).
local function month_of(now)
  local y, m = civil_from_days(math.floor(now / 86400))
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  return string.format("%04d-%02d", y, m), days_from_civil(ny, nm, 1) * 86400 - now
end

local function bucket_level(key, capacity, now)
  local state = redis.call("HMGET", key, "tokens", "ts")
  local tokens, ts = tonumber(state[1]), tonumber(state[2])
  if tokens == nil then
    return capacity
  end
  local rate = capacity / 60
  return math.min(capacity, tokens + math.max(0, now - ts) * rate)
end

local function bucket_store(key, tokens, now)
  redis.call("HSET", key, "tokens", string.format("%.6f", tokens), "ts", string.format("%.6f", now))
  redis.call("PEXPIRE", key, 120000)
end

local function live_count(key, now)
  redis.call("ZREMRANGEBYSCORE", key, "-inf", now)
  return redis.call("ZCARD", key)
end

local function budget_totals(key)
  local v = redis.call("HMGET", key, "ut", "rt", "us", "rs")
  return (tonumber(v[1]) or 0), (tonumber(v[2]) or 0), (tonumber(v[3]) or 0), (tonumber(v[4]) or 0)
end

-- The thresholds (percent) at which a scope's budgets raise alerts.
local function spec_alerts(s)
  if s.alerts then return s.alerts end
  return {s.alert}
end

-- ADMIT
-- KEYS[1] in-flight hash, KEYS[2] budget alert stream
-- ARGV[1] request id           ARGV[2] spec (JSON, see billing/ledger.py)
-- ARGV[3] in-flight entry (JSON, the usage event so far)   ARGV[4] test clock key or ""
-- (ADMIT and SETTLE take one request's KEYS and ARGV as parameters, named as Redis names
-- them: the same code runs a request alone and inside a batch, see MANY.)
local function admit(KEYS, ARGV)
  local rid = ARGV[1]
  -- Idempotent: a retried call (its first reply was lost) finds the request admitted
  -- already and answers the same, charging nothing a second time.
  local existing = redis.call("HGET", KEYS[1], rid)
  if existing then
    local entry = cjson.decode(existing)
    return cjson.encode({ok = true, scopes = entry.settle.report, month = entry.settle.month, replay = true})
  end
  local spec = cjson.decode(ARGV[2])
  local now = now_seconds(ARGV[4])
  local month, month_left = month_of(now)
  local tokens = spec.tokens
  local inferences = spec.inferences or 0
  local spend = spec.spend
  local expiry = now + spec.ttl
  local report = {}

  -- Check everything first; charge only if every check passes.
  local levels = {}
  for i, s in ipairs(spec.scopes) do
    local level = {}
    if s.rpm > 0 then
      level.rpm = bucket_level(s.p .. ":rpm", s.rpm, now)
      -- A request that paid its place before it was counted (TAKE) is not charged again.
      if spec.rpm_paid then
        level.rpm = level.rpm + 1
      end
      if level.rpm < 1 then
        return cjson.encode({ok = false, code = "rate_limit_exceeded", scope = s.name, limit = "requests",
          value = s.rpm, retry = (1 - level.rpm) / (s.rpm / 60)})
      end
    end
    if s.tpm > 0 then
      if tokens > s.tpm then
        return cjson.encode({ok = false, code = "request_too_large", scope = s.name, limit = "tokens",
          value = s.tpm, requested = tokens, retry = 60})
      end
      level.tpm = bucket_level(s.p .. ":tpm", s.tpm, now)
      if level.tpm < tokens then
        return cjson.encode({ok = false, code = "rate_limit_exceeded", scope = s.name, limit = "tokens",
          value = s.tpm, requested = tokens, retry = (tokens - level.tpm) / (s.tpm / 60)})
      end
    end
    if (s.ipm or 0) > 0 and inferences > 0 then
      if inferences > s.ipm then
        return cjson.encode({ok = false, code = "request_too_large", scope = s.name, limit = "inferences",
          value = s.ipm, requested = inferences, retry = 60})
      end
      level.ipm = bucket_level(s.p .. ":ipm", s.ipm, now)
      if level.ipm < inferences then
        return cjson.encode({ok = false, code = "rate_limit_exceeded", scope = s.name, limit = "inferences",
          value = s.ipm, requested = inferences, retry = (inferences - level.ipm) / (s.ipm / 60)})
      end
    end
    if s.conc > 0 and live_count(s.p .. ":conc", now) >= s.conc then
      return cjson.encode({ok = false, code = "rate_limit_exceeded", scope = s.name, limit = "concurrency",
        value = s.conc, retry = 1})
    end
    local ut, rt, us, rs = budget_totals(s.p .. ":b:" .. month)
    if s.quota > 0 and ut + rt + tokens > s.quota then
      return cjson.encode({ok = false, code = "insufficient_quota", scope = s.name, limit = "monthly tokens",
        value = s.quota, used = ut + rt, retry = month_left})
    end
    if s.spend > 0 and us + rs + spend > s.spend then
      return cjson.encode({ok = false, code = "insufficient_quota", scope = s.name, limit = "monthly spend",
        value = s.spend, used = us + rs, retry = month_left})
    end
    level.ut, level.rt, level.us, level.rs = ut, rt, us, rs
    levels[i] = level
  end
  local model_was_idle = false
  if spec.model_key ~= "" then
    local busy = live_count(spec.model_key, now)
    model_was_idle = busy == 0
    if busy >= spec.model_limit then
      return cjson.encode({ok = false, code = "model_overloaded", scope = "model", limit = "queue",
        value = spec.model_limit, retry = 1})
    end
  end

  -- Charge.
  for i, s in ipairs(spec.scopes) do
    local level = levels[i]
    local r = {scope = s.name}
    if s.rpm > 0 then
      bucket_store(s.p .. ":rpm", level.rpm - 1, now)
      r.rpm, r.rpm_left, r.rpm_reset = s.rpm, level.rpm - 1, (s.rpm - (level.rpm - 1)) / (s.rpm / 60)
    end
    if s.tpm > 0 then
      bucket_store(s.p .. ":tpm", level.tpm - tokens, now)
      r.tpm, r.tpm_left, r.tpm_reset = s.tpm, level.tpm - tokens, (s.tpm - (level.tpm - tokens)) / (s.tpm / 60)
    end
    if level.ipm then
      bucket_store(s.p .. ":ipm", level.ipm - inferences, now)
      r.ipm, r.ipm_left, r.ipm_reset = s.ipm, level.ipm - inferences, (s.ipm - (level.ipm - inferences)) / (s.ipm / 60)
    end
    if s.conc > 0 then
      redis.call("ZADD", s.p .. ":conc", int(expiry), rid)
      redis.call("PEXPIREAT", s.p .. ":conc", int(expiry * 1000 + 60000))
    end
    local bkey = s.p .. ":b:" .. month
    redis.call("HINCRBY", bkey, "rt", int(tokens))
    redis.call("HINCRBY", bkey, "rs", int(spend))
    redis.call("EXPIRE", bkey, int(month_left + 40 * 86400))
    -- Soft alerts: once per scope, budget, month and threshold, the moment used + reserved
    -- crosses it (flags a<pct> for tokens, s<pct> for spend in the month's hash).
    for _, pct in ipairs(spec_alerts(s)) do
      if s.quota > 0 and (level.ut + level.rt + tokens) * 100 >= s.quota * pct
          and redis.call("HSETNX", bkey, "a" .. pct, now) == 1 then
        redis.call("XADD", KEYS[2], "*", "scope", s.name, "id", s.id, "org", spec.org, "budget", "tokens",
          "month", month, "threshold", pct, "limit", int(s.quota), "used", int(level.ut + level.rt + tokens))
      end
      if s.spend > 0 and (level.us + level.rs + spend) * 100 >= s.spend * pct
          and redis.call("HSETNX", bkey, "s" .. pct, now) == 1 then
        redis.call("XADD", KEYS[2], "*", "scope", s.name, "id", s.id, "org", spec.org, "budget", "spend",
          "month", month, "threshold", pct, "limit", int(s.spend), "used", int(level.us + level.rs + spend))
      end
    end
    report[#report + 1] = r
  end
  if spec.model_key ~= "" then
    redis.call("ZADD", spec.model_key, int(expiry), rid)
    redis.call("PEXPIREAT", spec.model_key, int(expiry * 1000 + 60000))
    -- The first interactive request of a burst: batch workers stop the model's lines now,
    -- before this request reaches an engine, rather than at their next look.
    if model_was_idle and spec.arrivals ~= "" then
      redis.call("PUBLISH", spec.arrivals, spec.model)
    end
  end

  -- What settlement needs to undo the reservation, kept with the in-flight entry.
  local entry = cjson.decode(ARGV[3])
  -- Admission time on Redis's clock: the sweeper judges ages with the same clock.
  entry.t = real_now()
  entry.settle = {month = month, tokens = tokens, spend = spend, model_key = spec.model_key, scopes = {},
    report = report}
  for _, s in ipairs(spec.scopes) do
    table.insert(entry.settle.scopes, {p = s.p, tpm = s.tpm, conc = s.conc})
  end
  redis.call("HSET", KEYS[1], rid, cjson.encode(entry))
  return cjson.encode({ok = true, scopes = report, month = month})
end

-- The usage event's field/value pairs (from ARGV[first]), with its revision set.
local function event_fields(ARGV, first, revision)
  local out = {}
  for i = first, #ARGV, 2 do
    out[#out + 1] = ARGV[i]
    out[#out + 1] = (ARGV[i] == "revision") and revision or ARGV[i + 1]
  end
  return out
end

-- SETTLE: the request is over. Return what it reserved beyond what it used, release its
-- places, and write its one usage event (and count it for its admission hour).
-- KEYS[1] in-flight hash, KEYS[2] usage stream, KEYS[3] the admission hour's counters,
-- KEYS[4] the request's swept marker
-- ARGV[1] request id, ARGV[2] tokens used, ARGV[3] spend used (micro-units),
-- ARGV[4] test clock key or "", ARGV[5] "sweep" when the sweeper settles it, "release" to
-- give the request back with nothing used and no event (else ""),
-- ARGV[6..] the usage event's field/value pairs
local function settle(KEYS, ARGV)
  local rid = ARGV[1]
  local used, spent = tonumber(ARGV[2]), tonumber(ARGV[3])
  local raw = redis.call("HGET", KEYS[1], rid)
  if not raw then
    -- Settled already: by this gateway, or by the sweeper from the admission draft while
    -- this gateway was judged lost (cut off from Redis, say). In the latter case this is
    -- the truth the sweeper could not know: the budgets take the difference, and the event
    -- goes out again as revision 1, which the persister puts in place of the first. The
    -- marker is taken once, so a correction is written at most once.
    local marker = redis.call("GET", KEYS[4])
    if not marker or ARGV[5] == "sweep" or ARGV[5] == "release" then
      return false
    end
    redis.call("DEL", KEYS[4])
    local swept = cjson.decode(marker)
    for _, p in ipairs(swept.scopes) do
      local bkey = p .. ":b:" .. swept.month
      redis.call("HINCRBY", bkey, "ut", int(used - swept.tokens))
      redis.call("HINCRBY", bkey, "us", int(spent - swept.spend))
    end
    return redis.call("XADD", KEYS[2], "*", unpack(event_fields(ARGV, 6, "1")))
  end
  redis.call("HDEL", KEYS[1], rid)
  local entry = cjson.decode(raw)
  local s = entry.settle
  if s then
    local now = now_seconds(ARGV[4])
    local prefixes = {}
    for _, scope in ipairs(s.scopes) do
      prefixes[#prefixes + 1] = scope.p
      if scope.tpm > 0 then
        -- The refund may be negative if a request used more than it reserved.
        local key = scope.p .. ":tpm"
        bucket_store(key, math.min(scope.tpm, bucket_level(key, scope.tpm, now) + s.tokens - used), now)
      end
      if scope.conc > 0 then
        redis.call("ZREM", scope.p .. ":conc", rid)
      end
      local bkey = scope.p .. ":b:" .. s.month
      redis.call("HINCRBY", bkey, "rt", int(-s.tokens))
      redis.call("HINCRBY", bkey, "ut", int(used))
      redis.call("HINCRBY", bkey, "rs", int(-s.spend))
      redis.call("HINCRBY", bkey, "us", int(spent))
    end
    if s.model_key ~= "" then
      redis.call("ZREM", s.model_key, rid)
    end
    if ARGV[5] == "sweep" then
      redis.call("SET", KEYS[4], cjson.encode({month = s.month, scopes = prefixes, tokens = used, spend = spent}),
        "EX", 7 * 86400)
    end
  end
  if ARGV[5] == "release" then
    -- Given back unrun (a batch line's attempt that will be tried again): no event.
    return 1
  end
  local id = redis.call("XADD", KEYS[2], "*", unpack(event_fields(ARGV, 6, "0")))
  redis.call("HINCRBY", KEYS[3], "events", 1)
  -- And per key, so that one customer's requests can be reconciled on their own.
  for i = 6, #ARGV, 2 do
    if ARGV[i] == "api_key_id" then
      redis.call("HINCRBY", KEYS[3], "key:" .. ARGV[i + 1], 1)
    end
  end
  redis.call("EXPIRE", KEYS[3], 40 * 86400)
  return id
end

-- PEEK: the buckets' levels without charging (headers on answers that were not admitted).
-- ARGV[1] spec (JSON), ARGV[2] test clock key or ""
local function peek()
  local spec = cjson.decode(ARGV[1])
  local now = now_seconds(ARGV[2])
  local report = {}
  for _, s in ipairs(spec.scopes) do
    local r = {scope = s.name}
    if s.rpm > 0 then
      local level = bucket_level(s.p .. ":rpm", s.rpm, now)
      r.rpm, r.rpm_left, r.rpm_reset = s.rpm, level, (s.rpm - level) / (s.rpm / 60)
    end
    if s.tpm > 0 then
      local level = bucket_level(s.p .. ":tpm", s.tpm, now)
      r.tpm, r.tpm_left, r.tpm_reset = s.tpm, level, (s.tpm - level) / (s.tpm / 60)
    end
    report[#report + 1] = r
  end
  return cjson.encode({ok = true, scopes = report})
end

-- TAKE: one request from each scope's requests-per-minute bucket, outside admission: paid
-- up front by a request whose prompt is costly to count, or charged to a request refused
-- after it was counted, so that neither can be repeated for free.
-- ARGV[1] spec (JSON: scopes), ARGV[2] test clock key or "", ARGV[3] "1": charge what is
-- left even if it is less than one request (never below zero), and never refuse.
local function take()
  local spec = cjson.decode(ARGV[1])
  local now = now_seconds(ARGV[2])
  local force = ARGV[3] == "1"
  local levels = {}
  for i, s in ipairs(spec.scopes) do
    if s.rpm > 0 then
      levels[i] = bucket_level(s.p .. ":rpm", s.rpm, now)
      if levels[i] < 1 and not force then
        return cjson.encode({ok = false, code = "rate_limit_exceeded", scope = s.name, limit = "requests",
          value = s.rpm, retry = (1 - levels[i]) / (s.rpm / 60)})
      end
    end
  end
  for i, s in ipairs(spec.scopes) do
    if s.rpm > 0 then
      bucket_store(s.p .. ":rpm", math.max(0, levels[i] - 1), now)
    end
  end
  return cjson.encode({ok = true})
end

-- NOW: Redis's clock (seconds), for the sweeper.
local function now()
  return string.format("%.6f", real_now())
end

-- MONTH: for tests of the calendar arithmetic. ARGV[1] unix seconds.
local function month()
  local m, left = month_of(tonumber(ARGV[1]))
  return {m, tostring(left)}
end

-- MANY: several requests' ADMITs (or SETTLEs) in one run, each exactly as it would run alone,
-- in order; their replies in a list ("" for a SETTLE that found nothing to settle).
-- ARGV[1] n, ARGV[2] keys per request; then per request: its argument count m and its m
-- arguments. KEYS: each request's keys, one after the other.
local function many(one)
  local n, per = tonumber(ARGV[1]), tonumber(ARGV[2])
  local out, at = {}, 3
  for i = 1, n do
    local k, a = {}, {}
    for j = 1, per do
      k[j] = KEYS[(i - 1) * per + j]
    end
    local m = tonumber(ARGV[at])
    for j = 1, m do
      a[j] = ARGV[at + j]
    end
    at = at + m + 1
    out[i] = one(k, a) or ""
  end
  return out
end

local op = table.remove(ARGV, 1)
if op == "admit" then return admit(KEYS, ARGV) end
if op == "settle" then return settle(KEYS, ARGV) end
if op == "admit_many" then return many(admit) end
if op == "settle_many" then return many(settle) end
if op == "peek" then return peek() end
if op == "take" then return take() end
if op == "month" then return month() end
if op == "now" then return now() end
return redis.error_reply("unknown operation " .. tostring(op))

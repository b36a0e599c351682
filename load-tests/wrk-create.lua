-- wrk script: create vouchers over the admin API, each request a new code.
--   wrk -t2 -c16 -d10s -s load-tests/wrk-create.lua http://127.0.0.1:8080 -- TOKEN PREFIX [LIMIT]
-- Codes are PREFIX<thread>X<n>, n counting up from 1. With LIMIT, a thread creates that many
-- and stops (its last requests, past the limit, are GET /health/live).
local threads = {}

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  prefix = (args[2] or "NEW") .. id .. "X"
  counter = 0
  limit = tonumber(args[3] or "0")
  answered = 0
  statuses = {}
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["Authorization"] = "Bearer " .. (args[1] or "")
end

function request()
  if limit > 0 and counter >= limit then
    return wrk.format("GET", "/health/live", {}, "")
  end
  counter = counter + 1
  local body = string.format('{"code":"%s%d","discountAmount":100,"totalLimit":10,"perUserLimit":1,' ..
    '"startsAt":"2020-01-01T00:00:00Z","endsAt":"2100-01-01T00:00:00Z"}', prefix, counter)
  return wrk.format(nil, "/admin/vouchers", nil, body)
end

function response(status)
  if limit > 0 and status == 200 then
    return -- GET /health/live, past the limit (a create answers 201 or an error)
  end
  answered = answered + 1
  statuses[status] = (statuses[status] or 0) + 1
  if answered == limit then
    wrk.thread:stop()
  end
end

function done(summary, latency, requests)
  local totals = {}
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("statuses")) do totals[k] = (totals[k] or 0) + v end
  end
  for k, v in pairs(totals) do io.write(string.format("status %d: %d\n", k, v)) end
  io.write(string.format("p50 %.2fms p99 %.2fms max %.2fms\n", latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency.max / 1000))
end

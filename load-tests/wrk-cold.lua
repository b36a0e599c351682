-- wrk script: every request reserves on a voucher no request touched before (cold activation).
--   wrk -t1 -c256 -d10s -s load-tests/wrk-cold.lua http://127.0.0.1:8080 -- PREFIX COUNT [FIRST]
-- Voucher codes are PREFIX<i> for i in FIRST .. FIRST+COUNT-1, taken in order, each once; past
-- COUNT, requests wrap around (no longer cold). Use one wrk thread so codes are not shared.
local counter = 0
local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  prefix = args[1] or "COLD"
  count = tonumber(args[2] or "100000")
  first = tonumber(args[3] or "0")
  statuses = {}
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  local i = first + (counter % count)
  counter = counter + 1
  -- Customer and order numbered from FIRST too: a later run's orders are new ones (an orderId
  -- used on one voucher is refused on another).
  local n = first + counter
  local body = string.format('{"customerId":%d,"orderId":"cold-%d","orderAmount":10000}', n, n)
  return wrk.format(nil, "/vouchers/" .. prefix .. i .. "/reservations", nil, body)
end

function response(status)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local totals = {}
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("statuses")) do totals[k] = (totals[k] or 0) + v end
  end
  for k, v in pairs(totals) do io.write(string.format("status %d: %d\n", k, v)) end
  io.write(string.format("p50 %.2fms p99 %.2fms max %.2fms\n", latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency.max / 1000))
end

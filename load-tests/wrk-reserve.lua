-- wrk script: POST reserves with distinct customers and order ids, and count answers by status.
--   wrk -t2 -c256 -d15s -s load-tests/wrk-reserve.lua http://127.0.0.1:8080 -- CODE [ORDER_PREFIX] [VOUCHERS] [random]
-- Give each wrk process its own ORDER_PREFIX when several run against one voucher. With VOUCHERS
-- = N > 1, requests go round-robin to the vouchers CODE0 … CODE{N-1} (many hot vouchers at once).
-- Customer ids rise by one per request unless the fourth argument is `random`: then they are the
-- counter scrambled by an odd multiplier mod 2^32 (still distinct, but scattered like a real
-- sale's customers, so each reservation lands on a random page of the ledger's indexes).
local threads = {}
local counter = 0

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  code = args[1] or "BENCH"
  prefix = args[2] or code
  vouchers = tonumber(args[3] or "1")
  scattered = args[4] == "random"
  statuses = {}
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

-- counter * 2654435761 mod 2^32, a bijection on 32-bit counters. Lua numbers are doubles, exact
-- below 2^53: the product is taken in two 16-bit halves so that it stays exact however long wrk runs.
function scramble(n)
  local lo, hi = n % 65536, math.floor(n / 65536)
  return ((hi * 2654435761) % 65536 * 65536 + lo * 2654435761) % 4294967296
end

function request()
  counter = counter + 1
  local stream = id + 10 * (tonumber(prefix:match("(%d+)$")) or 0)
  local customer = stream * 100000000 + counter
  if scattered then customer = stream * 10000000000 + scramble(counter) end
  local body = string.format('{"customerId":%d,"orderId":"%s-%d","orderAmount":10000}', customer, prefix, customer)
  local target = code
  if vouchers > 1 then target = code .. (counter % vouchers) end
  return wrk.format(nil, "/vouchers/" .. target .. "/reservations", nil, body)
end

function response(status)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local totals = {}
  for _, t in ipairs(threads) do
    local s = t:get("statuses")
    for k, v in pairs(s) do totals[k] = (totals[k] or 0) + v end
  end
  for k, v in pairs(totals) do io.write(string.format("status %d: %d\n", k, v)) end
  io.write(string.format("p50 %.2fms p99 %.2fms max %.2fms\n", latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency.max / 1000))
end

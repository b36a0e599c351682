#!/usr/bin/env bash
# The ledger goes down mid-sale and comes back: one release node on PostgreSQL, reached through a
# small TCP proxy this script cuts and restores.
#   scripts/ledger-down.sh
# It floods the node (wrk, 64 connections, 5 s) while PostgreSQL is unreachable and the circuit
# breaker is open, and prints the answers and their latency (as wrk saw them, and as the node's
# own request histogram timed them); then it restores the link and
# prints how long after that the first reserve got its 201 (against ledger.breaker_open_ms).
# Traffic goes to 127.0.0.1 only and stops by itself.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
need wrk curl psql python3
bin=$(release_bin)
token="down-$RANDOM$RANDOM"
scratch_pg down
proxy_port=$(free_port)
# SIGUSR1 cuts every connection and refuses new ones; SIGUSR2 lets them through again.
python3 - "$proxy_port" <<'PY' &
import asyncio, signal, sys
port, up, conns = int(sys.argv[1]), [True], set()
async def pump(r, w):
    try:
        while data := await r.read(65536):
            w.write(data); await w.drain()
    except Exception: pass
    finally: w.close()
async def handle(r, w):
    if not up[0]: w.close(); return
    try: tr, tw = await asyncio.open_connection("127.0.0.1", 5432)
    except OSError: w.close(); return
    pair = (w, tw); conns.add(pair)
    await asyncio.gather(pump(r, tw), pump(tr, w)); conns.discard(pair)
def cut():
    up[0] = False
    for a, b in list(conns): a.transport.abort(); b.transport.abort()
async def main():
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, cut)
    loop.add_signal_handler(signal.SIGUSR2, lambda: up.__setitem__(0, True))
    async with await asyncio.start_server(handle, "127.0.0.1", port): await asyncio.Future()
asyncio.run(main())
PY
proxy=$!
pids+=("$proxy")
sleep 0.5
port=$(free_port)
base="http://127.0.0.1:$port"
VOUCHERS__HTTP__HOST=127.0.0.1 VOUCHERS__HTTP__PORT=$port VOUCHERS__ADMIN__TOKEN=$token \
VOUCHERS__LEDGER__URL="postgres://postgres@127.0.0.1:$proxy_port/$db" VOUCHERS__NODE__ID=down \
RUST_LOG=error "$bin" >"$work/node.log" 2>&1 &
pids+=($!)
wait_ready "$base"
auth=(-H "Authorization: Bearer $token" -H 'Content-Type: application/json')
curl -fsS "${auth[@]}" -XPOST "$base/admin/vouchers" \
  -d '{"code":"DOWN","discountAmount":100,"totalLimit":1000000000,"perUserLimit":1}' >/dev/null
wrk -t1 -c64 -d3s -s load-tests/wrk-reserve.lua "$base" -- DOWN up >"$work/up.txt" 2>&1
kill -USR1 "$proxy"
breaker() { curl -fsS "$base/metrics" | awk '/^vouchers_ledger_breaker_state/ {print $2}'; }
for _ in $(seq 1 200); do [ "$(breaker)" = 2 ] && break; sleep 0.05; done
curl -fsS "$base/metrics" >"$work/metrics-before.txt"
wrk -t1 -c64 -d5s -s load-tests/wrk-reserve.lua "$base" -- DOWN down >"$work/down.txt" 2>&1
curl -fsS "$base/metrics" >"$work/metrics-after.txt"
ready=$(curl -sS "$base/health/ready")
kill -USR2 "$proxy"
resumed=$(python3 - "$base" <<'PY'
import json, sys, time, urllib.request
base, start, n = sys.argv[1], time.time(), 0
while time.time() - start < 30:
    n += 1
    body = json.dumps({"customerId": 10**12 + n, "orderId": f"back-{n}", "orderAmount": 10000}).encode()
    req = urllib.request.Request(f"{base}/vouchers/DOWN/reservations", body, {"Content-Type": "application/json"})
    try:
        if urllib.request.urlopen(req).status == 201: break
    except Exception: pass
    time.sleep(0.01)
print(f"{1000 * (time.time() - start):.0f}")
PY
)
open_ms=$(python3 -c 'import tomllib; print(tomllib.load(open("config/default.toml","rb"))["ledger"]["breaker_open_ms"])')
python3 - "$work/up.txt" "$work/down.txt" "$ready" "$resumed" "$open_ms" "$work/metrics-before.txt" "$work/metrics-after.txt" <<'PY'
import re, sys
def buckets(f):
    b = {}
    for l in open(f):
        m = re.match(r'vouchers_http_request_duration_seconds_bucket\{(.*)\} (\S+)', l)
        if m and 'route="reserve"' in m.group(1):
            le = re.search(r'le="([^"]+)"', m.group(1)).group(1)
            b[le] = b.get(le, 0) + float(m.group(2))
    return b
b0, b1 = buckets(sys.argv[6]), buckets(sys.argv[7])
within = b1.get("0.001", 0) - b0.get("0.001", 0)
total = b1.get("+Inf", 0) - b0.get("+Inf", 0)
def read(f):
    t = open(f).read()
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
    p50, p99, mx = map(float, re.search(r"p50 ([\d.]+)ms p99 ([\d.]+)ms max ([\d.]+)ms", t).groups())
    return rps, p50, p99, mx, dict(re.findall(r"status (\d+): (\d+)", t))
for name, f in (("ledger up", sys.argv[1]), ("ledger down, breaker open", sys.argv[2])):
    rps, p50, p99, mx, st = read(f)
    print(f"{name}: {rps:,.0f} req/s, p50 {p50:.3f} ms, p99 {p99:.3f} ms, max {mx:.1f} ms, answers {st}")
if total:
    print(f"ledger down, as the node timed them: {within:,.0f} of {total:,.0f} reserves "
          f"({100 * within / total:.2f} %) answered within 1 ms")
print(f"readiness while down: {sys.argv[3]}")
print(f"first 201 {sys.argv[4]} ms after the link came back (ledger.breaker_open_ms {sys.argv[5]})")
PY

#!/usr/bin/env bash
# Issue 9's scenario: a node holding unused units is SIGKILLed in the middle of a sale, and
# another node is flooded. Release build, three nodes on PostgreSQL + Redis (config/cluster.toml).
#   scripts/kill-holder.sh
# 1. Node 1 serves a trickle and holds a lease with unused units.
# 2. Node 2's reserve rate is measured before the kill (wrk, 64 connections, on a voucher that
#    never sells out).
# 3. Node 1 is SIGKILLed; at once node 2 gets a wrk flood on the sale (64 connections, 8 s),
#    while the ledger is polled every 50 ms.
# It prints node 2's rate after the kill against before, the slowest answer (against
# engine.recall_wait_ms), when the dead node's lease was reaped and when the sale reached 100 %
# (both from the kill), and the books. Traffic goes to 127.0.0.1 only and stops by itself.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
need wrk curl psql python3
bin=$(release_bin)
token="kill-$RANDOM$RANDOM"
scratch_pg kill
ports=()
for i in 1 2 3; do
  port=$(free_port)
  ports+=("$port")
  VOUCHERS__HTTP__HOST=127.0.0.1 VOUCHERS__HTTP__PORT=$port VOUCHERS__LEDGER__URL="$ledger" \
  VOUCHERS__ADMIN__TOKEN=$token VOUCHERS__REDIS__URL="$redis" VOUCHERS__NODE__ID="kill-$i" \
  VOUCHERS__REDIS__EVENTS_STREAM="" RUST_LOG=warn "$bin" --config config/cluster.toml >"$work/node$i.log" 2>&1 &
  pids+=($!)
  wait_ready "http://127.0.0.1:$port"
done
n1="http://127.0.0.1:${ports[0]}"; n2="http://127.0.0.1:${ports[1]}"
auth=(-H "Authorization: Bearer $token" -H 'Content-Type: application/json')
create() { curl -fsS "${auth[@]}" -XPOST "$n1/admin/vouchers" -d "{\"code\":\"$1\",\"discountAmount\":100,\"totalLimit\":$2,\"perUserLimit\":1}" >/dev/null; }
create SALE 1000
create BIG 1000000000
for p in "${ports[@]}"; do curl -fsS "${auth[@]}" -XPOST "http://127.0.0.1:$p/admin/vouchers/BIG/warm"; done
# 1. A trickle on node 1 (some thirty reserves a second, on until the kill): it leases a block and
#    uses a little of it, so the lease is never idle.
(
  c=0
  while :; do
    c=$((c + 1))
    curl -fsS -o /dev/null -H 'Content-Type: application/json' -XPOST "$n1/vouchers/SALE/reservations" \
      -d "{\"customerId\":$c,\"orderId\":\"trickle-$c\",\"orderAmount\":10000}" || true
    sleep 0.02
  done
) &
trickle=$!
pids+=("$trickle")
# 2. Node 2's rate before the kill.
wrk -t1 -c64 -d4s -s load-tests/wrk-reserve.lua "$n2" -- BIG before >"$work/before.txt" 2>&1
held=$(psql -Atq "$ledger" -c "SELECT COALESCE(SUM(granted - consumed), 0) FROM leases WHERE voucher_code = 'SALE' AND state = 'ACTIVE' AND node_id LIKE 'kill-1#%'")
# 3. The kill, the flood, the poll.
kill -9 "${pids[0]}"
kill "$trickle" 2>/dev/null || true
python3 - "$ledger" "$work/poll.txt" <<'PY' &
import subprocess, sys, time
ledger, out = sys.argv[1], sys.argv[2]
start = time.time(); reaped = sold = None
q = ("SELECT (SELECT COUNT(*) FROM leases WHERE voucher_code = 'SALE' AND node_id LIKE 'kill-1#%' AND state = 'ACTIVE'),"
     " (SELECT COALESCE(SUM(consumed), 0) FROM leases WHERE voucher_code = 'SALE')")
while time.time() - start < 12 and (sold is None or reaped is None):
    active, won = map(int, subprocess.check_output(["psql", "-Atq", "-F", " ", ledger, "-c", q]).split())
    t = time.time() - start
    if reaped is None and active == 0: reaped = t
    if won >= 1000: sold = t
    time.sleep(0.05)
open(out, "w").write(f"{reaped} {sold}\n")
PY
poller=$!
wrk -t1 -c64 -d8s -s load-tests/wrk-reserve.lua "$n2" -- SALE after >"$work/after.txt" 2>&1
wait "$poller"
sleep 1
view=$(curl -fsS "${auth[@]}" "$n2/admin/vouchers/SALE")
recall_wait=$(python3 -c 'import tomllib; c=tomllib.load(open("config/default.toml","rb")); print(c["engine"]["recall_wait_ms"])')
python3 - "$work/before.txt" "$work/after.txt" "$work/poll.txt" "$view" "$held" "$recall_wait" <<'PY'
import json, re, sys
def rate(f):
    t = open(f).read()
    return float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1)), t
before, _ = rate(sys.argv[1]); after, t = rate(sys.argv[2])
reaped, sold = open(sys.argv[3]).read().split()
view, held, recall_wait = json.loads(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
statuses = dict(re.findall(r"status (\d+): (\d+)", t))
p99, worst = map(float, re.search(r"p99 ([\d.]+)ms max ([\d.]+)ms", t).groups())
fmt = lambda s: "never" if s == "None" else f"{float(s):.2f} s"
won = view["reserved"] + view["confirmed"]
print(f"node 1 held {held} unused units when it was killed")
print(f"node 2 before the kill: {before:,.0f} req/s; after: {after:,.0f} req/s ({100 * after / before:.0f} %), "
      f"p99 {p99:.1f} ms, slowest answer {worst:.0f} ms (recall_wait_ms {recall_wait:.0f}), answers {statuses}")
print(f"dead node's lease reaped {fmt(reaped)} after the kill; sale at 100 % {fmt(sold)} after the kill")
print(f"books: {won} of {view['totalLimit']} won, oversold {max(0, won - view['totalLimit'])}, "
      f"free {view['free']}, leased unused {view['leasedUnused']}, balanced {view['balanced']}")
PY

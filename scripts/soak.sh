#!/usr/bin/env bash
# A soak at full rate with nobody scraping /metrics: one embedded node (release build, SQLite), a
# voucher too large to sell out, wrk with distinct customers in back-to-back one-minute rounds.
#   scripts/soak.sh [MINUTES]      (default 10)
# After every round it prints the node's RSS, the round's rate and p99: both should stay flat
# after the first round (the metrics exporter's upkeep runs without a scraper).
# Traffic goes to 127.0.0.1 only and stops by itself.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
minutes="${1:-10}"
need wrk curl python3
bin=$(release_bin)
token="soak-$RANDOM$RANDOM"
port=$(free_port)
VOUCHERS__HTTP__PORT=$port VOUCHERS__LEDGER__URL="sqlite://$work/ledger.db" VOUCHERS__ADMIN__TOKEN=$token \
  RUST_LOG=warn "$bin" >"$work/node.log" 2>&1 &
pid=$!
pids+=("$pid")
base="http://127.0.0.1:$port"
wait_ready "$base"
curl -fsS -H "Authorization: Bearer $token" -H 'Content-Type: application/json' -XPOST "$base/admin/vouchers" \
  -d '{"code":"SOAK","discountAmount":100,"totalLimit":1000000000,"perUserLimit":1}' >/dev/null
rss() { awk '/VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$pid/status"; }
echo "minute  RSS MB  req/s     p99 ms  (start: RSS $(rss) MB)"
for m in $(seq 1 "$minutes"); do
  wrk -t1 -c256 -d60s -s load-tests/wrk-reserve.lua "$base" -- SOAK "soak$m" >"$work/wrk-$m.txt" 2>&1
  python3 - "$m" "$(rss)" "$work/wrk-$m.txt" <<'PY'
import re, sys
t = open(sys.argv[3]).read()
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
p99 = float(re.search(r"p99 ([\d.]+)ms", t).group(1))
print(f"{int(sys.argv[1]):6d}  {float(sys.argv[2]):6.1f}  {rps:8,.0f}  {p99:6.2f}")
PY
done

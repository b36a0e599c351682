#!/usr/bin/env bash
# Checks the Grafana dashboard against reality: starts a node on its default configuration (no
# interval overrides), a real Prometheus scraping it every second and short k6 runs, then
# evaluates every panel query of grafana/dashboards/*.json through Prometheus's HTTP API. Fails
# if any query returns no series, or if a tool is missing. It also sells out one voucher by hand
# and reports how long after the last 201 every per-voucher panel showed the sell-out (units
# left 0, sell-through 1, reconciliation 1): it fails only if they never do (30 s).
# Needs: prometheus, k6, python3, curl, a Redis at TEST_REDIS_URL (for the signal metrics).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

for tool in prometheus k6 python3 curl; do
  command -v "$tool" >/dev/null || { echo "check-dashboard: '$tool' is not installed" >&2; exit 1; }
done
bin="${VOUCHERS_BIN:-$root/target/debug/vouchers}"
[ -x "$bin" ] || cargo build --bin vouchers
redis="${TEST_REDIS_URL:-redis://127.0.0.1:6379}"

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"
  # The node's copy of the change feed (a stream of its own, see below).
  if [ -n "${token:-}" ] && command -v redis-cli >/dev/null; then
    redis-cli -u "$redis" DEL "check:events:$token" "check:events:$token:origin" "check:events:$token:relayer" >/dev/null || true
  fi
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { # url, what
  for _ in $(seq 1 100); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.2; done
  echo "check-dashboard: $2 did not come up at $1" >&2; return 1
}

port=$(free_port)
token="check-$(python3 -c 'import secrets; print(secrets.token_hex(8))')"
VOUCHERS__HTTP__PORT=$port VOUCHERS__LEDGER__URL="sqlite://$work/ledger.db" \
VOUCHERS__ADMIN__TOKEN=$token VOUCHERS__REDIS__URL="$redis" RUST_LOG=warn \
VOUCHERS__REDIS__EVENTS_STREAM="check:events:$token" \
  "$bin" >"$work/node.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$port/health/ready" "the node"

prom_port=$(free_port)
cat >"$work/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: vouchers
    static_configs:
      - targets: ["127.0.0.1:$port"]
YAML
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" >"$work/prometheus.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$prom_port/-/ready" "Prometheus"

export BASE_URL="http://127.0.0.1:$port" ADMIN_TOKEN="$token"
k6 run --quiet -e P99_MS=0 -e PEAK_RATE=400 -e TOTAL=300 -e RAMP=2s -e HOLD=4s load-tests/flash-sale.js
k6 run --quiet -e P99_MS=0 -e RATE=100 -e DURATION=4s load-tests/lifecycle.js
# The other two scenarios, short: every scenario runs in CI.
k6 run --quiet -e P99_MS=0 -e RATE=200 -e DURATION=3s load-tests/campaign.js
k6 run --quiet -e ORDERS=50 -e COPIES=10 load-tests/retry-storm.js
# Sell out a small voucher and time the per-voucher panels.
sell="PANELS$(python3 -c 'import secrets; print(secrets.token_hex(3))')"
curl -fsS -o /dev/null -XPOST "$BASE_URL/admin/vouchers" -H "Authorization: Bearer $token" \
  -H 'Content-Type: application/json' -d "{\"code\":\"$sell\",\"discountAmount\":100,\"totalLimit\":20,\"perUserLimit\":1,\"startsAt\":\"2020-01-01T00:00:00Z\",\"endsAt\":\"2099-01-01T00:00:00Z\"}"
# 20 units, 21 customers: the last gets 409 OUT_OF_STOCK, as late traffic would.
for i in $(seq 1 21); do
  curl -sS -o /dev/null -XPOST "$BASE_URL/vouchers/$sell/reservations" -H 'Content-Type: application/json' \
    -d "{\"customerId\":$i,\"orderId\":\"$sell-$i\",\"orderAmount\":1000}"
done
python3 - "$prom_port" "$sell" <<'PY'
import json, sys, time, urllib.parse, urllib.request
port, code = sys.argv[1], sys.argv[2]
panels = json.load(open("grafana/dashboards/vouchers.json"))["panels"]
expr = {p["title"]: p["targets"][0]["expr"] for p in panels}
want = {"Units left per voucher": 0.0, "Sell-through per voucher": 1.0, "Reconciliation": 1.0}
def value(q):
    u = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(u) as r:
        for s in json.load(r)["data"]["result"]:
            if s["metric"].get("voucher") == code:
                return float(s["value"][1])
start, seen = time.time(), {}
while len(seen) < len(want) and time.time() - start < 30:
    for title, v in want.items():
        if title not in seen and value(expr[title]) == v:
            seen[title] = time.time() - start
    time.sleep(0.05)
for title in want:
    print(f"{title}: " + (f"showed the sell-out {seen[title]*1000:.0f} ms after the last 201" if title in seen else "never showed it"))
if len(seen) < len(want):
    sys.exit("per-voucher panels did not follow the sell-out")
PY
# Two more scrapes of every target after the last request: polled on Prometheus's own record of
# its scrapes (a fixed pause would be too short on a slow machine, and wasted on a fast one).
python3 - "$prom_port" <<'PY'
import json, sys, time, urllib.request
port = sys.argv[1]
def last_scrapes():
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets?state=active") as r:
        return {t["scrapeUrl"]: t["lastScrape"] for t in json.load(r)["data"]["activeTargets"]}
def after(mark, what):
    deadline = time.time() + 30
    while True:
        now = last_scrapes()
        if now and all(now[u] != mark.get(u) for u in now):
            return now
        if time.time() > deadline:
            sys.exit(f"Prometheus did not scrape every target {what} within 30 s")
        time.sleep(0.1)
after(after(last_scrapes(), "once more"), "twice more")
PY

# Every metric of the catalogue (src/metrics.rs) is exported after the runs, but those of a
# diagnosis build.
curl -fsS "http://127.0.0.1:$port/metrics" >"$work/metrics.txt"
python3 - src/metrics.rs "$work/metrics.txt" <<'PY'
import re, sys
source = open(sys.argv[1]).read()
names = re.findall(r'pub const [A-Z_]+: &str = "(vouchers_[a-z_]+)";', source)
# A metric gated on a diagnosis feature (`#[cfg(feature = ...)]` on the line before) is not in
# what a serving build exports.
gated = set(re.findall(r'#\[cfg\(feature = "[a-z-]+"\)\]\npub const [A-Z_]+: &str = "(vouchers_[a-z_]+)";',
                       source))
names = [n for n in names if n not in gated]
text = open(sys.argv[2]).read()
exported = {l.split("{")[0].split(" ")[0] for l in text.splitlines() if l and not l.startswith("#")}
missing = [n for n in names if not ({n, n + "_bucket", n + "_count"} & exported)]
print(f"{len(names) - len(missing)} of {len(names)} catalogue metrics exported")
if missing:
    sys.exit("missing from /metrics: " + ", ".join(missing))
PY

python3 - "$prom_port" grafana/dashboards/*.json <<'PY'
import json, sys, urllib.parse, urllib.request
port, files = sys.argv[1], sys.argv[2:]
empty, total = [], 0
for f in files:
    for panel in json.load(open(f))["panels"]:
        for t in panel.get("targets", []):
            total += 1
            q = urllib.parse.urlencode({"query": t["expr"]})
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{q}") as r:
                res = json.load(r)
            n = len(res["data"]["result"]) if res.get("status") == "success" else 0
            print(f"{'ok ' if n else 'EMPTY'} {n:3d} series  {panel['title']}: {t['expr']}")
            if not n:
                empty.append(f"{panel['title']}: {t['expr']}")
print(f"{total - len(empty)} of {total} panel queries return data")
if empty:
    sys.exit("panel queries with no series:\n  " + "\n  ".join(empty))
PY

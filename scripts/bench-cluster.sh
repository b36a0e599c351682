#!/usr/bin/env bash
# Throughput and latency of POST …/reservations against the release build, on this machine, for
# several nodes at once (scripts/bench.sh measures one node against the yardsticks).
#   scripts/bench-cluster.sh cluster [NODES]   NODES nodes (default 3), PostgreSQL + Redis
#   scripts/bench-cluster.sh embedded          one node, SQLite
# For each node set it runs two wrk floods (DURATION seconds, default 10): a 1000-unit voucher
# under distinct customers, and a voucher too large to sell out. It prints wrk's rate and
# latency, the 201 count, the ledger's reservation count and, in cluster mode, the PostgreSQL
# transactions per 1000 reservations. Traffic goes to 127.0.0.1 only and stops by itself.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mode="${1:-embedded}"
nodes="${2:-3}"
duration="${DURATION:-10}"
conns="${CONNS:-256}"
for tool in wrk curl python3; do command -v "$tool" >/dev/null || { echo "bench: install $tool" >&2; exit 1; }; done
# VOUCHERS_BIN: another build to measure (an A/B against an earlier commit); default: this one.
if [ -z "${VOUCHERS_BIN:-}" ]; then cargo build --release --bin vouchers >/dev/null 2>&1; fi
bin="${VOUCHERS_BIN:-$root/target/release/vouchers}"
work=$(mktemp -d)
pids=()
token="bench-$RANDOM$RANDOM"
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"
  if command -v redis-cli >/dev/null; then
    redis-cli -u "$redis" DEL "bench:events:$token" "bench:events:$token:origin" "bench:events:$token:relayer" >/dev/null || true
  fi
}
trap cleanup EXIT
pg_admin="${BENCH_PG_ADMIN:-postgres://postgres@127.0.0.1:5432/test}"
redis="${TEST_REDIS_URL:-redis://127.0.0.1:6379}"

if [ "$mode" = cluster ]; then
  db="vouchers_bench_$RANDOM"
  psql -q "$pg_admin" -c "CREATE DATABASE $db"
  ledger="${pg_admin%/*}/$db"
  args=(--config config/cluster.toml)
else
  nodes=1
  ledger="sqlite://$work/ledger.db"
  args=()
fi

ports=()
for i in $(seq 1 "$nodes"); do
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  ports+=("$port")
  VOUCHERS__HTTP__HOST=127.0.0.1 VOUCHERS__HTTP__PORT=$port VOUCHERS__LEDGER__URL="$ledger" \
  VOUCHERS__ADMIN__TOKEN=$token VOUCHERS__REDIS__URL="$([ "$mode" = cluster ] && echo "$redis")" \
  VOUCHERS__NODE__ID="bench-$i" VOUCHERS__REDIS__EVENTS_STREAM="bench:events:$token" \
  RUST_LOG=warn "$bin" "${args[@]}" >"$work/node$i.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 100); do curl -fsS -o /dev/null "http://127.0.0.1:$port/health/ready" 2>/dev/null && break; sleep 0.1; done
done
first="http://127.0.0.1:${ports[0]}"
auth=(-H "Authorization: Bearer $token" -H 'Content-Type: application/json')

xacts() { [ "$mode" = cluster ] && psql -Atq "$pg_admin" -c "select xact_commit + xact_rollback from pg_stat_database where datname = '$db'" || echo 0; }

run() { # code total
  local code=$1 total=$2
  curl -fsS "${auth[@]}" -XPOST "$first/admin/vouchers" \
    -d "{\"code\":\"$code\",\"discountAmount\":100,\"totalLimit\":$total,\"perUserLimit\":1}" >/dev/null
  for p in "${ports[@]}"; do curl -fsS "${auth[@]}" -XPOST "http://127.0.0.1:$p/admin/vouchers/$code/warm"; done
  local before; before=$(xacts)
  for p in "${ports[@]}"; do curl -fsS "http://127.0.0.1:$p/metrics"; echo; done >"$work/metrics-before-$code.txt"
  local per_node=$(( conns / nodes ))
  local wrk_pids=()
  for i in "${!ports[@]}"; do
    wrk -t1 -c"$per_node" -d"${duration}s" -s load-tests/wrk-reserve.lua "http://127.0.0.1:${ports[$i]}" -- "$code" "$code-n$i" >"$work/wrk-$code-$i.txt" 2>&1 &
    wrk_pids+=($!)
  done
  wait "${wrk_pids[@]}"
  # wrk stops with requests in flight; let them land before reading the ledger.
  sleep 1
  local after; after=$(xacts)
  local view; view=$(curl -fsS "${auth[@]}" "$first/admin/vouchers/$code")
  local metrics=""
  for p in "${ports[@]}"; do metrics+=$(curl -fsS "http://127.0.0.1:$p/metrics"); metrics+=$'\n'; done
  echo "$metrics" >"$work/metrics-$code.txt"
  python3 - "$code" "$total" "$before" "$after" "$view" "$work/metrics-$code.txt" "$work/metrics-before-$code.txt" "$work"/wrk-"$code"-*.txt <<'PY'
import json, re, sys
code, total, before, after, view = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
def metric(name, label=""):
    total = lambda f: sum(float(l.split()[-1]) for l in open(f) if l.startswith(name) and label in l)
    return total(sys.argv[6]) - total(sys.argv[7])
batches, grants = metric("vouchers_batch_size_count"), metric("vouchers_lease_events_total", 'event="granted"')
commits = metric("vouchers_ledger_commits_total", 'result="ok"')
rps = created = 0; p99 = []; p50 = []
for f in sys.argv[8:]:
    t = open(f).read()
    rps += float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
    created += int(m.group(1)) if (m := re.search(r"status 201: (\d+)", t)) else 0
    m = re.search(r"p50 ([\d.]+)ms p99 ([\d.]+)ms", t); p50.append(float(m.group(1))); p99.append(float(m.group(2)))
sold = view["reserved"] + view["confirmed"]
print(f"{code}: total {total}: {rps:,.0f} req/s, p50 {max(p50):.2f} ms, p99 {max(p99):.2f} ms (worst node); "
      f"201s seen by wrk {created}, ledger reservations {sold}, balanced {view['balanced']}, oversold {max(0, sold - total)}")
if sold:
    print(f"  batches {batches:.0f} ({sold / max(batches, 1):.1f} reservations each), lease grants {grants:.0f}; "
          f"per 1000 reservations: {1000 * batches / sold:.1f} actor batches in {1000 * commits / sold:.1f} merged commits")
if after > before and sold:
    # A merged commit on PostgreSQL is one round trip (one call of vouchers_commit_batches_v2).
    print(f"  PostgreSQL transactions: {after - before} for {sold} reservations = {1000 * (after - before) / sold:.1f} per 1000")
PY
}
echo "mode $mode, $nodes node(s), $conns connections, ${duration}s per run, release build"
run FLOOD 1000
run NEVER 1000000000
[ "$mode" = cluster ] && psql -q "$pg_admin" -c "DROP DATABASE $db WITH (FORCE)" || true

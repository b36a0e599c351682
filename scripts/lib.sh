# Shared by the scripts that start release nodes on loopback ports (kill-holder, ledger-down,
# soak). Source it after `set -euo pipefail`; it cds to the repository root.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# need TOOL...: fails with a hint when a tool is missing.
need() {
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "$(basename "$0"): install $tool" >&2; exit 1; }
  done
}

# The binary to run: VOUCHERS_BIN (another build, for an A/B), or this one built in release mode.
release_bin() {
  if [ -z "${VOUCHERS_BIN:-}" ]; then cargo build --release --bin vouchers >/dev/null 2>&1; fi
  echo "${VOUCHERS_BIN:-$root/target/release/vouchers}"
}

# A loopback port that was free a moment ago.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_ready BASE: until the node at BASE is ready (10 s at most).
wait_ready() {
  for _ in $(seq 1 100); do curl -fsS -o /dev/null "$1/health/ready" 2>/dev/null && return; sleep 0.1; done
  echo "$(basename "$0"): $1 never became ready" >&2; exit 1
}

pg_admin="${BENCH_PG_ADMIN:-postgres://postgres@127.0.0.1:5432/test}"
redis="${TEST_REDIS_URL:-redis://127.0.0.1:6379}"

# Every process in `pids` is stopped, the scratch database (if any) dropped and `work` removed
# when the script exits, however it exits.
pids=()
work=$(mktemp -d)
db=""
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ -n "$db" ]; then psql -q "$pg_admin" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# scratch_pg TAG: a fresh PostgreSQL database for this run (`db`, its URL in `ledger`).
scratch_pg() {
  db="vouchers_$1_$RANDOM"
  psql -q "$pg_admin" -c "CREATE DATABASE $db"
  ledger="${pg_admin%/*}/$db"
}

#!/usr/bin/env bash
# Issue 31's rehearsal: the ledger's primary fails mid-sale and its synchronous standby takes
# over. Release build, three nodes + Redis on the multi-host URL of the pair
# scripts/ledger-pair.sh builds (two PostgreSQL clusters on ports 5433 and 5434, streaming,
# synchronous).
#   scripts/ledger-failover.sh            [TOTAL=10000 WORKERS=96 DELAY=3 PRESSURE=0]
# Round 1: a flood on a TOTAL-unit voucher (distinct customers, one in ten confirming, one in
# ten releasing) over the three nodes; at a third sold the primary's postmaster is SIGKILLed,
# DELAY seconds later the standby is promoted (the failover manager's part, played by the
# script). It prints the answers during the outage (503 with Retry-After within the deadline,
# none hung), how soon after the promotion each node answered 201 again, and the books read
# from the promoted primary against the 201s, confirms and releases the clients saw (lost,
# phantom, oversold, sold %, balanced, live nodes reaped). Then the old primary rejoins as the
# standby (pg_rewind) and round 2 fails over back the same way. Exits non-zero if a check
# fails. PRESSURE=N adds wrk with N connections per node on a second voucher throughout (its
# books must balance too). Traffic goes to 127.0.0.1 only and stops by itself.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
need psql python3 curl pg_createcluster
[ "${PRESSURE:-0}" = 0 ] || need wrk
bin=$(release_bin)
token="failover-$RANDOM$RANDOM"
scripts/ledger-pair.sh up >/dev/null
scripts/ledger-pair.sh check
fdb="failover_$RANDOM"
psql -X -q -h 127.0.0.1 -p "$(scripts/ledger-pair.sh primary)" -U postgres -d postgres -c "CREATE DATABASE $fdb"
url=$(DB=$fdb scripts/ledger-pair.sh url)
deadline=$(python3 -c 'import tomllib; print(tomllib.load(open("config/default.toml","rb"))["ledger"]["timeout_ms"])')
bases=()
for i in 1 2 3; do
  port=$(free_port)
  VOUCHERS__HTTP__HOST=127.0.0.1 VOUCHERS__HTTP__PORT=$port VOUCHERS__LEDGER__URL="$url" \
  VOUCHERS__ADMIN__TOKEN=$token VOUCHERS__REDIS__URL="$redis" VOUCHERS__NODE__ID="failover-$i" \
  VOUCHERS__REDIS__EVENTS_STREAM="" RUST_LOG="${NODE_LOG:-warn}" "$bin" --config config/cluster.toml >"$work/node$i.log" 2>&1 &
  pids+=($!)
  wait_ready "http://127.0.0.1:$port"
  bases+=("http://127.0.0.1:$port")
done
nodes=$(IFS=,; echo "${bases[*]}")
status=0
for round in 1 2; do
  python3 scripts/ledger-failover.py --nodes "$nodes" --token "$token" --pair scripts/ledger-pair.sh \
    --db "$fdb" --total "${TOTAL:-10000}" --workers "${WORKERS:-96}" --delay "${DELAY:-3}" \
    --round "$round" --deadline-ms "$deadline" --pressure "${PRESSURE:-0}" || status=1
  for b in "${bases[@]}"; do
    echo "  $b/health/ready: $(curl -sS "$b/health/ready")"
  done
  back=$(scripts/ledger-pair.sh rejoin) || { echo "  the old primary could not rejoin" >&2; status=1; break; }
  state=$(scripts/ledger-pair.sh check) || { echo "  the pair is not synchronous again" >&2; status=1; break; }
  echo "  the old primary rejoined as the standby (port $back): $state"
done
grep -h "primary moved\|circuit\|no ledger server" "$work"/node1.log | sed -e "s/\x1b\[[0-9;]*m//g" -e "s/^/  log: /" | head -60 || true
exit $status

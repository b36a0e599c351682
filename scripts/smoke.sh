#!/usr/bin/env bash
# The README's start command, run the way a newcomer runs it: the first `cargo run` line of
# README.md, exactly as written (release build, embedded default, port 8080), from the repository
# root. Waits for /health/ready, creates a voucher with the admin token the node printed, reserves
# a unit (201), stops the node with SIGTERM and checks that it exits cleanly. Any failed step
# fails the script. Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."

base=http://127.0.0.1:8080
# How long the first start may take: it includes the release build on a fresh clone.
build_deadline_s=${SMOKE_BUILD_DEADLINE_S:-1800}

fail() { echo "smoke: $*" >&2; [ -s "${log:-/dev/null}" ] && tail -n 30 "$log" >&2; exit 1; }

start_cmd=$(grep -m1 -E '^cargo run( |$)' README.md | sed -E 's/[[:space:]]*#.*$//')
[ -n "$start_cmd" ] || fail "README.md shows no 'cargo run' start command"
curl -s -o /dev/null "$base/health/live" && fail "something already listens on $base"

log=$(mktemp)
pid=""
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$log"
}
trap cleanup EXIT

echo "smoke: $start_cmd"
# `cargo run` execs the binary on Unix, so $pid is the node itself once it is built.
$start_cmd >"$log" 2>&1 &
pid=$!

deadline=$((SECONDS + build_deadline_s))
until curl -fsS -o /dev/null "$base/health/ready" 2>/dev/null; do
  kill -0 "$pid" 2>/dev/null || { wait "$pid" || true; fail "'$start_cmd' exited before it was ready"; }
  [ "$SECONDS" -lt "$deadline" ] || fail "not ready within ${build_deadline_s}s"
  sleep 1
done

token=$(sed -nE 's/^admin token \(generated[^)]*\): ([0-9a-f]+)$/\1/p' "$log" | head -n1)
token=${VOUCHERS__ADMIN__TOKEN:-$token}
[ -n "$token" ] || fail "the node printed no admin token"

code="SMOKE_$(date +%s)_$$"
status=$(curl -s -o /dev/null -w '%{http_code}' -XPOST "$base/admin/vouchers" \
  -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
  -d "{\"code\":\"$code\",\"discountAmount\":1000,\"minOrderAmount\":0,\"totalLimit\":10,
       \"perUserLimit\":1,\"startsAt\":\"2020-01-01T00:00:00Z\",\"endsAt\":\"2100-01-01T00:00:00Z\"}")
[ "$status" = 201 ] || fail "create voucher answered $status, not 201"

status=$(curl -s -o /dev/null -w '%{http_code}' -XPOST "$base/vouchers/$code/reservations" \
  -H 'Content-Type: application/json' -d '{"customerId":1,"orderId":"smoke-1","orderAmount":5000}')
[ "$status" = 201 ] || fail "reserve answered $status, not 201"

kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
pid=""
[ "$rc" = 0 ] || fail "the node exited with $rc after SIGTERM"
echo "smoke: started, created $code, reserved a unit (201), stopped cleanly on SIGTERM"

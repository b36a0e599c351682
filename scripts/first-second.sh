#!/usr/bin/env bash
# The first second of a sale against its tenth (issue 11, pre-heat): runs
# load-tests/first-second.js against BASE_URL(S) with k6's JSON output, then prints, for every
# second of the sale (from its first 201), the count and p50/p99 of the 201s' latency.
# Usage: BASE_URL=http://127.0.0.1:8080 ADMIN_TOKEN=… scripts/first-second.sh [k6 -e options]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
k6 run --quiet --out "json=$out" "$@" "$root/load-tests/first-second.js" >/dev/null
python3 - "$out" <<'PY'
import json, sys
from datetime import datetime
samples = []
for line in open(sys.argv[1]):
    e = json.loads(line)
    if e.get("type") != "Point" or e.get("metric") != "http_req_duration":
        continue
    d = e["data"]
    if d["tags"].get("kind") != "reserve" or d["tags"].get("status") != "201":
        continue
    t = datetime.fromisoformat(d["time"].replace("Z", "+00:00")).timestamp()
    samples.append((t, d["value"]))
if not samples:
    sys.exit("no 201s")
samples.sort()
t0 = samples[0][0]
buckets = {}
for t, v in samples:
    buckets.setdefault(int(t - t0), []).append(v)
def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]
print("second  201s   p50 ms  p99 ms")
for s in sorted(buckets):
    xs = buckets[s]
    print(f"{s + 1:6d} {len(xs):6d} {pct(xs, 0.5):8.2f} {pct(xs, 0.99):7.2f}")
PY

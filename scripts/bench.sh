#!/usr/bin/env bash
# One node against its yardsticks, as ratios to the actix-web ceiling measured in the same run:
# see scripts/bench.py for what it runs and reports. Several nodes: scripts/bench-cluster.sh.
set -euo pipefail
exec python3 "$(dirname "$0")/bench.py" "$@"

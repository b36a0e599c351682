#!/usr/bin/env bash
# A Redis Cluster of three primaries on this machine (ports REDIS_CLUSTER_PORTS, "7101 7102 7103"
# by default; no replicas, nothing kept on disk), for the sharded pub/sub of the signals
# (`redis.cluster = true`, docs/DESIGN.md "Signals").
#   scripts/redis-cluster.sh up     (re)build the cluster from scratch; waits for cluster_state:ok
#   scripts/redis-cluster.sh url    the seed URLs, space-separated, for `redis.url`
#   scripts/redis-cluster.sh check  every primary answers and the cluster's state is ok
#   scripts/redis-cluster.sh down   stop the three servers and drop their files
# One user at a time: `up` rebuilds the cluster, whoever else is using it.
set -euo pipefail
command -v redis-server >/dev/null || { echo "redis-cluster: no redis-server here (apt-get install redis-server)" >&2; exit 1; }
read -r -a ports <<<"${REDIS_CLUSTER_PORTS:-7101 7102 7103}"
dir=${REDIS_CLUSTER_DIR:-/tmp/vouchers-redis-cluster}

urls() { local out=(); for p in "${ports[@]}"; do out+=("redis://127.0.0.1:$p"); done; echo "${out[*]}"; }
state_ok() { redis-cli -p "${ports[0]}" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }
check() {
  for p in "${ports[@]}"; do [ "$(redis-cli -p "$p" ping 2>/dev/null)" = PONG ] || return 1; done
  state_ok
}
down() {
  for p in "${ports[@]}"; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
  for p in "${ports[@]}"; do
    for _ in $(seq 50); do redis-cli -p "$p" ping >/dev/null 2>&1 || break; sleep 0.1; done
  done
  rm -rf "$dir"
}
up() {
  down
  for p in "${ports[@]}"; do
    mkdir -p "$dir/$p"
    redis-server --port "$p" --bind 127.0.0.1 --daemonize yes --dir "$dir/$p" \
      --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 2000 \
      --save "" --appendonly no --logfile "$dir/$p/redis.log" >/dev/null
  done
  for p in "${ports[@]}"; do
    for _ in $(seq 50); do [ "$(redis-cli -p "$p" ping 2>/dev/null)" = PONG ] && break; sleep 0.1; done
  done
  local hosts=(); for p in "${ports[@]}"; do hosts+=("127.0.0.1:$p"); done
  redis-cli --cluster create "${hosts[@]}" --cluster-replicas 0 --cluster-yes >/dev/null
  for _ in $(seq 100); do
    if check; then echo "redis-cluster: up on ${ports[*]}"; return 0; fi
    sleep 0.1
  done
  echo "redis-cluster: cluster_state is not ok after 10 s" >&2; return 1
}

case "${1:-}" in
  up) up ;;
  url) urls ;;
  check) check || { echo "redis-cluster: not up on ${ports[*]} (scripts/redis-cluster.sh up)" >&2; exit 1; } ;;
  down) down ;;
  *) echo "usage: $0 up|url|check|down" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# A ledger primary with a synchronous standby on this machine, from Debian's PostgreSQL packages:
# two clusters, ledger_a and ledger_b (ports LEDGER_PAIR_PORTS, "5433 5434" by default), streaming
# replication, synchronous commit. This script plays the failover manager's part (what
# pg_auto_failover or Patroni do in production): it kills, promotes and rejoins on command.
#   scripts/ledger-pair.sh up        (re)build both clusters from scratch and start them
#   scripts/ledger-pair.sh url       the multi-host URL of database DB (default test) for nodes
#   scripts/ledger-pair.sh primary   the port of the writable primary (fails if none)
#   scripts/ledger-pair.sh kill [PORT]  SIGKILL the primary's (or PORT's) postmaster and every
#                                    process it started
#   scripts/ledger-pair.sh promote   promote the standby; it runs alone (nothing waits for a
#                                    standby) until `rejoin`, as pg_auto_failover's wait_primary
#   scripts/ledger-pair.sh rejoin    the killed server back as the synchronous standby of the
#                                    new primary (pg_rewind; a new base backup if that fails)
#   scripts/ledger-pair.sh revive    start the killed server as it was, taking writes alone: an
#                                    old primary back unfenced (a split brain, for the tests)
#   scripts/ledger-pair.sh check     both up, one primary, the other streaming synchronously
#   scripts/ledger-pair.sh down      stop and drop both clusters
# Run as root (it uses pg_createcluster / pg_ctlcluster and runs the PostgreSQL tools as postgres).
# One user at a time: `up` rebuilds both clusters, whoever else is using them.
set -euo pipefail
[ -d /etc/postgresql ] || { echo "ledger-pair: no PostgreSQL clusters here (apt-get install postgresql)" >&2; exit 1; }
version=${LEDGER_PAIR_PG:-$(ls /etc/postgresql | sort -n | tail -n1)}
bin=/usr/lib/postgresql/$version/bin
read -r port_a port_b <<<"${LEDGER_PAIR_PORTS:-5433 5434}"
names=(ledger_a ledger_b)
ports=("$port_a" "$port_b")

as_pg() { runuser -u postgres -- "$@"; }
data_of() { echo "/var/lib/postgresql/$version/$1"; }
q() { psql -X -Atq -h 127.0.0.1 -p "$1" -U postgres -d postgres -c "$2"; }
up_at() { pg_isready -q -h 127.0.0.1 -p "$1"; }
other() { [ "$1" = 0 ] && echo 1 || echo 0; }

# The index (0 or 1) of the writable primary, or nothing.
primary_index() {
  for i in 0 1; do
    if up_at "${ports[$i]}" && [ "$(q "${ports[$i]}" 'SELECT pg_is_in_recovery()' 2>/dev/null)" = f ]; then
      echo "$i"; return
    fi
  done
}

wait_for() { # SECONDS WHAT COMMAND...: until COMMAND succeeds
  local secs=$1 what=$2; shift 2
  for _ in $(seq 1 $((secs * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "ledger-pair: $what did not happen within ${secs}s" >&2; return 1
}

streaming_sync() { # PRIMARY_PORT: a standby streams and counts as synchronous
  [ "$(q "$1" "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' AND sync_state IN ('sync','quorum')")" -ge 1 ]
}

make_sync() { # PRIMARY_PORT: commits wait for the standby again
  q "$1" "ALTER SYSTEM SET synchronous_standby_names = '*'" && q "$1" "SELECT pg_reload_conf()" >/dev/null
  wait_for 30 "a synchronous standby on $1" streaming_sync "$1"
}

hba() {
  cat >"/etc/postgresql/$version/$1/pg_hba.conf" <<'EOF'
local   all          all                 trust
host    all          all   127.0.0.1/32  trust
local   replication  all                 trust
host    replication  all   127.0.0.1/32  trust
EOF
}

down() {
  for n in "${names[@]}"; do
    # A postmaster left stopped (a `kill` cut short) takes no signal but SIGKILL and SIGCONT.
    pid=$(head -n1 "$(data_of "$n")/postmaster.pid" 2>/dev/null || true)
    if [ -n "$pid" ]; then kill -CONT "$pid" 2>/dev/null || true; fi
    if [ -d "/etc/postgresql/$version/$n" ]; then
      pg_dropcluster --stop "$version" "$n" 2>/dev/null || {
        pg_ctlcluster --skip-systemctl-redirect "$version" "$n" stop -m immediate 2>/dev/null || true
        pg_dropcluster "$version" "$n"
      }
    fi
  done
}

standby_from() { # INDEX PRIMARY_PORT: a fresh base backup of the primary into INDEX's data dir
  local n=${names[$1]} data
  data=$(data_of "$n")
  pg_ctlcluster --skip-systemctl-redirect "$version" "$n" stop -m immediate 2>/dev/null || true
  rm -rf "$data" && install -d -o postgres -g postgres -m 700 "$data"
  as_pg "$bin/pg_basebackup" -h 127.0.0.1 -p "$2" -U postgres -D "$data" -X stream -c fast \
    -R -d "application_name=$n"
}

case "${1:-}" in
  up)
    down
    for i in 0 1; do
      pg_createcluster "$version" "${names[$i]}" -p "${ports[$i]}" \
        -o max_connections=300 -o wal_level=replica \
        -o max_wal_senders=10 -o wal_keep_size=1GB -o wal_log_hints=on -o hot_standby=on \
        -o synchronous_commit=on -o shared_buffers=128MB -o wal_receiver_status_interval=1s \
        -o log_min_messages=warning >/dev/null
      hba "${names[$i]}"
    done
    pg_ctlcluster --skip-systemctl-redirect "$version" ledger_a start
    wait_for 30 "ledger_a up" up_at "$port_a"
    q "$port_a" "CREATE DATABASE test" >/dev/null
    standby_from 1 "$port_a"
    pg_ctlcluster --skip-systemctl-redirect "$version" ledger_b start
    make_sync "$port_a"
    ;;
  url)
    echo "postgres://postgres@127.0.0.1:$port_a,127.0.0.1:$port_b/${DB:-test}?target_session_attrs=read-write"
    ;;
  primary)
    i=$(primary_index)
    [ -n "$i" ] || { echo "ledger-pair: no primary" >&2; exit 1; }
    echo "${ports[$i]}"
    ;;
  kill)
    if [ -n "${2:-}" ]; then
      i=-1; for k in 0 1; do [ "${ports[$k]}" = "$2" ] && i=$k; done
      [ "$i" -ge 0 ] || { echo "ledger-pair: $2 is not a port of the pair" >&2; exit 1; }
    else
      i=$(primary_index)
      [ -n "$i" ] || { echo "ledger-pair: no primary to kill" >&2; exit 1; }
    fi
    pid=$(head -n1 "$(data_of "${names[$i]}")/postmaster.pid")
    # What a dead machine does: stopped first, so it forks nothing more; then every process
    # killed at once, so no backend lives on to answer.
    kill -STOP "$pid"
    children=$(pgrep -P "$pid" || true)
    kill -9 "$pid" $children 2>/dev/null || true
    wait_for 10 "the server gone" bash -c "! kill -0 $pid 2>/dev/null"
    echo "${ports[$i]}"
    ;;
  revive)
    for i in 0 1; do
      if ! up_at "${ports[$i]}"; then
        pg_ctlcluster --skip-systemctl-redirect "$version" "${names[$i]}" start >/dev/null 2>&1
        wait_for 30 "${names[$i]} up" up_at "${ports[$i]}"
        if [ "$(q "${ports[$i]}" 'SELECT pg_is_in_recovery()')" = f ]; then
          q "${ports[$i]}" "ALTER SYSTEM SET synchronous_standby_names = ''" && q "${ports[$i]}" "SELECT pg_reload_conf()" >/dev/null
        fi
        echo "${ports[$i]}"
        exit 0
      fi
    done
    echo "ledger-pair: nothing to revive" >&2; exit 1
    ;;
  promote)
    # The standby is the one that answers and is in recovery.
    for i in 0 1; do
      if up_at "${ports[$i]}" && [ "$(q "${ports[$i]}" 'SELECT pg_is_in_recovery()')" = t ]; then
        # Alone from now on: nothing may wait for a standby that is gone.
        q "${ports[$i]}" "ALTER SYSTEM SET synchronous_standby_names = ''" 2>/dev/null \
          && q "${ports[$i]}" "SELECT pg_reload_conf()" >/dev/null 2>&1
        as_pg "$bin/pg_ctl" promote -w -D "$(data_of "${names[$i]}")" >/dev/null
        echo "${ports[$i]}"
        exit 0
      fi
    done
    echo "ledger-pair: no standby to promote" >&2; exit 1
    ;;
  rejoin)
    p=$(primary_index)
    [ -n "$p" ] || { echo "ledger-pair: no primary to rejoin" >&2; exit 1; }
    o=$(other "$p"); n=${names[$o]}
    pg_ctlcluster --skip-systemctl-redirect "$version" "$n" stop -m fast >/dev/null 2>&1 || true
    # A freshly promoted primary's control file names its new timeline only after a checkpoint;
    # pg_rewind reads it there.
    q "${ports[$p]}" "CHECKPOINT"
    src="host=127.0.0.1 port=${ports[$p]} user=postgres dbname=postgres application_name=$n"
    if ! as_pg "$bin/pg_rewind" --target-pgdata="$(data_of "$n")" --source-server="$src" -R \
        --config-file="/etc/postgresql/$version/$n/postgresql.conf" >"/tmp/ledger-pair-rewind.log" 2>&1; then
      echo "ledger-pair: pg_rewind failed; taking a new base backup" >&2
      standby_from "$o" "${ports[$p]}"
    fi
    # pg_rewind (or the base backup) copied the primary's settings, which wait for nobody yet.
    pg_ctlcluster --skip-systemctl-redirect "$version" "$n" start >/dev/null
    make_sync "${ports[$p]}"
    echo "${ports[$o]}"
    ;;
  check)
    p=$(primary_index)
    [ -n "$p" ] || { echo "ledger-pair: no primary" >&2; exit 1; }
    streaming_sync "${ports[$p]}" || { echo "ledger-pair: no synchronous standby streams from ${ports[$p]}" >&2; exit 1; }
    [ "$(q "${ports[$p]}" 'SHOW synchronous_commit')" = on ] || { echo "ledger-pair: synchronous_commit is off" >&2; exit 1; }
    echo "primary ${ports[$p]}, synchronous standby ${ports[$(other "$p")]}"
    ;;
  down) down ;;
  *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac

#!/usr/bin/env python3
"""Where one node's time goes under a never-sells-out flood, per thread and per syscall.

    scripts/where-time-goes.py VOUCHERS [--random] [--postgres] [--duration S] [--syscalls]
                                        [--engine-bin PATH]

Starts the release build on a fresh ledger (a scratch SQLite file, or a scratch PostgreSQL
database with --postgres), creates VOUCHERS vouchers that never sell out, warms them, and runs
wrk (-t2 -c256, load-tests/wrk-reserve.lua) against them. Prints req/s and p99, the CPU each of
the engine's threads used per request (HTTP workers, the ledger's runtime, sqlx's SQLite worker),
how busy the group committer kept the ledger (merged commits in flight on average, rows and
vouchers per merged commit), lease grants per 1,000 reservations, and with --syscalls the log
writes (pwrite), fsyncs and reads per 1,000 requests (perf stat on the engine's process).
Engine settings come from the environment as usual (VOUCHERS__…), so an A/B of a setting is two
calls with and without it; interleave them, as the machine's speed drifts between runs. The node,
wrk and the metrics go through scripts/bench.py's helpers, as in a bench run.
"""
import argparse
import collections
import os
import random
import shutil
import subprocess
import tempfile
import time

import bench

SYSCALLS = ["pwrite64", "fsync", "fdatasync", "pread64"]


def thread_cpu(pid):
    """CPU seconds per thread name of process `pid` (bench.cpu_seconds, per thread)."""
    tids = os.listdir(f"/proc/{pid}/task")
    names = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[f"{pid}/task/{tid}"] = f.read().strip()
        except FileNotFoundError:
            pass  # gone meanwhile
    out = collections.defaultdict(float)
    for task, used in bench.cpu_seconds(list(names)).items():
        out[names[task]] += used
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("vouchers", type=int)
    ap.add_argument("--random", action="store_true", help="scatter customer ids")
    ap.add_argument("--postgres", action="store_true")
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--syscalls", action="store_true")
    ap.add_argument("--engine-bin", default=os.path.join(bench.BIN, "vouchers"))
    args = ap.parse_args()
    # What bench.wrk_argv and bench.start_node read of bench's own arguments.
    args.threads, args.conns = 2, 256

    work = tempfile.mkdtemp(prefix="where-time-goes-")
    procs = bench.Procs(work)
    db = None
    try:
        if args.postgres:
            db = f"where_time_goes_{random.randrange(1 << 30)}"
            bench.psql(bench.PG_ADMIN, f"CREATE DATABASE {db}")
            url = bench.PG_ADMIN.rsplit("/", 1)[0] + "/" + db
            node, base = bench.start_node(procs, "postgres", url, args, cluster=True)
        else:
            node, base = bench.start_node(procs, "sqlite", f"sqlite://{work}/ledger.db", args)
        stem = f"WTG{args.vouchers}V"
        codes = [stem] if args.vouchers == 1 else [f"{stem}{i}" for i in range(args.vouchers)]
        for code in codes:
            bench.create(base, code, 10 ** 9)
        before, cpu0 = bench.scrape(base), thread_cpu(node.pid)
        stat = None
        if args.syscalls:
            events = ",".join(f"syscalls:sys_enter_{c}" for c in SYSCALLS)
            stat = subprocess.Popen(
                ["perf", "stat", "-x,", "-e", events, "-o", f"{work}/stat", "-p", str(node.pid),
                 "--", "sleep", str(args.duration)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = bench.wrk(base, codes[0] if args.vouchers == 1 else stem, f"{stem}-n0", args.vouchers,
                      args, customers="random" if args.random else "rising")
        cpu1 = thread_cpu(node.pid)
        if stat:
            stat.wait()
        time.sleep(1)  # answers in flight when wrk stopped land before the counters are read
        after = bench.scrape(base)
        d = lambda name, label="": bench.metric(after, name, label) - bench.metric(before, name, label)
        answered = sum(r["statuses"].values()) or 1
        rows = d("vouchers_ledger_commit_rows_sum") or 1
        commits = d("vouchers_ledger_commit_rows_count") or 1
        busy = d("vouchers_ledger_commit_duration_seconds_sum")
        print(f"{args.vouchers} voucher(s), {'random' if args.random else 'rising'} customers, "
              f"{'postgres' if args.postgres else 'sqlite'}: {r['rps']:,.0f} req/s, "
              f"p99 {r['p99']} ms")
        for name, c in sorted(cpu1.items(), key=lambda kv: -kv[1]):
            used = c - cpu0.get(name, 0)
            if used > 0.05:
                print(f"  thread {name:18s} {used:6.2f} s CPU, {1e6 * used / answered:6.1f} µs/req")
        print(f"  merged commits: {commits:,.0f}, {rows / commits:.1f} rows and "
              f"{d('vouchers_ledger_commit_batches_sum') / commits:.1f} vouchers each, "
              f"{busy / args.duration:.2f} in flight on average (SQLite runs one at a time: "
              f"its share of the wall time)")
        granted = d("vouchers_lease_events_total", 'event="granted"')
        print(f"  lease grants: {granted:,.0f} ({1000 * granted / rows:.1f} per 1,000 reservations)")
        if stat:
            for line in open(f"{work}/stat"):
                parts = line.strip().split(",")
                if len(parts) > 2 and parts[2].startswith("syscalls:"):
                    n = float(parts[0]) if parts[0].replace(".", "").isdigit() else 0
                    print(f"  {parts[2][len('syscalls:sys_enter_'):]:10s} "
                          f"{1000 * n / answered:8.1f} per 1,000 requests")
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
        if db:
            subprocess.run(["psql", "-q", bench.PG_ADMIN, "-c",
                            f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"], capture_output=True)


if __name__ == "__main__":
    main()

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
calls with and without it; interleave them, as the machine's speed drifts between runs.
"""
import argparse
import collections
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "where-time-goes"
PG_ADMIN = os.environ.get("TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
SYSCALLS = ["pwrite64", "fsync", "fdatasync", "pread64"]


def http(base, method, path, body=None):
    req = urllib.request.Request(
        base + path, method=method, data=json.dumps(body).encode() if body else None,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def thread_cpu(pid):
    """CPU seconds per thread name."""
    out = collections.defaultdict(float)
    tick = os.sysconf("SC_CLK_TCK")
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            st = open(f"/proc/{pid}/task/{t}/stat").read()
        except FileNotFoundError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        f = st[st.rindex(")") + 2:].split()
        out[name] += (int(f[11]) + int(f[12])) / tick
    return out


def metrics(base):
    values = collections.defaultdict(float)
    for line in http(base, "GET", "/metrics")[1].splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("vouchers", type=int)
    ap.add_argument("--random", action="store_true", help="scatter customer ids")
    ap.add_argument("--postgres", action="store_true")
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--syscalls", action="store_true")
    ap.add_argument("--engine-bin", default=os.path.join(ROOT, "target", "release", "vouchers"))
    args = ap.parse_args()

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    base = f"http://127.0.0.1:{port}"
    work = tempfile.mkdtemp(prefix="where-time-goes-")
    env = dict(os.environ, VOUCHERS__HTTP__PORT=str(port), VOUCHERS__ADMIN__TOKEN=TOKEN,
               VOUCHERS__NODE__ID="where-time-goes", RUST_LOG="warn")
    argv = [args.engine_bin]
    db = None
    if args.postgres:
        db = f"where_time_goes_{port}"
        subprocess.run(["psql", "-q", PG_ADMIN, "-c", f"CREATE DATABASE {db}"], check=True)
        env["VOUCHERS__LEDGER__URL"] = PG_ADMIN.rsplit("/", 1)[0] + f"/{db}"
        env["VOUCHERS__REDIS__URL"] = ""
        argv += ["--config", "config/cluster.toml"]
    else:
        env["VOUCHERS__LEDGER__URL"] = f"sqlite://{work}/ledger.db"
    node = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=open(f"{work}/log", "w"),
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while True:
            try:
                if http(base, "GET", "/health/ready")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or node.poll() is not None:
                raise SystemExit(f"the node did not get ready; see {work}/log")
            time.sleep(0.1)
        stem = f"WTG{args.vouchers}V"
        codes = [stem] if args.vouchers == 1 else [f"{stem}{i}" for i in range(args.vouchers)]
        for code in codes:
            status, body = http(base, "POST", "/admin/vouchers",
                                {"code": code, "discountAmount": 100, "totalLimit": 10 ** 9,
                                 "perUserLimit": 1})
            assert status == 201, (status, body)
        for code in codes:
            assert http(base, "POST", f"/admin/vouchers/{code}/warm")[0] == 204
        before, cpu0 = metrics(base), thread_cpu(node.pid)
        stat = None
        if args.syscalls:
            events = ",".join(f"syscalls:sys_enter_{c}" for c in SYSCALLS)
            stat = subprocess.Popen(
                ["perf", "stat", "-x,", "-e", events, "-o", f"{work}/stat", "-p", str(node.pid),
                 "--", "sleep", str(args.duration)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wrk = subprocess.run(
            ["wrk", "-t2", "-c256", f"-d{args.duration}s", "-s",
             os.path.join(ROOT, "load-tests", "wrk-reserve.lua"), base, "--",
             codes[0] if args.vouchers == 1 else stem, f"{stem}-n0", str(args.vouchers)]
            + (["random"] if args.random else []),
            capture_output=True, text=True, check=True).stdout
        cpu1 = thread_cpu(node.pid)
        if stat:
            stat.wait()
        time.sleep(1)  # answers in flight when wrk stopped land before the counters are read
        after = metrics(base)
        d = lambda key: after[key] - before[key]
        rps = next(float(l.split()[-1]) for l in wrk.splitlines() if "Requests/sec" in l)
        p99 = next(l.split()[3] for l in wrk.splitlines() if l.startswith("p50"))
        answered = rps * args.duration
        rows = d("vouchers_ledger_commit_rows_sum") or 1
        commits = d("vouchers_ledger_commit_rows_count") or 1
        busy = d("vouchers_ledger_commit_duration_seconds_sum")
        print(f"{args.vouchers} voucher(s), {'random' if args.random else 'rising'} customers, "
              f"{'postgres' if args.postgres else 'sqlite'}: {rps:,.0f} req/s, p99 {p99}")
        for name, c in sorted(cpu1.items(), key=lambda kv: -kv[1]):
            used = c - cpu0.get(name, 0)
            if used > 0.05:
                print(f"  thread {name:18s} {used:6.2f} s CPU, {1e6 * used / answered:6.1f} µs/req")
        print(f"  merged commits: {commits:,.0f}, {rows / commits:.1f} rows and "
              f"{d('vouchers_ledger_commit_batches_sum') / commits:.1f} vouchers each, "
              f"{busy / args.duration:.2f} in flight on average (SQLite runs one at a time: "
              f"its share of the wall time)")
        granted = d('vouchers_lease_events_total{event="granted"}')
        print(f"  lease grants: {granted:,.0f} ({1000 * granted / rows:.1f} per 1,000 reservations)")
        if stat:
            for line in open(f"{work}/stat"):
                parts = line.strip().split(",")
                if len(parts) > 2 and parts[2].startswith("syscalls:"):
                    n = float(parts[0]) if parts[0].replace(".", "").isdigit() else 0
                    print(f"  {parts[2][len('syscalls:sys_enter_'):]:10s} "
                          f"{1000 * n / answered:8.1f} per 1,000 requests")
    finally:
        node.terminate()
        node.wait()
        shutil.rmtree(work, ignore_errors=True)
        if db:
            subprocess.run(["psql", "-q", PG_ADMIN, "-c", f"DROP DATABASE IF EXISTS {db}"])


if __name__ == "__main__":
    main()

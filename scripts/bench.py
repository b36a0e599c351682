#!/usr/bin/env python3
"""Throughput and latency of POST …/reservations on this machine, as ratios to yardsticks measured
in the same run (absolute figures on a shared 2-core box drift 10-20 % between runs).

In one run, against the release build, each for DURATION seconds of wrk (CONNS connections,
distinct customers and order ids):

  ceiling      actix-web alone, parsing the same body (`baseline ceiling`), first and again
               last: 100 % is the mean of the two
  pg-sql       the one-row-per-request SQL solution on PostgreSQL (`baseline postgres`)
  redis-lua    the Redis Lua gateway, one script call per request (`baseline redis`)
  engine       one node on SQLite (the embedded default) and one node on PostgreSQL, each with
               one hot voucher and with 100 hot vouchers at once, as a sold-out flood (1000 units
               in all) and as a voucher that never sells out (every request a durable
               reservation). The never-sells-out rows run twice: with rising customer ids
               (each connection counts up, so a commit's rows share index pages) and with
               random ones (a real sale's: each reservation lands on a random index page)

  hostile      one SQLite node under abuse: a flood of unknown voucher codes (every request a
               code that was never created) against a sold-out flood on the same node, the node's
               RSS before and after at least a million junk requests, and real reserves
               (CONNS/2 connections) alone and beside a junk flood of as many connections

For every engine row it checks the books (201s seen by wrk vs the ledger, oversold units) and
reports ledger transactions per 1000 reservations: the node's merged group commits
(`vouchers_ledger_commits_total`), the actors' batches that went into them
(`vouchers_batch_size_count`), and on PostgreSQL every transaction the database ran
(`pg_stat_database`, grants, renewals and reads included). It also reports CPU per answered
request over the wrk run (`/proc/PID/stat`): the engine's, and on PostgreSQL every postgres
process's. Unlike req/s these hardly move with what else the machine runs.

Usage: scripts/bench.sh [--duration S] [--conns N] [--only NAME,…] [--kinds flood,never]
                       [--customers rising,random] [--engine-bin PATH]
(--only takes ceiling, pg-sql, redis-lua, sqlite, postgres, hostile)
Traffic goes to 127.0.0.1 only; every process it starts is stopped at the end.
"""
import argparse
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
PG_ADMIN = os.environ.get("BENCH_PG_ADMIN", "postgres://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379")
TOKEN = f"bench-{random.randrange(1 << 30)}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, token=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
            return r.status, (json.loads(text) if text.strip().startswith(("{", "[")) else text)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_ready(url, proc, log):
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"bench: process exited early; log:\n{open(log).read()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except Exception:
            time.sleep(0.1)
    sys.exit(f"bench: {url} not ready after 60 s")


class Procs:
    def __init__(self, work):
        self.work, self.procs = work, []

    def start(self, name, argv, env=None, ready=None):
        log = os.path.join(self.work, f"{name}.log")
        p = subprocess.Popen(argv, env={**os.environ, **(env or {})}, cwd=ROOT,
                             stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.procs.append(p)
        if ready:
            wait_ready(ready, p, log)
        return p

    def stop(self, p):
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                self.stop(p)


def wrk_argv(base, code, prefix, vouchers, args, conns=None, duration=None, customers="rising"):
    return ["wrk", f"-t{args.threads}", f"-c{conns or args.conns}",
            f"-d{duration or args.duration}s", "-s",
            os.path.join(ROOT, "load-tests", "wrk-reserve.lua"), base, "--", code, prefix,
            str(vouchers)] + (["random"] if customers == "random" else [])


def wrk(base, code, prefix, vouchers, args, conns=None, duration=None, customers="rising"):
    argv = wrk_argv(base, code, prefix, vouchers, args, conns, duration, customers)
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return parse_wrk(out)


def wrk_together(runs):
    """Runs several wrk at once (each an argv); returns their results in order."""
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for argv in runs]
    return [parse_wrk(p.communicate()[0]) for p in procs]


def parse_wrk(out):
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    m = re.search(r"p50 ([\d.]+)ms p99 ([\d.]+)ms", out)
    statuses = {int(k): int(v) for k, v in re.findall(r"status (\d+): (\d+)", out)}
    errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": rps, "p50": float(m.group(1)), "p99": float(m.group(2)),
            "statuses": statuses, "socket_errors": errors.group(1) if errors else ""}


def scrape(base):
    status, text = http("GET", f"{base}/metrics")
    sums = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        sums[name_labels] = float(value)
    return sums


def metric(snap, prefix, label=""):
    return sum(v for k, v in snap.items() if k.startswith(prefix) and label in k)


def psql(url, sql):
    return subprocess.run(["psql", "-Atq", url, "-c", sql], capture_output=True, text=True,
                          check=True).stdout.strip()


def pg_xacts(db):
    return int(psql(PG_ADMIN, f"select xact_commit + xact_rollback from pg_stat_database "
                              f"where datname = '{db}'") or 0)


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def create(base, code, total):
    s, body = http("POST", f"{base}/admin/vouchers",
                   {"code": code, "discountAmount": 100, "totalLimit": total, "perUserLimit": 1},
                   TOKEN)
    assert s == 201, (s, body)
    s, body = http("POST", f"{base}/admin/vouchers/{code}/warm", None, TOKEN)
    assert s == 204, (s, body)


def run_hostile(base, pid, tag, args):
    """The abuse rows: junk codes against a sold-out flood, RSS, real reserves beside junk."""
    rows = []
    sold_out = f"SOLD{tag}"
    create(base, sold_out, 1000)
    r = wrk(base, sold_out, f"{sold_out}-n0", 1, args)
    r.update(name="hostile: sold-out flood (1 voucher)")
    rows.append(r)
    flood_rps = r["rps"]
    # Every request names a code that does not exist: JUNK<tag>0 … JUNK<tag>999999.
    rss0 = rss_mb(pid)
    junk = 0
    while junk < 1_000_000:
        r = wrk(base, f"JUNK{tag}", f"JUNK{tag}-n{junk}", 1_000_000, args)
        junk += sum(r["statuses"].values())
        if len(rows) == 1:
            r.update(name="hostile: unknown-code flood")
            r["vs_flood"] = r["rps"] / flood_rps
            rows.append(r)
    rss1 = rss_mb(pid)
    rows[-1]["rss"] = (rss0, rss1, junk)
    real = f"REAL{tag}"
    create(base, real, 10 ** 9)
    half = max(1, args.conns // 2)
    r = wrk(base, real, f"{real}-n0", 1, args, conns=half)
    r.update(name=f"hostile: real reserves alone ({half} conns)")
    rows.append(r)
    alone = r["rps"]
    both = wrk_together([wrk_argv(base, real, f"{real}-n1", 1, args, conns=half),
                         wrk_argv(base, f"JUNK{tag}", f"JUNK{tag}-x", 1_000_000, args, conns=half)])
    both[0].update(name=f"hostile: real reserves beside junk ({half} + {half} conns)")
    both[0]["vs_alone"] = both[0]["rps"] / alone
    both[1].update(name="hostile: the junk beside them")
    rows += both
    return rows


def cpu_seconds(pids, children=False):
    """User + system CPU time each of the processes `pids` has used so far, in seconds; with
    `children`, that of its exited children too (a postmaster's: backends gone meanwhile)."""
    used = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks = fields[11:15] if children else fields[11:13]
            used[pid] = sum(int(t) for t in ticks) / os.sysconf("SC_CLK_TCK")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            pass  # gone meanwhile
    return used


def cpu_between(before, after):
    """CPU seconds used between two `cpu_seconds` readings; a process that started in between
    counts from zero (a backend the pool opened during the run)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def postgres_pids():
    out = subprocess.run(["pgrep", "-x", "postgres"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def run_engine_scenario(name, base, codes, total_each, args, db=None, pid=None,
                        customers="rising"):
    for code in codes:
        s, body = http("POST", f"{base}/admin/vouchers",
                       {"code": code, "discountAmount": 100, "totalLimit": total_each,
                        "perUserLimit": 1}, TOKEN)
        assert s == 201, (s, body)
    for code in codes:
        s, body = http("POST", f"{base}/admin/vouchers/{code}/warm", None, TOKEN)
        assert s == 204, (s, body)
    before, xa = scrape(base), pg_xacts(db) if db else 0
    stem = codes[0] if len(codes) == 1 else codes[0][:-1]
    # CPU per answered request, the engine's and (on PostgreSQL) the database's: unlike req/s it
    # does not move with whatever else the 2 cores run, so a change shows in it run to run.
    engine = [pid] if pid else []
    cpu0, pg0 = cpu_seconds(engine), cpu_seconds(postgres_pids() if db else [])
    r = wrk(base, stem, f"{stem}-n0", len(codes), args, customers=customers)
    cpu1, pg1 = cpu_seconds(engine), cpu_seconds(postgres_pids() if db else [])
    answered = sum(r["statuses"].values()) or 1
    time.sleep(1)  # wrk stops with answers in flight: let them land before reading the books
    after, xb = scrape(base), pg_xacts(db) if db else 0
    sold = 0
    balanced = True
    for code in codes:
        s, view = http("GET", f"{base}/admin/vouchers/{code}", None, TOKEN)
        sold += view["reserved"] + view["confirmed"]
        balanced &= view["balanced"]
    d = lambda p, label="": metric(after, p, label) - metric(before, p, label)
    commits = d("vouchers_ledger_commits_total", 'result="ok"')
    batches = d("vouchers_batch_size_count")
    per_k = lambda n: 1000 * n / sold if sold else float("nan")
    r.update(name=name, sold=sold, created=r["statuses"].get(201, 0), balanced=balanced,
             oversold=max(0, sold - total_each * len(codes)),
             commits_k=per_k(commits), batches_k=per_k(batches),
             pg_k=per_k(xb - xa) if db else None,
             cpu_us=1e6 * cpu_between(cpu0, cpu1) / answered if pid else None,
             pg_us=1e6 * cpu_between(pg0, pg1) / answered if db else None)
    return r


def quiesce_pg():
    """Flushes PostgreSQL's dirty pages now, so that no checkpoint runs during the next row."""
    psql(PG_ADMIN, "CHECKPOINT")


def run_baselines(names, procs, db_url, args, tag, want):
    """The yardsticks among `names`: the actix-web ceiling, one SQL transaction per request on
    PostgreSQL, one Redis Lua script call per request."""
    rows = []
    modes = {"ceiling": ("ceiling", None), "pg-sql": ("postgres", db_url),
             "redis-lua": ("redis", REDIS)}
    for name in names:
        if not want(name):
            continue
        mode, url = modes[name]
        port = free_port()
        argv = [os.path.join(BIN, "baseline"), mode, str(port)] + ([url] if url else [])
        p = procs.start(name, argv)
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while time.time() < deadline:  # the baselines have no health route: any answer will do
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                time.sleep(0.1)
        code = f"B{tag}{name.replace('-', '')}"
        http("POST", f"{base}/vouchers/{code}/reservations",
             {"customerId": 1, "orderId": f"{code}-warm", "orderAmount": 1})
        r = wrk(base, code, f"{code}-n0", 1, args)
        r.update(name=name)
        rows.append(r)
        procs.stop(p)
    return rows


def start_node(procs, name, ledger_url, args, cluster=False):
    """One engine node on `ledger_url` (with `config/cluster.toml` and no Redis if `cluster`),
    ready; returns its process and base URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"VOUCHERS__HTTP__PORT": str(port), "VOUCHERS__ADMIN__TOKEN": TOKEN,
           "VOUCHERS__NODE__ID": f"bench-{name}", "RUST_LOG": "warn",
           "VOUCHERS__LEDGER__URL": ledger_url}
    argv = [args.engine_bin]
    if cluster:
        argv += ["--config", "config/cluster.toml"]
        env["VOUCHERS__REDIS__URL"] = ""
    return procs.start(f"engine-{name}", argv, env, ready=f"{base}/health/ready"), base


def run_engine(procs, ledger, work, db_url, db, args, tag):
    """One node on `ledger`: one and 100 hot vouchers, sold-out flood and never-sells-out."""
    rows = []
    if ledger == "sqlite":
        p, base = start_node(procs, ledger, f"sqlite://{work}/ledger.db", args)
    else:
        p, base = start_node(procs, ledger, db_url, args, cluster=True)
    # Random customers only matter where reservations are written: the never-sells-out rows.
    scenarios = [("flood", 1000, "rising")] + [
        ("never", 10 ** 9, c) for c in args.customers.split(",")]
    for kind, total, customers in scenarios:
        if kind not in args.kinds.split(","):
            continue
        for n in (1, 100):
            stem = f"{kind.upper()}{customers[:2].upper()}{tag}{ledger[0].upper()}{n}V"
            codes = [stem] if n == 1 else [f"{stem}{i}" for i in range(n)]
            each = total if kind == "never" else total // n
            suffix = ", random customers" if customers == "random" else ""
            rows.append(run_engine_scenario(
                f"{ledger} {kind} {n}v{suffix}", base, codes, each, args,
                db if ledger == "postgres" else None, p.pid, customers))
    procs.stop(p)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=int, default=int(os.environ.get("DURATION", 10)))
    ap.add_argument("--conns", type=int, default=int(os.environ.get("CONNS", 256)))
    ap.add_argument("--threads", type=int, default=int(os.environ.get("THREADS", 2)))
    ap.add_argument("--only", default="", help="comma-separated: ceiling,pg-sql,redis-lua,sqlite,postgres")
    ap.add_argument("--kinds", default="flood,never",
                    help="comma-separated engine scenarios: flood (sold-out flood), never (durable)")
    ap.add_argument("--customers", default="rising,random",
                    help="comma-separated, for the never-sells-out rows: rising (each wrk connection's "
                         "customer and order ids count up, so a commit's rows share index pages) and "
                         "random (scattered like a real sale's: a random index page per reservation)")
    ap.add_argument("--engine-bin", default=os.path.join(BIN, "vouchers"),
                    help="the engine binary to measure (default: this tree's release build), "
                         "e.g. an earlier commit's build for a before/after in one run")
    args = ap.parse_args()
    if not set(args.customers.split(",")) <= {"rising", "random"}:
        ap.error("--customers takes rising, random or both")
    only = set(filter(None, args.only.split(",")))
    want = lambda n: not only or n in only
    for tool in ("wrk", "psql", "redis-cli"):
        if not shutil.which(tool):
            sys.exit(f"bench: install {tool}")
    subprocess.run(["cargo", "build", "--release", "--bins"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work = tempfile.mkdtemp(prefix="vouchers-bench-")
    procs = Procs(work)
    db = f"vouchers_bench_{random.randrange(1 << 30)}"
    psql(PG_ADMIN, f"CREATE DATABASE {db}")
    db_url = PG_ADMIN.rsplit("/", 1)[0] + "/" + db
    rows = []
    tag = f"{random.randrange(1 << 20):05x}"
    try:
        # PostgreSQL's own background work after a heavy row (checkpoints, autovacuum) would
        # land on the rows after it on these 2 cores: the rows that write to PostgreSQL run
        # last, each after a CHECKPOINT.
        rows += run_baselines(("ceiling", "redis-lua"), procs, db_url, args, tag, want)
        if want("sqlite"):
            rows += run_engine(procs, "sqlite", work, db_url, db, args, tag)
        quiesce_pg()
        rows += run_baselines(("pg-sql",), procs, db_url, args, tag, want)
        if want("postgres"):
            quiesce_pg()
            rows += run_engine(procs, "postgres", work, db_url, db, args, tag)
        if want("hostile"):
            quiesce_pg()
            p, base = start_node(procs, "hostile", f"sqlite://{work}/hostile.db", args)
            rows += run_hostile(base, p.pid, tag, args)
            procs.stop(p)
        # The ceiling once more: on a shared machine it drifts within a run too, and every row
        # is a share of the mean of the two.
        for r in run_baselines(("ceiling",), procs, db_url, args, tag + "e", want):
            r["name"] = "ceiling, again at the end"
            rows.append(r)
    finally:
        procs.stop_all()
        subprocess.run(["psql", "-q", PG_ADMIN, "-c", f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"],
                       capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    report(rows, args)


def report(rows, args):
    ceilings = [r["rps"] for r in rows if r["name"].startswith("ceiling")]
    ceiling = sum(ceilings) / len(ceilings) if ceilings else None
    print(f"release build, {os.cpu_count()} cores, wrk -t{args.threads} -c{args.conns} "
          f"-d{args.duration}s on the same machine")
    if len(ceilings) > 1:
        print(f"% of ceiling: of the mean of the ceiling's {len(ceilings)} runs, {ceiling:,.0f} "
              f"req/s (they differ by {100 * (max(ceilings) - min(ceilings)) / ceiling:.0f} %)")
    print()
    print("| run | req/s | % of ceiling | p50 ms | p99 ms | 201s (wrk) | ledger sold | oversold "
          "| balanced | merged commits /1k | actor batches /1k | PG xacts /1k "
          "| engine CPU µs/req | PG CPU µs/req |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f="{:.1f}": "" if v is None else f.format(v)
    for r in rows:
        pct = f"{100 * r['rps'] / ceiling:.0f} %" if ceiling else ""
        print(f"| {r['name']} | {r['rps']:,.0f} | {pct} | {r['p50']:.2f} | {r['p99']:.2f} "
              f"| {r['statuses'].get(201, 0)} | {fmt(r.get('sold'), '{}')} "
              f"| {fmt(r.get('oversold'), '{}')} | {fmt(r.get('balanced'), '{}')} "
              f"| {fmt(r.get('commits_k'))} | {fmt(r.get('batches_k'))} | {fmt(r.get('pg_k'))} "
              f"| {fmt(r.get('cpu_us'), '{:.0f}')} | {fmt(r.get('pg_us'), '{:.0f}')} |")
    for r in rows:
        if "vs_flood" in r:
            print(f"\n{r['name']}: {100 * r['vs_flood']:.0f} % of the sold-out flood's rate "
                  f"(statuses {r['statuses']})")
        if "rss" in r:
            rss0, rss1, n = r["rss"]
            print(f"RSS {rss0:.1f} MB before, {rss1:.1f} MB after {n:,} junk requests "
                  f"({rss1 - rss0:+.1f} MB)")
        if "vs_alone" in r:
            print(f"{r['name']}: {100 * r['vs_alone']:.0f} % of their rate alone")
    # The scaling figure: 100 hot vouchers against one, same ledger, kind and customers.
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        if " 1v" in r["name"]:
            many = by_name.get(r["name"].replace(" 1v", " 100v"))
            if many:
                print(f"{many['name']}: {100 * many['rps'] / r['rps']:.0f} % of the one-voucher rate")
    bad = [r["name"] for r in rows if r.get("oversold") or r.get("balanced") is False]
    errs = [f"{r['name']}: {r['socket_errors']}" for r in rows if r["socket_errors"]]
    if errs:
        print("\nsocket errors: " + "; ".join(errs))
    if bad:
        sys.exit(f"bench: books wrong in {bad}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The ledger in shards on this machine (issue 32): three PostgreSQL clusters on ports of their
own, three release nodes on them and Redis. Run as root (pg_createcluster, pg_ctlcluster).

  scripts/shards.py up       (re)create the clusters shard_a, shard_b, shard_c (5441-5443)
  scripts/shards.py run      the scenarios below, on fresh databases; prints the figures
  scripts/shards.py down     stop and drop the clusters

Scenarios of `run` (traffic to 127.0.0.1 only, each bounded in time):
  down   nine vouchers, three on each shard; wrk on each shard's vouchers (A, B, C: A and C on
         node 1, B on node 2), 8 s; then shard_c's server stops (immediate) and again 8 s:
         C's answers, A's and B's rates against before; a fourth node started meanwhile
         (ready? A on it 201, C 503); then shard_c starts again: the time from its readiness to
         C's first 201, on node 1 and on the node that started during the outage.
  kill   three vouchers of 4,000 units, one per shard, sold by wrk on all three nodes; node 3
         is SIGKILLed 2 s in; then the rest is sold on nodes 1 and 2. Prints sold, oversold
         (rows past the total), lost (201s the clients saw beyond the rows) and the books.
  model  the cost model of one shard: PostgreSQL CPU per reservation against the rows per
         merged commit, at 1 to 128 wrk connections (6 s each), fitted as a cost per row plus
         a cost per commit, with the capacity per PostgreSQL core it projects.
  contract  the HTTP contract from outside (scripts/contract.py) against three nodes on the
         three clusters, every request to the next node in turn.
  cost   PostgreSQL CPU per reservation (every process of the shards' clusters, /proc, by
         cluster) with the ledger on one server as ledger.url, then on 1, 2 and 3 shards,
         then 3 with order ids kept per shard: one never-selling-out voucher per shard, wrk
         -c64 on one node, 8 s each.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import contract  # noqa: E402  (its node stopping, shared)
CLUSTERS = [("shard_a", 5441), ("shard_b", 5442), ("shard_c", 5443)]
VERSION = os.environ.get("SHARDS_PG") or sorted(os.listdir("/etc/postgresql"), key=float)[-1]
DB = "vouchers_shards"
TOKEN = "shards-token"
REDIS = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379")
procs = []


def sh(*args, check=True, quiet=True):
    out = subprocess.DEVNULL if quiet else None
    return subprocess.run(args, check=check, stdout=out, stderr=out)


def psql(port, sql, db="postgres"):
    return subprocess.run(["psql", "-X", "-Atq", "-h", "127.0.0.1", "-p", str(port), "-U",
                           "postgres", "-d", db, "-c", sql],
                          check=True, capture_output=True, text=True).stdout.strip()


def ready(port):
    return subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1", "-p", str(port)]).returncode == 0


def until(what, secs, check):
    end = time.time() + secs
    while time.time() < end:
        if check():
            return
        time.sleep(0.05)
    sys.exit(f"shards: {what} did not happen within {secs} s")


def down():
    for name, _ in CLUSTERS:
        if os.path.isdir(f"/etc/postgresql/{VERSION}/{name}"):
            sh("pg_ctlcluster", "--skip-systemctl-redirect", VERSION, name, "stop", "-m",
               "immediate", check=False)
            sh("pg_dropcluster", VERSION, name, check=False)


def up():
    down()
    for name, port in CLUSTERS:
        sh("pg_createcluster", VERSION, name, "-p", str(port), "-o", "max_connections=200",
           "-o", "shared_buffers=128MB", "-o", "log_min_messages=warning")
        with open(f"/etc/postgresql/{VERSION}/{name}/pg_hba.conf", "w") as f:
            f.write("local all all trust\nhost all all 127.0.0.1/32 trust\n")
        sh("pg_ctlcluster", "--skip-systemctl-redirect", VERSION, name, "start")
        until(f"{name} up", 30, lambda: ready(port))


def url(port):
    return f"postgres://postgres@127.0.0.1:{port}/{DB}"


def fresh_databases():
    for name, port in CLUSTERS:
        if not ready(port):
            sys.exit(f"shards: {name} is not running on {port} (scripts/shards.py up)")
        psql(port, f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        psql(port, f"CREATE DATABASE {DB}")


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def http(method, base, path, body=None, token=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def start_nodes(shards, n=3, single=False, extra=None, name="shards"):
    binary = os.environ.get("VOUCHERS_BIN") or os.path.join(ROOT, "target/release/vouchers")
    bases = []
    for i in range(n):
        port = free_port()
        ledger = {"VOUCHERS__LEDGER__URL": shards[0]} if single else {
            "VOUCHERS__LEDGER__SHARDS": " ".join(shards)}
        env = dict(os.environ, VOUCHERS__HTTP__HOST="127.0.0.1", VOUCHERS__HTTP__PORT=str(port),
                   **ledger, VOUCHERS__ADMIN__TOKEN=TOKEN,
                   VOUCHERS__REDIS__URL=REDIS, VOUCHERS__NODE__ID=f"{name}-{i + 1}",
                   VOUCHERS__REDIS__EVENTS_STREAM="", RUST_LOG="error", **(extra or {}))
        log = open(f"/tmp/{name}-node{i + 1}.log", "w")
        p = subprocess.Popen([binary, "--config", "config/cluster.toml"], cwd=ROOT, env=env,
                             stdout=log, stderr=log)
        procs.append(p)
        base = f"http://127.0.0.1:{port}"
        until(f"node {i + 1} ready", 20, lambda: http_ok(base + "/health/ready"))
        bases.append(base)
    return bases


def stop_nodes():
    contract.stop(procs)
    procs.clear()


def http_ok(u):
    try:
        with urllib.request.urlopen(u, timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


def create(base, code, total):
    s, b = http("POST", base, "/admin/vouchers", {"code": code, "discountAmount": 100,
                                                  "totalLimit": total, "perUserLimit": 1}, TOKEN)
    assert s == 201, (code, s, b)


def placement():
    placed = {}
    for i, (_, port) in enumerate(CLUSTERS):
        for code in psql(port, "SELECT code FROM vouchers", DB).split():
            placed[code] = i
    return placed


def wrk(base, code, prefix, vouchers, secs, conns=32):
    return subprocess.Popen(["wrk", "-t1", f"-c{conns}", f"-d{secs}s", "-s",
                             "load-tests/wrk-reserve.lua", base, "--", code, prefix,
                             str(vouchers)], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def wrk_result(p):
    out = p.communicate()[0]
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    statuses = {int(k): int(v) for k, v in re.findall(r"status (\d+): (\d+)", out)}
    p99 = float(re.search(r"p99 ([\d.]+)ms", out).group(1))
    total = sum(statuses.values()) or 1
    return {"rps": rps, "statuses": statuses, "p99": p99,
            "ok_rps": rps * statuses.get(201, 0) / total}


def scenario_down(bases):
    n1, n2 = bases[0], bases[1]
    for i in range(3):
        for group in "ABC":
            create(n1, f"{group}{i}", 1_000_000_000)
    placed = placement()
    assert all(placed[f"{g}{i}"] == "ABC".index(g) for g in "ABC" for i in range(3)), placed

    def phase(tag):
        ps = {"A": wrk(n1, "A", f"a{tag}", 3, 8), "B": wrk(n2, "B", f"b{tag}", 3, 8),
              "C": wrk(n1, "C", f"c{tag}", 3, 8)}
        return {g: wrk_result(p) for g, p in ps.items()}

    before = phase("1")
    sh("pg_ctlcluster", "--skip-systemctl-redirect", VERSION, "shard_c", "stop", "-m",
       "immediate")
    during = phase("2")
    # C's refusals once its breaker is open (the phase above includes the first second, when
    # calls still wait out the pool before the breaker opens).
    settled = wrk_result(wrk(n1, "C", "c3", 3, 4))
    # A fourth node starts while shard_c is down: ready, sells A, answers C 503.
    t_start = time.time()
    late = start_nodes([url(p) for _, p in CLUSTERS], n=1, name="shards-late")[0]
    late_ready_ms = 1000 * (time.time() - t_start)
    late_a, _ = http("POST", late, "/vouchers/A0/reservations",
                     {"customerId": 10**13, "orderId": "late-a", "orderAmount": 10000})
    late_c, _ = http("POST", late, "/vouchers/C0/reservations",
                     {"customerId": 10**13 + 1, "orderId": "late-c", "orderAmount": 10000})
    sh("pg_ctlcluster", "--skip-systemctl-redirect", VERSION, "shard_c", "start")
    until("shard_c back", 30, lambda: ready(5443))
    t0, n = time.time(), 0
    while time.time() - t0 < 30:
        n += 1
        s, _ = http("POST", n1, "/vouchers/C0/reservations",
                    {"customerId": 10**12 + n, "orderId": f"back-{n}", "orderAmount": 10000})
        if s == 201:
            break
        time.sleep(0.01)
    back_ms = 1000 * (time.time() - t0)
    t0, n, late_back = time.time(), 0, None
    while time.time() - t0 < 30:
        n += 1
        s, _ = http("POST", late, "/vouchers/C0/reservations",
                    {"customerId": 10**13 + 10 + n, "orderId": f"late-back-{n}",
                     "orderAmount": 10000})
        if s == 201:
            late_back = 1000 * (time.time() - t0)
            break
        time.sleep(0.01)
    print("\n## One shard's PostgreSQL stops mid-sale (A, C on node 1; B on node 2)")
    print("| vouchers | before: 201/s, p99 | shard_c down: 201/s, p99, answers | share of before |")
    print("|---|---|---|---|")
    for g in "ABC":
        b, d = before[g], during[g]
        share = d["ok_rps"] / b["ok_rps"] if b["ok_rps"] else 0
        print(f"| {g} (shard {'abc'['ABC'.index(g)]}) | {b['ok_rps']:,.0f}, {b['p99']:.1f} ms | "
              f"{d['ok_rps']:,.0f}, {d['p99']:.1f} ms, {d['statuses']} | {100 * share:.0f} % |")
    print(f"\nC after the first 8 s, still down: {settled['rps']:,.0f}/s, p99 "
          f"{settled['p99']:.1f} ms, {settled['statuses']}")
    print(f"shard_c ready again -> C0's first 201: {back_ms:.0f} ms")
    print(f"a node started while shard_c was down: ready in {late_ready_ms:.0f} ms, A0 {late_a}, "
          f"C0 {late_c}; C0's first 201 on it after shard_c was back: "
          f"{'never' if late_back is None else f'{late_back:.0f} ms later'}")


def sold_rows(code, port):
    return int(psql(port, "SELECT count(*) FROM reservations WHERE voucher_code = "
                          f"'{code}' AND status IN ('RESERVED', 'CONFIRMED')", DB))


def scenario_kill(bases):
    total = 4000
    for i in range(3):
        create(bases[0], f"K{i}", total)
    placed = placement()
    ps = [wrk(b, "K", f"k{j}", 3, 10) for j, b in enumerate(bases)]
    time.sleep(2)
    procs[2].send_signal(signal.SIGKILL)
    results = [wrk_result(p) for p in ps]
    ok = sum(r["statuses"].get(201, 0) for r in results)
    # The dead node's leases are reaped within node.dead_after_ms; sell what they held.
    end = time.time() + 30
    while time.time() < end:
        left = sum(total - sold_rows(f"K{i}", CLUSTERS[placed[f'K{i}']][1]) for i in range(3))
        if left == 0:
            break
        extra = wrk_result(wrk(bases[0], "K", f"kx{int(time.time())}", 3, 2))
        ok += extra["statuses"].get(201, 0)
    print("\n## A node SIGKILLed mid-sale (3 vouchers x 4,000 units, one per shard)")
    rows_all = 0
    for i in range(3):
        code, port = f"K{i}", CLUSTERS[placed[f"K{i}"]][1]
        rows = sold_rows(code, port)
        every = int(psql(port, f"SELECT count(*) FROM reservations WHERE voucher_code = '{code}'",
                         DB))
        rows_all += every
        s, view = http("GET", bases[0], f"/admin/vouchers/{code}", token=TOKEN)
        print(f"{code} on shard {'abc'[placed[code]]}: sold {rows}/{total} "
              f"({100 * rows / total:.0f} %), oversold {max(0, every - total)}, "
              f"balanced {view.get('balanced')}")
    print(f"201s seen by the clients: {ok:,}; rows: {rows_all:,}; lost: {max(0, ok - rows_all)}")


def pg_cpu():
    """CPU seconds of every process of the shards' clusters."""
    return sum(pg_cpu_by_cluster().values())


def pg_cpu_by_cluster():
    """CPU seconds of the processes of each of the shards' clusters, by name."""
    used = {n: 0.0 for n, _ in CLUSTERS}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            name = next((n for n, _ in CLUSTERS if f"{VERSION}/{n}" in cmd), None)
            if "postgres" not in cmd or name is None:
                continue
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            used[name] += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return used


def scenario_cost():
    print("\n## PostgreSQL CPU per reservation as the shards go 1 -> 2 -> 3 "
          "(one voucher per shard, wrk -c64 on one node, 8 s)")
    print("| shards | 201/s | p99 ms | PostgreSQL CPU µs per reservation (by cluster) |")
    print("|---|---|---|---|")
    # 0: the same server as one ledger (ledger.url); -3: three shards, order ids per shard.
    for n in (0, 1, 2, 3, -3):
        per_shard = {"VOUCHERS__LEDGER__ORDER_IDS_ACROSS_SHARDS": "false"} if n < 0 else {}
        n = abs(n)
        fresh_databases()
        bases = start_nodes([url(p) for _, p in CLUSTERS[:max(n, 1)]], n=1, single=n == 0,
                            extra=per_shard)
        count = max(n, 1)
        # As wrk-reserve.lua names them: P alone, or P0 … P{count-1}.
        for code in (["P"] if count == 1 else [f"P{i}" for i in range(count)]):
            create(bases[0], code, 1_000_000_000)
        wrk_result(wrk(bases[0], "P", "warm", max(n, 1), 2, 64))
        c0 = pg_cpu_by_cluster()
        r = wrk_result(wrk(bases[0], "P", "cost", max(n, 1), 8, 64))
        c1 = pg_cpu_by_cluster()
        ok = r["statuses"].get(201, 0) or 1
        label = "1 (ledger.url)" if n == 0 else f"{n}{' (order ids per shard)' if per_shard else ''}"
        per = {k: 1e6 * (c1[k] - c0[k]) / ok for k in c0}
        split = ", ".join(f"{k[-1]} {v:.0f}" for k, v in per.items() if v >= 0.5)
        print(f"| {label} | {r['ok_rps']:,.0f} | {r['p99']:.1f} | {sum(per.values()):.0f} "
              f"({split}) |")
        stop_nodes()


def metric(base, name):
    """The sum of every series of `name` on a node's /metrics."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def scenario_model():
    """PostgreSQL CPU per reservation on one shard against the rows of its merged commits, at
    several loads (wrk connections): the cost model per shard, cost = row + commit / rows."""
    print("\n## Cost model of one shard: PostgreSQL CPU per reservation against rows per merged "
          "commit (one node, one voucher, wrk 6 s per load)")
    print("| wrk connections | 201/s | p99 ms | rows per commit | commits/s | "
          "PostgreSQL CPU µs per reservation | PostgreSQL cores busy |")
    print("|---|---|---|---|---|---|---|")
    fresh_databases()
    bases = start_nodes([url(CLUSTERS[0][1])], n=1)
    create(bases[0], "P", 1_000_000_000)
    wrk_result(wrk(bases[0], "P", "warm", 1, 2, 64))
    points = []
    for conns in (1, 2, 4, 8, 16, 32, 64, 128):
        rows0 = metric(bases[0], "vouchers_ledger_commit_rows_sum")
        n0 = metric(bases[0], "vouchers_ledger_commit_rows_count")
        c0, t0 = pg_cpu_by_cluster()[CLUSTERS[0][0]], time.monotonic()
        r = wrk_result(wrk(bases[0], "P", f"m{conns}", 1, 6, conns))
        c1, t1 = pg_cpu_by_cluster()[CLUSTERS[0][0]], time.monotonic()
        rows = metric(bases[0], "vouchers_ledger_commit_rows_sum") - rows0
        commits = metric(bases[0], "vouchers_ledger_commit_rows_count") - n0
        ok = r["statuses"].get(201, 0) or 1
        per = 1e6 * (c1 - c0) / ok
        per_commit = rows / commits if commits else 0
        points.append((per_commit, per))
        print(f"| {conns} | {r['ok_rps']:,.0f} | {r['p99']:.1f} | {per_commit:.1f} | "
              f"{commits / (t1 - t0):,.0f} | {per:.0f} | {(c1 - c0) / (t1 - t0):.2f} |")
    stop_nodes()
    # Least squares of cost = row + commit * (1 / rows per commit).
    xs = [1 / r for r, _ in points if r > 0]
    ys = [c for r, c in points if r > 0]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    print(f"\nfit: {a:.1f} µs per row + {b:.0f} µs per merged commit")
    for rows in (1, 4, 16, 64, 256):
        print(f"  at {rows} rows per commit: {a + b / rows:.1f} µs per reservation, "
              f"{1e6 / (a + b / rows):,.0f} reservations/s per PostgreSQL core")


def run(which):
    for tool in ("wrk", "psql", "pg_isready"):
        if not shutil.which(tool):
            sys.exit(f"shards: install {tool}")
    if not os.environ.get("VOUCHERS_BIN"):
        sh("cargo", "build", "--release", "--bin", "vouchers", quiet=False)
    try:
        if "down" in which or "kill" in which:
            fresh_databases()
            bases = start_nodes([url(p) for _, p in CLUSTERS])
            if "down" in which:
                scenario_down(bases)
            if "kill" in which:
                scenario_kill(bases)
            stop_nodes()
        if "contract" in which:
            fresh_databases()
            env = dict(os.environ, BIN=os.environ.get("VOUCHERS_BIN")
                       or os.path.join(ROOT, "target/release/vouchers"))
            subprocess.run([os.path.join(ROOT, "scripts/contract.py"), "--start", "3", "--fresh",
                            "--shards",
                            " ".join(url(p) for _, p in CLUSTERS)], env=env, check=True)
        if "cost" in which:
            scenario_cost()
        if "model" in which:
            scenario_model()
    finally:
        stop_nodes()


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "up":
        up()
    elif cmd == "down":
        down()
    elif cmd == "run":
        run(sys.argv[2:] or ["down", "kill", "contract", "cost"])
    else:
        sys.exit(__doc__)

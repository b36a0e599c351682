#!/usr/bin/env python3
"""PostgreSQL CPU of a lease grant and of a confirm, one call at a time, for engine builds side by
side.

    scripts/call-cost.py [--engine-bin PATH ...] [--calls N] [--repeat K]

`scripts/commit-cost.py` measures the merged commit; this script measures the ledger's two other
calls a sale makes per unit: a grant (`vouchers_grant_v3`, two per call, as the node merges its
actors' grants: `SELECT … FROM unnest(…) LEFT JOIN LATERAL vouchers_grant_v3(…)`), and a confirm
(`vouchers_settle`, one reservation of 200,000 stored). Each build given with --engine-bin (the
default: this tree's release build) migrates a scratch database of its own (one start of the
engine against it, waiting for its steps after the migration), which gets 100 vouchers and the
reservations, analyzed. The calls run through `pgbench -c1 -M prepared` with the session the
node opens (`plan_cache_mode = force_custom_plan`, src/ledger/postgres/open.rs), the builds
interleaved --repeat times, and the script prints the CPU of every postgres process per call
(as bench.sh counts it; the postmaster's exited children included). Figures move 10-30 %
between runs on a shared 2-core machine: compare builds within one run.
Traffic stays on 127.0.0.1; the databases are dropped at the end.
"""
import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import bench

SETUP = """
INSERT INTO vouchers (code, discount_amount, min_order_amount, total_limit, per_user_limit,
                      starts_at, ends_at, status, free, created_at)
SELECT 'HX' || i, 100, 0, 1000000000, 1, 0, 9000000000000, 'ACTIVE', 900000000, 0
FROM generate_series(0, 99) i;
INSERT INTO nodes (holder, name, incarnation, started_at, beat_at, streak_from, dead_after)
VALUES ('cost#1', 'cost', 1, 0, 1, 0, 100000000);
INSERT INTO reservations (order_id, voucher_code, customer_id, lease_id, discount_amount, status,
                          created_at, expires_at, updated_at, fed)
SELECT 'o' || i, 'HX1', i, 0, 100, 'RESERVED', 0, 9000000000000, 0, true
FROM generate_series(1, 200000) i;
CREATE SEQUENCE cost_order;
ANALYZE;
"""

GRANT = """\\set a random(0, 99)
\\set b random(0, 99)
SELECT a.i, g.out_units FROM (SELECT * FROM unnest(ARRAY['HX' || :a, 'HX' || :b],
  '{cost#1,cost#1}'::text[], '{5,5}'::bigint[], '{1,1}'::bigint[],
  '{9000000000000,9000000000000}'::bigint[]) WITH ORDINALITY AS u(code, node, want, now, expires, i)
  ORDER BY u.code) AS a
LEFT JOIN LATERAL vouchers_grant_v3(a.code, a.node, a.want, a.now, a.expires) g ON true ORDER BY a.i;
"""

CONFIRM = "SELECT * FROM vouchers_settle('HX1', 'o' || nextval('cost_order'), 1, true);\n"


def psql(url, sql):
    out = subprocess.run(["psql", "-Atq", "-v", "ON_ERROR_STOP=1", url, "-c", sql],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"call-cost: psql failed: {out.stderr.strip()}")
    return out.stdout.strip()


def prepare(procs, binary, work):
    db = f"vouchers_calls_{random.randrange(1 << 30)}"
    psql(bench.PG_ADMIN, f"CREATE DATABASE {db}")
    url = bench.PG_ADMIN.rsplit("/", 1)[0] + "/" + db
    p, _ = bench.start_node(procs, "calls", url, argparse.Namespace(engine_bin=binary),
                            cluster=True)
    # A build whose steps after the migration replace an index: let them finish first.
    deadline = time.time() + 60
    while time.time() < deadline and psql(
            url, "SELECT count(*) FROM pg_indexes WHERE indexname = 'leases_by_voucher' AND "
                 "EXISTS (SELECT 1 FROM schema_migrations WHERE version >= 16)") != "0":
        time.sleep(0.2)
    procs.stop(p)
    psql(url, SETUP)
    return db, url


def run(url, script, calls, per_call, work):
    path = os.path.join(work, "call.pgb")
    with open(path, "w") as f:
        f.write(script)
    env = dict(os.environ, PGOPTIONS="-c plan_cache_mode=force_custom_plan")
    before = sum(bench.cpu_seconds(bench.postgres_pids(), children=True).values())
    out = subprocess.run(["pgbench", "-n", "-c1", f"-t{calls}", "-M", "prepared", "-f", path, url],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"call-cost: pgbench failed: {out.stderr.strip()[-2000:]}")
    after = sum(bench.cpu_seconds(bench.postgres_pids(), children=True).values())
    return 1e6 * (after - before) / (calls * per_call)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine-bin", action="append", default=[])
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for tool in ("psql", "pgbench"):
        if not shutil.which(tool):
            sys.exit(f"call-cost: install {tool}")
    binaries = args.engine_bin or [os.path.join(bench.BIN, "vouchers")]
    work = tempfile.mkdtemp(prefix="vouchers-calls-")
    procs = bench.Procs(work)
    dbs = []
    try:
        urls = []
        for b in binaries:
            db, url = prepare(procs, b, work)
            dbs.append(db)
            urls.append(url)
        for _ in range(args.repeat):
            for b, url in zip(binaries, urls):
                g = run(url, GRANT, args.calls, 2, work)
                c = run(url, CONFIRM, args.calls, 1, work)
                print(f"{b}: {g:,.0f} µs per grant, {c:,.0f} µs per confirm", flush=True)
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
        for db in dbs:
            subprocess.run(["psql", "-q", bench.PG_ADMIN, "-c",
                            f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"], capture_output=True)


if __name__ == "__main__":
    main()

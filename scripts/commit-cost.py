#!/usr/bin/env python3
"""PostgreSQL CPU of the merged commit alone, per call, per batch and per row.

    scripts/commit-cost.py [--calls N] [--shapes 1x1,1x120,28x1] [--function NAME] [--load FILE]
                           [--repeat K] [--empty] [--keep]

`scripts/bench.sh` measures PostgreSQL CPU per reservation through the whole engine, where the
shape of each merged commit (batches and rows per call) follows the load. This script holds the
shape fixed: it calls `vouchers_commit_batches_v2` through `pgbench -c1 -M prepared`, each call
its own transaction, with SHAPE = BATCHESxROWS: BATCHES vouchers of one lease each, ROWS new
customers per batch (rising ids, every row a new reservation). --function names another
function of the same signature: `hx_noop` for the harness's own cost, or a copy of the merged
commit under another name for an A/B, loaded from the SQL file --load. It reports the CPU of
every postgres process over the run (the backend, the WAL writer, the checkpointer; as bench.sh
counts it) per call and per row, and from the shapes 1x1, 1xR and Bx1 a cost model: a cost for
one batch of one row, per further row of one batch, per further batch of one row.

The scratch database is made by the release build's migrations (one start of the engine against
it), then gets this tree's `migrations/postgres/0002_merged_commit.sql` again (the function as
the tree has it). It holds 100 vouchers and 200,000 reservations of other vouchers (so indexes
are not empty), and is analyzed; autovacuum is off on the written tables so that it does not
land inside a run. Each run starts from the same table. --empty leaves the reservations empty
and analyzed instead: the state in which a plan made then sees an empty table (see
migrations/postgres/0002). Figures move 5-30 % between runs on a shared 2-core machine, and
more after a restart of PostgreSQL: interleave an A/B with --repeat.
Traffic stays on 127.0.0.1; the database is dropped at the end unless --keep.
"""
import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile

import bench

HARNESS = """
-- The index migration 15 replaced, which a node drops after its start (perhaps not before it
-- stopped): an extra index on every insert, and a third choice for the usage probes.
DROP INDEX IF EXISTS reservations_by_voucher;
-- Before the inserts: a lease's deferred check would be pending in the same transaction.
ALTER TABLE reservations SET (autovacuum_enabled = false);
ALTER TABLE leases SET (autovacuum_enabled = false);
ALTER TABLE feed_batches SET (autovacuum_enabled = false);
ALTER TABLE feed_head SET (autovacuum_enabled = false);
INSERT INTO vouchers (code, discount_amount, min_order_amount, total_limit, per_user_limit,
                      starts_at, ends_at, status, free, created_at)
SELECT 'HX' || i, 100, 0, 1000000000, 1, 0, 9000000000000, 'ACTIVE', 900000000, 0
FROM generate_series(0, 99) i;
INSERT INTO leases (voucher_code, node_id, granted, state, granted_at, expires_at)
SELECT 'HX' || i, 'harness', 100000000, 'ACTIVE', 0, 9000000000000 FROM generate_series(0, 99) i;
CREATE SEQUENCE hx_seq;
-- One merged call of p_batches vouchers (taken in turn) x p_rows new customers each.
CREATE FUNCTION hx_call(p_batches INT, p_rows INT, p_fn TEXT) RETURNS INT LANGUAGE plpgsql AS $$
DECLARE
  base BIGINT := nextval('hx_seq') * 10000;
  off INT := ((base / 10000) * p_batches % 100)::int;
  a_lease BIGINT[]; a_code TEXT[]; a_now BIGINT[]; a_exp BIGINT[];
  a_batch INT[]; a_order TEXT[]; a_cust BIGINT[]; n_ins INT;
BEGIN
  SELECT array_agg(l.id ORDER BY g.b), array_agg(l.voucher_code ORDER BY g.b)
  INTO a_lease, a_code
  FROM generate_series(1, p_batches) g (b)
  JOIN leases l ON l.voucher_code = 'HX' || ((off + g.b) % 100) AND l.node_id = 'harness';
  a_now := array_fill(1000::bigint, ARRAY[p_batches]);
  a_exp := array_fill(901000::bigint, ARRAY[p_batches]);
  SELECT array_agg(b ORDER BY b, r), array_agg('hx-' || (base + (b - 1) * p_rows + r) ORDER BY b, r),
         array_agg(base + (b - 1) * p_rows + r ORDER BY b, r)
  INTO a_batch, a_order, a_cust
  FROM generate_series(1, p_batches) b, generate_series(1, p_rows) r;
  EXECUTE format('SELECT count(*) FILTER (WHERE out_verdict = ''INSERT'') FROM %s($1, $2, $3, $4, $5, $6, $7)', p_fn)
    INTO n_ins USING a_lease, a_code, a_now, a_exp, a_batch, a_order, a_cust;
  IF n_ins <> p_batches * p_rows THEN
    RAISE EXCEPTION 'inserted % of %', n_ins, p_batches * p_rows;
  END IF;
  RETURN n_ins;
END $$;
-- The harness's own cost (--function hx_noop): the call's arrays, pgbench's round trip and an
-- empty commit, nothing stored.
CREATE FUNCTION hx_noop(p_lease BIGINT[], p_code TEXT[], p_now BIGINT[], p_expires BIGINT[],
                        p_batch INT[], p_order TEXT[], p_customer BIGINT[])
RETURNS TABLE (out_idx INT, out_verdict TEXT) LANGUAGE sql AS $$
  SELECT i::int, 'INSERT'::text FROM generate_series(1, cardinality(p_order)) i $$;
"""

FILL = ("INSERT INTO reservations (order_id, voucher_code, customer_id, lease_id, discount_amount, "
        "status, created_at, expires_at, updated_at, fed) SELECT 'fill-' || i, 'FILL' || (i % 50), "
        "i, 0, 100, 'RESERVED', 0, 900000 + i, 0, true FROM generate_series(1, 200000) i")


def psql(url, *sql):
    argv = ["psql", "-Atq", "-v", "ON_ERROR_STOP=1", url]
    for s in sql:
        argv += ["-c", s]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"commit-cost: psql failed: {out.stderr.strip()}")


def postgres_cpu():
    """User + system CPU of every postgres process so far, the postmaster's exited children
    (the pgbench backend once it is gone) included."""
    return sum(bench.cpu_seconds(bench.postgres_pids(), children=True).values())


def reset(url, empty):
    psql(url, "TRUNCATE reservations", *([] if empty else [FILL]),
         "UPDATE leases SET consumed = 0 WHERE node_id = 'harness'",
         "VACUUM ANALYZE leases", "VACUUM ANALYZE reservations", "CHECKPOINT")


def run(url, fn, batches, rows, calls, empty, work):
    reset(url, empty)
    script = os.path.join(work, "call.pgb")
    with open(script, "w") as f:
        f.write(f"SELECT hx_call({batches}, {rows}, '{fn}');\n")
    before = postgres_cpu()
    out = subprocess.run(["pgbench", "-n", "-c1", f"-t{calls}", "-M", "prepared", "-f", script,
                          url], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"commit-cost: pgbench failed: {out.stderr.strip()[-2000:]}")
    return 1e6 * (postgres_cpu() - before) / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--shapes", default="1x1,1x120,28x1")
    ap.add_argument("--function", default="vouchers_commit_batches_v2")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--load", help="an SQL file to run in the scratch database first")
    ap.add_argument("--empty", action="store_true")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    for tool in ("psql", "pgbench"):
        if not subprocess.run(["which", tool], capture_output=True).stdout:
            sys.exit(f"commit-cost: install {tool}")
    db = f"vouchers_cost_{random.randrange(1 << 30)}"
    bench.psql(bench.PG_ADMIN, f"CREATE DATABASE {db}")
    url = bench.PG_ADMIN.rsplit("/", 1)[0] + "/" + db
    work = tempfile.mkdtemp(prefix="vouchers-cost-")
    procs = bench.Procs(work)
    try:
        # The release build's migrations make the schema.
        opts = argparse.Namespace(engine_bin=os.path.join(bench.BIN, "vouchers"))
        p, _ = bench.start_node(procs, "cost", url, opts, cluster=True)
        procs.stop(p)
        # The function as this tree has it, whatever the release build compiled in.
        merged = os.path.join(bench.ROOT, "migrations", "postgres", "0002_merged_commit.sql")
        with open(merged) as f:
            psql(url, f.read())
        psql(url, HARNESS)
        if args.load:
            with open(args.load) as f:
                psql(url, f.read())
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        seen = {s: [] for s in shapes}
        for _ in range(args.repeat):
            for b, r in shapes:
                us = run(url, args.function, b, r, args.calls, args.empty, work)
                seen[(b, r)].append(us)
                print(f"{args.function} {b}x{r}: {us:,.0f} µs per call, "
                      f"{us / (b * r):.1f} µs per row", flush=True)
        mean = {s: sum(v) / len(v) for s, v in seen.items()}
        one = mean.get((1, 1))
        if one is not None:
            for (b, r), us in sorted(mean.items()):
                if b == 1 and r > 1:
                    print(f"per further row of one batch: {(us - one) / (r - 1):.1f} µs")
                if r == 1 and b > 1:
                    print(f"per further batch of one row: {(us - one) / (b - 1):.1f} µs")
            print(f"one batch of one row (1x1): {one:,.0f} µs, the harness's own arrays and "
                  "pgbench's round trip included")
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep:
            out = subprocess.run(["psql", "-q", bench.PG_ADMIN, "-c",
                                  f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                print(f"commit-cost: could not drop {db}: {out.stderr.strip()}", file=sys.stderr)
        else:
            print(f"kept: {url}")


if __name__ == "__main__":
    main()

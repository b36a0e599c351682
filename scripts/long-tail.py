#!/usr/bin/env python3
"""The long tail: what a node costs with many vouchers on sale that nobody touches, and what the
first reserves on many cold vouchers cost. One node, release build, 127.0.0.1 only.

  scripts/long-tail.py [--vouchers N] [--touch M] [--floods F] [--ledger sqlite|postgres]
                       [--engine-bin PATH] [--memory] [--skip-customers] [--skip-create]
                       [--create-over-api] [--settle-min K]

Steps (each printed as it is measured):
  1. N vouchers on sale (inserted straight into the ledger's table: the catalogue is the subject,
     not how it was filled; or, with --create-over-api, created through the admin API by 16
     connections, as the issue's operator does), node started on them: its CPU over 10 s of no
     traffic, RSS, /metrics (series, bytes, time to render). Inserted, the RSS the flood is
     compared with is the node's after 2 s of GET /health/live over 256 connections (the HTTP
     server's own growth for the flood's connections left out); created over the API, it is
     the node's once it served the creates, with nothing else: the two ratios differ by that.
  2. First reserves for M/10,000 s (wrk -t1 -c256, every request a voucher no request touched
     before; the codes never wrap, so a rate of 10,000/s touches M of them): first reserves
     per second and p99; then the node's CPU 10 s after, and,
     once every actor idled out (vouchers_active_actors = 0), CPU and RSS again. Repeated F
     times on codes no earlier flood touched.
  3. Vouchers created over the admin API by 16 connections for 10 s: creates per second.
  4. A never-sells-out voucher with a new customer on every request, 6 windows of 10 s: req/s,
     p99 and RSS per window (SQLite only).
"""
import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (its helpers: Procs, start_node, scrape, metric, rss_mb, cpu)

NOW_MS = int(time.time() * 1000)
START, END = NOW_MS - 3_600_000, NOW_MS + 30 * 24 * 3_600_000


def insert_sqlite(path, prefix, n):
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    rows = ((f"{prefix}{i}", 100, 0, 10, 1, START, END, "ACTIVE", 10, NOW_MS) for i in range(n))
    db.executemany(
        "INSERT INTO vouchers (code, discount_amount, min_order_amount, total_limit, "
        "per_user_limit, starts_at, ends_at, status, free, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.commit()
    db.close()


def insert_postgres(url, prefix, n):
    bench.psql(url, f"""INSERT INTO vouchers (code, discount_amount, min_order_amount, total_limit,
        per_user_limit, starts_at, ends_at, status, free, created_at)
        SELECT '{prefix}' || i, 100, 0, 10, 1, {START}, {END}, 'ACTIVE', 10, {NOW_MS}
        FROM generate_series(0, {n - 1}) AS i""")


def idle_cpu(pid, seconds=10):
    before = bench.cpu_seconds([pid])
    time.sleep(seconds)
    return 100.0 * bench.cpu_between(before, bench.cpu_seconds([pid])) / seconds


def metrics_page(base):
    started = time.perf_counter()
    status, text = bench.http("GET", f"{base}/metrics")
    took = (time.perf_counter() - started) * 1000
    series = [l for l in text.splitlines() if l and not l.startswith("#")]
    return len(series), len(text.encode()), took


def untouched(pid, base):
    """Prints the untouched node's CPU over 10 s of no traffic, RSS and /metrics; returns the
    RSS (MB)."""
    time.sleep(5)
    cpu = idle_cpu(pid)
    series, size, took = metrics_page(base)
    rss = bench.rss_mb(pid)
    print(f"untouched: CPU {cpu:.1f} % of a core, RSS {rss:.1f} MB, /metrics {series:,} series, "
          f"{size / 1e6:.2f} MB, {took:.0f} ms{heap(base)}")
    return rss


def print_memory(pid):
    """The node's RSS by kind (smaps_rollup) and its largest mappings."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        kinds = {l.split(":")[0]: l.split()[1] for l in f if l.split(":")[0] in
                 ("Rss", "Anonymous", "Shared_Clean", "Private_Clean", "Private_Dirty")}
    print("  memory (kB): " + ", ".join(f"{k} {v}" for k, v in kinds.items()))
    rss, name = {}, ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                name = head[5] if len(head) > 5 else "[anon]"
            elif head[0] == "Rss:":
                rss[name] = rss.get(name, 0) + int(head[1])
    for name, kb in sorted(rss.items(), key=lambda x: -x[1])[:6]:
        print(f"  {kb / 1024:8.1f} MB  {name}")


HEAP_GAUGES = {}


def heap(base):
    """What a `--features heap-count` build reports of its heap, else nothing (a node that does
    not export the gauges is asked once)."""
    if HEAP_GAUGES.get(base) is False:
        return ""
    text = bench.scrape(base)
    HEAP_GAUGES[base] = any(k.startswith("vouchers_heap_bytes") for k in text)
    live = bench.metric(text, 'vouchers_heap_bytes{kind="live"}')
    committed = bench.metric(text, 'vouchers_heap_bytes{kind="committed"}')
    glibc = bench.metric(text, 'vouchers_heap_bytes{kind="glibc"}')
    if not committed:
        return ""
    return (f", heap live {live / 1e6:.1f} MB, mimalloc committed {committed / 1e6:.1f} MB, "
            f"glibc live {glibc / 1e6:.1f} MB")


def wrk_lua(script, base, args, threads=1, conns=256, duration=10):
    argv = ["wrk", f"-t{threads}", f"-c{conns}", f"-d{duration}s", "-s",
            os.path.join(bench.ROOT, "load-tests", script), base, "--"] + args
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return bench.parse_wrk(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vouchers", type=int, default=100_000)
    ap.add_argument("--touch", type=int, default=10_000)
    ap.add_argument("--ledger", default="sqlite", choices=["sqlite", "postgres"])
    ap.add_argument("--engine-bin", default=os.path.join(bench.BIN, "vouchers"))
    ap.add_argument("--idle-out-s", type=int, default=400,
                    help="how long to wait for every actor to idle out")
    ap.add_argument("--floods", type=int, default=1,
                    help="floods of first reserves, each on codes no earlier one touched, each "
                         "followed by the idle-out: RSS after the second shows whether the first "
                         "left a high-water mark or a leak")
    ap.add_argument("--memory", action="store_true",
                    help="after the idle-out, print where the node's RSS is (smaps)")
    ap.add_argument("--settle-min", type=int, default=0,
                    help="after the idle-out, RSS and CPU once a minute for this many minutes: "
                         "where the node settles once the flood's backlog is recounted; with "
                         "--touch 0, the untouched node watched as long (the control)")
    ap.add_argument("--skip-customers", action="store_true")
    ap.add_argument("--skip-create", action="store_true")
    ap.add_argument("--create-over-api", action="store_true",
                    help="fill the catalogue through POST /admin/vouchers (wrk -t1 -c16) on the "
                         "node that is then measured, instead of inserting it behind its back: "
                         "the RSS before the flood is then that of a node that served those "
                         "requests, with no other warm-up")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="long-tail-")
    procs = bench.Procs(work)
    db = None
    try:
        if args.ledger == "sqlite":
            url = f"sqlite://{work}/ledger.db"
        else:
            db = f"longtail_{os.getpid()}"
            bench.psql(bench.PG_ADMIN, f"CREATE DATABASE {db}")
            url = bench.PG_ADMIN.rsplit("/", 1)[0] + "/" + db
        prefix, first = "TAIL", 0  # the catalogue's codes: prefix + (first .. first + N - 1)
        if args.create_over_api:
            p, base = bench.start_node(procs, "tail", url, args)
            print(f"fresh node, empty catalogue: RSS {bench.rss_mb(p.pid):.1f} MB{heap(base)}")
            fresh = None  # the node before the flood is `before`: it has served the creates
            # One wrk thread, so the codes are TAIL1X1 .. TAIL1X<n> in order; it stops once n
            # are answered, and wrk waits out its duration (time enough for 10,000 a second).
            r = wrk_lua("wrk-create.lua", base, [bench.TOKEN, "TAIL", str(args.vouchers)],
                        conns=16, duration=10 + args.vouchers // 10_000)
            created = r["statuses"].get(201, 0)
            # Every answer counted unless wrk's duration ran out first (too slow a ledger, or a
            # create lost to a socket error, which wrk does not retry: it happened once in a
            # run, and that code answers 404 in the flood's statuses): then up to the 16
            # creates in flight may be missing from the count.
            if set(r["statuses"]) != {201} or created < args.vouchers - 16:
                sys.exit(f"creates over the API answered {r['statuses']}")
            # wrk's rate and latency count the pings after the last create too (a few of the
            # whole): the latency only, as an indication; step 3 measures the create rate.
            print(f"  creates: p99 {r['p99']:.1f} ms")
            print(f"{created:,} vouchers on sale, created over the API (16 connections)")
            args.vouchers, prefix, first = created, "TAIL1X", 1
            before = untouched(p.pid, base)
        else:
            # Start once for the schema, then fill the catalogue behind the node's back.
            p, base = bench.start_node(procs, "schema", url, args)
            procs.stop(p)
            started = time.time()
            if args.ledger == "sqlite":
                insert_sqlite(f"{work}/ledger.db", "TAIL", args.vouchers)
            else:
                insert_postgres(url, "TAIL", args.vouchers)
            print(f"{args.vouchers:,} vouchers on sale ({args.ledger}), inserted in "
                  f"{time.time() - started:.1f} s")
            p, base = bench.start_node(procs, "tail", url, args)
            fresh = untouched(p.pid, base)
            # A node that has served any traffic keeps actix-web's request pools (128 requests per
            # HTTP worker, each holding its connection's 8 KiB read buffer): the issue's own setup
            # creates the catalogue over the API first. The same burst of 256 connections as the
            # flood, on a route that touches no voucher, so that the RSS compared after the
            # idle-out is the long tail's, not the HTTP server's first burst.
            subprocess.run(["wrk", "-t1", "-c256", "-d2s", f"{base}/health/live"],
                           capture_output=True, check=True)
            time.sleep(3)
            before = bench.rss_mb(p.pid)
            print(f"untouched, after 2 s of GET /health/live over 256 connections: "
                  f"RSS {before:.1f} MB{heap(base)}")

        if not args.touch:
            # The control: the untouched node watched as long as a flood's settling is, for
            # what it gains with time alone (the ledger's page caches filling, say).
            for minute in range(args.settle_min):
                cpu = idle_cpu(p.pid, 60)
                rss = bench.rss_mb(p.pid)
                print(f"  untouched +{minute + 1} min: CPU {cpu:.1f} % of a core, "
                      f"RSS {rss:.1f} MB ({rss / before:.2f}x){heap(base)}")
        touched = 0
        for flood in range(args.floods if args.touch else 0):
            # Codes never wrap (the rest of the catalogue is in range), so every request is a
            # first reserve and wrk's rate is the cold rate; the flood lasts as long as
            # `--touch` first reserves take at the target's 10,000/s. A later flood takes the
            # codes after the earlier ones'.
            flood_s = max(1, args.touch // 10_000)
            # Room for three times the target rate: a flood that ran out of untouched codes
            # would wrap onto warm vouchers and count them as first reserves.
            if args.vouchers - touched < 3 * args.touch:
                sys.exit(f"flood {flood + 1}: {args.vouchers - touched:,} untouched codes left, "
                         f"fewer than three times --touch: use a larger --vouchers")
            r = wrk_lua("wrk-cold.lua", base,
                        [prefix, str(args.vouchers - touched), str(first + touched)], duration=flood_s)
            answered = sum(r["statuses"].values())
            # A request still in flight when wrk stopped may have reached the node: the next
            # flood starts 256 codes (one per connection) further on, so none of its is warm.
            touched += answered + 256
            created = r["statuses"].get(201, 0)
            print(f"flood {flood + 1}: first reserves on cold vouchers for {flood_s} s: "
                  f"{r['rps']:,.0f}/s answered, {created / flood_s:,.0f}/s created (201), "
                  f"p99 {r['p99']:.1f} ms, statuses {r['statuses']} "
                  f"({answered:,} vouchers touched, {args.touch:,} asked)")
            time.sleep(10)
            print(f"10 s later: CPU {idle_cpu(p.pid):.1f} % of a core, "
                  f"RSS {bench.rss_mb(p.pid):.0f} MB, actors "
                  f"{bench.metric(bench.scrape(base), 'vouchers_active_actors'):.0f}")
            deadline = time.time() + args.idle_out_s
            while time.time() < deadline:
                if bench.metric(bench.scrape(base), "vouchers_active_actors") == 0:
                    break
                time.sleep(5)
            actors = bench.metric(bench.scrape(base), "vouchers_active_actors")
            series, size, took = metrics_page(base)
            rss = bench.rss_mb(p.pid)
            print(f"idled out (actors {actors:.0f}): CPU {idle_cpu(p.pid):.1f} % of a core, "
                  f"RSS {rss:.1f} MB ({rss / before:.2f}x"
                  f"{f'; {rss / fresh:.2f}x the fresh node' if fresh else ''}), "
                  f"/metrics {series:,} series, {size / 1e6:.2f} MB, {took:.0f} ms{heap(base)}")
            if args.memory:
                print_memory(p.pid)
            for minute in range(args.settle_min):
                cpu = idle_cpu(p.pid, 60)
                rss = bench.rss_mb(p.pid)
                print(f"  +{minute + 1} min: CPU {cpu:.1f} % of a core, "
                      f"RSS {rss:.1f} MB ({rss / before:.2f}x){heap(base)}")
            if args.settle_min and args.memory:
                print_memory(p.pid)

        if not args.skip_create:
            r = wrk_lua("wrk-create.lua", base, [bench.TOKEN, "NEW"], threads=2, conns=16)
            print(f"creates over 16 connections: {r['rps']:,.0f}/s, p99 {r['p99']:.1f} ms, "
                  f"statuses {r['statuses']}")

        if not args.skip_customers and args.ledger == "sqlite":
            bench.create(base, "SITEWIDE", 10 ** 9)
            for w in range(6):
                r = wrk_lua("wrk-reserve.lua", base, ["SITEWIDE", f"w{w}", "1", "random"],
                            threads=2, duration=10)
                print(f"new customer per request, window {w + 1}: {r['rps']:,.0f}/s, "
                      f"p99 {r['p99']:.1f} ms, RSS {bench.rss_mb(p.pid):.0f} MB")
        procs.stop(p)
    finally:
        procs.stop_all()
        if db:
            bench.psql(bench.PG_ADMIN, f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The failover rehearsal's clients and checks (run by scripts/ledger-failover.sh).

Per round: a voucher of TOTAL units, a flood of distinct customers over the nodes (keep-alive
HTTP/1.1 on loopback), one in ten confirming and one in ten releasing what it won; when a third
of the units are sold the primary's postmaster is SIGKILLed (scripts/ledger-pair.sh kill), and
the standby is promoted DELAY seconds later. With --pressure, wrk floods a second voucher on every
node at the same time (its books are checked to balance, not against answers wrk keeps no record of). Clients retry a 503 or a lost answer with the same
order id, as a checkout service would. Then the books are read straight from the promoted
primary and held against what the clients were told.
"""
import argparse
import asyncio
import json
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--nodes", required=True, help="comma-separated base URLs")
p.add_argument("--token", required=True)
p.add_argument("--pair", required=True, help="path of scripts/ledger-pair.sh")
p.add_argument("--db", required=True, help="database name on the pair")
p.add_argument("--total", type=int, default=10000)
p.add_argument("--workers", type=int, default=96)
p.add_argument("--delay", type=float, default=3.0, help="seconds from the kill to the promotion")
p.add_argument("--round", type=int, default=1)
p.add_argument("--deadline-ms", type=float, default=5000, help="ledger.timeout_ms: no answer may take longer")
p.add_argument("--pressure", type=int, default=0,
               help="wrk connections per node flooding a second, never-sold-out voucher meanwhile (0: none)")
args = p.parse_args()
nodes = [n.rstrip("/") for n in args.nodes.split(",")]
CLIENT_TIMEOUT = args.deadline_ms / 1000 + 5


def pair(cmd):
    return subprocess.run([args.pair, cmd], check=True, capture_output=True, text=True).stdout.strip()


def psql(port, sql):
    out = subprocess.run(["psql", "-X", "-Atq", "-h", "127.0.0.1", "-p", port, "-U", "postgres",
                          "-d", args.db, "-F", "\t", "-c", sql], check=True, capture_output=True, text=True)
    return [line.split("\t") for line in out.stdout.splitlines() if line]


class Conn:
    """One keep-alive HTTP/1.1 connection to one node."""

    def __init__(self, base):
        host, port = base.split("://")[1].split(":")
        self.host, self.port, self.r, self.w = host, int(port), None, None

    async def request(self, method, path, body=None, token=None):
        if self.w is None:
            self.r, self.w = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode() if body is not None else b""
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {len(data)}\r\n"
        if body is not None:
            head += "Content-Type: application/json\r\n"
        if token:
            head += f"Authorization: Bearer {token}\r\n"
        self.w.write(head.encode() + b"\r\n" + data)
        try:
            await self.w.drain()
            status_line = await self.r.readline()
            if not status_line:
                raise ConnectionError("closed")
            status = int(status_line.split()[1])
            headers = {}
            while True:
                line = await self.r.readline()
                if line in (b"\r\n", b""):
                    break
                k, v = line.decode().split(":", 1)
                headers[k.strip().lower()] = v.strip()
            n = int(headers.get("content-length", "0"))
            payload = await self.r.readexactly(n) if n else b""
            return status, headers, payload
        except Exception:
            self.close()
            raise

    def close(self):
        if self.w is not None:
            self.w.close()
        self.r = self.w = None


class Round:
    def __init__(self, code):
        self.code = code
        self.created = {}        # order -> (node, time)
        self.confirmed, self.released, self.unknown = set(), set(), set()
        self.statuses = {}
        self.next_customer = 0
        self.t_kill = self.t_promote = None
        self.outage = []         # (status, seconds, has Retry-After) of reserves answered during the outage
        self.hung = 0
        self.back = {}           # node -> seconds from the promotion to its first 201
        self.sold_out = False
        self.unexpected = []

    def customer(self):
        self.next_customer += 1
        return self.next_customer


async def call(conn, method, path, body=None, token=None):
    t0 = time.monotonic()
    try:
        status, headers, payload = await asyncio.wait_for(conn.request(method, path, body, token), CLIENT_TIMEOUT)
    except asyncio.TimeoutError:
        conn.close()
        return None, {}, None, time.monotonic() - t0, True
    except Exception:
        return None, {}, None, time.monotonic() - t0, False
    try:
        parsed = json.loads(payload) if payload else None
    except ValueError:
        parsed = None
    return status, headers, parsed, time.monotonic() - t0, False


async def settle(conn, rnd, method, path, order, into):
    while True:
        status, _, body, _, hung = await call(conn, method, path)
        if status == 200:
            into.add(order)
            return
        if status == 503 or status is None:
            rnd.unknown.add(order)
            rnd.hung += hung
            await asyncio.sleep(0.05)
            continue
        rnd.unexpected.append(f"{method} {order}: {status} {body}")
        return


async def worker(w, rnd):
    node = w % len(nodes)
    conn = Conn(nodes[node])
    while not rnd.sold_out:
        c = rnd.customer()
        order = f"{rnd.code}-o{c}"
        path = f"/vouchers/{rnd.code}/reservations"
        body = {"customerId": c, "orderId": order, "orderAmount": 10000}
        while True:
            start = time.monotonic()
            status, headers, answer, took, hung = await call(conn, "POST", path, body)
            rnd.statuses[status] = rnd.statuses.get(status, 0) + 1
            rnd.hung += hung
            if rnd.t_kill is not None and rnd.t_promote is None and start >= rnd.t_kill:
                rnd.outage.append((status, took, "retry-after" in headers))
            if status == 201:
                now = time.monotonic()
                rnd.created[order] = (node, now)
                if rnd.t_promote is not None and node not in rnd.back:
                    rnd.back[node] = now - rnd.t_promote
                break
            if status == 503 or status is None:
                rnd.unknown.add(order)
                await asyncio.sleep(0.05)
                continue
            if status == 409 and answer and answer.get("error") == "OUT_OF_STOCK":
                if rnd.t_promote is not None:
                    rnd.sold_out = True
                break
            rnd.unexpected.append(f"reserve {order}: {status} {answer}")
            break
        if status != 201:
            continue
        if c % 10 == 1:
            await settle(conn, rnd, "POST", f"/vouchers/{rnd.code}/reservations/{order}/confirm", order, rnd.confirmed)
        elif c % 10 == 2:
            await settle(conn, rnd, "DELETE", f"/vouchers/{rnd.code}/reservations/{order}", order, rnd.released)
    conn.close()


async def failover(rnd):
    while len(rnd.created) < args.total // 3:
        await asyncio.sleep(0.01)
    rnd.old = await asyncio.to_thread(pair, "kill")
    rnd.t_kill = time.monotonic()
    await asyncio.sleep(args.delay)
    rnd.new = await asyncio.to_thread(pair, "promote")
    rnd.t_promote = time.monotonic()
    rnd.wall_promote = time.strftime("%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}"


async def admin(method, path, body=None):
    conn = Conn(nodes[0])
    status, _, answer, _, _ = await call(conn, method, path, body, args.token)
    conn.close()
    return status, answer


async def main():
    code = f"FAILOVER{args.round}"
    rnd = Round(code)
    status, answer = await admin("POST", "/admin/vouchers", {
        "code": code, "discountAmount": 100, "totalLimit": args.total, "perUserLimit": 1})
    assert status == 201, (status, answer)
    for base in nodes:
        conn = Conn(base)
        for _ in range(100):
            s, _, _, _, _ = await call(conn, "POST", f"/admin/vouchers/{code}/warm", token=args.token)
            if s == 204:
                break
            await asyncio.sleep(0.1)
        conn.close()
    wrks = []
    if args.pressure:
        big = f"PRESSURE{args.round}"
        status, answer = await admin("POST", "/admin/vouchers", {
            "code": big, "discountAmount": 100, "totalLimit": 1_000_000_000, "perUserLimit": 1})
        assert status == 201, (status, answer)
        for i, base in enumerate(nodes):
            wrks.append(subprocess.Popen(
                ["wrk", "-t1", f"-c{args.pressure}", "-d120s", "-s", "load-tests/wrk-reserve.lua", base,
                 "--", big, f"n{i}x", "1", "random"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    t0 = time.monotonic()
    await asyncio.gather(failover(rnd), *(worker(w, rnd) for w in range(args.workers)))
    pressure = []
    for w in wrks:
        w.send_signal(2)  # SIGINT: wrk prints what it saw and stops
        out = w.communicate(timeout=30)[0]
        rate = next((l.split()[1] for l in out.splitlines() if l.startswith("Requests/sec")), "?")
        pressure.append(rate)
    # Units released late (after the others saw OUT_OF_STOCK) go to more customers.
    port = rnd.new
    for _ in range(300):
        sold = int(psql(port, f"SELECT count(*) FROM reservations WHERE voucher_code = '{code}' AND status <> 'RELEASED'")[0][0])
        if sold >= args.total:
            break
        rnd.sold_out = False
        await asyncio.gather(*(worker(w, rnd) for w in range(6)))
        await asyncio.sleep(0.1)
    elapsed = time.monotonic() - t0
    rows = {o: s for o, s in psql(port, f"SELECT order_id, status FROM reservations WHERE voucher_code = '{code}'")}
    told = set(rnd.created)
    lost = sorted(told - set(rows))
    phantom = sorted(set(rows) - told - rnd.unknown)
    bad_confirm = sorted(o for o in rnd.confirmed if rows.get(o) != "CONFIRMED")
    bad_release = sorted(o for o in rnd.released if rows.get(o) != "RELEASED")
    live = sum(1 for s in rows.values() if s != "RELEASED")
    oversold = max(0, live - args.total)
    free, total_limit = map(int, psql(port, f"SELECT free, total_limit FROM vouchers WHERE code = '{code}'")[0])
    leased_unused = int(psql(port, f"SELECT COALESCE(SUM(granted - consumed), 0) FROM leases WHERE voucher_code = '{code}' AND state = 'ACTIVE'")[0][0])
    # §3's equation from the rows: free + leased unused + reserved + confirmed = total.
    balanced = free + leased_unused + live == total_limit
    early_reaps = int(psql(port, "SELECT count(*) FROM leases WHERE state = 'REAPED' AND closed_at < expires_at")[0][0])
    outage = rnd.outage
    o503 = sorted(t for s, t, _ in outage if s == 503)
    no_retry_after = sum(1 for s, _, ra in outage if s == 503 and not ra)
    others = {}
    for s, _, _ in outage:
        others[s] = others.get(s, 0) + 1
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")
    worst = max((t for _, t, _ in outage), default=0) * 1000
    print(f"round {args.round}: primary {rnd.old} SIGKILLed after {sum(1 for _, t in rnd.created.values() if t <= rnd.t_kill)} "
          f"201s; standby {rnd.new} promoted {rnd.t_promote - rnd.t_kill:.1f} s later (at {rnd.wall_promote} UTC)")
    if wrks:
        big = f"PRESSURE{args.round}"
        bfree, btotal = map(int, psql(port, f"SELECT free, total_limit FROM vouchers WHERE code = '{big}'")[0])
        bunused = int(psql(port, f"SELECT COALESCE(SUM(granted - consumed), 0) FROM leases WHERE voucher_code = '{big}' AND state = 'ACTIVE'")[0][0])
        blive = int(psql(port, f"SELECT count(*) FROM reservations WHERE voucher_code = '{big}' AND status <> 'RELEASED'")[0][0])
        bbalanced = bfree + bunused + blive == btotal
        balanced = balanced and bbalanced
        print(f"  pressure: wrk -c{args.pressure} per node on a second voucher, {', '.join(pressure)} req/s per node "
              f"(before, during and after the outage); its books: {blive:,} reserved, balanced {bbalanced}")
    print(f"  flood: {args.workers} clients on {len(nodes)} nodes, {sum(rnd.statuses.values()):,} reserve answers {dict(sorted((str(k), v) for k, v in rnd.statuses.items()))} in {elapsed:.1f} s")
    print(f"  during the outage: answers {others}; 503 p50 {pct(o503, 0.5):.1f} ms, p99 {pct(o503, 0.99):.1f} ms, "
          f"slowest answer {worst:.0f} ms (deadline {args.deadline_ms:.0f} ms); 503 without Retry-After {no_retry_after}; hung {rnd.hung}")
    print("  first 201 after the promotion: " + ", ".join(
        f"node {n + 1} {rnd.back[n] * 1000:.0f} ms" if n in rnd.back else f"node {n + 1} never" for n in range(len(nodes))))
    print(f"  books on the promoted primary: 201s seen {len(told)}, lost {len(lost)}, phantom {len(phantom)}, "
          f"confirms {len(rnd.confirmed)} (off {len(bad_confirm)}), releases {len(rnd.released)} (off {len(bad_release)}), "
          f"sold {live}/{args.total} ({100 * live / args.total:.1f} %), oversold {oversold}, balanced {balanced}, "
          f"live nodes reaped {early_reaps}")
    ok = (not lost and not phantom and not bad_confirm and not bad_release and oversold == 0 and balanced
          and live == args.total and rnd.hung == 0 and no_retry_after == 0 and len(rnd.back) == len(nodes)
          and not rnd.unexpected and early_reaps == 0)
    if rnd.unexpected:
        print("  unexpected answers:", rnd.unexpected[:5])
    if lost:
        print("  lost:", lost[:10])
    if phantom:
        print("  phantom:", phantom[:10])
    print(f"  round {args.round}: {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


asyncio.run(main())

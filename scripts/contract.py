#!/usr/bin/env python3
"""The HTTP contract (DESIGN §6) checked from outside against a running cluster: every request
goes to the next node in turn, so a reserve, its retry, its read, its confirm and its release
each land on another node than the one before.

  scripts/contract.py http://127.0.0.1:8080 [http://127.0.0.1:8081 ...]   # nodes already up
  scripts/contract.py --start 3 --shards "url1 url2 url3" [--fresh]   # starts 3 nodes on them

With --start the nodes run `$BIN` (default target/debug/vouchers) with config/cluster.toml and
Redis at $REDIS_URL (else $TEST_REDIS_URL, else redis://127.0.0.1:6379; a Redis Cluster's seeds
with VOUCHERS__REDIS__CLUSTER=true, which the nodes inherit), on the shards' databases
as they are, or with --fresh dropped and created again (they must be on servers this user can
create databases on). The admin token is $TOKEN, or the one the script gives the nodes it
starts. Exits non-zero at the first broken rule, saying which.

What it checks (every rule from the outside, by its status code and body):
  admin auth (401 changes nothing), create/duplicate/invalid voucher, reads on every node (once
  each knows the new code: see `voucher`);
  reserve, its retry on other nodes (same 201), one order on a second customer or voucher (409
  ALREADY_USED, on another shard where there are several), the per-customer limit, minimum
  order, unknown voucher, bad bodies (400 with detail), oversized bodies (413); confirm and
  release, each idempotent, and their conflicts; a replay of a stored order while the voucher
  is paused or sold out; NOT_STARTED / ENDED / PAUSED; sold out exactly at the total under
  concurrent reserves on every node (a 503 retried as a client would; the units a lease held
  when another node found the voucher sold out sold by later customers), the soldOut flag seen
  by every node, a restock when the
  total grows (a smaller total refused); the admin counters balanced; the change feed in order
  without gaps; the switches cluster-wide; warm.
"""
import concurrent.futures
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAST = "2020-01-01T00:00:00Z"
FUTURE = "2099-01-01T00:00:00Z"

bases = []
shard_urls = []
token = os.environ.get("TOKEN", "")
turn = 0
procs = []


class Broken(Exception):
    pass


def node():
    """The next node in turn."""
    global turn
    turn += 1
    return bases[turn % len(bases)]


def call(method, path, body=None, auth=True, base=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request((base or node()) + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if auth and token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            text = r.read()
            return r.status, (json.loads(text) if text else None), dict(r.headers)
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            parsed = json.loads(text) if text else None
        except ValueError:
            parsed = text.decode(errors="replace")
        return e.code, parsed, dict(e.headers)


def expect(what, got, want, error=None, **fields):
    code, body, _ = got
    ok = code == want
    if ok and error is not None:
        ok = isinstance(body, dict) and body.get("error") == error
    for k, v in fields.items():
        ok = ok and isinstance(body, dict) and body.get(k) == v
    if not ok:
        raise Broken(f"{what}: wanted {want} {error or ''} {fields or ''}, got {code} {body}")
    return body


def until(what, secs, check):
    deadline = time.monotonic() + secs
    while True:
        last = check()
        if last is True:
            return
        if time.monotonic() > deadline:
            raise Broken(f"{what}: not within {secs} s (last: {last})")
        time.sleep(0.05)


def voucher(code, total=10, per_user=1, min_order=0, starts=PAST, ends=FUTURE, discount=100):
    body = {"code": code, "discountAmount": discount, "minOrderAmount": min_order,
            "totalLimit": total, "perUserLimit": per_user, "startsAt": starts, "endsAt": ends}
    creator = node()
    got = expect(f"create {code}", call("POST", "/admin/vouchers", body, base=creator), 201,
                 code=code)
    # The node that created it knows it at once.
    expect(f"read {code} on the node that created it",
           call("GET", f"/vouchers/{code}", base=creator), 200)
    # The others learn it by the UPDATED signal or by their next read of the codes
    # (`engine.known_codes_refresh_ms`, 250 ms); until then they answer 404 from memory (DESIGN
    # §6, "Unknown codes"). Every rule below starts once every node knows it.
    def known(b):
        status = call("GET", f"/vouchers/{code}", base=b)[0]
        return status == 200 or f"status {status}"

    for base in bases:
        until(f"{code} known on {base}", 3, lambda b=base: known(b))
    return got


def reserve(code, customer, order, amount=1000, base=None):
    return call("POST", f"/vouchers/{code}/reservations",
                {"customerId": customer, "orderId": order, "orderAmount": amount}, base=base)


def counters(code):
    return expect(f"admin read {code}", call("GET", f"/admin/vouchers/{code}"), 200)


def check_admin(tag):
    code = f"{tag}AUTH"
    body = {"code": code, "discountAmount": 1, "minOrderAmount": 0, "totalLimit": 1,
            "perUserLimit": 1, "startsAt": PAST, "endsAt": FUTURE}
    expect("create without a token", call("POST", "/admin/vouchers", body, auth=False), 401,
           "UNAUTHORIZED")
    req = urllib.request.Request(node() + "/admin/vouchers", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json",
                                                         "Authorization": "Bearer wrong"})
    try:
        urllib.request.urlopen(req, timeout=15)
        raise Broken("create with a wrong token: not refused")
    except urllib.error.HTTPError as e:
        if e.code != 401:
            raise Broken(f"create with a wrong token: {e.code}")
    for b in bases:
        expect("a refused create left nothing", call("GET", f"/vouchers/{code}", base=b), 404,
               "NOT_FOUND")
    expect("admin read without a token", call("GET", f"/admin/vouchers/{code}", auth=False),
           401, "UNAUTHORIZED")
    expect("invalid code", call("POST", "/admin/vouchers", dict(body, code="bad code!")), 400,
           "INVALID_REQUEST")
    expect("starts after it ends", call("POST", "/admin/vouchers",
                                        dict(body, startsAt=FUTURE, endsAt=PAST)), 400,
           "INVALID_REQUEST")
    voucher(code, total=1)
    expect("create again", call("POST", "/admin/vouchers", body), 409, "ALREADY_EXISTS")


def check_reserve(tag):
    a, b = f"{tag}A", f"{tag}B"
    voucher(a, total=10, per_user=1, min_order=500)
    voucher(b, total=10, per_user=2)
    for base in bases:
        got = expect(f"read {a}", call("GET", f"/vouchers/{a}", base=base), 200, code=a,
                     discountAmount=100, minOrderAmount=500, status="ACTIVE", soldOut=False)
        for k in ("startsAt", "endsAt"):
            if k not in got:
                raise Broken(f"read {a}: no {k} in {got}")
    first = expect("reserve", reserve(a, 1, f"{tag}-o1"), 201, orderId=f"{tag}-o1",
                   discountAmount=100)
    if "expiresAt" not in first:
        raise Broken(f"reserve: no expiresAt in {first}")
    for base in bases:
        again = expect("a retry on every node", reserve(a, 1, f"{tag}-o1", base=base), 201)
        if again != first:
            raise Broken(f"a retry answered {again}, the first {first}")
    expect("the order on another customer", reserve(a, 2, f"{tag}-o1"), 409, "ALREADY_USED")
    if shard_urls:
        # The two vouchers sit on different shards, so the rule held across shards.
        placed = psql(shard_urls[0], f"SELECT count(DISTINCT shard) FROM voucher_shards "
                                     f"WHERE code IN ('{a}', '{b}')")
        if placed != "2":
            raise Broken(f"{a} and {b} are not on two shards ({placed})")
    expect("the order on another voucher", reserve(b, 1, f"{tag}-o1"), 409, "ALREADY_USED")
    expect("the customer at their limit", reserve(a, 1, f"{tag}-o2"), 409, "ALREADY_USED")
    expect("below the minimum order", reserve(a, 3, f"{tag}-o3", amount=499), 422,
           "NOT_ELIGIBLE", reason="MIN_ORDER_AMOUNT")
    expect("an unknown voucher", reserve(f"{tag}NONE", 3, f"{tag}-o3"), 404, "NOT_FOUND")
    for bad in ({"customerId": 0, "orderId": "x", "orderAmount": 1},
                {"customerId": 1, "orderId": "", "orderAmount": 1},
                {"customerId": 1, "orderId": "x" * 65, "orderAmount": 1},
                {"customerId": 1, "orderId": "x", "orderAmount": -1},
                {"customerId": 1, "orderId": "x"}):
        got = expect(f"bad body {bad}", call("POST", f"/vouchers/{a}/reservations", bad), 400,
                     "INVALID_REQUEST")
        if "detail" not in got:
            raise Broken(f"bad body {bad}: no detail in {got}")
    expect("not JSON", call("POST", f"/vouchers/{a}/reservations", raw=b"{nope"), 400,
           "INVALID_REQUEST")
    code, _, _ = call("POST", f"/vouchers/{a}/reservations", raw=b" " * (64 * 1024))
    if code != 413:
        raise Broken(f"a 64 KiB body: {code}, not 413")
    # Two orders of one customer on a voucher that allows two; the second on another shard's
    # voucher (B) after the first: the limit is per voucher.
    expect("a second voucher", reserve(b, 1, f"{tag}-o4"), 201)
    expect("its second order", reserve(b, 1, f"{tag}-o5"), 201)
    expect("its third", reserve(b, 1, f"{tag}-o6"), 409, "ALREADY_USED")

    # Confirm and release, each idempotent, each on another node.
    got = expect("read the reservation", call("GET", f"/vouchers/{a}/reservations/{tag}-o1"),
                 200, orderId=f"{tag}-o1", customerId=1, status="RESERVED", discountAmount=100)
    if got.get("expiresAt") != first["expiresAt"]:
        raise Broken(f"read expiresAt {got.get('expiresAt')}, reserve said {first['expiresAt']}")
    for _ in bases:
        expect("confirm", call("POST", f"/vouchers/{a}/reservations/{tag}-o1/confirm"), 200,
               orderId=f"{tag}-o1", status="CONFIRMED")
    expect("release a confirmed", call("DELETE", f"/vouchers/{a}/reservations/{tag}-o1"), 409,
           "ALREADY_CONFIRMED")
    expect("a confirmed order's retry", reserve(a, 1, f"{tag}-o1"), 201)
    for _ in bases:
        expect("release", call("DELETE", f"/vouchers/{b}/reservations/{tag}-o4"), 200,
               orderId=f"{tag}-o4", status="RELEASED")
    expect("confirm a released", call("POST", f"/vouchers/{b}/reservations/{tag}-o4/confirm"),
           409, "RESERVATION_RELEASED")
    expect("read a released", call("GET", f"/vouchers/{b}/reservations/{tag}-o4"), 200,
           status="RELEASED")
    expect("an unknown order", call("GET", f"/vouchers/{a}/reservations/{tag}-none"), 404,
           "NOT_FOUND")
    expect("confirm an unknown order", call("POST", f"/vouchers/{a}/reservations/{tag}-none/confirm"),
           404, "NOT_FOUND")
    expect("release an unknown order", call("DELETE", f"/vouchers/{a}/reservations/{tag}-none"),
           404, "NOT_FOUND")
    expect("an order read under another voucher",
           call("GET", f"/vouchers/{b}/reservations/{tag}-o1"), 404, "NOT_FOUND")
    # The released order's customer may reserve again (a release gives the use back).
    expect("a reserve after a release", reserve(b, 1, f"{tag}-o7"), 201)
    for code, reserved, confirmed, released in ((a, 0, 1, 0), (b, 2, 0, 1)):
        c = counters(code)
        for k, v in (("reserved", reserved), ("confirmed", confirmed), ("released", released),
                     ("balanced", True)):
            if c.get(k) != v:
                raise Broken(f"counters of {code}: {k} {c.get(k)}, wanted {v} ({c})")


def check_eligibility(tag):
    early, late, p = f"{tag}EARLY", f"{tag}LATE", f"{tag}P"
    voucher(early, starts="2098-01-01T00:00:00Z")
    voucher(late, starts="2020-01-01T00:00:00Z", ends="2021-01-01T00:00:00Z")
    voucher(p, total=5)
    expect("not started", reserve(early, 1, f"{tag}-e1"), 422, "NOT_ELIGIBLE",
           reason="NOT_STARTED")
    expect("ended", reserve(late, 1, f"{tag}-e2"), 422, "NOT_ELIGIBLE", reason="ENDED")
    expect("reserve before the pause", reserve(p, 1, f"{tag}-e3"), 201)
    expect("pause", call("PATCH", f"/admin/vouchers/{p}", {"status": "PAUSED"}), 200)
    until("every node refuses a paused voucher", 10,
          lambda: all(reserve(p, 2, f"{tag}-e4", base=b)[0] == 422 for b in bases) or "201")
    expect("paused", reserve(p, 2, f"{tag}-e4"), 422, "NOT_ELIGIBLE", reason="PAUSED")
    for base in bases:
        expect("a stored order's retry while paused", reserve(p, 1, f"{tag}-e3", base=base), 201)
    expect("resume", call("PATCH", f"/admin/vouchers/{p}", {"status": "ACTIVE"}), 200)
    until("every node sells again", 10,
          lambda: all(reserve(p, 2, f"{tag}-e4", base=b)[0] == 201 for b in bases) or "422")
    expect("a smaller total", call("PATCH", f"/admin/vouchers/{p}", {"totalLimit": 1}), 400,
           "INVALID_REQUEST")
    expect("patch an unknown voucher", call("PATCH", f"/admin/vouchers/{tag}NONE",
                                            {"status": "PAUSED"}), 404, "NOT_FOUND")


def check_sell_out(tag):
    code, total, customers = f"{tag}HOT", 40, 200
    voucher(code, total=total)

    def one(i):
        # A client retries a 503 with the same order (it is allowed, and changes nothing).
        for _ in range(20):
            got = reserve(code, 1000 + i, f"{tag}-h{i}", base=bases[i % len(bases)])
            if got[0] != 503:
                return got
            time.sleep(0.1)
        return got

    with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
        answers = list(pool.map(one, range(customers)))
    won = [i for i, a in enumerate(answers) if a[0] == 201]
    for a in answers:
        if a[0] != 201 and (a[0], (a[1] or {}).get("error")) != (409, "OUT_OF_STOCK"):
            raise Broken(f"sell-out: an answer {a[0]} {a[1]}")
    if len(won) > total:
        raise Broken(f"sell-out: {len(won)} 201s for {total} units")
    # Units a node still held in a lease when another found the voucher sold out come back
    # (recall, idle return): the sale ends sold out, never oversold.
    i, deadline = customers, time.monotonic() + 20
    while len(won) < total and time.monotonic() < deadline:
        got = one(i)
        if got[0] == 201:
            won.append(i)
        elif (got[0], (got[1] or {}).get("error")) != (409, "OUT_OF_STOCK"):
            raise Broken(f"sell-out top-up: {got[0]} {got[1]}")
        i += 1
        time.sleep(0.02)
    if len(won) != total:
        raise Broken(f"sell-out: {len(won)} of {total} units sold within 20 s")
    until("every node says sold out", 10, lambda: all(
        call("GET", f"/vouchers/{code}", base=b)[1].get("soldOut") for b in bases) or "not yet")
    for base in bases:
        expect("a late reserve", reserve(code, 5000, f"{tag}-late", base=base), 409,
               "OUT_OF_STOCK")
        expect("a winner's retry after the sell-out", one(won[0]), 201)
    c = counters(code)
    if (c.get("reserved"), c.get("free"), c.get("balanced")) != (total, 0, True):
        raise Broken(f"sell-out counters: {c}")
    # A release gives a unit back; the total raised gives more; both sell again.
    expect("release a winner", call("DELETE", f"/vouchers/{code}/reservations/{tag}-h{won[0]}"),
           200, status="RELEASED")
    expect("raise the total", call("PATCH", f"/admin/vouchers/{code}", {"totalLimit": total + 2}),
           200)
    sold = []
    deadline = time.monotonic() + 15
    i = 0
    while len(sold) < 3 and time.monotonic() < deadline:
        got = reserve(code, 6000 + i, f"{tag}-r{i}")
        if got[0] == 201:
            sold.append(i)
        elif got[0] != 409:
            raise Broken(f"restock reserve: {got[0]} {got[1]}")
        i += 1
        time.sleep(0.02)
    if len(sold) != 3:
        raise Broken(f"restock: {len(sold)} of 3 units sold again within 15 s")
    expect("sold out again", reserve(code, 7000, f"{tag}-r-last"), 409, "OUT_OF_STOCK")
    c = counters(code)
    if (c.get("reserved"), c.get("released"), c.get("free"), c.get("balanced")) != (
            total + 2, 1, 0, True):
        raise Broken(f"restock counters: {c}")


def check_feed(tag):
    seen, after = [], 0
    while True:
        got = expect("feed page", call("GET", f"/admin/events?after={after}&limit=100"), 200)
        seen += got["events"]
        if not got["events"]:
            break
        after = got["next"]
    expect("feed without a token", call("GET", "/admin/events?after=0", auth=False), 401,
           "UNAUTHORIZED")
    expect("feed with a bad limit", call("GET", "/admin/events?after=0&limit=-1"), 400,
           "INVALID_REQUEST")
    seqs = [e["seq"] for e in seen]
    if not seqs or seqs != list(range(seqs[0], seqs[0] + len(seqs))):
        raise Broken(f"feed: numbers not consecutive: {seqs[:5]}…")
    mine = {(e["orderId"], e["type"]) for e in seen if e["orderId"].startswith(f"{tag}-")}
    for want in ((f"{tag}-o1", "RESERVED"), (f"{tag}-o1", "CONFIRMED"), (f"{tag}-o4", "RELEASED")):
        if want not in mine:
            raise Broken(f"feed: no {want}")


def check_switches(tag):
    code = f"{tag}SW"
    voucher(code, total=5)
    expect("pause sales", call("PUT", "/admin/switches", {"salesPaused": True}), 200,
           salesPaused=True, readOnly=False)
    try:
        until("every node reads the switch", 5, lambda: all(
            call("GET", "/admin/switches", base=b)[1].get("salesPaused") for b in bases) or "no")
        for base in bases:
            expect("a reserve while sales are paused", reserve(code, 1, f"{tag}-s1", base=base),
                   422, "NOT_ELIGIBLE", reason="PAUSED")
    finally:
        expect("resume sales", call("PUT", "/admin/switches", {"salesPaused": False}), 200,
               salesPaused=False)
    until("every node sells again", 5, lambda: all(
        not call("GET", "/admin/switches", base=b)[1].get("salesPaused") for b in bases) or "no")
    expect("a reserve after", reserve(code, 1, f"{tag}-s1"), 201)
    expect("bad switches", call("PUT", "/admin/switches", {"salesPaused": "yes"}), 400,
           "INVALID_REQUEST")
    for base in bases:
        code_, _, _ = call("POST", f"/admin/vouchers/{code}/warm", base=base)
        if code_ != 204:
            raise Broken(f"warm: {code_}")
    expect("warm an unknown voucher", call("POST", f"/admin/vouchers/{tag}NONE/warm"), 404,
           "NOT_FOUND")


def check_service():
    for base in bases:
        for path in ("/health/live", "/health/ready", "/openapi.json", "/metrics"):
            req = urllib.request.Request(base + path)
            with urllib.request.urlopen(req, timeout=15) as r:
                if r.status != 200:
                    raise Broken(f"{base}{path}: {r.status}")


def stop(processes):
    """SIGTERM to every process still running, then SIGKILL to any not gone within 20 s."""
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def psql(url, sql):
    return subprocess.run(["psql", url, "-Atc", sql], check=True, capture_output=True,
                          text=True).stdout.strip()


def start(n, shards, fresh):
    global token
    binary = os.environ.get("BIN") or os.path.join(ROOT, "target/debug/vouchers")
    token = token or "contract-" + secrets.token_hex(8)
    shard_urls.extend(shards)
    for s in shards if fresh else []:
        u = urllib.parse.urlsplit(s)
        db = u.path.lstrip("/")
        admin = urllib.parse.urlunsplit(u._replace(path="/postgres"))
        psql(admin, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        psql(admin, f'CREATE DATABASE "{db}"')
    for i in range(n):
        port = free_port()
        env = dict(os.environ, VOUCHERS__HTTP__HOST="127.0.0.1", VOUCHERS__HTTP__PORT=str(port),
                   VOUCHERS__LEDGER__SHARDS=" ".join(shards), VOUCHERS__ADMIN__TOKEN=token,
                   VOUCHERS__REDIS__URL=os.environ.get("REDIS_URL")
                   or os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379"),
                   VOUCHERS__LEDGER__MAX_CONNECTIONS="4",
                   VOUCHERS__NODE__ID=f"contract-{i + 1}", VOUCHERS__REDIS__EVENTS_STREAM="",
                   RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        log = open(f"/tmp/contract-node{i + 1}.log", "w")
        procs.append(subprocess.Popen([binary, "--config", "config/cluster.toml"], cwd=ROOT,
                                      env=env, stdout=log, stderr=log))
        base = f"http://127.0.0.1:{port}"

        def ready():
            if procs[-1].poll() is not None:
                raise Broken(f"node {i + 1} exited: see /tmp/contract-node{i + 1}.log")
            try:
                with urllib.request.urlopen(base + "/health/ready", timeout=1) as r:
                    return r.status == 200 or r.status
            except (urllib.error.URLError, OSError) as e:
                return str(e)

        until(f"node {i + 1} ready", 60, ready)
        bases.append(base)


def main(argv):
    if "--start" in argv:
        n = int(argv[argv.index("--start") + 1])
        shards = argv[argv.index("--shards") + 1].split()
        start(n, shards, "--fresh" in argv)
    else:
        bases.extend(a.rstrip("/") for a in argv if a.startswith("http"))
    if not bases:
        sys.exit(__doc__)
    tag = "C" + secrets.token_hex(3).upper()
    steps = [("service", check_service), ("admin", lambda: check_admin(tag)),
             ("reserve", lambda: check_reserve(tag)),
             ("eligibility", lambda: check_eligibility(tag)),
             ("sell-out", lambda: check_sell_out(tag)), ("feed", lambda: check_feed(tag)),
             ("switches", lambda: check_switches(tag))]
    for name, step in steps:
        started = time.monotonic()
        step()
        print(f"contract: {name} ok ({time.monotonic() - started:.1f} s)", flush=True)
    alive = [p.poll() is None for p in procs]
    if not all(alive):
        raise Broken(f"a node exited during the run: {alive}")
    print(f"contract: every rule held on {len(bases)} node(s)")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Broken as e:
        print(f"contract: BROKEN: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        stop(procs)

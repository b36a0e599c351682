//! The ledger's primary fails mid-sale and its synchronous standby takes over: two node
//! processes on the multi-host URL of the pair `scripts/ledger-pair.sh` builds (`.ci/run` builds
//! it and sets `TEST_LEDGER_PAIR_URL`). The test plays the failover manager with the same
//! script: SIGKILL of the primary's postmaster, an outage longer than two liveness limits,
//! promotion, and later the old primary back as the standby, then the same the other way.

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;

use crate::audit::{books, Seen};
use crate::helpers::{
    client, create_on_every_node, eventually, metric_sum, metrics_text, send, try_reserve, Node,
};

const PAIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ledger-pair.sh");
const CLUSTER_TOML: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/config/cluster.toml");

/// Runs `scripts/ledger-pair.sh ARG` off the test's thread; its output, trimmed.
async fn pair(arg: &'static str) -> String {
    pair_with(vec![arg.to_string()]).await
}

/// `scripts/ledger-pair.sh kill PORT`.
async fn pair_kill(port: &str) -> String {
    pair_with(vec!["kill".into(), port.to_string()]).await
}

async fn pair_with(args: Vec<String>) -> String {
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(PAIR)
            .args(&args)
            .output()
            .expect("run scripts/ledger-pair.sh");
        assert!(
            out.status.success(),
            "ledger-pair.sh {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    })
    .await
    .expect("ledger-pair.sh thread")
}

/// The pair's URL with database `db` instead of the one it names.
fn with_db(url: &str, db: &str) -> String {
    let (head, tail) = url.split_once("://").expect("scheme");
    let (authority, rest) = tail.split_at(tail.find('/').expect("a database"));
    let query = rest
        .split_once('?')
        .map(|(_, q)| format!("?{q}"))
        .unwrap_or_default();
    format!("{head}://{authority}/{db}{query}")
}

/// A single-host URL of database `db` on the primary now (for the auditor and setup).
async fn on_primary(db: &str) -> String {
    let port = pair("primary").await;
    format!("postgres://postgres@127.0.0.1:{port}/{db}")
}

/// One customer's checkout, retried the way a checkout service would on `503` and on a lost
/// answer (same order id) until the engine answers for good: a reserve, and for some a confirm
/// or a release after it. Records what the client was told.
struct Shopper {
    told: RefCell<Seen>,
    /// Reserves answered 201 so far.
    wins: Cell<usize>,
    /// Reserve answers by status.
    statuses: RefCell<std::collections::BTreeMap<u16, usize>>,
    /// Requests that got no answer at all (the client gave up on them).
    unanswered: Cell<usize>,
    /// When the standby was promoted.
    since: Cell<Option<Instant>>,
    /// By node: how long after the promotion its first 201 came.
    back: RefCell<Vec<Option<Duration>>>,
}

impl Shopper {
    fn new(nodes: usize) -> Self {
        Shopper {
            told: RefCell::default(),
            wins: Cell::new(0),
            statuses: RefCell::default(),
            unanswered: Cell::new(0),
            since: Cell::new(None),
            back: RefCell::new(vec![None; nodes]),
        }
    }

    async fn checkout(&self, c: &awc::Client, bases: &[String], code: &str, i: i64) {
        self.checkout_at(c, bases, code, i, None).await
    }

    /// [`Shopper::checkout`], arriving at `at` (customers arrive over time, so the sale is still
    /// on when the primary dies and after it is promoted).
    async fn checkout_at(
        &self,
        c: &awc::Client,
        bases: &[String],
        code: &str,
        i: i64,
        at: Option<Instant>,
    ) {
        if let Some(at) = at {
            actix_rt::time::sleep_until(at.into()).await;
        }
        let node = (i as usize) % bases.len();
        let order = format!("{code}-o{i}");
        let deadline = Instant::now() + Duration::from_secs(60);
        let won = loop {
            let a = try_reserve(c, &bases[node], code, i, &order).await;
            let status = a.as_ref().map(|a| a.0);
            match status {
                Some(s) => *self.statuses.borrow_mut().entry(s).or_default() += 1,
                None => self.unanswered.set(self.unanswered.get() + 1),
            }
            match status {
                Some(201) => {
                    if let Some(t) = self.since.get() {
                        let mut back = self.back.borrow_mut();
                        back[node].get_or_insert(t.elapsed());
                    }
                    break true;
                }
                Some(503) | None if Instant::now() < deadline => {
                    self.told.borrow_mut().unknown.insert(order.clone());
                    actix_rt::time::sleep(Duration::from_millis(50)).await;
                }
                Some(503) | None => panic!("{order}: no answer for good within a minute"),
                Some(409) => break false,
                Some(other) => panic!("{order}: unexpected {other}: {a:?}"),
            }
        };
        if !won {
            return;
        }
        self.told.borrow_mut().created.insert(order.clone());
        self.wins.set(self.wins.get() + 1);
        // One in five confirms, one in five (of the first customers) releases.
        let (method, path) = match i % 5 {
            1 => (
                "POST",
                format!("/vouchers/{code}/reservations/{order}/confirm"),
            ),
            2 if i < 120 => ("DELETE", format!("/vouchers/{code}/reservations/{order}")),
            _ => return,
        };
        loop {
            let (s, b) = send(c, method, &format!("{}{path}", bases[node]), None, None).await;
            match s {
                200 => {
                    let mut told = self.told.borrow_mut();
                    if method == "POST" {
                        told.confirmed.insert(order.clone());
                    } else {
                        told.released.insert(order.clone());
                    }
                    return;
                }
                503 if Instant::now() < deadline => {
                    self.told.borrow_mut().unknown.insert(order.clone());
                    actix_rt::time::sleep(Duration::from_millis(50)).await;
                }
                _ => panic!("{method} {order}: {s} {b}"),
            }
        }
    }
}

async fn ready(c: &awc::Client, base: &str) -> (u16, Value) {
    send(c, "GET", &format!("{base}/health/ready"), None, None).await
}

/// One failover under a flood: returns the port of the new primary.
async fn one_failover(c: &awc::Client, nodes: &[Node], db: &str, round: usize) -> String {
    let bases: Vec<String> = nodes.iter().map(|n| n.base.clone()).collect();
    let code = format!("FO{round}-{}", vouchers::startup::random_hex(3));
    let total = 150;
    create_on_every_node(c, &bases, &code, total, 1).await;
    let failovers_before: Vec<f64> = {
        let mut v = Vec::new();
        for base in &bases {
            v.push(metric_sum(
                &metrics_text(c, base).await,
                "vouchers_ledger_failovers_total",
                &[],
            ));
        }
        v
    };
    let shopper = Shopper::new(bases.len());
    let dead_after = Duration::from_millis(1500);
    let old_primary = pair("primary").await;
    // 100 customers a second for four seconds, on 150 units: the sale outlasts the outage.
    let start = Instant::now();
    let flood = futures_util::stream::iter(1..=400i64)
        .map(|i| {
            let at = start + Duration::from_millis(10 * i as u64);
            shopper.checkout_at(c, &bases, &code, i, Some(at))
        })
        .buffer_unordered(64)
        .collect::<Vec<()>>();
    let failover = async {
        eventually("the sale is under way", Duration::from_secs(30), || {
            let wins = shopper.wins.get();
            async move { wins >= 20 }
        })
        .await;
        let killed = pair("kill").await;
        assert_eq!(killed, old_primary);
        let at = Instant::now();
        // Every node notices (its breaker opens) and stays cut off longer than two liveness
        // limits: beats missed now must not get live nodes reaped once the standby is promoted.
        for base in &bases {
            eventually(
                "the breaker opens",
                Duration::from_secs(20),
                || async move {
                    metric_sum(
                        &metrics_text(c, base).await,
                        "vouchers_ledger_breaker_state",
                        &[],
                    ) == 2.0
                },
            )
            .await;
            let (s, b) = ready(c, base).await;
            assert_eq!(s, 503, "not ready while no primary is up: {b}");
        }
        actix_rt::time::sleep_until((at + 2 * dead_after + Duration::from_millis(500)).into())
            .await;
        let promoted = pair("promote").await;
        shopper.since.set(Some(Instant::now()));
        promoted
    };
    let (_, promoted) = futures_util::future::join(flood, failover).await;
    assert_ne!(promoted, old_primary);
    // The sale sells out on the promoted primary: whatever units idled back get sold to more
    // customers.
    let db_url = on_primary(db).await;
    let mut next = 1000;
    eventually("the voucher sells out", Duration::from_secs(60), || {
        next += 1;
        let (shopper, bases, code, db_url) = (&shopper, &bases, &code, &db_url);
        let i = next;
        async move {
            shopper.checkout(c, bases, code, i).await;
            let b = books(db_url, code).await;
            b.reserved + b.confirmed == total
        }
    })
    .await;
    let statuses = shopper.statuses.borrow().clone();
    let back = shopper.back.borrow().clone();
    eprintln!(
        "failover round {round}: {old_primary} -> {promoted}; reserve answers {statuses:?}, \
         unanswered {}; first 201 after promotion per node {back:?}",
        shopper.unanswered.get()
    );
    assert!(
        statuses.get(&503).copied().unwrap_or(0) > 0,
        "the outage was seen as 503s"
    );
    assert_eq!(
        shopper.unanswered.get(),
        0,
        "no request hung past the client's timeout"
    );
    assert!(
        back.iter().all(Option::is_some),
        "every node sold again after the promotion: {back:?}"
    );
    // Every 201 is in the promoted ledger, nothing else is, and the books balance.
    let told = shopper.told.borrow().clone();
    let b = books(&db_url, &code).await;
    b.assert_matches(&code, &told);
    assert_eq!(b.reserved + b.confirmed, total, "sold 100 %: {b:?}");
    assert!(
        told.released.len() + told.confirmed.len() > 10,
        "confirms and releases were mixed in"
    );
    // No live node was taken for dead: the beats missed during the outage did not count
    // against them (a holder found dead loses its leases before they expire; a lease used up
    // and left to run out is reaped after its expiry, which is not that).
    let reaped = crate::helpers::scalar(
        &db_url,
        "SELECT count(*) FROM leases WHERE state = 'REAPED' AND closed_at < expires_at",
    )
    .await;
    assert_eq!(
        reaped, 0,
        "no lease of a live node was reaped as its holder's"
    );
    // Each node says which server it writes to now, and that it moved.
    for (base, before) in bases.iter().zip(failovers_before) {
        let (s, r) = ready(c, base).await;
        assert_eq!(s, 200, "{r}");
        assert_eq!(r["ledgerServer"], format!("127.0.0.1:{promoted}"), "{r}");
        let m = metrics_text(c, base).await;
        assert_eq!(
            metric_sum(&m, "vouchers_ledger_failovers_total", &[]),
            before + 1.0
        );
        assert_eq!(
            metric_sum(
                &m,
                "vouchers_ledger_server",
                &[&format!("server=\"127.0.0.1:{promoted}\"")]
            ),
            1.0
        );
        assert_eq!(
            metric_sum(
                &m,
                "vouchers_ledger_server",
                &[&format!("server=\"127.0.0.1:{old_primary}\"")]
            ),
            0.0
        );
    }
    promoted
}

/// After a failover from `old` to `new`: `old` comes back writable without being rewound (a
/// split brain the failover manager failed to fence), then `new` dies. The nodes must not write
/// to `old` (it is on an older timeline than they wrote on): `503`s, no row there. When `new`
/// comes back they sell again; `old` is then fenced (killed) for the rejoin.
async fn an_unfenced_old_primary_is_never_written_to(
    c: &awc::Client,
    nodes: &[Node],
    db: &str,
    old: &str,
    new: &str,
) {
    let bases: Vec<String> = nodes.iter().map(|n| n.base.clone()).collect();
    let code = format!("SB-{}", vouchers::startup::random_hex(3));
    create_on_every_node(c, &bases, &code, 1_000_000, 1).await;
    assert_eq!(pair("revive").await, old);
    let old_db = format!("postgres://postgres@127.0.0.1:{old}/{db}");
    let rows = "SELECT (SELECT count(*) FROM reservations) + (SELECT count(*) FROM leases)";
    let before = crate::helpers::scalar(&old_db, rows).await;
    assert_eq!(pair_kill(new).await, new);
    // Each node finds its server gone, searches (every 200 ms to 1 s) and finds only `old`,
    // writable but on the timeline before the promotion. Three seconds of reserves: none may
    // succeed.
    let until = Instant::now() + Duration::from_secs(3);
    let mut n = 0;
    while Instant::now() < until {
        for (i, base) in bases.iter().enumerate() {
            n += 1;
            let order = format!("{code}-sb{n}");
            let t = Instant::now();
            let mut a = try_reserve(c, base, &code, n, &order).await;
            if a.is_none() && t.elapsed() < Duration::from_secs(1) {
                // A pooled keep-alive connection the node had just closed: the same order again.
                a = try_reserve(c, base, &code, n, &order).await;
            }
            assert!(
                matches!(a, Some((503, _))),
                "node {i} answered {a:?} after {:?} with only a stale primary up",
                t.elapsed()
            );
        }
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        crate::helpers::scalar(&old_db, rows).await,
        before,
        "nothing was written to the stale primary"
    );
    for base in &bases {
        assert_eq!(ready(c, base).await.0, 503);
    }
    // The newest primary comes back: the nodes sell on it again.
    assert_eq!(pair("revive").await, new);
    for (i, base) in bases.iter().enumerate() {
        let mut k = 0;
        eventually("the node sells again", Duration::from_secs(30), || {
            k += 1;
            let order = format!("{code}-back{i}-{k}");
            let customer = 1_000 * (i as i64 + 1) + k;
            let code = &code;
            async move {
                matches!(
                    try_reserve(c, base, code, customer, &order).await,
                    Some((201, _))
                )
            }
        })
        .await;
        let (s, r) = ready(c, base).await;
        assert_eq!(
            (s, r["ledgerServer"].as_str()),
            (200, Some(format!("127.0.0.1:{new}").as_str()))
        );
    }
    assert_eq!(
        crate::helpers::scalar(&old_db, rows).await,
        before,
        "nothing was written to the stale primary"
    );
    // The failover manager's fencing, late: the old primary goes down, to rejoin as a standby.
    assert_eq!(pair_kill(old).await, old);
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pair, no_test_redis),
    ignore = "needs TEST_LEDGER_PAIR_URL (scripts/ledger-pair.sh up) and TEST_REDIS_URL; .ci/run sets them"
)]
async fn a_promoted_synchronous_standby_takes_over_and_loses_nothing() {
    let Some(url) = crate::helpers::service_url("TEST_LEDGER_PAIR_URL") else {
        return;
    };
    let Some(redis) = crate::helpers::service_url("TEST_REDIS_URL") else {
        return;
    };
    let c = client();
    eprintln!("{}", pair("check").await);
    let db = format!("failover_{}", vouchers::startup::random_hex(4));
    crate::helpers::execute(
        &on_primary("postgres").await,
        &format!("CREATE DATABASE {db}"),
    )
    .await;
    let url = with_db(&url, &db);
    let mut nodes = Vec::new();
    for i in 0..2 {
        let id = format!("fo-{i}");
        let env = [
            ("VOUCHERS__REDIS__URL", redis.as_str()),
            ("VOUCHERS__NODE__ID", id.as_str()),
            ("VOUCHERS__HTTP__HOST", "127.0.0.1"),
            ("VOUCHERS__LEDGER__MAX_CONNECTIONS", "4"),
            ("VOUCHERS__REDIS__EVENTS_STREAM", ""),
        ];
        nodes.push(Node::start_with_args(&url, &env, &["--config", CLUSTER_TOML]).await);
    }
    let old = pair("primary").await;
    let first = one_failover(&c, &nodes, &db, 1).await;
    an_unfenced_old_primary_is_never_written_to(&c, &nodes, &db, &old, &first).await;
    // The old primary back as the standby; then the same failover the other way.
    pair("rejoin").await;
    eprintln!("{}", pair("check").await);
    let second = one_failover(&c, &nodes, &db, 2).await;
    assert_ne!(first, second);
    pair("rejoin").await;
    eprintln!("{}", pair("check").await);
}

//! Cluster mode: real processes of the binary on loopback ports, sharing one PostgreSQL schema
//! and one Redis. Reported as ignored where TEST_DATABASE_URL or TEST_REDIS_URL is unset (and
//! failed if that happens inside CI); `.ci/run` sets both and fails if either service is down.

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::rc::Rc;
use std::time::{Duration, Instant};

use chrono::Utc;
use futures_util::future::join_all;
use futures_util::{FutureExt, StreamExt};
use serde_json::{json, Value};

use crate::audit::{books, Seen};
use crate::helpers::{
    client, create_voucher, eventually, fenced, metrics_text, send, try_reserve, Answer, Node,
    TOKEN,
};
use crate::ledger::fresh_pg_schema;
use crate::proxy::Proxy;

struct Cluster {
    nodes: Vec<Node>,
    db_url: String,
    client: awc::Client,
}

fn redis_url() -> Option<String> {
    crate::helpers::service_url("TEST_REDIS_URL")
}

/// The guard of the tests on a Redis Cluster: a fresh PostgreSQL schema named for `tag` and
/// the shared cluster's seeds (`scripts/redis-cluster.sh`), or `None` where a service is not set.
async fn cluster_services(tag: &str) -> Option<(String, String)> {
    Some((fresh_pg_schema(tag).await?, redis_cluster_url()?))
}

/// The guard of every test that needs both services (marked, each, with the same
/// `cfg_attr(any(no_test_pg, no_test_redis), ignore)`): a fresh PostgreSQL schema named for
/// `tag` and the Redis URL, or `None` (the test returns) where a service is not set.
async fn services(tag: &str) -> Option<(String, String)> {
    Some((fresh_pg_schema(tag).await?, redis_url()?))
}

/// Host and port of a `scheme://[user@]host:port/...` URL.
fn host_port(url: &str) -> String {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let rest = rest.rsplit('@').next().unwrap_or(rest);
    rest.split(['/', '?']).next().unwrap_or(rest).to_string()
}

/// The same URL pointed at another local port.
fn via_port(url: &str, port: u16) -> String {
    url.replacen(&host_port(url), &format!("127.0.0.1:{port}"), 1)
}

const CLUSTER_TOML: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/config/cluster.toml");

impl Cluster {
    async fn start(n: usize, db_url: &str, redis: &str, env: &[(&str, &str)]) -> Cluster {
        let mut nodes = Vec::new();
        for i in 0..n {
            nodes.push(Self::node(i, db_url, redis, env).await);
        }
        Cluster {
            nodes,
            db_url: db_url.to_string(),
            client: client(),
        }
    }

    async fn node(i: usize, db_url: &str, redis: &str, env: &[(&str, &str)]) -> Node {
        let id = format!("node-{i}");
        let mut all: Vec<(&str, &str)> = vec![
            ("VOUCHERS__REDIS__URL", redis),
            ("VOUCHERS__NODE__ID", &id),
            ("VOUCHERS__HTTP__HOST", "127.0.0.1"),
            ("VOUCHERS__LEDGER__MAX_CONNECTIONS", "4"),
            // No copy of the change feed unless a test asks for one (on a stream of its own).
            ("VOUCHERS__REDIS__EVENTS_STREAM", ""),
        ];
        all.extend_from_slice(env);
        Node::start_with_args(db_url, &all, &["--config", CLUSTER_TOML]).await
    }

    fn base(&self, i: usize) -> String {
        self.nodes[i].base.clone()
    }

    /// Every node's base URL, in node order.
    fn bases(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.base.clone()).collect()
    }

    async fn create(&self, code: &str, total: i64, per_user: i64) {
        crate::helpers::create_on_every_node(&self.client, &self.bases(), code, total, per_user)
            .await;
    }

    async fn admin(&self, node: usize, code: &str) -> Value {
        let (s, b) = send(
            &self.client,
            "GET",
            &format!("{}/admin/vouchers/{code}", self.base(node)),
            Some(TOKEN),
            None,
        )
        .await;
        assert_eq!(s, 200, "{b}");
        b
    }

    async fn pg(&self) -> sqlx::PgPool {
        sqlx::PgPool::connect(&self.db_url)
            .await
            .expect("connect test schema")
    }
}

/// Signals of `kind` a node says it received from other nodes so far.
async fn signals_received(c: &awc::Client, base: &str, kind: &str) -> f64 {
    let kind = format!("kind=\"{kind}\"");
    crate::helpers::metric_sum(
        &metrics_text(c, base).await,
        "vouchers_signals_total",
        &["event=\"received\"", &kind],
    )
}

/// A unique voucher code per run (Redis channels are shared between tests).
fn code(tag: &str) -> String {
    format!("{tag}-{}", vouchers::startup::random_hex(3))
}

/// Sends customers `from..to` to the nodes by weight, `concurrency` at a time; returns every answer
/// with its node and order id (`None` when the request failed in transit).
async fn flood(
    c: &awc::Client,
    bases: &[String],
    weights: &[usize],
    code: &str,
    customers: std::ops::Range<i64>,
    concurrency: usize,
) -> Vec<(usize, String, Option<Answer>)> {
    let total: usize = weights.iter().sum();
    futures_util::stream::iter(customers.map(|i| {
        let slot = (i as usize * 7919) % total;
        let mut acc = 0;
        let node = weights
            .iter()
            .position(|w| {
                acc += w;
                slot < acc
            })
            .unwrap();
        let (c, base, code) = (c.clone(), bases[node].clone(), code.to_string());
        async move {
            let order = format!("{code}-o{i}");
            let a = try_reserve(&c, &base, &code, i, &order).await;
            (node, order, a)
        }
    }))
    .buffer_unordered(concurrency)
    .collect()
    .await
}

/// A metric summed over the nodes at `bases` (each node counts only what it did itself).
async fn summed(c: &awc::Client, bases: &[String], name: &str, labels: &[&str]) -> f64 {
    let mut n = 0.0;
    for base in bases {
        n += crate::helpers::metric_sum(&metrics_text(c, base).await, name, labels);
    }
    n
}

/// The orders of `answers` that got `201`.
fn created(answers: &[(usize, String, Option<Answer>)]) -> BTreeSet<String> {
    answers
        .iter()
        .filter(|(_, _, a)| matches!(a, Some((201, _))))
        .map(|(_, o, _)| o.clone())
        .collect()
}

/// What the clients of `answers` were told: `201`s, and the orders left without an answer or
/// with a `503` (they may have committed).
fn seen(answers: &[(usize, String, Option<Answer>)]) -> Seen {
    let mut seen = Seen::created(created(answers));
    seen.unknown = answers
        .iter()
        .filter(|(_, _, a)| matches!(a, None | Some((503, _))))
        .map(|(_, o, _)| o.clone())
        .collect();
    seen
}

fn count(answers: &[(usize, String, Option<Answer>)], status: u16) -> usize {
    answers
        .iter()
        .filter(|(_, _, a)| matches!(a, Some((s, _)) if *s == status))
        .count()
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn three_nodes_uneven_traffic_sell_every_unit_exactly_once() {
    let Some((db, redis)) = services("uneven").await else {
        return;
    };
    let cluster = Cluster::start(3, &db, &redis, &[]).await;
    let code = code("UNEVEN");
    cluster.create(&code, 1000, 1).await;
    let bases = cluster.bases();
    let mut answers = Vec::new();
    // 5000 distinct customers in waves of 250, most of them on node 0.
    for wave in 0..20 {
        let from = 1 + wave * 250;
        answers.extend(
            flood(
                &cluster.client,
                &bases,
                &[7, 2, 1],
                &code,
                from..from + 250,
                64,
            )
            .await,
        );
    }
    let created = count(&answers, 201);
    let other: Vec<_> = answers
        .iter()
        .filter(|(_, _, a)| {
            !matches!(a, Some((201, _)))
                && !matches!(a, Some((409, b)) if b["error"] == "OUT_OF_STOCK")
        })
        .collect();
    assert!(
        other.is_empty(),
        "only 201 and 409 OUT_OF_STOCK: {:?}",
        &other[..other.len().min(5)]
    );
    assert_eq!(created, 1000, "every unit sold, none twice");
    // Every 201 is durable and nothing else is stored: the rows are the clients' 201s, as sets.
    let books = books(&db, &code).await;
    books.assert_matches(&code, &seen(&answers));
    assert_eq!(books.reserved, 1000, "{books:?}");
    // The nodes counted what they answered (the dashboard's outcome rates), exactly.
    let outcome = |o: &'static str| {
        let label = format!("outcome=\"{o}\"");
        let (c, bases) = (&cluster.client, &bases);
        async move { summed(c, bases, "vouchers_reservations_total", &[&label]).await }
    };
    assert_eq!(
        (outcome("created").await, outcome("out_of_stock").await),
        (1000.0, 4000.0)
    );
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn per_customer_limit_and_order_idempotency_hold_across_nodes() {
    let Some((db, redis)) = services("percust").await else {
        return;
    };
    let cluster = Cluster::start(3, &db, &redis, &[]).await;
    let code = code("PERCUST");
    cluster.create(&code, 500, 2).await;
    let c = &cluster.client;
    // One customer, 30 orders spread over three nodes at once.
    let answers = join_all((0..30).map(|i| {
        let base = cluster.base(i % 3);
        let code = code.clone();
        async move { try_reserve(c, &base, &code, 77, &format!("{code}-c77-{i}")).await }
    }))
    .await;
    let won: BTreeSet<String> = answers
        .iter()
        .enumerate()
        .filter(|(_, a)| matches!(a, Some((201, _))))
        .map(|(i, _)| format!("{code}-c77-{i}"))
        .collect();
    let ok = won.len();
    let used = answers
        .iter()
        .filter(|a| matches!(a, Some((409, b)) if b["error"] == "ALREADY_USED"))
        .count();
    assert_eq!((ok, used), (2, 28), "{answers:?}");
    // The same order id sent to three nodes at once, ten times each.
    let answers = join_all((0..30).map(|i| {
        let base = cluster.base(i % 3);
        let code = code.clone();
        async move { try_reserve(c, &base, &code, 78, &format!("{code}-same")).await }
    }))
    .await;
    let first = answers[0].clone().expect("answered");
    assert_eq!(first.0, 201);
    assert!(
        answers.iter().all(|a| a.as_ref() == Some(&first)),
        "the same 201 everywhere: {answers:?}"
    );
    let mut told = won;
    told.insert(format!("{code}-same"));
    let books = books(&db, &code).await;
    books.assert_matches_clients(&code, &told);
    assert_eq!(books.holdings()[&77], 2, "{books:?}");
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn a_killed_node_loses_nothing_and_its_units_are_sold_by_the_others() {
    let Some((db, redis)) = services("kill").await else {
        return;
    };
    // Leases outlive the test (10 minutes): only the dead node's missing heartbeat can bring its
    // units back in time, not the TTL reaper.
    let env = [
        ("VOUCHERS__ENGINE__LEASE_TTL_MS", "600000"),
        ("VOUCHERS__ENGINE__LEASE_SAFETY_MS", "5000"),
        ("VOUCHERS__JOBS__REAPER_INTERVAL_MS", "300"),
    ];
    let mut cluster = Cluster::start(3, &db, &redis, &env).await;
    let code = code("KILL");
    cluster.create(&code, 1000, 1).await;
    let bases = cluster.bases();
    // Warm node 2 with a big lease, then kill it in the middle of its traffic.
    let first = flood(&cluster.client, &bases, &[1, 1, 2], &code, 1..301, 32).await;
    let acked_before: Vec<String> = first
        .iter()
        .filter(|(_, _, a)| matches!(a, Some((201, _))))
        .map(|(_, o, _)| o.clone())
        .collect();
    let acked = Rc::new(Cell::new(0));
    let kill_after = 40;
    let victim_base = bases[2].clone();
    let killer_traffic = {
        let (c, code, acked) = (cluster.client.clone(), code.clone(), acked.clone());
        join_all((301..501).map(move |i| {
            let (c, base, code, acked) =
                (c.clone(), victim_base.clone(), code.clone(), acked.clone());
            async move {
                let order = format!("{code}-o{i}");
                let a = try_reserve(&c, &base, &code, i, &order).await;
                if matches!(a, Some((201, _))) {
                    acked.set(acked.get() + 1);
                }
                (2usize, order, a)
            }
        }))
    };
    let victim = &mut cluster.nodes[2];
    let kill = async {
        eventually("victim acknowledgements", Duration::from_secs(30), || {
            let n = acked.get();
            async move { n >= kill_after }
        })
        .await;
        victim.kill();
    };
    let (during, ()) = tokio::join!(killer_traffic, kill);
    let mut acknowledged = acked_before;
    acknowledged.extend(
        during
            .iter()
            .filter(|(_, _, a)| matches!(a, Some((201, _))))
            .map(|(_, o, _)| o.clone()),
    );
    // The survivors keep selling until the dead node's lease comes back and everything is sold.
    let survivors = vec![bases[0].clone(), bases[1].clone()];
    let mut next = 501;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let wave = flood(
            &cluster.client,
            &survivors,
            &[1, 1],
            &code,
            next..next + 200,
            32,
        )
        .await;
        next += 200;
        acknowledged.extend(
            wave.iter()
                .filter(|(_, _, a)| matches!(a, Some((201, _))))
                .map(|(_, o, _)| o.clone()),
        );
        let v = cluster.admin(0, &code).await;
        if v["reserved"] == json!(1000) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "units of the dead node never came back: {v}"
        );
    }
    // Requests cut off by the kill may have committed without an answer: their clients retry on
    // a survivor and get the original 201 (or 409 if they never won).
    let lost: Vec<(i64, String)> = first
        .iter()
        .chain(during.iter())
        .filter(|(_, _, a)| matches!(a, None | Some((503, _))))
        .map(|(_, o, _)| (crate::helpers::customer_of(o), o.clone()))
        .collect();
    for (customer, order) in &lost {
        match try_reserve(&cluster.client, &bases[0], &code, *customer, order).await {
            Some((201, _)) => acknowledged.push(order.clone()),
            Some((409, b)) => assert_eq!(b["error"], json!("OUT_OF_STOCK")),
            other => panic!("{order}: {other:?}"),
        }
    }
    assert_eq!(acknowledged.len(), 1000, "one 201 per unit");
    // Every client has its answer now: the rows are exactly the 201s, the books hold, nobody
    // holds more than one (the limit), across the kill.
    let books = books(&db, &code).await;
    books.assert_matches_clients(&code, &acknowledged.iter().cloned().collect());
    assert_eq!(
        (books.reserved, books.free, books.leased_unused),
        (1000, 0, 0),
        "{books:?}"
    );
    let pool = cluster.pg().await;
    // The dead node's unused units came back because it stopped beating, long before the
    // leases' TTL. Only when the kill found its leases fully used was there nothing to reap.
    let (reaped, unused_at_death): (i64, i64) = sqlx::query_as(
        "SELECT COUNT(*) FILTER (WHERE state = 'REAPED' AND closed_at < expires_at), \
                COUNT(*) FILTER (WHERE state <> 'RETURNED' AND consumed < granted) \
         FROM leases WHERE voucher_code = $1 AND node_id LIKE 'node-2#%'",
    )
    .bind(&code)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        reaped >= 1 || unused_at_death == 0,
        "the dead node's unused lease was reaped (reaped {reaped}, with unused units {unused_at_death})"
    );
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn a_paused_node_is_fenced_after_its_lease_is_reaped() {
    let Some((db, redis)) = services("pause").await else {
        return;
    };
    let env = [
        ("VOUCHERS__ENGINE__LEASE_TTL_MS", "2000"),
        ("VOUCHERS__ENGINE__LEASE_SAFETY_MS", "500"),
        ("VOUCHERS__JOBS__REAPER_INTERVAL_MS", "200"),
    ];
    let cluster = Cluster::start(3, &db, &redis, &env).await;
    let code = code("STOP");
    cluster.create(&code, 300, 1).await;
    let bases = cluster.bases();
    let warm = flood(&cluster.client, &bases, &[1, 1, 1], &code, 1..61, 16).await;
    assert_eq!(count(&warm, 201), 60);
    let pool = cluster.pg().await;
    let lease_ids: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM leases WHERE voucher_code = $1 AND node_id LIKE 'node-2#%' AND state = 'ACTIVE'",
    )
    .bind(&code)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(!lease_ids.is_empty(), "node 2 holds a lease");
    let pid = cluster.nodes[2].pid();
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    // Requests reach the frozen node and wait in its socket; meanwhile its lease is reaped.
    let frozen = {
        let (c, base, code) = (cluster.client.clone(), bases[2].clone(), code.clone());
        join_all((1000..1010).map(move |i| {
            let (c, base, code) = (c.clone(), base.clone(), code.clone());
            async move {
                (
                    format!("{code}-o{i}"),
                    try_reserve(&c, &base, &code, i, &format!("{code}-o{i}")).await,
                )
            }
        }))
    };
    // What the reaped leases hold, read once they are no longer ACTIVE: (consumed, rows).
    let on_leases = |pool: sqlx::PgPool, ids: Vec<i64>| async move {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT (SELECT COALESCE(SUM(consumed), 0)::BIGINT FROM leases WHERE id = ANY($1)), \
                    (SELECT COUNT(*) FROM reservations WHERE lease_id = ANY($1))",
        )
        .bind(&ids)
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let thaw = async {
        eventually(
            "frozen node's lease reaped",
            Duration::from_secs(30),
            || {
                let (pool, ids) = (pool.clone(), lease_ids.clone());
                async move {
                    let active: i64 = sqlx::query_scalar(
                        "SELECT COUNT(*) FROM leases WHERE id = ANY($1) AND state = 'ACTIVE'",
                    )
                    .bind(&ids)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                    active == 0
                }
            },
        )
        .await;
        // The node is still stopped: nothing of it can have landed since the reap.
        let at_reap = on_leases(pool.clone(), lease_ids.clone()).await;
        // The others keep selling meanwhile.
        let more = flood(&cluster.client, &bases[..2], &[1, 1], &code, 61..121, 16).await;
        unsafe { libc::kill(pid, libc::SIGCONT) };
        (more, at_reap)
    };
    let (frozen_answers, (more, at_reap)) = tokio::join!(frozen, thaw);
    assert_eq!(count(&more, 201), 60);
    let mut told = seen(&warm);
    told.created.extend(created(&more));
    for (order, a) in &frozen_answers {
        // Served from a fresh lease (201) or refused (503); never from the reaped one.
        match a {
            Some((201, _)) => told.created.insert(order.clone()),
            Some((503, _)) => told.unknown.insert(order.clone()),
            other => panic!("{order}: {other:?}"),
        };
    }
    // Decisive: a batch the thawed node formed on its reaped lease and committed after the reap,
    // whatever clock its rows carry, would raise the lease's consumed or add a row to it.
    assert_eq!(
        on_leases(pool.clone(), lease_ids.clone()).await,
        at_reap,
        "nothing was committed against the reaped lease after the reap"
    );
    books(&db, &code).await.assert_matches(&code, &told);
}

/// Issue 12, the decisive fence: node 0 reaches PostgreSQL through a proxy, node 1 directly.
/// Node 0 holds a lease with unused units and a 10-minute TTL. Its link is frozen (nothing
/// forwarded, nothing closed); reserves then reach it and are served from that lease, which it
/// still holds in memory, so their batch is formed and waits on the link. Node 0's beats stop
/// too, so node 1 judges it dead and reaps the lease. Only then does the link thaw and the batch
/// reach the ledger: it must be refused (`fenced`), its customers get 503, and no row lands on
/// the reaped lease. Without the ledger's fence the batch would commit against a lease whose
/// units were already given back (checked: with the fence removed from the SQL, this fails).
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn a_batch_formed_before_its_lease_was_reaped_is_fenced() {
    let Some((db, redis)) = services("fence").await else {
        return;
    };
    let proxy = Proxy::start(&host_port(&db)).await;
    // Node 0's batch may wait on the frozen link far longer than a reserve normally would.
    let patient = [
        ("VOUCHERS__ENGINE__LEASE_TTL_MS", "600000"),
        ("VOUCHERS__ENGINE__LEASE_IDLE_TIMEOUT_MS", "600000"),
        ("VOUCHERS__ENGINE__MIN_BLOCK", "10"),
        ("VOUCHERS__LEDGER__TIMEOUT_MS", "60000"),
        ("VOUCHERS__LEDGER__ACQUIRE_TIMEOUT_MS", "60000"),
        ("VOUCHERS__HTTP__REQUEST_TIMEOUT_MS", "60000"),
    ];
    let cluster = Cluster {
        nodes: vec![
            Cluster::node(0, &via_port(&db, proxy.port), &redis, &patient).await,
            Cluster::node(1, &db, &redis, &[]).await,
        ],
        db_url: db.clone(),
        client: client(),
    };
    let code = code("FENCE");
    cluster.create(&code, 100, 1).await;
    let node0 = cluster.base(0);
    let first = try_reserve(&cluster.client, &node0, &code, 1, &format!("{code}-o1")).await;
    assert!(matches!(first, Some((201, _))), "{first:?}");
    let pool = cluster.pg().await;
    let (lease_id, unused): (i64, i64) = sqlx::query_as(
        "SELECT id, granted - consumed FROM leases \
         WHERE voucher_code = $1 AND node_id = 'node-0#1' AND state = 'ACTIVE'",
    )
    .bind(&code)
    .fetch_one(&pool)
    .await
    .expect("node 0 holds one active lease");
    const N: i64 = 4;
    assert!(unused >= N, "node 0's lease has {unused} unused units");
    let fenced = |c: awc::Client, base: String| async move { fenced(&c, &base).await };
    assert_eq!(fenced(cluster.client.clone(), node0.clone()).await, 0.0);

    proxy.freeze();
    let requests = join_all((2..2 + N).map(|i| {
        let (c, base, code) = (cluster.client.clone(), node0.clone(), code.clone());
        async move {
            let order = format!("{code}-o{i}");
            let a = try_reserve(&c, &base, &code, i, &order).await;
            (order, a)
        }
    }));
    let reap_then_thaw = async {
        eventually(
            "node 1 reaps the lease of node 0, silent behind the frozen link",
            Duration::from_secs(20),
            || {
                let pool = pool.clone();
                async move {
                    let state: String =
                        sqlx::query_scalar("SELECT state FROM leases WHERE id = $1")
                            .bind(lease_id)
                            .fetch_one(&pool)
                            .await
                            .unwrap();
                    state == "REAPED"
                }
            },
        )
        .await;
        // Node 0's customers are still waiting: their batch has not reached the ledger.
        let rows: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM reservations WHERE voucher_code = $1")
                .bind(&code)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(rows, 1, "nothing of node 0's batch is in the ledger yet");
        proxy.thaw();
    };
    let (answers, ()) = tokio::join!(requests, reap_then_thaw);

    // The count is taken right after the batch's answers went out: poll for it.
    eventually(
        "node 0's batch reached the ledger after the reap and was refused",
        Duration::from_secs(10),
        || {
            let f = fenced(cluster.client.clone(), node0.clone());
            async move { f.await >= 1.0 }
        },
    )
    .await;
    let mut created: BTreeSet<String> = [format!("{code}-o1")].into();
    let mut refused = 0;
    for (order, a) in &answers {
        match a {
            Some((201, _)) => {
                created.insert(order.clone());
            }
            Some((503, _)) => refused += 1,
            other => panic!("{order}: {other:?}"),
        }
    }
    assert!(
        refused >= 1,
        "the fenced batch's customers got 503: {answers:?}"
    );
    let on_reaped: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT COUNT(*) FROM reservations WHERE lease_id = $1), \
                (SELECT consumed FROM leases WHERE id = $1)",
    )
    .bind(lease_id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        on_reaped,
        (1, 1),
        "only the first order lives on the reaped lease"
    );
    let books = books(&db, &code).await;
    books.assert_matches_clients(&code, &created);
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn pausing_on_one_node_stops_every_node() {
    let Some((db, redis)) = services("pausev").await else {
        return;
    };
    let cluster = Cluster::start(3, &db, &redis, &[]).await;
    let code = code("PAUSEV");
    cluster.create(&code, 100, 1).await;
    let bases = cluster.bases();
    let warm = flood(&cluster.client, &bases, &[1, 1, 1], &code, 1..31, 8).await;
    assert_eq!(count(&warm, 201), 30);
    let patch = |status: &'static str| {
        let url = format!("{}/admin/vouchers/{code}", bases[0]);
        let c = cluster.client.clone();
        async move {
            send(
                &c,
                "PATCH",
                &url,
                Some(TOKEN),
                Some(&json!({"status": status})),
            )
            .await
            .0
        }
    };
    // The create's own UPDATED signal already reached the nodes: count from here.
    let updated = |base: String| {
        let c = cluster.client.clone();
        async move {
            let m = metrics_text(&c, &base).await;
            crate::helpers::metric_sum(
                &m,
                "vouchers_signals_total",
                &["event=\"received\"", "kind=\"UPDATED\""],
            )
        }
    };
    let mut before = Vec::new();
    for base in &bases {
        before.push(updated(base.clone()).await);
    }
    assert_eq!(patch("PAUSED").await, 200);
    // Right after the edit every node refuses: the ledger enforces the status at commit, and the
    // UPDATED signal refreshes the nodes' copies.
    let answers = flood(&cluster.client, &bases, &[1, 1, 1], &code, 100..130, 8).await;
    for (node, order, a) in &answers {
        let a = a.as_ref().expect("answered");
        assert_eq!(
            (a.0, a.1["reason"].as_str()),
            (422, Some("PAUSED")),
            "node {node} {order}"
        );
    }
    for (n, base) in bases.iter().enumerate().skip(1) {
        eventually("UPDATED signal received", Duration::from_secs(10), || {
            let fut = updated(base.clone());
            let before = before[n];
            async move { fut.await > before }
        })
        .await;
    }
    // DESIGN §4: a retry of a stored order gets its 201 while paused, on any node, not only the
    // one that took it.
    for (node, order, a) in &warm {
        let original = a.clone().expect("answered");
        let customer = crate::helpers::customer_of(order);
        let other = bases[(node + 1) % bases.len()].clone();
        assert_eq!(
            try_reserve(&cluster.client, &other, &code, customer, order).await,
            Some(original),
            "{order} retried on another node while paused"
        );
    }
    assert_eq!(patch("ACTIVE").await, 200);
    for (n, base) in bases.iter().enumerate() {
        let mut i = 200 + 100 * n as i64;
        eventually("resumed on every node", Duration::from_secs(10), || {
            let (c, base, code) = (cluster.client.clone(), base.clone(), code.clone());
            i += 1;
            let order = format!("{code}-r{i}");
            let customer = i;
            async move {
                matches!(
                    try_reserve(&c, &base, &code, customer, &order).await,
                    Some((201, _))
                )
            }
        })
        .await;
    }
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn losing_redis_mid_sale_keeps_selling_correctly() {
    let Some((db, redis)) = services("noredis").await else {
        return;
    };
    let proxy = Proxy::start(&host_port(&redis)).await;
    let redis_via_proxy = via_port(&redis, proxy.port);
    let cluster = Cluster::start(3, &db, &redis_via_proxy, &[]).await;
    let code = code("NOREDIS");
    cluster.create(&code, 600, 1).await;
    let bases = cluster.bases();
    let mut answers = flood(&cluster.client, &bases, &[6, 3, 1], &code, 1..201, 32).await;
    proxy.cut();
    let mut next = 201;
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(&answers, 201) < 600 {
        answers.extend(
            flood(
                &cluster.client,
                &bases,
                &[6, 3, 1],
                &code,
                next..next + 200,
                32,
            )
            .await,
        );
        next += 200;
        assert!(
            Instant::now() < deadline,
            "sale stalled without Redis: {} sold",
            count(&answers, 201)
        );
    }
    assert_eq!(count(&answers, 201), 600);
    assert!(answers
        .iter()
        .all(|(_, _, a)| matches!(a, Some((201, _)) | Some((409, _)))));
    let books = books(&db, &code).await;
    books.assert_matches(&code, &seen(&answers));
    assert_eq!(books.reserved, 600, "{books:?}");
    let text = metrics_text(&cluster.client, &bases[0]).await;
    assert!(
        text.contains("vouchers_redis_up 0"),
        "the outage shows in the metrics"
    );
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn losing_postgres_fails_fast_and_recovers() {
    let Some((db, redis)) = services("nopg").await else {
        return;
    };
    let proxy = Proxy::start(&host_port(&db)).await;
    let db_via_proxy = via_port(&db, proxy.port);
    // The breaker stays open long enough to see that nothing reaches the ledger meanwhile; a
    // call already under way when it opened gives up within the ledger's deadline.
    let env = [
        ("VOUCHERS__LEDGER__BREAKER_OPEN_MS", "15000"),
        ("VOUCHERS__LEDGER__TIMEOUT_MS", "1000"),
    ];
    let cluster = Cluster::start(2, &db_via_proxy, &redis, &env).await;
    let code = code("NOPG");
    cluster.create(&code, 1000, 1).await;
    let bases = cluster.bases();
    let before = flood(&cluster.client, &bases, &[1, 1], &code, 1..41, 8).await;
    assert_eq!(count(&before, 201), 40);
    let mut told = seen(&before);
    let breaker = |c: awc::Client, base: String| async move {
        crate::helpers::metric_sum(
            &metrics_text(&c, &base).await,
            "vouchers_ledger_breaker_state",
            &[],
        )
    };
    for base in &bases {
        assert_eq!(breaker(cluster.client.clone(), base.clone()).await, 0.0);
    }
    proxy.cut();
    let down = flood(&cluster.client, &bases, &[1, 1], &code, 100..140, 8).await;
    let refused = |answers: &[(usize, String, Option<Answer>)]| {
        for (node, order, a) in answers {
            let a = a.as_ref().expect("answered, not hung");
            assert_eq!(
                (a.0, a.1["error"].as_str()),
                (503, Some("UNAVAILABLE")),
                "node {node} {order}: no 201 without a commit"
            );
        }
    };
    refused(&down);
    // Failures in a row open each node's breaker (the heartbeat alone fails every 250 ms).
    for base in &bases {
        eventually("the breaker opens", Duration::from_secs(20), || {
            let (c, base) = (cluster.client.clone(), base.clone());
            async move { breaker(c, base).await == 2.0 }
        })
        .await;
        let (s, b) = send(
            &cluster.client,
            "GET",
            &format!("{base}/health/ready"),
            None,
            None,
        )
        .await;
        assert_eq!(
            (s, b["detail"].as_str()),
            (503, Some("ledger circuit open"))
        );
        let m = metrics_text(&cluster.client, base).await;
        assert!(crate::helpers::metric_sum(&m, "vouchers_ledger_breaker_opened_total", &[]) >= 1.0);
    }
    // While open, reserves are refused without a commit reaching for the ledger (only the
    // heartbeats go out: a node that stopped beating would be taken for dead). A merged commit
    // admitted before it opened may still be finishing (it ends at the ledger's deadline): wait
    // until no node has one out.
    eventually(
        "the commits admitted before the breaker opened ended",
        Duration::from_secs(20),
        || {
            let (c, bases) = (cluster.client.clone(), bases.clone());
            async move { summed(&c, &bases, "vouchers_ledger_commits_in_flight", &[]).await == 0.0 }
        },
    )
    .await;
    let commits = || {
        summed(
            &cluster.client,
            &bases,
            "vouchers_ledger_commits_total",
            &[],
        )
    };
    let tried = commits().await;
    // Refused at the door: no actor takes them, so no batch fails on the breaker either.
    let batch_errors = || {
        summed(
            &cluster.client,
            &bases,
            "vouchers_ledger_errors_total",
            &["op=\"commit_batch\""],
        )
    };
    let failed_batches = batch_errors().await;
    let open = flood(&cluster.client, &bases, &[1, 1], &code, 140..180, 8).await;
    refused(&open);
    assert_eq!(
        commits().await,
        tried,
        "no commit reached for the ledger while the breaker was open"
    );
    assert_eq!(
        batch_errors().await,
        failed_batches,
        "no reserve reached an actor while the breaker was open"
    );
    proxy.restore();
    let mut next = 200;
    let recovered: RefCell<Vec<(usize, String, Option<Answer>)>> = RefCell::default();
    eventually("recovery", Duration::from_secs(60), || {
        let (c, bases, code, recovered) = (
            cluster.client.clone(),
            bases.clone(),
            code.clone(),
            &recovered,
        );
        next += 1;
        let i = next;
        async move {
            let order = format!("{code}-r{i}");
            let a = try_reserve(&c, &bases[(i % 2) as usize], &code, i, &order).await;
            let won = matches!(a, Some((201, _)));
            recovered.borrow_mut().push((0, order, a));
            won
        }
    })
    .await;
    let recovered = recovered.into_inner();
    let after = seen(&recovered);
    told.created.extend(after.created);
    told.unknown.extend(after.unknown);
    for base in &bases {
        eventually("the breaker closes", Duration::from_secs(20), || {
            let (c, base) = (cluster.client.clone(), base.clone());
            async move { breaker(c, base).await == 0.0 }
        })
        .await;
        let (s, _) = send(
            &cluster.client,
            "GET",
            &format!("{base}/health/ready"),
            None,
            None,
        )
        .await;
        assert_eq!(s, 200);
    }
    let books = books(&db, &code).await;
    books.assert_matches(&code, &told);
    assert_eq!(
        books.reserved, 41,
        "40 before the outage, none during, one after: {books:?}"
    );
}

/// A half-open Redis link (the socket stays, nothing flows) is noticed within the keepalive:
/// `vouchers_redis_up` drops to 0, and comes back to 1 once Redis answers again.
#[actix_web::test]
#[cfg_attr(no_test_redis, ignore = "needs TEST_REDIS_URL; .ci/run sets it")]
async fn a_half_open_redis_link_is_noticed_and_recovered() {
    let Some(redis) = redis_url() else {
        return;
    };
    let proxy = Proxy::start(&host_port(&redis)).await;
    let url = format!("redis://127.0.0.1:{}", proxy.port);
    let app = crate::helpers::spawn_app_with(|s| {
        s.redis.url = url;
        s.redis.keepalive_ms = 300;
    })
    .await;
    let redis_up = || {
        let (client, base) = (app.client.clone(), app.base.clone());
        async move {
            let m = metrics_text(&client, &base).await;
            m.lines()
                .any(|l| l.starts_with("vouchers_redis_up"))
                .then(|| crate::helpers::metric_sum(&m, "vouchers_redis_up", &[]))
        }
    };
    eventually("subscribed", Duration::from_secs(10), || {
        let up = redis_up();
        async move { up.await == Some(1.0) }
    })
    .await;
    proxy.freeze();
    eventually("the dead link noticed", Duration::from_secs(10), || {
        let up = redis_up();
        async move { up.await == Some(0.0) }
    })
    .await;
    proxy.thaw();
    eventually("resubscribed", Duration::from_secs(10), || {
        let up = redis_up();
        async move { up.await == Some(1.0) }
    })
    .await;
}

/// A sold-out voucher that is still asked for keeps probing the ledger, but a probe that finds
/// no new winner reloads nothing and announces nothing again; a winner's retry still gets its
/// 201.
#[actix_web::test]
#[cfg_attr(no_test_redis, ignore = "needs TEST_REDIS_URL; .ci/run sets it")]
async fn sold_out_probes_that_find_nothing_new_publish_nothing() {
    let Some(redis) = redis_url() else {
        return;
    };
    let app = crate::helpers::spawn_app_with(|s| s.redis.url = redis).await;
    let probe_ms = crate::helpers::test_settings("sqlite://unused")
        .engine
        .soldout_probe_ms;
    // A code of its own: other runs on the same Redis must not signal this voucher.
    let code = code("PROBE");
    assert_eq!(app.create_voucher(&code, 2, 1).await.0, 201);
    let mut won = Vec::new();
    for c in 1..=3 {
        let (status, body) = app.reserve(&code, c, format!("probe-{c}")).await;
        if status == 201 {
            won.push((c, body));
        }
    }
    assert_eq!(won.len(), 2);
    let metrics = || {
        let (client, base) = (app.client.clone(), app.base.clone());
        async move { metrics_text(&client, &base).await }
    };
    let published = |m: &str| {
        crate::helpers::metric_sum(m, "vouchers_signals_total", &["published", "SOLD_OUT"])
    };
    eventually("sold out and announced", Duration::from_secs(10), || {
        let (m, e, code) = (metrics(), app.engine.clone(), code.clone());
        async move { e.is_sold_out_locally(&code) && published(&m.await) >= 1.0 }
    })
    .await;
    let announced = published(&metrics().await);
    for late in 10..13 {
        let empties =
            |m: &str| crate::helpers::metric_sum(m, "vouchers_lease_events_total", &["\"empty\""]);
        let before = empties(&metrics().await);
        // Late traffic: a voucher nobody asks for is not probed.
        let (status, _) = app.reserve(&code, late, format!("probe-{late}")).await;
        assert_eq!(status, 409);
        app.clock.advance_ms(probe_ms + 1);
        eventually("a sold-out probe", Duration::from_secs(10), || {
            let m = metrics();
            async move { empties(&m.await) > before }
        })
        .await;
    }
    assert_eq!(
        published(&metrics().await),
        announced,
        "probes that found nothing new announced SOLD_OUT again"
    );
    let (c, first) = &won[0];
    assert_eq!(
        app.reserve(&code, *c, format!("probe-{c}")).await,
        (201, first.clone()),
        "a winner's retry still gets its 201"
    );
}

/// A PostgreSQL link that hangs (the socket stays open, nothing flows): reserves turn into 503s
/// at the ledger's deadline instead of hanging, readiness says so, and the node recovers by
/// itself once the link clears, with books that balance.
#[actix_web::test]
#[cfg_attr(no_test_pg, ignore = "needs TEST_DATABASE_URL; .ci/run sets it")]
async fn a_hung_postgres_link_turns_into_503s_and_recovers() {
    let Some(db) = fresh_pg_schema("hung").await else {
        return;
    };
    // The proxy runs on a runtime of its own: building the app blocks this test's thread while
    // it connects through the proxy.
    let proxy_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (handle, target) = (proxy_rt.handle().clone(), host_port(&db));
    let proxy = std::thread::spawn(move || handle.block_on(Proxy::start(&target)))
        .join()
        .expect("proxy started");
    let url = via_port(&db, proxy.port);
    let app = crate::helpers::spawn_app_with(|s| {
        s.ledger.url = url.clone();
        s.ledger.timeout_ms = 500;
        // Far beyond the test client's patience: only the ledger's deadline can answer in time.
        s.http.request_timeout_ms = 600_000;
    })
    .await;
    assert_eq!(app.create_voucher("HUNG", 1000, 1).await.0, 201);
    for c in 1..=5 {
        assert_eq!(app.reserve("HUNG", c, format!("hung-{c}")).await.0, 201);
    }
    proxy.freeze();
    let url = format!("{}/vouchers/HUNG/reservations", app.base);
    let answers = join_all((10..20).map(|c| {
        let (client, url) = (app.client.clone(), url.clone());
        async move {
            let body =
                json!({ "customerId": c, "orderId": format!("hung-{c}"), "orderAmount": 5000 });
            let mut res = client
                .post(url)
                .send_json(&body)
                .await
                .expect("answered, not hung");
            let retry_after = res
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let body: Value = res.json().await.expect("json");
            (res.status().as_u16(), body, retry_after)
        }
    }))
    .await;
    for (status, body, retry_after) in &answers {
        assert_eq!(
            (*status, body["error"].as_str()),
            (503, Some("UNAVAILABLE")),
            "{body}"
        );
        assert!(
            matches!(retry_after, Some(s) if *s >= 1),
            "a ledger-down 503 tells when to retry: {retry_after:?}"
        );
    }
    let (ready, _) = send(
        &app.client,
        "GET",
        &format!("{}/health/ready", app.base),
        None,
        None,
    )
    .await;
    assert_eq!(ready, 503, "not ready while the ledger hangs");
    proxy.thaw();
    let mut next = 100;
    eventually("recovery", Duration::from_secs(30), || {
        next += 1;
        // The app runs on a manual clock (corrected to the ledger's at every beat): let the
        // actor's back-off after the failure pass.
        app.clock.advance_ms(250);
        let (client, base, i) = (app.client.clone(), app.base.clone(), next);
        async move {
            crate::helpers::reserve(&client, &base, "HUNG", i, &format!("hung-{i}"))
                .await
                .0
                == 201
        }
    })
    .await;
    app.balanced_counters("HUNG").await;
    drop(proxy);
    proxy_rt.shutdown_background();
}

/// Every node of a cluster answers a new order `expected` (status, error); each answer is
/// recorded in `told`.
async fn all_answer(
    c: &awc::Client,
    bases: &[String],
    code: &str,
    next: &Cell<i64>,
    told: &RefCell<Seen>,
    expected: (u16, &'static str),
) -> bool {
    let mut all = true;
    for base in bases {
        next.set(next.get() + 1);
        let n = next.get();
        let order = format!("{code}-s{n}");
        let a = try_reserve(c, base, code, n, &order).await;
        match &a {
            Some((201, _)) => told.borrow_mut().created.insert(order),
            None | Some((503, _)) => told.borrow_mut().unknown.insert(order),
            _ => false,
        };
        let got = a
            .as_ref()
            .map(|(s, b)| (*s, b["error"].as_str().unwrap_or("")));
        all &= got == Some(expected);
    }
    all
}

/// The SWITCHES signal, shown by its metric: the nodes' periodic read of the switches from the
/// ledger is an hour apart here, so only the signal can pause nodes 1 and 2 within the test
/// (checked: with the publish removed from `set_switches`, this fails).
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn switches_reach_every_node_by_signal() {
    let Some((db, redis)) = services("swsig").await else {
        return;
    };
    switches_reach_every_node(&db, &redis, false).await;
}

/// The same on a Redis Cluster, where `SWITCHES` (as `UPDATED` and `WARM`) stays on classic
/// pub/sub, which the cluster carries to every primary.
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis_cluster),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_CLUSTER_URL; .ci/run sets them"
)]
async fn switches_reach_every_node_by_signal_on_a_redis_cluster() {
    let Some((db, seeds)) = cluster_services("swshard").await else {
        return;
    };
    switches_reach_every_node(&db, &seeds, true).await;
}

async fn switches_reach_every_node(db: &str, redis: &str, redis_cluster: bool) {
    let mut env = vec![("VOUCHERS__JOBS__SWITCHES_INTERVAL_MS", "3600000")];
    if redis_cluster {
        env.push(("VOUCHERS__REDIS__CLUSTER", "true"));
    }
    let cluster = Cluster::start(3, db, redis, &env).await;
    let code = code("SWSIG");
    cluster.create(&code, 1000, 1).await;
    let bases = cluster.bases();
    let warm = flood(&cluster.client, &bases, &[1, 1, 1], &code, 1..31, 8).await;
    assert_eq!(count(&warm, 201), 30);
    let told = RefCell::new(seen(&warm));
    let received = |base: String| {
        let c = cluster.client.clone();
        async move { signals_received(&c, &base, "SWITCHES").await }
    };
    let mut before = Vec::new();
    for base in &bases {
        before.push(received(base.clone()).await);
    }
    let put = |node: usize, body: Value| {
        let (c, url) = (
            cluster.client.clone(),
            format!("{}/admin/switches", bases[node]),
        );
        async move { send(&c, "PUT", &url, Some(TOKEN), Some(&body)).await.0 }
    };
    let next = Cell::new(1000);
    assert_eq!(put(0, json!({"salesPaused": true})).await, 200);
    for (n, base) in bases.iter().enumerate().skip(1) {
        eventually(
            "the SWITCHES signal received",
            Duration::from_secs(10),
            || {
                let (fut, before) = (received(base.clone()), before[n]);
                async move { fut.await > before }
            },
        )
        .await;
    }
    eventually(
        "every node pauses (signal)",
        Duration::from_secs(10),
        || {
            all_answer(
                &cluster.client,
                &bases,
                &code,
                &next,
                &told,
                (422, "NOT_ELIGIBLE"),
            )
        },
    )
    .await;
    // A retry of a stored order still gets its 201, on any node.
    let (node, order, first) = &warm[0];
    let customer = crate::helpers::customer_of(order);
    let other = &bases[(node + 2) % 3];
    assert_eq!(
        try_reserve(&cluster.client, other, &code, customer, order).await,
        first.clone()
    );
    assert_eq!(put(1, json!({"salesPaused": false})).await, 200);
    eventually("every node sells again", Duration::from_secs(10), || {
        all_answer(&cluster.client, &bases, &code, &next, &told, (201, ""))
    })
    .await;
    books(db, &code).await.assert_matches(&code, &told.borrow());
}

/// Without Redis the ledger carries the switches: every node reads them within its interval.
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn switches_reach_every_node_through_the_ledger_without_redis() {
    let Some((db, redis)) = services("switches").await else {
        return;
    };
    let proxy = Proxy::start(&host_port(&redis)).await;
    let cluster = Cluster::start(3, &db, &via_port(&redis, proxy.port), &[]).await;
    let code = code("SWCL");
    cluster.create(&code, 1000, 1).await;
    let bases = cluster.bases();
    let warm = flood(&cluster.client, &bases, &[1, 1, 1], &code, 1..31, 8).await;
    assert_eq!(count(&warm, 201), 30);
    let told = RefCell::new(seen(&warm));
    let put = |node: usize, body: Value| {
        let (c, url) = (
            cluster.client.clone(),
            format!("{}/admin/switches", bases[node]),
        );
        async move { send(&c, "PUT", &url, Some(TOKEN), Some(&body)).await.0 }
    };
    let next = Cell::new(1000);
    proxy.cut();
    assert_eq!(put(2, json!({"readOnly": true})).await, 200);
    eventually(
        "every node is read-only (ledger)",
        Duration::from_secs(10),
        || {
            all_answer(
                &cluster.client,
                &bases,
                &code,
                &next,
                &told,
                (503, "UNAVAILABLE"),
            )
        },
    )
    .await;
    // Confirm and release keep working on every node.
    for (i, (_, order, _)) in warm.iter().take(6).enumerate() {
        let url = format!("{}/vouchers/{code}/reservations/{order}", bases[i % 3]);
        let (method, url) = if i % 2 == 0 {
            told.borrow_mut().confirmed.insert(order.clone());
            ("POST", format!("{url}/confirm"))
        } else {
            told.borrow_mut().released.insert(order.clone());
            ("DELETE", url)
        };
        assert_eq!(
            send(&cluster.client, method, &url, None, None).await.0,
            200,
            "{method} {url}"
        );
    }
    assert_eq!(put(0, json!({"readOnly": false})).await, 200);
    eventually("every node sells again", Duration::from_secs(10), || {
        all_answer(&cluster.client, &bases, &code, &next, &told, (201, ""))
    })
    .await;
    let books = books(&db, &code).await;
    books.assert_matches(&code, &told.borrow());
    assert_eq!((books.confirmed, books.released), (3, 3), "{books:?}");
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn every_node_is_warm_before_the_start_and_on_a_warm_up() {
    let Some((db, redis)) = services("preheat").await else {
        return;
    };
    let cluster = Cluster::start(
        3,
        &db,
        &redis,
        &[("VOUCHERS__JOBS__PREHEAT_INTERVAL_MS", "200")],
    )
    .await;
    let pg = cluster.pg().await;
    // Whether all three nodes hold an active lease of the voucher.
    let all_warm = |code: String| {
        let pg = pg.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(DISTINCT node_id) FROM leases \
                 WHERE voucher_code = $1 AND state = 'ACTIVE'",
            )
            .bind(code)
            .fetch_one(&pg)
            .await
            .expect("count warm nodes")
                == 3
        }
    };
    // An operator's warm-up on one node reaches the others (WARM signal).
    let warmup = code("WARMUP");
    cluster.create(&warmup, 1000, 1).await;
    assert_eq!(
        crate::helpers::warm(&cluster.client, &cluster.base(0), &warmup).await,
        204
    );
    eventually("every node holds a lease", Duration::from_secs(10), || {
        all_warm(warmup.clone())
    })
    .await;

    // A voucher starting in 10 s: every node warms it by itself before the start.
    let soon = code("SOON");
    let starts = Utc::now() + chrono::Duration::seconds(10);
    let body = json!({"code": soon, "discountAmount": 100, "totalLimit": 1000, "perUserLimit": 1,
                      "startsAt": starts.to_rfc3339(), "endsAt": "2099-01-01T00:00:00Z"});
    let (s, b) = create_voucher(&cluster.client, &cluster.base(1), &body).await;
    assert_eq!(s, 201, "{b}");
    let starts_ms = starts.timestamp_millis();
    // Node 2 learns the new code by signal or by its next read of the codes (404 until then).
    let early = RefCell::new(None);
    eventually("node 2 knows the new code", Duration::from_secs(30), || {
        let (c, base, soon, early) = (
            cluster.client.clone(),
            cluster.base(2),
            soon.clone(),
            &early,
        );
        async move {
            let a = try_reserve(&c, &base, &soon, 1, "early")
                .await
                .expect("answered");
            let known = a.0 != 404;
            *early.borrow_mut() = Some(a);
            known
        }
    })
    .await;
    let (s, b) = early.into_inner().expect("an answer");
    let ledger_now: i64 =
        sqlx::query_scalar("SELECT (extract(epoch from clock_timestamp()) * 1000)::BIGINT")
            .fetch_one(&pg)
            .await
            .unwrap();
    assert!(
        ledger_now < starts_ms,
        "the machine took 10 s to create and ask: nothing can be judged"
    );
    assert_eq!((s, b["reason"].as_str()), (422, Some("NOT_STARTED")));
    eventually("every node warm", Duration::from_secs(60), || {
        all_warm(soon.clone())
    })
    .await;
    // Judged on the ledger's clock, not on how long the test waited: each node's first lease
    // was granted before the start.
    let first_grants: Vec<(String, i64)> = sqlx::query_as(
        "SELECT split_part(node_id, '#', 1), MIN(granted_at) FROM leases \
         WHERE voucher_code = $1 GROUP BY 1",
    )
    .bind(&soon)
    .fetch_all(&pg)
    .await
    .unwrap();
    assert_eq!(first_grants.len(), 3, "{first_grants:?}");
    for (node, granted_at) in &first_grants {
        assert!(
            *granted_at < starts_ms,
            "{node} warmed {} ms after the start",
            granted_at - starts_ms
        );
    }
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn sold_out_and_restock_travel_between_nodes_by_signal() {
    let Some((db, redis)) = services("soldsig").await else {
        return;
    };
    sold_out_and_restock_travel(&db, &redis, None).await;
}

/// The same on a Redis Cluster: `SOLD_OUT` and `RESTOCK` go by sharded pub/sub (`SPUBLISH`),
/// to the nodes subscribed to the voucher's channel (from their actor's second request on), and
/// the subscriptions end with the actors; a voucher asked for once is not subscribed.
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis_cluster),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_CLUSTER_URL; .ci/run sets them"
)]
async fn sold_out_and_restock_travel_by_sharded_pub_sub_on_a_redis_cluster() {
    let Some((db, _)) = cluster_services("soldshard").await else {
        return;
    };
    // A cluster of its own: the SPUBLISH count below is this test's alone.
    let rc = OwnRedisCluster::start().await;
    let seeds = rc.seeds();
    sold_out_and_restock_travel(&db, &seeds, Some(&seeds)).await;
}

/// The seed URLs of the test Redis Cluster (`scripts/redis-cluster.sh url`).
fn redis_cluster_url() -> Option<String> {
    crate::helpers::service_url("TEST_REDIS_CLUSTER_URL")
}

/// One connection to each seed of a Redis Cluster (the test cluster's seeds are its primaries).
async fn primaries(seeds: &str) -> Vec<redis::aio::MultiplexedConnection> {
    let mut out = Vec::new();
    for url in seeds.split_whitespace() {
        let client = redis::Client::open(url).expect("seed url");
        out.push(
            client
                .get_multiplexed_async_connection()
                .await
                .expect("connect to a cluster primary"),
        );
    }
    out
}

/// Nodes subscribed to `code`'s sharded channel, over every primary.
async fn shard_subscribers(seeds: &str, code: &str) -> i64 {
    let mut sum = 0;
    for mut c in primaries(seeds).await {
        let (_, n): (String, i64) = redis::cmd("PUBSUB")
            .arg("SHARDNUMSUB")
            .arg(format!("vouchers:{{{code}}}:signal"))
            .query_async(&mut c)
            .await
            .expect("PUBSUB SHARDNUMSUB");
        sum += n;
    }
    sum
}

/// `SPUBLISH` and `PUBLISH` calls the primaries served so far, summed.
async fn publish_calls(seeds: &str) -> (u64, u64) {
    let (mut sharded, mut classic) = (0, 0);
    for mut c in primaries(seeds).await {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut c)
            .await
            .expect("INFO commandstats");
        let calls = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
                .and_then(|rest| rest.split(',').next())
                .map_or(0, |n| n.parse::<u64>().expect("a call count"))
        };
        sharded += calls("spublish");
        classic += calls("publish");
    }
    (sharded, classic)
}

/// Sells a 4-unit voucher out on node 0 while node 1 holds an actor for it, then releases one:
/// `SOLD_OUT` must raise node 1's flag and `RESTOCK` lower it, by signal alone (probes an hour
/// apart). With `cluster` (the seeds of a Redis Cluster, also in `redis`), the two go by
/// `SPUBLISH` to the voucher's subscribers, and node 1's subscription ends with its actor.
async fn sold_out_and_restock_travel(db: &str, redis: &str, cluster: Option<&str>) {
    // Probes far apart: only the signals can move node 1's flag within the test.
    let mut env = vec![("VOUCHERS__ENGINE__SOLDOUT_PROBE_MS", "3600000")];
    if cluster.is_some() {
        // Actors stop 10 s after their last request: the subscriptions follow them.
        env.extend([
            ("VOUCHERS__REDIS__CLUSTER", "true"),
            ("VOUCHERS__ENGINE__ACTOR_IDLE_STOP_MS", "10000"),
        ]);
    }
    let cluster_seeds = cluster;
    let cluster = Cluster::start(2, db, redis, &env).await;
    let code = code("SOLDSIG");
    let published_before = match cluster_seeds {
        Some(seeds) => Some(publish_calls(seeds).await),
        None => None,
    };
    cluster.create(&code, 4, 1).await;
    let (c, b0, b1) = (cluster.client.clone(), cluster.base(0), cluster.base(1));
    let told = RefCell::new(Seen::default());
    // Records a reserve's answer in `told`; its status.
    let record = |order: String, a: Option<Answer>| {
        let status = a.as_ref().map(|a| a.0);
        match status {
            Some(201) => told.borrow_mut().created.insert(order),
            None | Some(503) => told.borrow_mut().unknown.insert(order),
            _ => false,
        };
        status
    };
    // Node 1 serves the voucher first, twice (its actor exists and, on a Redis Cluster, follows
    // the voucher's channel from its second request on), then node 0 sells the rest.
    for (customer, order) in [(1, "n1-first"), (2, "n1-second")] {
        assert_eq!(
            record(
                order.into(),
                try_reserve(&c, &b1, &code, customer, order).await
            ),
            Some(201)
        );
    }
    if let Some(seeds) = cluster_seeds {
        // Node 1 follows the voucher's channel before node 0 sells it out.
        eventually(
            "node 1 follows the voucher's channel",
            Duration::from_secs(10),
            || async { shard_subscribers(seeds, &code).await == 1 },
        )
        .await;
    }
    let mut sold = 2;
    let mut n = 100;
    while sold < 4 {
        n += 1;
        let order = format!("n0-{n}");
        let a = try_reserve(&c, &b0, &code, n, &order).await;
        match record(order, a) {
            Some(201) => sold += 1,
            Some(409) | Some(503) => {}
            other => panic!("unexpected answer {other:?}"),
        }
        assert!(n < 10_000, "node 0 could not sell the last units");
    }
    let short_circuits = |base: String| {
        let c = c.clone();
        async move {
            let m = metrics_text(&c, &base).await;
            crate::helpers::metric_sum(&m, "vouchers_sold_out_short_circuits_total", &[])
        }
    };
    // SOLD_OUT reaches node 1, which then answers late traffic from its flag.
    eventually("node 1 hears SOLD_OUT", Duration::from_secs(10), || {
        let (c, b1) = (c.clone(), b1.clone());
        async move { signals_received(&c, &b1, "SOLD_OUT").await > 0.0 }
    })
    .await;
    if let Some(seeds) = cluster_seeds {
        // Both nodes have an actor for the voucher now, so both follow its channel.
        eventually(
            "both nodes follow the voucher's channel",
            Duration::from_secs(10),
            || async { shard_subscribers(seeds, &code).await == 2 },
        )
        .await;
    }
    let before = short_circuits(b1.clone()).await;
    eventually(
        "node 1 answers from its sold-out flag",
        Duration::from_secs(10),
        || {
            n += 1;
            let (c, b1, code, sc, record) = (
                c.clone(),
                b1.clone(),
                code.clone(),
                short_circuits(b1.clone()),
                &record,
            );
            async move {
                let order = format!("late-{n}");
                let a = try_reserve(&c, &b1, &code, n, &order).await;
                record(order, a) == Some(409) && sc.await > before
            }
        },
    )
    .await;
    // RESTOCK: a release on node 0 lowers node 1's flag (its own probe is an hour away, so only
    // the signal can); node 1 sells the unit again.
    let url = format!("{b0}/vouchers/{code}/reservations/n1-first");
    assert_eq!(send(&c, "DELETE", &url, None, None).await.0, 200);
    told.borrow_mut().released.insert("n1-first".into());
    eventually(
        "node 1 sells the restocked unit",
        Duration::from_secs(10),
        || {
            n += 1;
            let (c, b1, code, record) = (c.clone(), b1.clone(), code.clone(), &record);
            async move {
                let order = format!("again-{n}");
                let a = try_reserve(&c, &b1, &code, n, &order).await;
                record(order, a) == Some(201)
            }
        },
    )
    .await;
    let books = books(db, &code).await;
    books.assert_matches(&code, &told.borrow());
    assert_eq!((books.reserved, books.released), (4, 1), "{books:?}");
    let (Some(seeds), Some((sharded_before, _))) = (cluster_seeds, published_before) else {
        return;
    };
    // SOLD_OUT and RESTOCK went by SPUBLISH (the classic PUBLISH calls are the keepalive's).
    let (sharded, _) = publish_calls(seeds).await;
    assert!(
        sharded >= sharded_before + 2,
        "SPUBLISH calls {sharded_before} -> {sharded}"
    );
    // A voucher asked for once (a long tail's first reserve) is not followed; one asked twice
    // is. Two such barriers in turn: the first voucher's follow, had it been asked, went out in
    // a batch before the second barrier's.
    let once = format!("{code}-ONCE");
    let barriers = [format!("{code}-B1"), format!("{code}-B2")];
    for v in [&once, &barriers[0], &barriers[1]] {
        cluster.create(v, 10, 1).await;
    }
    let reserve_on_0 = |v: String, customer: i64| {
        let (c, b0) = (c.clone(), b0.clone());
        async move {
            let order = format!("{v}-{customer}");
            let a = try_reserve(&c, &b0, &v, customer, &order).await;
            assert_eq!(a.as_ref().map(|a| a.0), Some(201), "{a:?}");
        }
    };
    reserve_on_0(once.clone(), 1).await;
    for b in &barriers {
        reserve_on_0(b.clone(), 1).await;
        reserve_on_0(b.clone(), 2).await;
        eventually(
            "a voucher asked twice is followed",
            Duration::from_secs(10),
            || async { shard_subscribers(seeds, b).await == 1 },
        )
        .await;
    }
    assert_eq!(shard_subscribers(seeds, &once).await, 0);
    // Once the actors stop, neither node follows the voucher's channel.
    eventually(
        "the subscriptions end with the actors",
        Duration::from_secs(30),
        || async { shard_subscribers(seeds, &code).await == 0 },
    )
    .await;
}

#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn a_dry_node_recalls_the_units_another_node_holds_idle() {
    let Some((db, redis)) = services("recall").await else {
        return;
    };
    // Idle leases are never returned by time here: only a RECALL can free node 1's units.
    let cluster = Cluster::start(
        2,
        &db,
        &redis,
        &[("VOUCHERS__ENGINE__LEASE_IDLE_TIMEOUT_MS", "3600000")],
    )
    .await;
    let code = code("RECALL");
    cluster.create(&code, 40, 1).await;
    let (c, b0, b1) = (cluster.client.clone(), cluster.base(0), cluster.base(1));
    assert_eq!(
        try_reserve(&c, &b1, &code, 1, "held-1").await.map(|a| a.0),
        Some(201)
    );
    let mut told = Seen::created(["held-1".to_string()]);
    let pg = cluster.pg().await;
    let held_by_node1: i64 = sqlx::query_scalar(
        "SELECT COALESCE(SUM(granted - consumed), 0)::BIGINT FROM leases \
         WHERE voucher_code = $1 AND node_id LIKE 'node-1#%' AND state = 'ACTIVE'",
    )
    .bind(&code)
    .fetch_one(&pg)
    .await
    .expect("node 1's idle units");
    assert!(held_by_node1 > 0, "node 1 holds idle units");
    // Node 0 sells everything else, the units node 1 held included.
    let answers = flood(&c, std::slice::from_ref(&b0), &[1], &code, 2..200, 8).await;
    let sold_by_node0 = count(&answers, 201);
    assert_eq!(
        sold_by_node0,
        39,
        "sell-through 100 %: {:?}",
        crate::helpers::tally(
            &answers
                .iter()
                .filter_map(|(_, _, a)| a.clone())
                .collect::<Vec<_>>()
        )
    );
    let m = metrics_text(&c, &b1).await;
    assert!(
        crate::helpers::metric_sum(&m, "vouchers_lease_events_total", &["event=\"recalled\""])
            > 0.0,
        "node 1 gave its units back on a RECALL"
    );
    told.created.extend(created(&answers));
    let books = books(&db, &code).await;
    books.assert_matches(&code, &told);
    assert_eq!(books.reserved, 40, "{books:?}");
}

/// One op of the mixed run: what the client saw.
#[derive(Default)]
struct FeedSeen {
    /// Orders that got `201`.
    reserved: Vec<String>,
    /// Orders whose confirm got `200`.
    confirmed: Vec<String>,
    /// Orders whose release got `200`.
    released: Vec<String>,
    /// Orders whose reserve, confirm or release got no answer or a `503`.
    unknown: Vec<String>,
}

/// A request that may fail in transit (its node was killed): `None` then.
async fn try_send(c: &awc::Client, method: &str, url: &str) -> Option<u16> {
    let req = c.request(method.parse().ok()?, url);
    let res = req.send().await.ok()?;
    Some(res.status().as_u16())
}

/// Issue 11: a mixed run (reserve, then confirm, release, or leave to expire) on two nodes, with
/// one node SIGKILLed and restarted in the middle. Afterwards the feed read from 0 holds, checked
/// against the rows with SQL written here: one RESERVED per reservation row, one later change
/// per settled row and none for the others, numbers 1..=N without a gap, every 201, confirm and
/// release the clients saw; the Redis Stream holds the same events; each voucher's books match
/// what the clients were told (the auditor). `FEED_RUN_WAVES` sets the length of the run in
/// waves of 300 reserves (default 6; the node is killed in the middle one).
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn the_feed_holds_every_change_once_in_order_through_a_sigkill() {
    let Some((db, redis)) = services("feed").await else {
        return;
    };
    let waves: i64 = std::env::var("FEED_RUN_WAVES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    let stream = format!("test:events:{}", vouchers::startup::random_hex(4));
    let env = [
        ("VOUCHERS__ENGINE__RESERVATION_TTL_MS", "1500"),
        ("VOUCHERS__JOBS__EXPIRY_INTERVAL_MS", "200"),
        ("VOUCHERS__ENGINE__LEASE_TTL_MS", "3000"),
        ("VOUCHERS__ENGINE__LEASE_SAFETY_MS", "1000"),
        ("VOUCHERS__JOBS__REAPER_INTERVAL_MS", "300"),
        ("VOUCHERS__REDIS__EVENTS_STREAM", stream.as_str()),
        ("VOUCHERS__REDIS__EVENTS_RELAY_MS", "100"),
    ];
    let mut cluster = Cluster::start(2, &db, &redis, &env).await;
    let codes = [code("FEEDA"), code("FEEDB")];
    for c in &codes {
        cluster.create(c, 1_000_000, 1_000_000).await;
    }
    let c = cluster.client.clone();
    // A reader tails the feed on node 0 (never killed) throughout the run: every page it gets
    // starts right after where it asked and has no gap, so no number is ever visible before a
    // smaller one.
    let stop = Rc::new(Cell::new(false));
    let tail = {
        let (c, url, stop) = (
            c.clone(),
            format!("{}/admin/events", cluster.base(0)),
            stop.clone(),
        );
        actix_rt::spawn(async move {
            let (mut after, mut pages) = (0i64, 0usize);
            while !stop.get() {
                let (s, b) = send(
                    &c,
                    "GET",
                    &format!("{url}?after={after}&limit=1000"),
                    Some(TOKEN),
                    None,
                )
                .await;
                assert_eq!(s, 200, "{b}");
                let seqs: Vec<i64> = b["events"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| e["seq"].as_i64().unwrap())
                    .collect();
                assert_eq!(
                    seqs,
                    (after + 1..after + 1 + seqs.len() as i64).collect::<Vec<_>>()
                );
                if let Some(last) = seqs.last() {
                    after = *last;
                    pages += 1;
                }
            }
            (after, pages)
        })
    };
    let mut seen = FeedSeen::default();
    let mut killed = false;
    let mut next: i64 = 1;
    for wave_no in 0..waves {
        let bases = cluster.bases();
        let from = next;
        next += 300;
        let acked = Rc::new(Cell::new(0usize));
        let wave = futures_util::stream::iter((from..next).map(|i| {
            let (c, bases, code, acked) = (
                c.clone(),
                bases.clone(),
                codes[i as usize % 2].clone(),
                acked.clone(),
            );
            async move {
                let order = format!("{code}-{i}");
                let node = (i as usize / 2) % 2;
                let got = try_reserve(&c, &bases[node], &code, i, &order).await;
                let got = got.map(|a| a.0);
                if got != Some(201) {
                    return (order, got, None);
                }
                acked.set(acked.get() + 1);
                // Settle through the other node half of the time.
                let via = &bases[(i as usize / 4) % 2];
                let url = format!("{via}/vouchers/{code}/reservations/{order}");
                let settled = match i % 10 {
                    0..=3 => Some((
                        "confirm",
                        try_send(&c, "POST", &format!("{url}/confirm")).await,
                    )),
                    4..=6 => Some(("release", try_send(&c, "DELETE", &url).await)),
                    _ => None,
                };
                (order, got, settled)
            }
        }))
        .buffer_unordered(16)
        .collect::<Vec<_>>();
        let answers = if wave_no == waves / 2 {
            // SIGKILL node 1 once this wave has had 100 reserves acknowledged, then restart it.
            let (answers, ()) = tokio::join!(wave, async {
                eventually("the wave is under way", Duration::from_secs(30), || {
                    let n = acked.get();
                    async move { n >= 100 }
                })
                .await;
                cluster.nodes[1].kill();
            });
            killed = true;
            cluster.nodes[1] = Cluster::node(1, &db, &redis, &env).await;
            answers
        } else {
            wave.await
        };
        for (order, got, settled) in answers {
            match got {
                Some(201) => {}
                None | Some(503) => {
                    seen.unknown.push(order);
                    continue;
                }
                _ => continue,
            }
            match settled {
                Some(("confirm", Some(200))) => seen.confirmed.push(order.clone()),
                Some(("release", Some(200))) => seen.released.push(order.clone()),
                Some((_, None | Some(503))) => seen.unknown.push(order.clone()),
                _ => {}
            }
            seen.reserved.push(order);
        }
    }
    assert!(killed, "the run was too short to kill a node in its middle");
    stop.set(true);
    let (tailed, pages) = tail.await.expect("the tailing reader");
    assert!(
        pages > 1 && tailed > 0,
        "the reader saw the feed grow ({pages} pages)"
    );
    let pool = cluster.pg().await;
    // Every unconfirmed reservation expires (TTL 1.5 s, sweep every 200 ms).
    eventually(
        "every unconfirmed reservation expired",
        Duration::from_secs(30),
        || {
            let pool = pool.clone();
            async move {
                let left: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM reservations WHERE status = 'RESERVED'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                left == 0
            }
        },
    )
    .await;
    // The feed, from 0, through the API.
    let mut feed: Vec<Value> = Vec::new();
    loop {
        let after = feed.last().map_or(0, |e| e["seq"].as_i64().unwrap());
        let (s, b) = send(
            &c,
            "GET",
            &format!("{}/admin/events?after={after}&limit=1000", cluster.base(0)),
            Some(TOKEN),
            None,
        )
        .await;
        assert_eq!(s, 200, "{b}");
        let page = b["events"].as_array().unwrap().clone();
        let last = page.last().map_or(after, |e| e["seq"].as_i64().unwrap());
        assert_eq!(b["next"], json!(last));
        if page.is_empty() {
            break;
        }
        feed.extend(page);
    }
    let seqs: Vec<i64> = feed.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=feed.len() as i64).collect::<Vec<_>>(),
        "numbers 1..=N, no gap"
    );
    // The rows, read here.
    let rows: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT order_id, status, customer_id FROM reservations")
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut by_order: std::collections::HashMap<String, Vec<(i64, String)>> = Default::default();
    for e in &feed {
        by_order
            .entry(e["orderId"].as_str().unwrap().to_string())
            .or_default()
            .push((
                e["seq"].as_i64().unwrap(),
                e["type"].as_str().unwrap().to_string(),
            ));
    }
    assert_eq!(
        by_order.len(),
        rows.len(),
        "one order in the feed per reservation row"
    );
    let mut expired = 0;
    for (order, status, _) in &rows {
        let events = by_order
            .get(order)
            .unwrap_or_else(|| panic!("{order} not in the feed"));
        let kinds: Vec<&str> = events.iter().map(|(_, k)| k.as_str()).collect();
        let want: &[&[&str]] = match status.as_str() {
            "CONFIRMED" => &[&["RESERVED", "CONFIRMED"]],
            "RELEASED" => &[&["RESERVED", "RELEASED"], &["RESERVED", "EXPIRED"]],
            other => panic!("{order} still {other}"),
        };
        assert!(
            want.contains(&kinds.as_slice()),
            "{order} ({status}): {kinds:?}"
        );
        expired += usize::from(kinds == ["RESERVED", "EXPIRED"]);
    }
    assert!(expired > 0, "some reservations expired in the run");
    assert!(!seen.confirmed.is_empty() && !seen.released.is_empty());
    // Each voucher's books, by the auditor, against what its clients were told.
    for code in &codes {
        let mine = |orders: &[String]| -> BTreeSet<String> {
            orders
                .iter()
                .filter(|o| o.starts_with(&format!("{code}-")))
                .cloned()
                .collect()
        };
        let told = Seen {
            created: mine(&seen.reserved),
            confirmed: mine(&seen.confirmed),
            released: mine(&seen.released),
            unknown: mine(&seen.unknown),
        };
        books(&db, code).await.assert_matches(code, &told);
    }
    for order in &seen.reserved {
        assert!(
            by_order.contains_key(order),
            "acknowledged {order} missing from the feed"
        );
    }
    for order in &seen.confirmed {
        assert_eq!(by_order[order].last().unwrap().1, "CONFIRMED", "{order}");
    }
    for order in &seen.released {
        let last = by_order[order].last().unwrap().1.as_str();
        assert!(last == "RELEASED" || last == "EXPIRED", "{order}: {last}");
    }
    // The Redis Stream holds the same events (the relay runs every 100 ms; its relayer may have
    // been the killed node, whose claim lapses within a second).
    let client = redis::Client::open(redis.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let total = feed.len();
    eventually("the stream caught up", Duration::from_secs(30), || {
        let mut conn = conn.clone();
        let stream = stream.clone();
        async move {
            let len = crate::helpers::stream_len(&mut conn, &stream).await;
            len >= total
        }
    })
    .await;
    let mut copied: Vec<(String, Vec<(String, String)>)> = Vec::new();
    loop {
        let start = copied
            .last()
            .map_or("-".to_string(), |(id, _)| format!("({id}"));
        let page: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(&stream)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        if page.is_empty() {
            break;
        }
        copied.extend(page);
    }
    // The relay stops first, or it would take the stream again.
    drop(cluster);
    crate::helpers::delete_stream(&mut conn, &stream).await;
    assert_eq!(copied.len(), total, "the stream holds each event once");
    for ((id, fields), e) in copied.iter().zip(&feed) {
        assert_eq!(id, &format!("{}-0", e["seq"]));
        let f: std::collections::HashMap<&str, &str> = fields
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(f["type"], e["type"].as_str().unwrap());
        assert_eq!(f["orderId"], e["orderId"].as_str().unwrap());
        assert_eq!(f["code"], e["code"].as_str().unwrap());
        assert_eq!(f["customerId"], e["customerId"].to_string());
        assert_eq!(f["at"], e["at"].as_str().unwrap());
    }
}

/// Issue 9: a rolling restart starts the new process under the same `node.id` before the old one
/// stops. Each is its own incarnation (`node-0#1`, `node-0#2`): the new one's start leaves the
/// old one's lease alone, the old one's graceful stop returns only its own leases, and no batch
/// of either is fenced by the other. Every reserve gets its 201.
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn a_rolling_restart_under_one_node_id_fences_nobody() {
    let Some((db, redis)) = services("rolling").await else {
        return;
    };
    // Idle leases stay, and a slow beat on this busy machine is not death: what the processes
    // hold changes only by what this test does.
    let env = [
        ("VOUCHERS__ENGINE__LEASE_IDLE_TIMEOUT_MS", "600000"),
        ("VOUCHERS__NODE__DEAD_AFTER_MS", "15000"),
    ];
    let mut cluster = Cluster::start(1, &db, &redis, &env).await;
    let code = code("ROLL");
    cluster.create(&code, 1000, 1).await;
    let old = cluster.base(0);
    let first = flood(
        &cluster.client,
        std::slice::from_ref(&old),
        &[1],
        &code,
        1..101,
        16,
    )
    .await;
    assert_eq!(count(&first, 201), 100);
    let pool = cluster.pg().await;
    let holders = |pool: sqlx::PgPool, code: String| async move {
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT node_id, state FROM leases WHERE voucher_code = $1 ORDER BY id")
                .bind(&code)
                .fetch_all(&pool)
                .await
                .unwrap();
        rows
    };
    let before = holders(pool.clone(), code.clone()).await;
    assert!(
        before.iter().any(|(h, s)| h == "node-0#1" && s == "ACTIVE"),
        "the old process holds a lease: {before:?}"
    );
    // The new process, same node.id, while the old one still serves.
    cluster
        .nodes
        .push(Cluster::node(0, &db, &redis, &env).await);
    let new = cluster.base(1);
    let after_start = holders(pool.clone(), code.clone()).await;
    assert_eq!(
        after_start, before,
        "the new process's start touched no lease of the old one"
    );
    let both = flood(
        &cluster.client,
        &[old.clone(), new.clone()],
        &[1, 1],
        &code,
        101..301,
        16,
    )
    .await;
    assert_eq!(count(&both, 201), 200, "both processes sell side by side");
    // The old process stops gracefully while the new one sells on.
    cluster.nodes[0].stop();
    let last = flood(
        &cluster.client,
        std::slice::from_ref(&new),
        &[1],
        &code,
        301..401,
        16,
    )
    .await;
    assert_eq!(count(&last, 201), 100, "the new process sells on");
    let leases = holders(pool.clone(), code.clone()).await;
    assert!(
        leases
            .iter()
            .all(|(h, s)| (h == "node-0#1" && s == "RETURNED") || h == "node-0#2"),
        "the old process returned its own leases, nobody reaped or returned another's: {leases:?}"
    );
    assert!(
        leases.iter().any(|(h, s)| h == "node-0#2" && s == "ACTIVE"),
        "the new process still holds its lease: {leases:?}"
    );
    assert_eq!(
        fenced(&cluster.client, &new).await,
        0.0,
        "no batch of the new process was fenced"
    );
    let mut told = created(&first);
    told.extend(created(&both));
    told.extend(created(&last));
    let books = books(&db, &code).await;
    books.assert_matches_clients(&code, &told);
    assert_eq!(books.reserved, 400, "{books:?}");
}

/// Issue 9: every node of a three-node cluster is restarted in turn while clients flood the sale:
/// the new process (same `node.id`, a new incarnation) starts first and joins the rotation, then
/// the old one leaves the rotation and stops gracefully. A client whose request failed in transit
/// or got 503 retries on another node with the same order id, as a checkout would. Afterwards:
/// every 201 a client saw is in the ledger and nothing else is, every unit is sold, the books
/// hold (the independent auditor), and no process ever had a batch fenced.
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn restarting_every_node_in_turn_during_a_flood_loses_and_fences_nothing() {
    use std::cell::RefCell;
    use std::collections::BTreeSet;
    let Some((db, redis)) = services("rollall").await else {
        return;
    };
    // Three nodes, PostgreSQL, the flood and the rest of the suite share two cores: a live node
    // may miss beats for longer than the default 1.5 s, and would rightly be reaped. This test
    // is about restarts, so a slow beat must not count as death here.
    let env = [("VOUCHERS__NODE__DEAD_AFTER_MS", "15000")];
    let mut cluster = Cluster::start(3, &db, &redis, &env).await;
    let code = code("ROLLALL");
    const TOTAL: i64 = 3000;
    cluster.create(&code, TOTAL, 1).await;
    let client = cluster.client.clone();
    // The nodes taking traffic, by node id.
    let live: Rc<RefCell<Vec<(usize, String)>>> = Rc::new(RefCell::new(
        cluster.bases().into_iter().enumerate().collect(),
    ));
    let restarted = Rc::new(Cell::new(false));
    let fenced = |c: awc::Client, base: String| async move { fenced(&c, &base).await };
    let pool = cluster.pg().await;
    let traffic = {
        let (client, code, live, restarted, pool) = (
            client.clone(),
            code.clone(),
            live.clone(),
            restarted.clone(),
            pool.clone(),
        );
        async move {
            let mut created = BTreeSet::new();
            let mut next = 1i64;
            let started = Instant::now();
            loop {
                assert!(
                    started.elapsed() < Duration::from_secs(180),
                    "the sale never ended ({} created)",
                    created.len()
                );
                let wave = join_all((next..next + 16).map(|customer| {
                    let (client, code, live) = (client.clone(), code.clone(), live.clone());
                    async move {
                        let order = format!("{code}-o{customer}");
                        for attempt in 0..20usize {
                            let base = {
                                let l = live.borrow();
                                l[(customer as usize + attempt) % l.len()].1.clone()
                            };
                            match try_reserve(&client, &base, &code, customer, &order).await {
                                Some((201, _)) => return (order, 201),
                                Some((409, _)) => return (order, 409),
                                // In transit or 503: the same order on another node.
                                _ => continue,
                            }
                        }
                        panic!("{order}: no answer in 20 tries");
                    }
                }))
                .await;
                next += 16;
                created.extend(wave.into_iter().filter(|(_, s)| *s == 201).map(|(o, _)| o));
                if restarted.get() {
                    // Done when the ledger holds every unit as a reservation (units may still
                    // sit in a lease when a wave meets 409s).
                    let sold: i64 = sqlx::query_scalar(
                        "SELECT COALESCE(SUM(consumed), 0)::BIGINT FROM leases \
                         WHERE voucher_code = $1",
                    )
                    .bind(&code)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                    if sold >= TOTAL {
                        return created;
                    }
                }
                // Paced, so the sale outlasts the three restarts.
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
        }
    };
    let restarts = {
        let (client, live, restarted) = (client.clone(), live.clone(), restarted.clone());
        let (db, redis) = (db.clone(), redis.clone());
        let cluster = &mut cluster;
        async move {
            for i in 0..3 {
                let fresh = Cluster::node(i, &db, &redis, &env).await;
                live.borrow_mut().push((i, fresh.base.clone()));
                let old = std::mem::replace(&mut cluster.nodes[i], fresh);
                live.borrow_mut()
                    .retain(|(id, base)| *id != i || *base != old.base);
                assert_eq!(
                    fenced(client.clone(), old.base.clone()).await,
                    0.0,
                    "node {i}'s old process had a batch fenced"
                );
                let mut old = old;
                old.stop();
            }
            restarted.set(true);
        }
    };
    let (created, ()) = tokio::join!(traffic, restarts);
    let survivors: Vec<String> = live.borrow().iter().map(|(_, b)| b.clone()).collect();
    for base in survivors {
        assert_eq!(fenced(client.clone(), base.clone()).await, 0.0, "{base}");
    }
    assert_eq!(created.len() as i64, TOTAL, "every unit sold, one 201 each");
    let books = books(&db, &code).await;
    books.assert_matches_clients(&code, &created);
    assert_eq!(books.reserved, TOTAL, "{books:?}");
    // A process that kept running never had units reaped from under it. (A used-up lease is
    // reaped at its TTL with nothing in it, and a stopping process's straggler grant is reaped
    // once it is retired: both are expected.)
    let reaped: Vec<String> = sqlx::query_scalar(
        "SELECT node_id FROM leases WHERE voucher_code = $1 AND state = 'REAPED' \
         AND consumed < granted AND node_id LIKE '%#2'",
    )
    .bind(&code)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        reaped.is_empty(),
        "no lease of a running process was reaped: {reaped:?}"
    );
    let holders: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT node_id FROM leases WHERE voucher_code = $1 ORDER BY node_id",
    )
    .bind(&code)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        holders.iter().any(|h| h.ends_with("#2")),
        "second incarnations held leases: {holders:?}"
    );
}

/// Issue 9: lease expiry is judged on the ledger's clock. Node 1's system clock runs 30 s ahead
/// while leases live 10 s: judged on its own clock, its reaper (every 200 ms) would reap node
/// 0's live lease at once, and it would stamp its rows 30 s in the future. Its clock follows the
/// ledger's from its registration on: its rows carry the ledger's time, node 0 sells on from its
/// lease, and no lease is reaped or fenced.
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn a_node_whose_clock_runs_ahead_follows_the_ledger_and_reaps_no_live_lease() {
    let Some((db, redis)) = services("skew").await else {
        return;
    };
    // A slow beat on this busy machine is not death here: only the TTL reaper is on trial.
    let env = [
        ("VOUCHERS__ENGINE__LEASE_TTL_MS", "10000"),
        ("VOUCHERS__ENGINE__LEASE_IDLE_TIMEOUT_MS", "600000"),
        ("VOUCHERS__JOBS__REAPER_INTERVAL_MS", "200"),
        ("VOUCHERS__NODE__DEAD_AFTER_MS", "15000"),
    ];
    let mut cluster = Cluster::start(1, &db, &redis, &env).await;
    let mut skewed = env.to_vec();
    skewed.push(("VOUCHERS__NODE__CLOCK_SKEW_MS", "30000"));
    cluster
        .nodes
        .push(Cluster::node(1, &db, &redis, &skewed).await);
    let code = code("SKEW");
    cluster.create(&code, 1000, 1).await;
    let bases = cluster.bases();
    let pool = cluster.pg().await;
    let ledger_now = || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT (extract(epoch from clock_timestamp()) * 1000)::BIGINT",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let before = ledger_now().await;
    let first = flood(&cluster.client, &bases, &[1, 1], &code, 1..101, 8).await;
    assert_eq!(count(&first, 201), 100);
    let after = ledger_now().await;
    // Node 1's rows carry times between the ledger's clock read before the flood and after it
    // (its own clock runs 30 s ahead). A node's copy of the ledger's clock is off by up to a
    // beat's round trip: a second either way is allowed, far from the 30 s a skewed clock
    // would show. (No limit on how long anything takes.)
    const FOLLOWING_ERROR_MS: i64 = 1000;
    let (before, after) = (before - FOLLOWING_ERROR_MS, after + FOLLOWING_ERROR_MS);
    let (rows, earliest, latest): (i64, Option<i64>, Option<i64>) = sqlx::query_as(
        "SELECT COUNT(*), MIN(r.created_at), MAX(r.created_at) \
         FROM reservations r JOIN leases l ON r.lease_id = l.id \
         WHERE r.voucher_code = $1 AND l.node_id LIKE 'node-1#%'",
    )
    .bind(&code)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(rows > 0, "node 1 sold");
    assert!(
        earliest >= Some(before) && latest <= Some(after),
        "node 1 stamps its rows on the ledger's clock ({earliest:?}..{latest:?} outside \
         {before}..{after})"
    );
    // Node 0 keeps selling from the lease it took; node 1's reaper has run many times by now.
    let more = flood(&cluster.client, &bases[..1], &[1], &code, 101..201, 8).await;
    assert_eq!(count(&more, 201), 100);
    let reaped: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM leases WHERE voucher_code = $1 AND state = 'REAPED'",
    )
    .bind(&code)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(reaped, 0, "no live lease was reaped");
    for base in &bases {
        assert_eq!(
            fenced(&cluster.client, base).await,
            0.0,
            "{base}: no batch fenced"
        );
    }
    let mut told = created(&first);
    told.extend(created(&more));
    let books = books(&db, &code).await;
    books.assert_matches_clients(&code, &told);
    assert_eq!(books.reserved, 200, "{books:?}");
}

/// Issue 33: the books under churn on three nodes. A voucher small enough to sell out (30
/// units, two per customer, 40 customers), reserves, confirms, releases and expiries (TTL 1.5 s)
/// from every node at once, node 2 SIGKILLed in the middle and restarted. Afterwards, once every
/// unconfirmed reservation has expired, the independent auditor: the books balance, nothing is
/// oversold, every 201 / confirm / release a client was told is in the rows and nothing else is,
/// no customer holds more than the limit (counted from the rows), every expiry restocked its
/// unit once (a second restock would leave `free` one too high against the equation).
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_URL; .ci/run sets them"
)]
async fn churn_on_three_nodes_through_a_sigkill_ends_on_balanced_books() {
    use crate::audit::Seen;
    let Some((db, redis)) = services("churn").await else {
        return;
    };
    let env = [
        ("VOUCHERS__ENGINE__RESERVATION_TTL_MS", "1500"),
        ("VOUCHERS__JOBS__EXPIRY_INTERVAL_MS", "200"),
        ("VOUCHERS__ENGINE__LEASE_TTL_MS", "3000"),
        ("VOUCHERS__ENGINE__LEASE_SAFETY_MS", "1000"),
        ("VOUCHERS__JOBS__REAPER_INTERVAL_MS", "300"),
    ];
    let mut cluster = Cluster::start(3, &db, &redis, &env).await;
    let code = code("CHURN");
    const CUSTOMERS: i64 = 40;
    cluster.create(&code, 30, 2).await;
    let c = cluster.client.clone();
    const WAVES: i64 = 10;
    const PER_WAVE: i64 = 60;
    let mut seen = Seen::default();
    let mut tally: std::collections::BTreeMap<String, usize> = Default::default();
    let pool = cluster.pg().await;
    // (rows expired so far, rows still RESERVED)
    let expired_count = |pool: &sqlx::PgPool, code: &str| {
        let (pool, code) = (pool.clone(), code.to_string());
        async move {
            sqlx::query_as::<_, (i64, i64)>(
                "SELECT count(*) FILTER (WHERE expired), \
                        count(*) FILTER (WHERE status = 'RESERVED') \
                 FROM reservations WHERE voucher_code = $1",
            )
            .bind(&code)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let mut expired_so_far = 0;
    for wave in 0..WAVES {
        let bases = cluster.bases();
        // In the middle wave, op 20 SIGKILLs node 2 before it sends: 15 others are in flight.
        let victim = (wave == WAVES / 2).then(|| cluster.nodes[2].pid());
        let ops = futures_util::stream::iter((wave * PER_WAVE..(wave + 1) * PER_WAVE).map(|i| {
            let (c, bases, code) = (c.clone(), bases.clone(), code.clone());
            async move {
                if let (Some(pid), 20) = (victim, i % PER_WAVE) {
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                let order = format!("{code}-{i}");
                let customer = 1 + (i * 7) % CUSTOMERS;
                let got = try_reserve(&c, &bases[i as usize % 3], &code, customer, &order).await;
                if !matches!(got, Some((201, _))) {
                    return (order, got, None);
                }
                // Settled through another node than the one that took it.
                let url = format!(
                    "{}/vouchers/{code}/reservations/{order}",
                    bases[(i as usize + 1) % 3]
                );
                // Few confirms, so that the units confirmed never use the voucher up: it sells
                // out again and again while reservations are out, and expiries restock it.
                let settled = match ((i * 2_654_435_761) >> 7) % 20 {
                    0 => Some((
                        "confirm",
                        try_send(&c, "POST", &format!("{url}/confirm")).await,
                    )),
                    1..=6 => Some(("release", try_send(&c, "DELETE", &url).await)),
                    _ => None,
                };
                (order, got, settled)
            }
        }))
        .buffer_unordered(16)
        .collect::<Vec<_>>();
        let answers = ops.await;
        if victim.is_some() {
            cluster.nodes[2].kill();
            cluster.nodes[2] = Cluster::node(2, &db, &redis, &env).await;
        }
        // The next wave starts once the sweep has expired something more (or nothing is left
        // to expire), so that waves and expiries interleave over the run: an event, not a
        // pause of a chosen length.
        let expired_before = expired_so_far;
        eventually(
            "an expiry since the last wave",
            Duration::from_secs(30),
            || {
                let (pool, code) = (pool.clone(), code.clone());
                async move {
                    let (expired, left) = expired_count(&pool, &code).await;
                    expired > expired_before || left == 0
                }
            },
        )
        .await;
        expired_so_far = expired_count(&pool, &code).await.0;
        for (order, got, settled) in answers {
            let key = match &got {
                Some((s, b)) => format!("{s} {}", b["error"].as_str().unwrap_or("")),
                None => "lost".into(),
            };
            *tally.entry(key).or_insert(0) += 1;
            match got {
                Some((201, _)) => {
                    seen.created.insert(order.clone());
                }
                Some((409, _)) => {}
                None | Some((503, _)) => {
                    seen.unknown.insert(order.clone());
                }
                other => panic!("{order}: {other:?}"),
            }
            match settled {
                Some(("confirm", Some(200))) => {
                    seen.confirmed.insert(order);
                }
                Some(("release", Some(200))) => {
                    seen.released.insert(order);
                }
                // Refused (it expired first, 409) changes nothing; no answer or 503: either.
                Some((_, None | Some(503))) => {
                    seen.unknown.insert(order);
                }
                _ => {}
            }
        }
    }
    for kind in ["201 ", "409 OUT_OF_STOCK", "409 ALREADY_USED", "lost"] {
        assert!(
            tally.contains_key(kind),
            "the run met no `{kind}`: {tally:?}"
        );
    }
    eventually(
        "every unconfirmed reservation expired",
        Duration::from_secs(60),
        || {
            let (pool, code) = (pool.clone(), code.clone());
            async move {
                let left: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM reservations WHERE voucher_code = $1 \
                     AND status = 'RESERVED'",
                )
                .bind(&code)
                .fetch_one(&pool)
                .await
                .unwrap();
                left == 0
            }
        },
    )
    .await;
    let books = books(&db, &code).await;
    books.assert_matches(&code, &seen);
    // The limit held at every moment of the run, not only at its end (when only confirmed
    // rows are left): judged from the rows' own times.
    books.assert_limit_held_throughout(&code, 100);
    let expired = books.rows.values().filter(|r| r.expired).count();
    assert!(expired > 0, "some reservations expired: {tally:?}");
    assert!(
        !seen.confirmed.is_empty() && !seen.released.is_empty(),
        "{tally:?}"
    );
    // With nothing reserved left, every unit not confirmed is back: free or in a lease.
    assert_eq!(
        books.free + books.leased_unused + books.confirmed,
        books.total,
        "{books:?}"
    );
}

/// A Redis Cluster of a test's own: three primaries on free ports (each with its bus port,
/// +10000, free too), for a test that stops one of them under the node's feet.
struct OwnRedisCluster {
    dir: std::path::PathBuf,
    ports: Vec<u16>,
    servers: Vec<Option<std::process::Child>>,
}

impl OwnRedisCluster {
    async fn start() -> OwnRedisCluster {
        let dir = crate::helpers::temp_dir("rcluster");
        // Below the ephemeral range (32768 on), bus ports (+10000) included, so that no
        // outgoing connection takes one between the check and redis-server's bind; each
        // cluster of this process a block of its own.
        static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
        let block = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let first = 12_000 + ((std::process::id() as u16 % 50) * 4 + block % 4) * 20;
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        let ports: Vec<u16> = (first..first + 20)
            .filter(|p| free(*p) && free(p + 10_000))
            .take(3)
            .collect();
        assert_eq!(
            ports.len(),
            3,
            "no three free ports in {first}..{}",
            first + 20
        );
        let mut own = OwnRedisCluster {
            dir,
            ports,
            servers: Vec::new(),
        };
        for i in 0..3 {
            let child = own.spawn(i);
            own.servers.push(Some(child));
        }
        for i in 0..3 {
            let url = own.url(i);
            eventually("a cluster server answers", Duration::from_secs(10), || {
                let url = url.clone();
                async move { ping(&url).await }
            })
            .await;
        }
        let hosts: Vec<String> = own.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let made = std::process::Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&hosts)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run redis-cli --cluster create");
        assert!(made.success(), "redis-cli --cluster create failed");
        own.wait_ok().await;
        own
    }

    fn url(&self, i: usize) -> String {
        format!("redis://127.0.0.1:{}", self.ports[i])
    }

    fn seeds(&self) -> String {
        (0..3).map(|i| self.url(i)).collect::<Vec<_>>().join(" ")
    }

    /// Starts server `i` (again: its `nodes.conf` keeps its place in the cluster).
    fn spawn(&self, i: usize) -> std::process::Child {
        let dir = self.dir.join(self.ports[i].to_string());
        std::fs::create_dir_all(&dir).expect("a server's directory");
        let mut cmd = std::process::Command::new("redis-server");
        cmd.args(["--port", &self.ports[i].to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(&dir)
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args([
                "--cluster-node-timeout",
                "2000",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null());
        // SAFETY: prctl(PR_SET_PDEATHSIG) takes integers and touches only the child: a test
        // run killed outright leaves no server behind.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        cmd.spawn()
            .expect("start redis-server (apt-get install redis-server)")
    }

    /// SIGKILL of server `i`.
    fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.servers[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    async fn restart(&mut self, i: usize) {
        let child = self.spawn(i);
        self.servers[i] = Some(child);
        self.wait_ok().await;
    }

    /// Every server says `cluster_state:ok`.
    async fn wait_ok(&self) {
        for i in 0..3 {
            let url = self.url(i);
            eventually("cluster_state:ok", Duration::from_secs(20), || {
                let url = url.clone();
                async move {
                    let Ok(client) = redis::Client::open(url.as_str()) else {
                        return false;
                    };
                    let Ok(mut c) = client.get_multiplexed_async_connection().await else {
                        return false;
                    };
                    let info: redis::RedisResult<String> =
                        redis::cmd("CLUSTER").arg("INFO").query_async(&mut c).await;
                    info.is_ok_and(|i| i.contains("cluster_state:ok"))
                }
            })
            .await;
        }
    }
}

impl Drop for OwnRedisCluster {
    fn drop(&mut self) {
        for i in 0..self.servers.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn ping(url: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    let Ok(mut c) = client.get_multiplexed_async_connection().await else {
        return false;
    };
    let pong: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut c).await;
    pong.is_ok()
}

/// A Redis Cluster primary killed: each node's signals link goes down (`vouchers_redis_up` 0:
/// that primary's vouchers' signals would be lost, so the node re-learns from the ledger) and
/// stays down while the primary is gone, however the rest of the cluster answers; once it is
/// back, each node subscribes again to the channels of the vouchers it has actors for, and a
/// voucher's own signal (`SOLD_OUT`, by `SPUBLISH`) reaches them again.
#[actix_web::test]
#[cfg_attr(
    any(no_test_pg, no_test_redis_cluster),
    ignore = "needs TEST_DATABASE_URL and TEST_REDIS_CLUSTER_URL (redis-server); .ci/run sets them"
)]
async fn a_redis_cluster_primary_lost_takes_the_signals_link_down_until_it_returns() {
    let Some((db, _)) = cluster_services("rclost").await else {
        return;
    };
    let mut rc = OwnRedisCluster::start().await;
    let seeds = rc.seeds();
    let env = [
        ("VOUCHERS__REDIS__CLUSTER", "true"),
        ("VOUCHERS__REDIS__KEEPALIVE_MS", "600"),
        // Only the signal can raise node 1's flag within the test.
        ("VOUCHERS__ENGINE__SOLDOUT_PROBE_MS", "3600000"),
    ];
    let cluster = Cluster::start(2, &db, &seeds, &env).await;
    let (c, b0, b1) = (cluster.client.clone(), cluster.base(0), cluster.base(1));
    let code = code("RCLOST");
    cluster.create(&code, 4, 1).await;
    let redis_up = |base: String| {
        let c = c.clone();
        async move {
            let m = metrics_text(&c, &base).await;
            m.lines()
                .any(|l| l.starts_with("vouchers_redis_up"))
                .then(|| crate::helpers::metric_sum(&m, "vouchers_redis_up", &[]))
        }
    };
    for base in [&b0, &b1] {
        eventually("subscribed", Duration::from_secs(10), || {
            redis_up(base.clone()).map(|up| up == Some(1.0))
        })
        .await;
    }
    // Node 1 has an actor for the voucher, asked twice, and follows its channel.
    for customer in [1, 2] {
        let order = format!("rclost-{customer}");
        let a = try_reserve(&c, &b1, &code, customer, &order).await;
        assert_eq!(a.as_ref().map(|a| a.0), Some(201), "{a:?}");
    }
    // And a second voucher (its channel most likely in another slot).
    let code2 = format!("{code}-2");
    cluster.create(&code2, 4, 1).await;
    for customer in [1, 2] {
        let order = format!("rclost2-{customer}");
        let a = try_reserve(&c, &b1, &code2, customer, &order).await;
        assert_eq!(a.as_ref().map(|a| a.0), Some(201), "{a:?}");
    }
    for v in [&code, &code2] {
        eventually(
            "node 1 follows the voucher",
            Duration::from_secs(10),
            || shard_subscribers(&seeds, v).map(|n| n == 1),
        )
        .await;
    }
    // Redis closes the connections that hold the subscriptions: the client library would
    // reconnect and resubscribe both channels in one command, which a cluster refuses across
    // slots; the node notices and subscribes them again.
    for mut p in primaries(&seeds).await {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut p)
            .await
            .unwrap();
        for line in list.lines().filter(|l| !l.contains(" ssub=0 ")) {
            if let Some(id) = line.strip_prefix("id=").and_then(|r| r.split(' ').next()) {
                let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("ID")
                    .arg(id)
                    .query_async(&mut p)
                    .await;
            }
        }
    }
    for v in [&code, &code2] {
        eventually(
            "subscribed again after the kill",
            Duration::from_secs(20),
            || shard_subscribers(&seeds, v).map(|n| n == 1),
        )
        .await;
    }
    rc.kill(1);
    eventually("the lost primary noticed", Duration::from_secs(10), || {
        redis_up(b1.clone()).map(|up| up == Some(0.0))
    })
    .await;
    // Still down a few keepalives later: the rest of the cluster answering is not enough.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(redis_up(b1.clone()).await, Some(0.0));
    }
    rc.restart(1).await;
    for base in [&b0, &b1] {
        eventually("subscribed again", Duration::from_secs(20), || {
            redis_up(base.clone()).map(|up| up == Some(1.0))
        })
        .await;
    }
    // Whichever primary owns the voucher's slot, node 1 follows its channel again.
    eventually(
        "node 1 follows the voucher again",
        Duration::from_secs(10),
        || shard_subscribers(&seeds, &code).map(|n| n >= 1),
    )
    .await;
    let (spublished, _) = publish_calls(&seeds).await;
    // Node 0 sells the rest: its SOLD_OUT reaches node 1 by sharded pub/sub.
    let mut n = 100;
    let mut sold = 2;
    while sold < 4 {
        n += 1;
        let order = format!("rclost-{n}");
        match try_reserve(&c, &b0, &code, n, &order).await.map(|a| a.0) {
            Some(201) => sold += 1,
            Some(409) | Some(503) | None => {}
            other => panic!("unexpected answer {other:?}"),
        }
        assert!(n < 10_000, "node 0 could not sell the last units");
    }
    eventually("node 1 hears SOLD_OUT", Duration::from_secs(10), || {
        let (c, b1) = (c.clone(), b1.clone());
        async move { signals_received(&c, &b1, "SOLD_OUT").await > 0.0 }
    })
    .await;
    assert!(
        publish_calls(&seeds).await.0 > spublished,
        "SOLD_OUT went by SPUBLISH"
    );
}

//! The ledger in shards, through the HTTP contract: vouchers spread over three PostgreSQL
//! ledgers (three schemas), an order id used on one shard's voucher refused on another's, the
//! change feed merged without gaps, and a shard that goes down stopping only its own vouchers.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

use crate::helpers::{eventually, metric_sum, metrics_text, send, spawn_app_with, TestApp, TOKEN};
use crate::ledger::fresh_pg_schemas;
use crate::proxy::Proxy;

/// `url`'s `host:port`.
fn host_port(url: &str) -> String {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let rest = rest.rsplit('@').next().unwrap_or(rest);
    rest.split(['/', '?']).next().unwrap_or(rest).to_string()
}

/// The shard (index into `urls`) whose rows hold each voucher, read from the databases.
async fn placement(urls: &[String]) -> BTreeMap<String, usize> {
    let mut placed = BTreeMap::new();
    for (i, url) in urls.iter().enumerate() {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        let codes: Vec<String> = sqlx::query_scalar("SELECT code FROM vouchers")
            .fetch_all(&pool)
            .await
            .unwrap();
        pool.close().await;
        for c in codes {
            assert!(placed.insert(c.clone(), i).is_none(), "{c} on two shards");
        }
    }
    placed
}

/// A runtime shut down in the background when dropped (also when the test panics inside
/// another runtime).
struct Background(Option<tokio::runtime::Runtime>);

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

async fn events(app: &TestApp, after: i64) -> Value {
    let url = format!("{}/admin/events?after={after}&limit=1000", app.base);
    let (status, body) = send(&app.client, "GET", &url, Some(TOKEN), None).await;
    assert_eq!(status, 200, "{body}");
    body
}

#[actix_web::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn a_sharded_ledger_sells_each_voucher_on_its_shard_and_a_down_shard_stops_only_its_own() {
    let Some(urls) = fresh_pg_schemas("http", 3).await else {
        return;
    };
    // The third shard is reached through a link the test can cut, run on a runtime of its own:
    // building the app blocks this test's thread while it connects through the proxy.
    let (_proxy_rt, proxy, via_proxy) = proxied(&urls[2]);
    let shards = vec![urls[0].clone(), urls[1].clone(), via_proxy];
    let app = spawn_app_with(|s| {
        s.ledger.shards = shards;
        s.ledger.timeout_ms = 2_000;
        s.ledger.acquire_timeout_ms = 500;
    })
    .await;
    let codes: Vec<String> = (0..6).map(|i| format!("SH{i}")).collect();
    for c in &codes {
        let (status, body) = app
            .create_voucher_with(crate::helpers::voucher_body(c, 50, 1))
            .await;
        assert_eq!(status, 201, "{body}");
    }
    // Spread by room: two on each shard.
    let placed = placement(&urls).await;
    for shard in 0..3 {
        assert_eq!(
            placed.values().filter(|s| **s == shard).count(),
            2,
            "{placed:?}"
        );
    }
    let on = |shard: usize| -> Vec<String> {
        placed
            .iter()
            .filter(|(_, s)| **s == shard)
            .map(|(c, _)| c.clone())
            .collect()
    };
    for (i, c) in codes.iter().enumerate() {
        let (status, body) = app.reserve(c, 1 + i as i64, format!("{c}-1")).await;
        assert_eq!(status, 201, "{c}: {body}");
    }
    // An order id used on a voucher of one shard is refused on a voucher of another.
    let (a, b) = (&on(0)[0], &on(1)[0]);
    let (status, body) = app.reserve(b, 900, format!("{a}-1")).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (409, Some("ALREADY_USED")),
        "{body}"
    );
    // The feed: every reserve once, numbered 1, 2, 3… across the shards.
    let feed = events(&app, 0).await;
    let seqs: Vec<i64> = feed["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(seqs, (1..=6).collect::<Vec<_>>(), "{feed}");

    // The third shard goes down: its vouchers answer 503, the others sell on.
    proxy.cut();
    for c in on(2) {
        let (status, body) = app.reserve(&c, 100, format!("{c}-down")).await;
        assert_eq!(status, 503, "{c} lives on the shard that is down: {body}");
    }
    for (i, c) in on(0).iter().chain(&on(1)).enumerate() {
        let (status, body) = app.reserve(c, 200 + i as i64, format!("{c}-up")).await;
        assert_eq!(status, 201, "{c} lives on a shard that is up: {body}");
    }
    // The change feed goes on with the shards that answer, and a reservation on the shard
    // that is down is unavailable (503), not unknown (404); one on a shard that is up reads.
    let during = events(&app, 6).await;
    assert!(
        during["events"].as_array().unwrap().len() >= 4,
        "the up shards' reserves: {during}"
    );
    let down_code = on(2)[0].clone();
    let (status, body) = app
        .call(
            "GET",
            &format!("/vouchers/{down_code}/reservations/{down_code}-1"),
        )
        .await;
    assert_eq!(status, 503, "{body}");
    let up_code = on(0)[0].clone();
    let (status, body) = app
        .call(
            "GET",
            &format!("/vouchers/{up_code}/reservations/{up_code}-1"),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    // A voucher created meanwhile goes to a shard that is up and sells.
    let (status, body) = app
        .create_voucher_with(crate::helpers::voucher_body("SHNEW", 5, 1))
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(app.reserve("SHNEW", 1, "SHNEW-1").await.0, 201);
    // The live numbers go on for the vouchers of the shards that answer (the cut shard's
    // vouchers, which sold before, are among those picked).
    let shown = app.engine.live_numbers().await.expect("live numbers");
    assert!(shown >= 4, "the up shards' vouchers and SHNEW: {shown}");
    // So does the reconciler: the up shards' vouchers are recounted (balanced), the cut
    // shard's wait for a later run.
    let unbalanced = app
        .engine
        .reconcile()
        .await
        .expect("a recount with one shard down");
    assert!(unbalanced.is_empty(), "{unbalanced:?}");
    let m = metrics_text(&app.client, &app.base).await;
    let sel = ["voucher=\"SHNEW\"", "kind=\"reserved\""];
    assert_eq!(metric_sum(&m, "vouchers_units", &sel), 1.0);
    // The third shard's breaker shows it, in a series of its own.
    let (client, base, down) = (&app.client, &app.base, on(2)[0].clone());
    let down = &down;
    eventually(
        "shard 2's breaker opens",
        Duration::from_secs(10),
        || async move {
            let m = metrics_text(client, base).await;
            let open = metric_sum(&m, "vouchers_ledger_breaker_state", &["shard=\"2\""]);
            if open < 1.0 {
                // More failures in a row open it.
                let order = format!("{down}-more");
                let _ = crate::helpers::reserve(client, base, down, 999, &order).await;
            }
            open >= 1.0
        },
    )
    .await;
    // Back: its vouchers sell again.
    proxy.restore();
    let c = on(2)[0].clone();
    let (app_ref, c_ref) = (&app, &c);
    eventually(
        "the shard's vouchers sell again",
        Duration::from_secs(15),
        || async move { app_ref.reserve(c_ref, 300, format!("{c_ref}-back")).await.0 == 201 },
    )
    .await;
    // Every voucher's books balance on its own shard, by the auditor's reading of the rows.
    for c in &codes {
        let books = crate::audit::books(&urls[placed[c]], c).await;
        books.assert_balanced(c);
    }
    assert_ne!(
        placement(&urls).await["SHNEW"],
        2,
        "placed on a shard that was up"
    );
    let after = events(&app, 6).await;
    let more = after["events"].as_array().unwrap();
    assert_eq!(
        more.iter()
            .map(|e| e["seq"].as_i64().unwrap())
            .collect::<Vec<_>>(),
        (7..7 + more.len() as i64).collect::<Vec<_>>(),
        "{after}"
    );
    assert_eq!(
        more.len(),
        6,
        "4 and SHNEW's sold while the shard was down, 1 after: {after}"
    );
}

/// `ledger.order_ids_across_shards = false`: no order claims; an order id is kept to one
/// voucher within its shard only, so the same order id on vouchers of two shards gets two
/// `201`s, and on two vouchers of one shard `409 ALREADY_USED`.
#[actix_web::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn order_ids_may_be_kept_per_shard_by_choice() {
    let Some(urls) = fresh_pg_schemas("pershard", 2).await else {
        return;
    };
    let shards = urls.clone();
    let app = spawn_app_with(|s| {
        s.ledger.shards = shards;
        s.ledger.order_ids_across_shards = false;
    })
    .await;
    // By room: P0 and P2 on the first shard, P1 on the second.
    for c in ["P0", "P1", "P2"] {
        let (status, body) = app
            .create_voucher_with(crate::helpers::voucher_body(c, 10, 1))
            .await;
        assert_eq!(status, 201, "{body}");
    }
    let placed = placement(&urls).await;
    assert_eq!((placed["P0"], placed["P1"], placed["P2"]), (0, 1, 0));
    assert_eq!(app.reserve("P0", 1, "same").await.0, 201);
    assert_eq!(app.reserve("P1", 1, "same").await.0, 201, "another shard");
    let (status, body) = app.reserve("P2", 1, "same").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (409, Some("ALREADY_USED")),
        "the same shard: {body}"
    );
    let pool = sqlx::PgPool::connect(&urls[0]).await.unwrap();
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM order_claims")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(claims, 0, "no claims are made");
}

/// A runtime of its own for a proxy (building an app blocks the test's thread), and the proxy to
/// `url`'s server on it; `url` through the proxy.
fn proxied(url: &str) -> (Background, Proxy, String) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let handle = rt.handle().clone();
    let target = host_port(url);
    let proxy = std::thread::spawn(move || handle.block_on(Proxy::start(&target)))
        .join()
        .expect("proxy started");
    let via = url.replacen(&host_port(url), &format!("127.0.0.1:{}", proxy.port), 1);
    (Background(Some(rt)), proxy, via)
}

/// A node starts while a shard after the first is down: it is ready and sells the other
/// shards' vouchers at once, places new vouchers on shards that are up, keeps the order rule
/// for the shard that is down (its claims are on the directory), answers `503` for that
/// shard's vouchers, and opens the shard (checked at its place, fenced) once it is back.
#[actix_web::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn a_node_starts_while_a_shard_is_down_and_opens_it_when_it_is_back() {
    let Some(urls) = fresh_pg_schemas("late", 3).await else {
        return;
    };
    // A first node, every shard up: three vouchers, one on each shard, one order each.
    let shards = urls.clone();
    let first = spawn_app_with(|s| s.ledger.shards = shards).await;
    for c in ["L0", "L1", "L2"] {
        let (status, body) = first
            .create_voucher_with(crate::helpers::voucher_body(c, 50, 1))
            .await;
        assert_eq!(status, 201, "{body}");
        assert_eq!(first.reserve(c, 1, format!("{c}-1")).await.0, 201);
    }
    let placed = placement(&urls).await;
    assert_eq!((placed["L0"], placed["L1"], placed["L2"]), (0, 1, 2));

    // The second node starts with the third shard's link cut.
    let (_rt, proxy, via) = proxied(&urls[2]);
    proxy.cut();
    let shards = vec![urls[0].clone(), urls[1].clone(), via];
    let app = spawn_app_with(|s| {
        s.ledger.shards = shards;
        s.ledger.timeout_ms = 2_000;
        s.ledger.acquire_timeout_ms = 500;
    })
    .await;
    let (status, body) = app.call("GET", "/health/ready").await;
    assert_eq!(status, 200, "{body}");
    for c in ["L0", "L1"] {
        let (status, body) = app.reserve(c, 2, format!("{c}-2")).await;
        assert_eq!(status, 201, "{c} lives on a shard that is up: {body}");
    }
    let (status, body) = app.reserve("L2", 2, "L2-2").await;
    assert_eq!(status, 503, "L2 lives on the shard that is down: {body}");
    // The order stored on the shard that is down is still refused elsewhere.
    let (status, body) = app.reserve("L0", 9, "L2-1").await;
    assert_eq!(
        (status, body["error"].as_str()),
        (409, Some("ALREADY_USED")),
        "{body}"
    );
    // A voucher created now goes to a shard that is up (the third has the fewest vouchers).
    let (status, body) = app
        .create_voucher_with(crate::helpers::voucher_body("LNEW", 5, 1))
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(app.reserve("LNEW", 1, "LNEW-1").await.0, 201);
    assert_ne!(
        placement(&urls).await["LNEW"],
        2,
        "placed on a shard that is up"
    );

    // Back: the shard is opened and its vouchers sell on this node.
    proxy.restore();
    let app_ref = &app;
    eventually(
        "the late shard's vouchers sell",
        Duration::from_secs(20),
        || async move { app_ref.reserve("L2", 3, "L2-3").await.0 == 201 },
    )
    .await;
    let placed = placement(&urls).await;
    for c in ["L0", "L1", "L2", "LNEW"] {
        crate::audit::books(&urls[placed[c]], c)
            .await
            .assert_balanced(c);
    }
}

/// Per shard, how many of `codes` it holds.
async fn spread(urls: &[String], codes: &[String]) -> [usize; 3] {
    let placed = placement(urls).await;
    let mut per_shard = [0; 3];
    for c in codes {
        per_shard[placed[c]] += 1;
    }
    per_shard
}

/// A sharded app on three fresh schemas whose first two shards hold 1,000 vouchers each (as
/// counted by the directory) and the third none, with `connections` per pool (as many
/// placements at once); and the directory's pool.
async fn uneven_shards(
    tag: &str,
    connections: u32,
) -> Option<(Vec<String>, TestApp, sqlx::PgPool)> {
    let urls = fresh_pg_schemas(tag, 3).await?;
    let shards = urls.clone();
    let app = spawn_app_with(|s| {
        s.ledger.shards = shards;
        s.ledger.max_connections = connections;
    })
    .await;
    let directory = sqlx::PgPool::connect(&urls[0]).await.unwrap();
    let set = sqlx::query("UPDATE shard_room SET vouchers = 1000 WHERE shard < 2")
        .execute(&directory)
        .await
        .unwrap();
    assert_eq!(set.rows_affected(), 2);
    Some((urls, app, directory))
}

/// A burst of creates spreads over every shard, however unequal their vouchers: a shard just
/// added (or back from an outage) no longer takes a whole campaign. Two shards hold 1,000
/// vouchers each, the third none; 24 vouchers created one after the other go eight to each
/// (placed by recent placements in steps of eight, then by the fewest vouchers; with the
/// fewest vouchers alone all 24 went to the third). Eight more then go to the emptiest shard;
/// once ten hours have passed the recent placements are forgotten (with no decay the next
/// would go to the first shard, the emptiest in recent placements).
#[actix_web::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn a_burst_of_creates_spreads_over_every_shard_however_full() {
    let Some((urls, app, directory)) = uneven_shards("spread", 4).await else {
        return;
    };
    let create = |c: String| {
        let app = &app;
        async move {
            let (status, body) = app
                .create_voucher_with(crate::helpers::voucher_body(&c, 5, 1))
                .await;
            assert_eq!(status, 201, "{body}");
        }
    };
    let burst: Vec<String> = (0..24).map(|i| format!("SPREAD{i:02}")).collect();
    for c in &burst {
        create(c.clone()).await;
    }
    assert_eq!(spread(&urls, &burst).await, [8, 8, 8]);
    let more: Vec<String> = (0..8).map(|i| format!("MORE{i}")).collect();
    for c in &more {
        create(c.clone()).await;
    }
    assert_eq!(spread(&urls, &more).await, [0, 0, 8]);
    let rooms: Vec<(i32, i64)> =
        sqlx::query_as("SELECT shard, vouchers FROM shard_room ORDER BY shard")
            .fetch_all(&directory)
            .await
            .unwrap();
    assert_eq!(rooms, vec![(0, 1008), (1, 1008), (2, 16)]);
    // Ten hours on the directory's clock, which the decay reads.
    sqlx::query("UPDATE shard_room SET recent_at = recent_at - 36000000")
        .execute(&directory)
        .await
        .unwrap();
    create("LATER".into()).await;
    assert_eq!(placement(&urls).await["LATER"], 2, "the emptiest shard");
}

/// The same burst sent all at once, 24 placements at a time: creates beyond the shards the
/// directory can hand out at that moment (each held by another create) go to a shard at
/// random rather than queue on the first one, so no shard takes most of the burst. A bound,
/// not a proof: with one HTTP worker the queueing of the old rule showed in one run of three
/// ([4, 3, 17]); the order itself is checked one create at a time above.
#[actix_web::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn a_burst_of_concurrent_creates_does_not_queue_on_one_shard() {
    let Some((urls, app, _directory)) = uneven_shards("spreadc", 24).await else {
        return;
    };
    let burst: Vec<String> = (0..24).map(|i| format!("CSPREAD{i:02}")).collect();
    let answers = futures_util::future::join_all(
        burst
            .iter()
            .map(|c| app.create_voucher_with(crate::helpers::voucher_body(c, 5, 1))),
    )
    .await;
    for (status, body) in answers {
        assert_eq!(status, 201, "{body}");
    }
    let per_shard = spread(&urls, &burst).await;
    assert!(per_shard.iter().all(|n| *n <= 16), "{per_shard:?}");
}

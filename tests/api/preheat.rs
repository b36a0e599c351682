//! Pre-heat (issue 11): a voucher is warm on every node before its sale starts, by itself
//! (`engine.preheat_ms`) or on an operator's warm-up, so the first second is served from leases.

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::json;

use crate::audit;
use crate::helpers::{eventually, spawn_app_with};

fn rfc3339(ms: i64) -> String {
    DateTime::<Utc>::from_timestamp_millis(ms)
        .expect("a valid time")
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

#[actix_web::test]
async fn a_voucher_starting_soon_is_warm_before_it_starts() {
    let app = spawn_app_with(|s| s.jobs.preheat_interval_ms = 50).await;
    let starts = app.engine.now_ms() + 10_000;
    let (s, b) = app
        .create_voucher_with(json!({
            "code": "SOONER", "discountAmount": 100, "totalLimit": 1000, "perUserLimit": 1,
            "startsAt": rfc3339(starts), "endsAt": rfc3339(starts + 3_600_000)
        }))
        .await;
    assert_eq!(s, 201, "{b}");
    let db = app.db_url.clone();
    eventually(
        "a lease is held before the start",
        Duration::from_secs(10),
        || {
            let db = db.clone();
            async move { audit::books(&db, "SOONER").await.leased_unused > 0 }
        },
    )
    .await;
    assert!(app.engine.now_ms() < starts, "the clock has not moved");
    let warm = audit::books(&app.db_url, "SOONER").await.leased_unused;
    assert!(warm < 50, "the first warm-up takes a small block ({warm})");
    // Clients already hammer the voucher before it opens: that is the demand it will meet at
    // the start, and it sizes the lease held when the sale opens.
    for c in 1..=100 {
        let (s, b) = app.reserve("SOONER", c, format!("soon-{c}")).await;
        assert_eq!((s, b["reason"].as_str()), (422, Some("NOT_STARTED")));
    }
    eventually(
        "the lease grows with the demand before the start",
        Duration::from_secs(10),
        || {
            let db = db.clone();
            async move { audit::books(&db, "SOONER").await.leased_unused >= 50 }
        },
    )
    .await;
    // A bot hammering this node before the start cannot pull the voucher into it: the node
    // holds at most a quarter of what was free at its first grant (`endgame_divisor`).
    for c in 101..=1100 {
        let (s, _) = app.reserve("SOONER", c, format!("soon-{c}")).await;
        assert_eq!(s, 422);
    }
    let held = audit::books(&app.db_url, "SOONER").await.leased_unused;
    assert!((50..=250).contains(&held), "held before the start: {held}");
    app.clock.advance_ms(10_000);
    assert_eq!(app.reserve("SOONER", 1, "soon-1").await.0, 201);
    let books = audit::books(&app.db_url, "SOONER").await;
    books.assert_balanced("SOONER");
    assert_eq!(books.reserved, 1);
    assert!(
        books.leased_unused >= 49,
        "the first reserve was served from the lease"
    );
}

/// A lease warmed ahead of the start is kept however long nobody can buy: idleness counts from
/// the start. A started voucher's idle lease, on the same clock, goes back (the control).
#[actix_web::test]
async fn a_warm_lease_is_kept_until_the_start_however_idle() {
    let app = spawn_app_with(|s| {
        s.engine.preheat_ms = 0;
        s.engine.lease_idle_timeout_ms = 1_000;
        // No lease runs out during the test's minutes: only idleness may end one.
        s.engine.lease_ttl_ms = 86_400_000;
    })
    .await;
    let starts = app.engine.now_ms() + 3_600_000;
    let (s, b) = app
        .create_voucher_with(json!({
            "code": "LATER", "discountAmount": 100, "totalLimit": 1000, "perUserLimit": 1,
            "startsAt": rfc3339(starts), "endsAt": rfc3339(starts + 3_600_000)
        }))
        .await;
    assert_eq!(s, 201, "{b}");
    assert_eq!(app.create_voucher("NOWNOW", 1000, 1).await.0, 201);
    app.engine.warm("LATER").await.expect("warm");
    let warm = audit::books(&app.db_url, "LATER").await.leased_unused;
    assert!(warm > 0, "warmed");
    // A minute at a time on the engine's clock, the warm actor's ticks included.
    app.two_tick_periods("NOWNOW", 60_000).await;
    assert!(app.engine.now_ms() < starts);
    assert_eq!(
        audit::books(&app.db_url, "LATER").await.leased_unused,
        warm,
        "the warm lease is still held"
    );
}

/// A warm-up that finds every unit in another holder's lease waits for them as a reserve would,
/// but recalls nothing: only real demand takes units away from another node. A reserve then
/// does recall them.
#[actix_web::test]
#[cfg_attr(no_test_redis, ignore = "needs TEST_REDIS_URL; .ci/run sets it")]
async fn a_warm_up_recalls_nothing_but_a_waiting_reserve_does() {
    let Some(redis) = crate::helpers::service_url("TEST_REDIS_URL") else {
        return;
    };
    let app = spawn_app_with(move |s| {
        s.redis.url = redis;
        s.engine.recall_wait_ms = 200;
    })
    .await;
    // A code of its own: Redis channels are shared with the other tests.
    let code = format!("RECALL{}", vouchers::startup::random_hex(3).to_uppercase());
    assert_eq!(app.create_voucher(&code, 10, 1).await.0, 201);
    // Every unit sits, unused, in the lease of another holder (one without a number, whose
    // lease nobody reaps before its TTL).
    let ghost = app
        .ledger
        .grant(&code, "ghost", 10, app.engine.now_ms(), 3_600_000)
        .await
        .unwrap();
    assert_eq!(ghost.lease.map(|l| l.granted), Some(10));
    let published = |kind: &'static str| {
        let (client, base) = (app.client.clone(), app.base.clone());
        async move {
            let m = crate::helpers::metrics_text(&client, &base).await;
            let kind = format!("kind=\"{kind}\"");
            crate::helpers::metric_sum(
                &m,
                "vouchers_signals_total",
                &["event=\"published\"", &kind],
            )
        }
    };
    let (recalls, warms) = (published("RECALL").await, published("WARM").await);
    app.engine.warm(&code).await.expect("warm");
    // The node's signals leave in order: once a later WARM is out, a RECALL of the warm-up
    // would be out too.
    app.engine.warm_everywhere(&code).await.expect("warm");
    eventually(
        "the WARM signal is out",
        Duration::from_secs(10),
        || async { published("WARM").await > warms },
    )
    .await;
    assert_eq!(
        published("RECALL").await,
        recalls,
        "a warm-up recalled units"
    );
    // The warm-up's wait for units has run out by the time a customer comes.
    app.clock.advance_ms(1_000);
    let reserve = app.reserve(&code, 1, "rc-1");
    let recalled_then_give_up = async {
        eventually(
            "the reserve recalled the units",
            Duration::from_secs(10),
            || async { published("RECALL").await == recalls + 1.0 },
        )
        .await;
        // Nobody gives the ghost's units back: past the recall wait, the reserve is refused.
        app.clock.advance_ms(1_000);
    };
    let ((s, b), ()) = tokio::join!(reserve, recalled_then_give_up);
    assert_eq!((s, b["error"].as_str()), (409, Some("OUT_OF_STOCK")), "{b}");
}

/// Sells an 8-unit voucher out of a node (end-game divisor 4, blocks of at least 4) and counts
/// the leases it took.
async fn leases_to_sell_out(shared_pg: Option<String>) -> i64 {
    let app = spawn_app_with(|s| {
        s.engine.endgame_divisor = 4;
        s.engine.min_block = 4;
        if let Some(url) = shared_pg {
            s.ledger.url = url;
        }
    })
    .await;
    assert_eq!(app.create_voucher("SMALL", 8, 1).await.0, 201);
    for c in 1..=8 {
        assert_eq!(app.reserve("SMALL", c, format!("small-{c}")).await.0, 201);
    }
    assert_eq!(app.reserve("SMALL", 9, "small-9").await.0, 409);
    audit::books(&app.db_url, "SMALL")
        .await
        .assert_balanced("SMALL");
    let sql = "SELECT COUNT(*) FROM leases WHERE voucher_code = 'SMALL'";
    crate::helpers::scalar(&app.db_url, sql).await
}

/// The end-game divisor spreads a voucher's last units over the nodes that want them. On the
/// embedded ledger this node is the only one (its data lock sees to it), so it sells a small
/// voucher out of whole blocks: the first block, then the rest.
#[actix_web::test]
async fn alone_on_the_embedded_ledger_a_node_sells_out_in_whole_blocks() {
    assert_eq!(leases_to_sell_out(None).await, 2);
}

/// On a shared ledger the end-game grants shrink towards single units as the free pool runs low.
#[actix_web::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn on_a_shared_ledger_the_end_game_spreads_the_last_units() {
    let Some(pg) = crate::ledger::fresh_pg_schema("endgame").await else {
        return;
    };
    let leases = leases_to_sell_out(Some(pg)).await;
    assert!(leases >= 4, "4, then one unit at a time: {leases} leases");
}

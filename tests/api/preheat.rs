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
    let db = app.db_url.clone();
    // Each round: the control takes a lease, a minute passes on the engine's clock, and the
    // control's actor gives the lease back at one of its ticks. Two rounds span at least one
    // tick period of every actor, the warm one's included.
    for round in 1..=2 {
        let order = format!("now-{round}");
        assert_eq!(app.reserve("NOWNOW", round, order).await.0, 201);
        assert!(audit::books(&db, "NOWNOW").await.leased_unused > 0);
        app.clock.advance_ms(60_000);
        eventually(
            "the started voucher's idle lease goes back",
            Duration::from_secs(10),
            || {
                let db = db.clone();
                async move { audit::books(&db, "NOWNOW").await.leased_unused == 0 }
            },
        )
        .await;
    }
    assert!(app.engine.now_ms() < starts);
    assert_eq!(
        audit::books(&app.db_url, "LATER").await.leased_unused,
        warm,
        "the warm lease is still held"
    );
}

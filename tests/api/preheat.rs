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

//! Live numbers (issue 11): the per-voucher unit gauges move within a second of a sale, and a
//! voucher that has not started is never exported.

use std::time::Duration;

use serde_json::json;

use crate::helpers::{eventually, metric_sum, metrics_text, spawn_app_with};

#[actix_web::test]
async fn unit_gauges_follow_the_sale_and_hide_vouchers_not_yet_started() {
    // The reconciler stays quiet (test settings): only the live numbers can move the gauges.
    let app = spawn_app_with(|s| s.jobs.live_numbers_interval_ms = 100).await;
    assert_eq!(app.create_voucher("LIVEV", 5, 1).await.0, 201);
    let (s, _) = app
        .create_voucher_with(json!({
            "code": "SECRETV", "discountAmount": 100, "totalLimit": 5, "perUserLimit": 1,
            "startsAt": "2098-01-01T00:00:00Z", "endsAt": "2099-01-01T00:00:00Z"
        }))
        .await;
    assert_eq!(s, 201);
    // Both are hot on this node (a reserve started their actors).
    assert_eq!(app.reserve("SECRETV", 9, "secret-9").await.0, 422);
    for c in 1..=3 {
        assert_eq!(app.reserve("LIVEV", c, format!("live-{c}")).await.0, 201);
    }
    assert_eq!(
        app.call("DELETE", "/vouchers/LIVEV/reservations/live-3")
            .await
            .0,
        200
    );
    let units = |m: &str, code: &str, kind: &str| {
        metric_sum(
            m,
            "vouchers_units",
            &[&format!("voucher=\"{code}\""), &format!("kind=\"{kind}\"")],
        )
    };
    // Per-voucher outcomes: a replay and a clash besides the three 201s.
    assert_eq!(app.reserve("LIVEV", 1, "live-1").await.0, 201);
    assert_eq!(app.reserve("LIVEV", 1, "live-other").await.0, 409);
    let outcomes = |m: &str, code: &str, outcome: &str| {
        metric_sum(
            m,
            "vouchers_voucher_reservations",
            &[
                &format!("voucher=\"{code}\""),
                &format!("outcome=\"{outcome}\""),
            ],
        )
    };
    let (client, base) = (app.client.clone(), app.base.clone());
    eventually("the gauges show the sale", Duration::from_secs(10), || {
        let (client, base) = (client.clone(), base.clone());
        async move {
            let m = metrics_text(&client, &base).await;
            units(&m, "LIVEV", "reserved") == 2.0
                && units(&m, "LIVEV", "released") == 1.0
                && units(&m, "LIVEV", "free") + units(&m, "LIVEV", "leased_unused") == 3.0
                && outcomes(&m, "LIVEV", "created") == 3.0
        }
    })
    .await;
    let m = metrics_text(&app.client, &app.base).await;
    assert_eq!(
        (
            outcomes(&m, "LIVEV", "replayed"),
            outcomes(&m, "LIVEV", "already_used")
        ),
        (1.0, 1.0)
    );
    assert!(
        !m.contains("SECRETV"),
        "a voucher that has not started is not in /metrics"
    );
}

/// A voucher whose window just ended is still watched (live numbers, reconciler): its
/// reservations can still expire for up to a reservation TTL after the end.
#[actix_web::test]
async fn a_voucher_that_just_ended_is_still_watched() {
    let app = spawn_app_with(|s| s.jobs.live_numbers_interval_ms = 3_600_000).await;
    let now = app.engine.now_ms();
    let at = |ms: i64| {
        chrono::DateTime::<chrono::Utc>::from_timestamp_millis(ms)
            .expect("a valid time")
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    };
    let (s, b) = app
        .create_voucher_with(json!({
            "code": "ENDING", "discountAmount": 100, "totalLimit": 5, "perUserLimit": 1,
            "startsAt": at(now - 60_000), "endsAt": at(now + 10_000)
        }))
        .await;
    assert_eq!(s, 201, "{b}");
    assert_eq!(app.reserve("ENDING", 1, "ending-1").await.0, 201);
    app.clock.advance_ms(20_000);
    assert_eq!(app.reserve("ENDING", 2, "ending-2").await.0, 422, "ended");
    assert_eq!(app.engine.live_numbers().await.unwrap(), 1, "still watched");
}

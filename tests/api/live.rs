//! Live numbers (issue 11): the per-voucher unit gauges move within a second of a sale, and a
//! voucher that has not started is never exported.

use std::time::Duration;

use serde_json::json;

use crate::helpers::{eventually, metric_sum, metrics_text, send, spawn_app_with, TestApp, TOKEN};

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

/// The per-voucher view is capped: with `metrics.top_vouchers = 1`, only the hottest voucher on
/// the node and the watched ones get series of their own, and `vouchers_voucher_view` is on
/// the page to say how many of the catalogue do not.
#[actix_web::test]
async fn only_the_hottest_and_the_watched_get_series_of_their_own() {
    let app = spawn_app_with(|s| {
        s.jobs.live_numbers_interval_ms = 3_600_000;
        s.metrics.top_vouchers = 1;
    })
    .await;
    for code in ["HOTV", "COLDV", "WATCHV", "IDLEV"] {
        assert_eq!(app.create_voucher(code, 1000, 100).await.0, 201);
    }
    for i in 0..5 {
        assert_eq!(app.reserve("HOTV", 1, format!("hot-{i}")).await.0, 201);
    }
    assert_eq!(app.reserve("COLDV", 1, "cold-1").await.0, 201);
    let admin = |method: &'static str, code: &'static str| {
        let url = format!("{}/admin/vouchers/{code}/watch", app.base);
        let client = app.client.clone();
        async move { send(&client, method, &url, Some(TOKEN), None).await.0 }
    };
    assert_eq!(admin("PUT", "WATCHV").await, 204);
    assert_eq!(admin("PUT", "NOPE").await, 404);
    assert_eq!(
        app.engine.live_numbers().await.unwrap(),
        2,
        "HOTV and WATCHV"
    );
    let m = metrics_text(&app.client, &app.base).await;
    let has = |code: &str| m.contains(&format!("voucher=\"{code}\""));
    assert!(has("HOTV") && has("WATCHV"), "{m}");
    assert!(!has("COLDV") && !has("IDLEV"), "{m}");
    // The view's gauges are process-wide (other tests' apps set them too): their presence is
    // what this page can tell; live_numbers' answer above is this node's count.
    assert!(
        m.contains("vouchers_voucher_view{view=\"not_shown\"}"),
        "{m}"
    );
    // Unwatched, WATCHV leaves the pick, and its series the page (they stay in the recorder
    // until they idle out).
    assert_eq!(admin("DELETE", "WATCHV").await, 204);
    assert_eq!(app.engine.live_numbers().await.unwrap(), 1);
    let m = metrics_text(&app.client, &app.base).await;
    let has = |code: &str| m.contains(&format!("voucher=\"{code}\""));
    assert!(has("HOTV") && !has("WATCHV"), "{m}");
}

/// The reconciler recounts what this node changed, and audits the rest of the catalogue a page
/// a run: a voucher nobody touched whose books went wrong (here behind the engine's back) is
/// found within a round of the catalogue.
#[actix_web::test]
async fn the_reconciler_audits_what_nobody_touched_a_page_a_run() {
    let app = spawn_app_with(|s| s.jobs.reconcile_audit_page = 1).await;
    for code in ["AUD1", "AUD2", "AUD3"] {
        assert_eq!(app.create_voucher(code, 10, 1).await.0, 201);
    }
    assert!(app.engine.reconcile().await.unwrap().is_empty());
    lose_a_free_unit_behind_the_engine(&app, "AUD2").await;
    reconcile_until_unbalanced(&app, "AUD2", 3).await;
}

/// A create queues no recount: a new voucher's books are its row alone, and a campaign that
/// creates a million codes must not leave a million recounts (and their queue's memory) behind.
/// The audit still reads it in its round, one voucher a page here.
#[actix_web::test]
async fn a_created_voucher_waits_for_the_audit_not_for_a_recount() {
    let app = spawn_app_with(|s| s.jobs.reconcile_audit_page = 1).await;
    for code in ["NEWA", "NEWB", "NEWC"] {
        assert_eq!(app.create_voucher(code, 10, 1).await.0, 201);
    }
    lose_a_free_unit_behind_the_engine(&app, "NEWC").await;
    // The job's run at start audits one page at most (NEWA, or nothing), so this run's page is
    // NEWA or NEWB: NEWC is found now only if its create marked it changed.
    assert_eq!(app.engine.reconcile().await.unwrap(), Vec::<String>::new());
    reconcile_until_unbalanced(&app, "NEWC", 1).await;
}

/// Takes one unit off `code`'s free count in the embedded ledger's file, behind the engine's
/// back: books that no longer balance, for the reconciler to find.
async fn lose_a_free_unit_behind_the_engine(app: &TestApp, code: &str) {
    let pool = sqlx::SqlitePool::connect(&app.db_url).await.unwrap();
    sqlx::query("UPDATE vouchers SET free = free - 1 WHERE code = ?")
        .bind(code)
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
}

/// Runs the reconciler until a run finds `code`, and only it, unbalanced; fails on a run that
/// finds another, and once `quiet` runs in a row found nothing.
async fn reconcile_until_unbalanced(app: &TestApp, code: &str, quiet: usize) {
    for _ in 0..=quiet {
        let unbalanced = app.engine.reconcile().await.unwrap();
        if unbalanced == [code] {
            return;
        }
        assert!(unbalanced.is_empty(), "{unbalanced:?}");
    }
    panic!("the audit never reached {code}");
}

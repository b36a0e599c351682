//! The emergency switches (DESIGN §6): `PUT /admin/switches` stops every sale at once, or puts
//! the service in read-only mode, held by the ledger and applied by every node.

use std::time::Duration;

use serde_json::{json, Value};

use crate::audit;
use crate::helpers::{
    error, eventually, metric_sum, metrics_text, send, spawn_app, Answer, TestApp, TOKEN,
};

async fn put(app: &TestApp, body: Value) -> Answer {
    let url = format!("{}/admin/switches", app.base);
    send(&app.client, "PUT", &url, Some(TOKEN), Some(&body)).await
}

#[actix_web::test]
async fn sales_paused_and_read_only_stop_new_sales_but_not_retries_confirm_or_release() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("SW", 10, 3).await.0, 201);
    assert_eq!(app.create_voucher("SWONE", 1, 1).await.0, 201);
    let kept = app.reserve("SW", 1, "sw-1").await;
    let to_confirm = app.reserve("SW", 2, "sw-2").await;
    let to_release = app.reserve("SW", 3, "sw-3").await;
    let winner = app.reserve("SWONE", 1, "one-1").await;
    assert!([&kept, &to_confirm, &to_release, &winner]
        .iter()
        .all(|a| a.0 == 201));
    // SWONE sells out: its late traffic is answered by the frontend's short-circuit.
    assert_eq!(error(&app.reserve("SWONE", 2, "one-2").await).0, 409);

    // Refused without the admin token or with a bad body: nothing changes.
    let url = format!("{}/admin/switches", app.base);
    let (s, _) = send(
        &app.client,
        "PUT",
        &url,
        None,
        Some(&json!({"salesPaused": true})),
    )
    .await;
    assert_eq!(s, 401);
    assert_eq!(put(&app, json!({"salesPaused": "yes"})).await.0, 400);
    assert_eq!(put(&app, json!({"paused": true})).await.0, 400);
    let (s, b) = send(&app.client, "GET", &url, Some(TOKEN), None).await;
    assert_eq!(
        (s, b),
        (200, json!({"salesPaused": false, "readOnly": false}))
    );

    let (s, b) = put(&app, json!({"salesPaused": true})).await;
    assert_eq!(
        (s, b),
        (200, json!({"salesPaused": true, "readOnly": false}))
    );
    for (code, customer, order) in [("SW", 4, "sw-4"), ("SWONE", 3, "one-3"), ("SW", 1, "sw-1b")] {
        assert_eq!(
            error(&app.reserve(code, customer, order).await),
            (422, Some("NOT_ELIGIBLE"), Some("PAUSED")),
            "{code} {order}: a new order while sales are paused"
        );
    }
    assert_eq!(
        app.reserve("SW", 1, "sw-1").await,
        kept,
        "a retry still gets its 201"
    );
    assert_eq!(
        app.reserve("SWONE", 1, "one-1").await,
        winner,
        "on the sold-out path too"
    );
    let (_, ready) = app.call("GET", "/health/ready").await;
    assert_eq!(ready["salesPaused"], json!(true));
    // The gauge is process-wide and other tests' apps set theirs when they start: ask again
    // (the PUT is idempotent) until this app's value is the one read.
    eventually(
        "the gauge shows the switch",
        Duration::from_secs(10),
        || async {
            assert_eq!(put(&app, json!({"salesPaused": true})).await.0, 200);
            let m = metrics_text(&app.client, &app.base).await;
            metric_sum(&m, "vouchers_switch", &["switch=\"sales_paused\""]) == 1.0
        },
    )
    .await;

    // Read-only (one key changes, the other stays): new reserves 503, lifecycle goes on.
    let (s, b) = put(&app, json!({"readOnly": true})).await;
    assert_eq!(
        (s, b),
        (200, json!({"salesPaused": true, "readOnly": true}))
    );
    assert_eq!(put(&app, json!({"salesPaused": false})).await.0, 200);
    let refused = app.reserve("SW", 5, "sw-5").await;
    assert_eq!(error(&refused), (503, Some("UNAVAILABLE"), None));
    assert_eq!(error(&app.reserve("SWONE", 5, "one-5").await).0, 503);
    assert_eq!(app.reserve("SW", 1, "sw-1").await, kept);
    let one = |o: &str| format!("/vouchers/SW/reservations/{o}");
    assert_eq!(
        app.call("POST", &format!("{}/confirm", one("sw-2")))
            .await
            .0,
        200
    );
    assert_eq!(app.call("DELETE", &one("sw-3")).await.0, 200);

    assert_eq!(put(&app, json!({"readOnly": false})).await.0, 200);
    assert_eq!(app.reserve("SW", 6, "sw-6").await.0, 201, "sales resume");
    let books = audit::books(&app.db_url, "SW").await;
    books.assert_balanced("SW");
    assert_eq!(
        (books.reserved, books.confirmed, books.released),
        (2, 1, 1),
        "sw-1 and sw-6 reserved, sw-2 confirmed, sw-3 released; nothing refused left a trace"
    );
}

#[actix_web::test]
async fn a_switch_set_behind_the_node_is_applied_from_the_ledger() {
    // Another node set it and no signal came (no Redis here): the periodic read picks it up.
    // (Read-only, not sales paused: this app's reads set the process-wide gauges every 100 ms,
    // and the sales-paused gauge is what another test checks.)
    let app = spawn_app_with_fast_switches().await;
    assert_eq!(app.create_voucher("SWL", 10, 1).await.0, 201);
    let patch = vouchers::domain::SwitchesPatch {
        sales_paused: None,
        read_only: Some(true),
    };
    app.ledger
        .set_switches(&patch, app.engine.now_ms())
        .await
        .unwrap();
    let mut n = 0;
    let app = &app;
    eventually("the node reads the switch", Duration::from_secs(10), || {
        n += 1;
        async move {
            let a = app.reserve("SWL", n, format!("swl-{n}")).await;
            error(&a) == (503, Some("UNAVAILABLE"), None)
        }
    })
    .await;
}

async fn spawn_app_with_fast_switches() -> TestApp {
    crate::helpers::spawn_app_with(|s| s.jobs.switches_interval_ms = 100).await
}

#[actix_web::test]
async fn the_switches_start_as_the_ledger_holds_them() {
    let app = spawn_app().await;
    assert_eq!(put(&app, json!({"readOnly": true})).await.0, 200);
    // A second node on the same ledger starts read-only.
    let url = app.db_url.clone();
    let other = crate::helpers::spawn_app_with(move |s| s.ledger.url = url).await;
    assert!(other.engine.switches().read_only);
}

/// Reserves already queued at an actor when the sales are paused do not become a batch
/// afterwards: the batch in flight when the switch went on commits (it was taken before), the
/// queued ones get `422 PAUSED` (or, like any new sale, would after a lookup) and take nothing.
/// PostgreSQL, so the test can hold the batch in flight on its lease's row lock while the
/// switch row changes.
#[actix_web::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn reserves_queued_when_sales_pause_are_refused_not_batched() {
    let Some(db) = crate::ledger::fresh_pg_schema("queued").await else {
        return;
    };
    let url = db.clone();
    let app = crate::helpers::spawn_app_with(move |s| {
        s.ledger.url = url;
        s.ledger.timeout_ms = 60_000;
        s.http.request_timeout_ms = 60_000;
    })
    .await;
    assert_eq!(app.create_voucher("QUEUE", 100, 1).await.0, 201);
    assert_eq!(app.reserve("QUEUE", 1, "q-1").await.0, 201);
    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    let mut hold = pool.begin().await.unwrap();
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *hold)
        .await
        .unwrap();
    sqlx::query("SELECT id FROM leases WHERE voucher_code = 'QUEUE' FOR UPDATE")
        .fetch_all(&mut *hold)
        .await
        .unwrap();
    let first = app.reserve("QUEUE", 2, "q-2");
    let rest_then_pause = async {
        crate::helpers::blocked_by(&pool, holder, "q-2's batch waits on the lease row").await;
        // Only now do the others arrive: they queue behind q-2's batch.
        let rest = futures_util::future::join_all(
            (3..=6).map(|c| app.reserve("QUEUE", c, format!("q-{c}"))),
        );
        let pause_then_free = async {
            eventually(
                "the other four are queued at the actor",
                Duration::from_secs(10),
                || async { app.engine.reserves_in_flight() == 5 },
            )
            .await;
            assert_eq!(put(&app, json!({"salesPaused": true})).await.0, 200);
            hold.rollback().await.unwrap();
        };
        tokio::join!(rest, pause_then_free).0
    };
    let (first, rest) = tokio::join!(first, rest_then_pause);
    assert_eq!(
        first.0, 201,
        "the batch in flight was taken before the pause"
    );
    for a in &rest {
        assert_eq!(
            error(a),
            (422, Some("NOT_ELIGIBLE"), Some("PAUSED")),
            "{a:?}"
        );
    }
    let books = audit::books(&db, "QUEUE").await;
    books.assert_matches_clients("QUEUE", &["q-1".to_string(), "q-2".to_string()].into());
}

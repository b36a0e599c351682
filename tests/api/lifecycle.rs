//! Eligibility, confirm and release, expiry with a moved clock, and the fence.

use futures_util::future::join_all;
use serde_json::json;

use crate::helpers::{spawn_app, tally};

#[actix_web::test]
async fn ineligible_reserves_get_422_with_their_reason_and_change_nothing() {
    let app = spawn_app().await;
    let base = json!({ "discountAmount": 100, "minOrderAmount": 1000, "totalLimit": 5, "perUserLimit": 1 });
    let make = |code: &str, starts: &str, ends: &str| {
        let mut b = base.clone();
        b["code"] = json!(code);
        b["startsAt"] = json!(starts);
        b["endsAt"] = json!(ends);
        b
    };
    let cases = [
        (
            make("SOON", "2098-01-01T00:00:00Z", "2099-01-01T00:00:00Z"),
            "NOT_STARTED",
        ),
        (
            make("OVER", "2020-01-01T00:00:00Z", "2021-01-01T00:00:00Z"),
            "ENDED",
        ),
        (
            make("PAUSE", "2020-01-01T00:00:00Z", "2099-01-01T00:00:00Z"),
            "PAUSED",
        ),
    ];
    for (body, _) in &cases {
        assert_eq!(app.create_voucher_with(body.clone()).await.0, 201);
    }
    let url = format!("{}/admin/vouchers/PAUSE", app.base);
    let (s, _) = crate::helpers::send(
        &app.client,
        "PATCH",
        &url,
        Some(crate::helpers::TOKEN),
        Some(&json!({"status": "PAUSED"})),
    )
    .await;
    assert_eq!(s, 200);
    for (body, reason) in &cases {
        let code = body["code"].as_str().unwrap();
        let (s, b) = app.reserve(code, 1, format!("{code}-1")).await;
        assert_eq!(
            (s, b["error"].as_str(), b["reason"].as_str()),
            (422, Some("NOT_ELIGIBLE"), Some(*reason))
        );
        let c = app.balanced_counters(code).await;
        assert_eq!(
            (c["reserved"].clone(), c["free"].clone()),
            (json!(0), json!(5))
        );
    }
    // Below the minimum order amount.
    assert_eq!(app.create_voucher("MIN", 5, 1).await.0, 201);
    let url = format!("{}/vouchers/MIN/reservations", app.base);
    let body = json!({ "customerId": 1, "orderId": "cheap", "orderAmount": 999 });
    let (s, b) = crate::helpers::send(&app.client, "POST", &url, None, Some(&body)).await;
    assert_eq!((s, b["reason"].as_str()), (422, Some("MIN_ORDER_AMOUNT")));
    let c = app.balanced_counters("MIN").await;
    assert_eq!(c["reserved"], json!(0));
    // Resuming the paused voucher makes it sell again.
    let url = format!("{}/admin/vouchers/PAUSE", app.base);
    let resume = json!({"status": "ACTIVE"});
    let (s, _) = crate::helpers::send(
        &app.client,
        "PATCH",
        &url,
        Some(crate::helpers::TOKEN),
        Some(&resume),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(app.reserve("PAUSE", 1, "PAUSE-2").await.0, 201);
}

#[actix_web::test]
async fn confirm_and_release_are_idempotent_and_exclusive() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("LIFE", 10, 5).await.0, 201);
    assert_eq!(app.reserve("LIFE", 1, "pay").await.0, 201);
    assert_eq!(app.reserve("LIFE", 1, "cancel").await.0, 201);
    for _ in 0..2 {
        let (s, b) = app
            .call("POST", "/vouchers/LIFE/reservations/pay/confirm")
            .await;
        assert_eq!(
            (s, b),
            (200, json!({"orderId": "pay", "status": "CONFIRMED"}))
        );
        let (s, b) = app
            .call("DELETE", "/vouchers/LIFE/reservations/cancel")
            .await;
        assert_eq!(
            (s, b),
            (200, json!({"orderId": "cancel", "status": "RELEASED"}))
        );
    }
    let (s, b) = app.call("DELETE", "/vouchers/LIFE/reservations/pay").await;
    assert_eq!((s, b["error"].as_str()), (409, Some("ALREADY_CONFIRMED")));
    let (s, b) = app
        .call("POST", "/vouchers/LIFE/reservations/cancel/confirm")
        .await;
    assert_eq!(
        (s, b["error"].as_str()),
        (409, Some("RESERVATION_RELEASED"))
    );
    let (s, b) = app
        .call("POST", "/vouchers/LIFE/reservations/nope/confirm")
        .await;
    assert_eq!((s, b["error"].as_str()), (404, Some("NOT_FOUND")));
    let (s, _) = app.call("DELETE", "/vouchers/OTHER/reservations/pay").await;
    assert_eq!(s, 404, "an order is only found under its own voucher");
    let (s, b) = app.call("GET", "/vouchers/LIFE/reservations/pay").await;
    assert_eq!(
        (s, b["status"].as_str(), b["customerId"].as_i64()),
        (200, Some("CONFIRMED"), Some(1))
    );
    let c = app.balanced_counters("LIFE").await;
    assert_eq!(
        (
            c["confirmed"].clone(),
            c["released"].clone(),
            c["reserved"].clone()
        ),
        (json!(1), json!(1), json!(0))
    );
}

#[actix_web::test]
async fn a_released_unit_is_sold_again_after_sold_out() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("ONE", 1, 1).await.0, 201);
    assert_eq!(app.reserve("ONE", 1, "first").await.0, 201);
    assert_eq!(
        app.reserve("ONE", 2, "second").await.1["error"],
        json!("OUT_OF_STOCK")
    );
    assert_eq!(
        app.call("DELETE", "/vouchers/ONE/reservations/first")
            .await
            .0,
        200
    );
    let (s, b) = app.reserve("ONE", 2, "second").await;
    assert_eq!(s, 201, "{b}");
    assert_eq!(
        app.reserve("ONE", 3, "third").await.1["error"],
        json!("OUT_OF_STOCK")
    );
    let c = app.balanced_counters("ONE").await;
    assert_eq!(
        (c["reserved"].clone(), c["released"].clone()),
        (json!(1), json!(1))
    );
}

#[actix_web::test]
async fn expiry_releases_each_reservation_exactly_once_even_with_two_sweepers() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("TTL", 3, 1).await.0, 201);
    let answers = join_all((1..=3).map(|i| app.reserve("TTL", i, format!("ttl-{i}")))).await;
    assert_eq!(tally(&answers).get("201"), Some(&3));
    assert_eq!(
        app.call("POST", "/vouchers/TTL/reservations/ttl-1/confirm")
            .await
            .0,
        200
    );
    assert_eq!(
        app.reserve("TTL", 9, "late").await.1["error"],
        json!("OUT_OF_STOCK")
    );
    // Nothing is due before the TTL.
    assert_eq!(app.engine.expire_due(1000).await.unwrap(), 0);
    app.clock.advance_ms(15 * 60 * 1000 + 1);
    let now = app.engine.now_ms();
    let (a, b) = tokio::join!(
        app.engine.expire_due(1000),
        app.ledger.expire_due(now, 1000)
    );
    let released: i64 = a.unwrap() + b.unwrap().iter().map(|r| r.units).sum::<i64>();
    assert_eq!(released, 2, "the two unconfirmed reservations, each once");
    assert_eq!(app.engine.expire_due(1000).await.unwrap(), 0);
    let (_, r) = app.call("GET", "/vouchers/TTL/reservations/ttl-2").await;
    assert_eq!(r["status"], json!("RELEASED"));
    let (_, r) = app.call("GET", "/vouchers/TTL/reservations/ttl-1").await;
    assert_eq!(r["status"], json!("CONFIRMED"));
    let c = app.balanced_counters("TTL").await;
    assert_eq!(
        (c["released"].clone(), c["confirmed"].clone()),
        (json!(2), json!(1))
    );
    // Whichever sweeper released them, the node learns of the restock (its own notice or the
    // sold-out probe) and sells the units again; a confirm of an expired one is refused.
    let engine = app.engine.clone();
    crate::helpers::eventually("restock seen", std::time::Duration::from_secs(10), || {
        let e = engine.clone();
        async move { !e.is_sold_out_locally("TTL") }
    })
    .await;
    let (s, b) = app.reserve("TTL", 9, "late").await;
    assert_eq!(s, 201, "{b}");
    assert_eq!(
        app.call("POST", "/vouchers/TTL/reservations/ttl-2/confirm")
            .await
            .1["error"],
        json!("RESERVATION_RELEASED")
    );
    app.balanced_counters("TTL").await;
}

#[actix_web::test]
async fn a_batch_against_a_reaped_lease_is_fenced() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("FENCE", 50, 1).await.0, 201);
    assert_eq!(app.warm("FENCE").await, 204);
    let c = app.balanced_counters("FENCE").await;
    let leased = c["leasedUnused"].as_i64().unwrap();
    assert!(leased > 0, "warm-up took a lease: {c}");
    // Another node with a clock far ahead reaps the lease while this node still trusts it.
    let future = app.engine.now_ms() + 3_600_000;
    let reaped = app.ledger.reap_expired(future).await.unwrap();
    assert_eq!(reaped.iter().map(|r| r.units).sum::<i64>(), leased);
    let (s, b) = app.reserve("FENCE", 1, "f-1").await;
    assert_eq!(
        (s, b["error"].as_str()),
        (503, Some("UNAVAILABLE")),
        "no 201 from a fenced lease"
    );
    let c = app.balanced_counters("FENCE").await;
    assert_eq!(c["reserved"], json!(0));
    // The node takes a new lease and the retries succeed.
    let answers = join_all((1..=5).map(|i| app.reserve("FENCE", i, format!("f-{i}")))).await;
    assert_eq!(tally(&answers).get("201"), Some(&5));
    let c = app.balanced_counters("FENCE").await;
    assert_eq!(c["reserved"], json!(5));
}

#[actix_web::test]
async fn idle_units_go_back_to_free() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("IDLE", 40, 1).await.0, 201);
    assert_eq!(app.reserve("IDLE", 1, "idle-1").await.0, 201);
    let c = app.balanced_counters("IDLE").await;
    assert!(
        c["leasedUnused"].as_i64().unwrap() > 0,
        "the actor holds a lease: {c}"
    );
    // No traffic for longer than the idle timeout: the actor hands its units back.
    app.clock.advance_ms(5_001);
    crate::helpers::eventually(
        "idle lease returned",
        std::time::Duration::from_secs(10),
        || {
            let ledger = app.ledger.clone();
            async move {
                ledger
                    .counters("IDLE")
                    .await
                    .unwrap()
                    .unwrap()
                    .leased_unused
                    == 0
            }
        },
    )
    .await;
    let c = app.balanced_counters("IDLE").await;
    assert_eq!(
        (c["free"].clone(), c["reserved"].clone()),
        (json!(39), json!(1))
    );
}

/// Between two requests of a sale that is not idle, the actor keeps its lease (nothing in
/// flight is no reason to give it back) and renews it before it runs out.
#[actix_web::test]
async fn a_lease_is_kept_and_renewed_between_requests() {
    let app = crate::helpers::spawn_app_with(|s| {
        s.engine.lease_ttl_ms = 20_000;
        s.engine.lease_safety_ms = 2_000;
        s.engine.lease_idle_timeout_ms = 3_600_000;
    })
    .await;
    assert_eq!(app.create_voucher("KEEP", 1000, 1).await.0, 201);
    assert_eq!(app.reserve("KEEP", 1, "keep-1").await.0, 201);
    let pool = sqlx::SqlitePool::connect(&app.db_url).await.unwrap();
    let leases = |pool: sqlx::SqlitePool| async move {
        let rows: Vec<(i64, String, i64)> =
            sqlx::query_as("SELECT id, state, expires_at FROM leases WHERE voucher_code = 'KEEP'")
                .fetch_all(&pool)
                .await
                .unwrap();
        rows
    };
    let before = leases(pool.clone()).await;
    assert_eq!(before.len(), 1, "{before:?}");
    // Past half the lease's life, still outside its safety margin, far from idle: a tick of
    // the actor renews it.
    app.clock.advance_ms(12_000);
    crate::helpers::eventually(
        "the lease is renewed",
        std::time::Duration::from_secs(10),
        || {
            let pool = pool.clone();
            let was = before[0].2;
            async move { leases(pool).await.iter().any(|l| l.2 > was) }
        },
    )
    .await;
    let after = leases(pool).await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!((after[0].0, after[0].1.as_str()), (before[0].0, "ACTIVE"));
    assert_eq!(app.reserve("KEEP", 2, "keep-2").await.0, 201);
}

/// A sold-out actor asks the ledger whether units came back once per `soldout_probe_ms` of the
/// engine's clock, not at every tick: after a probe, it makes no further grant call until that
/// time has passed again, however many ticks pass. The ticks are counted by a control voucher
/// whose idle lease goes back (twice, so at least one whole tick period of every actor passed).
#[actix_web::test]
async fn a_sold_out_actor_probes_once_per_probe_interval_not_every_tick() {
    let app = crate::helpers::spawn_app_with(|s| {
        s.engine.soldout_probe_ms = 100_000;
        s.engine.reservation_ttl_ms = 86_400_000;
        s.engine.lease_idle_timeout_ms = 5_000;
        s.engine.lease_ttl_ms = 86_400_000;
        s.engine.actor_idle_stop_ms = 86_400_000;
    })
    .await;
    assert_eq!(app.create_voucher("GONE", 1, 1).await.0, 201);
    assert_eq!(app.create_voucher("TICKS", 1000, 1).await.0, 201);
    assert_eq!(app.reserve("GONE", 1, "gone-1").await.0, 201);
    assert_eq!(app.reserve("GONE", 2, "gone-2").await.0, 409);
    // GONE's own count: the node-wide metric also counts other tests' vouchers (one recorder
    // per process).
    let empty_grants = || async { app.engine.empty_grants("GONE") };
    let before = empty_grants().await;
    app.clock.advance_ms(100_001);
    crate::helpers::eventually(
        "the probe after the interval",
        std::time::Duration::from_secs(10),
        || async { empty_grants().await == before + 1 },
    )
    .await;
    // Idle for longer than the control's timeout (and its demand estimate down to zero, so it
    // does not lease again at once), still far within the probe interval.
    app.two_tick_periods("TICKS", 10_000).await;
    assert_eq!(
        empty_grants().await,
        before + 1,
        "no second probe within soldout_probe_ms"
    );
}

/// Voucher actors live on the HTTP workers' threads (a reserve that arrives on its actor's
/// worker never changes thread), on the shards with `engine.actors_on_http_workers` off; both
/// serve the same.
#[actix_web::test]
async fn voucher_actors_live_on_the_http_workers_unless_switched_off() {
    for on in [true, false] {
        let app = crate::helpers::spawn_app_with(|s| {
            s.engine.actors_on_http_workers = on;
            s.http.workers = 2;
        })
        .await;
        assert_eq!(app.engine.actor_on_http_worker("HOME0"), None);
        for i in 0..6 {
            let code = format!("HOME{i}");
            assert_eq!(app.create_voucher(&code, 10, 1).await.0, 201);
            assert_eq!(app.reserve(&code, 1, format!("home-{i}")).await.0, 201);
            assert_eq!(
                app.engine.actor_on_http_worker(&code),
                Some(on),
                "{code}, actors_on_http_workers = {on}"
            );
            assert_eq!(app.balanced_counters(&code).await["reserved"], json!(1));
        }
    }
}

//! Races: a flood for a few units, copies of one order, one customer with many orders, and the
//! sold-out short-circuit that must still honour retries of winning orders.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;
use std::time::Duration;

use sqlx::Connection;

use futures_util::future::join_all;
use serde_json::json;

use crate::helpers::{eventually, spawn_app, tally};

#[actix_web::test]
async fn two_hundred_customers_race_for_ten_units() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("RACE10", 10, 1).await.0, 201);
    let answers = join_all((1..=200).map(|i| app.reserve("RACE10", i, format!("race-{i}")))).await;
    let t = tally(&answers);
    assert_eq!(t.get("201"), Some(&10), "{t:?}");
    assert_eq!(t.get("409 OUT_OF_STOCK"), Some(&190), "{t:?}");
    let c = app.balanced_counters("RACE10").await;
    assert_eq!(c["reserved"], json!(10));
    assert_eq!(
        c["free"].as_i64().unwrap() + c["leasedUnused"].as_i64().unwrap(),
        0
    );
    // Every 201 is a row in the ledger, of the customer that got it.
    let winners: Vec<(usize, &str)> = answers
        .iter()
        .enumerate()
        .filter(|(_, (s, _))| *s == 201)
        .map(|(i, (_, body))| (i + 1, body["orderId"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(winners.len(), 10);
    let created: BTreeSet<String> = winners.iter().map(|(_, o)| o.to_string()).collect();
    crate::audit::books(&app.db_url, "RACE10")
        .await
        .assert_matches_clients("RACE10", &created);
    for (customer, order) in winners {
        assert_eq!(
            order,
            format!("race-{customer}"),
            "the 201 names the order sent"
        );
        let (s, r) = app
            .call("GET", &format!("/vouchers/RACE10/reservations/{order}"))
            .await;
        assert_eq!(
            (s, r["status"].as_str(), r["customerId"].as_u64()),
            (200, Some("RESERVED"), Some(customer as u64))
        );
    }
}

#[actix_web::test]
async fn copies_of_one_order_take_one_unit_and_retries_survive_sold_out() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("ONCE", 1, 5).await.0, 201);
    let answers = join_all((0..100).map(|_| app.reserve("ONCE", 7, "order-7"))).await;
    assert!(
        answers.iter().all(|(s, _)| *s == 201),
        "{:?}",
        tally(&answers)
    );
    let first = &answers[0].1;
    assert!(
        answers.iter().all(|(_, b)| b == first),
        "every copy gets the same body"
    );
    let c = app.balanced_counters("ONCE").await;
    assert_eq!(c["reserved"], json!(1));

    // The only unit is gone: the frontend answers from memory once the flag is up.
    let engine = app.engine.clone();
    eventually("sold-out flag", Duration::from_secs(10), || {
        let e = engine.clone();
        async move {
            let _ = &e;
            e.is_sold_out_locally("ONCE")
        }
    })
    .await;
    let before = app.engine.short_circuits("ONCE");
    let retry = app.reserve("ONCE", 7, "order-7").await;
    assert_eq!(
        (retry.0, &retry.1),
        (201, first),
        "a retry of the winner still gets its 201"
    );
    let others = join_all((100..120).map(|i| app.reserve("ONCE", i, format!("late-{i}")))).await;
    assert_eq!(tally(&others).get("409 OUT_OF_STOCK"), Some(&20));
    assert_eq!(
        app.engine.short_circuits("ONCE") - before,
        21,
        "the retry and the 20 late orders were answered without messaging the actor"
    );
    // The same order id from another customer is a clash, not a retry.
    let clash = app.reserve("ONCE", 8, "order-7").await;
    assert_eq!(clash.1["error"], json!("ALREADY_USED"));
    app.balanced_counters("ONCE").await;
}

#[actix_web::test]
async fn one_customer_many_orders_respects_the_per_user_limit() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("LIMIT1", 100, 1).await.0, 201);
    assert_eq!(app.create_voucher("LIMIT3", 100, 3).await.0, 201);
    for (code, limit) in [("LIMIT1", 1usize), ("LIMIT3", 3)] {
        let answers = join_all((0..50).map(|i| app.reserve(code, 42, format!("{code}-{i}")))).await;
        let t = tally(&answers);
        assert_eq!(t.get("201"), Some(&limit), "{code}: {t:?}");
        assert_eq!(
            t.get("409 ALREADY_USED"),
            Some(&(50 - limit)),
            "{code}: {t:?}"
        );
        let c = app.balanced_counters(code).await;
        assert_eq!(c["reserved"], json!(limit));
    }
}

#[actix_web::test]
async fn overload_is_refused_at_once_with_503_and_retry_after() {
    // A real overload: the ledger's writer is held by another connection, so the one batch in
    // flight cannot commit and every reserve past the bounded queue must be refused at once.
    let app = crate::helpers::spawn_app_with(|s| {
        s.engine.max_pending = 5;
        s.engine.max_batch = 1;
    })
    .await;
    assert_eq!(app.create_voucher("FULL", 100, 1).await.0, 201);
    assert_eq!(app.warm("FULL").await, 204);
    let leased = app.balanced_counters("FULL").await["leasedUnused"]
        .as_i64()
        .unwrap_or(0);
    assert!(leased >= 1, "warm-up took a lease");

    let mut blocker = sqlx::SqliteConnection::connect(&app.db_url).await.unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut blocker)
        .await
        .expect("hold the writer");

    let url = format!("{}/vouchers/FULL/reservations", app.base);
    let answers = Rc::new(RefCell::new(Vec::new()));
    for i in 1..=30 {
        let (c, url, answers) = (app.client.clone(), url.clone(), answers.clone());
        actix_rt::spawn(async move {
            let body =
                json!({ "customerId": i, "orderId": format!("full-{i}"), "orderAmount": 5000 });
            let mut res = c.post(url).send_json(&body).await.expect("sent");
            let retry_after = res
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let body: serde_json::Value = res.json().await.expect("json");
            answers
                .borrow_mut()
                .push((res.status().as_u16(), body, retry_after, i));
        });
    }
    // One request is in the stuck batch, five wait in the queue: the other 24 are refused
    // while the writer is still held.
    let refused = || answers.borrow().iter().filter(|a| a.0 == 503).count();
    eventually(
        "24 refusals while the ledger is stuck",
        Duration::from_secs(20),
        || {
            let n = refused();
            async move { n >= 24 }
        },
    )
    .await;
    assert_eq!(
        answers.borrow().len(),
        24,
        "nothing but refusals before the writer is free"
    );
    for (status, body, retry_after, _) in answers.borrow().iter() {
        assert_eq!((*status, &body["error"]), (503, &json!("UNAVAILABLE")));
        assert!(
            matches!(retry_after, Some(s) if *s >= 1),
            "Retry-After: {retry_after:?}"
        );
    }

    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    eventually("every answer", Duration::from_secs(20), || {
        let n = answers.borrow().len();
        async move { n == 30 }
    })
    .await;
    let created: BTreeSet<String> = answers
        .borrow()
        .iter()
        .filter(|a| a.0 == 201)
        .map(|a| format!("full-{}", a.3))
        .collect();
    assert_eq!(
        created.len(),
        6,
        "the batch in flight and the queue are served once free"
    );
    app.balanced_counters("FULL").await;
    crate::audit::books(&app.db_url, "FULL")
        .await
        .assert_matches_clients("FULL", &created);
}

/// A voucher the ledger cannot write now (its writer held by another connection past SQLite's
/// busy timeout) gets `503 UNAVAILABLE`, never `409 ALREADY_EXISTS`: only a unique violation
/// means the code exists. Once the writer is free, the same request creates it.
#[actix_web::test]
async fn a_create_the_ledger_cannot_write_is_unavailable_not_a_conflict() {
    let app = crate::helpers::spawn_app_with(|s| s.ledger.timeout_ms = 60_000).await;
    let mut blocker = sqlx::SqliteConnection::connect(&app.db_url).await.unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut blocker)
        .await
        .expect("hold the writer");
    let (s, b) = app.create_voucher("BUSY", 10, 1).await;
    assert_eq!((s, b["error"].as_str()), (503, Some("UNAVAILABLE")), "{b}");
    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    assert_eq!(app.create_voucher("BUSY", 10, 1).await.0, 201);
    assert_eq!(app.create_voucher("BUSY", 10, 1).await.0, 409);
}

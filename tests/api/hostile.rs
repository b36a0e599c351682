//! Abusive traffic (DESIGN §4 and §6): the precedence rule on every path, unknown codes answered
//! from memory, rate limits, and service credentials on the checkout routes. Each test checks
//! the ledger's rows, not only the statuses: a refused request leaves no trace.

use std::time::Duration;

use futures_util::future::join_all;
use serde_json::{json, Value};

use crate::audit;
use crate::helpers::{
    error, eventually, metric_sum, metrics_text, send, spawn_app, spawn_app_with, tally, TestApp,
    TOKEN,
};

async fn patch(app: &TestApp, code: &str, body: Value) {
    let url = format!("{}/admin/vouchers/{code}", app.base);
    let (s, b) = send(&app.client, "PATCH", &url, Some(TOKEN), Some(&body)).await;
    assert_eq!(s, 200, "{b}");
}

/// Creates a voucher straight in the ledger, as another node without Redis would.
async fn create_behind_the_node(app: &TestApp, code: &str) {
    let v = vouchers::domain::Voucher {
        code: code.into(),
        discount_amount: 100,
        min_order_amount: 0,
        total_limit: 3,
        per_user_limit: 1,
        starts_at: 0,
        ends_at: i64::MAX / 2,
        status: vouchers::domain::VoucherStatus::Active,
        limits: Default::default(),
    };
    app.ledger
        .create_voucher(&v, app.engine.now_ms())
        .await
        .expect("create in the ledger");
}

/// A reserve with extra headers, answering the status, the error code and `Retry-After`.
async fn reserve_with(
    app: &TestApp,
    code: &str,
    customer: i64,
    order: &str,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, Option<String>) {
    let mut req = app
        .client
        .post(format!("{}/vouchers/{code}/reservations", app.base));
    for (k, v) in headers {
        req = req.insert_header((*k, *v));
    }
    let mut res = req
        .send_json(&json!({"customerId": customer, "orderId": order, "orderAmount": 5000}))
        .await
        .expect("request sent");
    let retry_after = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let body: Value = res.json().await.unwrap_or(Value::Null);
    (
        res.status().as_u16(),
        body["error"].as_str().map(String::from),
        retry_after,
    )
}

#[actix_web::test]
async fn a_stored_order_replays_after_pause_and_end_and_new_orders_get_422_first() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("PREC", 5, 1).await.0, 201);
    let won = app.reserve("PREC", 1, "prec-1").await;
    assert_eq!(won.0, 201);

    patch(&app, "PREC", json!({"status": "PAUSED"})).await;
    let again = app.reserve("PREC", 1, "prec-1").await;
    assert_eq!(again, won, "a retry after the pause gets the same 201");
    // Past the actor's memory of recent 201s: the ledger's row answers.
    app.clock.advance_ms(1_000);
    assert_eq!(
        app.reserve("PREC", 1, "prec-1").await,
        won,
        "from the ledger too"
    );
    for (customer, order, why) in [
        (2, "prec-2", "a new order"),
        (1, "prec-1b", "a customer at their limit"),
        (9, "prec-1", "another customer's order id"),
    ] {
        assert_eq!(
            error(&app.reserve("PREC", customer, order).await),
            (422, Some("NOT_ELIGIBLE"), Some("PAUSED")),
            "{why}: 422 comes before 409"
        );
    }

    patch(
        &app,
        "PREC",
        json!({"status": "ACTIVE", "endsAt": "2021-01-01T00:00:00Z"}),
    )
    .await;
    app.clock.advance_ms(1_000);
    assert_eq!(
        app.reserve("PREC", 1, "prec-1").await,
        won,
        "and after endsAt"
    );
    assert_eq!(
        error(&app.reserve("PREC", 3, "prec-3").await),
        (422, Some("NOT_ELIGIBLE"), Some("ENDED"))
    );
    // A released order is not replayed: its retry is a new order, refused as such.
    let url = format!("{}/vouchers/PREC/reservations/prec-1", app.base);
    assert_eq!(send(&app.client, "DELETE", &url, None, None).await.0, 200);
    assert_eq!(
        error(&app.reserve("PREC", 1, "prec-1").await),
        (422, Some("NOT_ELIGIBLE"), Some("ENDED"))
    );
    let books = audit::books(&app.db_url, "PREC").await;
    books.assert_balanced("PREC");
    assert_eq!((books.reserved, books.released), (0, 1));
}

#[actix_web::test]
async fn a_released_order_is_not_replayed_from_memory() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("GONE", 5, 2).await.0, 201);
    assert_eq!(app.reserve("GONE", 1, "gone-1").await.0, 201);
    let url = format!("{}/vouchers/GONE/reservations/gone-1", app.base);
    assert_eq!(send(&app.client, "DELETE", &url, None, None).await.0, 200);
    // The retry comes right away (the actor remembers the 201), but the release voided it.
    assert_eq!(
        error(&app.reserve("GONE", 1, "gone-1").await),
        (409, Some("ALREADY_USED"), None),
        "a released order id is used up"
    );
    let books = audit::books(&app.db_url, "GONE").await;
    books.assert_balanced("GONE");
    assert_eq!((books.reserved, books.released), (0, 1));
}

#[actix_web::test]
async fn a_sold_out_voucher_answers_with_the_same_precedence_from_memory() {
    sold_out_precedence(None).await;
}

#[actix_web::test]
async fn a_large_sold_out_voucher_asks_the_ledger_on_bloom_hits_with_the_same_answers() {
    sold_out_precedence(Some(0)).await;
}

/// `exact_max`: `Some(0)` makes the winners' sets Bloom filters, whose hits the ledger answers.
async fn sold_out_precedence(exact_max: Option<usize>) {
    let app = spawn_app_with(|s| {
        if let Some(n) = exact_max {
            s.engine.won_set_exact_max = n;
        }
    })
    .await;
    assert_eq!(app.create_voucher("SOLD", 2, 1).await.0, 201);
    let won = app.reserve("SOLD", 1, "sold-1").await;
    assert_eq!(won.0, 201);
    assert_eq!(app.reserve("SOLD", 2, "sold-2").await.0, 201);
    // Without units, before or after the flag is up: the customer at the limit is told so.
    assert_eq!(
        error(&app.reserve("SOLD", 1, "sold-1b").await),
        (409, Some("ALREADY_USED"), None)
    );
    let engine = app.engine.clone();
    eventually("sold-out flag", Duration::from_secs(10), || {
        let e = engine.clone();
        async move { e.is_sold_out_locally("SOLD") }
    })
    .await;
    let before = app.engine.short_circuits("SOLD");
    assert_eq!(
        app.reserve("SOLD", 1, "sold-1").await,
        won,
        "the winner's retry"
    );
    assert_eq!(
        error(&app.reserve("SOLD", 1, "sold-1c").await),
        (409, Some("ALREADY_USED"), None),
        "a customer at their limit"
    );
    assert_eq!(
        error(&app.reserve("SOLD", 7, "sold-1").await),
        (409, Some("ALREADY_USED"), None),
        "a winning order id under another customer"
    );
    assert_eq!(
        error(&app.reserve("SOLD", 8, "sold-8").await),
        (409, Some("OUT_OF_STOCK"), None)
    );
    patch(&app, "SOLD", json!({"status": "PAUSED"})).await;
    eventually(
        "the frontend sees the pause",
        Duration::from_secs(10),
        || async {
            error(&app.reserve("SOLD", 9, "sold-9").await)
                == (422, Some("NOT_ELIGIBLE"), Some("PAUSED"))
        },
    )
    .await;
    assert_eq!(
        error(&app.reserve("SOLD", 1, "sold-1d").await),
        (422, Some("NOT_ELIGIBLE"), Some("PAUSED")),
        "422 before ALREADY_USED"
    );
    assert_eq!(
        app.reserve("SOLD", 1, "sold-1").await,
        won,
        "paused and sold out"
    );
    assert!(app.engine.is_sold_out_locally("SOLD"));
    assert!(
        app.engine.short_circuits("SOLD") - before >= 7,
        "these were answered by the frontend, not the actor"
    );
    let books = audit::books(&app.db_url, "SOLD").await;
    books.assert_balanced("SOLD");
    assert_eq!(books.reserved, 2);
}

#[actix_web::test]
async fn unknown_codes_get_404_without_an_actor_or_a_ledger_read() {
    let app = spawn_app_with(|s| s.engine.known_codes_refresh_ms = 3_600_000).await;
    assert_eq!(app.create_voucher("REAL", 5, 1).await.0, 201);
    let (reads, actors) = (app.engine.known_code_reads(), app.engine.actor_count());
    // Created behind this node's back (another node, no Redis): the ledger has it, this node
    // does not know it yet, so every answer below comes from memory.
    create_behind_the_node(&app, "JUNKX").await;
    let codes: Vec<String> = (0..300).map(|i| format!("JUNK{i}")).collect();
    let junk = join_all(codes.iter().zip(1..).map(|(c, i)| app.reserve(c, i, "j"))).await;
    assert_eq!(tally(&junk).get("404 NOT_FOUND"), Some(&300));
    assert_eq!(app.reserve("JUNKX", 1, "j").await.0, 404);
    for (method, path) in [
        ("GET", "/vouchers/JUNKX"),
        ("GET", "/vouchers/JUNKX/reservations/o"),
        ("POST", "/vouchers/JUNKX/reservations/o/confirm"),
        ("DELETE", "/vouchers/JUNKX/reservations/o"),
    ] {
        assert_eq!(app.call(method, path).await.0, 404, "{method} {path}");
    }
    assert_eq!(
        app.engine.known_code_reads(),
        reads,
        "no ledger read for junk"
    );
    assert_eq!(app.engine.actor_count(), actors, "no actor for junk");
    // A code created through this node is known at once.
    assert_eq!(app.create_voucher("FRESH", 5, 1).await.0, 201);
    assert_eq!(app.reserve("FRESH", 1, "fresh-1").await.0, 201);
    assert_eq!(app.reserve("REAL", 1, "real-1").await.0, 201);
}

#[actix_web::test]
async fn a_code_created_elsewhere_is_found_by_the_next_read() {
    // No Redis: another node created the code straight in the shared ledger.
    let app = spawn_app_with(|s| s.engine.known_codes_refresh_ms = 0).await;
    assert_eq!(app.reserve("LATER", 1, "later-1").await.0, 404);
    create_behind_the_node(&app, "LATER").await;
    let reads = app.engine.known_code_reads();
    assert_eq!(app.reserve("LATER", 1, "later-1").await.0, 201);
    assert!(
        app.engine.known_code_reads() > reads,
        "the node read the codes again to find it"
    );
}

#[actix_web::test]
async fn one_customer_flooding_gets_its_burst_then_429_and_nobody_else_is_hurt() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("FLOOD", 100, 1).await.0, 201);
    let limited = || async {
        let m = metrics_text(&app.client, &app.base).await;
        metric_sum(&m, "vouchers_rate_limited_total", &["limiter=\"customer\""])
    };
    let limited_before = limited().await;
    let burst = vouchers::config::Settings::defaults()
        .limits
        .per_customer_burst as usize;
    let answers = join_all((0..1000).map(|i| app.reserve("FLOOD", 42, format!("flood-{i}")))).await;
    let t = tally(&answers);
    assert_eq!(t.get("201"), Some(&1), "{t:?}");
    // Every answered reserve left the in-flight count (which turns the junk-code tarpit on).
    assert_eq!(app.engine.reserves_in_flight(), 0);
    assert_eq!(t.get("409 ALREADY_USED"), Some(&(burst - 1)), "{t:?}");
    assert_eq!(t.get("429 RATE_LIMITED"), Some(&(1000 - burst)), "{t:?}");
    let (s, e, retry) = reserve_with(&app, "FLOOD", 42, "flood-x", &[]).await;
    // 10 a second: the next token is 100 ms away, rounded up to whole seconds.
    assert_eq!(
        (s, e.as_deref(), retry.as_deref()),
        (429, Some("RATE_LIMITED"), Some("1"))
    );
    // Other customers are not affected, and the limited customer is let in once Retry-After
    // has passed (not before: the clock has not moved).
    assert_eq!(app.reserve("FLOOD", 43, "other-1").await.0, 201);
    assert_eq!(reserve_with(&app, "FLOOD", 42, "flood-z", &[]).await.0, 429);
    app.clock.advance_ms(1_000);
    assert_eq!(
        error(&app.reserve("FLOOD", 42, "flood-y").await),
        (409, Some("ALREADY_USED"), None)
    );
    let books = audit::books(&app.db_url, "FLOOD").await;
    books.assert_balanced("FLOOD");
    assert_eq!(books.reserved, 2, "the ledger holds exactly the units sold");
    // Process-wide (another test's voucher limits its customers too): at least these.
    assert!(limited().await - limited_before >= (1000 - burst + 2) as f64);
}

#[actix_web::test]
async fn address_and_voucher_limits_refuse_in_memory() {
    let app = spawn_app_with(|s| {
        s.limits.per_address_per_sec = 1;
        s.limits.per_address_burst = 3;
        s.limits.address_header = "X-Forwarded-For".into();
    })
    .await;
    assert_eq!(app.create_voucher("ADDR", 100, 1).await.0, 201);
    // The proxy appends the address it saw; what the bot wrote before it changes nothing.
    for c in 1..=3 {
        let spoofed = format!("10.9.8.{c}, 203.0.113.7");
        let xff = [("X-Forwarded-For", spoofed.as_str())];
        assert_eq!(
            reserve_with(&app, "ADDR", c, &format!("a-{c}"), &xff)
                .await
                .0,
            201
        );
    }
    let xff = [("X-Forwarded-For", "10.9.8.4, 203.0.113.7")];
    let (s, e, retry) = reserve_with(&app, "ADDR", 4, "a-4", &xff).await;
    assert_eq!(
        (s, e.as_deref(), retry.as_deref()),
        (429, Some("RATE_LIMITED"), Some("1"))
    );
    let human = [("X-Forwarded-For", "203.0.113.7, 198.51.100.1")];
    assert_eq!(reserve_with(&app, "ADDR", 5, "a-5", &human).await.0, 201);
    assert_eq!(audit::books(&app.db_url, "ADDR").await.reserved, 4);

    let app = spawn_app_with(|s| s.limits.admission_per_sec = 5).await;
    assert_eq!(app.create_voucher("ADMIT", 100, 1).await.0, 201);
    let answers = join_all((1..=8).map(|c| app.reserve("ADMIT", c, format!("ad-{c}")))).await;
    let t = tally(&answers);
    assert_eq!(
        (t.get("201"), t.get("429 RATE_LIMITED")),
        (Some(&5), Some(&3)),
        "{t:?}"
    );
    // Process-wide (other tests limit vouchers too): at least these three.
    let m = metrics_text(&app.client, &app.base).await;
    assert!(metric_sum(&m, "vouchers_rate_limited_total", &["limiter=\"voucher\""]) >= 3.0);
    assert_eq!(audit::books(&app.db_url, "ADMIT").await.reserved, 5);
}

#[actix_web::test]
async fn checkout_routes_need_one_of_the_configured_tokens() {
    let app =
        spawn_app_with(|s| s.http.checkout_tokens = vec!["tok-old".into(), "tok-new".into()]).await;
    assert_eq!(app.create_voucher("AUTH", 5, 1).await.0, 201);
    let url = format!("{}/vouchers/AUTH/reservations", app.base);
    let body = json!({"customerId": 1, "orderId": "auth-1", "orderAmount": 5000});
    for token in [None, Some("wrong"), Some(TOKEN)] {
        let (s, b) = send(&app.client, "POST", &url, token, Some(&body)).await;
        assert_eq!(
            (s, b["error"].as_str()),
            (401, Some("UNAUTHORIZED")),
            "{token:?}"
        );
    }
    assert_eq!(
        audit::books(&app.db_url, "AUTH").await.reserved,
        0,
        "no trace"
    );
    for token in ["tok-old", "tok-new"] {
        assert_eq!(
            send(&app.client, "POST", &url, Some(token), Some(&body))
                .await
                .0,
            201
        );
    }
    let one = format!("{url}/auth-1");
    for (method, path) in [
        ("GET", one.clone()),
        ("POST", format!("{one}/confirm")),
        ("DELETE", one.clone()),
    ] {
        assert_eq!(
            send(&app.client, method, &path, None, None).await.0,
            401,
            "{method} {path}"
        );
    }
    assert_eq!(
        send(&app.client, "GET", &one, Some("tok-new"), None)
            .await
            .0,
        200
    );
    // The public voucher view and health stay open.
    assert_eq!(app.call("GET", "/vouchers/AUTH").await.0, 200);
    assert_eq!(audit::books(&app.db_url, "AUTH").await.reserved, 1);
}

#[actix_web::test]
async fn an_empty_checkout_token_is_refused_at_start() {
    let dir = crate::helpers::temp_dir("emptytoken");
    let mut settings = crate::helpers::test_settings(&format!("sqlite://{}/l.db", dir.display()));
    settings.http.checkout_tokens = vec!["tok".into(), " ".into()];
    let clock = std::sync::Arc::new(vouchers::clock::ManualClock::starting_now());
    let built = vouchers::startup::Application::build(settings, clock).await;
    let err = built.err().expect("an empty token would open the routes");
    assert!(err.to_string().contains("empty token"), "{err}");
}

#[actix_web::test]
async fn a_voucher_sets_its_own_limits_on_create_and_patch() {
    let app = spawn_app().await;
    let (s, b) = app
        .create_voucher_with(json!({
            "code": "OWN", "discountAmount": 100, "totalLimit": 100, "perUserLimit": 5,
            "startsAt": "2020-01-01T00:00:00Z", "endsAt": "2099-01-01T00:00:00Z",
            "customerRatePerSec": 1, "customerBurst": 2
        }))
        .await;
    assert_eq!(
        (s, &b["customerBurst"], &b["admissionRatePerSec"]),
        (201, &json!(2), &Value::Null)
    );
    // The node applies a voucher's limits once it holds the voucher (warm-up loads it).
    assert_eq!(app.warm("OWN").await, 204);
    let t = tally(&join_all((1..=5).map(|i| app.reserve("OWN", 7, format!("own-{i}")))).await);
    assert_eq!(
        (t.get("201"), t.get("429 RATE_LIMITED")),
        (Some(&2), Some(&3)),
        "{t:?}"
    );

    // Off for customers: one customer's 200 requests at once (more than the node's default
    // burst of 128) pass the limits, and the ledger's perUserLimit decides.
    patch(&app, "OWN", json!({"customerRatePerSec": 0})).await;
    let (_, view) = app.admin("OWN").await;
    assert_eq!(view["customerRatePerSec"], json!(0));
    let mut customer = 1000;
    let app_ref = &app;
    eventually("the customer limit is off", Duration::from_secs(10), || {
        customer += 1;
        let app = app_ref;
        async move {
            let t = tally(
                &join_all(
                    (0..200).map(|i| app.reserve("OWN", customer, format!("off-{customer}-{i}"))),
                )
                .await,
            );
            !t.contains_key("429 RATE_LIMITED") && t.get("201") == Some(&5)
        }
    })
    .await;
    // 3 a second for the voucher as a whole.
    patch(&app, "OWN", json!({"admissionRatePerSec": 3})).await;
    app.clock.advance_ms(1_000);
    eventually(
        "the admission limit applies",
        Duration::from_secs(10),
        || async {
            app.clock.advance_ms(1_000);
            let t = tally(
                &join_all((1..=4).map(|i| app.reserve("OWN", 100 + i, format!("x-{i}")))).await,
            );
            t.get("429 RATE_LIMITED") == Some(&1)
        },
    )
    .await;
    // Back to the node's defaults: a burst of 128 per customer, no admission limit.
    patch(
        &app,
        "OWN",
        json!({"customerRatePerSec": null, "customerBurst": null, "admissionRatePerSec": null}),
    )
    .await;
    eventually(
        "the defaults apply again",
        Duration::from_secs(10),
        || async {
            app.clock.advance_ms(1_000);
            let base = app.engine.now_ms();
            let t = tally(
                &join_all((1..=6).map(|i| app.reserve("OWN", 200 + i, format!("d-{base}-{i}"))))
                    .await,
            );
            t.get("201") == Some(&6)
        },
    )
    .await;
    let books = audit::books(&app.db_url, "OWN").await;
    books.assert_balanced("OWN");
}

//! Bad input gets its documented error and leaves the ledger unchanged.

use serde_json::{json, Value};

use crate::helpers::{send, spawn_app, TOKEN};

async fn raw(
    app: &crate::helpers::TestApp,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, Value) {
    let mut req = app
        .client
        .request(method.parse().unwrap(), format!("{}{path}", app.base))
        .insert_header(("Content-Type", "application/json"));
    if let Some(t) = token {
        req = req.insert_header(("Authorization", format!("Bearer {t}")));
    }
    let mut res = req.send_body(body.to_string()).await.expect("sent");
    let bytes = res.body().limit(1 << 20).await.unwrap_or_default();
    (
        res.status().as_u16(),
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[actix_web::test]
async fn malformed_reserves_get_400_or_413_and_change_nothing() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("BAD", 10, 1).await.0, 201);
    let before = app.balanced_counters("BAD").await;
    let long_order = "o".repeat(65);
    let huge = format!(
        r#"{{"customerId":1,"orderId":"x","orderAmount":5000,"pad":"{}"}}"#,
        "p".repeat(17_000)
    );
    let cases: Vec<(String, String, u16, &str)> = vec![
        ("BAD".into(), "{not json".into(), 400, "INVALID_REQUEST"),
        (
            "BAD".into(),
            r#"{"customerId":1,"orderAmount":5000}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "BAD".into(),
            r#"{"customerId":"one","orderId":"a","orderAmount":5000}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "BAD".into(),
            r#"{"customerId":1.5,"orderId":"a","orderAmount":5000}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "BAD".into(),
            r#"{"customerId":0,"orderId":"a","orderAmount":5000}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "BAD".into(),
            r#"{"customerId":-4,"orderId":"a","orderAmount":5000}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "BAD".into(),
            r#"{"customerId":1,"orderId":"a","orderAmount":-1}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "BAD".into(),
            r#"{"customerId":1e30,"orderId":"a","orderAmount":5000}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "BAD".into(),
            r#"{"customerId":99999999999999999999,"orderId":"a","orderAmount":5000}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "BAD".into(),
            r#"{"customerId":1,"orderId":"","orderAmount":5000}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "BAD".into(),
            format!(r#"{{"customerId":1,"orderId":"{long_order}","orderAmount":5000}}"#),
            400,
            "INVALID_REQUEST",
        ),
        (
            "BAD".into(),
            "{\"customerId\":1,\"orderId\":\"tab\\there\",\"orderAmount\":5000}".into(),
            400,
            "INVALID_REQUEST",
        ),
        ("BAD".into(), huge, 413, "PAYLOAD_TOO_LARGE"),
        (
            "bad!code".into(),
            r#"{"customerId":1,"orderId":"a","orderAmount":5000}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "C".repeat(33),
            r#"{"customerId":1,"orderId":"a","orderAmount":5000}"#.into(),
            400,
            "INVALID_REQUEST",
        ),
        (
            "NOSUCH".into(),
            r#"{"customerId":1,"orderId":"a","orderAmount":5000}"#.into(),
            404,
            "NOT_FOUND",
        ),
    ];
    for (code, body, status, error) in &cases {
        let (s, b) = raw(
            &app,
            "POST",
            &format!("/vouchers/{code}/reservations"),
            None,
            body,
        )
        .await;
        assert_eq!(
            (s, b["error"].as_str()),
            (*status, Some(*error)),
            "body {:.80}: {b}",
            body
        );
        if *status == 400 {
            assert!(b["detail"].is_string(), "400 carries a detail: {b}");
        }
    }
    assert_eq!(
        app.balanced_counters("BAD").await,
        before,
        "refused requests leave no trace"
    );
    let (s, _) = app.call("GET", "/vouchers/BAD/reservations/a").await;
    assert_eq!(s, 404);
}

#[actix_web::test]
async fn admin_routes_need_the_token_and_refusals_change_nothing() {
    let app = spawn_app().await;
    let body = json!({"code": "ADM", "discountAmount": 1, "totalLimit": 5, "perUserLimit": 1,
                      "startsAt": "2020-01-01T00:00:00Z", "endsAt": "2099-01-01T00:00:00Z"});
    let url = format!("{}/admin/vouchers", app.base);
    for token in [None, Some("wrong"), Some("")] {
        let (s, b) = send(&app.client, "POST", &url, token, Some(&body)).await;
        assert_eq!((s, b["error"].as_str()), (401, Some("UNAUTHORIZED")));
    }
    let (s, _) = send(&app.client, "GET", &format!("{url}/ADM"), Some(TOKEN), None).await;
    assert_eq!(s, 404, "a refused create leaves no voucher");
    assert_eq!(
        send(&app.client, "POST", &url, Some(TOKEN), Some(&body))
            .await
            .0,
        201
    );
    let (s, b) = send(&app.client, "POST", &url, Some(TOKEN), Some(&body)).await;
    assert_eq!((s, b["error"].as_str()), (409, Some("ALREADY_EXISTS")));
    // Refused edits: no token, wrong token, shrinking the total, unknown status, unknown field.
    let patch_url = format!("{url}/ADM");
    let refused = [
        (None, json!({"totalLimit": 50}), 401),
        (Some("nope"), json!({"status": "PAUSED"}), 401),
        (Some(TOKEN), json!({"totalLimit": 4}), 400),
        (Some(TOKEN), json!({"status": "SLEEPING"}), 400),
        (Some(TOKEN), json!({"perUserLimit": 9}), 400),
        (Some(TOKEN), json!({"endsAt": "2019-01-01T00:00:00Z"}), 400),
    ];
    for (token, patch, status) in refused {
        let (s, b) = send(&app.client, "PATCH", &patch_url, token, Some(&patch)).await;
        assert_eq!(s, status, "{patch}: {b}");
    }
    let c = app.balanced_counters("ADM").await;
    assert_eq!(
        (
            c["totalLimit"].clone(),
            c["status"].clone(),
            c["free"].clone()
        ),
        (json!(5), json!("ACTIVE"), json!(5))
    );
    // Invalid creates.
    for bad in [
        json!({"code": "bad code", "discountAmount": 1, "totalLimit": 5}),
        json!({"code": "X", "discountAmount": -1, "totalLimit": 5}),
        json!({"code": "X", "discountAmount": 1, "totalLimit": 0}),
        json!({"code": "X", "discountAmount": 1, "totalLimit": 5, "perUserLimit": 0}),
        json!({"code": "X", "discountAmount": 1, "totalLimit": 5, "startsAt": "2030-01-01T00:00:00Z", "endsAt": "2029-01-01T00:00:00Z"}),
        json!({"code": "X", "discountAmount": 1, "totalLimit": 5, "startsAt": "yesterday"}),
    ] {
        let (s, b) = send(&app.client, "POST", &url, Some(TOKEN), Some(&bad)).await;
        assert_eq!(
            (s, b["error"].as_str()),
            (400, Some("INVALID_REQUEST")),
            "{bad}"
        );
    }
    let (s, _) = send(&app.client, "GET", &format!("{url}/X"), Some(TOKEN), None).await;
    assert_eq!(s, 404);
    // Warm and read need the token too.
    let (s, _) = send(&app.client, "POST", &format!("{url}/ADM/warm"), None, None).await;
    assert_eq!(s, 401);
    let (s, _) = send(
        &app.client,
        "GET",
        &format!("{url}/ADM"),
        Some("nope"),
        None,
    )
    .await;
    assert_eq!(s, 401);
    // Raising the total grows free.
    let (s, b) = send(
        &app.client,
        "PATCH",
        &patch_url,
        Some(TOKEN),
        Some(&json!({"totalLimit": 8})),
    )
    .await;
    assert_eq!((s, b["free"].clone()), (200, json!(8)), "{b}");
    // The new units are free in the rows, and the books hold (the auditor, not the answer's
    // own `balanced`).
    let books = crate::audit::books(&app.db_url, "ADM").await;
    books.assert_balanced("ADM");
    assert_eq!((books.total, books.free + books.leased_unused), (8, 8));
}

#[actix_web::test]
async fn public_routes_answer_with_the_contract_shapes() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("SHOW", 2, 1).await.0, 201);
    let (s, b) = app.call("GET", "/vouchers/SHOW").await;
    assert_eq!(s, 200);
    for key in [
        "code",
        "discountAmount",
        "minOrderAmount",
        "startsAt",
        "endsAt",
        "status",
        "soldOut",
    ] {
        assert!(b.get(key).is_some(), "missing {key}: {b}");
    }
    assert_eq!(b["soldOut"], json!(false));
    assert_eq!(app.call("GET", "/vouchers/NOPE").await.0, 404);
    assert_eq!(app.call("GET", "/health/live").await.0, 200);
    assert_eq!(app.call("GET", "/health/ready").await.0, 200);
    let (s, b) = app.reserve("SHOW", 1, "show-1").await;
    assert_eq!(s, 201);
    for key in ["orderId", "discountAmount", "expiresAt"] {
        assert!(b.get(key).is_some(), "missing {key}: {b}");
    }
    let text = crate::helpers::metrics_text(&app.client, &app.base).await;
    assert!(
        text.contains("vouchers_reservations_total{outcome=\"created\"}"),
        "{text}"
    );
}

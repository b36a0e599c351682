//! The change feed over HTTP on the embedded ledger (issue 11): `GET /admin/events` needs the
//! admin token, refuses bad bounds with `400` and tells each change once, in order, page by page.
//! The feed through a SIGKILL, with its Redis Stream copy, is in `cluster`.

use serde_json::{json, Value};

use crate::helpers::{send, spawn_app, TOKEN};

#[actix_web::test]
async fn the_feed_tells_each_change_once_in_order_page_by_page() {
    let app = spawn_app().await;
    let get = |path: String, token: Option<&'static str>| {
        let (c, url) = (app.client.clone(), format!("{}{path}", app.base));
        async move { send(&c, "GET", &url, token, None).await }
    };
    // Empty at first, and `next` stays where the reader asked.
    assert_eq!(
        get("/admin/events".into(), Some(TOKEN)).await,
        (200, json!({"events": [], "next": 0}))
    );
    assert_eq!(get("/admin/events".into(), None).await.0, 401);
    assert_eq!(get("/admin/events".into(), Some("wrong")).await.0, 401);
    for bad in [
        "after=-1",
        "after=9223372036854775000",
        "after=x",
        "limit=0",
        "limit=1001",
        "limit=-5",
        "from=3",
    ] {
        let (s, b) = get(format!("/admin/events?{bad}"), Some(TOKEN)).await;
        assert_eq!(
            (s, b["error"].clone()),
            (400, json!("INVALID_REQUEST")),
            "{bad}: {b}"
        );
    }

    assert_eq!(app.create_voucher("FEEDV", 10, 1).await.0, 201);
    for c in 1..=4 {
        assert_eq!(app.reserve("FEEDV", c, format!("feed-{c}")).await.0, 201);
    }
    // A replay and a refusal change nothing, so they are not in the feed.
    assert_eq!(app.reserve("FEEDV", 1, "feed-1").await.0, 201);
    assert_eq!(app.reserve("FEEDV", 1, "feed-other").await.0, 409);
    assert_eq!(
        app.call("POST", "/vouchers/FEEDV/reservations/feed-1/confirm")
            .await
            .0,
        200
    );
    assert_eq!(
        app.call("DELETE", "/vouchers/FEEDV/reservations/feed-2")
            .await
            .0,
        200
    );
    // feed-3 expires: the sweep runs on the app's clock.
    app.clock.advance_ms(3_600_000);
    app.engine.expire_due(100).await.unwrap();

    // Read three at a time: pages join without a gap or a repeat.
    let mut events: Vec<Value> = Vec::new();
    let mut after = 0;
    loop {
        let (s, b) = get(format!("/admin/events?after={after}&limit=3"), Some(TOKEN)).await;
        assert_eq!(s, 200, "{b}");
        let page = b["events"].as_array().unwrap().clone();
        assert!(page.len() <= 3);
        after = b["next"].as_i64().unwrap();
        if page.is_empty() {
            break;
        }
        assert_eq!(page.last().unwrap()["seq"].as_i64(), Some(after));
        events.extend(page);
    }
    let seqs: Vec<i64> = events.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, (1..=8).collect::<Vec<_>>());
    let mut told: Vec<(String, String)> = events
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap().into(),
                e["orderId"].as_str().unwrap().into(),
            )
        })
        .collect();
    // The four reserves came in one or more batches: their order among themselves is the
    // ledger's; every later change comes after all of them here.
    told[..4].sort();
    let want: Vec<(String, String)> = [
        ("RESERVED", "feed-1"),
        ("RESERVED", "feed-2"),
        ("RESERVED", "feed-3"),
        ("RESERVED", "feed-4"),
        ("CONFIRMED", "feed-1"),
        ("RELEASED", "feed-2"),
    ]
    .into_iter()
    .map(|(k, o)| (k.into(), o.into()))
    .collect();
    assert_eq!(&told[..6], &want[..]);
    // feed-3 and feed-4 both expired, in one sweep, last.
    let mut last: Vec<&str> = events[6..]
        .iter()
        .filter(|e| e["type"] == json!("EXPIRED"))
        .map(|e| e["orderId"].as_str().unwrap())
        .collect();
    last.sort();
    assert_eq!(last, ["feed-3", "feed-4"]);
    // Each event names its voucher and the order's customer (feed-N is customer N's).
    for e in &events {
        let order = e["orderId"].as_str().unwrap();
        let customer: i64 = order.trim_start_matches("feed-").parse().unwrap();
        assert_eq!(
            (&e["code"], e["customerId"].as_i64()),
            (&json!("FEEDV"), Some(customer))
        );
        assert!(e["at"].as_str().unwrap().ends_with('Z'), "{e}");
    }
}

/// The relay copies the feed to the Redis Stream, and refuses a stream another ledger's relay
/// made (its `:origin` names that ledger) until the operator clears it.
#[actix_web::test]
#[cfg_attr(no_test_redis, ignore = "needs TEST_REDIS_URL; .ci/run sets it")]
async fn the_relay_copies_the_feed_only_to_a_stream_of_its_own_ledger() {
    let Some(redis_url) = crate::helpers::service_url("TEST_REDIS_URL") else {
        return;
    };
    relay_copies_only_to_its_own_ledgers_stream(&redis_url, false).await;
}

/// The same on a Redis Cluster: the relay's keys beside the stream (`{stream}:origin`,
/// `{stream}:relayer`) share its slot, so its scripts run on the stream's primary.
#[actix_web::test]
#[cfg_attr(
    no_test_redis_cluster,
    ignore = "needs TEST_REDIS_CLUSTER_URL; .ci/run sets it"
)]
async fn the_relay_copies_the_feed_to_a_stream_on_a_redis_cluster() {
    let Some(seeds) = crate::helpers::service_url("TEST_REDIS_CLUSTER_URL") else {
        return;
    };
    relay_copies_only_to_its_own_ledgers_stream(&seeds, true).await;
}

async fn relay_copies_only_to_its_own_ledgers_stream(redis_url: &str, cluster: bool) {
    let stream = format!("test:events:{}", vouchers::startup::random_hex(4));
    // Where the relay keeps the stream's origin: on a cluster, in the stream's slot.
    let origin = if cluster {
        format!("{{{stream}}}:origin")
    } else {
        format!("{stream}:origin")
    };
    let relayer = origin.replace(":origin", ":relayer");
    let mut conn = vouchers::signals::Target::open(redis_url, cluster)
        .unwrap()
        .connect(std::time::Duration::from_secs(2))
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(&origin)
        .arg("another-ledger")
        .query_async(&mut conn)
        .await
        .unwrap();
    // A process of its own: an in-process app with Redis would set the process-wide
    // `vouchers_redis_up` under other tests' feet.
    let dir = crate::helpers::temp_dir("relay");
    let node = crate::helpers::Node::start(
        &format!("sqlite://{}/ledger.db", dir.display()),
        &[
            ("VOUCHERS__REDIS__URL", redis_url),
            (
                "VOUCHERS__REDIS__CLUSTER",
                if cluster { "true" } else { "false" },
            ),
            ("VOUCHERS__REDIS__EVENTS_STREAM", stream.as_str()),
            ("VOUCHERS__REDIS__EVENTS_RELAY_MS", "20"),
        ],
    )
    .await;
    let c = crate::helpers::client();
    let body =
        json!({"code": "RELAYV", "discountAmount": 100, "totalLimit": 10, "perUserLimit": 1});
    assert_eq!(
        crate::helpers::create_voucher(&c, &node.base, &body)
            .await
            .0,
        201
    );
    assert_eq!(
        crate::helpers::reserve(&c, &node.base, "RELAYV", 1, "relay-1")
            .await
            .0,
        201
    );
    let base = node.base.clone();
    crate::helpers::eventually(
        "the relay refuses the foreign stream",
        std::time::Duration::from_secs(10),
        || {
            let (c, base) = (c.clone(), base.clone());
            async move {
                let m = crate::helpers::metrics_text(&c, &base).await;
                crate::helpers::metric_sum(&m, "vouchers_feed_relay_errors_total", &[]) > 0.0
            }
        },
    )
    .await;
    let len = crate::helpers::stream_len(&mut conn, &stream).await;
    assert_eq!(len, 0, "nothing was written to another ledger's stream");
    // Cleared by the operator: the relay takes the stream and copies the feed.
    let _: () = redis::cmd("DEL")
        .arg(&origin)
        .query_async(&mut conn)
        .await
        .unwrap();
    let c2 = conn.clone();
    crate::helpers::eventually(
        "the relay copies the feed",
        std::time::Duration::from_secs(10),
        || {
            let (mut conn, stream) = (c2.clone(), stream.clone());
            async move {
                let len = crate::helpers::stream_len(&mut conn, &stream).await;
                len == 1
            }
        },
    )
    .await;
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(entries[0].0, "1-0");
    assert!(entries[0]
        .1
        .contains(&("orderId".to_string(), "relay-1".to_string())));
    let held: Option<String> = redis::cmd("GET")
        .arg(&origin)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        held.is_some(),
        "the relay marked the stream as its ledger's"
    );
    // The relay stops first, or it would take the stream again.
    drop(node);
    for key in [&stream, &origin, &relayer] {
        let _: () = redis::cmd("DEL")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

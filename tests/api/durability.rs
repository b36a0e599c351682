//! Durability: every `201` survives a SIGKILL of the real binary; after restart the ledger
//! balances, the dead process's leases come back after their TTL, and retries are idempotent.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use futures_util::future::join_all;

use crate::audit::Seen;
use crate::helpers::{client, create_voucher, eventually, send, temp_dir, try_reserve, Node};

const FAST_LEASES: [(&str, &str); 4] = [
    ("VOUCHERS__ENGINE__LEASE_TTL_MS", "2000"),
    ("VOUCHERS__ENGINE__LEASE_SAFETY_MS", "800"),
    ("VOUCHERS__JOBS__REAPER_INTERVAL_MS", "200"),
    ("VOUCHERS__ENGINE__MIN_BLOCK", "50"),
];

#[actix_web::test]
async fn acknowledged_reservations_survive_sigkill() {
    let dir = temp_dir("durability");
    let db = format!("sqlite://{}/ledger.db", dir.display());
    let mut node = Node::start(&db, &FAST_LEASES).await;
    let c = client();
    let body = crate::helpers::voucher_body("DUR", 1000, 1);
    assert_eq!(create_voucher(&c, &node.base, &body).await.0, 201);

    // 32 clients send distinct customers without pause until the process is gone; it dies
    // (SIGKILL) right after the 100th acknowledgement, with requests still in flight.
    let acked = Rc::new(Cell::new(0usize));
    let next = Rc::new(Cell::new(1i64));
    let kill_after = 100;
    let base = node.base.clone();
    let clients = (0..32).map(|_| {
        let (c, base, acked, next) = (c.clone(), base.clone(), acked.clone(), next.clone());
        async move {
            let mut results = Vec::new();
            while next.get() <= 1000 {
                let i = next.get();
                next.set(i + 1);
                let order = format!("dur-{i}");
                let answer = try_reserve(&c, &base, "DUR", i, &order).await;
                let lost = answer.is_none();
                if matches!(answer, Some((201, _))) {
                    acked.set(acked.get() + 1);
                }
                results.push((i, order, answer));
                if lost {
                    break;
                }
            }
            results
        }
    });
    let killer = async {
        eventually("100 acknowledgements", Duration::from_secs(60), || {
            let n = acked.get();
            async move { n >= kill_after }
        })
        .await;
        node.kill();
    };
    let (per_client, ()) = tokio::join!(join_all(clients), killer);
    let results: Vec<(i64, String, Option<crate::helpers::Answer>)> =
        per_client.into_iter().flatten().collect();
    let acknowledged: Vec<&(i64, String, _)> = results
        .iter()
        .filter(|(_, _, a)| matches!(a, Some((201, _))))
        .collect();
    assert!(acknowledged.len() >= kill_after);
    assert!(
        results.iter().any(|(_, _, a)| a.is_none()),
        "some requests were in flight when the process died"
    );

    let node = Node::start(&db, &FAST_LEASES).await;
    for (_, order, answer) in &acknowledged {
        let (s, r) = send(
            &c,
            "GET",
            &format!("{}/vouchers/DUR/reservations/{order}", node.base),
            None,
            None,
        )
        .await;
        assert_eq!(
            (s, r["status"].as_str()),
            (200, Some("RESERVED")),
            "{order} was acknowledged"
        );
        let original = &answer.as_ref().unwrap().1;
        assert_eq!(r["expiresAt"], original["expiresAt"]);
    }
    // The auditor: every 201 is a row, and every other row is an order whose answer was lost
    // in the kill (as sets); the books hold.
    let told = Seen {
        created: acknowledged.iter().map(|(_, o, _)| o.clone()).collect(),
        unknown: results
            .iter()
            .filter(|(_, _, a)| !matches!(a, Some((201, _))))
            .map(|(_, o, _)| o.clone())
            .collect(),
        ..Seen::default()
    };
    let books = crate::audit::books(&db, "DUR").await;
    books.assert_matches("DUR", &told);
    // The restarted node took back what the dead one held in leases: no unit is lost.
    assert_eq!(books.leased_unused, 0, "{books:?}");
    assert_eq!(books.free + books.reserved, 1000, "{books:?}");

    // Every client retries: acknowledged ones replay, the rest are served now, each once.
    let retries = join_all(results.iter().map(|(i, order, _)| {
        let (c, base) = (c.clone(), node.base.clone());
        async move {
            (
                order.clone(),
                try_reserve(&c, &base, "DUR", *i, order).await,
            )
        }
    }))
    .await;
    for (order, answer) in &retries {
        assert!(matches!(answer, Some((201, _))), "{order}: {answer:?}");
    }
    for (_, order, answer) in &acknowledged {
        let again = retries
            .iter()
            .find(|(o, _)| o == order)
            .and_then(|(_, a)| a.as_ref())
            .unwrap();
        assert_eq!(
            &again.1,
            &answer.as_ref().unwrap().1,
            "a retry gets the original 201"
        );
    }
    let books = crate::audit::books(&db, "DUR").await;
    books.assert_matches_clients("DUR", &results.iter().map(|(_, o, _)| o.clone()).collect());
    assert_eq!(
        books.reserved,
        results.len() as i64,
        "one unit per order that was ever sent: {books:?}"
    );
}

#[actix_web::test]
async fn a_graceful_stop_returns_every_unused_unit() {
    let dir = temp_dir("graceful");
    let db = format!("sqlite://{}/ledger.db", dir.display());
    let node = Node::start(&db, &[]).await;
    let c = client();
    let body = crate::helpers::voucher_body("BYE", 500, 1);
    assert_eq!(create_voucher(&c, &node.base, &body).await.0, 201);
    assert_eq!(crate::helpers::warm(&c, &node.base, "BYE").await, 204);
    assert_eq!(
        try_reserve(&c, &node.base, "BYE", 1, "bye-1")
            .await
            .map(|a| a.0),
        Some(201)
    );
    assert!(crate::audit::books(&db, "BYE").await.leased_unused > 0);
    // SIGTERM: stop taking requests, hand leases back, exit.
    let mut node = node;
    node.stop();
    let books = crate::audit::books(&db, "BYE").await;
    books.assert_matches_clients("BYE", &["bye-1".to_string()].into());
    assert_eq!(
        (books.leased_unused, books.free, books.reserved),
        (0, 499, 1)
    );
}

/// Issue 9: a second embedded process on the same data directory refuses to start, says why,
/// and touches nothing: the running node keeps its lease and goes on selling from it.
#[actix_web::test]
async fn a_second_embedded_process_on_the_same_ledger_refuses_to_start() {
    let dir = temp_dir("twice");
    let db = format!("sqlite://{}/ledger.db", dir.display());
    let first = Node::start(&db, &[]).await;
    let c = client();
    let body = crate::helpers::voucher_body("TWICE", 100, 1);
    assert_eq!(create_voucher(&c, &first.base, &body).await.0, 201);
    assert_eq!(
        crate::helpers::reserve(&c, &first.base, "TWICE", 1, "twice-1")
            .await
            .0,
        201
    );
    let before = crate::audit::books(&db, "TWICE").await;
    assert!(before.leased_unused > 0, "the first node holds a lease");

    let mut second = Node::command(&db, crate::helpers::free_port(), &[])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run a second node");
    // It must exit by itself; one still running after the deadline started, which is the bug.
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = second.try_wait().expect("poll the second node") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = second.kill();
            let _ = second.wait();
            panic!("a second node started on the same ledger");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!status.success(), "the second node must not start");
    let mut said = String::new();
    std::io::Read::read_to_string(&mut second.stderr.take().expect("stderr"), &mut said)
        .expect("read its stderr");
    assert!(
        said.contains("another process runs on this ledger"),
        "{said}"
    );

    // Nothing changed: the first node's lease is still there and it still sells from it.
    let after = crate::audit::books(&db, "TWICE").await;
    assert_eq!(
        (after.leased_unused, after.free, after.reserved),
        (before.leased_unused, before.free, before.reserved)
    );
    assert_eq!(
        crate::helpers::reserve(&c, &first.base, "TWICE", 2, "twice-2")
            .await
            .0,
        201
    );
}

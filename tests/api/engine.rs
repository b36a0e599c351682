//! The engine without HTTP: `EngineHandle` over a real SQLite ledger and a manual clock.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use vouchers::clock::{Clock, ManualClock};
use vouchers::config::Settings;
use vouchers::domain::{ReserveRequest, Voucher, VoucherStatus};
use vouchers::engine::{EngineError, EngineHandle};
use vouchers::ledger::{self, Ledger};
use vouchers::signals::Publisher;

use crate::audit::Seen;
use crate::helpers::{eventually, temp_dir, test_settings};

/// An engine on a fresh SQLite ledger, its clock, and the ledger's URL for the auditor.
async fn engine() -> (EngineHandle, ManualClock, String) {
    let dir = temp_dir("engine");
    let url = format!("sqlite://{}/ledger.db", dir.display());
    let settings = test_settings(&url);
    // Batches go through the node-wide group committer, as in the service.
    let ledger = Arc::new(ledger::NodeLedger::start(
        ledger::connect(&url, 2).await.unwrap(),
        tokio::runtime::Handle::current(),
        &settings.ledger,
    ));
    let clock = ManualClock::starting_now();
    let (engine, _shards) = EngineHandle::start(
        ledger,
        Arc::new(clock.clone()),
        settings.engine.clone(),
        "engine-test".into(),
        Duration::from_secs(5),
        Publisher::disabled(),
        &settings,
    );
    (engine, clock, url)
}

/// A voucher on sale from just before `now` for an hour, one per customer.
fn on_sale(code: &str, discount_amount: i64, total_limit: i64, now: i64) -> Voucher {
    Voucher {
        code: code.into(),
        discount_amount,
        min_order_amount: 0,
        total_limit,
        per_user_limit: 1,
        starts_at: now - 1,
        ends_at: now + 3_600_000,
        status: VoucherStatus::Active,
        limits: Default::default(),
    }
}

fn req(customer: i64, order: &str) -> ReserveRequest {
    ReserveRequest {
        customer_id: customer,
        order_id: order.into(),
        order_amount: 100,
    }
}

#[actix_web::test]
async fn reserves_sell_out_and_come_back_without_http() {
    let (engine, clock, url) = engine().await;
    let now = clock.now_ms();
    let v = on_sale("ENG", 5, 3, now);
    engine.create_voucher(&v).await.unwrap();
    let answers =
        join_all((1..=10).map(|i| engine.reserve("ENG", req(i, &format!("e{i}")), None))).await;
    let won: Vec<_> = answers.iter().filter_map(|a| a.as_ref().ok()).collect();
    assert_eq!(won.len(), 3);
    assert!(won
        .iter()
        .all(|r| !r.replayed && r.reservation.discount_amount == 5));
    assert_eq!(
        answers
            .iter()
            .filter(|a| **a == Err(EngineError::OutOfStock))
            .count(),
        7
    );
    eventually("sold out", Duration::from_secs(10), || {
        let e = engine.clone();
        async move { e.is_sold_out_locally("ENG") }
    })
    .await;
    // A winner's retry replays; releasing one unit lowers the flag and sells it again.
    let first = &won[0].reservation;
    let again = engine
        .reserve("ENG", req(first.customer_id, &first.order_id), None)
        .await
        .unwrap();
    assert!(again.replayed);
    assert_eq!(&again.reservation, first);
    engine.release("ENG", &first.order_id).await.unwrap();
    assert!(!engine.is_sold_out_locally("ENG"));
    assert!(engine.reserve("ENG", req(99, "late"), None).await.is_ok());
    let mut told = Seen::created(won.iter().map(|r| r.reservation.order_id.clone()));
    told.created.insert("late".into());
    told.released.insert(first.order_id.clone());
    crate::audit::books(&url, "ENG")
        .await
        .assert_matches("ENG", &told);
    assert_eq!(
        engine.reserve("NOPE", req(1, "x"), None).await,
        Err(EngineError::NotFound)
    );
}

/// Many vouchers hot at once: their batches share the node's transactions, and each voucher
/// still sells exactly its units, every 201 in the ledger.
#[actix_web::test]
async fn many_hot_vouchers_at_once_each_sell_exactly_their_units() {
    let (engine, clock, url) = engine().await;
    let now = clock.now_ms();
    let codes: Vec<String> = (0..40).map(|i| format!("HOT{i}")).collect();
    for code in &codes {
        let v = on_sale(code, 7, 5, now);
        engine.create_voucher(&v).await.unwrap();
    }
    let requests = codes
        .iter()
        .flat_map(|code| (1..=8).map(move |c| (code.clone(), c, format!("{code}-o{c}"))));
    let answers = join_all(requests.map(|(code, c, order)| {
        let e = engine.clone();
        async move { (code.clone(), e.reserve(&code, req(c, &order), None).await) }
    }))
    .await;
    for code in &codes {
        let mine: Vec<_> = answers.iter().filter(|(c, _)| c == code).collect();
        let created = mine.iter().filter(|(_, a)| a.is_ok()).count();
        let refused = mine
            .iter()
            .filter(|(_, a)| *a == Err(EngineError::OutOfStock))
            .count();
        assert_eq!((created, refused), (5, 3), "{code}: {mine:?}");
        // The auditor: the rows are exactly this voucher's 201s, as a set.
        let won = mine
            .iter()
            .filter_map(|(_, a)| a.as_ref().ok())
            .map(|r| r.reservation.order_id.clone());
        let books = crate::audit::books(&url, code).await;
        books.assert_matches(code, &Seen::created(won));
        assert_eq!(
            (books.reserved, books.free + books.leased_unused),
            (5, 0),
            "{code}: the ledger holds exactly the 201s"
        );
    }
}

#[actix_web::test]
async fn an_idle_actor_returns_its_units_then_leaves_the_registry() {
    let (engine, clock, url) = engine().await;
    let v = Voucher {
        code: "IDLE".into(),
        discount_amount: 10,
        min_order_amount: 0,
        total_limit: 100,
        per_user_limit: 1,
        starts_at: 0,
        ends_at: i64::MAX / 2,
        status: VoucherStatus::Active,
        limits: Default::default(),
    };
    engine.create_voucher(&v).await.unwrap();
    assert!(engine.reserve("IDLE", req(1, "idle-1"), None).await.is_ok());
    assert_eq!(engine.actor_count(), 1);
    // Past the idle timeout its unused units go back to free; past the stop timeout it leaves.
    clock.advance_ms(Settings::defaults().engine.actor_idle_stop_ms + 1);
    let e = engine.clone();
    eventually("the idle actor stops", Duration::from_secs(10), || {
        let e = e.clone();
        async move { e.actor_count() == 0 }
    })
    .await;
    // Its unused units went back to free (the return runs on its own, so poll).
    eventually("the lease went back", Duration::from_secs(10), || {
        let url = url.clone();
        async move {
            let b = crate::audit::books(&url, "IDLE").await;
            (b.free, b.leased_unused, b.reserved) == (99, 0, 1) && b.violations().is_empty()
        }
    })
    .await;
    // A new reserve starts a fresh actor and is served.
    assert!(engine.reserve("IDLE", req(2, "idle-2"), None).await.is_ok());
    assert_eq!(engine.actor_count(), 1);
}

/// An actor whose thread ends under it (an HTTP worker that stops before the others at
/// shutdown) hands its waiting reserves back: the voucher's next actor serves them, so none of
/// them gets `503`, and each order is in the ledger once. Whether any reserve is still waiting
/// when the thread ends is a race this test does not force (a burst may be answered first);
/// what it always checks: every reserve is answered `201` once, and the next reserve after the
/// worker stopped gets an actor on a shard.
#[actix_web::test]
async fn reserves_on_an_actor_whose_thread_ends_are_served_by_its_successor() {
    let (engine, clock, url) = engine().await;
    // A stand-in for an HTTP worker: an arbiter of its own, registered as one.
    let worker = actix_rt::Arbiter::new();
    let (registered, done) = tokio::sync::oneshot::channel();
    let e = engine.clone();
    worker.spawn_fn(move || {
        e.host_actors_here();
        let _ = registered.send(());
    });
    done.await.unwrap();
    let now = clock.now_ms();
    let v = on_sale("GONE", 5, 100_000, now);
    engine.create_voucher(&v).await.unwrap();
    assert!(engine.reserve("GONE", req(1, "gone-1"), None).await.is_ok());
    assert_eq!(engine.actor_on_http_worker("GONE"), Some(true));
    // A burst, and the worker's thread ends under it.
    let burst =
        join_all((2..=600).map(|i| engine.reserve("GONE", req(i, &format!("gone-{i}")), None)));
    let (answers, ()) = tokio::join!(burst, async {
        tokio::task::yield_now().await;
        worker.stop();
    });
    let failed: Vec<_> = answers.iter().filter(|a| a.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        failed.first()
    );
    // The burst may all be answered before the thread ends; either way the worker's actor goes
    // with it, and the next reserve's actor lives on a shard: the stopped worker left the list.
    eventually(
        "the worker's actor is gone",
        Duration::from_secs(10),
        || {
            let gone = engine.actor_on_http_worker("GONE") != Some(true);
            async move { gone }
        },
    )
    .await;
    assert!(engine
        .reserve("GONE", req(601, "gone-601"), None)
        .await
        .is_ok());
    assert_eq!(engine.actor_on_http_worker("GONE"), Some(false));
    // Every order was answered 201: the rows are exactly those orders.
    let books = crate::audit::books(&url, "GONE").await;
    books.assert_matches_clients("GONE", &(1..=601).map(|i| format!("gone-{i}")).collect());
    assert_eq!(books.reserved, 601, "every 201 once, nothing else");
}

/// The first calls of many cold vouchers' actors at once ([`ledger::Ledger::open`] through the
/// node's merged calls, on real SQLite): each gets its own definition and its own first lease;
/// a code with no voucher gets neither, and a voucher that refuses the order (below its minimum
/// amount) gets its definition and no lease, so refused first reserves move no units.
#[actix_web::test]
async fn the_first_calls_of_many_cold_vouchers_each_get_their_own_answer() {
    let dir = temp_dir("opens");
    let url = format!("sqlite://{}/ledger.db", dir.display());
    let settings = test_settings(&url);
    let node = Arc::new(ledger::NodeLedger::start(
        ledger::connect(&url, 2).await.unwrap(),
        tokio::runtime::Handle::current(),
        &settings.ledger,
    ));
    let now = ManualClock::starting_now().now_ms();
    let codes: Vec<String> = (0..60).map(|i| format!("OPEN{i}")).collect();
    for (i, code) in codes.iter().enumerate() {
        let mut v = on_sale(code, 5, 3 + i as i64 % 4, now);
        if i == 7 {
            v.min_order_amount = 1_000;
        }
        node.create_voucher(&v, now).await.unwrap();
    }
    let ask = |code: &str| ledger::OpenAsk {
        grant: ledger::GrantAsk {
            code: code.into(),
            node: "open-node".into(),
            want: 2,
            now,
            ttl_ms: 30_000,
        },
        amount: 100,
    };
    let mut asked: Vec<String> = codes.clone();
    asked.push("NO-SUCH".into());
    let answers = join_all(asked.iter().map(|c| {
        let (node, ask) = (node.clone(), ask(c));
        async move { node.open(&ask).await }
    }))
    .await;
    let mut leases = Vec::new();
    for (code, a) in asked.iter().zip(&answers) {
        let o = a.as_ref().unwrap_or_else(|e| panic!("{code}: {e:?}"));
        match code.as_str() {
            "NO-SUCH" => assert!(o.voucher.is_none() && o.grant.is_none(), "{o:?}"),
            "OPEN7" => {
                assert_eq!(o.voucher.as_ref().map(|v| v.code.as_str()), Some("OPEN7"));
                assert!(o.grant.is_none(), "a refused order took a lease: {o:?}");
            }
            _ => {
                assert_eq!(
                    o.voucher.as_ref().map(|v| v.code.as_str()),
                    Some(code.as_str())
                );
                let g = o.grant.as_ref().expect("a grant").as_ref().unwrap();
                let lease = g.lease.as_ref().expect("a lease");
                assert_eq!(lease.granted, 2, "{code}: {g:?}");
                leases.push(lease.id);
            }
        }
    }
    leases.sort();
    leases.dedup();
    assert_eq!(leases.len(), codes.len() - 1, "every lease its own");
    for code in &codes {
        let b = crate::audit::books(&url, code).await;
        b.assert_balanced(code);
        let held = if code == "OPEN7" { 0 } else { 2 };
        assert_eq!(b.leased_unused, held, "{code}: {b:?}");
    }
}

/// After a flood's actors stopped, memory goes back at the first quiet run of the live numbers,
/// not while reserves, confirms or releases keep the node busy (more than a hundred a run).
#[actix_web::test]
async fn memory_goes_back_after_an_idle_out_only_once_the_node_is_quiet() {
    let (engine, clock, _url) = engine().await;
    let now = clock.now_ms();
    // More actors than a give-back is worth starting from, each with one reserve.
    let codes: Vec<String> = (0..1_100).map(|i| format!("TAIL{i}")).collect();
    for chunk in codes.chunks(100) {
        let created = join_all(
            chunk
                .iter()
                .map(|c| async { engine.create_voucher(&on_sale(c, 5, 10, now)).await }),
        )
        .await;
        assert!(created.iter().all(Result::is_ok));
        let answers = join_all(
            chunk
                .iter()
                .map(|c| engine.reserve(c, req(1, &format!("{c}-1")), None)),
        )
        .await;
        assert!(answers.iter().all(Result::is_ok));
    }
    assert_eq!(engine.actor_count(), 1_100);
    engine.live_numbers().await.unwrap();
    // They idle out.
    clock.advance_ms(Settings::defaults().engine.actor_idle_stop_ms + 1);
    let e = engine.clone();
    eventually("the idle actors stop", Duration::from_secs(30), || {
        let e = e.clone();
        async move { e.actor_count() == 0 }
    })
    .await;
    // A hot voucher is selling: a give-back is due but waits.
    let now = clock.now_ms();
    engine
        .create_voucher(&on_sale("HOT", 5, 10_000, now))
        .await
        .unwrap();
    let hot = |from: i64| {
        join_all(
            (from..from + 101).map(|i| engine.reserve("HOT", req(i, &format!("hot-{i}")), None)),
        )
    };
    assert!(hot(1).await.iter().all(Result::is_ok));
    engine.live_numbers().await.unwrap();
    assert_eq!(
        engine.memory_give_backs(),
        0,
        "not in the middle of a burst of reserves"
    );
    assert!(engine.memory_give_back_due(), "the idle-out made one due");
    // Checkouts confirm and release: still busy.
    for i in 1..=101 {
        let order = format!("hot-{i}");
        if i % 2 == 0 {
            engine.confirm("HOT", &order).await.unwrap();
        } else {
            engine.release("HOT", &order).await.unwrap();
        }
    }
    engine.live_numbers().await.unwrap();
    assert_eq!(engine.memory_give_backs(), 0, "not in a wave of confirms");
    // A trickle is quiet.
    let trickle =
        join_all((1_000..1_050).map(|i| engine.reserve("HOT", req(i, &format!("hot-{i}")), None)))
            .await;
    assert!(trickle.iter().all(Result::is_ok));
    engine.live_numbers().await.unwrap();
    assert_eq!(engine.memory_give_backs(), 1, "the first quiet run");
    assert!(!engine.memory_give_back_due());
    engine.live_numbers().await.unwrap();
    assert_eq!(engine.memory_give_backs(), 1, "once");
}

//! The ledger conformance suite: the same checks against every ledger implementation.

use std::collections::HashMap;

use futures_util::future::join_all;
use vouchers::domain::{
    EventKind, FeedEvent, Ineligible, ReservationStatus, Voucher, VoucherLimits, VoucherPatch,
    VoucherStatus,
};
use vouchers::ledger::{self, Batch, BatchRow, GrantAsk, LedgerError, RowOutcome, SharedLedger};

use crate::helpers::temp_dir;

pub(crate) const NOW: i64 = 1_800_000_000_000;
pub(crate) const TTL: i64 = 30_000;

pub(crate) fn voucher(code: &str, total: i64, per_user: i64) -> Voucher {
    Voucher {
        code: code.into(),
        discount_amount: 100,
        min_order_amount: 0,
        total_limit: total,
        per_user_limit: per_user,
        starts_at: NOW - 1000,
        ends_at: NOW + 86_400_000,
        status: VoucherStatus::Active,
        limits: Default::default(),
    }
}

fn rows(spec: &[(&str, i64)]) -> Vec<BatchRow> {
    spec.iter()
        .map(|(o, c)| BatchRow {
            order_id: o.to_string(),
            customer_id: *c,
        })
        .collect()
}

fn batch(code: &str, lease_id: i64, rows: Vec<BatchRow>) -> Batch {
    Batch {
        voucher_code: code.into(),
        lease_id,
        now: NOW,
        expires_at: NOW + 900_000,
        rows,
    }
}

/// A lease of `units` for `node`, granted now; the voucher must have them free.
async fn leased(l: &SharedLedger, code: &str, node: &str, units: i64) -> ledger::Lease {
    l.grant(code, node, units, NOW, TTL)
        .await
        .unwrap()
        .lease
        .expect("granted")
}

tokio::task_local! {
    /// The URLs of the ledger under the conformance suite (one per shard), for the independent
    /// auditor (none for the in-memory model ledger, which has no rows to read).
    static AUDIT_URL: Option<Vec<String>>;
}

/// The voucher's counters, once the books balance: judged by the independent auditor from the
/// rows where there are rows (SQLite, PostgreSQL), and checked to agree with the counters the
/// ledger reports. The model ledger, which has no rows, is judged by its own reconciler.
async fn balanced(l: &SharedLedger, code: &str) -> ledger::Counters {
    let c = l.counters(code).await.unwrap().expect("voucher exists");
    match AUDIT_URL.try_with(Clone::clone).ok().flatten() {
        Some(urls) => {
            let url = the_one_holding(&urls, code).await;
            let b = crate::audit::books(&url, code).await;
            b.assert_balanced(code);
            assert_eq!(
                (
                    c.total_limit,
                    c.free + c.leased_unused,
                    c.reserved,
                    c.confirmed,
                    c.released
                ),
                (
                    b.total,
                    b.free + b.leased_unused,
                    b.reserved,
                    b.confirmed,
                    b.released
                ),
                "{code}: the ledger's counters differ from the rows: {c:?} vs {b:?}"
            );
        }
        None => assert!(c.balanced, "{code} does not balance: {c:?}"),
    }
    c
}

/// Of a ledger's shards, the one whose rows hold `code`'s voucher: there must be exactly one.
async fn the_one_holding(urls: &[String], code: &str) -> String {
    if urls.len() == 1 {
        return urls[0].clone();
    }
    let mut holding = Vec::new();
    for url in urls {
        let pool = sqlx::PgPool::connect(url).await.expect("postgres");
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM vouchers WHERE code = $1")
            .bind(code)
            .fetch_one(&pool)
            .await
            .expect("vouchers");
        pool.close().await;
        if n > 0 {
            holding.push(url.clone());
        }
    }
    assert_eq!(holding.len(), 1, "{code} is on one shard: {holding:?}");
    holding.remove(0)
}

/// Runs every check against one ledger whose rows are at `url` (`None`: the model ledger).
pub async fn conformance_at(l: SharedLedger, url: Option<String>) {
    AUDIT_URL.scope(url.map(|u| vec![u]), conformance(l)).await;
}

/// Runs every check against one ledger.
async fn conformance(l: SharedLedger) {
    grants_never_exceed_free(&l).await;
    batches_apply_idempotency_and_limits(&l).await;
    the_fence_stops_batches_on_dead_or_full_leases(&l).await;
    returns_and_reaps_give_units_back_once(&l).await;
    release_confirm_and_expiry_move_units_exactly_once(&l).await;
    concurrent_grants_and_batches_never_oversell(&l).await;
    concurrent_batches_agree_on_customers_and_orders(&l).await;
    concurrent_batches_keep_each_customer_to_the_limit(&l).await;
    edits_follow_the_rules(&l).await;
    merged_batches_settle_each_batch_on_its_own(&l).await;
    an_order_id_is_not_taken_by_a_row_that_never_inserts(&l).await;
    holders_that_stop_beating_are_reaped_at_once(&l).await;
    pre_heat_finds_active_vouchers_starting_within_the_window(&l).await;
    a_voucher_the_schema_refuses_is_not_created(&l).await;
    usage_counts_every_live_reservation(&l).await;
    the_catalogue_is_read_in_pages_and_by_what_is_new(&l).await;
    reads_and_grants_of_many_vouchers_answer_each(&l).await;
    counters_of_many_vouchers_are_each_ones_own(&l).await;
    a_first_call_reads_and_grants_only_what_serves_the_order(&l).await;
    // Last: it checks the feed of every change the checks above made.
    the_feed_tells_every_change_once_in_order(&l).await;
}

/// A cold voucher's first call ([`ledger::Ledger::open`]): the definition and a first lease when
/// the voucher sells to the order now; the definition and no lease for an order it refuses
/// (below its minimum, or before its start); nothing for a code with no voucher.
async fn a_first_call_reads_and_grants_only_what_serves_the_order(l: &SharedLedger) {
    let mut v = voucher("OPENA", 4, 1);
    v.min_order_amount = 50;
    l.create_voucher(&v, NOW).await.unwrap();
    let ask = |code: &str, amount: i64, now: i64| ledger::OpenAsk {
        grant: GrantAsk {
            code: code.into(),
            node: "open-node".into(),
            want: 3,
            now,
            ttl_ms: 30_000,
        },
        amount,
    };
    let o = l.open(&ask("OPENX", 100, NOW)).await.unwrap();
    assert!(o.voucher.is_none() && o.grant.is_none(), "{o:?}");
    let o = l.open(&ask("OPENA", 10, NOW)).await.unwrap();
    assert_eq!(o.voucher.as_ref().map(|v| v.min_order_amount), Some(50));
    assert!(o.grant.is_none(), "below the minimum: {o:?}");
    let early = v.starts_at - 1;
    let o = l.open(&ask("OPENA", 100, early)).await.unwrap();
    assert!(
        o.voucher.is_some() && o.grant.is_none(),
        "before its start: {o:?}"
    );
    let c = balanced(l, "OPENA").await;
    assert_eq!((c.free, c.leased_unused), (4, 0), "{c:?}");
    let o = l.open(&ask("OPENA", 100, NOW)).await.unwrap();
    let g = o.grant.expect("a grant").unwrap();
    assert_eq!(g.lease.as_ref().map(|l| l.granted), Some(3), "{g:?}");
    let c = balanced(l, "OPENA").await;
    assert_eq!((c.free, c.leased_unused), (1, 3), "{c:?}");
}

/// The reconciler's recount of many vouchers at once gives each voucher the counters a recount
/// of it alone gives (nothing of one voucher leaks into another's), in the order asked, with
/// `None` for a code with no voucher; and every one of them balances.
async fn counters_of_many_vouchers_are_each_ones_own(l: &SharedLedger) {
    let mut codes = l.voucher_codes(0, "", 1_000).await.unwrap();
    assert!(
        codes.len() >= 5,
        "the checks before made vouchers: {codes:?}"
    );
    codes.reverse();
    codes.insert(1, "NO-SUCH-VOUCHER".into());
    let many = l.counters_many(&codes).await.unwrap();
    assert_eq!(many.len(), codes.len());
    let mut distinct = std::collections::HashSet::new();
    for (code, c) in codes.iter().zip(&many) {
        assert_eq!(*c, l.counters(code).await.unwrap(), "{code}");
        if let Some(c) = c {
            assert!(c.balanced, "{code}: {c:?}");
            distinct.insert((c.total_limit, c.free, c.reserved, c.confirmed, c.released));
        }
    }
    assert_eq!(many[1], None);
    assert!(
        distinct.len() > 1,
        "every voucher got the same counters: {many:?}"
    );
    assert!(l.counters_many(&[]).await.unwrap().is_empty());
    // A voucher with no reservation and no lease, its limit far past what 53-bit (JSON double)
    // numbers hold exactly: the counters come from its row alone, to the unit.
    let big = 1_000_000_000_000_000_003;
    l.create_voucher(&voucher("NOROWS-BIG", big, 1), NOW)
        .await
        .unwrap();
    let got = l
        .counters_many(&["NOROWS-BIG".to_string(), codes[0].clone()])
        .await
        .unwrap();
    let expected = ledger::Counters {
        total_limit: big,
        free: big,
        leased_unused: 0,
        reserved: 0,
        confirmed: 0,
        released: 0,
        balanced: true,
    };
    assert_eq!(got[0], Some(expected));
    assert_eq!(got[1], many[0], "{}", codes[0]);
}

/// The merged calls of cold activation: one read of several vouchers gives those that exist,
/// and one transaction of grants answers each in order (`NotFound` for a missing voucher),
/// moving each voucher's units as a grant of its own would.
async fn reads_and_grants_of_many_vouchers_answer_each(l: &SharedLedger) {
    for (code, total) in [("GM1", 5), ("GM2", 1)] {
        l.create_voucher(&voucher(code, total, 1), NOW)
            .await
            .unwrap();
    }
    let codes: Vec<String> = ["GM2", "GMX", "GM1"]
        .iter()
        .map(|c| c.to_string())
        .collect();
    let mut found: Vec<String> = l
        .vouchers(&codes)
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.code)
        .collect();
    found.sort();
    assert_eq!(found, ["GM1", "GM2"]);
    let ask = |code: &str, want: i64| GrantAsk {
        code: code.into(),
        node: "gm-node".into(),
        want,
        now: NOW,
        ttl_ms: 30_000,
    };
    let answers = l
        .grant_many(&[ask("GM2", 3), ask("GMX", 1), ask("GM1", 2), ask("GM1", 9)])
        .await
        .unwrap();
    let granted = |i: usize| match &answers[i] {
        Ok(g) => g.lease.as_ref().map_or(0, |lease| lease.granted),
        Err(e) => panic!("grant {i}: {e:?}"),
    };
    assert_eq!(granted(0), 1, "GM2 has one unit: {answers:?}");
    assert!(
        matches!(answers[1], Err(LedgerError::NotFound)),
        "{answers:?}"
    );
    assert_eq!(
        (granted(2), granted(3)),
        (2, 3),
        "GM1's five, in order: {answers:?}"
    );
    for code in ["GM1", "GM2"] {
        let c = balanced(l, code).await;
        assert_eq!(
            (c.free, c.leased_unused),
            (0, c.total_limit),
            "{code}: {c:?}"
        );
    }
    // Returns in one transaction: each as a return of its own would answer (a second return,
    // or an unknown lease, gives nothing back).
    let lease = |i: usize| answers[i].as_ref().unwrap().lease.as_ref().unwrap().id;
    let back = l
        .return_leases(&[(lease(0), NOW), (lease(2), NOW), (lease(0), NOW), (-1, NOW)])
        .await
        .unwrap();
    let units: Vec<i64> = back
        .iter()
        .map(|r| r.as_ref().map_or(0, |r| r.units))
        .collect();
    assert_eq!(units, [1, 2, 0, 0], "{back:?}");
    assert_eq!(balanced(l, "GM2").await.free, 1);
    assert_eq!(balanced(l, "GM1").await.free, 2);
    // Creates in one transaction: a taken code is AlreadyExists and stops none of the others.
    let made = l
        .create_vouchers(&[
            (voucher("GMC1", 3, 1), NOW),
            (voucher("GM1", 3, 1), NOW),
            (voucher("GMC2", 4, 1), NOW),
        ])
        .await
        .unwrap();
    assert!(made[0].is_ok() && made[2].is_ok(), "{made:?}");
    assert!(
        matches!(made[1], Err(LedgerError::AlreadyExists)),
        "{made:?}"
    );
    assert_eq!(balanced(l, "GMC2").await.free, 4);
    assert_eq!(
        balanced(l, "GM1").await.total_limit,
        5,
        "the taken code is unchanged"
    );
}

/// The long tail's reads: the catalogue in pages of codes (in order, each once), the codes
/// created since a time, and the watched vouchers.
async fn the_catalogue_is_read_in_pages_and_by_what_is_new(l: &SharedLedger) {
    for i in 0..5 {
        l.create_voucher(&voucher(&format!("PG{i}"), 1, 1), NOW + i)
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    let mut after = String::from("PG");
    loop {
        let page = l.voucher_codes(NOW, &after, 2).await.unwrap();
        assert!(page.len() <= 2, "{page:?}");
        let Some(last) = page.last().cloned() else {
            break;
        };
        seen.extend(page.into_iter().filter(|c| c.starts_with("PG")));
        if !last.starts_with("PG") {
            break;
        }
        after = last;
    }
    assert_eq!(seen, ["PG0", "PG1", "PG2", "PG3", "PG4"]);
    let new = l.codes_created_since(NOW + 3).await.unwrap();
    assert!(
        new.contains(&"PG3".to_string()) && new.contains(&"PG4".to_string()),
        "{new:?}"
    );
    assert!(!new.contains(&"PG2".to_string()), "{new:?}");
    assert!(l.watched_codes().await.unwrap().is_empty());
    l.set_watched("PG1", true).await.unwrap();
    l.set_watched("PG1", true).await.unwrap();
    l.set_watched("PG3", true).await.unwrap();
    assert_eq!(l.watched_codes().await.unwrap(), ["PG1", "PG3"]);
    l.set_watched("PG1", false).await.unwrap();
    assert_eq!(l.watched_codes().await.unwrap(), ["PG3"]);
    assert!(matches!(
        l.set_watched("NOPE", true).await,
        Err(LedgerError::NotFound)
    ));
    l.set_watched("PG3", false).await.unwrap();
}

/// A customer's usage counts every reservation of theirs that is not released: one stored
/// before, and one a row earlier in the same transaction (two batches of the voucher, and a
/// customer twice in one batch); and a RESERVED one past its expiry that the sweep has not
/// released yet.
async fn usage_counts_every_live_reservation(l: &SharedLedger) {
    l.create_voucher(&voucher("UL", 10, 2), NOW).await.unwrap();
    let lease = leased(l, "UL", "n1", 8).await.id;
    let first = l
        .commit_batch(&batch("UL", lease, rows(&[("ul-1", 7)])))
        .await
        .unwrap();
    assert!(matches!(first[0], RowOutcome::Created(_)));
    let results = l
        .commit_batches(&[
            batch("UL", lease, rows(&[("ul-2", 7), ("ul-3", 7), ("ul-4", 8)])),
            batch("UL", lease, rows(&[("ul-5", 8), ("ul-6", 8)])),
        ])
        .await
        .unwrap();
    let (a, b) = (
        results[0].as_ref().expect("first batch"),
        results[1].as_ref().expect("second batch"),
    );
    assert!(matches!(a[0], RowOutcome::Created(_)), "{a:?}");
    assert_eq!(
        a[1],
        RowOutcome::AlreadyUsed,
        "customer 7: one stored, one just now"
    );
    assert!(matches!(a[2], RowOutcome::Created(_)), "{a:?}");
    assert!(matches!(b[0], RowOutcome::Created(_)), "{b:?}");
    assert_eq!(
        b[1],
        RowOutcome::AlreadyUsed,
        "customer 8: two in this transaction"
    );

    l.create_voucher(&voucher("UX", 10, 1), NOW).await.unwrap();
    let lease = leased(l, "UX", "n1", 4).await.id;
    let due = Batch {
        expires_at: NOW + 1,
        ..batch("UX", lease, rows(&[("ux-1", 9)]))
    };
    assert!(matches!(
        l.commit_batch(&due).await.unwrap()[0],
        RowOutcome::Created(_)
    ));
    let later = Batch {
        now: NOW + 10,
        ..batch("UX", lease, rows(&[("ux-2", 9)]))
    };
    assert_eq!(
        l.commit_batch(&later).await.unwrap()[0],
        RowOutcome::AlreadyUsed,
        "a RESERVED row past its expiry counts until the sweep releases it"
    );
    balanced(l, "UL").await;
    balanced(l, "UX").await;
}

/// `starting_between(from, to)`: active vouchers whose sale starts after `from`, no later than
/// `to`; a paused one is not warmed.
async fn pre_heat_finds_active_vouchers_starting_within_the_window(l: &SharedLedger) {
    let starts = NOW + 7_777_000;
    let mut soon = voucher("SOON", 5, 1);
    soon.starts_at = starts;
    let mut paused = voucher("SOON-PAUSED", 5, 1);
    paused.starts_at = starts;
    paused.status = VoucherStatus::Paused;
    l.create_voucher(&soon, NOW).await.unwrap();
    l.create_voucher(&paused, NOW).await.unwrap();
    let found = |from, to| async move { l.starting_between(from, to).await.unwrap() };
    assert_eq!(found(starts - 1, starts).await, vec!["SOON".to_string()]);
    assert!(
        found(starts, starts + 1000).await.is_empty(),
        "starts after `from`"
    );
    assert!(
        found(starts - 1000, starts - 1).await.is_empty(),
        "no later than `to`"
    );
}

/// Each rule of a voucher's row on its own (one bad field, the rest right) refuses the whole
/// voucher, and nothing is created.
async fn a_voucher_the_schema_refuses_is_not_created(l: &SharedLedger) {
    type Spoil = fn(&mut Voucher);
    let bad: [(&str, Spoil); 4] = [
        ("BAD-DISCOUNT", |v| v.discount_amount = -1),
        ("BAD-MIN", |v| v.min_order_amount = -1),
        ("BAD-TOTAL", |v| v.total_limit = -1),
        ("BAD-LIMIT", |v| v.per_user_limit = 0),
    ];
    for (code, spoil) in bad {
        let mut v = voucher(code, 5, 1);
        spoil(&mut v);
        assert!(l.create_voucher(&v, NOW).await.is_err(), "{code}");
        assert!(l.voucher(code).await.unwrap().is_none(), "{code}");
    }
}

/// Wall-clock milliseconds: liveness is judged on the ledger's clock, which on PostgreSQL is the
/// database's own (the `now` passed in only stamps `closed_at`).
fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Units reaped of one voucher.
fn reaped_of(restocks: &[ledger::Restock], code: &str) -> i64 {
    restocks
        .iter()
        .filter(|r| r.voucher_code == code)
        .map(|r| r.units)
        .sum()
}

/// `holder` beats every 20 ms until one of its beats names every holder of `expected` dead
/// (and no other than `others_allowed`); fails after 20 s.
async fn beat_until_dead(l: &SharedLedger, holder: &str, limit: i64, expected: &[&str]) {
    let start = std::time::Instant::now();
    loop {
        let dead = l.heartbeat(holder, wall_ms(), limit).await.unwrap().dead;
        if expected.iter().all(|e| dead.iter().any(|d| d == e)) {
            return;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "{expected:?} never found dead (last answer {dead:?})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// DESIGN §3 "Reap": incarnations are numbered per name and never reused; a holder that stops
/// beating is found dead by a live holder's beat, by its own limit, and its leases are reaped
/// long before their TTL; a live holder's, a patient holder's and a pre-incarnation holder's
/// leases are left alone; a holder back from a silence judges nobody until it has beaten for
/// its limit; a retired holder is dead at once.
async fn holders_that_stop_beating_are_reaped_at_once(l: &SharedLedger) {
    const LIMIT: i64 = 2000;
    const PATIENT: i64 = 600_000;
    l.create_voucher(&voucher("HB", 20, 5), NOW).await.unwrap();
    let a = l.register_node("hb-a", wall_ms(), LIMIT).await.unwrap();
    let b1 = l.register_node("hb-b", wall_ms(), LIMIT).await.unwrap();
    let b2 = l.register_node("hb-b", wall_ms(), LIMIT).await.unwrap();
    let c = l.register_node("hb-c", wall_ms(), PATIENT).await.unwrap();
    assert_eq!((a.holder.as_str(), a.number), ("hb-a#1", 1));
    assert_eq!((b2.holder.as_str(), b2.number), ("hb-b#2", 2));
    assert_eq!(b2.live_siblings, vec![1], "the first hb-b still beats");
    let lease = |holder: String, units: i64| {
        let l = l.clone();
        async move {
            l.grant("HB", &holder, units, NOW, 10 * 60_000)
                .await
                .unwrap()
                .lease
                .unwrap()
        }
    };
    let la = lease(a.holder.clone(), 3).await;
    let lb = lease(b1.holder.clone(), 4).await;
    lease(c.holder.clone(), 1).await;
    let legacy = lease("hb-legacy".into(), 2).await;
    let first = l.heartbeat(&a.holder, wall_ms(), LIMIT).await.unwrap();
    // The beat reads the ledger's clock (the database's on PostgreSQL, on this same machine).
    assert!((first.ledger_ms - wall_ms()).abs() < 5_000, "{first:?}");
    // hb-a keeps beating, the hb-b processes do not.
    beat_until_dead(l, &a.holder, LIMIT, &[&b1.holder, &b2.holder]).await;
    let dead = l.heartbeat(&a.holder, wall_ms(), LIMIT).await.unwrap().dead;
    assert!(
        !dead.contains(&c.holder),
        "hb-c is judged by its own, longer limit: {dead:?}"
    );
    let r = l.reap_holder(&b1.holder, wall_ms()).await.unwrap();
    assert_eq!(reaped_of(&r, "HB"), 4, "hb-b#1's unused units: {r:?}");
    // Reaped, hb-b#1 has no row: a grant it asks for before its next beat is refused and takes
    // nothing (else a lease it then crashed with would be listed by nobody; the counters below
    // show nothing moved).
    let refused = l.grant("HB", &b1.holder, 1, NOW, 10 * 60_000).await;
    assert!(
        matches!(refused, Err(LedgerError::NotLive)),
        "a grant to a reaped holder: {refused:?}"
    );
    assert!(
        l.reap_holder(&b1.holder, wall_ms())
            .await
            .unwrap()
            .is_empty(),
        "reaped once"
    );
    assert!(l
        .reap_holder(&b2.holder, wall_ms())
        .await
        .unwrap()
        .is_empty());
    let refused = l
        .grant_many(&[GrantAsk {
            code: "HB".into(),
            node: b2.holder.clone(),
            want: 1,
            now: NOW,
            ttl_ms: 10 * 60_000,
        }])
        .await;
    assert!(
        matches!(refused, Err(LedgerError::NotLive)),
        "a merged grant to a reaped holder: {refused:?}"
    );
    assert!(
        l.reap_holder(&a.holder, wall_ms())
            .await
            .unwrap()
            .is_empty(),
        "a live holder is not reaped"
    );
    let res = l
        .commit_batch(&batch("HB", lb.id, rows(&[("hb1", 1)])))
        .await;
    assert!(
        matches!(res, Err(LedgerError::Fenced)),
        "a dead holder's lease is fenced: {res:?}"
    );
    l.commit_batch(&batch("HB", la.id, rows(&[("hb2", 2)])))
        .await
        .unwrap();
    l.commit_batch(&batch("HB", legacy.id, rows(&[("hb3", 3)])))
        .await
        .unwrap();
    let c_ = balanced(l, "HB").await;
    assert_eq!(
        (c_.free, c_.leased_unused, c_.reserved),
        (10 + 4, 2 + 1 + 1, 2),
        "{c_:?}"
    );
    // A retired holder is dead at once, whatever its limit.
    l.retire_node(&c.holder).await.unwrap();
    let refused = l.grant("HB", &c.holder, 1, NOW, 10 * 60_000).await;
    assert!(
        matches!(refused, Err(LedgerError::NotLive)),
        "a grant to a retired holder: {refused:?}"
    );
    // A beat of its own process that lands after the retire (sent before it) brings it back
    // to life for nobody.
    let late = l.heartbeat(&c.holder, wall_ms(), LIMIT).await;
    assert!(
        matches!(late, Err(LedgerError::NotFound)),
        "a beat after the retire: {late:?}"
    );
    beat_until_dead(l, &a.holder, LIMIT, &[&c.holder]).await;
    let r = l.reap_holder(&c.holder, wall_ms()).await.unwrap();
    assert_eq!(reaped_of(&r, "HB"), 1, "{r:?}");
    // A dead holder that beats again is recorded again, and may take leases again. Then
    // everyone falls silent: back from its silence (its row still there), hb-b#1 judges nobody,
    // though hb-a was silent as long; once it has beaten without a gap for hb-a's limit, it
    // finds hb-a dead.
    assert!(l
        .heartbeat(&b1.holder, wall_ms(), LIMIT)
        .await
        .unwrap()
        .dead
        .is_empty());
    lease(b1.holder.clone(), 1).await;
    let silent = std::time::Instant::now();
    while silent.elapsed() < std::time::Duration::from_millis(2 * LIMIT as u64) {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let back = l
        .heartbeat(&b1.holder, wall_ms(), LIMIT)
        .await
        .unwrap()
        .dead;
    assert!(
        back.is_empty(),
        "a holder back from silence judges nobody: {back:?}"
    );
    beat_until_dead(l, &b1.holder, LIMIT, &[&a.holder]).await;
    let r = l.reap_holder(&a.holder, wall_ms()).await.unwrap();
    assert_eq!(reaped_of(&r, "HB"), 2, "hb-a#1's two unused units: {r:?}");
    // The pre-incarnation holder has no beat to judge: its lease waits for its TTL; so does
    // hb-b#1's, which still beats.
    let c_ = balanced(l, "HB").await;
    assert_eq!(
        (c_.free, c_.leased_unused, c_.reserved),
        (16, 1 + 1, 2),
        "{c_:?}"
    );
    // Numbers are never reused.
    let b3 = l.register_node("hb-b", wall_ms(), LIMIT).await.unwrap();
    assert_eq!(b3.number, 3);
}

/// Customers of vouchers whose rows were all refused: none may have a usage row (DESIGN §6: a
/// refused request leaves no trace). Checked with each store's own SQL.
const UNTOUCHED_USAGE: &str = "SELECT COUNT(*) FROM customer_usage \
     WHERE (voucher_code = 'M2' AND customer_id = 20) OR (voucher_code = 'M4' AND customer_id = 40) \
        OR (voucher_code = 'X1' AND customer_id = 50) OR (voucher_code = 'X2' AND customer_id = 60)";

async fn grants_never_exceed_free(l: &SharedLedger) {
    l.create_voucher(&voucher("G", 10, 1), NOW).await.unwrap();
    assert!(matches!(
        l.create_voucher(&voucher("G", 10, 1), NOW).await,
        Err(LedgerError::AlreadyExists)
    ));
    let g1 = l.grant("G", "n1", 7, NOW, TTL).await.unwrap();
    assert_eq!((g1.lease.as_ref().unwrap().granted, g1.free_after), (7, 3));
    let g2 = l.grant("G", "n2", 7, NOW, TTL).await.unwrap();
    assert_eq!(
        (
            g2.lease.as_ref().unwrap().granted,
            g2.free_after,
            g2.leased_unused
        ),
        (3, 0, 7)
    );
    let g3 = l.grant("G", "n3", 7, NOW, TTL).await.unwrap();
    assert_eq!((g3.lease, g3.free_after, g3.leased_unused), (None, 0, 10));
    assert!(matches!(
        l.grant("NOPE", "n1", 1, NOW, TTL).await,
        Err(LedgerError::NotFound)
    ));
    let c = balanced(l, "G").await;
    assert_eq!((c.free, c.leased_unused), (0, 10));
    let (v, available) = l.voucher_stock("G").await.unwrap().unwrap();
    assert_eq!((v.code.as_str(), available), ("G", 10));
    assert!(l.voucher_stock("NOPE").await.unwrap().is_none());
}

async fn batches_apply_idempotency_and_limits(l: &SharedLedger) {
    l.create_voucher(&voucher("B", 10, 2), NOW).await.unwrap();
    l.create_voucher(&voucher("B2", 10, 2), NOW).await.unwrap();
    let lease = leased(l, "B", "n1", 10).await;
    let out = l
        .commit_batch(&batch(
            "B",
            lease.id,
            rows(&[
                ("b1", 1),
                ("b1", 1),
                ("b2", 1),
                ("b3", 1),
                ("b1", 2),
                ("b4", 2),
            ]),
        ))
        .await
        .unwrap();
    assert!(matches!(out[0], RowOutcome::Created(_)));
    assert!(matches!(out[1], RowOutcome::Replayed(_)));
    assert!(matches!(out[2], RowOutcome::Created(_)));
    assert_eq!(
        out[3],
        RowOutcome::AlreadyUsed,
        "customer 1 is at the limit of 2"
    );
    assert_eq!(
        out[4],
        RowOutcome::AlreadyUsed,
        "same order id, other customer"
    );
    assert!(matches!(out[5], RowOutcome::Created(_)));
    // A later retry replays the stored row, byte for byte.
    let again = l
        .commit_batch(&batch("B", lease.id, rows(&[("b1", 1)])))
        .await
        .unwrap();
    match (&out[0], &again[0]) {
        (RowOutcome::Created(a), RowOutcome::Replayed(b)) => assert_eq!(a, b),
        other => panic!("expected a replay, got {other:?}"),
    }
    // The same order id under another voucher is a clash.
    let lease2 = leased(l, "B2", "n1", 5).await;
    let out = l
        .commit_batch(&batch("B2", lease2.id, rows(&[("b1", 1)])))
        .await
        .unwrap();
    assert_eq!(out[0], RowOutcome::AlreadyUsed);
    let c = balanced(l, "B").await;
    assert_eq!((c.reserved, c.leased_unused), (3, 7));
    live_matches_counters(l, "B").await;
    let found = l
        .find_orders(&["b1".into(), "b2".into(), "zz".into()])
        .await
        .unwrap();
    assert_eq!(found.len(), 2);
    let mut won = l.won_orders("B").await.unwrap();
    won.sort();
    let expected: Vec<(String, i64)> = vec![("b1".into(), 1), ("b2".into(), 1), ("b4".into(), 2)];
    assert_eq!(won, expected);
    let mut usage = l.customer_usage("B", &[1, 2, 3]).await.unwrap();
    usage.sort();
    assert_eq!(usage, vec![(1, 2), (2, 1)], "customer 3 never used B");
    assert_eq!(l.customer_usage("B", &[]).await.unwrap(), vec![]);
    // The ledger's own copy of the window refuses new rows before the start and from the end
    // on (a node's copy may be stale), and still answers a replay.
    let early = Batch {
        now: NOW - 2000,
        ..batch("B", lease.id, rows(&[("b9", 9), ("b2", 1)]))
    };
    let late = Batch {
        now: NOW + 86_400_000,
        ..batch("B", lease.id, rows(&[("b9", 9)]))
    };
    let out = l.commit_batch(&early).await.unwrap();
    assert_eq!(out[0], RowOutcome::NotEligible(Ineligible::NotStarted));
    assert!(
        matches!(&out[1], RowOutcome::Replayed(r) if r.order_id == "b2"),
        "{out:?}"
    );
    assert_eq!(
        l.commit_batch(&late).await.unwrap(),
        vec![RowOutcome::NotEligible(Ineligible::Ended)]
    );
    assert_eq!(balanced(l, "B").await.reserved, 3, "nothing taken");
}

async fn the_fence_stops_batches_on_dead_or_full_leases(l: &SharedLedger) {
    l.create_voucher(&voucher("F", 10, 5), NOW).await.unwrap();
    let lease = leased(l, "F", "n1", 2).await;
    let res = l
        .commit_batch(&batch(
            "F",
            lease.id,
            rows(&[("f1", 1), ("f2", 2), ("f3", 3)]),
        ))
        .await;
    assert!(
        matches!(res, Err(LedgerError::Fenced)),
        "three rows on a two-unit lease: {res:?}"
    );
    let reaped = l.reap_expired(NOW + TTL).await.unwrap();
    assert_eq!(
        reaped
            .iter()
            .find(|r| r.voucher_code == "F")
            .map(|r| r.units),
        Some(2)
    );
    let res = l
        .commit_batch(&batch("F", lease.id, rows(&[("f1", 1)])))
        .await;
    assert!(
        matches!(res, Err(LedgerError::Fenced)),
        "a reaped lease is fenced"
    );
    assert!(
        l.find_orders(&["f1".into(), "f2".into()])
            .await
            .unwrap()
            .is_empty(),
        "nothing of a fenced batch is stored"
    );
    assert!(
        l.renew(&[lease.id], "n1", NOW, TTL)
            .await
            .unwrap()
            .is_empty(),
        "a reaped lease cannot be renewed"
    );
    let c = balanced(l, "F").await;
    assert_eq!((c.free, c.reserved, c.leased_unused), (10, 0, 0));
}

async fn returns_and_reaps_give_units_back_once(l: &SharedLedger) {
    l.create_voucher(&voucher("R", 10, 5), NOW).await.unwrap();
    let a = leased(l, "R", "n1", 4).await;
    let b = leased(l, "R", "n2", 4).await;
    l.commit_batch(&batch("R", a.id, rows(&[("r1", 1)])))
        .await
        .unwrap();
    // A node finds its own ACTIVE leases of a voucher (a grant whose answer it lost), only its own.
    assert_eq!(l.active_leases("R", "n1").await.unwrap(), vec![a.id]);
    assert_eq!(l.active_leases("R", "n2").await.unwrap(), vec![b.id]);
    assert!(l.active_leases("R", "n3").await.unwrap().is_empty());
    assert!(l.active_leases("other", "n1").await.unwrap().is_empty());
    // A used-up lease has nothing to give back: it is not listed.
    let full = leased(l, "R", "n4", 1).await;
    l.commit_batch(&batch("R", full.id, rows(&[("r-n4", 2)])))
        .await
        .unwrap();
    assert!(l.active_leases("R", "n4").await.unwrap().is_empty());
    let back = l.return_lease(a.id, NOW).await.unwrap();
    assert!(
        l.active_leases("R", "n1").await.unwrap().is_empty(),
        "a returned lease is not active"
    );
    assert_eq!(back.map(|r| r.units), Some(3));
    assert_eq!(
        l.return_lease(a.id, NOW).await.unwrap(),
        None,
        "returning twice is a no-op"
    );
    // The live node renews; the other one does not and is reaped.
    assert_eq!(
        l.renew(&[b.id], "n2", NOW + TTL - 1, TTL).await.unwrap(),
        vec![b.id]
    );
    assert!(
        l.renew(&[b.id], "other-node", NOW, TTL)
            .await
            .unwrap()
            .is_empty(),
        "only the owner renews"
    );
    assert!(l
        .reap_expired(NOW + TTL)
        .await
        .unwrap()
        .iter()
        .all(|r| r.voucher_code != "R"));
    let reaped = l.reap_expired(NOW + 2 * TTL).await.unwrap();
    assert_eq!(
        reaped
            .iter()
            .find(|r| r.voucher_code == "R")
            .map(|r| r.units),
        Some(4)
    );
    assert!(l
        .reap_expired(NOW + 3 * TTL)
        .await
        .unwrap()
        .iter()
        .all(|r| r.voucher_code != "R"));
    let c = balanced(l, "R").await;
    assert_eq!((c.free, c.reserved), (8, 2));
    // A node that stops gracefully hands back every lease it holds, and only its own.
    let mine = leased(l, "R", "leaving", 3).await;
    let other = leased(l, "R", "staying", 2).await;
    let back = l.return_node_leases("leaving", NOW).await.unwrap();
    assert_eq!(back.iter().map(|r| r.units).sum::<i64>(), 3);
    assert!(l
        .return_node_leases("leaving", NOW)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(l.return_lease(mine.id, NOW).await.unwrap(), None);
    assert_eq!(
        l.return_lease(other.id, NOW)
            .await
            .unwrap()
            .map(|r| r.units),
        Some(2)
    );
    balanced(l, "R").await;
}

/// The live numbers (row and active leases, no scan of the reservations) agree with the full
/// recount of the reconciler, for a voucher that has started and not ended.
async fn live_matches_counters(l: &SharedLedger, code: &str) {
    let c = balanced(l, code).await;
    let live = l.live_units(NOW, NOW, &[code.to_string()]).await.unwrap();
    let u = live
        .iter()
        .find(|u| u.code == code)
        .unwrap_or_else(|| panic!("{code} is live: {live:?}"));
    assert_eq!(
        (
            u.total_limit,
            u.free,
            u.leased_unused,
            u.reserved,
            u.confirmed,
            u.released
        ),
        (
            c.total_limit,
            c.free,
            c.leased_unused,
            c.reserved,
            c.confirmed,
            c.released
        ),
        "{code}"
    );
    // Only the vouchers asked for; not yet started, or ended: not live.
    assert!(l.live_units(NOW, NOW, &[]).await.unwrap().is_empty());
    let codes = [code.to_string()];
    assert!(l
        .live_units(i64::MIN / 2, NOW, &codes)
        .await
        .unwrap()
        .is_empty());
    let ended = l.live_units(NOW, i64::MAX / 2, &codes).await.unwrap();
    assert!(ended.iter().all(|u| u.code != code));
}

async fn release_confirm_and_expiry_move_units_exactly_once(l: &SharedLedger) {
    l.create_voucher(&voucher("L", 5, 5), NOW).await.unwrap();
    let lease = leased(l, "L", "n1", 5).await;
    l.commit_batch(&batch(
        "L",
        lease.id,
        rows(&[("l1", 1), ("l2", 1), ("l3", 1), ("l4", 1)]),
    ))
    .await
    .unwrap();
    assert_eq!(
        l.confirm("L", "l1", NOW).await.unwrap().status,
        ReservationStatus::Confirmed
    );
    assert_eq!(
        l.confirm("L", "l1", NOW).await.unwrap().status,
        ReservationStatus::Confirmed
    );
    assert!(matches!(
        l.release("L", "l1", NOW).await,
        Err(LedgerError::AlreadyConfirmed)
    ));
    let (r, restock) = l.release("L", "l2", NOW).await.unwrap();
    assert_eq!(
        (r.status, restock.map(|r| r.units)),
        (ReservationStatus::Released, Some(1))
    );
    let (_, restock) = l.release("L", "l2", NOW).await.unwrap();
    assert_eq!(restock, None, "a second release gives nothing back");
    assert!(matches!(
        l.confirm("L", "l2", NOW).await,
        Err(LedgerError::Released)
    ));
    assert!(matches!(
        l.confirm("L", "zz", NOW).await,
        Err(LedgerError::NotFound)
    ));
    assert!(matches!(
        l.release("OTHER", "l3", NOW).await,
        Err(LedgerError::NotFound)
    ));
    // Expiry: two sweepers at once release each due reservation once.
    let due = NOW + 900_000;
    let sweeps = join_all([l.expire_due(due, 1000), l.expire_due(due, 1000)]).await;
    let released: i64 = sweeps
        .into_iter()
        .flat_map(|r| r.unwrap())
        .filter(|r| r.voucher_code == "L")
        .map(|r| r.units)
        .sum();
    assert_eq!(released, 2);
    let c = balanced(l, "L").await;
    assert_eq!(
        (c.reserved, c.confirmed, c.released, c.free, c.leased_unused),
        (0, 1, 3, 3, 1)
    );
    // Customer 1's usage went down with every release and expiry (4 reserved, 3 given back):
    // three more orders fit under the limit of 5 only if it did.
    let more = l
        .grant("L", "n1", 3, NOW, TTL)
        .await
        .unwrap()
        .lease
        .expect("the released units are free again");
    let out = l
        .commit_batch(&batch(
            "L",
            more.id,
            rows(&[("l5", 1), ("l6", 1), ("l7", 1)]),
        ))
        .await
        .unwrap();
    assert!(
        out.iter().all(|o| matches!(o, RowOutcome::Created(_))),
        "usage did not go down: {out:?}"
    );
    // With confirmed and released units, the live numbers still agree with the recount.
    live_matches_counters(l, "L").await;
}

async fn concurrent_grants_and_batches_never_oversell(l: &SharedLedger) {
    l.create_voucher(&voucher("C", 100, 1), NOW).await.unwrap();
    let work = (0..8).map(|node| {
        let l = l.clone();
        async move {
            let mut won = 0;
            for round in 0..10 {
                let Some(lease) = l
                    .grant("C", &format!("n{node}"), 3, NOW, TTL)
                    .await
                    .unwrap()
                    .lease
                else {
                    break;
                };
                let rs: Vec<BatchRow> = (0..lease.granted)
                    .map(|i| BatchRow {
                        order_id: format!("c-{node}-{round}-{i}"),
                        customer_id: node * 1000 + round * 10 + i + 1,
                    })
                    .collect();
                let out = l.commit_batch(&batch("C", lease.id, rs)).await.unwrap();
                won += out
                    .iter()
                    .filter(|o| matches!(o, RowOutcome::Created(_)))
                    .count();
            }
            won
        }
    });
    let won: usize = join_all(work).await.into_iter().sum();
    assert_eq!(won, 100);
    let c = balanced(l, "C").await;
    assert_eq!((c.reserved, c.free), (100, 0));
}

/// Batches of several nodes at once, all wanting the same customers and order ids: each order is
/// created once (the rest replay or clash), and no customer passes the limit.
async fn concurrent_batches_agree_on_customers_and_orders(l: &SharedLedger) {
    l.create_voucher(&voucher("X", 1000, 2), NOW).await.unwrap();
    let nodes = (0..6).map(|node| {
        let l = l.clone();
        async move {
            let lease = leased(&l, "X", &format!("x{node}"), 100).await;
            let mut outcomes = Vec::new();
            for round in 0..5 {
                // Customers 1..=10 each try orders o{c}-{0..3}; every node sends the same ones.
                let rs: Vec<BatchRow> = (1..=10)
                    .flat_map(|c| {
                        (0..4).map(move |k| BatchRow {
                            order_id: format!("x-{c}-{}", (k + round) % 4),
                            customer_id: c,
                        })
                    })
                    .collect();
                let out = l
                    .commit_batch(&batch("X", lease.id, rs.clone()))
                    .await
                    .unwrap();
                outcomes.extend(rs.into_iter().zip(out));
            }
            outcomes
        }
    });
    let all: Vec<(BatchRow, RowOutcome)> = join_all(nodes).await.into_iter().flatten().collect();
    let mut created: HashMap<String, i64> = HashMap::new();
    let mut per_customer: HashMap<i64, i64> = HashMap::new();
    for (row, o) in &all {
        match o {
            RowOutcome::Created(r) => {
                assert_eq!(
                    (r.order_id.as_str(), r.customer_id),
                    (row.order_id.as_str(), row.customer_id)
                );
                *created.entry(row.order_id.clone()).or_insert(0) += 1;
                *per_customer.entry(row.customer_id).or_insert(0) += 1;
            }
            RowOutcome::Replayed(r) => assert_eq!(r.order_id, row.order_id),
            other => assert_eq!(other, &RowOutcome::AlreadyUsed),
        }
    }
    assert!(
        created.values().all(|n| *n == 1),
        "an order created twice: {created:?}"
    );
    // Order ids name their customer, and nobody releases: an order some node created answers
    // every other node's row for it with that reservation (a replay, also when the two inserts
    // raced), and a row is refused only for an order nobody ever got.
    for (row, o) in &all {
        assert_eq!(
            created.contains_key(&row.order_id),
            o != &RowOutcome::AlreadyUsed,
            "{row:?}: {o:?}"
        );
    }
    assert_eq!(per_customer.len(), 10);
    assert!(
        per_customer.values().all(|n| *n == 2),
        "each customer exactly at the limit: {per_customer:?}"
    );
    let c = balanced(l, "X").await;
    assert_eq!(c.reserved, 20);
}

/// Nodes that commit the same customers at once, each with order ids of its own: every row would
/// insert on its own, so only the ledger's serialisation of each (voucher, customer) keeps the
/// per-customer limit (1 here): each customer ends with exactly one reservation.
async fn concurrent_batches_keep_each_customer_to_the_limit(l: &SharedLedger) {
    l.create_voucher(&voucher("Y", 10_000, 1), NOW)
        .await
        .unwrap();
    let nodes = (0..6).map(|node| {
        let l = l.clone();
        async move {
            let lease = leased(&l, "Y", &format!("y{node}"), 1000).await;
            let mut created = Vec::new();
            for round in 0..8 {
                let rs: Vec<BatchRow> = (0..40)
                    .map(|c| BatchRow {
                        order_id: format!("y-{node}-{round}-{c}"),
                        customer_id: 1 + round * 40 + c,
                    })
                    .collect();
                let out = l.commit_batch(&batch("Y", lease.id, rs)).await.unwrap();
                for o in out {
                    match o {
                        RowOutcome::Created(r) => created.push(r.customer_id),
                        other => assert_eq!(other, RowOutcome::AlreadyUsed),
                    }
                }
            }
            created
        }
    });
    let mut per_customer: HashMap<i64, i64> = HashMap::new();
    for c in join_all(nodes).await.into_iter().flatten() {
        *per_customer.entry(c).or_insert(0) += 1;
    }
    assert_eq!(per_customer.len(), 320, "every customer got one");
    let over: Vec<_> = per_customer.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        over.is_empty(),
        "{} customers over the limit of 1, such as {:?}",
        over.len(),
        &over[..over.len().min(5)]
    );
    let c = balanced(l, "Y").await;
    assert_eq!(c.reserved, 320);
}

/// The node-wide group commit: batches of several vouchers (and a voucher twice) in one
/// transaction, as if committed one after the other. A fenced batch takes nothing and the others
/// commit; limits, replays and order-id clashes are decided per row, across batches too.
async fn merged_batches_settle_each_batch_on_its_own(l: &SharedLedger) {
    for (code, per_user) in [("M1", 1), ("M2", 1), ("M3", 1), ("M4", 1)] {
        l.create_voucher(&voucher(code, 10, per_user), NOW)
            .await
            .unwrap();
    }
    let lease =
        |code: &'static str, units: i64| async move { leased(l, code, "n1", units).await.id };
    let (m1, m1b, m2, m3, m4) = (
        lease("M1", 3).await,
        lease("M1", 2).await,
        lease("M2", 2).await,
        lease("M3", 3).await,
        lease("M4", 2).await,
    );
    // A stored order of M3 that the merged batch replays.
    let stored = l
        .commit_batch(&batch("M3", m3, rows(&[("m3-old", 30)])))
        .await
        .unwrap();
    // M2's lease is gone (returned), so its batch is fenced; M4 is paused in the ledger.
    l.return_lease(m2, NOW).await.unwrap();
    l.update_voucher(
        "M4",
        &VoucherPatch {
            status: Some(VoucherStatus::Paused),
            ..Default::default()
        },
    )
    .await
    .unwrap();

    let results = l
        .commit_batches(&[
            batch("M1", m1, rows(&[("m1-a", 10), ("m1-b", 11), ("m1-c", 10)])),
            batch("M2", m2, rows(&[("m2-a", 20)])),
            batch(
                "M3",
                m3,
                rows(&[("m3-old", 30), ("m3-new", 31), ("m1-a", 32), ("m3-new", 31)]),
            ),
            batch("M4", m4, rows(&[("m4-a", 40), ("m3-old", 41)])),
            // M1 again, on its other lease: customer 10 is already at the limit of 1.
            batch("M1", m1b, rows(&[("m1-d", 12), ("m1-e", 10)])),
        ])
        .await
        .expect("the merged transaction commits");
    assert_eq!(results.len(), 5);
    let m1_out = results[0].as_ref().expect("M1 commits");
    assert!(matches!(m1_out[0], RowOutcome::Created(_)));
    assert!(matches!(m1_out[1], RowOutcome::Created(_)));
    assert_eq!(
        m1_out[2],
        RowOutcome::AlreadyUsed,
        "customer 10 hit the limit"
    );
    assert!(
        matches!(results[1], Err(LedgerError::Fenced)),
        "M2's lease was returned: {:?}",
        results[1]
    );
    let m3_out = results[2].as_ref().expect("M3 commits");
    assert_eq!(
        m3_out[0],
        match &stored[0] {
            RowOutcome::Created(r) => RowOutcome::Replayed(r.clone()),
            other => panic!("the stored order was not created: {other:?}"),
        },
        "a stored order replays as it was stored"
    );
    assert!(matches!(m3_out[1], RowOutcome::Created(_)));
    assert_eq!(
        m3_out[2],
        RowOutcome::AlreadyUsed,
        "an order id M1's batch took in the same transaction"
    );
    assert!(
        matches!((&m3_out[1], &m3_out[3]), (RowOutcome::Created(a), RowOutcome::Replayed(b)) if a == b),
        "a repeat inside the batch gets the first row's reservation: {m3_out:?}"
    );
    assert_eq!(
        results[3].as_ref().expect("M4 answers"),
        &vec![RowOutcome::NotEligible(Ineligible::Paused); 2],
        "DESIGN §4: NOT_ELIGIBLE before ALREADY_USED, for an order id taken elsewhere too"
    );
    let m1b_out = results[4].as_ref().expect("M1's second batch commits");
    assert!(matches!(m1b_out[0], RowOutcome::Created(_)));
    assert_eq!(
        m1b_out[1],
        RowOutcome::AlreadyUsed,
        "the limit spans batches"
    );
    // Both of M1's batches count, in this transaction's answers and in the next one's (the
    // SQLite writer's usage counts take M1's rows as two runs of the transaction's rows).
    let mut usage = l.customer_usage("M1", &[10, 11, 12, 13]).await.unwrap();
    usage.sort();
    assert_eq!(usage, vec![(10, 1), (11, 1), (12, 1)]);
    let next = l
        .commit_batch(&batch("M1", m1b, rows(&[("m1-f", 12), ("m1-g", 13)])))
        .await
        .unwrap();
    assert_eq!(
        next[0],
        RowOutcome::AlreadyUsed,
        "customer 12 came in M1's second batch"
    );
    assert!(matches!(next[1], RowOutcome::Created(_)), "{next:?}");

    assert!(
        l.find_orders(&["m2-a".into(), "m4-a".into(), "m1-c".into(), "m1-e".into()])
            .await
            .unwrap()
            .is_empty(),
        "refused rows and fenced batches leave no trace"
    );
    let m1_a = l.find_orders(&["m1-a".into()]).await.unwrap();
    assert_eq!(
        (
            m1_a.len(),
            m1_a[0].voucher_code.as_str(),
            m1_a[0].customer_id
        ),
        (1, "M1", 10)
    );
    let expect = [("M1", 4, 1), ("M2", 0, 0), ("M3", 2, 1), ("M4", 0, 2)];
    for (code, reserved, leased_unused) in expect {
        let c = balanced(l, code).await;
        assert_eq!(
            (
                c.reserved,
                c.leased_unused,
                c.free + c.leased_unused + c.reserved
            ),
            (reserved, leased_unused, 10),
            "{code}: {c:?}"
        );
    }
}

/// An order id that one batch's row did not take (its lease is fenced, its customer at the
/// limit) is still free for another voucher's batch in the same merged transaction, as if the
/// batches had committed one after the other. A batch of replays answers even on a lease that
/// is gone, and a batch for an unknown voucher is refused on its own.
async fn an_order_id_is_not_taken_by_a_row_that_never_inserts(l: &SharedLedger) {
    for code in ["X1", "X2", "X3", "X4"] {
        l.create_voucher(&voucher(code, 10, 1), NOW).await.unwrap();
    }
    let grant = |code: &'static str| async move { leased(l, code, "n1", 3).await.id };
    let (x1, x2, x3, x4) = (
        grant("X1").await,
        grant("X2").await,
        grant("X3").await,
        grant("X4").await,
    );
    let won = l
        .commit_batch(&batch("X2", x2, rows(&[("x2-old", 61)])))
        .await
        .unwrap();
    l.return_lease(x1, NOW).await.unwrap();
    l.return_lease(x2, NOW).await.unwrap();
    // Customer 70 is at its limit of 1 on X3.
    l.commit_batch(&batch("X3", x3, rows(&[("x3-first", 70)])))
        .await
        .unwrap();
    let results = l
        .commit_batches(&[
            batch("X1", x1, rows(&[("shared-a", 50)])),
            batch("X3", x3, rows(&[("shared-b", 70)])),
            batch("X2", x2, rows(&[("x2-old", 61), ("x2-none", 60)])),
            batch("NOPE", x3, rows(&[("nope-1", 1)])),
            batch("X4", x4, rows(&[("shared-a", 71), ("shared-b", 72)])),
        ])
        .await
        .expect("the merged transaction commits");
    assert!(
        matches!(results[0], Err(LedgerError::Fenced)),
        "{:?}",
        results[0]
    );
    assert_eq!(
        results[1].as_ref().unwrap()[0],
        RowOutcome::AlreadyUsed,
        "customer 70 is at the limit"
    );
    assert!(
        matches!(results[2], Err(LedgerError::Fenced)),
        "a new row on a returned lease is fenced: {:?}",
        results[2]
    );
    assert!(
        matches!(results[3], Err(LedgerError::NotFound)),
        "{:?}",
        results[3]
    );
    let x3_out = results[4].as_ref().expect("X4's batch commits");
    assert!(
        matches!(&x3_out[0], RowOutcome::Created(r) if r.customer_id == 71),
        "the fenced batch never stored shared-a: {x3_out:?}"
    );
    assert!(
        matches!(&x3_out[1], RowOutcome::Created(r) if r.customer_id == 72),
        "the row at its limit never stored shared-b: {x3_out:?}"
    );
    // Only replays: answered even though the lease is gone.
    let replay = l
        .commit_batches(&[batch("X2", x2, rows(&[("x2-old", 61)]))])
        .await
        .unwrap();
    match (&won[0], &replay[0]) {
        (RowOutcome::Created(a), Ok(out)) => assert_eq!(out[0], RowOutcome::Replayed(a.clone())),
        other => panic!("expected the stored order back: {other:?}"),
    }
    for code in ["X1", "X2", "X3", "X4"] {
        balanced(l, code).await;
    }
}

async fn edits_follow_the_rules(l: &SharedLedger) {
    l.create_voucher(&voucher("E", 5, 1), NOW).await.unwrap();
    let shrink = VoucherPatch {
        total_limit: Some(4),
        ..Default::default()
    };
    assert!(matches!(
        l.update_voucher("E", &shrink).await,
        Err(LedgerError::Invalid(_))
    ));
    let grow = VoucherPatch {
        total_limit: Some(8),
        status: Some(VoucherStatus::Paused),
        ..Default::default()
    };
    let (v, restock) = l.update_voucher("E", &grow).await.unwrap();
    assert_eq!(
        (v.total_limit, v.status, restock.map(|r| r.units)),
        (8, VoucherStatus::Paused, Some(3))
    );
    assert_eq!(l.voucher("E").await.unwrap().unwrap(), v);
    assert!(matches!(
        l.update_voucher("NOPE", &grow).await,
        Err(LedgerError::NotFound)
    ));
    let c = balanced(l, "E").await;
    assert_eq!(c.free, 8);
    // A voucher's own rate limits round-trip; a patch sets, clears (back to the default) or
    // leaves each one.
    let limited = Voucher {
        limits: VoucherLimits {
            customer_per_sec: Some(3),
            customer_burst: Some(0),
            admission_per_sec: None,
        },
        ..voucher("EL", 5, 1)
    };
    l.create_voucher(&limited, NOW).await.unwrap();
    assert_eq!(l.voucher("EL").await.unwrap().unwrap(), limited);
    let (v, _) = l
        .update_voucher(
            "EL",
            &VoucherPatch {
                customer_per_sec: Some(None),
                admission_per_sec: Some(Some(50)),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let expected = VoucherLimits {
        customer_per_sec: None,
        customer_burst: Some(0),
        admission_per_sec: Some(50),
    };
    assert_eq!(v.limits, expected);
    assert_eq!(l.voucher("EL").await.unwrap().unwrap().limits, expected);
    assert_eq!(
        l.voucher_stock("EL").await.unwrap().unwrap().0.limits,
        expected
    );
    // E ends a day after NOW: watched until then, not after.
    assert!(l
        .voucher_codes(NOW, "", 1_000_000)
        .await
        .unwrap()
        .contains(&"E".to_string()));
    assert!(!l
        .voucher_codes(NOW + 2 * 86_400_000, "", 1_000_000)
        .await
        .unwrap()
        .contains(&"E".to_string()));
}

#[tokio::test]
async fn sqlite_ledger_conforms() {
    let dir = temp_dir("ledger");
    let url = format!("sqlite://{}/l.db", dir.display());
    let l = ledger::connect(&url, 4).await.unwrap();
    conformance_at(l, Some(url.clone())).await;
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let traces: i64 = sqlx::query_scalar(UNTOUCHED_USAGE)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(traces, 0, "refused rows left usage rows");
}

/// The embedded ledger counts each customer's usage in its writer's memory (it keeps no index by
/// customer): the counts come back from the rows when the ledger opens again, follow releases
/// and the expiry sweep, and agree with the rows throughout, also when another handle on the
/// same file writes (a second node, or the tests' second handle).
#[tokio::test]
async fn sqlite_usage_comes_back_from_the_rows_and_follows_them() {
    let dir = temp_dir("usage");
    let url = format!("sqlite://{}/l.db", dir.display());
    let l = ledger::connect(&url, 2).await.unwrap();
    l.create_voucher(&voucher("RU", 10, 2), NOW).await.unwrap();
    let lease = leased(&l, "RU", "n1", 10).await.id;
    let created = |out: &[RowOutcome]| out.iter().all(|o| matches!(o, RowOutcome::Created(_)));
    let out = l
        .commit_batch(&batch(
            "RU",
            lease,
            rows(&[("ru-1", 5), ("ru-2", 5), ("ru-3", 6)]),
        ))
        .await
        .unwrap();
    assert!(created(&out), "{out:?}");
    drop(l);

    let l = ledger::connect(&url, 2).await.unwrap();
    let mut usage = l.customer_usage("RU", &[5, 6, 7]).await.unwrap();
    usage.sort();
    assert_eq!(usage, vec![(5, 2), (6, 1)], "counted again from the rows");
    let one = |order: &'static str, customer: i64, now: i64, expires_at: i64| Batch {
        now,
        expires_at,
        ..batch("RU", lease, rows(&[(order, customer)]))
    };
    let far = NOW + 900_000;
    assert_eq!(
        l.commit_batch(&one("ru-4", 5, NOW, far)).await.unwrap()[0],
        RowOutcome::AlreadyUsed,
        "customer 5 is at the limit after the reopen"
    );
    l.release("RU", "ru-1", NOW + 1).await.unwrap();
    assert!(created(
        &l.commit_batch(&one("ru-5", 5, NOW + 2, far)).await.unwrap()
    ));
    assert!(created(
        &l.commit_batch(&one("ru-6", 6, NOW + 3, NOW + 5))
            .await
            .unwrap()
    ));
    assert_eq!(
        l.commit_batch(&one("ru-7", 6, NOW + 4, far)).await.unwrap()[0],
        RowOutcome::AlreadyUsed,
        "customer 6 is at the limit"
    );
    let swept = l.expire_due(NOW + 10, 100).await.unwrap();
    assert_eq!(swept.iter().map(|r| r.units).sum::<i64>(), 1, "{swept:?}");
    assert!(
        created(
            &l.commit_batch(&one("ru-8", 6, NOW + 20, far))
                .await
                .unwrap()
        ),
        "the sweep gave customer 6 a unit back"
    );
    balanced(&l, "RU").await;
    let mut usage = l.customer_usage("RU", &[5, 6, 7]).await.unwrap();
    usage.sort();
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let rows: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT customer_id, used FROM customer_usage WHERE voucher_code = 'RU' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(usage, rows, "the writer's counts are the rows' counts");
    assert_eq!(usage, vec![(5, 2), (6, 2)]);

    // Another handle on the file releases one of customer 5's and reserves for customer 7;
    // this one's counts follow both.
    let other = ledger::connect(&url, 2).await.unwrap();
    assert_eq!(l.customer_usage("RU", &[5]).await.unwrap(), vec![(5, 2)]);
    other.release("RU", "ru-2", NOW + 30).await.unwrap();
    assert!(created(
        &other
            .commit_batch(&one("ru-9", 7, NOW + 31, far))
            .await
            .unwrap()
    ));
    let mut usage = l.customer_usage("RU", &[5, 6, 7]).await.unwrap();
    usage.sort();
    assert_eq!(usage, vec![(5, 1), (6, 2), (7, 1)]);
    assert!(created(
        &l.commit_batch(&one("ru-10", 5, NOW + 32, far))
            .await
            .unwrap()
    ));
    assert!(created(
        &other
            .commit_batch(&one("ru-11", 7, NOW + 33, far))
            .await
            .unwrap()
    ));
    assert_eq!(
        l.commit_batch(&one("ru-12", 7, NOW + 34, far))
            .await
            .unwrap()[0],
        RowOutcome::AlreadyUsed,
        "customer 7 reached the limit through the other handle"
    );
    balanced(&l, "RU").await;
}

/// The in-memory model ledger (the one a deterministic simulation runs against) passes the same
/// suite; refused rows leave no usage behind there either.
#[tokio::test]
async fn model_ledger_conforms() {
    let l: SharedLedger = std::sync::Arc::new(ledger::model::ModelLedger::new("model"));
    conformance_at(l.clone(), None).await;
    for (code, customer) in [("M2", 20), ("M4", 40), ("X1", 50), ("X2", 60)] {
        let usage = l.customer_usage(code, &[customer]).await.unwrap();
        assert!(
            usage.is_empty(),
            "refused rows left usage: {code} {usage:?}"
        );
    }
}

/// A fresh PostgreSQL schema for one test: its URL (search_path set through `options`).
pub async fn fresh_pg_schema(tag: &str) -> Option<String> {
    let base = crate::helpers::service_url("TEST_DATABASE_URL")?;
    let schema = format!("t_{tag}_{}", vouchers::startup::random_hex(6));
    let pool = sqlx::PgPool::connect(&base)
        .await
        .expect("connect TEST_DATABASE_URL");
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&pool)
        .await
        .expect("create schema");
    pool.close().await;
    let sep = if base.contains('?') { '&' } else { '?' };
    Some(format!("{base}{sep}options=-c%20search_path%3D{schema}"))
}

/// `n` fresh schemas, `{tag}0` … (see [`fresh_pg_schema`]); `None` without PostgreSQL.
pub async fn fresh_pg_schemas(tag: &str, n: usize) -> Option<Vec<String>> {
    let mut urls = Vec::with_capacity(n);
    for i in 0..n {
        urls.push(fresh_pg_schema(&format!("{tag}{i}")).await?);
    }
    Some(urls)
}

#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn postgres_ledger_conforms() {
    let Some(url) = fresh_pg_schema("conf").await else {
        return;
    };
    let l = ledger::connect(&url, 8).await.unwrap();
    conformance_at(l, Some(url.clone())).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let traces: i64 = sqlx::query_scalar(UNTOUCHED_USAGE)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(traces, 0, "refused rows left usage rows");
}

/// The ledger in three shards (three PostgreSQL schemas): every check of the suite, the auditor
/// reading each voucher's rows on the one shard that holds them.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn sharded_ledger_conforms() {
    let Some(urls) = fresh_pg_schemas("shard", 3).await else {
        return;
    };
    let l = ledger::connect_sharded(&urls, 4, true).await.unwrap();
    AUDIT_URL.scope(Some(urls.clone()), conformance(l)).await;
    // The vouchers were spread: each shard holds some.
    for url in &urls {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM vouchers")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(n > 0, "{url} holds no voucher");
    }
}

/// DESIGN §4's order rule across shards, by the order claims: raced on two vouchers of two
/// shards, each order id is stored once; an order refused on one voucher (paused) may still be
/// used on another, while one stored (and replayed) never can; the claims left are exactly the
/// stored orders'.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn order_claims_keep_an_order_on_one_voucher_across_shards() {
    let Some(urls) = fresh_pg_schemas("claim", 2).await else {
        return;
    };
    let l = ledger::connect_sharded(&urls, 8, true).await.unwrap();
    // Placed by room: X on the first shard, Y on the second.
    l.create_voucher(&voucher("X", 1_000, 1_000), NOW)
        .await
        .unwrap();
    l.create_voucher(&voucher("Y", 1_000, 1_000), NOW)
        .await
        .unwrap();
    assert_ne!(
        the_one_holding(&urls, "X").await,
        the_one_holding(&urls, "Y").await
    );
    let (lx, ly) = (
        leased(&l, "X", "n1", 500).await.id,
        leased(&l, "Y", "n2", 500).await.id,
    );
    // 200 order ids, each sent to both vouchers at once (by two "nodes").
    let races = (0..200).map(|i| {
        let (l, order) = (l.clone(), format!("race-{i}"));
        async move {
            let on = |code: &'static str, lease: i64| {
                let (l, order) = (l.clone(), order.clone());
                async move {
                    l.commit_batch(&batch(code, lease, rows(&[(&order, 1 + i)])))
                        .await
                        .unwrap()
                        .remove(0)
                }
            };
            tokio::join!(on("X", lx), on("Y", ly))
        }
    });
    let answers = join_all(races).await;
    for (i, (x, y)) in answers.iter().enumerate() {
        let created = [x, y]
            .iter()
            .filter(|o| matches!(o, RowOutcome::Created(_)))
            .count();
        assert_eq!(created, 1, "race-{i}: {x:?} / {y:?}");
        assert!(
            [x, y].iter().any(|o| **o == RowOutcome::AlreadyUsed),
            "race-{i}: the other is refused: {x:?} / {y:?}"
        );
    }
    // Refused on a paused voucher: the order may still go elsewhere.
    l.update_voucher(
        "X",
        &VoucherPatch {
            status: Some(VoucherStatus::Paused),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let paused = l
        .commit_batch(&batch("X", lx, rows(&[("roam", 7)])))
        .await
        .unwrap();
    assert!(
        matches!(paused[0], RowOutcome::NotEligible(_)),
        "{paused:?}"
    );
    let elsewhere = l
        .commit_batch(&batch("Y", ly, rows(&[("roam", 7)])))
        .await
        .unwrap();
    assert!(
        matches!(elsewhere[0], RowOutcome::Created(_)),
        "{elsewhere:?}"
    );
    // Stored and replayed on Y: never usable on X.
    let replay = l
        .commit_batch(&batch("Y", ly, rows(&[("roam", 7)])))
        .await
        .unwrap();
    assert!(matches!(replay[0], RowOutcome::Replayed(_)), "{replay:?}");
    l.update_voucher(
        "X",
        &VoucherPatch {
            status: Some(VoucherStatus::Active),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let taken = l
        .commit_batch(&batch("X", lx, rows(&[("roam", 7)])))
        .await
        .unwrap();
    assert_eq!(taken[0], RowOutcome::AlreadyUsed);
    // The directory's claims are exactly the stored orders, each for its voucher.
    let pool = sqlx::PgPool::connect(&urls[0]).await.unwrap();
    let claims: Vec<(String, String)> =
        sqlx::query_as("SELECT order_id, code FROM order_claims ORDER BY order_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let mut stored = Vec::new();
    for url in &urls {
        let p = sqlx::PgPool::connect(url).await.unwrap();
        let rows: Vec<(String, String)> =
            sqlx::query_as("SELECT order_id, voucher_code FROM reservations")
                .fetch_all(&p)
                .await
                .unwrap();
        stored.extend(rows);
    }
    stored.sort();
    assert_eq!(claims, stored);
    AUDIT_URL
        .scope(Some(urls.clone()), async {
            for code in ["X", "Y"] {
                balanced(&l, code).await;
            }
        })
        .await;
}

/// A shard's database is refused as a ledger of its own (its orders would go unclaimed), and a
/// database that already holds vouchers is refused as a shard after the first.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn shard_databases_are_used_only_as_shards() {
    let (Some(a), Some(b), Some(c)) = (
        fresh_pg_schema("only0").await,
        fresh_pg_schema("only1").await,
        fresh_pg_schema("only2").await,
    ) else {
        return;
    };
    let l = ledger::connect_sharded(&[a.clone(), b.clone()], 2, true)
        .await
        .unwrap();
    drop(l);
    for url in [&a, &b] {
        let e = ledger::connect(url, 2).await.err().expect("refused");
        assert!(format!("{e:#}").contains("ledger.shards"), "{e:#}");
    }
    // A single ledger with vouchers may become the first shard, not a later one.
    let single = ledger::connect(&c, 2).await.unwrap();
    single
        .create_voucher(&voucher("OLD", 5, 1), NOW)
        .await
        .unwrap();
    let (Some(d), Some(e)) = (
        fresh_pg_schema("only3").await,
        fresh_pg_schema("only4").await,
    ) else {
        return;
    };
    let err = ledger::connect_sharded(&[d.clone(), c.clone()], 2, true)
        .await
        .err()
        .expect("refused");
    assert!(format!("{err:#}").contains("start empty"), "{err:#}");
    // The refused list marked none of its databases: the empty one is still free to use.
    ledger::connect(&d, 2).await.expect("left unmarked");
    // Listed in another order than they were first given: refused.
    let err = ledger::connect_sharded(&[b, a], 2, true)
        .await
        .err()
        .expect("refused");
    assert!(format!("{err:#}").contains("another place"), "{err:#}");
    let l = ledger::connect_sharded(&[c, e], 2, true).await.unwrap();
    assert!(
        l.voucher("OLD").await.unwrap().is_some(),
        "kept on the first shard"
    );
}

/// Orders stored while no claims were made (one shard) are claimed when claims begin (a second
/// shard is added), so none can be stored again on a voucher of the new shard; nodes still
/// running without claims are fenced by each shard (and stop at their next beat); and once the
/// directory claims, a node that would store without claims is refused.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn orders_stored_before_claims_begin_stay_on_their_voucher() {
    let (Some(a), Some(b)) = (
        fresh_pg_schema("grow0").await,
        fresh_pg_schema("grow1").await,
    ) else {
        return;
    };
    // A node on `ledger.url` that was left running when the ledger went sharded.
    let plain = ledger::connect(&a, 2).await.unwrap();
    let one = ledger::connect_sharded(std::slice::from_ref(&a), 2, true)
        .await
        .unwrap();
    one.create_voucher(&voucher("OLD", 100, 1), NOW)
        .await
        .unwrap();
    let lease = leased(&one, "OLD", "n1", 10).await.id;
    let early = one
        .commit_batch(&batch("OLD", lease, rows(&[("early", 1)])))
        .await
        .unwrap();
    assert!(matches!(early[0], RowOutcome::Created(_)), "{early:?}");
    let pool = sqlx::PgPool::connect(&a).await.unwrap();
    let claims = || async {
        sqlx::query_as::<_, (String, String)>("SELECT order_id, code FROM order_claims")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    assert!(claims().await.is_empty(), "one shard makes no claim");
    // A second node without claims, which will not commit before its next beat.
    let idle = ledger::connect_sharded(std::slice::from_ref(&a), 2, true)
        .await
        .unwrap();
    let node = idle.register_node("n1", NOW, 60_000).await.unwrap();

    let urls = [a.clone(), b.clone()];
    let two = ledger::connect_sharded(&urls, 2, true).await.unwrap();
    assert_eq!(claims().await, [("early".to_string(), "OLD".to_string())]);
    two.create_voucher(&voucher("NEW", 100, 1), NOW)
        .await
        .unwrap();
    assert_eq!(the_one_holding(&urls, "NEW").await, b, "placed by room");
    let lease_new = leased(&two, "NEW", "n2", 10).await.id;
    let again = two
        .commit_batch(&batch("NEW", lease_new, rows(&[("early", 2)])))
        .await
        .unwrap();
    assert_eq!(again[0], RowOutcome::AlreadyUsed);
    let replay = two
        .commit_batch(&batch("OLD", lease, rows(&[("early", 1)])))
        .await
        .unwrap();
    assert!(matches!(replay[0], RowOutcome::Replayed(_)), "{replay:?}");

    // The one-shard nodes stored without claims. The shard itself refuses their commits from
    // the moment its claims began (a fence, whatever their beats say), and the node then
    // refuses every reserve at once.
    assert!(!one.refuses("OLD"));
    let late = one
        .commit_batch(&batch("OLD", lease, rows(&[("late", 3)])))
        .await;
    assert!(late.is_err(), "{late:?}");
    assert!(one.refuses("OLD"));
    assert!(one.ping().await.is_err(), "not ready");
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM reservations WHERE order_id = 'late'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
    // The node on `ledger.url` never reads the mode: the shard's fence refuses it all the same
    // (its lease id is the shard's own: the sharded one without the shard's bits).
    let stray = plain
        .commit_batch(&batch("OLD", lease >> 8, rows(&[("stray", 5)])))
        .await;
    assert!(stray.is_err(), "{stray:?}");
    // And says it is not ready (a load balancer sends it nothing more).
    assert!(
        plain.ping().await.is_err(),
        "the node on ledger.url is not ready"
    );
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM reservations WHERE order_id = 'stray'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
    // The other stops at its next beat, before it tries a commit.
    assert!(!idle.refuses("OLD"));
    idle.heartbeat(&node.holder, NOW, 60_000).await.unwrap();
    assert!(idle.refuses("OLD"));
    let refused = idle
        .commit_batch(&batch("OLD", lease, rows(&[("later", 4)])))
        .await;
    assert!(
        matches!(refused, Err(LedgerError::CircuitOpen)),
        "{refused:?}"
    );

    // Claims stay: a node that would store without them is refused.
    let err = ledger::connect_sharded(&urls, 2, false)
        .await
        .err()
        .expect("refused");
    assert!(
        format!("{err:#}").contains("order_ids_across_shards"),
        "{err:#}"
    );
    // Back to one shard (the second holds a voucher: refused), claims go on.
    let err = ledger::connect_sharded(&urls[..1], 2, true)
        .await
        .err()
        .expect("refused");
    assert!(format!("{err:#}").contains("does not list"), "{err:#}");
}

/// A merge of more customers than one call may lock (512, see `MAX_CUSTOMERS_PER_CALL`) goes in
/// several calls, each its own transaction with its own change-feed batch, and every row of
/// every batch is decided as in one call.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn postgres_a_merge_of_many_customers_goes_in_several_calls() {
    let Some(url) = fresh_pg_schema("wide").await else {
        return;
    };
    let l = ledger::connect(&url, 2).await.unwrap();
    let mut batches = Vec::new();
    for v in 0..3 {
        let code = format!("W{v}");
        l.create_voucher(&voucher(&code, 1000, 1), NOW)
            .await
            .unwrap();
        let lease = leased(&l, &code, "n1", 400).await;
        // 300 customers each, and customer 1 twice (the second is over the limit).
        let mut rs: Vec<BatchRow> = (1..=300)
            .map(|c| BatchRow {
                order_id: format!("w{v}-{c}"),
                customer_id: c,
            })
            .collect();
        rs.push(BatchRow {
            order_id: format!("w{v}-again"),
            customer_id: 1,
        });
        batches.push(batch(&code, lease.id, rs));
    }
    let out = l.commit_batches(&batches).await.unwrap();
    for (b, res) in batches.iter().zip(out) {
        let res = res.unwrap();
        assert_eq!(res.len(), 301);
        let created = res
            .iter()
            .filter(|o| matches!(o, RowOutcome::Created(_)))
            .count();
        assert_eq!(created, 300, "{}", b.voucher_code);
        assert_eq!(res[300], RowOutcome::AlreadyUsed);
        assert_eq!(balanced(&l, &b.voucher_code).await.reserved, 300);
    }
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let calls: i64 = sqlx::query_scalar("SELECT count(*) FROM feed_batches")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    assert_eq!(calls, 3, "300 + 300 customers pass 512: one call per batch");

    // One batch of as many customers as the function takes locks for (1,024, what a build
    // before the bound sends) commits; one more, and the call is refused before anything is
    // locked or written.
    l.create_voucher(&voucher("W9", 5000, 1), NOW)
        .await
        .unwrap();
    let lease = leased(&l, "W9", "n1", 3000).await;
    let wide = |from: i64, n: i64| -> Vec<BatchRow> {
        (from..from + n)
            .map(|c| BatchRow {
                order_id: format!("w9-{c}"),
                customer_id: c,
            })
            .collect()
    };
    let taken = l.commit_batch(&batch("W9", lease.id, wide(1, 1024))).await;
    assert!(
        matches!(&taken, Ok(rows) if rows.iter().all(|o| matches!(o, RowOutcome::Created(_)))),
        "{taken:?}"
    );
    let refused = l
        .commit_batch(&batch("W9", lease.id, wide(2000, 1025)))
        .await;
    assert!(
        matches!(&refused, Err(LedgerError::Database { code: Some(c), .. }) if c == "VC003"),
        "{refused:?}"
    );
    assert_eq!(balanced(&l, "W9").await.reserved, 1024);

    // The index migration 15 replaced goes after the migration's transaction, on its own.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    replaced_indexes_dropped(&pool).await;
    pool.close().await;
}

/// Waits until the indexes later migrations replaced (`reservations_by_voucher` by 15's,
/// `leases_by_voucher` and `leases_active_by_voucher` by 16's) are gone from the pool's
/// schema: they are dropped after the migration's transaction, by a task of its own.
async fn replaced_indexes_dropped(pool: &sqlx::PgPool) {
    crate::helpers::eventually(
        "the replaced indexes dropped",
        // The replacement is built concurrently first, which waits for every older
        // transaction of the database: other tests' held locks included.
        std::time::Duration::from_secs(90),
        || {
            let pool = pool.clone();
            async move {
                let left: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_indexes WHERE schemaname = current_schema() \
                     AND indexname IN ('reservations_by_voucher', 'leases_by_voucher', \
                     'leases_active_by_voucher')",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                left == 0
            }
        },
    )
    .await;
}

/// A PostgreSQL ledger of one connection on a fresh schema (each plan is made once, on it,
/// after the analyze), whose `tables` were analyzed while empty once the indexes later
/// migrations replaced are gone, with autovacuum off on them (its analyze would make the plans
/// again on what the tables hold later, hiding what a plan made on them empty does); and a
/// pool to read the schema's statistics. `None` without PostgreSQL.
async fn analyzed_empty(tag: &str, tables: &str) -> Option<(SharedLedger, sqlx::PgPool)> {
    let url = fresh_pg_schema(tag).await?;
    let l = ledger::connect(&url, 1).await.unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    replaced_indexes_dropped(&pool).await;
    for table in tables.split(", ") {
        sqlx::query(&format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        ))
        .execute(&pool)
        .await
        .unwrap();
    }
    sqlx::query(&format!("VACUUM ANALYZE {tables}"))
        .execute(&pool)
        .await
        .unwrap();
    Some((l, pool))
}

/// How many scans the statistics have counted on the index `index` of the pool's schema.
async fn index_scans(pool: &sqlx::PgPool, index: &str) -> i64 {
    index_stat(pool, index, "idx_scan").await
}

/// How many entries the scans of the index `index` of the pool's schema returned.
async fn index_entries_read(pool: &sqlx::PgPool, index: &str) -> i64 {
    index_stat(pool, index, "idx_tup_read").await
}

/// One counter (`column` of `pg_stat_user_indexes`) of the index `index` of the pool's schema.
async fn index_stat(pool: &sqlx::PgPool, index: &str, column: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT {column} FROM pg_stat_user_indexes \
         WHERE schemaname = current_schema() AND indexrelname = $1"
    ))
    .bind(index)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The merged commit's usage probes read `reservations_by_customer` even when the function's
/// generic plan is made while the table is empty and analyzed so (a new database analyzed
/// before its first sale, a truncated table). With the statuses as literals, that plan probed
/// the partial index `reservations_due` (`status = 'RESERVED'`) and read every reserved row
/// per probe until the next analyze: a cost that grew with the table. The index statistics
/// tell which index the probes used.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn postgres_usage_probes_keep_their_index_on_a_table_analyzed_empty() {
    // While it is there, `reservations_by_voucher` is a third choice for the probes.
    let Some((l, pool)) = analyzed_empty("probe", "reservations").await else {
        return;
    };
    l.create_voucher(&voucher("PROBE", 1000, 1), NOW)
        .await
        .unwrap();
    let lease = leased(&l, "PROBE", "n1", 400).await;
    for call in 0..4 {
        let rows = (1..=50)
            .map(|c| BatchRow {
                order_id: format!("probe-{call}-{c}"),
                customer_id: call * 100 + c,
            })
            .collect();
        let out = l
            .commit_batch(&batch("PROBE", lease.id, rows))
            .await
            .unwrap();
        assert!(out.iter().all(|o| matches!(o, RowOutcome::Created(_))));
    }
    // Two probes for each of the 200 rows, and no other index scan of the table in this
    // schema. A backend flushes its counts at the end of a transaction at most once a second
    // (and when idle), so the calls' counts arrive in parts: wait for all 400.
    crate::helpers::eventually(
        "the commits' index scans in the statistics",
        std::time::Duration::from_secs(30),
        || async {
            index_scans(&pool, "reservations_by_customer").await
                + index_scans(&pool, "reservations_due").await
                >= 400
        },
    )
    .await;
    assert_eq!(
        index_scans(&pool, "reservations_due").await,
        0,
        "a usage probe read the partial index of reserved rows"
    );
    assert_eq!(index_scans(&pool, "reservations_by_customer").await, 400);
    pool.close().await;
}

/// The grant's, the lease triggers' and the confirm's generic plans (`migrations/postgres/
/// grant.sql`, `0008_settle.sql`: one plan per connection instead of one per call) keep to their
/// indexes when they are made while the tables are empty and analyzed so. A grant sums the
/// voucher's active leases twice (its own statement and the check at commit), each by equality
/// on `leases_by_voucher_state` (migration 16), never by a whole scan of a partial index of
/// active leases by expiry or holder, which hold every voucher's (with the state as a literal,
/// one of the sums scanned the one by holder). A confirm or release finds its row by order id,
/// never among the voucher's reserved rows by `reservations_due` or `reservations_by_customer`
/// (which it did while it looked the row up by voucher and status too). The index statistics
/// tell which indexes the calls used.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn postgres_grant_and_settle_plans_keep_their_indexes_on_tables_analyzed_empty() {
    let Some((l, pool)) = analyzed_empty("plans", "vouchers, leases, reservations").await else {
        return;
    };
    l.create_voucher(&voucher("PLANS", 1000, 1), NOW)
        .await
        .unwrap();
    const GRANTS: i64 = 20;
    for g in 0..GRANTS {
        let lease = leased(&l, "PLANS", "n1", 5).await;
        let rows = (1..=2)
            .map(|c| BatchRow {
                order_id: format!("plans-{g}-{c}"),
                customer_id: g * 10 + c,
            })
            .collect();
        let out = l
            .commit_batch(&batch("PLANS", lease.id, rows))
            .await
            .unwrap();
        assert!(out.iter().all(|o| matches!(o, RowOutcome::Created(_))));
        l.return_lease(lease.id, NOW).await.unwrap();
        l.confirm("PLANS", &format!("plans-{g}-1"), NOW)
            .await
            .unwrap();
        l.release("PLANS", &format!("plans-{g}-2"), NOW)
            .await
            .unwrap();
    }
    let by_voucher = [
        "leases_by_voucher_state",
        "leases_active_by_expiry",
        "leases_active_by_node",
    ];
    let settled = || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT n_tup_upd FROM pg_stat_user_tables \
                 WHERE schemaname = current_schema() AND relname = 'reservations'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    // Counts arrive in parts (a backend flushes them at most once a second, a transaction's
    // all at once): wait until the grants' sums are all in, whichever index they used, and
    // every confirm's and release's update of its row.
    crate::helpers::eventually(
        "the calls' counts in the statistics",
        std::time::Duration::from_secs(30),
        || async {
            let mut n = 0;
            for index in by_voucher {
                n += index_scans(&pool, index).await;
            }
            n >= 2 * GRANTS && settled().await >= 2 * GRANTS
        },
    )
    .await;
    let mut seen = String::new();
    for index in by_voucher
        .iter()
        .chain(&["reservations_due", "reservations_by_customer"])
    {
        seen.push_str(&format!("{index} {}; ", index_scans(&pool, index).await));
    }
    assert_eq!(
        index_scans(&pool, "leases_by_voucher_state").await,
        2 * GRANTS,
        "{seen}"
    );
    assert_eq!(
        index_scans(&pool, "leases_active_by_expiry").await,
        0,
        "{seen}"
    );
    assert_eq!(
        index_scans(&pool, "leases_active_by_node").await,
        0,
        "{seen}"
    );
    assert_eq!(index_scans(&pool, "reservations_due").await, 0, "{seen}");
    // Only the commits' usage probes (two per row): a confirm or release that looked its row
    // up by voucher and status read the voucher's reserved rows by this index.
    assert_eq!(
        index_scans(&pool, "reservations_by_customer").await,
        2 * 2 * GRANTS,
        "{seen}"
    );
    pool.close().await;
}

/// The merged commit reads its batches' vouchers and leases by key whatever the tables held
/// when its plan was made. The plan is made once per connection: made while `leases` and
/// `vouchers` held a row or two and were analyzed so, it joined each batch to its voucher and
/// lease by a whole scan of their primary keys, and updated the lease by another, and kept
/// doing so at every call as the tables grew (every lease ever granted stays): about 10x the
/// call's cost at 200,000 closed leases. The index statistics count the entries each primary
/// key returned. The lease the calls draw on is granted after the growth and the voucher's code
/// sorts after the others, so that a scan in key order that stops at its first match still
/// reads the whole key.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn postgres_merged_commit_reads_by_key_after_its_tables_grow() {
    const TABLES: &str = "vouchers, leases, reservations";
    let Some((l, pool)) = analyzed_empty("grown", TABLES).await else {
        return;
    };
    l.create_voucher(&voucher("ZGROWN", 1000, 1), NOW)
        .await
        .unwrap();
    let commit = |lease: i64, call: i64| {
        let l = l.clone();
        async move {
            let rows = vec![BatchRow {
                order_id: format!("grown-{call}"),
                customer_id: call + 1,
            }];
            let out = l.commit_batch(&batch("ZGROWN", lease, rows)).await.unwrap();
            assert!(matches!(out[..], [RowOutcome::Created(_)]), "{out:?}");
        }
    };
    // The plan is made on one voucher and one lease, analyzed so (autovacuum stays off: no
    // analyze after the growth makes the plan again).
    let first = leased(&l, "ZGROWN", "n1", 10).await;
    sqlx::query(&format!("VACUUM ANALYZE {TABLES}"))
        .execute(&pool)
        .await
        .unwrap();
    commit(first.id, 0).await;
    // Then the tables grow, on a connection closed afterwards (a backend's statistics are all
    // in once it has gone): other vouchers, and leases long closed. Each lease's insert reads
    // its voucher by key (its foreign key, the grant check).
    const GROWN: i64 = 5_000;
    let mut grow = pool.acquire().await.unwrap().detach();
    sqlx::query(
        "INSERT INTO vouchers (code, discount_amount, min_order_amount, total_limit, \
         per_user_limit, starts_at, ends_at, status, free, created_at) \
         SELECT 'OLD' || i, 1, 0, 1, 1, 0, 1, 'ACTIVE', 1, 0 FROM generate_series(1, $1) i",
    )
    .bind(GROWN)
    .execute(&mut grow)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO leases (voucher_code, node_id, granted, state, granted_at, expires_at, \
         closed_at) SELECT 'OLD' || i, 'gone', 1, 'RETURNED', 0, 1, 1 \
         FROM generate_series(1, $1) i",
    )
    .bind(GROWN)
    .execute(&mut grow)
    .await
    .unwrap();
    sqlx::Connection::close(grow).await.unwrap();
    let read = |index| index_entries_read(&pool, index);
    crate::helpers::eventually(
        "the growth's reads in the statistics",
        std::time::Duration::from_secs(30),
        || async { read("vouchers_pkey").await >= GROWN },
    )
    .await;
    let (leases_before, vouchers_before) = (read("leases_pkey").await, read("vouchers_pkey").await);
    let scans_before = index_scans(&pool, "leases_pkey").await;
    // The calls draw on a lease granted now: the highest id.
    let lease = leased(&l, "ZGROWN", "n1", 400).await;
    const CALLS: i64 = 20;
    for call in 1..=CALLS {
        commit(lease.id, call).await;
    }
    // Each call scans `leases_pkey` at least three times, whatever the plan (the lease's lock,
    // read and update). A backend sends its counts in parts, at most once a second: wait
    // until every call's are in.
    crate::helpers::eventually(
        "the calls' index scans in the statistics",
        std::time::Duration::from_secs(30),
        || async { index_scans(&pool, "leases_pkey").await >= scans_before + 3 * CALLS },
    )
    .await;
    // By key, a call reads a few entries of each key (and the grant its voucher's); a whole
    // scan reads GROWN of them at every call.
    let leases = read("leases_pkey").await - leases_before;
    let vouchers = read("vouchers_pkey").await - vouchers_before;
    assert!(
        leases < GROWN,
        "leases_pkey returned {leases} entries to {CALLS} calls after the growth"
    );
    assert!(
        vouchers < GROWN,
        "vouchers_pkey returned {vouchers} entries to {CALLS} calls after the growth"
    );
    pool.close().await;
}

/// DESIGN §3's last line on PostgreSQL after leases close: the grant check reads what closed
/// leases consumed from the voucher's `closed_consumed` (migration 10), which a trigger keeps at
/// every close (a return, a reap, an older build's own statement); a grant past the total is
/// refused as it was when the check summed every lease, and a drifted copy unbalances the books.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn postgres_grant_check_counts_what_closed_leases_consumed() {
    let Some(url) = fresh_pg_schema("closed").await else {
        return;
    };
    let l = ledger::connect(&url, 2).await.unwrap();
    l.create_voucher(&voucher("CC", 10, 1), NOW).await.unwrap();
    let a = leased(&l, "CC", "n1", 4).await;
    l.commit_batch(&batch(
        "CC",
        a.id,
        rows(&[("cc1", 1), ("cc2", 2), ("cc3", 3)]),
    ))
    .await
    .unwrap();
    assert_eq!(
        l.return_lease(a.id, NOW).await.unwrap().map(|r| r.units),
        Some(1)
    );
    let b = leased(&l, "CC", "n2", 3).await;
    l.commit_batch(&batch("CC", b.id, rows(&[("cc4", 4), ("cc5", 5)])))
        .await
        .unwrap();
    assert_eq!(
        reaped_of(&l.reap_expired(NOW + TTL + 1).await.unwrap(), "CC"),
        1
    );
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    // A node of the build before this one, still running during a rolling restart, closes with
    // its own statement (and gives the unused unit back): still counted.
    let c = leased(&l, "CC", "n3", 2).await;
    l.commit_batch(&batch("CC", c.id, rows(&[("cc6", 6)])))
        .await
        .unwrap();
    sqlx::query("UPDATE leases SET state = 'RETURNED', closed_at = 1 WHERE id = $1")
        .bind(c.id)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE vouchers SET free = free + 1 WHERE code = 'CC'")
        .execute(&pool)
        .await
        .unwrap();
    let kept = || async {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT v.closed_consumed, \
                    (SELECT SUM(consumed)::BIGINT FROM leases \
                     WHERE voucher_code = v.code AND state <> 'ACTIVE') \
             FROM vouchers v WHERE v.code = 'CC'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(
        kept().await,
        (6, 6),
        "a return, a reap and an old build's close each added theirs"
    );
    assert_eq!(balanced(&l, "CC").await.free, 4);
    // The trigger counts a lease once: closing a closed lease again changes nothing, and a lease
    // made ACTIVE again by hand takes its units back out (both rolled back).
    let mut tx = pool.begin().await.unwrap();
    for (sql, want) in [
        ("UPDATE leases SET state = 'REAPED' WHERE id = $1", 6),
        ("UPDATE leases SET state = 'ACTIVE' WHERE id = $1", 5),
    ] {
        sqlx::query(sql).bind(c.id).execute(&mut *tx).await.unwrap();
        let now: i64 = sqlx::query_scalar("SELECT closed_consumed FROM vouchers WHERE code = 'CC'")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(now, want, "after `{sql}`");
    }
    tx.rollback().await.unwrap();
    // An active lease with one unit consumed and one unused beside the closed ones.
    let d = leased(&l, "CC", "n4", 2).await;
    l.commit_batch(&batch("CC", d.id, rows(&[("cc7", 7)])))
        .await
        .unwrap();
    // One unit more free than the books allow (the table's own CHECK lets it through): with
    // the six consumed on closed leases and the one on the active lease, a grant of three passes
    // the total of ten by one.
    sqlx::query("UPDATE vouchers SET free = 3 WHERE code = 'CC'")
        .execute(&pool)
        .await
        .unwrap();
    match l.grant("CC", "n5", 3, NOW, TTL).await {
        Err(LedgerError::Database { code, source }) => {
            assert_eq!(
                code.as_deref(),
                Some("23514"),
                "a check violation: {source}"
            )
        }
        other => panic!("a grant past the total was not refused: {other:?}"),
    }
    sqlx::query("UPDATE vouchers SET free = 2 WHERE code = 'CC'")
        .execute(&pool)
        .await
        .unwrap();
    let again = l.grant("CC", "n5", 3, NOW, TTL).await.unwrap();
    assert_eq!(
        again.lease.map(|x| x.granted),
        Some(2),
        "repaired, it grants again"
    );
    // A copy that drifts from the leases is a reconciliation mismatch.
    balanced(&l, "CC").await;
    sqlx::query("UPDATE vouchers SET closed_consumed = closed_consumed - 1 WHERE code = 'CC'")
        .execute(&pool)
        .await
        .unwrap();
    let c = l.counters("CC").await.unwrap().expect("voucher exists");
    assert!(
        !c.balanced,
        "a drifted closed_consumed went unnoticed: {c:?}"
    );
    // A ledger migrated before version 10 has no copy: the migration computes it from the leases.
    for sql in [
        "UPDATE vouchers SET closed_consumed = 0",
        "DELETE FROM schema_migrations WHERE version = 10",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let migrated = ledger::connect(&url, 2).await.unwrap();
    assert_eq!(kept().await, (6, 6), "the backfill");
    // Version 14 was retired (placement's columns are added at every start): a ledger an
    // intermediate build marked with it opens, and the mark is gone.
    sqlx::query("INSERT INTO schema_migrations (version) VALUES (14)")
        .execute(&pool)
        .await
        .unwrap();
    let reopened = ledger::connect(&url, 2).await;
    assert!(reopened.is_ok(), "{:?}", reopened.err());
    let marks: i64 =
        sqlx::query_scalar("SELECT count(*) FROM schema_migrations WHERE version = 14")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(marks, 0);
    balanced(&migrated, "CC").await;
    // Dry now: the answer counts every unit ever consumed, on closed and on active leases.
    let dry = migrated.grant("CC", "n6", 1, NOW, TTL).await.unwrap();
    assert_eq!(
        (dry.lease, dry.leased_unused, dry.ever_reserved),
        (None, 3, Some(7))
    );
}

/// PostgreSQL's lock order: a return (or a reap) takes its voucher rows before its leases, as a
/// grant does. While another transaction holds the voucher row, a return therefore waits without
/// holding its lease, and a batch on that lease goes through. Taken the other way round (leases
/// first), the batch would wait behind the return, and a grant holding the voucher row could
/// deadlock with it.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn postgres_returns_lock_vouchers_before_leases() {
    let Some(url) = fresh_pg_schema("order").await else {
        return;
    };
    // A lock wait gives up after 10 s: a batch stuck behind the return fails instead of hanging.
    let l = ledger::connect_with_timeout(&url, 4, 10_000, 1_000)
        .await
        .unwrap();
    l.create_voucher(&voucher("LO", 10, 5), NOW).await.unwrap();
    let lease = leased(&l, "LO", "n1", 5).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let mut hold = pool.begin().await.unwrap();
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *hold)
        .await
        .unwrap();
    sqlx::query("SELECT 1 FROM vouchers WHERE code = 'LO' FOR UPDATE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let returning = {
        let l = l.clone();
        tokio::spawn(async move { l.return_lease(lease.id, NOW).await })
    };
    crate::helpers::blocked_by(&pool, holder, "the return waits on the voucher row").await;
    let out = l
        .commit_batch(&batch("LO", lease.id, rows(&[("lo-1", 1)])))
        .await
        .expect("the batch is not stuck behind the waiting return");
    assert!(matches!(out[0], RowOutcome::Created(_)), "{out:?}");
    hold.rollback().await.unwrap();
    let back = returning.await.unwrap().unwrap();
    assert_eq!(
        back.map(|r| r.units),
        Some(4),
        "the rest of the lease went back"
    );
    let c = balanced(&l, "LO").await;
    assert_eq!((c.free, c.reserved, c.leased_unused), (9, 1, 0));
}

/// Expiry's race on PostgreSQL with two sweepers really overlapping: two ledger handles (two
/// nodes) sweep the same due rows at once. A test transaction holds the voucher row, so each
/// sweep takes its rows and then waits on it inside its own transaction; only once both are
/// seen waiting is the row let go. Each due reservation is released, and its unit restocked,
/// exactly once (the auditor: the kept `released` and `free` against the rows). Checked: with
/// `FOR UPDATE SKIP LOCKED` taken out of `vouchers_expire`, both sweeps take the same ten rows
/// and restock them twice, and this fails (the customer's usage goes below zero at the next
/// sweep, which its CHECK refuses).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn two_overlapping_sweepers_on_postgres_expire_each_row_once() {
    let Some(url) = fresh_pg_schema("sweep").await else {
        return;
    };
    let a = ledger::connect(&url, 2).await.unwrap();
    let b = ledger::connect(&url, 2).await.unwrap();
    // One customer holds all 30: a double release would take their usage down twice without
    // going negative (which a CHECK would refuse), so only the books can tell.
    a.create_voucher(&voucher("SW", 40, 40), NOW).await.unwrap();
    let lease = leased(&a, "SW", "n1", 40).await;
    let spec: Vec<(String, i64)> = (1..=30).map(|i| (format!("sw-{i}"), 1)).collect();
    let spec: Vec<(&str, i64)> = spec.iter().map(|(o, c)| (o.as_str(), *c)).collect();
    let out = a
        .commit_batch(&batch("SW", lease.id, rows(&spec)))
        .await
        .unwrap();
    assert!(out.iter().all(|o| matches!(o, RowOutcome::Created(_))));
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let mut hold = pool.begin().await.unwrap();
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *hold)
        .await
        .unwrap();
    sqlx::query("SELECT 1 FROM vouchers WHERE code = 'SW' FOR UPDATE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let due = NOW + 900_000;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
    let sweep = |l: SharedLedger| {
        let barrier = barrier.clone();
        tokio::spawn(async move {
            barrier.wait().await;
            l.expire_due(due, 10).await
        })
    };
    let (sa, sb) = (sweep(a.clone()), sweep(b.clone()));
    // The first waits on the test's lock, the second on the first's (PostgreSQL queues row
    // lock waiters): both are inside their transactions, their rows taken, neither done.
    crate::helpers::eventually(
        "both sweeps wait on the voucher row",
        std::time::Duration::from_secs(10),
        || {
            let pool = pool.clone();
            async move {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM pg_stat_activity \
                     WHERE cardinality(pg_blocking_pids(pid)) > 0 \
                     AND query LIKE '%vouchers_expire%'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                waiting == 2
            }
        },
    )
    .await;
    let first: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
    )
    .bind(holder)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(first >= 1, "a sweep waits on the test's lock");
    hold.rollback().await.unwrap();
    let units = |r: Result<Vec<ledger::Restock>, LedgerError>| -> i64 {
        r.unwrap().iter().map(|x| x.units).sum()
    };
    let (ua, ub) = (units(sa.await.unwrap()), units(sb.await.unwrap()));
    assert_eq!((ua, ub), (10, 10), "each sweep released its own ten rows");
    assert_eq!(units(b.expire_due(due, 1000).await), 10, "the rest");
    assert_eq!(units(a.expire_due(due, 1000).await), 0, "nothing twice");
    let books = crate::audit::books(&url, "SW").await;
    books.assert_balanced("SW");
    assert!(books.rows.values().all(|r| r.expired), "{books:?}");
    assert_eq!(
        (
            books.released,
            books.kept_released,
            books.free,
            books.leased_unused
        ),
        (30, 30, 30, 10),
        "every unit restocked once: {books:?}"
    );
}

/// The whole change feed, read `page` events at a time.
async fn whole_feed(l: &SharedLedger, page: i64) -> Vec<FeedEvent> {
    let mut all: Vec<FeedEvent> = Vec::new();
    loop {
        let after = all.last().map_or(0, |e| e.seq);
        let got = l.events(after, page).await.unwrap();
        assert!(got.len() as i64 <= page, "a page longer than its limit");
        let done = (got.len() as i64) < page;
        all.extend(got);
        if done {
            return all;
        }
    }
}

async fn the_feed_tells_every_change_once_in_order(l: &SharedLedger) {
    l.create_voucher(&voucher("FEED", 5, 5), NOW).await.unwrap();
    let head = whole_feed(l, 1000).await.last().map_or(0, |e| e.seq);
    let lease = leased(l, "FEED", "n1", 5).await;
    l.commit_batch(&batch(
        "FEED",
        lease.id,
        rows(&[("f2", 7), ("f1", 7), ("f3", 7)]),
    ))
    .await
    .unwrap();
    l.confirm("FEED", "f1", NOW).await.unwrap();
    l.release("FEED", "f2", NOW).await.unwrap();
    // Refusals and repeats change nothing, so they tell nothing.
    l.confirm("FEED", "f1", NOW).await.unwrap();
    assert!(l.confirm("FEED", "f2", NOW).await.is_err());
    l.release("FEED", "f2", NOW).await.unwrap();
    l.expire_due(NOW + 900_000, 1000).await.unwrap();
    let mut tail: Vec<(EventKind, String)> = l
        .events(head, 1000)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.voucher_code == "FEED")
        .map(|e| (e.kind, e.order_id))
        .collect();
    // The rows of one transaction come in an order of the ledger's choosing.
    tail[..3].sort_by(|a, b| a.1.cmp(&b.1));
    let want: Vec<(EventKind, String)> = [
        (EventKind::Reserved, "f1"),
        (EventKind::Reserved, "f2"),
        (EventKind::Reserved, "f3"),
        (EventKind::Confirmed, "f1"),
        (EventKind::Released, "f2"),
        (EventKind::Expired, "f3"),
    ]
    .into_iter()
    .map(|(k, o)| (k, o.to_string()))
    .collect();
    assert_eq!(tail, want);

    // The whole feed, after every check above (concurrent batches, releases, sweeps included):
    // numbers 1..=N without a gap, whatever the page size.
    let all = whole_feed(l, 1000).await;
    assert_eq!(whole_feed(l, 7).await, all, "paging changed the feed");
    let seqs: Vec<i64> = all.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=all.len() as i64).collect::<Vec<_>>());
    assert!(l.events(all.len() as i64, 10).await.unwrap().is_empty());
    // Each order is reserved once, and changes at most once more, after that.
    let mut first: HashMap<&str, EventKind> = HashMap::new();
    let mut settled: HashMap<&str, EventKind> = HashMap::new();
    for e in &all {
        if e.kind == EventKind::Reserved {
            assert!(
                first.insert(&e.order_id, e.kind).is_none(),
                "{} reserved twice",
                e.order_id
            );
        } else {
            assert!(
                first.contains_key(e.order_id.as_str()),
                "{} changed before it was reserved",
                e.order_id
            );
            assert!(
                settled.insert(&e.order_id, e.kind).is_none(),
                "{} settled twice",
                e.order_id
            );
        }
    }
    // And the feed agrees with each voucher's counters.
    let mut codes: Vec<&str> = all.iter().map(|e| e.voucher_code.as_str()).collect();
    codes.sort();
    codes.dedup();
    for code in codes {
        let c = balanced(l, code).await;
        let count = |k: &[EventKind]| {
            all.iter()
                .filter(|e| e.voucher_code == code && k.contains(&e.kind))
                .count() as i64
        };
        assert_eq!(
            count(&[EventKind::Reserved]),
            c.reserved + c.confirmed + c.released,
            "{code}"
        );
        assert_eq!(count(&[EventKind::Confirmed]), c.confirmed, "{code}");
        assert_eq!(
            count(&[EventKind::Released, EventKind::Expired]),
            c.released,
            "{code}"
        );
    }
}

/// A shard after the first that is down when a node opens the ledger (a fresh database behind
/// a cut link): claims cannot begin then (refused, the directory's mode left as it was);
/// without claims the ledger opens, places new vouchers on the shards that are up, and once the
/// link is back migrates the late shard, marks its place and serves it.
#[tokio::test]
#[cfg_attr(
    no_test_pg,
    ignore = "needs TEST_DATABASE_URL (PostgreSQL); .ci/run sets it"
)]
async fn a_shard_down_at_start_is_migrated_and_opened_once_it_is_back() {
    let (Some(a), Some(b), Some(c)) = (
        fresh_pg_schema("late0").await,
        fresh_pg_schema("late1").await,
        fresh_pg_schema("late2").await,
    ) else {
        return;
    };
    let host = c
        .split('@')
        .nth(1)
        .unwrap()
        .split(['/', '?'])
        .next()
        .unwrap();
    let proxy = crate::proxy::Proxy::start(host).await;
    let via = c.replacen(host, &format!("127.0.0.1:{}", proxy.port), 1);
    proxy.cut();
    let urls = [a.clone(), b.clone(), via];
    let refused = ledger::connect_sharded(&urls, 2, true).await.err();
    assert!(
        refused
            .as_ref()
            .is_some_and(|e| format!("{e:#}").contains("every shard up")),
        "{refused:?}"
    );
    let pool = sqlx::PgPool::connect(&a).await.unwrap();
    let mode: Option<String> = sqlx::query_scalar("SELECT mode FROM order_claim_mode")
        .fetch_optional(&pool)
        .await
        .unwrap();
    assert_eq!(mode, None, "the claims did not begin");

    let l = ledger::connect_sharded(&urls, 2, false).await.unwrap();
    for code in ["D0", "D1", "D2"] {
        l.create_voucher(&voucher(code, 10, 1), NOW).await.unwrap();
    }
    let up = [a.clone(), b.clone()];
    for code in ["D0", "D1", "D2"] {
        the_one_holding(&up, code).await;
    }
    assert!(
        l.voucher("D0").await.unwrap().is_some(),
        "the shards that are up serve"
    );
    proxy.restore();
    // Once open, the late shard (the fewest vouchers) takes the next one.
    let shard_of = |code: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i32>("SELECT shard FROM voucher_shards WHERE code = $1")
                .bind(code)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut n = 0;
    let late = loop {
        n += 1;
        let code = format!("E{n}");
        l.create_voucher(&voucher(&code, 10, 1), NOW).await.unwrap();
        if shard_of(code.clone()).await == 2 {
            break code;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the late shard never opened"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(the_one_holding(&[a, b, c.clone()], &late).await, c);
    assert!(
        l.voucher(&late).await.unwrap().is_some(),
        "served from the late shard"
    );
    let cp = sqlx::PgPool::connect(&c).await.unwrap();
    let place: i32 = sqlx::query_scalar("SELECT shard FROM shard_self")
        .fetch_one(&cp)
        .await
        .unwrap();
    assert_eq!(place, 2, "marked at its place");
}

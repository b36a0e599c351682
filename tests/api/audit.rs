//! The independent auditor: SQL written for the tests, not shared with the engine's reconciler
//! (`ledger::reconcile`), that recomputes every term of DESIGN §3 from the rows and compares it
//! with what the clients saw, as sets: the orders told `201` against the reservation rows, the
//! confirms and releases told `200` against the rows' statuses, each customer's live rows against
//! `perUserLimit`. Every test that ends on the books uses it, and the sensitivity tests below
//! show that it (and, for the terms it keeps, the engine's reconciler) notices a corrupted row.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::json;
use vouchers::config::LedgerKind;

use crate::helpers::{metrics_text, spawn_app};

/// One reservation row, as the auditor reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub customer: i64,
    /// `RESERVED`, `CONFIRMED` or `RELEASED`.
    pub status: String,
    /// Released by the expiry sweep (not by a client).
    pub expired: bool,
    pub created_at: i64,
    pub expires_at: i64,
    pub updated_at: i64,
}

/// One voucher's books, every term from the rows except `free` (no row stands for a free unit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Books {
    pub total: i64,
    pub per_user_limit: i64,
    pub free: i64,
    /// Σ (granted − consumed) over ACTIVE leases.
    pub leased_unused: i64,
    /// Rows by status.
    pub reserved: i64,
    pub confirmed: i64,
    pub released: i64,
    /// Σ consumed over every lease, whatever its state: one unit per reservation ever made.
    pub consumed: i64,
    /// The voucher row's own counters: `confirmed`, `released`, and `reserved` where it is a
    /// column (SQLite; PostgreSQL derives it from the leases).
    pub kept_confirmed: i64,
    pub kept_released: i64,
    pub kept_reserved: Option<i64>,
    /// Σ used over the customers' usage (`customer_usage`, on both stores a view of the
    /// reservation rows: comparing it customer by customer would compare the rows with
    /// themselves, so the limit is judged from the rows alone).
    pub usage: i64,
    /// Every reservation row of the voucher, by order id.
    pub rows: BTreeMap<String, Row>,
    /// Order ids of the RESERVED and CONFIRMED rows.
    pub live: BTreeSet<String>,
}

/// What the clients were told, as sets of order ids.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// Reserves answered `201`.
    pub created: BTreeSet<String>,
    /// Confirms answered `200`.
    pub confirmed: BTreeSet<String>,
    /// Releases answered `200`.
    pub released: BTreeSet<String>,
    /// Requests whose answer never came (the node died under them) or came as `503`: they may
    /// or may not have committed, so a row of theirs is allowed, never required.
    pub unknown: BTreeSet<String>,
}

impl Seen {
    /// Only the `201`s.
    pub fn created(created: impl IntoIterator<Item = String>) -> Seen {
        Seen {
            created: created.into_iter().collect(),
            ..Seen::default()
        }
    }
}

const HEAD: &str = "SELECT total_limit, per_user_limit, free, confirmed, released \
     FROM vouchers WHERE code = $1";
const KEPT_RESERVED: &str = "SELECT reserved FROM vouchers WHERE code = $1";
const LEASES: &str = "SELECT \
     CAST(COALESCE(SUM(CASE WHEN state = 'ACTIVE' THEN granted - consumed ELSE 0 END), 0) AS BIGINT), \
     CAST(COALESCE(SUM(consumed), 0) AS BIGINT) FROM leases WHERE voucher_code = $1";
const ROWS: &str = "SELECT order_id, customer_id, status, \
     CAST(CASE WHEN expired THEN 1 ELSE 0 END AS BIGINT), created_at, expires_at, updated_at \
     FROM reservations WHERE voucher_code = $1";
const USAGE: &str =
    "SELECT customer_id, CAST(used AS BIGINT) FROM customer_usage WHERE voucher_code = $1";

type RowTuple = (String, i64, String, i64, i64, i64, i64);

/// Runs the auditor's queries on one pool (SQLite or PostgreSQL: the SQL is the same), in one
/// read transaction, so that they see one snapshot even while the engine keeps working.
macro_rules! read_books {
    ($pool:expr, $code:expr, $isolation:expr, $sqlite:expr) => {{
        let pool = $pool;
        let mut tx = pool.begin().await.expect("begin");
        if !$isolation.is_empty() {
            sqlx::query($isolation)
                .execute(&mut *tx)
                .await
                .expect("isolation");
        }
        let (total, per_user_limit, free, kept_confirmed, kept_released): (
            i64,
            i64,
            i64,
            i64,
            i64,
        ) = sqlx::query_as(HEAD)
            .bind($code)
            .fetch_one(&mut *tx)
            .await
            .expect("voucher row");
        let kept_reserved: Option<i64> = if $sqlite {
            Some(
                sqlx::query_scalar(KEPT_RESERVED)
                    .bind($code)
                    .fetch_one(&mut *tx)
                    .await
                    .expect("reserved column"),
            )
        } else {
            None
        };
        let (leased_unused, consumed): (i64, i64) = sqlx::query_as(LEASES)
            .bind($code)
            .fetch_one(&mut *tx)
            .await
            .expect("leases");
        let rows: Vec<RowTuple> = sqlx::query_as(ROWS)
            .bind($code)
            .fetch_all(&mut *tx)
            .await
            .expect("reservations");
        let usage: Vec<(i64, i64)> = sqlx::query_as(USAGE)
            .bind($code)
            .fetch_all(&mut *tx)
            .await
            .expect("usage");
        tx.commit().await.expect("end the read");
        pool.close().await;
        Books::from_parts(
            [total, per_user_limit, free, leased_unused, consumed],
            (kept_confirmed, kept_released, kept_reserved),
            rows,
            usage,
        )
    }};
}

/// Reads one voucher's books straight from the ledger's tables.
pub async fn books(db_url: &str, code: &str) -> Books {
    if matches!(LedgerKind::of(db_url), Ok(LedgerKind::Sqlite)) {
        read_books!(
            sqlx::SqlitePool::connect(db_url).await.expect("sqlite"),
            code,
            "",
            true
        )
    } else {
        read_books!(
            sqlx::PgPool::connect(db_url).await.expect("postgres"),
            code,
            "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ",
            false
        )
    }
}

impl Books {
    fn from_parts(
        [total, per_user_limit, free, leased_unused, consumed]: [i64; 5],
        (kept_confirmed, kept_released, kept_reserved): (i64, i64, Option<i64>),
        rows: Vec<RowTuple>,
        usage: Vec<(i64, i64)>,
    ) -> Books {
        let rows: BTreeMap<String, Row> = rows
            .into_iter()
            .map(
                |(order, customer, status, expired, created_at, expires_at, updated_at)| {
                    let row = Row {
                        customer,
                        status,
                        expired: expired != 0,
                        created_at,
                        expires_at,
                        updated_at,
                    };
                    (order, row)
                },
            )
            .collect();
        let count = |s: &str| rows.values().filter(|r| r.status == s).count() as i64;
        let live = rows
            .iter()
            .filter(|(_, r)| r.status != "RELEASED")
            .map(|(o, _)| o.clone())
            .collect();
        Books {
            total,
            per_user_limit,
            free,
            leased_unused,
            reserved: count("RESERVED"),
            confirmed: count("CONFIRMED"),
            released: count("RELEASED"),
            consumed,
            kept_confirmed,
            kept_released,
            kept_reserved,
            usage: usage.iter().map(|(_, n)| n).sum(),
            rows,
            live,
        }
    }

    /// Each customer's live (RESERVED or CONFIRMED) rows, counted here from the rows.
    pub fn holdings(&self) -> BTreeMap<i64, i64> {
        let mut h = BTreeMap::new();
        for r in self.rows.values().filter(|r| r.status != "RELEASED") {
            *h.entry(r.customer).or_insert(0) += 1;
        }
        h
    }

    /// Each customer's most live reservations at any one moment of the sale, from the rows' own
    /// times: a row is live from `created_at` until its release (`updated_at`), or to the end.
    /// The times are the nodes' (which follow the ledger's clock), so a row is taken as live only
    /// from `slack_ms` after its creation: a reserve on one node and a release on another a few
    /// milliseconds apart are not an overlap, while a row past the limit lives for seconds.
    pub fn peak_holdings(&self, slack_ms: i64) -> BTreeMap<i64, i64> {
        let mut edges: BTreeMap<i64, Vec<(i64, i64)>> = BTreeMap::new();
        for r in self.rows.values() {
            let (from, to) = (r.created_at + slack_ms, r.updated_at);
            if r.status == "RELEASED" && to <= from {
                continue;
            }
            let e = edges.entry(r.customer).or_default();
            e.push((from, 1));
            if r.status == "RELEASED" {
                e.push((to, -1));
            }
        }
        edges
            .into_iter()
            .map(|(customer, mut e)| {
                // Ends before starts at the same instant.
                e.sort();
                let (mut now, mut peak) = (0, 0);
                for (_, d) in e {
                    now += d;
                    peak = peak.max(now);
                }
                (customer, peak)
            })
            .collect()
    }

    /// No customer ever held more than `perUserLimit` at once ([`Books::peak_holdings`]).
    pub fn assert_limit_held_throughout(&self, code: &str, slack_ms: i64) {
        let over: BTreeMap<i64, i64> = self
            .peak_holdings(slack_ms)
            .into_iter()
            .filter(|(_, n)| *n > self.per_user_limit)
            .collect();
        assert!(
            over.is_empty(),
            "{code}: customers held more than {} at once: {over:?}",
            self.per_user_limit
        );
    }

    /// Every relation of DESIGN §3 that the rows must satisfy; empty when they all hold. Each
    /// entry starts with the name of the check that failed (`equation:`, `oversold:`, …), which
    /// the sensitivity tests match on.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        let sold = self.reserved + self.confirmed;
        if self.total != self.free + self.leased_unused + sold {
            v.push(format!(
                "equation: total {} != free {} + leased unused {} + reserved {} + confirmed {}",
                self.total, self.free, self.leased_unused, self.reserved, self.confirmed
            ));
        }
        if sold > self.total {
            v.push(format!("oversold: sold {sold} > total {}", self.total));
        }
        if self.consumed != sold + self.released {
            v.push(format!(
                "consumed: leases consumed {} != reservation rows {}",
                self.consumed,
                sold + self.released
            ));
        }
        if self.kept_confirmed != self.confirmed {
            v.push(format!(
                "confirmed: the voucher counts {} confirmed, the rows {}",
                self.kept_confirmed, self.confirmed
            ));
        }
        if self.kept_released != self.released {
            v.push(format!(
                "released: the voucher counts {} released, the rows {}",
                self.kept_released, self.released
            ));
        }
        if let Some(kept) = self.kept_reserved {
            if kept != self.reserved {
                v.push(format!(
                    "reserved: the voucher counts {kept} reserved, the rows {}",
                    self.reserved
                ));
            }
        }
        let holdings = self.holdings();
        let over: Vec<_> = holdings
            .iter()
            .filter(|(_, n)| **n > self.per_user_limit)
            .collect();
        if !over.is_empty() {
            v.push(format!(
                "per-customer: customers over the limit of {}: {over:?}",
                self.per_user_limit
            ));
        }
        if self.usage != sold {
            v.push(format!(
                "usage: usage {} != live reservations {sold}",
                self.usage
            ));
        }
        for (order, r) in &self.rows {
            if r.expired && (r.status != "RELEASED" || r.updated_at < r.expires_at) {
                v.push(format!(
                    "expiry: {order} marked expired before its time: {r:?}"
                ));
            }
        }
        if self.free < 0 || self.leased_unused < 0 {
            v.push("negative: a negative term".into());
        }
        v
    }

    pub fn assert_balanced(&self, code: &str) {
        let v = self.violations();
        assert!(
            v.is_empty(),
            "{code}: the books do not hold: {v:?} in {self:?}"
        );
    }

    /// What the clients were told against the rows, as sets; empty when they agree.
    pub fn client_mismatches(&self, seen: &Seen) -> Vec<String> {
        let mut v = Vec::new();
        let missing: Vec<_> = seen
            .created
            .iter()
            .filter(|o| !self.rows.contains_key(*o))
            .collect();
        if !missing.is_empty() {
            v.push(format!("lost: told 201, no row: {missing:?}"));
        }
        let phantom: Vec<_> = self
            .rows
            .keys()
            .filter(|o| !seen.created.contains(*o) && !seen.unknown.contains(*o))
            .collect();
        if !phantom.is_empty() {
            v.push(format!(
                "phantom: a row no client was told 201: {phantom:?}"
            ));
        }
        for order in &seen.confirmed {
            match self.rows.get(order) {
                Some(r) if r.status == "CONFIRMED" => {}
                other => v.push(format!("confirm: {order} told 200, row {other:?}")),
            }
        }
        for order in &seen.released {
            match self.rows.get(order) {
                Some(r) if r.status == "RELEASED" => {}
                other => v.push(format!("release: {order} told 200, row {other:?}")),
            }
        }
        for (order, r) in &self.rows {
            let settled_unseen = !seen.unknown.contains(order)
                && !seen.confirmed.contains(order)
                && !seen.released.contains(order);
            // A row that moved without a client being told so: only the expiry sweep may
            // release one, and only once it is due.
            if settled_unseen && r.status == "CONFIRMED" {
                v.push(format!("confirm: {order} confirmed, no client was told so"));
            }
            if settled_unseen && r.status == "RELEASED" && !r.expired {
                v.push(format!(
                    "release: {order} released, neither by a client nor by expiry"
                ));
            }
            if seen.released.contains(order) && r.expired {
                v.push(format!(
                    "release: {order} released by a client, marked expired"
                ));
            }
        }
        v
    }

    /// The books hold and the rows are exactly what the clients were told.
    pub fn assert_matches(&self, code: &str, seen: &Seen) {
        self.assert_balanced(code);
        let v = self.client_mismatches(seen);
        assert!(
            v.is_empty(),
            "{code}: the ledger differs from what the clients were told: {v:?}"
        );
    }

    /// The books hold and the rows are exactly the `201`s the clients received (nothing was
    /// confirmed, released or left unanswered).
    pub fn assert_matches_clients(&self, code: &str, created: &BTreeSet<String>) {
        self.assert_matches(code, &Seen::created(created.iter().cloned()));
    }
}

fn mismatches(metrics: &str) -> f64 {
    crate::helpers::metric_sum(metrics, "vouchers_reconcile_mismatches_total", &[])
}

/// Who must notice a corruption: the auditor always, under the named check; the engine's
/// reconciler (admin view and metric) when the term is one it keeps.
struct Expect {
    kind: &'static str,
    reconciler: bool,
}

fn both(kind: &'static str) -> Expect {
    Expect {
        kind,
        reconciler: true,
    }
}

/// Corrupts one voucher's rows behind the engine's back with `sql` and checks that the auditor
/// (under check `expect.kind`) and, where `expect.reconciler`, the engine's reconciler (admin
/// view and metric) report it.
async fn corruption_is_noticed(sql: &str, expect: Expect) {
    corruption_is_noticed_on(spawn_app().await, sql, expect).await;
}

/// [`corruption_is_noticed`] on `app`'s ledger, SQLite or PostgreSQL.
async fn corruption_is_noticed_on(app: crate::helpers::TestApp, sql: &str, expect: Expect) {
    assert_eq!(app.create_voucher("SENS", 10, 2).await.0, 201);
    for i in 1..=3 {
        assert_eq!(app.reserve("SENS", i, format!("sens-{i}")).await.0, 201);
    }
    let before = books(&app.db_url, "SENS").await;
    before.assert_balanced("SENS");
    assert_eq!(app.balanced_counters("SENS").await["balanced"], json!(true));

    let changed = crate::helpers::execute(&app.db_url, sql).await;
    assert!(changed >= 1, "the corruption touched a row: {sql}");

    let after = books(&app.db_url, "SENS").await;
    let found = after.violations();
    assert!(
        found
            .iter()
            .any(|v| v.starts_with(&format!("{}:", expect.kind))),
        "the auditor's `{}` check missed `{sql}`: {found:?} in {after:?}",
        expect.kind
    );
    if !expect.reconciler {
        return;
    }
    let (status, view) = app.admin("SENS").await;
    assert_eq!((status, &view["balanced"]), (200, &json!(false)), "{view}");
    let m0 = mismatches(&metrics_text(&app.client, &app.base).await);
    assert_eq!(
        app.engine.reconcile().await.unwrap(),
        vec!["SENS".to_string()],
        "the reconciler names the voucher"
    );
    let m1 = mismatches(&metrics_text(&app.client, &app.base).await);
    assert!(
        m1 > m0,
        "vouchers_reconcile_mismatches_total did not rise ({m0} → {m1})"
    );
}

/// A fresh PostgreSQL app, for the corruptions only that ledger lets through.
async fn pg_app(tag: &str) -> Option<crate::helpers::TestApp> {
    let url = crate::ledger::fresh_pg_schema(tag).await?;
    Some(crate::helpers::spawn_app_with(|s| s.ledger.url = url).await)
}

#[actix_web::test]
async fn a_unit_added_to_free_is_noticed() {
    corruption_is_noticed(
        "UPDATE vouchers SET free = free + 1 WHERE code = 'SENS'",
        both("equation"),
    )
    .await;
}

#[actix_web::test]
async fn an_orphan_reservation_is_noticed() {
    corruption_is_noticed(
        "INSERT INTO reservations (order_id, voucher_code, customer_id, lease_id, \
         discount_amount, status, created_at, expires_at, updated_at) \
         SELECT 'orphan', 'SENS', 99, 0, 100, 'RESERVED', 0, 1, 0",
        both("consumed"),
    )
    .await;
}

/// A row confirmed behind the counters' back: every unit is still where the equation wants it,
/// only the `confirmed` count disagrees with the rows.
const CONFIRM_BEHIND: &str =
    "UPDATE reservations SET status = 'CONFIRMED', settled_seq = 999999 WHERE order_id = 'sens-1'";

#[actix_web::test]
async fn a_confirm_the_counters_missed_is_noticed() {
    corruption_is_noticed(CONFIRM_BEHIND, both("confirmed")).await;
}

#[actix_web::test]
#[cfg_attr(no_test_pg, ignore = "needs TEST_DATABASE_URL; .ci/run sets it")]
async fn a_confirm_the_counters_missed_is_noticed_on_postgres() {
    let Some(app) = pg_app("confirmed").await else {
        return;
    };
    corruption_is_noticed_on(app, CONFIRM_BEHIND, both("confirmed")).await;
}

/// A release counted that no row made.
const RELEASED_PLUS_ONE: &str = "UPDATE vouchers SET released = released + 1 WHERE code = 'SENS'";

#[actix_web::test]
async fn a_release_no_row_made_is_noticed() {
    corruption_is_noticed(RELEASED_PLUS_ONE, both("released")).await;
}

#[actix_web::test]
#[cfg_attr(no_test_pg, ignore = "needs TEST_DATABASE_URL; .ci/run sets it")]
async fn a_release_no_row_made_is_noticed_on_postgres() {
    let Some(app) = pg_app("released").await else {
        return;
    };
    corruption_is_noticed_on(app, RELEASED_PLUS_ONE, both("released")).await;
}

/// `sold <= total`: PostgreSQL's voucher row has no `reserved` column for a CHECK to read, so a
/// total lowered under the units already sold passes its table's CHECKs (SQLite's refuse it:
/// `the_check_constraints_refuse_an_oversold_voucher_and_an_overdrawn_lease`).
#[actix_web::test]
#[cfg_attr(no_test_pg, ignore = "needs TEST_DATABASE_URL; .ci/run sets it")]
async fn a_total_under_the_units_sold_is_noticed_on_postgres() {
    let Some(app) = pg_app("oversold").await else {
        return;
    };
    corruption_is_noticed_on(
        app,
        "UPDATE vouchers SET total_limit = 2, free = 0 WHERE code = 'SENS'",
        both("oversold"),
    )
    .await;
}

/// A customer holding more live reservations than `perUserLimit` (2 here): rows moved to
/// customer 1. The reconciler sums usage and does not judge customers; the auditor does, from the
/// rows.
const OVER_THE_LIMIT: &str =
    "UPDATE reservations SET customer_id = 1 WHERE order_id IN ('sens-2', 'sens-3')";

#[actix_web::test]
async fn a_customer_over_the_limit_is_noticed() {
    let expect = Expect {
        kind: "per-customer",
        reconciler: false,
    };
    corruption_is_noticed(OVER_THE_LIMIT, expect).await;
}

#[actix_web::test]
#[cfg_attr(no_test_pg, ignore = "needs TEST_DATABASE_URL; .ci/run sets it")]
async fn a_customer_over_the_limit_is_noticed_on_postgres() {
    let Some(app) = pg_app("percust").await else {
        return;
    };
    let expect = Expect {
        kind: "per-customer",
        reconciler: false,
    };
    corruption_is_noticed_on(app, OVER_THE_LIMIT, expect).await;
}

/// A row released with its unit given back but neither by a client nor by the expiry sweep:
/// the books balance, only the comparison with what the clients were told catches it. And a lost
/// `201` offset by a phantom row: the counts match, the sets do not.
#[actix_web::test]
async fn rows_that_differ_from_what_the_clients_saw_are_noticed() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("SEEN", 10, 2).await.0, 201);
    let mut seen = Seen::default();
    for i in 1..=4 {
        let order = format!("seen-{i}");
        assert_eq!(app.reserve("SEEN", i, &order).await.0, 201);
        seen.created.insert(order);
    }
    let (s, _) = app
        .call("POST", "/vouchers/SEEN/reservations/seen-1/confirm")
        .await;
    assert_eq!(s, 200);
    seen.confirmed.insert("seen-1".into());
    let (s, _) = app
        .call("DELETE", "/vouchers/SEEN/reservations/seen-2")
        .await;
    assert_eq!(s, 200);
    seen.released.insert("seen-2".into());
    let b = books(&app.db_url, "SEEN").await;
    b.assert_matches("SEEN", &seen);

    let kinds = |v: Vec<String>| -> BTreeSet<String> {
        v.iter()
            .map(|m| m.split(':').next().unwrap_or("").to_string())
            .collect()
    };
    // A lost 201 and a phantom row: same count, other orders.
    let mut told = seen.clone();
    told.created.remove("seen-4");
    told.created.insert("seen-9".into());
    assert_eq!(
        kinds(b.client_mismatches(&told)),
        ["lost".to_string(), "phantom".to_string()].into()
    );
    // A confirm the client was told of that the row does not show; a release likewise.
    let mut told = seen.clone();
    told.confirmed.insert("seen-3".into());
    told.released.insert("seen-4".into());
    assert_eq!(
        kinds(b.client_mismatches(&told)),
        ["confirm".to_string(), "release".to_string()].into()
    );
    // A row released behind the clients' back, its unit restocked: balanced, but not what they
    // were told.
    crate::helpers::execute(
        &app.db_url,
        "UPDATE reservations SET status = 'RELEASED', settled_seq = 999999 WHERE order_id = 'seen-3'",
    )
    .await;
    crate::helpers::execute(
        &app.db_url,
        "UPDATE vouchers SET free = free + 1, reserved = reserved - 1, released = released + 1 \
         WHERE code = 'SEEN'",
    )
    .await;
    let b = books(&app.db_url, "SEEN").await;
    b.assert_balanced("SEEN");
    assert_eq!(
        kinds(b.client_mismatches(&seen)),
        ["release".to_string()].into()
    );
}

const USAGE_PLUS_ONE: &str =
    "UPDATE customer_usage SET used = used + 1 WHERE voucher_code = 'SENS' AND customer_id = 1";

/// Both ledgers count a customer's usage from their reservations: `customer_usage` is a view of
/// them (PostgreSQL since migration 15), so there is no second copy to drift, and it cannot be
/// written.
async fn usage_is_counted_from_the_reservations_on(app: crate::helpers::TestApp) {
    assert_eq!(app.create_voucher("SENS", 10, 2).await.0, 201);
    assert_eq!(app.reserve("SENS", 1, "use-1").await.0, 201);
    assert_eq!(app.reserve("SENS", 1, "use-2").await.0, 201);
    assert_eq!(books(&app.db_url, "SENS").await.usage, 2);
    assert!(
        crate::helpers::try_execute(&app.db_url, USAGE_PLUS_ONE)
            .await
            .is_err(),
        "customer_usage took a write"
    );
    assert_eq!(
        app.call("DELETE", "/vouchers/SENS/reservations/use-1")
            .await
            .0,
        200
    );
    assert_eq!(books(&app.db_url, "SENS").await.usage, 1);
    assert_eq!(
        app.reserve("SENS", 1, "use-3").await.0,
        201,
        "the released reservation no longer counts"
    );
    assert_eq!(
        app.reserve("SENS", 1, "use-4").await.1["error"],
        json!("ALREADY_USED"),
        "two live reservations are the limit"
    );
    books(&app.db_url, "SENS").await.assert_balanced("SENS");
}

#[actix_web::test]
async fn sqlite_usage_is_counted_from_the_reservations() {
    usage_is_counted_from_the_reservations_on(spawn_app().await).await;
}

#[actix_web::test]
#[cfg_attr(no_test_pg, ignore = "needs TEST_DATABASE_URL; .ci/run sets it")]
async fn postgres_usage_is_counted_from_the_reservations() {
    let Some(url) = crate::ledger::fresh_pg_schema("usage").await else {
        return;
    };
    let app = crate::helpers::spawn_app_with(|s| s.ledger.url = url).await;
    usage_is_counted_from_the_reservations_on(app).await;
}

#[actix_web::test]
async fn a_lease_consuming_more_than_it_shows_is_noticed() {
    // consumed may not pass granted (CHECK), but a lease can claim a unit no reservation used.
    corruption_is_noticed(
        "UPDATE leases SET consumed = consumed + 1 \
         WHERE id = (SELECT MIN(id) FROM leases WHERE voucher_code = 'SENS' AND consumed < granted)",
        both("consumed"),
    )
    .await;
}

#[actix_web::test]
async fn the_check_constraints_refuse_an_oversold_voucher_and_an_overdrawn_lease() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("CHK", 2, 2).await.0, 201);
    assert_eq!(app.reserve("CHK", 1, "chk-1").await.0, 201);
    let pool = sqlx::SqlitePool::connect(&app.db_url).await.unwrap();
    for sql in [
        "UPDATE leases SET consumed = granted + 1 WHERE voucher_code = 'CHK'",
        "UPDATE vouchers SET reserved = total_limit + 1 WHERE code = 'CHK'",
        "UPDATE vouchers SET free = -1 WHERE code = 'CHK'",
    ] {
        let res = sqlx::query(sql).execute(&pool).await;
        assert!(res.is_err(), "the schema accepted `{sql}`");
    }
    pool.close().await;
    books(&app.db_url, "CHK").await.assert_balanced("CHK");
}

/// DESIGN §3's last line on PostgreSQL, where `reserved` is no column a CHECK could read: a grant
/// that would hand out more than `total_limit` (here after `free` was raised behind the engine's
/// back, which the table's own CHECK lets through) is refused whole, and nothing is leased.
#[tokio::test]
#[cfg_attr(no_test_pg, ignore = "needs TEST_DATABASE_URL; .ci/run sets it")]
async fn postgres_refuses_a_grant_that_would_pass_the_total() {
    use crate::ledger::{fresh_pg_schema, voucher, NOW, TTL};
    use vouchers::ledger::LedgerError;
    let Some(url) = fresh_pg_schema("grantchk").await else {
        return;
    };
    let l = vouchers::ledger::connect(&url, 2).await.unwrap();
    l.create_voucher(&voucher("GC", 10, 1), NOW).await.unwrap();
    let first = l.grant("GC", "n1", 5, NOW, TTL).await.unwrap();
    assert_eq!(first.lease.map(|x| x.granted), Some(5));
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let changed = sqlx::query("UPDATE vouchers SET free = 8 WHERE code = 'GC'")
        .execute(&pool)
        .await
        .expect("free + confirmed stays within the total: the table's CHECK allows it")
        .rows_affected();
    assert_eq!(changed, 1);
    let res = l.grant("GC", "n1", 6, NOW, TTL).await;
    match &res {
        Err(LedgerError::Database { code, source }) => {
            assert_eq!(
                code.as_deref(),
                Some("23514"),
                "a check violation: {source}"
            )
        }
        other => panic!("a grant past the total was not refused: {other:?}"),
    }
    let leases: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM leases WHERE voucher_code = 'GC'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(leases, 1, "the refused grant leased nothing");
    // Repaired, the same ledger grants again within the total.
    sqlx::query("UPDATE vouchers SET free = 5 WHERE code = 'GC'")
        .execute(&pool)
        .await
        .unwrap();
    let again = l.grant("GC", "n1", 6, NOW, TTL).await.unwrap();
    assert_eq!(again.lease.map(|x| x.granted), Some(5));
}

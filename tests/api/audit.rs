//! The independent auditor: SQL written for the tests, not shared with the engine's reconciler
//! (`ledger::reconcile`), that recomputes every term of DESIGN §3 from the rows and compares it
//! with what the clients saw. Tests that end on the books use it, and the sensitivity tests
//! below show that it (and the engine's reconciler) notices a corrupted row.

use std::collections::BTreeSet;

use serde_json::json;
use vouchers::config::LedgerKind;

use crate::helpers::{metrics_text, spawn_app};

/// One voucher's books, every term from the rows except `free` (no row stands for a free unit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Books {
    pub total: i64,
    pub free: i64,
    /// Σ (granted − consumed) over ACTIVE leases.
    pub leased_unused: i64,
    pub reserved: i64,
    pub confirmed: i64,
    pub released: i64,
    /// Σ consumed over every lease, whatever its state: one unit per reservation ever made.
    pub consumed: i64,
    /// Σ used over the customers' usage rows.
    pub usage: i64,
    /// Order ids of the RESERVED and CONFIRMED rows.
    pub live: BTreeSet<String>,
}

const TOTAL_FREE: &str = "SELECT total_limit, free FROM vouchers WHERE code = $1";
const LEASES: &str = "SELECT \
     CAST(COALESCE(SUM(CASE WHEN state = 'ACTIVE' THEN granted - consumed ELSE 0 END), 0) AS BIGINT), \
     CAST(COALESCE(SUM(consumed), 0) AS BIGINT) FROM leases WHERE voucher_code = $1";
const BY_STATUS: &str = "SELECT \
     CAST(COALESCE(SUM(CASE WHEN status = 'RESERVED' THEN 1 ELSE 0 END), 0) AS BIGINT), \
     CAST(COALESCE(SUM(CASE WHEN status = 'CONFIRMED' THEN 1 ELSE 0 END), 0) AS BIGINT), \
     CAST(COALESCE(SUM(CASE WHEN status = 'RELEASED' THEN 1 ELSE 0 END), 0) AS BIGINT) \
     FROM reservations WHERE voucher_code = $1";
const USAGE: &str =
    "SELECT CAST(COALESCE(SUM(used), 0) AS BIGINT) FROM customer_usage WHERE voucher_code = $1";
const LIVE: &str =
    "SELECT order_id FROM reservations WHERE voucher_code = $1 AND status <> 'RELEASED'";

/// Runs the auditor's five queries on one pool (SQLite or PostgreSQL: the SQL is the same), in
/// one read transaction, so that they see one snapshot even while the engine keeps working.
macro_rules! read_books {
    ($pool:expr, $code:expr, $isolation:expr) => {{
        let pool = $pool;
        let mut tx = pool.begin().await.expect("begin");
        if !$isolation.is_empty() {
            sqlx::query($isolation)
                .execute(&mut *tx)
                .await
                .expect("isolation");
        }
        let (total, free): (i64, i64) = sqlx::query_as(TOTAL_FREE)
            .bind($code)
            .fetch_one(&mut *tx)
            .await
            .expect("voucher row");
        let (leased_unused, consumed): (i64, i64) = sqlx::query_as(LEASES)
            .bind($code)
            .fetch_one(&mut *tx)
            .await
            .expect("leases");
        let (reserved, confirmed, released): (i64, i64, i64) = sqlx::query_as(BY_STATUS)
            .bind($code)
            .fetch_one(&mut *tx)
            .await
            .expect("reservations");
        let usage: i64 = sqlx::query_scalar(USAGE)
            .bind($code)
            .fetch_one(&mut *tx)
            .await
            .expect("usage");
        let live: Vec<String> = sqlx::query_scalar(LIVE)
            .bind($code)
            .fetch_all(&mut *tx)
            .await
            .expect("live orders");
        tx.commit().await.expect("end the read");
        pool.close().await;
        Books {
            total,
            free,
            leased_unused,
            reserved,
            confirmed,
            released,
            consumed,
            usage,
            live: live.into_iter().collect(),
        }
    }};
}

/// Reads one voucher's books straight from the ledger's tables.
pub async fn books(db_url: &str, code: &str) -> Books {
    if matches!(LedgerKind::of(db_url), Ok(LedgerKind::Sqlite)) {
        read_books!(
            sqlx::SqlitePool::connect(db_url).await.expect("sqlite"),
            code,
            ""
        )
    } else {
        read_books!(
            sqlx::PgPool::connect(db_url).await.expect("postgres"),
            code,
            "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"
        )
    }
}

impl Books {
    /// Every relation of DESIGN §3 that the rows must satisfy; empty when they all hold.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        let sold = self.reserved + self.confirmed;
        if self.total != self.free + self.leased_unused + sold {
            v.push(format!(
                "total {} != free {} + leased unused {} + reserved {} + confirmed {}",
                self.total, self.free, self.leased_unused, self.reserved, self.confirmed
            ));
        }
        if sold > self.total {
            v.push(format!("sold {sold} > total {}", self.total));
        }
        if self.consumed != sold + self.released {
            v.push(format!(
                "leases consumed {} != reservation rows {}",
                self.consumed,
                sold + self.released
            ));
        }
        if self.usage != sold {
            v.push(format!("usage {} != live reservations {sold}", self.usage));
        }
        if self.free < 0 || self.leased_unused < 0 {
            v.push("a negative term".into());
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

    /// The books hold and the live reservations are exactly the 201s the clients received.
    pub fn assert_matches_clients(&self, code: &str, created: &BTreeSet<String>) {
        self.assert_balanced(code);
        assert_eq!(
            &self.live, created,
            "{code}: the ledger's live orders differ from the 201s the clients saw"
        );
    }
}

fn mismatches(metrics: &str) -> f64 {
    crate::helpers::metric_sum(metrics, "vouchers_reconcile_mismatches_total", &[])
}

/// Corrupts one voucher's rows behind the engine's back with `sql` and checks that the auditor,
/// the engine's reconciler (admin view and metric) all report it.
async fn corruption_is_noticed(sql: &str) {
    corruption_is_noticed_on(spawn_app().await, sql).await;
}

/// [`corruption_is_noticed`] on `app`'s ledger, SQLite or PostgreSQL.
async fn corruption_is_noticed_on(app: crate::helpers::TestApp, sql: &str) {
    assert_eq!(app.create_voucher("SENS", 10, 2).await.0, 201);
    for i in 1..=3 {
        assert_eq!(app.reserve("SENS", i, format!("sens-{i}")).await.0, 201);
    }
    let before = books(&app.db_url, "SENS").await;
    before.assert_balanced("SENS");
    assert_eq!(app.balanced_counters("SENS").await["balanced"], json!(true));

    // Runs `sql` on a pool of the ledger's own kind; the rows it changed.
    macro_rules! execute_on {
        ($pool:ty) => {{
            let pool = <$pool>::connect(&app.db_url).await.unwrap();
            let n = sqlx::query(sql)
                .execute(&pool)
                .await
                .unwrap()
                .rows_affected();
            pool.close().await;
            n
        }};
    }
    let changed = if matches!(LedgerKind::of(&app.db_url), Ok(LedgerKind::Sqlite)) {
        execute_on!(sqlx::SqlitePool)
    } else {
        execute_on!(sqlx::PgPool)
    };
    assert_eq!(changed, 1, "the corruption touched one row: {sql}");

    let after = books(&app.db_url, "SENS").await;
    assert!(
        !after.violations().is_empty(),
        "the auditor missed `{sql}`: {after:?}"
    );
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

#[actix_web::test]
async fn a_unit_added_to_free_is_noticed() {
    corruption_is_noticed("UPDATE vouchers SET free = free + 1 WHERE code = 'SENS'").await;
}

#[actix_web::test]
async fn an_orphan_reservation_is_noticed() {
    corruption_is_noticed(
        "INSERT INTO reservations (order_id, voucher_code, customer_id, lease_id, \
         discount_amount, status, created_at, expires_at, updated_at) \
         SELECT 'orphan', 'SENS', 99, 0, 100, 'RESERVED', 0, 1, 0",
    )
    .await;
}

const USAGE_PLUS_ONE: &str =
    "UPDATE customer_usage SET used = used + 1 WHERE voucher_code = 'SENS' AND customer_id = 1";

/// PostgreSQL keeps each customer's usage in rows of its own (locked by every node's batches),
/// which can drift from the reservations: the reconciler must see it.
#[actix_web::test]
#[cfg_attr(no_test_pg, ignore = "needs TEST_DATABASE_URL; .ci/run sets it")]
async fn usage_off_by_one_is_noticed() {
    let Some(url) = crate::ledger::fresh_pg_schema("usage").await else {
        return;
    };
    let app = crate::helpers::spawn_app_with(|s| s.ledger.url = url).await;
    corruption_is_noticed_on(app, USAGE_PLUS_ONE).await;
}

/// The embedded ledger counts a customer's usage from their reservations: `customer_usage` is a
/// view of them, so there is no second copy to drift, and it cannot be written.
#[actix_web::test]
async fn sqlite_usage_is_counted_from_the_reservations() {
    let app = spawn_app().await;
    assert_eq!(app.create_voucher("SENS", 10, 2).await.0, 201);
    assert_eq!(app.reserve("SENS", 1, "use-1").await.0, 201);
    assert_eq!(app.reserve("SENS", 1, "use-2").await.0, 201);
    let pool = sqlx::SqlitePool::connect(&app.db_url).await.unwrap();
    let used: i64 = sqlx::query_scalar(
        "SELECT used FROM customer_usage WHERE voucher_code = 'SENS' AND customer_id = 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(used, 2);
    assert!(
        sqlx::query(USAGE_PLUS_ONE).execute(&pool).await.is_err(),
        "customer_usage took a write"
    );
    pool.close().await;
    assert_eq!(
        app.call("DELETE", "/vouchers/SENS/reservations/use-1")
            .await
            .0,
        200
    );
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
async fn a_lease_consuming_more_than_it_shows_is_noticed() {
    // consumed may not pass granted (CHECK), but a lease can claim a unit no reservation used.
    corruption_is_noticed(
        "UPDATE leases SET consumed = consumed + 1 \
         WHERE id = (SELECT MIN(id) FROM leases WHERE voucher_code = 'SENS' AND consumed < granted)",
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
    let first = l.grant("GC", "n#1", 5, NOW, TTL).await.unwrap();
    assert_eq!(first.lease.map(|x| x.granted), Some(5));
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let changed = sqlx::query("UPDATE vouchers SET free = 8 WHERE code = 'GC'")
        .execute(&pool)
        .await
        .expect("free + confirmed stays within the total: the table's CHECK allows it")
        .rows_affected();
    assert_eq!(changed, 1);
    let res = l.grant("GC", "n#1", 6, NOW, TTL).await;
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
    let again = l.grant("GC", "n#1", 6, NOW, TTL).await.unwrap();
    assert_eq!(again.lease.map(|x| x.granted), Some(5));
}

//! The embedded ledger's own tests: its migrations and the plans of its merged commit's
//! statements (the conformance suite, `tests/api/ledger.rs`, covers its behaviour).

use std::str::FromStr;

use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};
use sqlx::Row;

use super::commit::{
    COUNT_RESERVED, FEED_LAST, FEED_TAKE, FENCE, INSERT_RESERVATION, READ_LEASE, READ_RULES,
    READ_STORED,
};
use super::open::MIGRATIONS;
use super::*;

/// A ledger made before the feed existed, with reservations in every state, gets every one
/// of them numbered once by migration 4: RESERVED events by time, then the later changes.
#[tokio::test]
async fn migrating_numbers_the_reservations_made_before_the_feed() {
    let dir = std::env::temp_dir().join(format!("vouchers-mig-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let url = format!("sqlite://{}/l.db", dir.display());
    std::fs::create_dir_all(&dir).unwrap();
    let options = SqliteConnectOptions::from_str(&url)
        .unwrap()
        .create_if_missing(true);
    let pool = SqlitePool::connect_with(options).await.unwrap();
    sqlx::raw_sql("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    for (version, sql) in &MIGRATIONS[..3] {
        sqlx::raw_sql(sql).execute(&pool).await.unwrap();
        sqlx::query("INSERT INTO schema_migrations (version) VALUES (?)")
            .bind(version)
            .execute(&pool)
            .await
            .unwrap();
    }
    // Created at 1, 2, 3; o2 confirmed at 10, o3 released at 5 (before its expiry at 100),
    // o1 left reserved.
    sqlx::raw_sql(
        "INSERT INTO reservations (order_id, voucher_code, customer_id, lease_id, \
           discount_amount, status, created_at, expires_at, updated_at) VALUES \
         ('o1', 'V', 1, 1, 5, 'RESERVED', 1, 100, 1), \
         ('o2', 'V', 2, 1, 5, 'CONFIRMED', 2, 100, 10), \
         ('o3', 'V', 3, 1, 5, 'RELEASED', 3, 100, 5)",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let l = SqliteLedger::connect(&url, 1).await.unwrap();
    let events: Vec<(i64, String, String)> = l
        .events(0, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.seq, e.kind.as_str().to_string(), e.order_id))
        .collect();
    let want: Vec<(i64, String, String)> = [
        (1, "RESERVED", "o1"),
        (2, "RESERVED", "o2"),
        (3, "RESERVED", "o3"),
        (4, "RELEASED", "o3"),
        (5, "CONFIRMED", "o2"),
    ]
    .into_iter()
    .map(|(n, k, o)| (n, k.to_string(), o.to_string()))
    .collect();
    assert_eq!(events, want);
    let head: i64 = sqlx::query_scalar("SELECT last FROM feed_head")
        .fetch_one(&l.reader)
        .await
        .unwrap();
    assert_eq!(head, 5, "new changes go on after the numbered ones");
    // Migration 7 rebuilt the table: its indexes (as migration 8 left them), and the view
    // over it, are all there.
    let schema: Vec<String> = sqlx::query_scalar(
        "SELECT type || ' ' || name FROM sqlite_schema \
         WHERE tbl_name IN ('reservations', 'customer_usage') ORDER BY 1",
    )
    .fetch_all(&l.reader)
    .await
    .unwrap();
    assert_eq!(
        schema,
        [
            "index reservations_by_reserved_seq",
            "index reservations_by_settled_seq",
            "index reservations_by_voucher",
            "index reservations_due",
            "index sqlite_autoindex_reservations_1",
            "table reservations",
            "view customer_usage",
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// SQLite opens, fills and closes a temporary B-tree at every run of a statement with an
/// `IN` list of three or more constants (in its text or in a CHECK it evaluates) or with
/// `RETURNING`: the merged commit's statements, run per row or per batch, have none; nor
/// has a bare status change, which evaluates the status CHECK as confirm, release and
/// expiry do (those still return their row through `RETURNING`: one per request).
#[tokio::test]
async fn merged_commit_statements_build_no_temporary_btree() {
    let dir = std::env::temp_dir().join(format!("vouchers-eph-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let l = SqliteLedger::connect(&format!("sqlite://{}/l.db", dir.display()), 1)
        .await
        .unwrap();
    let status_change = "UPDATE reservations SET status = ?2 WHERE order_id = ?1";
    for sql in [
        READ_RULES,
        READ_LEASE,
        READ_STORED,
        usage::LOAD_RESERVED,
        usage::LOAD_CONFIRMED,
        FENCE,
        FEED_TAKE,
        FEED_LAST,
        INSERT_RESERVATION,
        COUNT_RESERVED,
        status_change,
    ] {
        // EXPLAIN lists the statement's program, one instruction per row; column 1 is
        // the opcode. On the writer's connection: a read-only one leaves CHECKs out.
        let plan: Vec<String> = sqlx::query(&format!("EXPLAIN {sql}"))
            .fetch_all(&l.writer_pool)
            .await
            .unwrap()
            .iter()
            .map(|r| Row::get::<String, _>(r, 1))
            .collect();
        assert!(plan.iter().any(|op| op == "Halt"), "{sql}: {plan:?}");
        assert!(
            !plan.iter().any(|op| op == "OpenEphemeral"),
            "{sql} builds a temporary B-tree at each run: {plan:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

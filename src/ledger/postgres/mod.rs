//! The cluster ledger: PostgreSQL through sqlx. Every node talks to the same database.
//!
//! Concurrency: a batch locks only what it draws on: its own lease row (the fence) and an
//! advisory lock per customer (in key order; usage is counted from the rows, migration 15), so
//! batches of different nodes run side by side.
//! Order ids are settled by the primary key (`ON CONFLICT DO NOTHING`; a row that lost a race is
//! re-read and answered as a replay or `ALREADY_USED`). Everything that moves units between
//! `free` and leases or reservations (grant, return, reap, release, expiry, confirm, edits)
//! locks the voucher row first, in code order when several. Batches never touch the voucher
//! row: `reserved` is derived from the leases (see the migration).
//!
//! The node's merged group commit (the batches of many vouchers) is one call of the server-side
//! function `vouchers_commit_batches_v2` (migration 0002): rows travel as arrays, the call is its
//! own transaction, and no lock is held across a network round trip. Confirm, release and
//! expiry are one call each too (`vouchers_settle`, `vouchers_expire`, migration 0008).
//!
//! The change feed (migration 0007): every transaction that changes reservations takes the one
//! row `feed_head` as its last lock and holds it to commit, which numbers the changes without
//! gaps and in commit order. The cost: such transactions commit one at a time cluster-wide for
//! the span of their last statement and their commit.
//!
//! This file holds [`PostgresLedger`] and its [`Ledger`] implementation, with the reads, the
//! voucher and switch edits and the settling calls; [`open`] connects and migrates, [`commit`]
//! runs the merged commit, and [`leases`] grants, returns and reaps leases and keeps the
//! holders' beats. [`target`] reads the servers a multi-host `ledger.url` lists, and [`primary`]
//! keeps the node's pools on the writable one through a failover.

/// The ledger's own clock in SQL, milliseconds since the epoch: liveness and the placement's
/// decay are judged on it, so no node's clock can skew them (a macro, for `concat!`).
macro_rules! ledger_now {
    () => {
        "(extract(epoch from clock_timestamp()) * 1000)::BIGINT"
    };
}

pub(crate) mod commit;
pub(crate) mod directory;
mod leases;
mod open;
pub(crate) use open::Pending;
mod primary;
pub mod target;

use std::collections::HashMap;

use async_trait::async_trait;
use sqlx::postgres::PgPool;
use sqlx::Row;

use super::rows::settled_events;
use super::rows::{
    event_from, limit_column, reservation_from, switches_from, voucher_from, EventRow,
    ACTIVE_LEASES_SQL, CREATED_SINCE_SQL, FEED_ORIGIN_SQL, LIVE_CODES_SQL, RESERVATION_COLUMNS,
    RETIRE_SQL, SET_SWITCHES_SQL, STARTING_SQL, SWITCHES_SQL, UNWATCH_SQL, VOUCHER_COLUMNS,
    VOUCHER_STOCK_SQL, WATCHED_SQL, WATCH_SQL, WON_ORDERS_SQL,
};
use super::{
    group_restocks, Batch, BatchResults, Beat, Closing, Counters, Grant, GrantAsk, Incarnation,
    Ledger, LedgerError, LiveUnits, Restock,
};
use crate::clock::Millis;
use crate::domain::{FeedEvent, Reservation, Switches, SwitchesPatch, Voucher, VoucherPatch};

/// The change feed after `$1`, at most `$2` events, in order: the RESERVED events from the
/// merged commits' `feed_batches` rows, then the settled ones. Numbers have no gaps, so the
/// page is exactly the numbers in `($1, $1 + $2]`: only the batches that overlap it are
/// unnested, however far behind the reader is.
const EVENTS_SQL: &str = concat!(
    "SELECT seq, kind, voucher_code, order_id, customer_id, at FROM ( \
     SELECT * FROM (SELECT u.seq, 'RESERVED'::text AS kind, r.voucher_code, r.order_id, r.customer_id, r.created_at AS at \
       FROM (SELECT f.last_seq - cardinality(f.orders) + t.i AS seq, t.o \
             FROM (SELECT * FROM feed_batches WHERE last_seq > $1 \
                     AND last_seq - cardinality(orders) < $1 + $2 \
                   ORDER BY last_seq LIMIT $2) AS f \
             CROSS JOIN LATERAL unnest(f.orders) WITH ORDINALITY AS t (o, i)) AS u \
       JOIN reservations r ON r.order_id = u.o \
       WHERE u.seq > $1 AND u.seq <= $1 + $2 ORDER BY 1 LIMIT $2) AS r \
     UNION ALL ",
    settled_events!(),
    ") AS e ORDER BY seq LIMIT $2"
);

pub struct PostgresLedger {
    /// Which listed server the node writes to, and the node's pools on it: its pool, and one
    /// connection of its own for heartbeats (a pool busy with commits, or waiting on locks, must
    /// not delay a beat until the node looks dead).
    locator: std::sync::Arc<primary::Locator>,
    /// This store is a shard of a node that claims its orders on the directory first: its
    /// commits pass the claims' fence (`vouchers_commit_batches_claimed`, migration 13); every
    /// other commit is refused once the database's claims began.
    claimed: std::sync::atomic::AtomicBool,
    /// A store opened while its server was down ([`PostgresLedger::connect_late`]): a closed
    /// pool that every call gets (and fails on, as unreachable) until the store is migrated and
    /// checked and `opened` is set.
    unopened: Option<PgPool>,
    opened: std::sync::atomic::AtomicBool,
}

impl PostgresLedger {
    fn pool(&self) -> PgPool {
        self.unopened_gate().unwrap_or_else(|| self.locator.pool())
    }

    fn beats(&self) -> PgPool {
        self.unopened_gate().unwrap_or_else(|| self.locator.beats())
    }

    /// The closed pool of a late store not yet opened.
    fn unopened_gate(&self) -> Option<PgPool> {
        self.unopened
            .as_ref()
            .filter(|_| !self.opened.load(std::sync::atomic::Ordering::Acquire))
            .cloned()
    }

    /// The pool on the server, even before a late store is opened: for the checks that open it.
    fn server_pool(&self) -> PgPool {
        self.locator.pool()
    }

    /// RESERVED → CONFIRMED (`confirm`) or RELEASED; `None` when the reservation is not
    /// RESERVED (or, to confirm, expired) or not there.
    async fn settle(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
        confirm: bool,
    ) -> Result<Option<Reservation>, LedgerError> {
        let row = sqlx::query(
            "SELECT out_order AS order_id, out_voucher AS voucher_code, \
             out_customer AS customer_id, out_discount AS discount_amount, out_status AS status, \
             out_expires AS expires_at FROM vouchers_settle($1, $2, $3, $4)",
        )
        .bind(code)
        .bind(order_id)
        .bind(now)
        .bind(confirm)
        .fetch_optional(&self.pool())
        .await?;
        Ok(row.as_ref().map(reservation_from).transpose()?)
    }

    async fn load_reservation(
        &self,
        code: &str,
        order_id: &str,
    ) -> Result<Reservation, LedgerError> {
        let row = sqlx::query(&format!(
            "SELECT {RESERVATION_COLUMNS} FROM reservations WHERE order_id = $1 AND voucher_code = $2"
        ))
        .bind(order_id)
        .bind(code)
        .fetch_optional(&self.pool())
        .await?
        .ok_or(LedgerError::NotFound)?;
        Ok(reservation_from(&row)?)
    }
}

macro_rules! insert_voucher_sql {
    () => {
        "INSERT INTO vouchers (code, discount_amount, min_order_amount, total_limit, \
         per_user_limit, starts_at, ends_at, status, free, created_at, customer_rate, \
         customer_burst, admission_rate) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $4, $9, $10, $11, $12)"
    };
}

/// The insert of a new voucher, all of it `free`.
const INSERT_VOUCHER: &str = insert_voucher_sql!();
/// The same, inserting nothing for a taken code.
const INSERT_VOUCHER_OR_SKIP: &str =
    concat!(insert_voucher_sql!(), " ON CONFLICT (code) DO NOTHING");

/// The insert of a new voucher (`sql`: one of the two above).
fn insert_voucher<'q>(
    v: &'q Voucher,
    now: Millis,
    sql: &'static str,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(&v.code)
        .bind(v.discount_amount)
        .bind(v.min_order_amount)
        .bind(v.total_limit)
        .bind(v.per_user_limit)
        .bind(v.starts_at)
        .bind(v.ends_at)
        .bind(v.status.as_str())
        .bind(now)
        .bind(limit_column(v.limits.customer_per_sec))
        .bind(limit_column(v.limits.customer_burst))
        .bind(limit_column(v.limits.admission_per_sec))
}

#[async_trait]
impl Ledger for PostgresLedger {
    /// Also fails once this database's order claims began for a store that commits without
    /// claims (a node on `ledger.url`, or a sharded one without claims): every commit of it is
    /// refused by the fence, so it says it is not ready and a load balancer sends it nothing.
    async fn ping(&self) -> Result<(), LedgerError> {
        if self.claimed.load(std::sync::atomic::Ordering::Acquire) {
            sqlx::query("SELECT 1").execute(&self.pool()).await?;
            return Ok(());
        }
        let began: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM claims_begun)")
            .fetch_one(&self.pool())
            .await?;
        match began {
            true => Err(LedgerError::Invalid(
                "order claims began on this database: list every shard in ledger.shards \
                 (with order_ids_across_shards) and restart",
            )),
            false => Ok(()),
        }
    }

    /// A bare TCP connection to the server in use: refused outright (nothing listens) within a
    /// quarter second says so; a Unix socket, any other failure, a slow answer or a connection
    /// made says nothing (`false`).
    async fn refuses_connections(&self) -> bool {
        let Some((host, port)) = self.locator.tcp_server() else {
            return false;
        };
        let connect = tokio::net::TcpStream::connect((host.as_str(), port));
        matches!(
            tokio::time::timeout(std::time::Duration::from_millis(250), connect).await,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
        )
    }

    async fn create_voucher(&self, v: &Voucher, now: Millis) -> Result<(), LedgerError> {
        let res = insert_voucher(v, now, INSERT_VOUCHER)
            .execute(&self.pool())
            .await;
        super::sql::insert_unique(res)
    }

    async fn create_vouchers(
        &self,
        vouchers: &[(Voucher, Millis)],
    ) -> Result<Vec<Result<(), LedgerError>>, LedgerError> {
        // A unique violation would abort the transaction: a taken code inserts nothing instead.
        // In code order, so that two nodes creating the same codes wait on each other's
        // inserts in one order, never in a cycle.
        let mut order: Vec<usize> = (0..vouchers.len()).collect();
        order.sort_by(|&a, &b| vouchers[a].0.code.cmp(&vouchers[b].0.code));
        let mut tx = self.pool().begin().await?;
        let mut answers: Vec<Result<(), LedgerError>> = vouchers.iter().map(|_| Ok(())).collect();
        for i in order {
            let (v, now) = &vouchers[i];
            let done = insert_voucher(v, *now, INSERT_VOUCHER_OR_SKIP)
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() != 1 {
                answers[i] = Err(LedgerError::AlreadyExists);
            }
        }
        tx.commit().await?;
        Ok(answers)
    }

    async fn voucher(&self, code: &str) -> Result<Option<Voucher>, LedgerError> {
        let row = sqlx::query(&format!(
            "SELECT {VOUCHER_COLUMNS} FROM vouchers WHERE code = $1"
        ))
        .bind(code)
        .fetch_optional(&self.pool())
        .await?;
        Ok(row.as_ref().map(voucher_from).transpose()?)
    }

    async fn vouchers(&self, codes: &[String]) -> Result<Vec<Voucher>, LedgerError> {
        let rows = sqlx::query(&format!(
            "SELECT {VOUCHER_COLUMNS} FROM vouchers WHERE code = ANY($1)"
        ))
        .bind(codes)
        .fetch_all(&self.pool())
        .await?;
        Ok(rows.iter().map(voucher_from).collect::<Result<_, _>>()?)
    }

    async fn voucher_stock(&self, code: &str) -> Result<Option<(Voucher, i64)>, LedgerError> {
        let row = sqlx::query(VOUCHER_STOCK_SQL)
            .bind(code)
            .fetch_optional(&self.pool())
            .await?;
        match row {
            Some(row) => Ok(Some((voucher_from(&row)?, row.try_get("available")?))),
            None => Ok(None),
        }
    }

    async fn update_voucher(
        &self,
        code: &str,
        patch: &VoucherPatch,
    ) -> Result<(Voucher, Option<Restock>), LedgerError> {
        let mut tx = self.pool().begin().await?;
        let row = sqlx::query(&format!(
            "SELECT {VOUCHER_COLUMNS} FROM vouchers WHERE code = $1 FOR UPDATE"
        ))
        .bind(code)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(LedgerError::NotFound)?;
        let current = voucher_from(&row)?;
        let (next, added) = super::apply_patch(&current, patch)?;
        sqlx::query(
            "UPDATE vouchers SET status = $1, ends_at = $2, total_limit = $3, free = free + $4, \
             customer_rate = $6, customer_burst = $7, admission_rate = $8 WHERE code = $5",
        )
        .bind(next.status.as_str())
        .bind(next.ends_at)
        .bind(next.total_limit)
        .bind(added)
        .bind(code)
        .bind(limit_column(next.limits.customer_per_sec))
        .bind(limit_column(next.limits.customer_burst))
        .bind(limit_column(next.limits.admission_per_sec))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok((next, Restock::of(code, added)))
    }

    async fn grant(
        &self,
        code: &str,
        node: &str,
        want: i64,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Grant, LedgerError> {
        self.grant_lease(code, node, want, now, ttl_ms).await
    }

    async fn grant_many(
        &self,
        asks: &[GrantAsk],
    ) -> Result<Vec<Result<Grant, LedgerError>>, LedgerError> {
        self.grant_leases(asks).await
    }

    async fn renew(
        &self,
        lease_ids: &[i64],
        node: &str,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Vec<i64>, LedgerError> {
        // Lease rows are locked in id order, as a merged commit locks them (no deadlock).
        Ok(sqlx::query_scalar(
            "WITH l AS (SELECT id FROM leases \
                        WHERE id = ANY($2) AND node_id = $3 AND state = 'ACTIVE' \
                        ORDER BY id FOR UPDATE) \
             UPDATE leases SET expires_at = $1 FROM l WHERE leases.id = l.id RETURNING leases.id",
        )
        .bind(now + ttl_ms)
        .bind(lease_ids)
        .bind(node)
        .fetch_all(&self.pool())
        .await?)
    }

    async fn active_leases(&self, code: &str, node: &str) -> Result<Vec<i64>, LedgerError> {
        Ok(sqlx::query_scalar(ACTIVE_LEASES_SQL)
            .bind(code)
            .bind(node)
            .fetch_all(&self.pool())
            .await?)
    }

    async fn return_lease(
        &self,
        lease_id: i64,
        now: Millis,
    ) -> Result<Option<Restock>, LedgerError> {
        Ok(self
            .close_leases(Closing::Lease(lease_id), now)
            .await?
            .into_iter()
            .next())
    }

    async fn return_leases(
        &self,
        leases: &[(i64, Millis)],
    ) -> Result<Vec<Option<Restock>>, LedgerError> {
        self.return_many(leases).await
    }

    async fn return_node_leases(
        &self,
        node: &str,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        self.close_leases(Closing::Node(node), now).await
    }

    async fn register_node(
        &self,
        name: &str,
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Incarnation, LedgerError> {
        self.register(name, now, dead_after_ms).await
    }

    fn lost(&self) {
        self.locator.lost();
    }

    fn server(&self) -> Option<(String, u64)> {
        Some(self.locator.server())
    }

    fn failovers(&self) -> u64 {
        self.locator.failovers()
    }

    async fn heartbeat(
        &self,
        holder: &str,
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Beat, LedgerError> {
        self.beat(holder, now, dead_after_ms).await
    }

    async fn reap_holder(&self, holder: &str, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        self.reap_dead(holder, now).await
    }

    async fn retire_node(&self, holder: &str) -> Result<(), LedgerError> {
        sqlx::query(RETIRE_SQL)
            .bind(holder)
            .execute(&self.pool())
            .await?;
        Ok(())
    }

    async fn commit_batches(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        self.commit_merged(batches).await
    }

    async fn find_orders(&self, order_ids: &[String]) -> Result<Vec<Reservation>, LedgerError> {
        let rows = sqlx::query(&format!(
            "SELECT {RESERVATION_COLUMNS} FROM reservations WHERE order_id = ANY($1)"
        ))
        .bind(order_ids)
        .fetch_all(&self.pool())
        .await?;
        Ok(rows
            .iter()
            .map(reservation_from)
            .collect::<Result<_, _>>()?)
    }

    async fn live_units(
        &self,
        now: Millis,
        ending_after: Millis,
        codes: &[String],
    ) -> Result<Vec<LiveUnits>, LedgerError> {
        if codes.is_empty() {
            return Ok(Vec::new());
        }
        // Only the active leases are read (by voucher and state); `reserved`, which this schema
        // derives from every lease ever granted, follows from the accounting equation instead:
        // total = free + leased unused + reserved + confirmed (the reconciler checks it).
        let rows: Vec<(String, i64, i64, i64, i64, i64, i64)> = sqlx::query_as(
            "SELECT v.code, v.total_limit, v.free, a.unused, \
             v.total_limit - v.free - a.unused - v.confirmed, v.confirmed, v.released \
             FROM vouchers v CROSS JOIN LATERAL ( \
                 SELECT COALESCE(SUM(l.granted - l.consumed), 0)::BIGINT AS unused FROM leases l \
                 WHERE l.voucher_code = v.code AND l.state = 'ACTIVE') a \
             WHERE v.code = ANY($3) AND v.starts_at <= $1 AND v.ends_at > $2",
        )
        .bind(now)
        .bind(ending_after)
        .bind(codes)
        .fetch_all(&self.pool())
        .await?;
        Ok(rows.into_iter().map(super::rows::live_units_from).collect())
    }

    async fn starting_between(&self, from: Millis, to: Millis) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(STARTING_SQL)
            .bind(from)
            .bind(to)
            .fetch_all(&self.pool())
            .await?)
    }

    async fn switches(&self) -> Result<Switches, LedgerError> {
        let row = sqlx::query_as(SWITCHES_SQL).fetch_one(&self.pool()).await?;
        Ok(switches_from(row))
    }

    async fn set_switches(
        &self,
        patch: &SwitchesPatch,
        now: Millis,
    ) -> Result<Switches, LedgerError> {
        let row = sqlx::query_as(SET_SWITCHES_SQL)
            .bind(patch.sales_paused)
            .bind(patch.read_only)
            .bind(now)
            .fetch_one(&self.pool())
            .await?;
        Ok(switches_from(row))
    }

    async fn won_orders(&self, code: &str) -> Result<Vec<(String, i64)>, LedgerError> {
        Ok(sqlx::query_as(WON_ORDERS_SQL)
            .bind(code)
            .fetch_all(&self.pool())
            .await?)
    }

    async fn customer_usage(
        &self,
        code: &str,
        customers: &[i64],
    ) -> Result<Vec<(i64, i64)>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT customer_id, used FROM customer_usage \
             WHERE voucher_code = $1 AND customer_id = ANY ($2)",
        )
        .bind(code)
        .bind(customers)
        .fetch_all(&self.pool())
        .await?)
    }

    // Confirm, release and expiry are one call each of a server-side function (migration 8):
    // one round trip, its own transaction, locks in a fixed order with the change feed's head
    // last, and each reservation row written once.
    async fn confirm(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<Reservation, LedgerError> {
        match self.settle(code, order_id, now, true).await? {
            Some(r) => Ok(r),
            None => super::confirm_unchanged(self.load_reservation(code, order_id).await?),
        }
    }

    async fn release(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<(Reservation, Option<Restock>), LedgerError> {
        match self.settle(code, order_id, now, false).await? {
            Some(r) => {
                let restock = Restock {
                    voucher_code: r.voucher_code.clone(),
                    units: 1,
                };
                Ok((r, Some(restock)))
            }
            None => super::release_unchanged(self.load_reservation(code, order_id).await?),
        }
    }

    async fn expire_due(&self, now: Millis, limit: i64) -> Result<Vec<Restock>, LedgerError> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT out_voucher, out_units FROM vouchers_expire($1, $2)")
                .bind(now)
                .bind(limit)
                .fetch_all(&self.pool())
                .await?;
        Ok(group_restocks(rows))
    }

    async fn reap_expired(&self, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        self.close_leases(Closing::ExpiredBy(now), now).await
    }

    async fn counters_many(&self, codes: &[String]) -> Result<Vec<Option<Counters>>, LedgerError> {
        if codes.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.pool().begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .execute(&mut *tx)
            .await?;
        let heads: Vec<(String, i64, i64, i64, i64, i64)> = sqlx::query_as(
            "SELECT code, total_limit, free, confirmed, released, closed_consumed \
             FROM vouchers WHERE code = ANY($1)",
        )
        .bind(codes)
        .fetch_all(&mut *tx)
        .await?;
        let rows: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT voucher_code, status, COUNT(*) FROM reservations \
             WHERE voucher_code = ANY($1) GROUP BY voucher_code, status",
        )
        .bind(codes)
        .fetch_all(&mut *tx)
        .await?;
        let leases: Vec<(String, i64, i64, i64)> = sqlx::query_as(
            "SELECT voucher_code, \
             COALESCE(SUM(CASE WHEN state = 'ACTIVE' THEN granted - consumed ELSE 0 END), 0)::BIGINT, \
             COALESCE(SUM(consumed), 0)::BIGINT, \
             COALESCE(SUM(consumed) FILTER (WHERE state <> 'ACTIVE'), 0)::BIGINT \
             FROM leases WHERE voucher_code = ANY($1) GROUP BY voucher_code",
        )
        .bind(codes)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        let mut by_status: HashMap<String, Vec<(String, i64)>> = HashMap::new();
        for (code, status, n) in rows {
            by_status.entry(code).or_default().push((status, n));
        }
        let leases: HashMap<String, (i64, i64, i64)> = leases
            .into_iter()
            .map(|(c, a, b, d)| (c, (a, b, d)))
            .collect();
        let mut found: HashMap<String, Counters> = HashMap::with_capacity(heads.len());
        for (code, total_limit, free, confirmed, released, kept_closed) in heads {
            let (leased_unused, consumed, closed) = leases.get(&code).copied().unwrap_or_default();
            // Units taken by batches, less those confirmed or released since (see the migration).
            let reserved = consumed - confirmed - released;
            let statuses = by_status.get(&code).map_or(&[][..], Vec::as_slice);
            // Usage is the count of the rows that are not RELEASED (`customer_usage` is a view
            // of it since migration 15, as on SQLite): it cannot drift from them, so it is not
            // read again (summing the view cost more than the rows' count by status).
            let usage = statuses
                .iter()
                .filter(|(s, _)| s != "RELEASED")
                .map(|(_, n)| n)
                .sum();
            let mut counters = super::reconcile(
                Counters {
                    total_limit,
                    free,
                    leased_unused,
                    reserved,
                    confirmed,
                    released,
                    balanced: false,
                },
                statuses,
                consumed,
                usage,
            );
            // The grant check reads closed leases' consumption from the voucher row (migration
            // 10): a copy that drifted from the leases would weaken DESIGN §3's last line unseen.
            if kept_closed != closed {
                tracing::error!(
                    code,
                    kept_closed,
                    closed,
                    "vouchers.closed_consumed disagrees with the closed leases"
                );
                counters.balanced = false;
            }
            found.insert(code, counters);
        }
        Ok(codes.iter().map(|c| found.get(c).copied()).collect())
    }

    async fn feed_origin(&self) -> Result<String, LedgerError> {
        Ok(sqlx::query_scalar(FEED_ORIGIN_SQL)
            .fetch_one(&self.pool())
            .await?)
    }

    async fn events(&self, after: i64, limit: i64) -> Result<Vec<FeedEvent>, LedgerError> {
        let rows: Vec<EventRow> = sqlx::query_as(EVENTS_SQL)
            .bind(after)
            .bind(limit)
            .fetch_all(&self.pool())
            .await?;
        rows.into_iter().map(event_from).collect()
    }

    async fn voucher_codes(
        &self,
        ending_after: Millis,
        after: &str,
        limit: i64,
    ) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(LIVE_CODES_SQL)
            .bind(ending_after)
            .bind(after)
            .bind(limit)
            .fetch_all(&self.pool())
            .await?)
    }

    async fn codes_created_since(&self, since: Millis) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(CREATED_SINCE_SQL)
            .bind(since)
            .fetch_all(&self.pool())
            .await?)
    }

    async fn watched_codes(&self) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(WATCHED_SQL)
            .fetch_all(&self.pool())
            .await?)
    }

    async fn set_watched(&self, code: &str, watched: bool) -> Result<(), LedgerError> {
        if watched {
            let n = sqlx::query(WATCH_SQL)
                .bind(code)
                .execute(&self.pool())
                .await?;
            if n.rows_affected() == 0 && self.voucher(code).await?.is_none() {
                return Err(LedgerError::NotFound);
            }
        } else {
            sqlx::query(UNWATCH_SQL)
                .bind(code)
                .execute(&self.pool())
                .await?;
        }
        Ok(())
    }
}

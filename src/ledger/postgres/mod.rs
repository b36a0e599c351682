//! The cluster ledger: PostgreSQL through sqlx. Every node talks to the same database.
//!
//! Concurrency: a batch locks only what it draws on: its own lease row (the fence) and the usage
//! rows of its customers (in customer order), so batches of different nodes run side by side.
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

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Row, Transaction};

use super::rows::settled_events;
use super::rows::{
    event_from, limit_column, reservation_from, switches_from, voucher_from, EventRow,
    FEED_ORIGIN_SQL, LIVE_CODES_SQL, RESERVATION_COLUMNS, SET_SWITCHES_SQL, STARTING_SQL,
    SWITCHES_SQL, VOUCHER_COLUMNS, VOUCHER_STOCK_SQL,
};
use super::{
    group_restocks, holder_name, resolve_plan, split_holder, Batch, BatchResults, Beat, Closing,
    Counters, Grant, Incarnation, Lease, Ledger, LedgerError, LiveUnits, Planned, Restock,
    RowOutcome, LEASE_FILTER,
};
use crate::clock::Millis;
use crate::domain::{
    FeedEvent, Ineligible, Reservation, ReservationStatus, Switches, SwitchesPatch, Voucher,
    VoucherPatch,
};

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

const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../../migrations/postgres/0001_init.sql"),
    ),
    (
        2,
        include_str!("../../../migrations/postgres/0002_merged_commit.sql"),
    ),
    (
        3,
        include_str!("../../../migrations/postgres/0003_leases_by_voucher.sql"),
    ),
    (
        5,
        include_str!("../../../migrations/postgres/0005_voucher_limits.sql"),
    ),
    (
        6,
        include_str!("../../../migrations/postgres/0006_switches.sql"),
    ),
    (
        7,
        include_str!("../../../migrations/postgres/0007_feed.sql"),
    ),
    (
        8,
        include_str!("../../../migrations/postgres/0008_settle.sql"),
    ),
    (
        9,
        include_str!("../../../migrations/postgres/0009_nodes.sql"),
    ),
    (
        10,
        include_str!("../../../migrations/postgres/0010_closed_consumed.sql"),
    ),
];

/// Definitions applied on every start after the versioned migrations (each is `CREATE OR
/// REPLACE`): a database made by an earlier build gets the function of this one. Version 2 made
/// the function first; an edit of it needs no new version.
const REPEATABLE: &[&str] = &[
    include_str!("../../../migrations/postgres/0002_merged_commit.sql"),
    include_str!("../../../migrations/postgres/0008_settle.sql"),
    include_str!("../../../migrations/postgres/grant.sql"),
];

/// An arbitrary constant that names this schema's migration lock.
const MIGRATION_LOCK: i64 = 0x766f_7563_6865_7273;

pub struct PostgresLedger {
    pool: PgPool,
    /// One connection of its own for heartbeats: a pool busy with commits (or waiting on locks)
    /// must not delay a beat until the node looks dead.
    beats: PgPool,
}

impl PostgresLedger {
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
        .fetch_optional(&self.pool)
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
        .fetch_optional(&self.pool)
        .await?
        .ok_or(LedgerError::NotFound)?;
        Ok(reservation_from(&row)?)
    }

    pub async fn connect(
        url: &str,
        max_connections: u32,
        timeout_ms: u64,
        acquire_timeout_ms: u64,
    ) -> Result<Self, sqlx::Error> {
        // Tables grow from empty within seconds of a sale starting: a generic plan cached while
        // they were tiny (a sequential scan) would stay for the life of the connection. Custom
        // plans see the real table size every time.
        let mut options =
            PgConnectOptions::from_str(url)?.options([("plan_cache_mode", "force_custom_plan")]);
        if timeout_ms > 0 {
            // No statement and no lock wait may hold a connection past the ledger's deadline.
            let ms = timeout_ms.to_string();
            options = options.options([
                ("statement_timeout", ms.as_str()),
                ("lock_timeout", ms.as_str()),
            ]);
        }
        // Connections are checked before use (one short round trip per merged transaction):
        // after an outage the pool replaces broken ones instead of failing a request on each.
        // Waiting for a connection (and that check) fails fast, so the breaker sees a dead link
        // within `acquire_timeout_ms` rather than at the end of each call's deadline.
        let pool = PgPoolOptions::new()
            .max_connections(max_connections.max(2))
            .acquire_timeout(Duration::from_millis(acquire_timeout_ms.max(1)))
            .connect_with(options.clone())
            .await?;
        migrate(&pool).await?;
        let beats = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(1))
            .connect_lazy_with(options);
        Ok(Self { pool, beats })
    }
}

async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    // Nodes that start together migrate one after the other.
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut *tx)
        .await?;
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY)")
        .execute(&mut *tx)
        .await?;
    // An older build would put back its own commit function (below) and write rows the
    // feed cannot see: it refuses a ledger a newer build migrated.
    let newest: i64 = sqlx::query_scalar("SELECT COALESCE(max(version), 0) FROM schema_migrations")
        .fetch_one(&mut *tx)
        .await?;
    super::sql::refuse_newer_schema(newest, MIGRATIONS)?;
    for (version, sql) in MIGRATIONS {
        let done = sqlx::query("SELECT 1 FROM schema_migrations WHERE version = $1")
            .bind(version)
            .fetch_optional(&mut *tx)
            .await?;
        if done.is_none() {
            sqlx::raw_sql(sql).execute(&mut *tx).await?;
            sqlx::query("INSERT INTO schema_migrations (version) VALUES ($1)")
                .bind(version)
                .execute(&mut *tx)
                .await?;
        }
    }
    for sql in REPEATABLE {
        sqlx::raw_sql(sql).execute(&mut *tx).await?;
    }
    tx.commit().await
}

type Tx = Transaction<'static, Postgres>;

/// Locks the voucher rows of `codes` in code order; returns the codes that exist.
async fn lock_vouchers(tx: &mut Tx, codes: &[String]) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT code FROM vouchers WHERE code = ANY($1) ORDER BY code FOR UPDATE")
        .bind(codes)
        .fetch_all(&mut **tx)
        .await
}

#[async_trait]
impl Ledger for PostgresLedger {
    async fn ping(&self) -> Result<(), LedgerError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn create_voucher(&self, v: &Voucher, now: Millis) -> Result<(), LedgerError> {
        let res = sqlx::query(
            "INSERT INTO vouchers (code, discount_amount, min_order_amount, total_limit, \
             per_user_limit, starts_at, ends_at, status, free, created_at, customer_rate, \
             customer_burst, admission_rate) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $4, $9, $10, $11, $12)",
        )
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
        .execute(&self.pool)
        .await;
        super::sql::insert_unique(res)
    }

    async fn voucher(&self, code: &str) -> Result<Option<Voucher>, LedgerError> {
        let row = sqlx::query(&format!(
            "SELECT {VOUCHER_COLUMNS} FROM vouchers WHERE code = $1"
        ))
        .bind(code)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.as_ref().map(voucher_from).transpose()?)
    }

    async fn voucher_stock(&self, code: &str) -> Result<Option<(Voucher, i64)>, LedgerError> {
        let row = sqlx::query(VOUCHER_STOCK_SQL)
            .bind(code)
            .fetch_optional(&self.pool)
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
        let mut tx = self.pool.begin().await?;
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
        // One round trip: `vouchers_grant_v2` (migrations/postgres/grant.sql) locks the voucher,
        // moves the units and inserts the lease; the deferred check runs as the call commits.
        let expires_at = now + ttl_ms;
        let row: Option<(i64, i64, i64, Option<i64>, Option<i64>)> = sqlx::query_as(
            "SELECT out_free, out_units, out_unused, out_lease, out_ever \
             FROM vouchers_grant_v2($1, $2, $3, $4, $5)",
        )
        .bind(code)
        .bind(node)
        .bind(want)
        .bind(now)
        .bind(expires_at)
        .fetch_optional(&self.pool)
        .await
        .inspect_err(|e| {
            if let sqlx::Error::Database(d) = e {
                if d.code().as_deref() == Some("23514") {
                    // DESIGN §3's last line held where the books had already gone wrong.
                    tracing::error!(code, want, error = %d, "a grant would pass total_limit: refused");
                    crate::metrics::ledger_error(crate::metrics::LedgerOp::GrantPastTotal);
                }
            }
        })?;
        let (free, units, leased_unused, lease_id, ever_reserved) =
            row.ok_or(LedgerError::NotFound)?;
        let lease = lease_id.map(|id| Lease {
            id,
            granted: units,
            expires_at,
        });
        Ok(Grant {
            lease,
            free_after: free - units,
            leased_unused,
            ever_reserved,
        })
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
        .fetch_all(&self.pool)
        .await?)
    }

    async fn active_leases(&self, code: &str, node: &str) -> Result<Vec<i64>, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT id FROM leases WHERE voucher_code = $1 AND node_id = $2 AND state = 'ACTIVE' \
             AND consumed < granted ORDER BY id",
        )
        .bind(code)
        .bind(node)
        .fetch_all(&self.pool)
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
        _now: Millis,
        dead_after_ms: i64,
    ) -> Result<Incarnation, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let number: i64 = sqlx::query_scalar(
            "INSERT INTO node_names (name, last_incarnation) VALUES ($1, 1) \
             ON CONFLICT (name) DO UPDATE SET last_incarnation = node_names.last_incarnation + 1 \
             RETURNING last_incarnation",
        )
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
        let holder = holder_name(name, number);
        sqlx::query(&format!(
            "INSERT INTO nodes (holder, name, incarnation, started_at, beat_at, streak_from, \
                                dead_after) \
             VALUES ($1, $2, $3, {LEDGER_NOW}, {LEDGER_NOW}, {LEDGER_NOW}, $4) \
             ON CONFLICT (holder) DO UPDATE SET beat_at = EXCLUDED.beat_at, \
                 streak_from = EXCLUDED.streak_from, dead_after = EXCLUDED.dead_after"
        ))
        .bind(&holder)
        .bind(name)
        .bind(number)
        .bind(dead_after_ms.max(1))
        .execute(&mut *tx)
        .await?;
        let live_siblings: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT incarnation FROM nodes WHERE name = $1 AND incarnation <> $2 \
             AND beat_at >= {LEDGER_NOW} - dead_after ORDER BY incarnation"
        ))
        .bind(name)
        .bind(number)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Incarnation {
            holder,
            number,
            live_siblings,
        })
    }

    async fn heartbeat(
        &self,
        holder: &str,
        _now: Millis,
        dead_after_ms: i64,
    ) -> Result<Beat, LedgerError> {
        let (name, number) = split_holder(holder);
        // One statement, one round trip: the clock reading it returns is as close to the middle
        // of the call as can be. The dead are listed in the snapshot from before this beat.
        let (ledger_ms, dead): (i64, Vec<String>) = sqlx::query_as(&format!(
            "WITH b AS ( \
                 INSERT INTO nodes (holder, name, incarnation, started_at, beat_at, streak_from, \
                                    dead_after) \
                 VALUES ($1, $2, $3, {LEDGER_NOW}, {LEDGER_NOW}, {LEDGER_NOW}, $4) \
                 ON CONFLICT (holder) DO UPDATE SET beat_at = EXCLUDED.beat_at, \
                     dead_after = EXCLUDED.dead_after, \
                     streak_from = CASE \
                         WHEN EXCLUDED.beat_at - nodes.beat_at > EXCLUDED.dead_after / 2 \
                         THEN EXCLUDED.beat_at ELSE nodes.streak_from END \
                 RETURNING beat_at - streak_from AS streak, beat_at) \
             SELECT b.beat_at, ARRAY(SELECT n.holder FROM nodes n \
                                     WHERE n.holder <> $1 AND n.beat_at < b.beat_at - n.dead_after \
                                       AND n.dead_after <= b.streak ORDER BY n.holder) \
             FROM b"
        ))
        .bind(holder)
        .bind(name)
        .bind(number)
        .bind(dead_after_ms.max(1))
        .fetch_one(&self.beats)
        .await?;
        Ok(Beat { ledger_ms, dead })
    }

    async fn reap_holder(&self, holder: &str, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        self.reap_dead(holder, now).await
    }

    async fn retire_node(&self, holder: &str) -> Result<(), LedgerError> {
        sqlx::query("UPDATE nodes SET beat_at = 0, dead_after = 1 WHERE holder = $1")
            .bind(holder)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn commit_batches(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        // Lock order is fixed, but two calls racing for one order id (or the database's own
        // choices) can still end in a deadlock; the victim runs again.
        let mut attempt = 0;
        loop {
            match self.try_commit_batches(batches).await {
                Err(e) if is_deadlock(&e) && attempt < 2 => {
                    attempt += 1;
                    tracing::warn!(
                        attempt,
                        batches = batches.len(),
                        "merged commit deadlocked; retrying"
                    );
                }
                other => return other,
            }
        }
    }

    async fn find_orders(&self, order_ids: &[String]) -> Result<Vec<Reservation>, LedgerError> {
        let rows = sqlx::query(&format!(
            "SELECT {RESERVATION_COLUMNS} FROM reservations WHERE order_id = ANY($1)"
        ))
        .bind(order_ids)
        .fetch_all(&self.pool)
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
    ) -> Result<Vec<LiveUnits>, LedgerError> {
        // Only the active leases are read (a partial index); `reserved`, which this schema
        // derives from every lease ever granted, follows from the accounting equation instead:
        // total = free + leased unused + reserved + confirmed (the reconciler checks it).
        let rows: Vec<(String, i64, i64, i64, i64, i64, i64)> = sqlx::query_as(
            "SELECT v.code, v.total_limit, v.free, a.unused, \
             v.total_limit - v.free - a.unused - v.confirmed, v.confirmed, v.released \
             FROM vouchers v CROSS JOIN LATERAL ( \
                 SELECT COALESCE(SUM(l.granted - l.consumed), 0)::BIGINT AS unused FROM leases l \
                 WHERE l.voucher_code = v.code AND l.state = 'ACTIVE') a \
             WHERE v.starts_at <= $1 AND v.ends_at > $2",
        )
        .bind(now)
        .bind(ending_after)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(super::rows::live_units_from).collect())
    }

    async fn starting_between(&self, from: Millis, to: Millis) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(STARTING_SQL)
            .bind(from)
            .bind(to)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn switches(&self) -> Result<Switches, LedgerError> {
        let row = sqlx::query_as(SWITCHES_SQL).fetch_one(&self.pool).await?;
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
            .fetch_one(&self.pool)
            .await?;
        Ok(switches_from(row))
    }

    async fn won_orders(&self, code: &str) -> Result<Vec<(String, i64)>, LedgerError> {
        Ok(sqlx::query_as(
            "SELECT order_id, customer_id FROM reservations \
             WHERE voucher_code = $1 AND status <> 'RELEASED'",
        )
        .bind(code)
        .fetch_all(&self.pool)
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
        .fetch_all(&self.pool)
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
                .fetch_all(&self.pool)
                .await?;
        Ok(group_restocks(rows))
    }

    async fn reap_expired(&self, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        self.close_leases(Closing::ExpiredBy(now), now).await
    }

    async fn counters(&self, code: &str) -> Result<Option<Counters>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .execute(&mut *tx)
            .await?;
        let head: Option<(i64, i64, i64, i64, i64)> = sqlx::query_as(
            "SELECT total_limit, free, confirmed, released, closed_consumed \
             FROM vouchers WHERE code = $1",
        )
        .bind(code)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((total_limit, free, confirmed, released, kept_closed)) = head else {
            return Ok(None);
        };
        let by_status: Vec<(String, i64)> = sqlx::query_as(
            "SELECT status, COUNT(*) FROM reservations WHERE voucher_code = $1 GROUP BY status",
        )
        .bind(code)
        .fetch_all(&mut *tx)
        .await?;
        let (leased_unused, consumed, closed): (i64, i64, i64) = sqlx::query_as(
            "SELECT COALESCE(SUM(CASE WHEN state = 'ACTIVE' THEN granted - consumed ELSE 0 END), 0)::BIGINT, \
             COALESCE(SUM(consumed), 0)::BIGINT, \
             COALESCE(SUM(consumed) FILTER (WHERE state <> 'ACTIVE'), 0)::BIGINT \
             FROM leases WHERE voucher_code = $1",
        )
        .bind(code)
        .fetch_one(&mut *tx)
        .await?;
        let usage: i64 = sqlx::query_scalar(
            "SELECT COALESCE(SUM(used), 0)::BIGINT FROM customer_usage WHERE voucher_code = $1",
        )
        .bind(code)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        // Units taken by batches, less those confirmed or released since (see the migration).
        let reserved = consumed - confirmed - released;
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
            &by_status,
            consumed,
            usage,
        );
        // The grant check reads closed leases' consumption from the voucher row (migration 10):
        // a copy that drifted from the leases would weaken DESIGN §3's last line unseen.
        if kept_closed != closed {
            tracing::error!(
                code,
                kept_closed,
                closed,
                "vouchers.closed_consumed disagrees with the closed leases"
            );
            counters.balanced = false;
        }
        Ok(Some(counters))
    }

    async fn feed_origin(&self) -> Result<String, LedgerError> {
        Ok(sqlx::query_scalar(FEED_ORIGIN_SQL)
            .fetch_one(&self.pool)
            .await?)
    }

    async fn events(&self, after: i64, limit: i64) -> Result<Vec<FeedEvent>, LedgerError> {
        let rows: Vec<EventRow> = sqlx::query_as(EVENTS_SQL)
            .bind(after)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        rows.into_iter().map(event_from).collect()
    }

    async fn voucher_codes(&self, ending_after: Millis) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(LIVE_CODES_SQL)
            .bind(ending_after)
            .fetch_all(&self.pool)
            .await?)
    }
}

impl PostgresLedger {
    /// One merged transaction: one call of `vouchers_commit_batches_v2` (one round trip, its own
    /// transaction) for the batches of distinct vouchers and order ids; then, only when another
    /// transaction stored one of the order ids meanwhile, one read of those rows.
    ///
    /// Batches that share a voucher or an order id go in later calls, one after the other, each
    /// its own transaction: a call holds the change feed's head (its last lock) until it
    /// commits, so a second call in the same transaction would take lease and usage locks after
    /// the head and could deadlock with every other writer. A later call that fails fails only
    /// its own batches; the outer error means the first call failed and nothing committed.
    async fn try_commit_batches(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        let groups = independent_groups(batches);
        let mut verdicts: Vec<Result<Vec<Verdict>, LedgerError>> = Vec::with_capacity(groups.len());
        for (k, group) in groups.iter().enumerate() {
            let mut res = call_merged(&self.pool, batches, group).await;
            if k > 0 && matches!(&res, Err(e) if is_deadlock(e)) {
                // A deadlock victim ran nothing: once more (the first call's is retried by
                // `commit_batches`).
                res = call_merged(&self.pool, batches, group).await;
            }
            match res {
                Err(e) if k == 0 => return Err(e),
                other => verdicts.push(other),
            }
        }
        let lost: Vec<String> = verdicts
            .iter()
            .flatten()
            .flatten()
            .filter(|v| v.verdict == "LOST")
            .map(|v| v.order_id.clone())
            .collect();
        // Committed already: a failed read of the rows another transaction stored fails only
        // the batches that needed it, never the transaction's answer to the others.
        let stored = if lost.is_empty() {
            Ok(Vec::new())
        } else {
            self.find_orders(&lost).await
        };
        let mut results: Vec<Option<Result<Vec<RowOutcome>, LedgerError>>> =
            batches.iter().map(|_| None).collect();
        for (group, rows) in groups.iter().zip(verdicts) {
            let mut rows = match rows {
                Ok(rows) => rows.into_iter(),
                Err(e) => {
                    tracing::warn!(error = %e, "a later call of a merged commit failed");
                    let failed = Arc::new(e);
                    for &i in group {
                        results[i] = Some(Err(LedgerError::CommitFailed(failed.clone())));
                    }
                    continue;
                }
            };
            for &i in group {
                let batch = &batches[i];
                let mine: Vec<Verdict> = rows.by_ref().take(batch.rows.len()).collect();
                results[i] = Some(match &stored {
                    Err(_) if mine.iter().any(|v| v.verdict == "LOST") => {
                        Err(LedgerError::Invalid("stored orders could not be read back"))
                    }
                    Err(_) => resolve_verdicts(batch, mine, &[]),
                    Ok(stored) => resolve_verdicts(batch, mine, stored),
                });
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.unwrap_or(Err(LedgerError::Invalid("batch left out of the merge"))))
            .collect())
    }

    /// Returns or reaps leases, in a transaction of their own.
    async fn close_leases(
        &self,
        which: Closing<'_>,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let restocks = close_leases_in(&mut tx, which, now).await?;
        tx.commit().await?;
        Ok(restocks)
    }

    /// Reaps the leases of `holder` if it is still dead by its own limit (it may have beaten
    /// since it was listed): its row goes, and its leases close, in one transaction. Another
    /// node reaping the same holder holds its row: this one skips it (no queue of reapers).
    /// Locks: the holder's row, then as [`close_leases_in`].
    async fn reap_dead(&self, holder: &str, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let gone: Option<String> = sqlx::query_scalar(&format!(
            "DELETE FROM nodes WHERE holder = \
                 (SELECT holder FROM nodes \
                  WHERE holder = $1 AND beat_at < {LEDGER_NOW} - dead_after \
                  FOR UPDATE SKIP LOCKED) \
             RETURNING holder"
        ))
        .bind(holder)
        .fetch_optional(&mut *tx)
        .await?;
        if gone.is_none() {
            return Ok(Vec::new());
        }
        let restocks = close_leases_in(&mut tx, Closing::Dead(holder), now).await?;
        tx.commit().await?;
        let units: i64 = restocks.iter().map(|r| r.units).sum();
        tracing::warn!(
            holder,
            units,
            "reaped the leases of a holder that stopped beating"
        );
        Ok(restocks)
    }
}

/// The ledger's clock, in milliseconds since the epoch: liveness is judged on it, so no node's
/// own clock can make a live holder look dead.
const LEDGER_NOW: &str = "(extract(epoch from clock_timestamp()) * 1000)::BIGINT";

/// Returns or reaps leases: their vouchers are locked first (in code order), then the leases
/// close and their unused units go back to `free`.
async fn close_leases_in(
    tx: &mut Tx,
    which: Closing<'_>,
    now: Millis,
) -> Result<Vec<Restock>, LedgerError> {
    let (id, node, expired_by) = which.params();
    let codes: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT DISTINCT voucher_code FROM leases WHERE {LEASE_FILTER} ORDER BY voucher_code"
    ))
    .bind(id)
    .bind(&node)
    .bind(expired_by)
    .fetch_all(&mut **tx)
    .await?;
    if codes.is_empty() {
        return Ok(Vec::new());
    }
    lock_vouchers(tx, &codes).await?;
    // Then the leases, in id order, as a merged commit locks them (no deadlock).
    sqlx::query(&format!(
        "SELECT id FROM leases WHERE {LEASE_FILTER} AND voucher_code = ANY($4) \
         ORDER BY id FOR UPDATE"
    ))
    .bind(id)
    .bind(&node)
    .bind(expired_by)
    .bind(&codes)
    .execute(&mut **tx)
    .await?;
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "UPDATE leases SET state = $4, closed_at = $5 \
         WHERE {LEASE_FILTER} AND voucher_code = ANY($6) \
         RETURNING voucher_code, granted - consumed"
    ))
    .bind(id)
    .bind(&node)
    .bind(expired_by)
    .bind(which.state())
    .bind(now)
    .bind(&codes)
    .fetch_all(&mut **tx)
    .await?;
    give_back(tx, rows).await
}

/// PostgreSQL chose this call as a deadlock's victim (it ran nothing).
fn is_deadlock(e: &LedgerError) -> bool {
    matches!(e, LedgerError::Database { code: Some(c), .. } if c == "40P01")
}

/// Puts the unused units of closed leases back to `free`.
async fn give_back(tx: &mut Tx, rows: Vec<(String, i64)>) -> Result<Vec<Restock>, LedgerError> {
    let restocks = group_restocks(rows);
    if !restocks.is_empty() {
        let (codes, units): (Vec<String>, Vec<i64>) = restocks
            .iter()
            .map(|r| (r.voucher_code.clone(), r.units))
            .unzip();
        sqlx::query(
            "UPDATE vouchers SET free = free + d.units \
             FROM UNNEST($1::text[], $2::bigint[]) AS d (code, units) WHERE vouchers.code = d.code",
        )
        .bind(&codes)
        .bind(&units)
        .execute(&mut **tx)
        .await?;
    }
    Ok(restocks)
}

/// Batch indexes split into groups in which no voucher and no order id appears in two batches
/// (the precondition of `vouchers_commit_batches_v2`). The node's committer sends each voucher
/// once per transaction, so this is one group in slice order unless two vouchers' batches
/// share an order id.
fn independent_groups(batches: &[Batch]) -> Vec<Vec<usize>> {
    struct Group<'a> {
        codes: HashSet<&'a str>,
        orders: HashSet<&'a str>,
        members: Vec<usize>,
    }
    let mut groups: Vec<Group> = Vec::new();
    for (i, b) in batches.iter().enumerate() {
        let fits = |g: &Group| {
            !g.codes.contains(b.voucher_code.as_str())
                && b.rows
                    .iter()
                    .all(|r| !g.orders.contains(r.order_id.as_str()))
        };
        // A batch goes after every group it clashes with, so the slice order holds.
        let last_clash = groups.iter().rposition(|g| !fits(g));
        let at = match last_clash {
            Some(j) => j + 1,
            None => 0,
        };
        if at == groups.len() {
            groups.push(Group {
                codes: HashSet::new(),
                orders: HashSet::new(),
                members: Vec::new(),
            });
        }
        let g = &mut groups[at];
        g.codes.insert(&b.voucher_code);
        g.orders.extend(b.rows.iter().map(|r| r.order_id.as_str()));
        g.members.push(i);
    }
    groups.into_iter().map(|g| g.members).collect()
}

/// The function's answer for one row.
#[derive(Debug)]
struct Verdict {
    order_id: String,
    verdict: String,
    discount: Option<i64>,
    /// The stored reservation that answers a `REPLAYED` row.
    stored: Option<(String, i64, String, i64)>,
}

/// Calls `vouchers_commit_batches_v2` for the batches `group` names, in one round trip.
async fn call_merged<'e, E>(
    ex: E,
    batches: &[Batch],
    group: &[usize],
) -> Result<Vec<Verdict>, LedgerError>
where
    E: sqlx::Executor<'e, Database = Postgres>,
{
    let n_rows: usize = group.iter().map(|&i| batches[i].rows.len()).sum();
    let (mut leases, mut codes, mut nows, mut expires) = (
        Vec::with_capacity(group.len()),
        Vec::with_capacity(group.len()),
        Vec::with_capacity(group.len()),
        Vec::with_capacity(group.len()),
    );
    let (mut row_batch, mut orders, mut customers) = (
        Vec::with_capacity(n_rows),
        Vec::with_capacity(n_rows),
        Vec::with_capacity(n_rows),
    );
    for (pos, &i) in group.iter().enumerate() {
        let b = &batches[i];
        leases.push(b.lease_id);
        codes.push(b.voucher_code.as_str());
        nows.push(b.now);
        expires.push(b.expires_at);
        for row in &b.rows {
            row_batch.push(pos as i32 + 1);
            orders.push(row.order_id.as_str());
            customers.push(row.customer_id);
        }
    }
    type Out = (
        i32,
        String,
        Option<i64>,
        Option<String>,
        Option<i64>,
        Option<String>,
        Option<i64>,
    );
    let out: Vec<Out> = sqlx::query_as(
        "SELECT out_idx, out_verdict, out_discount, out_voucher, out_customer, out_status, \
         out_expires FROM vouchers_commit_batches_v2($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(&leases)
    .bind(&codes)
    .bind(&nows)
    .bind(&expires)
    .bind(&row_batch)
    .bind(&orders)
    .bind(&customers)
    .fetch_all(ex)
    .await?;
    if out.len() != n_rows {
        return Err(LedgerError::database(
            "merged commit returned the wrong number of rows",
        ));
    }
    Ok(out
        .into_iter()
        .map(
            |(idx, verdict, discount, voucher, customer, status, expires)| {
                let stored = match (voucher, customer, status, expires) {
                    (Some(v), Some(c), Some(s), Some(e)) => Some((v, c, s, e)),
                    _ => None,
                };
                Verdict {
                    order_id: orders
                        .get((idx as usize).wrapping_sub(1))
                        .map(|o| o.to_string())
                        .unwrap_or_default(),
                    verdict,
                    discount,
                    stored,
                }
            },
        )
        .collect())
}

/// Turns one batch's verdicts into its outcomes (or its refusal as a whole).
fn resolve_verdicts(
    batch: &Batch,
    verdicts: Vec<Verdict>,
    stored: &[Reservation],
) -> Result<Vec<RowOutcome>, LedgerError> {
    if verdicts.len() != batch.rows.len() {
        return Err(LedgerError::Invalid("merged commit lost rows of a batch"));
    }
    if verdicts.iter().any(|v| v.verdict == "FENCED") {
        return Err(LedgerError::Fenced);
    }
    if verdicts.iter().any(|v| v.verdict == "NOT_FOUND") {
        return Err(LedgerError::NotFound);
    }
    let code = batch.voucher_code.as_str();
    let mut plan = Vec::with_capacity(verdicts.len());
    let mut won = Vec::new();
    let mut discount = 0;
    for (i, v) in verdicts.into_iter().enumerate() {
        let row = &batch.rows[i];
        let planned = match v.verdict.as_str() {
            "INSERT" => {
                won.push(i);
                discount = v.discount.unwrap_or(discount);
                Planned::Insert
            }
            "REPLAYED" => match (v.stored, v.discount) {
                (Some((voucher_code, customer_id, status, expires_at)), Some(discount_amount)) => {
                    Planned::Replay(Reservation {
                        order_id: row.order_id.clone(),
                        voucher_code,
                        customer_id,
                        discount_amount,
                        status: ReservationStatus::parse(&status)
                            .ok_or(LedgerError::Invalid("stored reservation status"))?,
                        expires_at,
                    })
                }
                _ => return Err(LedgerError::Invalid("replay without its stored row")),
            },
            "SAME" => match batch.rows[..i]
                .iter()
                .position(|r| r.order_id == row.order_id)
            {
                Some(j) => Planned::SameAs(j),
                None => Planned::AlreadyUsed,
            },
            "LOST" => match stored.iter().find(|r| r.order_id == row.order_id) {
                Some(r) if r.is_retry_of(code, row.customer_id, batch.now) => {
                    Planned::Replay(r.clone())
                }
                _ => Planned::AlreadyUsed,
            },
            "PAUSED" => Planned::NotEligible(Ineligible::Paused),
            "NOT_STARTED" => Planned::NotEligible(Ineligible::NotStarted),
            "ENDED" => Planned::NotEligible(Ineligible::Ended),
            _ => Planned::AlreadyUsed,
        };
        plan.push(planned);
    }
    let created = super::created_rows(batch, won, discount);
    Ok(resolve_plan(plan, &created))
}

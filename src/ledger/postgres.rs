//! The cluster ledger: PostgreSQL through sqlx. Every node talks to the same database.
//!
//! Concurrency: a batch locks only what it draws on: its own lease row (the fence) and the usage
//! rows of its customers (in customer order), so batches of different nodes run side by side.
//! Order ids are settled by the primary key (`ON CONFLICT DO NOTHING`; a row that lost a race is
//! re-read and answered as a replay or `ALREADY_USED`). Everything that moves units between
//! `free` and leases or reservations (grant, return, reap, release, expiry, confirm, edits)
//! locks the voucher row first, in code order when several. Batches never touch the voucher
//! row: `reserved` is derived from the leases (see the migration). A batch costs a fixed number
//! of round trips however many rows it holds: rows travel as arrays (`UNNEST`, `= ANY`).

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Row, Transaction};

use super::rows::{
    group_restocks, reservation_from, voucher_from, LIVE_CODES_SQL, RESERVATION_COLUMNS,
    VOUCHER_COLUMNS, VOUCHER_STOCK_SQL,
};
use super::{
    plan_batch, resolve_plan, Batch, Closing, Counters, Grant, Lease, Ledger, LedgerError, Planned,
    Restock, RowOutcome, LEASE_FILTER,
};
use crate::clock::Millis;
use crate::domain::{Reservation, Voucher, VoucherPatch};

const MIGRATIONS: &[(i64, &str)] = &[(1, include_str!("../../migrations/postgres/0001_init.sql"))];

/// An arbitrary constant that names this schema's migration lock.
const MIGRATION_LOCK: i64 = 0x766f_7563_6865_7273;

pub struct PostgresLedger {
    pool: PgPool,
}

impl PostgresLedger {
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

    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, sqlx::Error> {
        // Tables grow from empty within seconds of a sale starting: a generic plan cached while
        // they were tiny (a sequential scan) would stay for the life of the connection. Custom
        // plans see the real table size every time.
        let options =
            PgConnectOptions::from_str(url)?.options([("plan_cache_mode", "force_custom_plan")]);
        let pool = PgPoolOptions::new()
            .max_connections(max_connections.max(2))
            .acquire_timeout(Duration::from_secs(1))
            .connect_with(options)
            .await?;
        migrate(&pool).await?;
        Ok(Self { pool })
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
             per_user_limit, starts_at, ends_at, status, free, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $4, $9)",
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
        .execute(&self.pool)
        .await;
        super::insert_unique(res)
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
            "UPDATE vouchers SET status = $1, ends_at = $2, total_limit = $3, free = free + $4 \
             WHERE code = $5",
        )
        .bind(next.status.as_str())
        .bind(next.ends_at)
        .bind(next.total_limit)
        .bind(added)
        .bind(code)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        let restock = (added > 0).then(|| Restock {
            voucher_code: code.into(),
            units: added,
        });
        Ok((next, restock))
    }

    async fn grant(
        &self,
        code: &str,
        node: &str,
        want: i64,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Grant, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let free: i64 = sqlx::query_scalar("SELECT free FROM vouchers WHERE code = $1 FOR UPDATE")
            .bind(code)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(LedgerError::NotFound)?;
        let units = want.max(1).min(free);
        let (leased_unused, lease): (i64, Option<Lease>) = if units > 0 {
            let expires_at = now + ttl_ms;
            let (unused, id): (i64, i64) = sqlx::query_as(
                "WITH taken AS (UPDATE vouchers SET free = free - $2 WHERE code = $1), \
                      unused AS (SELECT COALESCE(SUM(granted - consumed), 0)::BIGINT AS n \
                                 FROM leases WHERE voucher_code = $1 AND state = 'ACTIVE') \
                 INSERT INTO leases (voucher_code, node_id, granted, consumed, state, granted_at, \
                                     expires_at) \
                 SELECT $1, $3, $2, 0, 'ACTIVE', $4, $5 FROM unused RETURNING (SELECT n FROM unused), id",
            )
            .bind(code)
            .bind(units)
            .bind(node)
            .bind(now)
            .bind(expires_at)
            .fetch_one(&mut *tx)
            .await?;
            (
                unused,
                Some(Lease {
                    id,
                    granted: units,
                    expires_at,
                }),
            )
        } else {
            let unused: i64 = sqlx::query_scalar(
                "SELECT COALESCE(SUM(granted - consumed), 0)::BIGINT FROM leases \
                 WHERE voucher_code = $1 AND state = 'ACTIVE'",
            )
            .bind(code)
            .fetch_one(&mut *tx)
            .await?;
            (unused, None)
        };
        tx.commit().await?;
        Ok(Grant {
            lease,
            free_after: free - units,
            leased_unused,
        })
    }

    async fn renew(
        &self,
        lease_ids: &[i64],
        node: &str,
        now: Millis,
        ttl_ms: i64,
    ) -> Result<Vec<i64>, LedgerError> {
        Ok(sqlx::query_scalar(
            "UPDATE leases SET expires_at = $1 \
             WHERE id = ANY($2) AND node_id = $3 AND state = 'ACTIVE' RETURNING id",
        )
        .bind(now + ttl_ms)
        .bind(lease_ids)
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

    async fn commit_batch(&self, batch: &Batch) -> Result<Vec<RowOutcome>, LedgerError> {
        // Locks are taken in a fixed order, but two vouchers racing for one order id (or the
        // database's own choices) can still end in a deadlock; the victim's batch runs again.
        let mut attempt = 0;
        loop {
            match self.try_commit_batch(batch).await {
                Err(LedgerError::Unavailable(sqlx::Error::Database(e)))
                    if e.code().as_deref() == Some("40P01") && attempt < 2 =>
                {
                    attempt += 1;
                    tracing::warn!(code = %batch.voucher_code, attempt, "batch deadlocked; retrying");
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

    async fn won_orders(&self, code: &str) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT order_id FROM reservations WHERE voucher_code = $1 AND status <> 'RELEASED'",
        )
        .bind(code)
        .fetch_all(&self.pool)
        .await?)
    }

    // Confirm, release and expiry are one statement each: the reservation row first (its status
    // guards "exactly once"), then the voucher's counters and the customer's usage. Batches never
    // lock the voucher row and these never lock leases, so no lock order can cross.
    async fn confirm(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<Reservation, LedgerError> {
        let row = sqlx::query(&format!(
            "WITH c AS ( \
               UPDATE reservations SET status = 'CONFIRMED', updated_at = $1 \
               WHERE order_id = $2 AND voucher_code = $3 AND status = 'RESERVED' \
                 AND expires_at > $1 \
               RETURNING {RESERVATION_COLUMNS}), \
             v AS (UPDATE vouchers SET confirmed = confirmed + 1 \
                   WHERE code = $3 AND EXISTS (SELECT 1 FROM c)) \
             SELECT {RESERVATION_COLUMNS} FROM c"
        ))
        .bind(now)
        .bind(order_id)
        .bind(code)
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => Ok(reservation_from(&row)?),
            None => super::confirm_unchanged(self.load_reservation(code, order_id).await?),
        }
    }

    async fn release(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<(Reservation, Option<Restock>), LedgerError> {
        let row = sqlx::query(&format!(
            "WITH r AS ( \
               UPDATE reservations SET status = 'RELEASED', updated_at = $1 \
               WHERE order_id = $2 AND voucher_code = $3 AND status = 'RESERVED' \
               RETURNING {RESERVATION_COLUMNS}), \
             v AS (UPDATE vouchers SET free = free + 1, released = released + 1 \
                   WHERE code = $3 AND EXISTS (SELECT 1 FROM r)), \
             u AS (UPDATE customer_usage SET used = used - 1 \
                   WHERE voucher_code = $3 AND customer_id = (SELECT customer_id FROM r)) \
             SELECT {RESERVATION_COLUMNS} FROM r"
        ))
        .bind(now)
        .bind(order_id)
        .bind(code)
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(row) => {
                let r = reservation_from(&row)?;
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
        // SKIP LOCKED: sweepers on several nodes take disjoint rows; the status guard makes each
        // release happen once even against a concurrent confirm or release.
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "WITH due AS ( \
               SELECT order_id FROM reservations WHERE status = 'RESERVED' AND expires_at <= $1 \
               ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED), \
             r AS ( \
               UPDATE reservations SET status = 'RELEASED', updated_at = $1 \
               WHERE order_id IN (SELECT order_id FROM due) AND status = 'RESERVED' \
               RETURNING voucher_code, customer_id), \
             per_v AS (SELECT voucher_code, COUNT(*) AS n FROM r GROUP BY voucher_code), \
             v AS (UPDATE vouchers SET free = free + per_v.n, released = released + per_v.n \
                   FROM per_v WHERE vouchers.code = per_v.voucher_code), \
             per_c AS (SELECT voucher_code, customer_id, COUNT(*) AS n FROM r \
                       GROUP BY voucher_code, customer_id), \
             u AS (UPDATE customer_usage SET used = used - per_c.n FROM per_c \
                   WHERE customer_usage.voucher_code = per_c.voucher_code \
                     AND customer_usage.customer_id = per_c.customer_id) \
             SELECT voucher_code, n::BIGINT FROM per_v",
        )
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
        let head: Option<(i64, i64, i64, i64)> = sqlx::query_as(
            "SELECT total_limit, free, confirmed, released FROM vouchers WHERE code = $1",
        )
        .bind(code)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((total_limit, free, confirmed, released)) = head else {
            return Ok(None);
        };
        let by_status: Vec<(String, i64)> = sqlx::query_as(
            "SELECT status, COUNT(*) FROM reservations WHERE voucher_code = $1 GROUP BY status",
        )
        .bind(code)
        .fetch_all(&mut *tx)
        .await?;
        let (leased_unused, consumed): (i64, i64) = sqlx::query_as(
            "SELECT COALESCE(SUM(CASE WHEN state = 'ACTIVE' THEN granted - consumed ELSE 0 END), 0)::BIGINT, \
             COALESCE(SUM(consumed), 0)::BIGINT FROM leases WHERE voucher_code = $1",
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
        Ok(Some(super::reconcile(
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
        )))
    }

    async fn voucher_codes(&self, ending_after: Millis) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(LIVE_CODES_SQL)
            .bind(ending_after)
            .fetch_all(&self.pool)
            .await?)
    }
}

impl PostgresLedger {
    async fn try_commit_batch(&self, batch: &Batch) -> Result<Vec<RowOutcome>, LedgerError> {
        let code = batch.voucher_code.as_str();
        let mut customers: Vec<i64> = batch.rows.iter().map(|r| r.customer_id).collect();
        customers.sort_unstable();
        customers.dedup();
        let mut tx = self.pool.begin().await?;
        // The customers' usage rows are created if missing (in customer order, so two batches
        // sharing customers cannot deadlock), and the fence: this node's lease, locked for the
        // batch, must still be ACTIVE.
        type Head = (i64, i64, i64, String, i64, i64);
        let head: Option<Head> = sqlx::query_as(
            "WITH missing AS ( \
               INSERT INTO customer_usage (voucher_code, customer_id, used) \
               SELECT $2, c, 0 FROM UNNEST($3::bigint[]) AS t (c) ORDER BY c \
               ON CONFLICT (voucher_code, customer_id) DO NOTHING) \
             SELECT l.granted - l.consumed, v.per_user_limit, v.discount_amount, \
                    v.status, v.starts_at, v.ends_at \
             FROM leases l JOIN vouchers v ON v.code = l.voucher_code \
             WHERE l.id = $1 AND l.voucher_code = $2 AND l.state = 'ACTIVE' FOR UPDATE OF l",
        )
        .bind(batch.lease_id)
        .bind(code)
        .bind(&customers)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((room, per_user_limit, discount, status, starts_at, ends_at)) = head else {
            return Err(LedgerError::Fenced);
        };
        // Lock the usage rows (in customer order), then read the stored orders: a new statement,
        // so it sees what a same-customer batch that held those locks committed (its snapshot
        // is taken after the locks are granted).
        let used: HashMap<i64, i64> = sqlx::query_as(
            "SELECT customer_id, used FROM customer_usage \
             WHERE voucher_code = $1 AND customer_id = ANY($2) ORDER BY customer_id FOR UPDATE",
        )
        .bind(code)
        .bind(&customers)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .collect();
        let order_ids: Vec<String> = batch.rows.iter().map(|r| r.order_id.clone()).collect();
        let existing = orders_in(&mut tx, &order_ids).await?;

        let blocked = super::refuses_new(&status, starts_at, ends_at, batch.now);
        let plan = plan_batch(code, &batch.rows, &existing, &used, per_user_limit, blocked);
        let planned: Vec<usize> = plan
            .iter()
            .enumerate()
            .filter(|(_, p)| matches!(p, Planned::Insert))
            .map(|(i, _)| i)
            .collect();
        if planned.len() as i64 > room {
            return Err(LedgerError::Fenced);
        }
        let mut plan = plan;
        let mut created = HashMap::new();
        if !planned.is_empty() {
            let ids: Vec<&str> = planned
                .iter()
                .map(|&i| batch.rows[i].order_id.as_str())
                .collect();
            let custs: Vec<i64> = planned.iter().map(|&i| batch.rows[i].customer_id).collect();
            // One statement writes the batch: the rows (sorted by order id, so racing inserts of
            // the same ids wait in one order; an id stored meanwhile is skipped), the lease's
            // consumed units and the customers' usage.
            let inserted: HashSet<String> = sqlx::query_scalar(
                "WITH ins AS ( \
                   INSERT INTO reservations (order_id, voucher_code, customer_id, lease_id, \
                     discount_amount, status, created_at, expires_at, updated_at) \
                   SELECT o, $3, c, $4, $5, 'RESERVED', $6, $7, $6 \
                   FROM UNNEST($1::text[], $2::bigint[]) AS t (o, c) ORDER BY o \
                   ON CONFLICT (order_id) DO NOTHING RETURNING order_id, customer_id), \
                 lease AS ( \
                   UPDATE leases SET consumed = consumed + (SELECT COUNT(*) FROM ins) WHERE id = $4), \
                 usage AS ( \
                   UPDATE customer_usage u SET used = u.used + d.n \
                   FROM (SELECT customer_id, COUNT(*) AS n FROM ins GROUP BY customer_id) d \
                   WHERE u.voucher_code = $3 AND u.customer_id = d.customer_id) \
                 SELECT order_id FROM ins",
            )
            .bind(&ids)
            .bind(&custs)
            .bind(code)
            .bind(batch.lease_id)
            .bind(discount)
            .bind(batch.now)
            .bind(batch.expires_at)
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .collect();
            // Rows whose id another batch stored meanwhile: the stored row answers them.
            let lost: Vec<String> = planned
                .iter()
                .map(|&i| batch.rows[i].order_id.clone())
                .filter(|o| !inserted.contains(o))
                .collect();
            if !lost.is_empty() {
                let stored = orders_in(&mut tx, &lost).await?;
                for &i in &planned {
                    if let Some(r) = stored.iter().find(|r| r.order_id == batch.rows[i].order_id) {
                        plan[i] = if r.is_retry_of(code, batch.rows[i].customer_id) {
                            Planned::Replay(r.clone())
                        } else {
                            Planned::AlreadyUsed
                        };
                    }
                }
            }
            let won = planned
                .into_iter()
                .filter(|&i| inserted.contains(&batch.rows[i].order_id));
            created = super::created_rows(batch, won, discount);
        }
        tx.commit().await?;
        Ok(resolve_plan(plan, &created))
    }

    /// Returns or reaps leases: their vouchers are locked first (in code order), then the
    /// leases close and their unused units go back to `free`.
    async fn close_leases(
        &self,
        which: Closing<'_>,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        let (id, node, expired_by) = which.params();
        let mut tx = self.pool.begin().await?;
        let codes: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT DISTINCT voucher_code FROM leases WHERE {LEASE_FILTER} ORDER BY voucher_code"
        ))
        .bind(id)
        .bind(&node)
        .bind(expired_by)
        .fetch_all(&mut *tx)
        .await?;
        if codes.is_empty() {
            return Ok(Vec::new());
        }
        lock_vouchers(&mut tx, &codes).await?;
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
        .fetch_all(&mut *tx)
        .await?;
        let restocks = give_back(&mut tx, rows).await?;
        tx.commit().await?;
        Ok(restocks)
    }
}

/// The stored reservations with these order ids, inside a transaction.
async fn orders_in(tx: &mut Tx, order_ids: &[String]) -> Result<Vec<Reservation>, LedgerError> {
    let rows = sqlx::query(&format!(
        "SELECT {RESERVATION_COLUMNS} FROM reservations WHERE order_id = ANY($1)"
    ))
    .bind(order_ids)
    .fetch_all(&mut **tx)
    .await?;
    Ok(rows
        .iter()
        .map(reservation_from)
        .collect::<Result<_, _>>()?)
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

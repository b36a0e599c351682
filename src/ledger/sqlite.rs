//! The embedded single-node ledger: SQLite through sqlx, in WAL mode with `synchronous = FULL`, so
//! a committed batch survives a crash of the process or the machine.
//!
//! All writes go through one connection (SQLite has one writer anyway; a single writer also rules
//! out `SQLITE_BUSY` on lock upgrades), reads through a small pool of readers. Batches are set-based:
//! the rows travel as one JSON array and every statement works on the whole set through `json_each`.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use sqlx::Row;

use async_trait::async_trait;
use serde_json::json;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use super::rows::{
    group_restocks, per_customer, reservation_from, voucher_from, LIVE_CODES_SQL,
    RESERVATION_COLUMNS, VOUCHER_COLUMNS, VOUCHER_STOCK_SQL,
};
use super::{
    plan_batch, resolve_plan, usage_deltas, Batch, BatchResults, Closing, Counters, Grant, Lease,
    Ledger, LedgerError, Planned, Restock, RowOutcome, LEASE_FILTER,
};
use crate::clock::Millis;
use crate::domain::{Reservation, Voucher, VoucherPatch};

const MIGRATIONS: &[(i64, &str)] = &[(1, include_str!("../../migrations/sqlite/0001_init.sql"))];

pub struct SqliteLedger {
    /// The one connection every write goes through.
    writer: SqlitePool,
    reader: SqlitePool,
}

impl SqliteLedger {
    pub async fn connect(url: &str, readers: u32) -> Result<Self, sqlx::Error> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(5));
        if let Some(dir) = options.get_filename().parent() {
            if !dir.as_os_str().is_empty() {
                std::fs::create_dir_all(dir).map_err(sqlx::Error::Io)?;
            }
        }
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.clone())
            .await?;
        migrate(&writer).await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(readers.max(1))
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.read_only(true))
            .await?;
        Ok(Self { writer, reader })
    }
}

impl SqliteLedger {
    /// Returns or reaps leases; their unused units go back to `free`.
    async fn close_leases(
        &self,
        which: Closing<'_>,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        let (id, node, expired_by) = which.params();
        let mut tx = self.writer.begin().await?;
        let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
            "UPDATE leases SET state = $4, closed_at = $5 WHERE {LEASE_FILTER} \
             RETURNING voucher_code, granted - consumed"
        ))
        .bind(id)
        .bind(node)
        .bind(expired_by)
        .bind(which.state())
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        let restocks = give_back(&mut tx, rows).await?;
        tx.commit().await?;
        Ok(restocks)
    }
}

async fn migrate(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY)")
        .execute(pool)
        .await?;
    for (version, sql) in MIGRATIONS {
        let mut tx = pool.begin().await?;
        let done = sqlx::query("SELECT 1 FROM schema_migrations WHERE version = ?")
            .bind(version)
            .fetch_optional(&mut *tx)
            .await?;
        if done.is_none() {
            sqlx::raw_sql(sql).execute(&mut *tx).await?;
            sqlx::query("INSERT INTO schema_migrations (version) VALUES (?)")
                .bind(version)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
    }
    Ok(())
}

fn json_list<T: serde::Serialize>(items: &[T]) -> String {
    serde_json::to_string(items).unwrap_or_else(|_| "[]".into())
}

#[async_trait]
impl Ledger for SqliteLedger {
    async fn ping(&self) -> Result<(), LedgerError> {
        sqlx::query("SELECT 1").execute(&self.reader).await?;
        Ok(())
    }

    async fn create_voucher(&self, v: &Voucher, now: Millis) -> Result<(), LedgerError> {
        let res = sqlx::query(
            "INSERT INTO vouchers (code, discount_amount, min_order_amount, total_limit, \
             per_user_limit, starts_at, ends_at, status, free, created_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&v.code)
        .bind(v.discount_amount)
        .bind(v.min_order_amount)
        .bind(v.total_limit)
        .bind(v.per_user_limit)
        .bind(v.starts_at)
        .bind(v.ends_at)
        .bind(v.status.as_str())
        .bind(v.total_limit)
        .bind(now)
        .execute(&self.writer)
        .await;
        super::insert_unique(res)
    }

    async fn voucher(&self, code: &str) -> Result<Option<Voucher>, LedgerError> {
        let row = sqlx::query(&format!(
            "SELECT {VOUCHER_COLUMNS} FROM vouchers WHERE code = ?"
        ))
        .bind(code)
        .fetch_optional(&self.reader)
        .await?;
        Ok(row.as_ref().map(voucher_from).transpose()?)
    }

    async fn voucher_stock(&self, code: &str) -> Result<Option<(Voucher, i64)>, LedgerError> {
        let row = sqlx::query(VOUCHER_STOCK_SQL)
            .bind(code)
            .fetch_optional(&self.reader)
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
        let mut tx = self.writer.begin().await?;
        let row = sqlx::query(&format!(
            "SELECT {VOUCHER_COLUMNS} FROM vouchers WHERE code = ?"
        ))
        .bind(code)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(LedgerError::NotFound)?;
        let current = voucher_from(&row)?;
        let (next, added) = super::apply_patch(&current, patch)?;
        sqlx::query(
            "UPDATE vouchers SET status = ?, ends_at = ?, total_limit = ?, free = free + ? \
             WHERE code = ?",
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
        let mut tx = self.writer.begin().await?;
        let free: i64 = sqlx::query_scalar("SELECT free FROM vouchers WHERE code = ?")
            .bind(code)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(LedgerError::NotFound)?;
        let leased_unused: i64 = sqlx::query_scalar(
            "SELECT COALESCE(SUM(granted - consumed), 0) FROM leases \
             WHERE voucher_code = ? AND state = 'ACTIVE'",
        )
        .bind(code)
        .fetch_one(&mut *tx)
        .await?;
        let units = want.max(1).min(free);
        let lease = if units > 0 {
            sqlx::query("UPDATE vouchers SET free = free - ? WHERE code = ?")
                .bind(units)
                .bind(code)
                .execute(&mut *tx)
                .await?;
            let expires_at = now + ttl_ms;
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO leases (voucher_code, node_id, granted, consumed, state, granted_at, \
                 expires_at) VALUES (?, ?, ?, 0, 'ACTIVE', ?, ?) RETURNING id",
            )
            .bind(code)
            .bind(node)
            .bind(units)
            .bind(now)
            .bind(expires_at)
            .fetch_one(&mut *tx)
            .await?;
            Some(Lease {
                id,
                granted: units,
                expires_at,
            })
        } else {
            None
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
        let ids: Vec<i64> = sqlx::query_scalar(
            "UPDATE leases SET expires_at = ? WHERE state = 'ACTIVE' AND node_id = ? \
             AND id IN (SELECT value FROM json_each(?)) RETURNING id",
        )
        .bind(now + ttl_ms)
        .bind(node)
        .bind(json_list(lease_ids))
        .fetch_all(&self.writer)
        .await?;
        Ok(ids)
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

    async fn commit_batches(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        let mut tx = self.writer.begin().await?;
        let mut results = Vec::with_capacity(batches.len());
        for batch in batches {
            results.push(apply_batch(&mut tx, batch).await?);
        }
        tx.commit().await?;
        Ok(results)
    }

    async fn find_orders(&self, order_ids: &[String]) -> Result<Vec<Reservation>, LedgerError> {
        let rows = sqlx::query(&format!(
            "SELECT {RESERVATION_COLUMNS} FROM reservations \
             WHERE order_id IN (SELECT value FROM json_each(?))"
        ))
        .bind(json_list(order_ids))
        .fetch_all(&self.reader)
        .await?;
        Ok(rows
            .iter()
            .map(reservation_from)
            .collect::<Result<_, _>>()?)
    }

    async fn won_orders(&self, code: &str) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT order_id FROM reservations WHERE voucher_code = ? AND status <> 'RELEASED'",
        )
        .bind(code)
        .fetch_all(&self.reader)
        .await?)
    }

    async fn confirm(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<Reservation, LedgerError> {
        let mut tx = self.writer.begin().await?;
        let row = sqlx::query(&format!(
            "UPDATE reservations SET status = 'CONFIRMED', updated_at = ? \
             WHERE order_id = ? AND voucher_code = ? AND status = 'RESERVED' AND expires_at > ? \
             RETURNING {RESERVATION_COLUMNS}"
        ))
        .bind(now)
        .bind(order_id)
        .bind(code)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = row {
            sqlx::query(
                "UPDATE vouchers SET reserved = reserved - 1, confirmed = confirmed + 1 WHERE code = ?",
            )
            .bind(code)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(reservation_from(&row)?);
        }
        let current = load_reservation(&mut tx, code, order_id).await?;
        super::confirm_unchanged(current)
    }

    async fn release(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<(Reservation, Option<Restock>), LedgerError> {
        let mut tx = self.writer.begin().await?;
        let row = sqlx::query(&format!(
            "UPDATE reservations SET status = 'RELEASED', updated_at = ? \
             WHERE order_id = ? AND voucher_code = ? AND status = 'RESERVED' \
             RETURNING {RESERVATION_COLUMNS}"
        ))
        .bind(now)
        .bind(order_id)
        .bind(code)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = row {
            let r = reservation_from(&row)?;
            let restocks =
                release_units(&mut tx, &[(r.voucher_code.clone(), r.customer_id)]).await?;
            tx.commit().await?;
            return Ok((r, restocks.into_iter().next()));
        }
        let current = load_reservation(&mut tx, code, order_id).await?;
        super::release_unchanged(current)
    }

    async fn expire_due(&self, now: Millis, limit: i64) -> Result<Vec<Restock>, LedgerError> {
        let mut tx = self.writer.begin().await?;
        let released: Vec<(String, i64)> = sqlx::query_as(
            "UPDATE reservations SET status = 'RELEASED', updated_at = ? \
             WHERE order_id IN (SELECT order_id FROM reservations \
                                WHERE status = 'RESERVED' AND expires_at <= ? LIMIT ?) \
             AND status = 'RESERVED' RETURNING voucher_code, customer_id",
        )
        .bind(now)
        .bind(now)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        let restocks = release_units(&mut tx, &released).await?;
        tx.commit().await?;
        Ok(restocks)
    }

    async fn reap_expired(&self, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        self.close_leases(Closing::ExpiredBy(now), now).await
    }

    async fn counters(&self, code: &str) -> Result<Option<Counters>, LedgerError> {
        let mut tx = self.reader.begin().await?;
        let head: Option<(i64, i64, i64, i64, i64)> = sqlx::query_as(
            "SELECT total_limit, free, reserved, confirmed, released FROM vouchers WHERE code = ?",
        )
        .bind(code)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((total_limit, free, reserved, confirmed, released)) = head else {
            return Ok(None);
        };
        let by_status: Vec<(String, i64)> = sqlx::query_as(
            "SELECT status, COUNT(*) FROM reservations WHERE voucher_code = ? GROUP BY status",
        )
        .bind(code)
        .fetch_all(&mut *tx)
        .await?;
        let (leased_unused, consumed): (i64, i64) = sqlx::query_as(
            "SELECT COALESCE(SUM(CASE WHEN state = 'ACTIVE' THEN granted - consumed ELSE 0 END), 0), \
             COALESCE(SUM(consumed), 0) FROM leases WHERE voucher_code = ?",
        )
        .bind(code)
        .fetch_one(&mut *tx)
        .await?;
        let usage: i64 = sqlx::query_scalar(
            "SELECT COALESCE(SUM(used), 0) FROM customer_usage WHERE voucher_code = ?",
        )
        .bind(code)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
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
            .fetch_all(&self.reader)
            .await?)
    }
}

async fn load_reservation(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    code: &str,
    order_id: &str,
) -> Result<Reservation, LedgerError> {
    let row = sqlx::query(&format!(
        "SELECT {RESERVATION_COLUMNS} FROM reservations WHERE order_id = ? AND voucher_code = ?"
    ))
    .bind(order_id)
    .bind(code)
    .fetch_optional(&mut **tx)
    .await?
    .ok_or(LedgerError::NotFound)?;
    Ok(reservation_from(&row)?)
}

/// Puts the unused units of closed leases back to `free`.
async fn give_back(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    rows: Vec<(String, i64)>,
) -> Result<Vec<Restock>, LedgerError> {
    let restocks = group_restocks(rows);
    if !restocks.is_empty() {
        let list: Vec<(String, i64)> = restocks
            .iter()
            .map(|r| (r.voucher_code.clone(), r.units))
            .collect();
        sqlx::query(
            "UPDATE vouchers SET free = free + d.units FROM \
             (SELECT json_extract(value, '$[0]') AS code, json_extract(value, '$[1]') AS units \
              FROM json_each(?)) AS d WHERE vouchers.code = d.code",
        )
        .bind(json_list(&list))
        .execute(&mut **tx)
        .await?;
    }
    Ok(restocks)
}

/// Counter side of releasing reservations (already marked RELEASED): each unit back to `free`,
/// each customer's usage down by one.
async fn release_units(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    released: &[(String, i64)],
) -> Result<Vec<Restock>, LedgerError> {
    if released.is_empty() {
        return Ok(Vec::new());
    }
    let restocks = group_restocks(released.iter().map(|(c, _)| (c.clone(), 1)).collect());
    let list: Vec<(String, i64)> = restocks
        .iter()
        .map(|r| (r.voucher_code.clone(), r.units))
        .collect();
    sqlx::query(
        "UPDATE vouchers SET free = free + d.n, reserved = reserved - d.n, released = released + d.n \
         FROM (SELECT json_extract(value, '$[0]') AS code, json_extract(value, '$[1]') AS n \
               FROM json_each(?)) AS d WHERE vouchers.code = d.code",
    )
    .bind(json_list(&list))
    .execute(&mut **tx)
    .await?;
    let list = per_customer(released);
    sqlx::query(
        "UPDATE customer_usage SET used = used - d.n \
         FROM (SELECT json_extract(value, '$[0]') AS code, json_extract(value, '$[1]') AS customer, \
                      json_extract(value, '$[2]') AS n FROM json_each(?)) AS d \
         WHERE customer_usage.voucher_code = d.code AND customer_usage.customer_id = d.customer",
    )
    .bind(json_list(&list))
    .execute(&mut **tx)
    .await?;
    Ok(restocks)
}

/// Applies one batch inside a merged transaction. The outer error aborts the whole transaction;
/// the inner one (`NotFound`, `Fenced`) refuses this batch alone, before it wrote anything.
async fn apply_batch(
    tx: &mut sqlx::SqliteConnection,
    batch: &Batch,
) -> Result<Result<Vec<RowOutcome>, LedgerError>, LedgerError> {
    let code = batch.voucher_code.as_str();
    let Some((per_user_limit, discount, status, starts_at, ends_at)): Option<(
        i64,
        i64,
        String,
        i64,
        i64,
    )> = sqlx::query_as(
        "SELECT per_user_limit, discount_amount, status, starts_at, ends_at \
                 FROM vouchers WHERE code = ?",
    )
    .bind(code)
    .fetch_optional(&mut *tx)
    .await?
    else {
        return Ok(Err(LedgerError::NotFound));
    };
    let order_ids: Vec<&str> = batch.rows.iter().map(|r| r.order_id.as_str()).collect();
    let existing = sqlx::query(&format!(
        "SELECT {RESERVATION_COLUMNS} FROM reservations \
             WHERE order_id IN (SELECT value FROM json_each(?))"
    ))
    .bind(json_list(&order_ids))
    .fetch_all(&mut *tx)
    .await?
    .iter()
    .map(reservation_from)
    .collect::<Result<Vec<_>, _>>()?;
    let customers: Vec<i64> = batch.rows.iter().map(|r| r.customer_id).collect();
    let used: HashMap<i64, i64> = sqlx::query_as(
        "SELECT customer_id, used FROM customer_usage \
             WHERE voucher_code = ? AND customer_id IN (SELECT value FROM json_each(?))",
    )
    .bind(code)
    .bind(json_list(&customers))
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();

    let blocked = super::refuses_new(&status, starts_at, ends_at, batch.now);
    let plan = plan_batch(code, &batch.rows, &existing, &used, per_user_limit, blocked);
    let inserts: Vec<usize> = plan
        .iter()
        .enumerate()
        .filter(|(_, p)| matches!(p, Planned::Insert))
        .map(|(i, _)| i)
        .collect();
    let k = inserts.len() as i64;
    let mut created = HashMap::new();
    if k > 0 {
        // The fence: only an ACTIVE lease with room may be drawn on.
        let fenced = sqlx::query(
                "UPDATE leases SET consumed = consumed + ? \
                 WHERE id = ? AND voucher_code = ? AND state = 'ACTIVE' AND consumed + ? <= granted",
            )
            .bind(k)
            .bind(batch.lease_id)
            .bind(code)
            .bind(k)
            .execute(&mut *tx)
            .await?
            .rows_affected()
                != 1;
        if fenced {
            return Ok(Err(LedgerError::Fenced));
        }
        let rows: Vec<serde_json::Value> = inserts
            .iter()
            .map(|&i| json!([batch.rows[i].order_id, batch.rows[i].customer_id]))
            .collect();
        let inserted = sqlx::query(
            "INSERT INTO reservations (order_id, voucher_code, customer_id, lease_id, \
                 discount_amount, status, created_at, expires_at, updated_at) \
                 SELECT json_extract(value, '$[0]'), ?, json_extract(value, '$[1]'), ?, ?, \
                 'RESERVED', ?, ?, ? FROM json_each(?)",
        )
        .bind(code)
        .bind(batch.lease_id)
        .bind(discount)
        .bind(batch.now)
        .bind(batch.expires_at)
        .bind(batch.now)
        .bind(json_list(&rows))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if inserted != k as u64 {
            return Err(LedgerError::Unavailable(sqlx::Error::Protocol(
                "reservation insert count mismatch".into(),
            )));
        }
        let deltas = usage_deltas(&batch.rows, inserts.iter().copied());
        sqlx::query(
            "INSERT INTO customer_usage (voucher_code, customer_id, used) \
                 SELECT ?, json_extract(value, '$[0]'), json_extract(value, '$[1]') \
                 FROM json_each(?) WHERE true \
                 ON CONFLICT (voucher_code, customer_id) DO UPDATE SET used = used + excluded.used",
        )
        .bind(code)
        .bind(json_list(&deltas))
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE vouchers SET reserved = reserved + ? WHERE code = ?")
            .bind(k)
            .bind(code)
            .execute(&mut *tx)
            .await?;
        created = super::created_rows(batch, inserts.iter().copied(), discount);
    }
    Ok(Ok(resolve_plan(plan, &created)))
}

//! The embedded single-node ledger: SQLite through sqlx, in WAL mode with `synchronous = FULL`, so
//! a committed batch survives a crash of the process or the machine.
//!
//! All writes go through one connection (SQLite has one writer anyway; a single writer also rules
//! out `SQLITE_BUSY` on lock upgrades), held for the ledger's life; reads go through a small pool
//! of readers. The node's merged group commit runs on that connection's raw handle
//! ([`raw`]): each batch costs two indexed probes (its voucher, its lease), each row one more
//! (its order id), a lookup of its customer's usage in the writer's memory
//! ([`usage`]) and one insert, through statements prepared once per connection.
//!
//! This file holds [`SqliteLedger`] and its [`Ledger`] implementation, with the reads and the
//! voucher and switch edits; the rest is in parts of its own: [`open`] (pools, migrations,
//! checkpoints), [`writer`] (the one writer connection), [`commit`] (the merged commit),
//! [`leases`] (grants, returns, reaps, holders), [`settle`] (confirm, release, expiry), [`raw`]
//! and [`usage`].

mod commit;
mod leases;
mod open;
mod raw;
mod settle;
#[cfg(test)]
mod tests;
mod usage;
mod writer;

use std::collections::HashMap;

use async_trait::async_trait;
use sqlx::sqlite::SqlitePool;
use sqlx::{Connection, Row};

use super::rows::settled_events;
use super::rows::{
    event_from, limit_column, reservation_from, switches_from, voucher_from, EventRow,
    ACTIVE_LEASES_SQL, CREATED_SINCE_SQL, FEED_ORIGIN_SQL, LIVE_CODES_SQL, RESERVATION_COLUMNS,
    RETIRE_SQL, SET_SWITCHES_SQL, STARTING_SQL, SWITCHES_SQL, UNWATCH_SQL, VOUCHER_COLUMNS,
    VOUCHER_STOCK_SQL, WATCHED_SQL, WATCH_SQL, WON_ORDERS_SQL,
};
use super::{
    Batch, BatchResults, Beat, Closing, Counters, Grant, GrantAsk, Incarnation, Ledger,
    LedgerError, LiveUnits, Restock,
};
use crate::clock::Millis;
use crate::domain::{FeedEvent, Reservation, Switches, SwitchesPatch, Voucher, VoucherPatch};
use writer::Writer;

/// The change feed after `$1`, at most `$2` events, in order: each reservation's RESERVED
/// event numbered on its row (`reserved_seq`, written with it), then its settled one.
const EVENTS_SQL: &str = concat!(
    "SELECT seq, kind, voucher_code, order_id, customer_id, at FROM ( \
     SELECT * FROM (SELECT reserved_seq AS seq, 'RESERVED' AS kind, voucher_code, order_id, \
       customer_id, created_at AS at FROM reservations \
       WHERE reserved_seq > $1 AND reserved_seq <= $1 + $2 ORDER BY reserved_seq LIMIT $2) AS r \
     UNION ALL ",
    settled_events!(),
    ") AS e ORDER BY seq LIMIT $2"
);

pub struct SqliteLedger {
    /// The one connection every write goes through, with its prepared statements.
    writer: tokio::sync::Mutex<Writer>,
    /// Where the writer connection comes from (one connection), at first use and again if
    /// it had to be dropped.
    writer_pool: SqlitePool,
    reader: SqlitePool,
    /// The background checkpointer (see [`open`]), stopped with the ledger.
    checkpoints: tokio::task::AbortHandle,
}

/// `items` as a JSON array, for the statements that take a list through `json_each`.
/// The insert of a new voucher, all of it `free`.
fn insert_voucher(
    v: &Voucher,
    now: Millis,
) -> sqlx::query::Query<'_, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'_>> {
    sqlx::query(
        "INSERT INTO vouchers (code, discount_amount, min_order_amount, total_limit, \
         per_user_limit, starts_at, ends_at, status, free, created_at, customer_rate, \
         customer_burst, admission_rate) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
    .bind(limit_column(v.limits.customer_per_sec))
    .bind(limit_column(v.limits.customer_burst))
    .bind(limit_column(v.limits.admission_per_sec))
}

/// [`Ledger::create_vouchers`] on the raw writer: one transaction and one prepared statement
/// for all of them, without a hop to sqlx's worker per insert; a taken code is `AlreadyExists`
/// and writes nothing.
fn create_many_on(
    db: &raw::Db,
    vouchers: &[(Voucher, Millis)],
) -> Result<Vec<Result<(), LedgerError>>, LedgerError> {
    let tx = db.begin()?;
    let mut insert = db.prepare(
        "INSERT INTO vouchers (code, discount_amount, min_order_amount, total_limit, \
         per_user_limit, starts_at, ends_at, status, free, created_at, customer_rate, \
         customer_burst, admission_rate) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?4, ?9, ?10, \
         ?11, ?12) ON CONFLICT (code) DO NOTHING",
    )?;
    let mut answers = Vec::with_capacity(vouchers.len());
    for (v, now) in vouchers {
        insert.bind_text(1, &v.code)?;
        insert.bind_int(2, v.discount_amount)?;
        insert.bind_int(3, v.min_order_amount)?;
        insert.bind_int(4, v.total_limit)?;
        insert.bind_int(5, v.per_user_limit)?;
        insert.bind_int(6, v.starts_at)?;
        insert.bind_int(7, v.ends_at)?;
        insert.bind_text(8, v.status.as_str())?;
        insert.bind_int(9, *now)?;
        let limit = |l: Option<u32>| limit_column(l).map(i64::from);
        insert.bind_opt_int(10, limit(v.limits.customer_per_sec))?;
        insert.bind_opt_int(11, limit(v.limits.customer_burst))?;
        insert.bind_opt_int(12, limit(v.limits.admission_per_sec))?;
        insert.execute()?;
        answers.push(if db.changes() == 1 {
            Ok(())
        } else {
            Err(LedgerError::AlreadyExists)
        });
    }
    drop(insert);
    tx.commit()?;
    Ok(answers)
}

/// The rows of `sql`, which binds `list` and returns them as one row: a JSON array of arrays.
async fn json_rows<T: serde::de::DeserializeOwned>(
    conn: &mut sqlx::SqliteConnection,
    sql: &str,
    list: &str,
) -> Result<Vec<T>, LedgerError> {
    let json: String = sqlx::query_scalar(sql).bind(list).fetch_one(conn).await?;
    serde_json::from_str(&json)
        .map_err(|e| LedgerError::database(format!("sqlite recount rows: {e}")))
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

    /// `PRAGMA shrink_memory` on the writer and on each reader idle now: each connection's
    /// page cache goes back to SQLite's allocator (glibc's), and from there to the system at the
    /// caller's `malloc_trim`. The next reads fill them again from the OS's cache of the file.
    /// A connection busy now keeps its cache: this is tidying, never a wait on a sale's calls.
    /// Readers are taken one at a time and handed back at once, so a read that comes meanwhile
    /// waits for one statement at most (a reader may be shrunk twice, or missed, if reads take
    /// one meanwhile).
    async fn give_back_memory(&self) {
        const SHRINK: &str = "PRAGMA shrink_memory";
        if let Ok(mut w) = self.writer.try_lock() {
            if let Ok(conn) = w.conn() {
                let _ = sqlx::query(SHRINK).execute(conn).await;
            }
        }
        for _ in 0..self.reader.num_idle() {
            let Some(mut conn) = self.reader.try_acquire() else {
                break;
            };
            let _ = sqlx::query(SHRINK).execute(&mut *conn).await;
        }
    }

    async fn create_voucher(&self, v: &Voucher, now: Millis) -> Result<(), LedgerError> {
        let res = insert_voucher(v, now)
            .execute(self.writer().await?.conn()?)
            .await;
        super::sql::insert_unique(res)
    }

    async fn create_vouchers(
        &self,
        vouchers: &[(Voucher, Millis)],
    ) -> Result<Vec<Result<(), LedgerError>>, LedgerError> {
        self.on_writer(|db, _| create_many_on(db, vouchers)).await
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

    async fn vouchers(&self, codes: &[String]) -> Result<Vec<Voucher>, LedgerError> {
        let rows = sqlx::query(&format!(
            "SELECT {VOUCHER_COLUMNS} FROM vouchers WHERE code IN (SELECT value FROM json_each(?))"
        ))
        .bind(json_list(codes))
        .fetch_all(&self.reader)
        .await?;
        Ok(rows.iter().map(voucher_from).collect::<Result<_, _>>()?)
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
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
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
            "UPDATE vouchers SET status = ?, ends_at = ?, total_limit = ?, free = free + ?, \
             customer_rate = ?, customer_burst = ?, admission_rate = ? WHERE code = ?",
        )
        .bind(next.status.as_str())
        .bind(next.ends_at)
        .bind(next.total_limit)
        .bind(added)
        .bind(limit_column(next.limits.customer_per_sec))
        .bind(limit_column(next.limits.customer_burst))
        .bind(limit_column(next.limits.admission_per_sec))
        .bind(code)
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
        self.on_writer(|db, _| leases::grant_on(db, code, node, want, now, ttl_ms))
            .await
    }

    async fn grant_many(
        &self,
        asks: &[GrantAsk],
    ) -> Result<Vec<Result<Grant, LedgerError>>, LedgerError> {
        self.on_writer(|db, _| leases::grant_many_on(db, asks))
            .await
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
        .fetch_all(self.writer().await?.conn()?)
        .await?;
        Ok(ids)
    }

    async fn active_leases(&self, code: &str, node: &str) -> Result<Vec<i64>, LedgerError> {
        Ok(sqlx::query_scalar(ACTIVE_LEASES_SQL)
            .bind(code)
            .bind(node)
            .fetch_all(&self.reader)
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
            .execute(self.writer().await?.conn()?)
            .await?;
        Ok(())
    }

    async fn commit_batches(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        self.on_writer(|db, usage| {
            let results = commit::apply_merged(db, usage, batches);
            if results.is_err() {
                // Committed or not, its rows are the truth: count its vouchers from them again.
                for b in batches {
                    usage.forget(&b.voucher_code);
                }
            }
            results
        })
        .await
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

    async fn live_units(
        &self,
        now: Millis,
        ending_after: Millis,
        codes: &[String],
    ) -> Result<Vec<LiveUnits>, LedgerError> {
        if codes.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<(String, i64, i64, i64, i64, i64, i64)> = sqlx::query_as(
            "SELECT v.code, v.total_limit, v.free, \
             COALESCE((SELECT SUM(l.granted - l.consumed) FROM leases l \
                       WHERE l.voucher_code = v.code AND l.state = 'ACTIVE'), 0), \
             v.reserved, v.confirmed, v.released \
             FROM vouchers v WHERE v.code IN (SELECT value FROM json_each(?)) \
             AND v.starts_at <= ? AND v.ends_at > ?",
        )
        .bind(json_list(codes))
        .bind(now)
        .bind(ending_after)
        .fetch_all(&self.reader)
        .await?;
        Ok(rows.into_iter().map(super::rows::live_units_from).collect())
    }

    async fn starting_between(&self, from: Millis, to: Millis) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(STARTING_SQL)
            .bind(from)
            .bind(to)
            .fetch_all(&self.reader)
            .await?)
    }

    async fn switches(&self) -> Result<Switches, LedgerError> {
        let row = sqlx::query_as(SWITCHES_SQL).fetch_one(&self.reader).await?;
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
            .fetch_one(self.writer().await?.conn()?)
            .await?;
        Ok(switches_from(row))
    }

    async fn won_orders(&self, code: &str) -> Result<Vec<(String, i64)>, LedgerError> {
        Ok(sqlx::query_as(WON_ORDERS_SQL)
            .bind(code)
            .fetch_all(&self.reader)
            .await?)
    }

    async fn customer_usage(
        &self,
        code: &str,
        customers: &[i64],
    ) -> Result<Vec<(i64, i64)>, LedgerError> {
        // The writer's counts: the ledger keeps no index by customer to read them from.
        self.on_writer(|db, usage| {
            // In a transaction (it writes nothing) so that the counts are checked against other
            // connections' commits on the snapshot they are read from.
            let _tx = db.begin_read()?;
            usage.check_writers(db)?;
            let counts = usage.voucher(db, code, None)?;
            Ok(customers
                .iter()
                .map(|&customer| (customer, counts.of(customer)))
                .filter(|&(_, n)| n > 0)
                .collect())
        })
        .await
    }

    async fn confirm(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<Reservation, LedgerError> {
        self.confirm_reservation(code, order_id, now).await
    }

    async fn release(
        &self,
        code: &str,
        order_id: &str,
        now: Millis,
    ) -> Result<(Reservation, Option<Restock>), LedgerError> {
        self.release_reservation(code, order_id, now).await
    }

    async fn expire_due(&self, now: Millis, limit: i64) -> Result<Vec<Restock>, LedgerError> {
        self.expire(now, limit).await
    }

    async fn reap_expired(&self, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        self.close_leases(Closing::ExpiredBy(now), now).await
    }

    async fn counters_many(&self, codes: &[String]) -> Result<Vec<Option<Counters>>, LedgerError> {
        if codes.is_empty() {
            return Ok(Vec::new());
        }
        let list = json_list(codes);
        // Each read comes back as one row, a JSON array of the per-voucher rows: sqlx's SQLite
        // worker hands every row to the caller's thread on its own (a wake-up of each thread
        // per row), which made a recount of a flood's backlog, three rows per voucher, cost
        // most of a core's percent at 250 vouchers a second.
        let mut tx = self.reader.begin().await?;
        let heads: Vec<(String, i64, i64, i64, i64, i64)> = json_rows(
            &mut tx,
            "SELECT json_group_array(json_array(code, total_limit, free, reserved, confirmed, \
             released)) FROM vouchers WHERE code IN (SELECT value FROM json_each(?))",
            &list,
        )
        .await?;
        // Read straight off the (voucher, status) index.
        let rows: Vec<(String, i64, i64, i64)> = json_rows(
            &mut tx,
            "SELECT json_group_array(json_array(voucher_code, r, c, x)) FROM ( \
             SELECT voucher_code, COALESCE(SUM(status = 'RESERVED'), 0) AS r, \
             COALESCE(SUM(status = 'CONFIRMED'), 0) AS c, \
             COALESCE(SUM(status = 'RELEASED'), 0) AS x \
             FROM reservations WHERE voucher_code IN (SELECT value FROM json_each(?)) \
             GROUP BY voucher_code)",
            &list,
        )
        .await?;
        let leases: Vec<(String, i64, i64)> = json_rows(
            &mut tx,
            "SELECT json_group_array(json_array(voucher_code, unused, consumed)) FROM ( \
             SELECT voucher_code, \
             COALESCE(SUM(CASE WHEN state = 'ACTIVE' THEN granted - consumed ELSE 0 END), 0) \
             AS unused, COALESCE(SUM(consumed), 0) AS consumed FROM leases \
             WHERE voucher_code IN (SELECT value FROM json_each(?)) GROUP BY voucher_code)",
            &list,
        )
        .await?;
        tx.commit().await?;
        let rows: HashMap<String, (i64, i64, i64)> = rows
            .into_iter()
            .map(|(c, a, b, d)| (c, (a, b, d)))
            .collect();
        let leases: HashMap<String, (i64, i64)> =
            leases.into_iter().map(|(c, a, b)| (c, (a, b))).collect();
        let mut found: HashMap<String, Counters> = HashMap::with_capacity(heads.len());
        for (code, total_limit, free, reserved, confirmed, released) in heads {
            let (rows_reserved, rows_confirmed, rows_released) =
                rows.get(&code).copied().unwrap_or_default();
            let (leased_unused, consumed) = leases.get(&code).copied().unwrap_or_default();
            let by_status: Vec<(String, i64)> = vec![
                ("RESERVED".into(), rows_reserved),
                ("CONFIRMED".into(), rows_confirmed),
                ("RELEASED".into(), rows_released),
            ];
            // This ledger's usage is the count of the rows that are not RELEASED (migration 6):
            // it cannot drift from them, so the reconciler's usage check holds by construction.
            // The writer's counts of it, which enforce the limit, are checked against the books
            // at every merged commit (`usage`).
            let usage = rows_reserved + rows_confirmed;
            let counters = super::reconcile(
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
            found.insert(code, counters);
        }
        Ok(codes.iter().map(|c| found.get(c).copied()).collect())
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
            .fetch_all(&self.reader)
            .await?)
    }

    async fn codes_created_since(&self, since: Millis) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(CREATED_SINCE_SQL)
            .bind(since)
            .fetch_all(&self.reader)
            .await?)
    }

    async fn watched_codes(&self) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(WATCHED_SQL)
            .fetch_all(&self.reader)
            .await?)
    }

    async fn set_watched(&self, code: &str, watched: bool) -> Result<(), LedgerError> {
        let mut w = self.writer().await?;
        let conn = w.conn()?;
        if watched {
            let n = sqlx::query(WATCH_SQL)
                .bind(code)
                .execute(&mut *conn)
                .await?;
            if n.rows_affected() == 0 && self.voucher(code).await?.is_none() {
                return Err(LedgerError::NotFound);
            }
        } else {
            sqlx::query(UNWATCH_SQL)
                .bind(code)
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }

    async fn feed_origin(&self) -> Result<String, LedgerError> {
        Ok(sqlx::query_scalar(FEED_ORIGIN_SQL)
            .fetch_one(&self.reader)
            .await?)
    }

    async fn events(&self, after: i64, limit: i64) -> Result<Vec<FeedEvent>, LedgerError> {
        let rows: Vec<EventRow> = sqlx::query_as(EVENTS_SQL)
            .bind(after)
            .bind(limit)
            .fetch_all(&self.reader)
            .await?;
        rows.into_iter().map(event_from).collect()
    }
}

//! The embedded single-node ledger: SQLite through sqlx, in WAL mode with `synchronous = FULL`, so
//! a committed batch survives a crash of the process or the machine.
//!
//! All writes go through one connection (SQLite has one writer anyway; a single writer also rules
//! out `SQLITE_BUSY` on lock upgrades), held for the ledger's life; reads go through a small pool
//! of readers. The node's merged group commit runs on that connection's raw handle
//! ([`raw`]): each batch costs two indexed probes (its voucher, its lease), each row one more
//! (its order id), a lookup of its customer's usage in the writer's memory
//! ([`usage`]) and one insert, through statements prepared once per connection.

mod raw;
#[cfg(test)]
mod tests;
mod usage;

use std::str::FromStr;
use std::time::Duration;

use sqlx::{Connection, Row};

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};

use super::merged::{plan_merged, LeaseRoom, MergedReads, MergedWrites, Rules};
use super::rows::settled_events;
use super::rows::{
    event_from, limit_column, reservation_from, switches_from, voucher_from, EventRow,
    FEED_ORIGIN_SQL, LIVE_CODES_SQL, RESERVATION_COLUMNS, SET_SWITCHES_SQL, STARTING_SQL,
    SWITCHES_SQL, VOUCHER_COLUMNS, VOUCHER_STOCK_SQL,
};
use super::{
    group_restocks, holder_name, split_holder, Batch, BatchResults, Beat, Closing, Counters, Grant,
    Incarnation, Lease, Ledger, LedgerError, LiveUnits, Restock, LEASE_FILTER,
};
use crate::clock::Millis;
use crate::domain::{
    FeedEvent, Reservation, ReservationStatus, Switches, SwitchesPatch, Voucher, VoucherPatch,
};
use usage::UsageCache;

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

const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("../../../migrations/sqlite/0001_init.sql")),
    (
        2,
        include_str!("../../../migrations/sqlite/0002_voucher_limits.sql"),
    ),
    (
        3,
        include_str!("../../../migrations/sqlite/0003_switches.sql"),
    ),
    (4, include_str!("../../../migrations/sqlite/0004_feed.sql")),
    (5, include_str!("../../../migrations/sqlite/0005_nodes.sql")),
    (
        6,
        include_str!("../../../migrations/sqlite/0006_usage_from_rows.sql"),
    ),
    (
        7,
        include_str!("../../../migrations/sqlite/0007_status_check_without_list.sql"),
    ),
    (
        8,
        include_str!("../../../migrations/sqlite/0008_usage_in_writer.sql"),
    ),
];

pub struct SqliteLedger {
    /// The one connection every write goes through, with its prepared statements.
    writer: tokio::sync::Mutex<Writer>,
    /// Where the writer connection comes from (one connection), at first use and again if
    /// it had to be dropped.
    writer_pool: SqlitePool,
    reader: SqlitePool,
    /// The background checkpointer ([`checkpoint_every`]), stopped with the ledger.
    checkpoints: tokio::task::AbortHandle,
}

/// The writer connection, held out of its pool for the ledger's life, and the statements
/// [`SqliteLedger::on_writer`] prepared on it. The statements must be finalized before the
/// connection closes (sqlx panics closing a connection with statements left), and a pool closes
/// a connection on its own when it cannot hand it back (a runtime shutting down): held here,
/// it closes only after [`SqliteLedger`]'s drop cleared the statements, or after `on_writer`
/// did, when it drops a broken connection.
#[derive(Default)]
struct Writer {
    conn: Option<sqlx::pool::PoolConnection<sqlx::Sqlite>>,
    stmts: raw::StmtCache,
    /// Each customer's usage of the vouchers on sale, counted from the rows this connection
    /// wrote (see [`usage`]).
    usage: UsageCache,
}

impl Writer {
    /// The connection, for sqlx's own statements (which run through its worker thread).
    fn conn(&mut self) -> Result<&mut SqliteConnection, LedgerError> {
        self.conn.as_deref_mut().ok_or_else(writer_missing)
    }

    /// The connection and the usage counts, for a status change that moves a count.
    fn conn_and_usage(&mut self) -> Result<(&mut SqliteConnection, &mut UsageCache), LedgerError> {
        let conn = self.conn.as_deref_mut().ok_or_else(writer_missing)?;
        Ok((conn, &mut self.usage))
    }
}

/// [`SqliteLedger::writer`] always leaves a connection in place: this is never seen.
fn writer_missing() -> LedgerError {
    LedgerError::database("sqlite writer missing")
}

impl SqliteLedger {
    pub async fn connect(url: &str, readers: u32) -> Result<Self, sqlx::Error> {
        raw::quiet_allocator();
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
        // The writer checkpoints only as a backstop, when the log passes WAL_BACKSTOP_PAGES;
        // the checkpointer below normally copies the log back first, off the writer's thread.
        let writer = pool(
            1,
            options
                .clone()
                .pragma("wal_autocheckpoint", WAL_BACKSTOP_PAGES.to_string())
                // When the log is rewound, a file grown past this is cut back to it.
                .pragma("journal_size_limit", WAL_SIZE_LIMIT_BYTES.to_string())
                // Statement journals (a multi-row insert inside a transaction keeps one) in
                // memory, not in a temporary file opened, written and unlinked at every
                // merged commit.
                .pragma("temp_store", "memory"),
        )
        .await?;
        migrate(&writer).await?;
        let reader = pool(readers.max(1), options.clone().read_only(true)).await?;
        let checkpointer = pool(1, options).await?;
        let checkpoints = tokio::spawn(checkpoint_every(checkpointer, CHECKPOINT_EVERY));
        Ok(Self {
            writer: Default::default(),
            writer_pool: writer,
            reader,
            checkpoints: checkpoints.abort_handle(),
        })
    }
}

/// A pool of `max` connections to the local file: no ping before each use, and kept open for
/// the ledger's life (a connection to a local file needs no recycling).
async fn pool(max: u32, options: SqliteConnectOptions) -> Result<SqlitePool, sqlx::Error> {
    SqlitePoolOptions::new()
        .max_connections(max)
        .idle_timeout(None)
        .max_lifetime(None)
        .test_before_acquire(false)
        .acquire_timeout(CONNECTION_WAIT)
        .connect_with(options)
        .await
}

impl Drop for SqliteLedger {
    fn drop(&mut self) {
        self.checkpoints.abort();
        let w = self.writer.get_mut();
        let Some(mut conn) = w.conn.take() else {
            return;
        };
        // The statements go before the connection closes, with the handle locked: sqlx's
        // worker may still be running what a dropped transaction queued (its rollback), and
        // the lock waits behind it. The worker is a thread of its own, so waiting here for it
        // cannot deadlock, and it is brief.
        match block_on(conn.lock_handle()) {
            // SAFETY: the handle is locked out of the worker and live.
            Ok(locked) => unsafe {
                w.stmts.clear();
                drop(locked);
            },
            Err(_) => w.stmts.forget(),
        }
        // Closed by its worker thread as it drops; given back to the pool it would need a
        // runtime to spawn on, and a runtime may not be running here.
        drop(conn.detach());
    }
}

/// Runs a future to completion on this thread (for [`SqliteLedger`]'s drop, which waits for
/// sqlx's worker thread, not for anything a runtime drives).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::sync::Arc::new(Unpark(std::thread::current())).into();
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// How long a call waits for a connection (a pool's, or the held writer) before it fails
/// (`PoolTimedOut`).
const CONNECTION_WAIT: Duration = Duration::from_secs(5);

/// How often the checkpointer copies the write-ahead log back into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// The log's size, in pages, at which a commit checkpoints by itself (SQLite's default is 1000).
/// Only the writer can rewind the log, and only once every frame in it was copied back; under
/// steady load a commit nearly always lands while a background checkpoint runs, so the log
/// keeps growing until this backstop. By then the checkpointer has copied all but the last
/// interval's frames, so the writer's own checkpoint is short, and the log starts over.
const WAL_BACKSTOP_PAGES: u32 = 4_000;

/// `journal_size_limit`: the log file is cut back to this when it is rewound (16 MiB, the
/// backstop's 4,000 pages of 4 KiB), so a burst does not leave it large.
const WAL_SIZE_LIMIT_BYTES: u32 = 16 << 20;

/// Copies the write-ahead log back into the database file every `every`, on a connection of its
/// own (sqlx runs it on that connection's worker thread). A merged commit would otherwise run
/// the checkpoint itself every thousand pages, holding every batch behind it while it copies;
/// and a page that several commits rewrote within one interval is copied once, not once per
/// checkpoint. `PASSIVE` never waits for the writer or the readers: it copies what it can and
/// the next round copies the rest.
async fn checkpoint_every(pool: SqlitePool, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Logged when checkpoints start failing and when they work again, not ten times a second.
    let mut failing = false;
    loop {
        tick.tick().await;
        match sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
            .execute(&pool)
            .await
        {
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "wal checkpoints fail; the writer's backstop holds");
            }
            Ok(_) if failing => {
                failing = false;
                tracing::info!("wal checkpoints work again");
            }
            _ => {}
        }
    }
}

impl SqliteLedger {
    /// The writer connection, locked for the caller (taken from its pool at first use). Waits
    /// no longer than the pool would have ([`CONNECTION_WAIT`]): a write queued behind a stuck
    /// one fails rather than run long after its caller gave up.
    async fn writer(&self) -> Result<tokio::sync::MutexGuard<'_, Writer>, sqlx::Error> {
        let mut w = tokio::time::timeout(CONNECTION_WAIT, self.writer.lock())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?;
        if w.conn.is_none() {
            w.conn = Some(self.writer_pool.acquire().await?);
        }
        Ok(w)
    }

    /// Runs `work` on the writer connection's handle, on this thread, without sqlx's worker
    /// (see [`raw`]). `work` must leave the handle outside any transaction, as [`raw::Tx`] does.
    async fn on_writer<T>(
        &self,
        work: impl FnOnce(&raw::Db, &mut UsageCache) -> Result<T, LedgerError>,
    ) -> Result<T, LedgerError> {
        let mut w = self.writer().await?;
        let Writer { conn, stmts, usage } = &mut *w;
        let handle = conn.as_deref_mut().ok_or_else(writer_missing)?;
        // `Some(crashed)` when the connection may not be used again.
        let (result, broken) = match handle.lock_handle().await {
            Ok(mut locked) => {
                // SAFETY: the handle stays locked out of sqlx's worker until `locked` drops;
                // the cache only ever holds this connection's statements (it is cleared
                // before one is dropped).
                let db = unsafe { raw::Db::new(locked.as_raw_handle(), stmts) };
                // The work blocks (fsync, busy waits): tell a multi-threaded runtime, so the
                // tasks queued on this worker move to another one meanwhile.
                let multi = tokio::runtime::Handle::try_current().is_ok_and(|h| {
                    h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
                });
                let result = if multi {
                    tokio::task::block_in_place(|| work(&db, usage))
                } else {
                    work(&db, usage)
                };
                if db.autocommit() {
                    return result;
                }
                // A rollback that failed left the handle inside a transaction: never use it
                // like that again (later writes would join a transaction nobody commits).
                // SAFETY: the handle is still locked and live; its statements go before it.
                unsafe { stmts.clear() };
                tracing::error!("sqlite writer left inside a transaction; connection dropped");
                let e = LedgerError::database("sqlite writer left inside a transaction");
                (Err(e), Some(false))
            }
            Err(e) => {
                let crashed = matches!(e, sqlx::Error::WorkerCrashed);
                if crashed {
                    // The worker is gone with the handle: its statements cannot be finalized
                    // nor the handle closed. Both are left (leaked).
                    stmts.forget();
                    tracing::error!("sqlite writer's worker crashed; connection replaced");
                }
                (Err(e.into()), crashed.then_some(true))
            }
        };
        // The next write takes a new connection from the pool.
        if let Some(crashed) = broken {
            w.usage.clear();
            if let Some(conn) = w.conn.take() {
                let conn = conn.detach();
                if crashed {
                    std::mem::forget(conn);
                }
            }
        }
        result
    }

    /// Returns or reaps leases; their unused units go back to `free`.
    async fn close_leases(
        &self,
        which: Closing<'_>,
        now: Millis,
    ) -> Result<Vec<Restock>, LedgerError> {
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        let restocks = close_leases_in(&mut tx, which, now).await?;
        tx.commit().await?;
        Ok(restocks)
    }
}

/// [`SqliteLedger::close_leases`] inside a transaction.
async fn close_leases_in(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    which: Closing<'_>,
    now: Millis,
) -> Result<Vec<Restock>, LedgerError> {
    let (id, node, expired_by) = which.params();
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "UPDATE leases SET state = $4, closed_at = $5 WHERE {LEASE_FILTER} \
         RETURNING voucher_code, granted - consumed"
    ))
    .bind(id)
    .bind(node)
    .bind(expired_by)
    .bind(which.state())
    .bind(now)
    .fetch_all(&mut **tx)
    .await?;
    give_back(tx, rows).await
}

async fn migrate(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY)")
        .execute(pool)
        .await?;
    let newest: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
        .fetch_one(pool)
        .await?;
    super::sql::refuse_newer_schema(newest, MIGRATIONS)?;
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
        .execute(self.writer().await?.conn()?)
        .await;
        super::sql::insert_unique(res)
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
        self.on_writer(|db, _| grant_on(db, code, node, want, now, ttl_ms))
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
        Ok(sqlx::query_scalar(
            "SELECT id FROM leases WHERE voucher_code = ? AND node_id = ? AND state = 'ACTIVE' \
             AND consumed < granted ORDER BY id",
        )
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
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        let number: i64 = sqlx::query_scalar(
            "INSERT INTO node_names (name, last_incarnation) VALUES (?1, 1) \
             ON CONFLICT (name) DO UPDATE SET last_incarnation = last_incarnation + 1 \
             RETURNING last_incarnation",
        )
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
        let holder = holder_name(name, number);
        // Rows of earlier runs that hold nothing any more (the embedded ledger runs no
        // heartbeat, so nothing else forgets them).
        sqlx::query(
            "DELETE FROM nodes WHERE beat_at < ?1 - dead_after AND holder NOT IN \
             (SELECT node_id FROM leases WHERE state = 'ACTIVE')",
        )
        .bind(now)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO nodes (holder, name, incarnation, started_at, beat_at, streak_from, \
                                dead_after) \
             VALUES (?1, ?2, ?3, ?4, ?4, ?4, ?5) ON CONFLICT (holder) DO UPDATE SET \
                 beat_at = ?4, streak_from = ?4, dead_after = ?5",
        )
        .bind(&holder)
        .bind(name)
        .bind(number)
        .bind(now)
        .bind(dead_after_ms.max(1))
        .execute(&mut *tx)
        .await?;
        let live_siblings: Vec<i64> = sqlx::query_scalar(
            "SELECT incarnation FROM nodes WHERE name = ?1 AND incarnation <> ?2 \
             AND beat_at >= ?3 - dead_after ORDER BY incarnation",
        )
        .bind(name)
        .bind(number)
        .bind(now)
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
        now: Millis,
        dead_after_ms: i64,
    ) -> Result<Beat, LedgerError> {
        let (name, number) = split_holder(holder);
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        let streak: i64 = sqlx::query_scalar(
            "INSERT INTO nodes (holder, name, incarnation, started_at, beat_at, streak_from, \
                                dead_after) \
             VALUES (?1, ?2, ?3, ?4, ?4, ?4, ?5) ON CONFLICT (holder) DO UPDATE SET \
                 beat_at = ?4, dead_after = ?5, \
                 streak_from = CASE WHEN ?4 - beat_at > ?5 / 2 THEN ?4 ELSE streak_from END \
             RETURNING beat_at - streak_from",
        )
        .bind(holder)
        .bind(name)
        .bind(number)
        .bind(now)
        .bind(dead_after_ms.max(1))
        .fetch_one(&mut *tx)
        .await?;
        let dead: Vec<String> = sqlx::query_scalar(
            "SELECT holder FROM nodes WHERE holder <> ?1 AND beat_at < ?2 - dead_after \
             AND dead_after <= ?3 ORDER BY holder",
        )
        .bind(holder)
        .bind(now)
        .bind(streak)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        // One process on one machine: the ledger's clock is this node's.
        Ok(Beat {
            ledger_ms: now,
            dead,
        })
    }

    async fn reap_holder(&self, holder: &str, now: Millis) -> Result<Vec<Restock>, LedgerError> {
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        let gone: Option<String> = sqlx::query_scalar(
            "DELETE FROM nodes WHERE holder = ?1 AND beat_at < ?2 - dead_after RETURNING holder",
        )
        .bind(holder)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        if gone.is_none() {
            return Ok(Vec::new());
        }
        let restocks = close_leases_in(&mut tx, Closing::Dead(holder), now).await?;
        tx.commit().await?;
        Ok(restocks)
    }

    async fn retire_node(&self, holder: &str) -> Result<(), LedgerError> {
        sqlx::query("UPDATE nodes SET beat_at = 0, dead_after = 1 WHERE holder = ?1")
            .bind(holder)
            .execute(self.writer().await?.conn()?)
            .await?;
        Ok(())
    }

    async fn commit_batches(&self, batches: &[Batch]) -> Result<BatchResults, LedgerError> {
        self.on_writer(|db, usage| {
            let results = apply_merged(db, usage, batches);
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
    ) -> Result<Vec<LiveUnits>, LedgerError> {
        let rows: Vec<(String, i64, i64, i64, i64, i64, i64)> = sqlx::query_as(
            "SELECT v.code, v.total_limit, v.free, \
             COALESCE((SELECT SUM(l.granted - l.consumed) FROM leases l \
                       WHERE l.voucher_code = v.code AND l.state = 'ACTIVE'), 0), \
             v.reserved, v.confirmed, v.released \
             FROM vouchers v WHERE v.starts_at <= ? AND v.ends_at > ?",
        )
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
        Ok(sqlx::query_as(
            "SELECT order_id, customer_id FROM reservations \
             WHERE voucher_code = ? AND status <> 'RELEASED'",
        )
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
        let mut w = self.writer().await?;
        let mut tx = w.conn()?.begin().await?;
        // The writer is alone: the head's next number is this change's.
        let row = sqlx::query(&format!(
            "UPDATE reservations SET status = 'CONFIRMED', updated_at = ?, \
               settled_seq = (SELECT last + 1 FROM feed_head WHERE id = 1) \
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
            bump_feed_head(&mut tx).await?;
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
        let mut w = self.writer().await?;
        let (conn, usage) = w.conn_and_usage()?;
        let mut tx = conn.begin().await?;
        let row = sqlx::query(&format!(
            "UPDATE reservations SET status = 'RELEASED', updated_at = ?, \
               settled_seq = (SELECT last + 1 FROM feed_head WHERE id = 1) \
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
            bump_feed_head(&mut tx).await?;
            commit_released(tx, usage, [(r.voucher_code.as_str(), r.customer_id)]).await?;
            return Ok((r, restocks.into_iter().next()));
        }
        let current = load_reservation(&mut tx, code, order_id).await?;
        super::release_unchanged(current)
    }

    async fn expire_due(&self, now: Millis, limit: i64) -> Result<Vec<Restock>, LedgerError> {
        let mut w = self.writer().await?;
        let (conn, usage) = w.conn_and_usage()?;
        let mut tx = conn.begin().await?;
        let released: Vec<(String, i64, String)> = sqlx::query_as(
            "UPDATE reservations SET status = 'RELEASED', updated_at = ? \
             WHERE order_id IN (SELECT order_id FROM reservations \
                                WHERE status = 'RESERVED' AND expires_at <= ? LIMIT ?) \
             AND status = 'RESERVED' RETURNING voucher_code, customer_id, order_id",
        )
        .bind(now)
        .bind(now)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        let (pairs, orders): (Vec<(String, i64)>, Vec<&str>) = released
            .iter()
            .map(|(code, customer, order)| ((code.clone(), *customer), order.as_str()))
            .unzip();
        let restocks = release_units(&mut tx, &pairs).await?;
        stamp_expired(&mut tx, &orders).await?;
        commit_released(
            tx,
            usage,
            pairs
                .iter()
                .map(|(code, customer)| (code.as_str(), *customer)),
        )
        .await?;
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
        // Read straight off the (voucher, status) index, with no sort.
        let (rows_reserved, rows_confirmed, rows_released): (i64, i64, i64) = sqlx::query_as(
            "SELECT COALESCE(SUM(status = 'RESERVED'), 0), COALESCE(SUM(status = 'CONFIRMED'), 0), \
             COALESCE(SUM(status = 'RELEASED'), 0) FROM reservations WHERE voucher_code = ?",
        )
        .bind(code)
        .fetch_one(&mut *tx)
        .await?;
        let by_status: Vec<(String, i64)> = vec![
            ("RESERVED".into(), rows_reserved),
            ("CONFIRMED".into(), rows_confirmed),
            ("RELEASED".into(), rows_released),
        ];
        let (leased_unused, consumed): (i64, i64) = sqlx::query_as(
            "SELECT COALESCE(SUM(CASE WHEN state = 'ACTIVE' THEN granted - consumed ELSE 0 END), 0), \
             COALESCE(SUM(consumed), 0) FROM leases WHERE voucher_code = ?",
        )
        .bind(code)
        .fetch_one(&mut *tx)
        .await?;
        // This ledger's usage is the count of the rows that are not RELEASED (migration 6): it
        // cannot drift from them, so the reconciler's usage check holds by construction. The
        // writer's counts of it, which enforce the limit, are checked against the books at
        // every merged commit (`usage`).
        let usage = rows_reserved + rows_confirmed;
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

/// Commits `tx`, which released one reservation of each `(voucher, customer)` in `released`,
/// and then takes them off the writer's usage counts. A commit that failed may or may not have
/// happened: the counts are dropped, to be read from the rows again.
async fn commit_released<'a>(
    tx: sqlx::Transaction<'_, sqlx::Sqlite>,
    usage: &mut UsageCache,
    released: impl IntoIterator<Item = (&'a str, i64)>,
) -> Result<(), LedgerError> {
    // If this future is dropped while the commit is in flight, sqlx's worker may still commit:
    // the next use of the counts finds them unsettled and drops them.
    usage.settling();
    if let Err(e) = tx.commit().await {
        usage.clear();
        return Err(e.into());
    }
    for (code, customer) in released {
        usage.add(code, customer, -1);
    }
    usage.settled();
    Ok(())
}

/// Hands out the feed's next number, which the one change of `tx` already took.
async fn bump_feed_head(tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>) -> Result<(), LedgerError> {
    let bumped = sqlx::query("UPDATE feed_head SET last = last + 1 WHERE id = 1")
        .execute(&mut **tx)
        .await?
        .rows_affected();
    if bumped != 1 {
        return Err(LedgerError::Invalid("feed_head row missing"));
    }
    Ok(())
}

/// Gives the expired reservations `orders` (already released in `tx`) their feed numbers, in
/// the order given.
async fn stamp_expired(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    orders: &[&str],
) -> Result<(), LedgerError> {
    if orders.is_empty() {
        return Ok(());
    }
    let n = orders.len() as i64;
    let base: i64 = sqlx::query_scalar(
        "UPDATE feed_head SET last = last + ?1 WHERE id = 1 RETURNING last - ?1",
    )
    .bind(n)
    .fetch_one(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE reservations SET settled_seq = ?1 + j.key + 1, expired = 1 \
         FROM json_each(?2) AS j WHERE reservations.order_id = j.value",
    )
    .bind(base)
    .bind(json_list(orders))
    .execute(&mut **tx)
    .await?;
    Ok(())
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

/// Counter side of releasing reservations (already marked RELEASED): each unit back to `free`.
/// Each customer's usage is the count of their rows that are not RELEASED: the caller takes the
/// released ones off the writer's counts once it committed.
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
    Ok(restocks)
}

/// A merged transaction's statements. None of them builds a temporary B-tree at each run (see
/// `merged_commit_statements_build_no_temporary_btree`): no `IN (list)` in them or in a CHECK
/// they evaluate, no `RETURNING`.
const READ_RULES: &str = "SELECT per_user_limit, discount_amount, status, starts_at, ends_at, \
     reserved + confirmed FROM vouchers WHERE code = ?1";
const READ_LEASE: &str = "SELECT voucher_code, state, granted - consumed FROM leases WHERE id = ?1";
const READ_STORED: &str = "SELECT voucher_code, customer_id, discount_amount, status, expires_at \
     FROM reservations WHERE order_id = ?1";
const FENCE: &str = "UPDATE leases SET consumed = consumed + ?2 \
     WHERE id = ?1 AND state = 'ACTIVE' AND consumed + ?2 <= granted";
const FEED_TAKE: &str = "UPDATE feed_head SET last = last + ?1 WHERE id = 1";
const FEED_LAST: &str = "SELECT last FROM feed_head WHERE id = 1";
const INSERT_RESERVATION: &str = "INSERT INTO reservations (order_id, voucher_code, customer_id, \
     lease_id, discount_amount, status, created_at, expires_at, updated_at, reserved_seq) \
     VALUES (?1, ?2, ?3, ?4, ?5, 'RESERVED', ?6, ?7, ?6, ?8)";
const COUNT_RESERVED: &str = "UPDATE vouchers SET reserved = reserved + ?2 WHERE code = ?1";

/// The reads of a merged transaction: each batch's voucher rules and lease, each row's stored
/// order and (from the writer's counts) its customer's usage.
fn read_merged(
    db: &raw::Db,
    usage: &mut UsageCache,
    batches: &[Batch],
) -> Result<MergedReads, LedgerError> {
    let mut reads = MergedReads::default();
    // Every read is an indexed probe through a statement prepared once per connection. None
    // takes a list: `x IN (list)` builds a temporary B-tree of the list at each run (opening
    // and closing one cost more than the probe), and a set-based read over a JSON array of a
    // hundred ids parses the array into one before it seeks the same index anyway.
    // Each voucher's `reserved + confirmed`, for its usage counts' load.
    let mut books: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    let mut rules = db.prepare(READ_RULES)?;
    let mut lease = db.prepare(READ_LEASE)?;
    for b in batches {
        if !reads.rules.contains_key(&b.voucher_code) {
            rules.bind_text(1, &b.voucher_code)?;
            if rules.step()? {
                let found = Rules {
                    per_user_limit: rules.int(0),
                    discount: rules.int(1),
                    status: rules.text(2),
                    starts_at: rules.int(3),
                    ends_at: rules.int(4),
                };
                usage.agrees(&b.voucher_code, rules.int(5));
                books.insert(b.voucher_code.as_str(), rules.int(5));
                reads.rules.insert(b.voucher_code.clone(), found);
            }
            rules.reset();
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = reads.leases.entry(b.lease_id) {
            lease.bind_int(1, b.lease_id)?;
            if lease.step()? {
                slot.insert(LeaseRoom {
                    voucher_code: lease.text(0),
                    active: lease.text(1) == "ACTIVE",
                    room: lease.int(2),
                });
            }
            lease.reset();
        }
    }
    let mut stored = db.prepare(READ_STORED)?;
    for b in batches {
        // A batch of an unknown voucher, or of one that takes no new reservations now, is
        // refused whole: no counts to load for it.
        let known = reads.rules.get(&b.voucher_code).is_some_and(|r| {
            super::refuses_new(&r.status, r.starts_at, r.ends_at, b.now).is_none()
        });
        let counts = if known {
            let books = books.get(b.voucher_code.as_str()).copied();
            Some(usage.voucher(db, &b.voucher_code, books)?)
        } else {
            None
        };
        for row in &b.rows {
            stored.bind_text(1, &row.order_id)?;
            if stored.step()? {
                let status = stored.text(3);
                let r = Reservation {
                    order_id: row.order_id.clone(),
                    voucher_code: stored.text(0),
                    customer_id: stored.int(1),
                    discount_amount: stored.int(2),
                    status: ReservationStatus::parse(&status)
                        .ok_or(LedgerError::Invalid("stored reservation status"))?,
                    expires_at: stored.int(4),
                };
                reads.stored.insert(r.order_id.clone(), r);
            }
            stored.reset();
            let used = counts.map_or(0, |c| c.of(row.customer_id));
            if used > 0 {
                reads
                    .used
                    .entry(b.voucher_code.clone())
                    .or_default()
                    .insert(row.customer_id, used);
            }
        }
    }
    Ok(reads)
}

/// The four writes of a merged transaction. The fence is checked once more in SQL: a lease
/// that lost its room since the read (only another writer could do that) fails the whole
/// transaction rather than commit past it.
fn write_merged(db: &raw::Db, w: &MergedWrites) -> Result<(), LedgerError> {
    if w.rows.is_empty() {
        return Ok(());
    }
    // The fence once more, per lease: a lease that lost its room since the read (only another
    // writer could do that) fails the whole transaction.
    let mut fence = db.prepare(FENCE)?;
    for &(lease, units) in &w.consumed {
        fence.bind_int(1, lease)?;
        fence.bind_int(2, units)?;
        fence.execute()?;
        if db.changes() != 1 {
            return Err(LedgerError::database("lease changed under a merged commit"));
        }
    }
    drop(fence);
    // The feed's numbers for the new rows, in the rows' order (the writer is alone: nobody
    // takes numbers in between). An update and a read rather than `UPDATE … RETURNING`, which
    // SQLite runs through a temporary B-tree of the returned rows, opened at every commit.
    let n = w.rows.len() as i64;
    let mut take = db.prepare(FEED_TAKE)?;
    take.bind_int(1, n)?;
    if db.run(take)? != 1 {
        return Err(LedgerError::Invalid("feed_head row missing"));
    }
    let base = {
        let mut last = db.prepare(FEED_LAST)?;
        if !last.step()? {
            return Err(LedgerError::Invalid("feed_head row missing"));
        }
        last.int(0) - n
    };
    // One prepared insert, run once per row: cheaper than one statement over a JSON array,
    // where every column of every row is a `json_extract` of its element.
    let mut insert = db.prepare(INSERT_RESERVATION)?;
    for (seq, r) in (base + 1..).zip(&w.rows) {
        insert.bind_text(1, r.order_id)?;
        insert.bind_text(2, r.voucher_code)?;
        insert.bind_int(3, r.customer_id)?;
        insert.bind_int(4, r.lease_id)?;
        insert.bind_int(5, r.discount_amount)?;
        insert.bind_int(6, r.created_at)?;
        insert.bind_int(7, r.expires_at)?;
        insert.bind_int(8, seq)?;
        // A row that cannot go in (an order id stored meanwhile) fails here, and the whole
        // transaction with it: nothing of it is acknowledged.
        insert.execute()?;
    }
    drop(insert);
    let mut counted = db.prepare(COUNT_RESERVED)?;
    for (code, units) in &w.reserved {
        counted.bind_text(1, code)?;
        counted.bind_int(2, *units)?;
        counted.execute()?;
    }
    Ok(())
}

/// One merged transaction, start to commit, on the calling thread; the writer's usage counts
/// take its new rows once it committed.
fn apply_merged(
    db: &raw::Db,
    usage: &mut UsageCache,
    batches: &[Batch],
) -> Result<BatchResults, LedgerError> {
    let tx = db.begin()?;
    usage.check_writers(db)?;
    let reads = read_merged(db, usage, batches)?;
    let (results, writes) = plan_merged(batches, reads);
    write_merged(db, &writes)?;
    tx.commit()?;
    // The rows come batch by batch: one lookup per run of one voucher's rows.
    for rows in writes
        .rows
        .chunk_by(|a, b| a.voucher_code == b.voucher_code)
    {
        usage.taken(rows[0].voucher_code, rows.iter().map(|r| r.customer_id));
    }
    usage.committed();
    Ok(results)
}

/// Moves `min(want, free)` units into a new ACTIVE lease, in one transaction.
fn grant_on(
    db: &raw::Db,
    code: &str,
    node: &str,
    want: i64,
    now: Millis,
    ttl_ms: i64,
) -> Result<Grant, LedgerError> {
    let tx = db.begin()?;
    let (free, leased_unused, ever_reserved) = {
        let mut q = db.prepare(
            "SELECT free, (SELECT COALESCE(SUM(granted - consumed), 0) FROM leases \
             WHERE voucher_code = ?1 AND state = 'ACTIVE'), reserved + confirmed + released \
             FROM vouchers WHERE code = ?1",
        )?;
        q.bind_text(1, code)?;
        if !q.step()? {
            return Err(LedgerError::NotFound);
        }
        (q.int(0), q.int(1), q.int(2))
    };
    let units = want.max(1).min(free);
    let lease = if units > 0 {
        let mut take = db.prepare("UPDATE vouchers SET free = free - ?2 WHERE code = ?1")?;
        take.bind_text(1, code)?;
        take.bind_int(2, units)?;
        db.run(take)?;
        let expires_at = now + ttl_ms;
        let mut insert = db.prepare(
            "INSERT INTO leases (voucher_code, node_id, granted, consumed, state, granted_at, \
             expires_at) VALUES (?1, ?2, ?3, 0, 'ACTIVE', ?4, ?5) RETURNING id",
        )?;
        insert.bind_text(1, code)?;
        insert.bind_text(2, node)?;
        insert.bind_int(3, units)?;
        insert.bind_int(4, now)?;
        insert.bind_int(5, expires_at)?;
        if !insert.step()? {
            return Err(LedgerError::Invalid("lease insert returned no id"));
        }
        let id = insert.int(0);
        drop(insert);
        Some(Lease {
            id,
            granted: units,
            expires_at,
        })
    } else {
        None
    };
    tx.commit()?;
    Ok(Grant {
        ever_reserved: lease.is_none().then_some(ever_reserved),
        lease,
        free_after: free - units,
        leased_unused,
    })
}

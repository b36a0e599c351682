//! Opening the embedded ledger: the file's connection options, its pools (one writer, a few
//! readers, one checkpointer), the migrations, and the background checkpointer that copies the
//! write-ahead log back into the file off the writer's thread.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use super::{raw, SqliteLedger};

/// The schema's versions, applied in order (`schema_migrations` records each).
pub(super) const MIGRATIONS: &[(i64, &str)] = &[
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
    (
        9,
        include_str!("../../../migrations/sqlite/0009_long_tail.sql"),
    ),
    (
        10,
        include_str!("../../../migrations/sqlite/0010_leases_by_voucher.sql"),
    ),
];

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
            None,
        )
        .await?;
        migrate(&writer).await?;
        // Readers would close after 20 s unused (sqlx then opens one again, so one is always
        // ready), but the pool hands its idle connections out in turn and the jobs take one
        // several times a second, so while they run no reader sits unused that long. So each
        // keeps a page cache of at most READER_CACHE_KIB, filled by whatever it last read (a
        // flood of first reserves on a long tail, then the recounts, fill them all).
        let reader = pool(
            readers.max(1),
            options
                .clone()
                .read_only(true)
                .pragma("cache_size", format!("-{READER_CACHE_KIB}")),
            Some(READER_IDLE),
        )
        .await?;
        let checkpointer = pool(1, options, None).await?;
        let checkpoints = tokio::spawn(checkpoint_every(checkpointer, CHECKPOINT_EVERY));
        Ok(Self {
            writer: Default::default(),
            writer_pool: writer,
            reader,
            checkpoints: checkpoints.abort_handle(),
        })
    }
}

/// How long a reader stays open unused.
const READER_IDLE: Duration = Duration::from_secs(20);

/// A reader's page cache, in KiB (SQLite's default is 2,000). Its reads are of rows spread
/// over a catalogue far larger than any cache (a merged read of 500 definitions, a recount of
/// 500 vouchers): what a cache keeps hot is the trees' inner pages within one statement (in WAL
/// mode a read transaction starts with an empty cache whenever the log changed, as it does
/// all through a sale), and a miss is a copy from the OS's cache of the file. Eight readers at 2 MiB kept 14 MB after a flood of first
/// reserves on a 1M-voucher catalogue (heaptrack, `pcache1Alloc`); the node held 72 MB before.
const READER_CACHE_KIB: u32 = 512;

/// A pool of `max` connections to the local file: no ping before each use, and kept open for
/// the ledger's life (a connection to a local file needs no recycling) unless `idle` closes
/// the ones unused that long (and one is opened again).
async fn pool(
    max: u32,
    options: SqliteConnectOptions,
    idle: Option<Duration>,
) -> Result<SqlitePool, sqlx::Error> {
    SqlitePoolOptions::new()
        .max_connections(max)
        .min_connections(u32::from(idle.is_some()))
        .idle_timeout(idle)
        .max_lifetime(None)
        .test_before_acquire(false)
        .acquire_timeout(CONNECTION_WAIT)
        .connect_with(options)
        .await
}

/// How long a call waits for a connection (a pool's, or the held writer) before it fails
/// (`PoolTimedOut`).
pub(super) const CONNECTION_WAIT: Duration = Duration::from_secs(5);

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

async fn migrate(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY)")
        .execute(pool)
        .await?;
    let newest: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
        .fetch_one(pool)
        .await?;
    crate::ledger::sql::refuse_newer_schema(newest, MIGRATIONS)?;
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

//! Opening the cluster ledger: the connection options (custom plans; statement and lock
//! timeouts at the ledger's deadline), the server to use among those `ledger.url` lists
//! ([`super::primary`]), the pool and the heartbeat's own connection, and the migrations, which
//! nodes starting together run one after the other.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::{Connection, Executor};

use super::primary::{Locator, Shape};
use super::target::Targets;
use super::PostgresLedger;

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
    (
        11,
        include_str!("../../../migrations/postgres/0011_long_tail.sql"),
    ),
    (
        12,
        include_str!("../../../migrations/postgres/0012_shards.sql"),
    ),
    (
        13,
        include_str!("../../../migrations/postgres/0013_claim_mode.sql"),
    ),
    // 14: retired, never to be reused. Builds of 1c59448 and b87f195 applied `placement.sql`
    // as version 14; it is now repeatable, and `migrate` deletes the row.
    (
        15,
        include_str!("../../../migrations/postgres/0015_usage_from_rows.sql"),
    ),
    (
        16,
        include_str!("../../../migrations/postgres/0016_generic_lease_plans.sql"),
    ),
];

/// Statements run after the migration's transaction commits (and after
/// [`BUILT_AFTER_MIGRATION`]), each on its own and in order (at every start; each is
/// idempotent), by [`drop_after_migration`]: what cannot run in a
/// transaction, or would take a second table's exclusive lock inside it.
const AFTER_MIGRATION: &[&str] = &[
    // Migration 15's index by customer replaces it.
    "DROP INDEX CONCURRENTLY IF EXISTS reservations_by_voucher",
    // Migration 16's index by voucher and state replaces it.
    "DROP INDEX CONCURRENTLY IF EXISTS leases_by_voucher",
    // The same index serves what this partial one of migration 1 did (a voucher's active
    // leases, by equality on both columns), and every grant wrote both.
    "DROP INDEX CONCURRENTLY IF EXISTS leases_active_by_voucher",
];

/// Indexes built after the migration's transaction with `CREATE INDEX CONCURRENTLY` (at every
/// start; a no-op once built), before [`AFTER_MIGRATION`] drops the ones they replace: `(name,
/// table and columns)`. Built inside the migration's transaction, an index would block its
/// table's writes for the whole build, on every node still serving (about a second per million
/// leases); built here, the statements that want it use the index it replaces meanwhile, and
/// re-plan onto it once it is valid.
const BUILT_AFTER_MIGRATION: &[(&str, &str)] = &[
    // Migration 16's: the lease functions' sums of a voucher's active leases.
    ("leases_by_voucher_state", "leases (voucher_code, state)"),
];

/// The class of the session advisory lock (keyed by the schema's hash) under which one node at
/// a time runs the steps after the migration: under it, an index found invalid is a build that
/// failed (nobody else is building it), and no node drops an index whose replacement another
/// node is still building.
const AFTER_MIGRATION_LOCK: i32 = 0x7663_6166;

/// Versions a build of this project once applied and later retired: their rows are deleted
/// before the schema's version is judged, so a database one of them touched opens here, and a
/// build from before them opens it again.
const RETIRED: &[i64] = &[14];

/// Definitions applied on every start after the versioned migrations (each is `CREATE OR
/// REPLACE`): a database made by an earlier build gets the function of this one. Version 2 made
/// the function first; an edit of it needs no new version.
const REPEATABLE: &[&str] = &[
    include_str!("../../../migrations/postgres/0002_merged_commit.sql"),
    include_str!("../../../migrations/postgres/0008_settle.sql"),
    include_str!("../../../migrations/postgres/grant.sql"),
    include_str!("../../../migrations/postgres/placement.sql"),
];

/// A ledger call boxed as `Send` for every lifetime (a task that opens a late store spawns
/// it; the sharded ledger's claim statements pass the directory's breaker as one).
pub(crate) type Pending<'a, T> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<T, crate::ledger::LedgerError>> + Send + 'a>,
>;

/// An arbitrary constant that names this schema's migration lock.
const MIGRATION_LOCK: i64 = 0x766f_7563_6865_7273;

impl PostgresLedger {
    pub async fn connect(
        url: &str,
        max_connections: u32,
        timeout_ms: u64,
        acquire_timeout_ms: u64,
    ) -> Result<Self, sqlx::Error> {
        let locator = locate(url, max_connections, timeout_ms, acquire_timeout_ms, false).await?;
        migrate(&locator.pool()).await?;
        locator.spawn();
        Ok(Self {
            locator,
            claimed: Default::default(),
            unopened: None,
            opened: Default::default(),
        })
    }

    /// [`PostgresLedger::connect`] for a store whose server is down now (a shard of a node that
    /// starts during that shard's outage): nothing is asked of the server yet, and every call
    /// fails as unreachable (a closed pool) until [`PostgresLedger::migrate_late`] and the
    /// caller's checks are done and [`PostgresLedger::opened`] says so.
    pub async fn connect_late(
        url: &str,
        max_connections: u32,
        timeout_ms: u64,
        acquire_timeout_ms: u64,
    ) -> Result<Self, sqlx::Error> {
        let locator = locate(url, max_connections, timeout_ms, acquire_timeout_ms, true).await?;
        locator.spawn();
        let closed = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(PgConnectOptions::new());
        closed.close().await;
        Ok(Self {
            locator,
            claimed: Default::default(),
            unopened: Some(closed),
            opened: Default::default(),
        })
    }

    /// Whether the store serves calls (every store but a late one not yet opened).
    pub(crate) fn is_open(&self) -> bool {
        self.unopened.is_none() || self.opened.load(std::sync::atomic::Ordering::Acquire)
    }

    /// A late store's migrations, on its server's pool (the store's own calls still fail).
    pub(crate) fn migrate_late(&self) -> Pending<'_, ()> {
        let pool = self.locator.pool();
        Box::pin(async move { Ok(migrate(&pool).await?) })
    }

    /// A late store, migrated and checked, serves calls from now on.
    pub(crate) fn opened(&self) {
        self.opened
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

/// The server to use among those `url` lists, and the node's pools on it (`wait`: see
/// [`Locator::start_up`]).
async fn locate(
    url: &str,
    max_connections: u32,
    timeout_ms: u64,
    acquire_timeout_ms: u64,
    wait: bool,
) -> Result<std::sync::Arc<Locator>, sqlx::Error> {
    let targets = Targets::parse(url)
        .map_err(|e| sqlx::Error::Configuration(e.into()))?
        .map_options(|o| session(o, timeout_ms));
    let shape = Shape {
        max_connections,
        acquire_timeout: Duration::from_millis(acquire_timeout_ms.max(1)),
    };
    let probe_timeout = Duration::from_millis(acquire_timeout_ms.clamp(200, 2000));
    Locator::start_up(targets, shape, probe_timeout, wait).await
}

/// The session every connection of the node opens with. Tables grow from empty within seconds
/// of a sale starting: a generic plan cached while they were tiny (a sequential scan) would stay
/// for the life of the connection, so plans are custom (they see the real table size every
/// time). The hot functions (the merged commit, a grant, a confirm or release) set their own
/// generic plans, kept off sequential scans, with their lookups written for the index they
/// need (migrations 2 and 16). A commit is acknowledged only once it is durable (and, where
/// the server names synchronous standbys, on one of them), whatever a role or database setting
/// says. No statement and no lock wait may hold a connection past the ledger's deadline.
fn session(options: PgConnectOptions, timeout_ms: u64) -> PgConnectOptions {
    let options = options.options([
        ("plan_cache_mode", "force_custom_plan"),
        ("synchronous_commit", "on"),
    ]);
    if timeout_ms == 0 {
        return options;
    }
    let ms = timeout_ms.to_string();
    options.options([
        ("statement_timeout", ms.as_str()),
        ("lock_timeout", ms.as_str()),
    ])
}

/// Takes the advisory lock `key` for the rest of the transaction `conn` is in (waiting for it).
pub(super) async fn xact_lock(conn: &mut sqlx::PgConnection, key: i64) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(key)
        .execute(conn)
        .await?;
    Ok(())
}

async fn migrate(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    // Nodes that start together migrate one after the other: the others wait for as long as a
    // migration takes (an index built over every reservation can take minutes), not for the
    // connection's deadlines, which apply again once the lock is had.
    (&mut *tx)
        .execute("SET LOCAL lock_timeout = 0; SET LOCAL statement_timeout = 0")
        .await?;
    xact_lock(&mut tx, MIGRATION_LOCK).await?;
    (&mut *tx)
        .execute("RESET lock_timeout; RESET statement_timeout")
        .await?;
    // Scripts go as simple queries (a `&str` without arguments: several statements each), not
    // through `raw_sql`, whose future is not `Send` for every lifetime (a late store migrates
    // on a spawned task).
    (&mut *tx)
        .execute("CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY)")
        .await?;
    sqlx::query("DELETE FROM schema_migrations WHERE version = ANY($1)")
        .bind(RETIRED)
        .execute(&mut *tx)
        .await?;
    // An older build would put back its own commit function (below) and write rows the
    // feed cannot see: it refuses a ledger a newer build migrated.
    let newest: i64 = sqlx::query_scalar("SELECT COALESCE(max(version), 0) FROM schema_migrations")
        .fetch_one(&mut *tx)
        .await?;
    crate::ledger::sql::refuse_newer_schema(newest, MIGRATIONS)?;
    for (version, sql) in MIGRATIONS {
        let done = sqlx::query("SELECT 1 FROM schema_migrations WHERE version = $1")
            .bind(version)
            .fetch_optional(&mut *tx)
            .await?;
        if done.is_none() {
            (&mut *tx).execute(*sql).await?;
            sqlx::query("INSERT INTO schema_migrations (version) VALUES ($1)")
                .bind(version)
                .execute(&mut *tx)
                .await?;
        }
    }
    for sql in REPEATABLE {
        (&mut *tx).execute(*sql).await?;
    }
    tx.commit().await?;
    tokio::spawn(drop_after_migration(pool.clone()));
    Ok(())
}

/// Builds [`BUILT_AFTER_MIGRATION`] and runs [`AFTER_MIGRATION`] on a connection of its own,
/// without the pool's deadlines (a concurrent drop waits for every transaction that uses the
/// table, a concurrent build for every transaction of the database older than its last phase,
/// whatever it reads: a long report, a dump), again after 1, 2, 4 … and then every 30 s until
/// every step has gone through, here or on another node. Meanwhile an index on its way out may
/// still be written: the error log says so. The connection is to the server the pool used at
/// the start: after a failover the steps wait for the node's next start.
async fn drop_after_migration(pool: PgPool) {
    let options = pool.connect_options();
    // Soon at first (a concurrent build waits for every older transaction of the database, any
    // table's), then every 30 s.
    let mut pause = Duration::from_secs(1);
    loop {
        let done: Result<bool, sqlx::Error> = async {
            let mut conn = sqlx::PgConnection::connect_with(&options).await?;
            conn.execute("SET lock_timeout = 0; SET statement_timeout = 0")
                .await?;
            let mine: bool =
                sqlx::query_scalar("SELECT pg_try_advisory_lock($1, hashtext(current_schema()))")
                    .bind(AFTER_MIGRATION_LOCK)
                    .fetch_one(&mut conn)
                    .await?;
            if !mine {
                // Another node runs them now; the next round finds them done (or takes over
                // if that node stopped: its lock went with its connection).
                conn.close().await?;
                return Ok(false);
            }
            for (name, on) in BUILT_AFTER_MIGRATION {
                if valid(&mut conn, name).await? == Some(false) {
                    // A build that failed leaves its index invalid, and `IF NOT EXISTS` would
                    // take it for built.
                    conn.execute(format!("DROP INDEX CONCURRENTLY IF EXISTS {name}").as_str())
                        .await?;
                }
                // A simple query of one statement: outside any transaction block.
                conn.execute(
                    format!("CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {on}").as_str(),
                )
                .await?;
                // Nothing it replaces is dropped unless it is there and valid.
                if valid(&mut conn, name).await? != Some(true) {
                    return Err(sqlx::Error::Protocol(format!(
                        "index {name} not valid after its build"
                    )));
                }
            }
            for sql in AFTER_MIGRATION {
                conn.execute(*sql).await?;
            }
            conn.close().await?;
            Ok(true)
        }
        .await;
        match done {
            Ok(true) => return,
            Ok(false) => {
                tracing::debug!(?pause, "another node runs the steps after the migration")
            }
            Err(e) => {
                tracing::error!(error = %e, ?pause, "a step after the migration failed");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(30));
    }
}

/// Whether the index `name` of the connection's schema is valid (`None`: there is none). A
/// concurrent build that failed leaves it invalid. The schema by its name as the catalog holds
/// it, so that a name that needs quoting is found too.
async fn valid(conn: &mut sqlx::PgConnection, name: &str) -> Result<Option<bool>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relname = $1 AND n.nspname = current_schema()",
    )
    .bind(name)
    .fetch_optional(conn)
    .await
}

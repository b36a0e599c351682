//! The embedded ledger's one writer connection: taken from its pool at first use and held for
//! the ledger's life, locked for each write, lent raw to the merged commit and the grants
//! ([`super::raw`]) with the statements prepared on it, dropped and replaced when it can no
//! longer be trusted, and closed after its statements when the ledger drops.

use sqlx::sqlite::SqliteConnection;

use super::open::CONNECTION_WAIT;
use super::raw;
use super::usage::UsageCache;
use super::SqliteLedger;
use crate::ledger::LedgerError;

/// The writer connection, held out of its pool for the ledger's life, and the statements
/// [`SqliteLedger::on_writer`] prepared on it. The statements must be finalized before the
/// connection closes (sqlx panics closing a connection with statements left), and a pool closes
/// a connection on its own when it cannot hand it back (a runtime shutting down): held here,
/// it closes only after [`SqliteLedger`]'s drop cleared the statements, or after `on_writer`
/// did, when it drops a broken connection.
#[derive(Default)]
pub(super) struct Writer {
    conn: Option<sqlx::pool::PoolConnection<sqlx::Sqlite>>,
    stmts: raw::StmtCache,
    /// Each customer's usage of the vouchers on sale, counted from the rows this connection
    /// wrote (see [`super::usage`]).
    usage: UsageCache,
}

impl Writer {
    /// The connection, for sqlx's own statements (which run through its worker thread).
    pub(super) fn conn(&mut self) -> Result<&mut SqliteConnection, LedgerError> {
        self.conn.as_deref_mut().ok_or_else(writer_missing)
    }

    /// The connection and the usage counts, for a status change that moves a count.
    pub(super) fn conn_and_usage(
        &mut self,
    ) -> Result<(&mut SqliteConnection, &mut UsageCache), LedgerError> {
        let conn = self.conn.as_deref_mut().ok_or_else(writer_missing)?;
        Ok((conn, &mut self.usage))
    }
}

/// [`SqliteLedger::writer`] always leaves a connection in place: this is never seen.
pub(super) fn writer_missing() -> LedgerError {
    LedgerError::database("sqlite writer missing")
}

impl SqliteLedger {
    /// The writer connection, locked for the caller (taken from its pool at first use). Waits
    /// no longer than the pool would have ([`CONNECTION_WAIT`]): a write queued behind a stuck
    /// one fails rather than run long after its caller gave up.
    pub(super) async fn writer(&self) -> Result<tokio::sync::MutexGuard<'_, Writer>, sqlx::Error> {
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
    pub(super) async fn on_writer<T>(
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

//! A minimal, safe wrapper over the SQLite C API for the one path where sqlx's worker thread
//! costs more than the work: the node's merged group commit.
//!
//! sqlx runs every SQLite statement on a worker thread of its own and hands each command and
//! its result across a channel, so a transaction of ten statements is twenty thread hand-offs.
//! On a busy 2-core machine each hand-off waits for a time slice, and the single writer spends
//! most of a commit waiting rather than writing. Here the commit locks the connection's handle
//! out of the worker (`SqliteConnection::lock_handle`, sqlx's supported escape hatch) and runs
//! the whole transaction on the calling thread. The connection is the same one sqlx uses, so
//! its settings (WAL, `synchronous = FULL`, busy timeout, foreign keys) apply unchanged.
//!
//! Lease grants, the other frequent write, take the same path. Only what they need is wrapped:
//! prepare, bind text and integers, step, read integer and text columns, count changes. [`Tx`]
//! rolls back on drop unless committed, so the handle goes back to sqlx never inside a
//! transaction.
//!
//! Statements are prepared once per connection and kept in a [`StmtCache`]: parsing and
//! planning the merged commit's ten statements again at every commit was a seventh of the
//! writer's time. A statement goes back to the cache reset and unbound when its [`Stmt`] drops;
//! the cache must be [cleared](StmtCache::clear) before its connection closes (sqlx's close
//! panics on a connection with statements left).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, CStr};
use std::ptr::{self, NonNull};

use libsqlite3_sys as ffi;

use crate::ledger::LedgerError;

/// Turns off SQLite's allocation statistics, process-wide, if SQLite has not started yet.
///
/// With them on (the default), every allocation SQLite makes takes one global mutex to count
/// itself: a tenth of the writer's time in a merged commit went to that mutex's lock and unlock.
/// Nothing here reads the statistics. Once SQLite has initialized (at the process's first
/// connection) it refuses the change (`SQLITE_MISUSE`), which only leaves the default, so this
/// runs before the ledger's first open. SQLite asks that nothing else use it while
/// `sqlite3_config` runs: in the service the ledger is the first to open SQLite, on one thread;
/// tests that open SQLite in parallel can at worst miscount the statistics nobody reads.
pub(crate) fn quiet_allocator() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: `sqlite3_config` is safe to call before SQLite initializes, and refuses
        // (without effect) after; MEMSTATUS takes one int argument.
        let off: c_int = 0;
        let rc = unsafe { ffi::sqlite3_config(ffi::SQLITE_CONFIG_MEMSTATUS, off) };
        if rc != ffi::SQLITE_OK {
            tracing::debug!(rc, "sqlite already started: allocation statistics stay on");
        }
    });
}

/// An error from SQLite, as the ledger reports it: the database answering, with its extended
/// result code (as sqlx reports SQLite's codes).
fn error(db: NonNull<ffi::sqlite3>, what: &str) -> LedgerError {
    // SAFETY: `db` is a live handle; sqlite3_errmsg returns a NUL-terminated string it owns.
    let (code, msg) = unsafe {
        (
            ffi::sqlite3_extended_errcode(db.as_ptr()),
            CStr::from_ptr(ffi::sqlite3_errmsg(db.as_ptr())),
        )
    };
    LedgerError::Database {
        code: Some(code.to_string()),
        source: format!("sqlite {what}: {}", msg.to_string_lossy()).into(),
    }
}

type Prepared = HashMap<&'static str, NonNull<ffi::sqlite3_stmt>>;

/// The prepared statements of one connection, by their SQL, kept between transactions.
#[derive(Default)]
pub(crate) struct StmtCache {
    /// The connection the statements belong to: a statement is only ever run on its own.
    handle: Option<NonNull<ffi::sqlite3>>,
    stmts: RefCell<Prepared>,
}

// SAFETY: the statements are only touched through a `Db` on their own connection, which the
// caller has locked out of every other thread (see `Db::new`), or in `clear`, whose caller
// must hold the same lock.
unsafe impl Send for StmtCache {}

impl StmtCache {
    /// Finalizes every statement; the cache is empty afterwards.
    ///
    /// # Safety
    /// The statements' connection must be live and locked out of sqlx's worker (its
    /// `LockedSqliteHandle` held), so no other thread uses it meanwhile.
    pub(crate) unsafe fn clear(&mut self) {
        for (_, stmt) in self.stmts.get_mut().drain() {
            // SAFETY: per the contract; each statement is finalized once, as it leaves the map.
            unsafe {
                ffi::sqlite3_finalize(stmt.as_ptr());
            }
        }
        self.handle = None;
    }

    /// Empties the cache without finalizing: for a connection whose worker crashed with the
    /// handle, which nothing may touch any more (its statements leak with it).
    pub(crate) fn forget(&mut self) {
        self.stmts.get_mut().clear();
        self.handle = None;
    }
}

/// A borrowed connection handle, locked out of sqlx's worker for as long as this lives.
pub(crate) struct Db<'c> {
    handle: NonNull<ffi::sqlite3>,
    stmts: &'c RefCell<Prepared>,
}

impl<'c> Db<'c> {
    /// # Safety
    /// `handle` must be a live connection that no other thread uses while this value lives
    /// (sqlx guarantees that while its `LockedSqliteHandle` is held), and `cache` must hold
    /// statements of this connection or none (it is emptied here if it names another one).
    pub(crate) unsafe fn new(handle: NonNull<ffi::sqlite3>, cache: &'c mut StmtCache) -> Self {
        if cache.handle != Some(handle) {
            let stale = cache.stmts.get_mut().len();
            if stale > 0 {
                // Their connection was closed under them (it cannot be finalized now): drop
                // the pointers rather than run them on a connection they do not belong to.
                tracing::error!(stale, "sqlite statement cache outlived its connection");
                cache.stmts.get_mut().clear();
            }
            cache.handle = Some(handle);
        }
        Self {
            handle,
            stmts: &cache.stmts,
        }
    }

    /// The statement for `sql`: the one prepared earlier on this connection if it is not in
    /// use, else a new one. It goes back to the cache when it drops (finalized instead if the
    /// cache meanwhile got another statement for the same SQL).
    pub(crate) fn prepare(&self, sql: &'static str) -> Result<Stmt<'_, 'c>, LedgerError> {
        if let Some(stmt) = self.stmts.borrow_mut().remove(sql) {
            return Ok(Stmt {
                db: self,
                stmt,
                sql,
            });
        }
        let mut stmt = ptr::null_mut();
        let len = c_int::try_from(sql.len()).map_err(|_| error(self.handle, "sql too long"))?;
        // SAFETY: the handle is live; `sql` is valid for `len` bytes; the out pointer is ours.
        let rc = unsafe {
            ffi::sqlite3_prepare_v3(
                self.handle.as_ptr(),
                sql.as_ptr().cast(),
                len,
                ffi::SQLITE_PREPARE_PERSISTENT,
                &mut stmt,
                ptr::null_mut(),
            )
        };
        match NonNull::new(stmt) {
            Some(stmt) if rc == ffi::SQLITE_OK => Ok(Stmt {
                db: self,
                stmt,
                sql,
            }),
            _ => Err(error(self.handle, "prepare")),
        }
    }

    /// Runs a statement that returns no rows, with its parameters already bound; returns the
    /// rows it changed.
    pub(crate) fn run(&self, mut stmt: Stmt<'_, 'c>) -> Result<u64, LedgerError> {
        while stmt.step()? {}
        Ok(self.changes())
    }

    /// Rows the last finished statement changed.
    pub(crate) fn changes(&self) -> u64 {
        // SAFETY: the handle is live.
        unsafe { ffi::sqlite3_changes64(self.handle.as_ptr()) as u64 }
    }

    /// Whether the connection is outside any transaction.
    pub(crate) fn autocommit(&self) -> bool {
        // SAFETY: the handle is live.
        unsafe { ffi::sqlite3_get_autocommit(self.handle.as_ptr()) != 0 }
    }

    /// Begins a write transaction at once (the write lock is taken now, not at the first write).
    pub(crate) fn begin(&self) -> Result<Tx<'_, 'c>, LedgerError> {
        self.begin_with("BEGIN IMMEDIATE")
    }

    /// Begins a transaction that only reads (its snapshot is taken at its first read; no write
    /// lock); it ends, rolled back, when dropped.
    pub(crate) fn begin_read(&self) -> Result<Tx<'_, 'c>, LedgerError> {
        self.begin_with("BEGIN")
    }

    fn begin_with(&self, sql: &'static str) -> Result<Tx<'_, 'c>, LedgerError> {
        self.run(self.prepare(sql)?)?;
        Ok(Tx {
            db: self,
            done: false,
        })
    }
}

/// An open transaction; rolled back on drop unless [`Tx::commit`] succeeded.
pub(crate) struct Tx<'a, 'c> {
    db: &'a Db<'c>,
    done: bool,
}

impl Tx<'_, '_> {
    pub(crate) fn commit(mut self) -> Result<(), LedgerError> {
        self.db.run(self.db.prepare("COMMIT")?)?;
        self.done = true;
        Ok(())
    }
}

impl Drop for Tx<'_, '_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.db.prepare("ROLLBACK").and_then(|s| self.db.run(s));
        }
    }
}

/// A prepared statement, in use: back to its connection's cache on drop.
pub(crate) struct Stmt<'a, 'c> {
    db: &'a Db<'c>,
    stmt: NonNull<ffi::sqlite3_stmt>,
    /// Its key in the cache.
    sql: &'static str,
}

impl Stmt<'_, '_> {
    pub(crate) fn bind_text(&mut self, index: c_int, text: &str) -> Result<(), LedgerError> {
        let len = c_int::try_from(text.len()).map_err(|_| error(self.db.handle, "bind"))?;
        // SAFETY: the statement is live; SQLITE_TRANSIENT makes SQLite copy the bytes.
        let rc = unsafe {
            ffi::sqlite3_bind_text(
                self.stmt.as_ptr(),
                index,
                text.as_ptr().cast(),
                len,
                ffi::SQLITE_TRANSIENT(),
            )
        };
        if rc == ffi::SQLITE_OK {
            Ok(())
        } else {
            Err(error(self.db.handle, "bind"))
        }
    }

    pub(crate) fn bind_int(&mut self, index: c_int, value: i64) -> Result<(), LedgerError> {
        // SAFETY: the statement is live.
        let rc = unsafe { ffi::sqlite3_bind_int64(self.stmt.as_ptr(), index, value) };
        if rc == ffi::SQLITE_OK {
            Ok(())
        } else {
            Err(error(self.db.handle, "bind"))
        }
    }

    /// Binds `value`, or NULL for `None`.
    pub(crate) fn bind_opt_int(
        &mut self,
        index: c_int,
        value: Option<i64>,
    ) -> Result<(), LedgerError> {
        match value {
            Some(v) => self.bind_int(index, v),
            // SAFETY: the statement is live.
            None => match unsafe { ffi::sqlite3_bind_null(self.stmt.as_ptr(), index) } {
                ffi::SQLITE_OK => Ok(()),
                _ => Err(error(self.db.handle, "bind")),
            },
        }
    }

    /// Advances to the next row: true while there is one.
    pub(crate) fn step(&mut self) -> Result<bool, LedgerError> {
        // SAFETY: the statement is live.
        match unsafe { ffi::sqlite3_step(self.stmt.as_ptr()) } {
            ffi::SQLITE_ROW => Ok(true),
            ffi::SQLITE_DONE => Ok(false),
            _ => Err(error(self.db.handle, "step")),
        }
    }

    /// Runs a statement that returns no rows, with its parameters bound, and makes it ready to
    /// run again with new bindings: one prepared statement serves every row of a set.
    pub(crate) fn execute(&mut self) -> Result<(), LedgerError> {
        while self.step()? {}
        self.reset();
        Ok(())
    }

    /// Ends the current run (rows not read are dropped), ready to step again with new
    /// bindings. Only after a step that did not fail: its caller gives a failed statement up.
    pub(crate) fn reset(&mut self) {
        // SAFETY: the statement is live. After a successful step the code returned is OK.
        unsafe {
            ffi::sqlite3_reset(self.stmt.as_ptr());
        }
    }

    pub(crate) fn int(&self, col: c_int) -> i64 {
        // SAFETY: the statement is live and positioned on a row (callers read after `step`).
        unsafe { ffi::sqlite3_column_int64(self.stmt.as_ptr(), col) }
    }

    pub(crate) fn text(&self, col: c_int) -> String {
        // SAFETY: as `int`; the pointer and length describe the column's bytes until the next
        // step, and they are copied at once.
        unsafe {
            let p = ffi::sqlite3_column_text(self.stmt.as_ptr(), col);
            let n = ffi::sqlite3_column_bytes(self.stmt.as_ptr(), col);
            if p.is_null() || n <= 0 {
                return String::new();
            }
            String::from_utf8_lossy(std::slice::from_raw_parts(p, n as usize)).into_owned()
        }
    }
}

impl Drop for Stmt<'_, '_> {
    fn drop(&mut self) {
        // SAFETY: the statement is live. Reset ends any run in progress (a read left mid-rows
        // would hold the read snapshot open); its code repeats the last step's error, which
        // was reported then. A statement already in the cache (two in use at once) is
        // finalized instead, exactly once, as it is not stored.
        unsafe {
            ffi::sqlite3_reset(self.stmt.as_ptr());
            ffi::sqlite3_clear_bindings(self.stmt.as_ptr());
            let mut stmts = self.db.stmts.borrow_mut();
            if stmts.contains_key(self.sql) {
                ffi::sqlite3_finalize(self.stmt.as_ptr());
            } else {
                stmts.insert(self.sql, self.stmt);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use sqlx::{Connection, SqliteConnection};

    use super::*;

    impl StmtCache {
        /// The cached statements, by SQL.
        fn held(&self) -> Vec<(&'static str, NonNull<ffi::sqlite3_stmt>)> {
            self.stmts.borrow().iter().map(|(k, v)| (*k, *v)).collect()
        }
    }

    const ROWS: &str = "SELECT value FROM json_each('[1, 2, 3]')";

    /// A statement is prepared once per connection: the second use gets the same one back,
    /// reset (a run left mid-rows, as an early return leaves it, holds nothing open) and
    /// unbound. Two uses at once get two statements, and the cache keeps one.
    #[tokio::test]
    async fn statements_are_prepared_once_and_come_back_reset() {
        let mut conn = SqliteConnection::connect("sqlite::memory:").await.unwrap();
        let mut locked = conn.lock_handle().await.unwrap();
        let mut cache = StmtCache::default();
        {
            // SAFETY: the handle is locked for this block; the cache is new.
            let db = unsafe { Db::new(locked.as_raw_handle(), &mut cache) };
            let mut q = db.prepare(ROWS).unwrap();
            assert!(q.step().unwrap());
            assert_eq!(q.int(0), 1);
            let first = q.stmt;
            drop(q); // mid-rows
            let mut again = db.prepare(ROWS).unwrap();
            assert_eq!(again.stmt, first, "prepared again instead of reused");
            // SAFETY: the statement is live.
            assert_eq!(unsafe { ffi::sqlite3_stmt_busy(again.stmt.as_ptr()) }, 0);
            assert!(again.step().unwrap());
            assert_eq!(again.int(0), 1, "the reused statement resumed mid-rows");
            // `reset` keeps the bindings (a merged commit binds a batch's voucher once for
            // all its rows); the statement's return to the cache drops them.
            let mut bound = db.prepare("SELECT ?1").unwrap();
            let first_bound = bound.stmt;
            bound.bind_int(1, 7).unwrap();
            assert!(bound.step().unwrap());
            bound.reset();
            assert!(bound.step().unwrap());
            assert_eq!(bound.int(0), 7, "reset dropped a binding");
            drop(bound);
            let mut bound = db.prepare("SELECT ?1").unwrap();
            assert_eq!(bound.stmt, first_bound, "prepared again instead of reused");
            assert!(bound.step().unwrap());
            // SAFETY: the statement is live and on a row.
            let kind = unsafe { ffi::sqlite3_column_type(bound.stmt.as_ptr(), 0) };
            assert_eq!(
                kind,
                ffi::SQLITE_NULL,
                "a binding survived the statement's return"
            );
            drop(bound);
            let twice = db.prepare(ROWS).unwrap();
            assert_ne!(twice.stmt, again.stmt);
            drop(twice);
            drop(again);
        }
        let held = cache.held();
        assert_eq!(held.len(), 2, "one statement per SQL: {held:?}");
        for (_, stmt) in held {
            // SAFETY: the statements are live until the cache is cleared below.
            assert_eq!(unsafe { ffi::sqlite3_stmt_busy(stmt.as_ptr()) }, 0);
        }
        // SAFETY: the handle is still locked and live.
        unsafe { cache.clear() };
        assert!(cache.held().is_empty());
        drop(locked);
        conn.close().await.unwrap();
    }
}

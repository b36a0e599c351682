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
//! Lease grants, the other frequent write, take the same path. Only what they need is wrapped: prepare, bind text and integers, step, read integer
//! and text columns, count changes. Every statement is finalized on drop, and [`Tx`] rolls back
//! on drop unless committed, so the handle goes back to sqlx never inside a transaction.

use std::ffi::{c_int, CStr};
use std::ptr::{self, NonNull};

use libsqlite3_sys as ffi;

use super::LedgerError;

/// An error from SQLite, as the ledger reports it.
fn error(db: NonNull<ffi::sqlite3>, what: &str) -> LedgerError {
    // SAFETY: `db` is a live handle; sqlite3_errmsg returns a NUL-terminated string it owns.
    let msg = unsafe { CStr::from_ptr(ffi::sqlite3_errmsg(db.as_ptr())) };
    LedgerError::Unavailable(sqlx::Error::Protocol(format!(
        "sqlite {what}: {}",
        msg.to_string_lossy()
    )))
}

/// A borrowed connection handle, locked out of sqlx's worker for as long as this lives.
pub(crate) struct Db {
    handle: NonNull<ffi::sqlite3>,
}

impl Db {
    /// # Safety
    /// `handle` must be a live connection that no other thread uses while this value lives
    /// (sqlx guarantees that while its `LockedSqliteHandle` is held).
    pub(crate) unsafe fn new(handle: NonNull<ffi::sqlite3>) -> Self {
        Self { handle }
    }

    pub(crate) fn prepare(&self, sql: &str) -> Result<Stmt<'_>, LedgerError> {
        let mut stmt = ptr::null_mut();
        let len = c_int::try_from(sql.len()).map_err(|_| error(self.handle, "sql too long"))?;
        // SAFETY: the handle is live; `sql` is valid for `len` bytes; the out pointer is ours.
        let rc = unsafe {
            ffi::sqlite3_prepare_v2(
                self.handle.as_ptr(),
                sql.as_ptr().cast(),
                len,
                &mut stmt,
                ptr::null_mut(),
            )
        };
        match NonNull::new(stmt) {
            Some(stmt) if rc == ffi::SQLITE_OK => Ok(Stmt { db: self, stmt }),
            _ => Err(error(self.handle, "prepare")),
        }
    }

    /// Prepares a statement with one text parameter (the rows of a set-based statement, as
    /// JSON) bound to `?1`.
    pub(crate) fn query(&self, sql: &str, json: &str) -> Result<Stmt<'_>, LedgerError> {
        let mut stmt = self.prepare(sql)?;
        stmt.bind_text(1, json)?;
        Ok(stmt)
    }

    /// Runs a statement that returns no rows, with its parameters already bound; returns the
    /// rows it changed.
    pub(crate) fn run(&self, mut stmt: Stmt<'_>) -> Result<u64, LedgerError> {
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
    pub(crate) fn begin(&self) -> Result<Tx<'_>, LedgerError> {
        self.run(self.prepare("BEGIN IMMEDIATE")?)?;
        Ok(Tx {
            db: self,
            done: false,
        })
    }
}

/// An open transaction; rolled back on drop unless [`Tx::commit`] succeeded.
pub(crate) struct Tx<'a> {
    db: &'a Db,
    done: bool,
}

impl Tx<'_> {
    pub(crate) fn commit(mut self) -> Result<(), LedgerError> {
        self.db.run(self.db.prepare("COMMIT")?)?;
        self.done = true;
        Ok(())
    }
}

impl Drop for Tx<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.db.prepare("ROLLBACK").and_then(|s| self.db.run(s));
        }
    }
}

/// A prepared statement, finalized on drop.
pub(crate) struct Stmt<'a> {
    db: &'a Db,
    stmt: NonNull<ffi::sqlite3_stmt>,
}

impl Stmt<'_> {
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
        // SAFETY: the statement is live. It is reset only after it ran to its end, so the code
        // returned is OK (a failed step returned above, and its caller gives the statement up).
        unsafe {
            ffi::sqlite3_reset(self.stmt.as_ptr());
        }
        Ok(())
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

impl Drop for Stmt<'_> {
    fn drop(&mut self) {
        // SAFETY: the statement is live and finalized exactly once.
        unsafe {
            ffi::sqlite3_finalize(self.stmt.as_ptr());
        }
    }
}

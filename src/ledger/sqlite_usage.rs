//! The embedded ledger's per-customer usage, kept in memory by its one writer.
//!
//! A customer's usage of a voucher is the number of their reservations of it that are not
//! RELEASED (migration 6). SQLite used to read it off an index on `(voucher, customer,
//! status)`; with a real sale's customers, who come in no order, every reservation then
//! dirtied a random leaf page of that index, and on SQLite every such page is a write-ahead-log
//! frame of its own (two writes, a checksum, a share of the commit's `fsync`, a copy back at
//! the checkpoint). Migration 8 drops that index: the writer counts usage here instead.
//!
//! The counts are a cache of the rows, never a second source of truth:
//! - a voucher's counts are loaded from its rows the first time a merged commit (or a usage
//!   read) needs them, on the writer's connection, before anything of that transaction is
//!   written;
//! - they change only after the transaction that changed the rows committed (a merged commit's
//!   inserts, a release, an expiry sweep); a confirmation keeps the count;
//! - any write that failed, or whose outcome is not known, drops them all (the next use loads
//!   from the rows again), and so does a commit of any other connection to the file (another
//!   process, or a second handle on it, as the tests open): each merged commit reads SQLite's
//!   `data_version` first, which changes exactly when another connection committed;
//! - a voucher no commit used for [`SWEEP_EVERY`] merged commits is dropped, so the memory held
//!   is that of the vouchers on sale (about 40 bytes per customer who holds a unit).
//!
//! Two processes writing one ledger stay correct, then, but each one's commits make the other
//! load its counts again: the embedded ledger is meant for one node.

use std::collections::HashMap;

use super::sqlite_raw as raw;
use super::LedgerError;

/// Merged commits between two sweeps of the vouchers no commit used meanwhile.
pub(crate) const SWEEP_EVERY: u32 = 4096;

/// A voucher's customers who hold units, as two range reads of the `(voucher, status)` index:
/// equality on the whole key, not `IN (list)` (a temporary B-tree) nor `<> 'RELEASED'` (which
/// would walk the released rows, as many as clients care to make).
pub(crate) const LOAD_RESERVED: &str =
    "SELECT customer_id FROM reservations WHERE voucher_code = ?1 AND status = 'RESERVED'";
pub(crate) const LOAD_CONFIRMED: &str =
    "SELECT customer_id FROM reservations WHERE voucher_code = ?1 AND status = 'CONFIRMED'";

const DATA_VERSION: &str = "PRAGMA data_version";

/// Usage per voucher and customer, for the vouchers loaded.
#[derive(Default)]
pub(crate) struct UsageCache {
    vouchers: HashMap<String, VoucherUsage>,
    /// Merged commits since the last sweep.
    commits: u32,
    /// The writer connection's `PRAGMA data_version` when the counts were last checked: it
    /// moves when another connection commits to the file.
    data_version: Option<i64>,
}

#[derive(Default)]
struct VoucherUsage {
    /// Customers with a usage above zero.
    customers: HashMap<i64, i64>,
    /// Whether a commit used this voucher since the last sweep.
    touched: bool,
}

impl UsageCache {
    /// `customer`'s usage of `code`, loading the voucher's counts from its rows if they are
    /// not here. Call it only with no write of the current transaction made yet.
    pub(crate) fn used(
        &mut self,
        db: &raw::Db,
        code: &str,
        customer: i64,
    ) -> Result<i64, LedgerError> {
        let v = match self.vouchers.get_mut(code) {
            Some(v) => v,
            None => {
                let loaded = load(db, code)?;
                self.vouchers.entry(code.to_owned()).or_insert(loaded)
            }
        };
        v.touched = true;
        Ok(v.customers.get(&customer).copied().unwrap_or(0))
    }

    /// Applies a committed change of `delta` units to `customer`'s usage of `code`. A voucher
    /// that is not loaded is left alone: its rows already say it.
    pub(crate) fn add(&mut self, code: &str, customer: i64, delta: i64) {
        let Some(v) = self.vouchers.get_mut(code) else {
            return;
        };
        let used = v.customers.entry(customer).or_insert(0);
        *used += delta;
        if *used <= 0 {
            v.customers.remove(&customer);
        }
    }

    /// Forgets every count: the next use loads them from the rows.
    pub(crate) fn clear(&mut self) {
        self.vouchers.clear();
        self.data_version = None;
    }

    /// Drops every count if another connection committed to the file since the last check.
    /// Call it inside the transaction (after `BEGIN IMMEDIATE`, which reads the newest state),
    /// before the counts are used.
    pub(crate) fn check_writers(&mut self, db: &raw::Db) -> Result<(), LedgerError> {
        let mut q = db.prepare(DATA_VERSION)?;
        if !q.step()? {
            return Err(LedgerError::Invalid("PRAGMA data_version returned no row"));
        }
        let now = q.int(0);
        if self.data_version != Some(now) {
            self.vouchers.clear();
            self.data_version = Some(now);
        }
        Ok(())
    }

    /// Counts a merged commit; every [`SWEEP_EVERY`] of them, drops the vouchers none used.
    pub(crate) fn committed(&mut self) {
        self.commits += 1;
        if self.commits < SWEEP_EVERY {
            return;
        }
        self.commits = 0;
        self.vouchers.retain(|_, v| std::mem::take(&mut v.touched));
    }

    #[cfg(test)]
    pub(crate) fn loaded(&self) -> usize {
        self.vouchers.len()
    }
}

fn load(db: &raw::Db, code: &str) -> Result<VoucherUsage, LedgerError> {
    let mut v = VoucherUsage::default();
    for sql in [LOAD_RESERVED, LOAD_CONFIRMED] {
        let mut rows = db.prepare(sql)?;
        rows.bind_text(1, code)?;
        while rows.step()? {
            *v.customers.entry(rows.int(0)).or_insert(0) += 1;
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(codes: &[&str]) -> UsageCache {
        let mut c = UsageCache::default();
        for code in codes {
            c.vouchers.insert(code.to_string(), VoucherUsage::default());
        }
        c
    }

    #[test]
    fn counts_follow_committed_changes_of_loaded_vouchers_only() {
        let mut c = with(&["A"]);
        c.add("A", 7, 1);
        c.add("A", 7, 1);
        c.add("B", 7, 1);
        assert_eq!(c.vouchers["A"].customers[&7], 2);
        assert!(
            !c.vouchers.contains_key("B"),
            "B's rows say it when it loads"
        );
        c.add("A", 7, -2);
        assert!(
            c.vouchers["A"].customers.is_empty(),
            "a count of zero is dropped"
        );
        c.clear();
        assert_eq!(c.loaded(), 0);
    }

    #[test]
    fn a_sweep_drops_the_vouchers_no_commit_used() {
        let mut c = with(&["A", "B"]);
        for _ in 0..SWEEP_EVERY - 1 {
            c.committed();
        }
        if let Some(v) = c.vouchers.get_mut("A") {
            v.touched = true;
        }
        assert_eq!(c.loaded(), 2, "no sweep before SWEEP_EVERY commits");
        c.committed();
        assert_eq!(c.loaded(), 1);
        assert!(c.vouchers.contains_key("A"));
        for _ in 0..SWEEP_EVERY {
            c.committed();
        }
        assert_eq!(c.loaded(), 0, "A was not used since the last sweep");
    }
}

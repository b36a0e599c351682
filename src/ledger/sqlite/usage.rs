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
//!   read) needs them, on the writer's connection, inside its transaction and before anything
//!   of it is written;
//! - they change only after the transaction that changed the rows committed (a merged commit's
//!   inserts, a release, an expiry sweep); a confirmation keeps the count;
//! - they are checked against the books at every merged commit: a voucher's counts add up to
//!   its `reserved + confirmed` (which the same transactions move, and the reconciler checks
//!   against the rows), give or take what the two already differed by at the load; a drift
//!   from that drops them, is logged and counted (`vouchers_ledger_usage_mismatches_total`);
//! - a merged commit that failed drops its vouchers' counts, a release or sweep whose commit
//!   failed (or never returned) drops them all, and so does a commit of any other connection
//!   to the file (another process, or a second handle on it, as the tests open): each use reads
//!   SQLite's `data_version` first, which moves exactly when another connection committed;
//! - a voucher no commit used for [`IDLE`] (10 to 10½ minutes) is dropped, and a small one
//!   (at most [`SMALL`] units held, which load again in under a millisecond) after one
//!   [`SWEEP_EVERY`] (30 to 60 s): the sweep runs after merged commits and after the expiry
//!   sweeper's runs, so a node that stopped selling gives the memory back too. What is held is
//!   that of the vouchers selling now: about 30 bytes per customer holding a unit, in maps that
//!   grow a sixty-fourth at a time (no stall of the writer when a voucher's map of millions
//!   doubles); a long tail's first reserves leave nothing behind a minute after they stop.
//!
//! Loading a voucher reads its live rows on the writer (about 0.75 µs each: a million held
//! units stall the node's commits for most of a second, once); `vouchers_ledger_usage_loads_total`
//! and `vouchers_ledger_usage_loaded_rows_total` count them. Two processes writing one ledger
//! stay correct, but each one's commits make the other load its counts again: the embedded
//! ledger is meant for one node.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::raw;
use crate::ledger::LedgerError;
use crate::metrics as m;

/// How often the counts are swept: a voucher no commit used since the sweep before is dropped
/// if it is small; a large one after [`IDLE_SWEEPS`] such sweeps.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// How long a large voucher no merged commit used keeps its counts (at least; at most one
/// [`SWEEP_EVERY`] longer).
pub(crate) const IDLE: Duration = Duration::from_secs(600);

/// Sweeps a large voucher no commit used survives: [`IDLE`] in all.
const IDLE_SWEEPS: u32 = (IDLE.as_secs() / SWEEP_EVERY.as_secs()) as u32;

/// The most units a voucher's customers hold (rows its load reads, about 0.75 µs each) for it
/// to count as small: dropped after one idle sweep.
pub(crate) const SMALL: i64 = 1024;

/// A voucher's customers who hold units, as two range reads of the `(voucher, status)` index:
/// equality on the whole key, not `IN (list)` (a temporary B-tree) nor `<> 'RELEASED'` (which
/// would walk the released rows, as many as clients care to make).
pub(crate) const LOAD_RESERVED: &str =
    "SELECT customer_id FROM reservations WHERE voucher_code = ?1 AND status = 'RESERVED'";
pub(crate) const LOAD_CONFIRMED: &str =
    "SELECT customer_id FROM reservations WHERE voucher_code = ?1 AND status = 'CONFIRMED'";

const DATA_VERSION: &str = "PRAGMA data_version";

/// Hashed with foldhash, randomly seeded (clients choose the customer ids), not SipHash: every
/// reservation looks its customer up and counts it in.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Usage per voucher and customer, for the vouchers loaded.
#[derive(Default)]
pub(crate) struct UsageCache {
    vouchers: Map<String, VoucherUsage>,
    /// When the last sweep ran (the first look at the time only sets it).
    swept: Option<Instant>,
    /// The writer connection's `PRAGMA data_version` when the counts were last checked: it
    /// moves when another connection commits to the file.
    data_version: Option<i64>,
    /// A release or sweep is committing and has not applied its change yet: if its caller
    /// gave up waiting (its future dropped), the commit may still have happened.
    unsettled: bool,
    /// A sweep dropped counts since the expiry sweeper last looked: it hands the memory back
    /// ([`UsageCache::take_freed`]) once the writer is released.
    freed: bool,
}

/// Parts of a large voucher's customer map.
const PARTS: usize = 64;

/// Customers a voucher's map holds before it is split into [`PARTS`].
const SPLIT_AT: usize = 1 << 16;

/// A voucher's customers and their counts. A hash table grows by doubling, moving every entry:
/// one map of millions of customers (a site-wide code, a new customer on every reserve) would
/// stall the writer, which every commit waits for, for tens of milliseconds at each doubling.
/// So a map that reaches [`SPLIT_AT`] customers is split, once, into [`PARTS`] maps chosen by
/// the customer's hash, and a doubling then moves a sixty-fourth of them. A small voucher keeps
/// one map (64 empty maps would cost 2 KiB for each of a long tail's vouchers). The memory per
/// customer is the same either way: about 30 bytes per customer holding a unit (a 16-byte
/// entry and its control byte, in a table between 7/16 and 7/8 full).
enum Customers {
    One(Map<i64, i64>),
    Parts {
        pick: foldhash::fast::RandomState,
        parts: Box<[Map<i64, i64>]>,
    },
}

impl Default for Customers {
    fn default() -> Self {
        Self::One(Map::default())
    }
}

impl Customers {
    fn map(&self, customer: i64) -> &Map<i64, i64> {
        match self {
            Self::One(map) => map,
            Self::Parts { pick, parts } => &parts[part(pick, customer)],
        }
    }

    fn get(&self, customer: i64) -> Option<i64> {
        self.map(customer).get(&customer).copied()
    }

    /// Adds `delta` to `customer`'s count; a count of zero or less leaves the map.
    fn add(&mut self, customer: i64, delta: i64) {
        if let Self::One(map) = self {
            if map.len() >= SPLIT_AT {
                let pick = foldhash::fast::RandomState::default();
                let mut parts: Box<[Map<i64, i64>]> = (0..PARTS).map(|_| Map::default()).collect();
                for (c, used) in map.drain() {
                    parts[part(&pick, c)].insert(c, used);
                }
                *self = Self::Parts { pick, parts };
            }
        }
        let map = match self {
            Self::One(map) => map,
            Self::Parts { pick, parts } => &mut parts[part(pick, customer)],
        };
        let used = map.entry(customer).or_insert(0);
        *used += delta;
        if *used <= 0 {
            map.remove(&customer);
        }
    }

    #[cfg(test)]
    fn count(&self) -> usize {
        match self {
            Self::One(map) => map.len(),
            Self::Parts { parts, .. } => parts.iter().map(HashMap::len).sum(),
        }
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.count() == 0
    }
}

/// The part of [`Customers::Parts`] that holds `customer`.
fn part(pick: &foldhash::fast::RandomState, customer: i64) -> usize {
    (std::hash::BuildHasher::hash_one(pick, customer) >> 58) as usize % PARTS
}

#[derive(Default)]
pub(crate) struct VoucherUsage {
    /// Customers with a usage above zero.
    customers: Customers,
    /// The sum of `customers`: checked against the voucher's `reserved + confirmed`.
    live: i64,
    /// `reserved + confirmed − live` when the counts were loaded (zero unless the books and
    /// the rows already disagreed, which the reconciler reports): a drift from it is a miscount
    /// here. `None` until a merged commit read the books.
    offset: Option<i64>,
    /// Whether a commit used this voucher since the last sweep.
    touched: bool,
    /// Sweeps in a row that found it untouched.
    idle_sweeps: u32,
}

impl VoucherUsage {
    /// `customer`'s usage.
    pub(crate) fn of(&self, customer: i64) -> i64 {
        self.customers.get(customer).unwrap_or(0)
    }

    /// `delta` units more (or fewer) for `customer`; a count of zero leaves the map.
    fn add(&mut self, customer: i64, delta: i64) {
        self.live += delta;
        self.customers.add(customer, delta);
    }

    /// Takes `books` (the voucher's `reserved + confirmed`) as the reference the counts are
    /// checked against from now on; an offset other than zero is logged and counted.
    fn anchor(&mut self, code: &str, books: i64) {
        let offset = books - self.live;
        self.offset = Some(offset);
        if offset != 0 {
            tracing::error!(
                voucher = code,
                offset,
                "reserved + confirmed differs from the rows' count at load"
            );
            m::usage_mismatch();
        }
    }
}

impl UsageCache {
    /// `code`'s counts, loaded from its rows if they are not here. Call it only with no write
    /// of the current transaction made yet; `books` is the voucher's `reserved + confirmed` if
    /// the transaction read it.
    pub(crate) fn voucher(
        &mut self,
        db: &raw::Db,
        code: &str,
        books: Option<i64>,
    ) -> Result<&VoucherUsage, LedgerError> {
        if !self.vouchers.contains_key(code) {
            let mut loaded = load(db, code)?;
            if let Some(books) = books {
                loaded.anchor(code, books);
            }
            self.vouchers.insert(code.to_owned(), loaded);
        }
        let v = self
            .vouchers
            .get_mut(code)
            .ok_or(LedgerError::Inconsistent(
                "usage counts missing just after their load",
            ))?;
        v.touched = true;
        Ok(v)
    }

    /// Applies a committed merged transaction's new rows of `code`, one unit per customer
    /// given (as [`UsageCache::add`]).
    pub(crate) fn taken(&mut self, code: &str, customers: impl Iterator<Item = i64>) {
        let Some(v) = self.vouchers.get_mut(code) else {
            return;
        };
        for customer in customers {
            v.add(customer, 1);
        }
    }

    /// Applies a committed change of `delta` units to `customer`'s usage of `code`. A voucher
    /// that is not loaded is left alone: its rows already say it.
    pub(crate) fn add(&mut self, code: &str, customer: i64, delta: i64) {
        if let Some(v) = self.vouchers.get_mut(code) {
            v.add(customer, delta);
        }
    }

    /// Checks `code`'s counts, if loaded, against `books` (its `reserved + confirmed`, read in
    /// the current transaction before any write of it). If they drifted from the offset they
    /// were loaded with, they are dropped (the next use loads them again), logged and counted,
    /// and it returns false. A lasting disagreement of the books with the rows reloads once.
    pub(crate) fn agrees(&mut self, code: &str, books: i64) -> bool {
        let Some(v) = self.vouchers.get_mut(code) else {
            return true;
        };
        match v.offset {
            None => {
                v.anchor(code, books);
                true
            }
            Some(offset) if books - v.live == offset => true,
            Some(offset) => {
                tracing::error!(
                    voucher = code,
                    counted = v.live,
                    books,
                    offset,
                    "usage counts drifted from the books; counting again from the rows"
                );
                m::usage_mismatch();
                self.vouchers.remove(code);
                false
            }
        }
    }

    /// Drops `code`'s counts (a merged commit of it failed).
    pub(crate) fn forget(&mut self, code: &str) {
        self.vouchers.remove(code);
    }

    /// A release or sweep is about to commit: until [`UsageCache::settled`], the counts are
    /// not to be trusted.
    pub(crate) fn settling(&mut self) {
        if self.unsettled {
            // An earlier one never settled (its caller gave up): it may have committed.
            self.clear();
        }
        self.unsettled = true;
    }

    /// The release or sweep committed (and its change was applied) or failed (and the counts
    /// were dropped).
    pub(crate) fn settled(&mut self) {
        self.unsettled = false;
    }

    /// Forgets every count: the next use loads them from the rows.
    pub(crate) fn clear(&mut self) {
        self.vouchers.clear();
        self.data_version = None;
        self.unsettled = false;
    }

    /// Drops every count if another connection committed to the file since the last check (or
    /// a release or sweep never settled). Call it inside the transaction, before the counts
    /// are used: the pragma reads the transaction's snapshot.
    pub(crate) fn check_writers(&mut self, db: &raw::Db) -> Result<(), LedgerError> {
        if self.unsettled {
            self.clear();
        }
        let mut q = db.prepare(DATA_VERSION)?;
        if !q.step()? {
            return Err(LedgerError::Inconsistent(
                "PRAGMA data_version returned no row",
            ));
        }
        let now = q.int(0);
        if self.data_version != Some(now) {
            self.vouchers.clear();
            self.data_version = Some(now);
        }
        Ok(())
    }

    /// After a merged commit and an expiry sweep: about once per [`SWEEP_EVERY`], drops the
    /// small vouchers no commit used since the sweep before, and the large ones no commit used
    /// for [`IDLE`]; then gives back the table's room if most of it is empty.
    pub(crate) fn tidy(&mut self) {
        self.sweep(Instant::now());
    }

    /// Whether a sweep dropped counts since the last call.
    pub(crate) fn take_freed(&mut self) -> bool {
        std::mem::take(&mut self.freed)
    }

    fn sweep(&mut self, now: Instant) {
        match self.swept {
            Some(at) if now.saturating_duration_since(at) >= SWEEP_EVERY => {
                self.swept = Some(now);
                let before = self.vouchers.len();
                self.vouchers.retain(|_, v| {
                    if std::mem::take(&mut v.touched) {
                        v.idle_sweeps = 0;
                        return true;
                    }
                    v.idle_sweeps += 1;
                    v.idle_sweeps < IDLE_SWEEPS && v.live > SMALL
                });
                if crate::memory::mostly_empty(self.vouchers.capacity(), self.vouchers.len()) {
                    self.vouchers.shrink_to_fit();
                }
                self.freed |= self.vouchers.len() < before;
            }
            Some(_) => {}
            None => self.swept = Some(now),
        }
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
            v.add(rows.int(0), 1);
        }
    }
    m::usage_loaded(v.live);
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
        c.taken("A", [7, 8].into_iter());
        c.add("B", 7, 1);
        c.taken("B", [7].into_iter());
        assert_eq!(c.vouchers["A"].of(7), 2);
        assert_eq!(c.vouchers["A"].of(8), 1);
        assert!(c.agrees("A", 3), "the first check sets the offset (0)");
        c.add("A", 8, -1);
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
    fn a_sweep_drops_small_vouchers_soon_and_large_ones_after_idle() {
        let mut c = with(&["SMALL", "LARGE", "BUSY"]);
        // Few customers, many units: the rows a load reads are what makes it large.
        for customer in 0..4 {
            c.add("LARGE", customer, SMALL / 4);
        }
        c.add("LARGE", 0, 1);
        c.add("SMALL", 1, 1);
        let t0 = Instant::now();
        c.sweep(t0);
        c.sweep(t0 + SWEEP_EVERY / 2);
        assert_eq!(c.loaded(), 3, "no sweep before SWEEP_EVERY has passed");
        c.vouchers.get_mut("SMALL").unwrap().touched = true;
        let mut t = t0;
        for sweep in 1..=IDLE_SWEEPS {
            t += SWEEP_EVERY;
            c.vouchers.get_mut("BUSY").unwrap().touched = true;
            c.sweep(t);
            assert_eq!(
                c.vouchers.contains_key("SMALL"),
                sweep == 1,
                "sweep {sweep}"
            );
            assert_eq!(
                c.vouchers.contains_key("LARGE"),
                sweep < IDLE_SWEEPS,
                "sweep {sweep}"
            );
            assert!(c.vouchers.contains_key("BUSY"), "used before every sweep");
        }
        assert_eq!(t - t0, IDLE);
    }

    #[test]
    fn a_sweep_gives_back_the_room_of_the_vouchers_it_dropped() {
        let codes: Vec<String> = (0..10_000).map(|i| format!("C{i}")).collect();
        let mut c = with(&codes.iter().map(String::as_str).collect::<Vec<_>>());
        let room = c.vouchers.capacity();
        let t0 = Instant::now();
        c.sweep(t0);
        c.sweep(t0 + SWEEP_EVERY);
        assert_eq!(c.loaded(), 0);
        assert!(
            c.vouchers.capacity() < room / 4,
            "{} of {room}",
            c.vouchers.capacity()
        );
    }

    #[test]
    fn counts_that_drift_from_the_books_are_dropped_and_a_lasting_offset_is_kept() {
        let mut c = with(&["A"]);
        c.add("A", 1, 1);
        c.add("A", 2, 1);
        assert!(c.agrees("A", 2));
        assert!(c.agrees("B", 7), "nothing loaded, nothing to check");
        c.add("A", 3, 1);
        assert!(c.agrees("A", 3), "books and counts moved together");
        assert!(!c.agrees("A", 4), "a unit the counts missed");
        assert_eq!(c.loaded(), 0);
        // Books one above the rows from the start (a drift the reconciler reports): kept.
        let mut c = with(&["A"]);
        c.add("A", 1, 1);
        assert!(c.agrees("A", 2));
        c.add("A", 2, 1);
        assert!(
            c.agrees("A", 3),
            "the same offset: no reload at every commit"
        );
        assert_eq!(c.loaded(), 1);
    }

    #[test]
    fn an_unsettled_release_and_a_forgotten_voucher_drop_counts() {
        let mut c = with(&["A", "B"]);
        c.forget("B");
        assert_eq!(c.loaded(), 1);
        c.settling();
        assert!(c.unsettled);
        c.settled();
        assert!(!c.unsettled);
        // A release whose caller gave up never settles: the next one drops every count.
        c.settling();
        c.settling();
        assert_eq!(c.loaded(), 0);
        assert!(c.unsettled);
    }

    #[test]
    fn a_large_map_splits_once_and_keeps_every_count() {
        let mut c = Customers::default();
        let n = SPLIT_AT as i64 + 1_000;
        for customer in 0..n {
            c.add(customer, 1 + customer % 3);
        }
        let Customers::Parts { parts, .. } = &c else {
            panic!("a map of {n} customers is still one map");
        };
        // The parts share the customers: none holds more than twice its share.
        assert!(parts.iter().all(|p| p.len() < 2 * n as usize / PARTS));
        assert_eq!(c.count(), n as usize);
        for customer in 0..n {
            assert_eq!(
                c.get(customer),
                Some(1 + customer % 3),
                "customer {customer}"
            );
        }
        for customer in 0..n {
            c.add(customer, -(1 + customer % 3));
        }
        assert!(c.is_empty());
        let mut small = Customers::default();
        small.add(7, 1);
        assert!(matches!(small, Customers::One(_)));
    }
}

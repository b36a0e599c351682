//! Which voucher codes exist, in memory (DESIGN §6): a request for a code that does not exist is
//! answered `404` without an actor, a timer or a ledger read, so a flood of random codes costs a
//! set lookup each. The set is loaded at start, grows on create here and on the cluster's
//! `UPDATED` signal, and is re-read from the ledger on a miss at most once per
//! `engine.known_codes_refresh_ms` (so a code created on another node is found without Redis).
//! It holds only codes the ledger has: junk never enters it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use dashmap::DashSet;

use crate::ledger::{LedgerError, SharedLedger};

pub(crate) struct KnownCodes {
    /// Hashed with foldhash, randomly seeded (clients choose the codes they ask for), not
    /// SipHash: every request looks its code up here, junk included.
    codes: DashSet<Box<str>, foldhash::fast::RandomState>,
    /// The whole set was read from the ledger at least once: before that, a miss may only mean
    /// that the ledger was down at start.
    loaded: AtomicBool,
    /// When the last read started (ms since `epoch`, plus one; 0: never): misses within
    /// `refresh_ms` of it are answered from memory, even when that read failed (a ledger outage
    /// costs one call per interval, not one per request). Real time, not the engine's clock:
    /// this is a throttle, not a lease.
    last_refresh: AtomicU64,
    epoch: Instant,
    refresh_ms: u64,
    /// One re-read at a time; misses that arrive meanwhile wait for it and look again.
    refreshing: tokio::sync::Mutex<()>,
    /// Reads of the codes so far, failed ones included: a miss that waited for a read takes its
    /// result. Also for tests and diagnostics (the metric is process-wide).
    reads: AtomicU64,
}

/// Whether a code exists, as far as this node can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Known {
    Yes,
    No,
    /// The set was never loaded and the ledger cannot be read now.
    Unknown,
}

impl KnownCodes {
    pub(crate) fn new(refresh_ms: u64) -> Self {
        Self {
            codes: DashSet::default(),
            loaded: AtomicBool::new(false),
            last_refresh: AtomicU64::new(0),
            epoch: Instant::now(),
            refresh_ms,
            refreshing: tokio::sync::Mutex::new(()),
            reads: AtomicU64::new(0),
        }
    }

    pub(crate) fn insert(&self, code: &str) {
        if !self.codes.contains(code) {
            self.codes.insert(code.into());
        }
    }

    pub(crate) fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    pub(crate) fn len(&self) -> usize {
        self.codes.len()
    }

    fn since_epoch(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn recently_read(&self) -> bool {
        let last = self.last_refresh.load(Ordering::Acquire);
        last != 0 && self.since_epoch() + 1 < last + self.refresh_ms
    }

    fn verdict(&self, code: &str) -> Known {
        if self.codes.contains(code) {
            Known::Yes
        } else if self.loaded.load(Ordering::Acquire) {
            Known::No
        } else {
            Known::Unknown
        }
    }

    /// Reads every code from the ledger into the set.
    pub(crate) async fn load(&self, ledger: &SharedLedger) -> Result<(), LedgerError> {
        self.last_refresh
            .store(self.since_epoch() + 1, Ordering::Release);
        let res = ledger.voucher_codes(i64::MIN).await.map(|codes| {
            for code in codes {
                self.insert(&code);
            }
            self.loaded.store(true, Ordering::Release);
        });
        crate::metrics::known_codes_read();
        self.reads.fetch_add(1, Ordering::Release);
        // From the end of the read as well: a slow ledger is read once per interval, not back
        // to back.
        self.last_refresh
            .store(self.since_epoch() + 1, Ordering::Release);
        res
    }

    /// Whether `code` exists: from memory, or after one (shared, throttled) re-read. Misses that
    /// queue behind a read take its result instead of reading again, so a slow or hung ledger
    /// costs one read at a time (each bounded by the ledger's deadline), never a queue of them.
    pub(crate) async fn check(&self, code: &str, ledger: &SharedLedger) -> Known {
        if self.codes.contains(code) {
            return Known::Yes;
        }
        if self.recently_read() {
            return self.verdict(code);
        }
        let reads_before = self.reads.load(Ordering::Acquire);
        let _turn = self.refreshing.lock().await;
        let read_meanwhile = self.reads.load(Ordering::Acquire) != reads_before;
        if !read_meanwhile && !self.codes.contains(code) && !self.recently_read() {
            if let Err(e) = self.load(ledger).await {
                tracing::warn!(error = %e, "read voucher codes");
            }
        }
        self.verdict(code)
    }
}

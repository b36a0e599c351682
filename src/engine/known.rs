//! Which voucher codes exist, in memory (DESIGN §6): a request for a code that does not exist is
//! answered `404` without an actor, a timer or a ledger read, so a flood of random codes costs a
//! set lookup each. The set is loaded at start, grows on create here and on the cluster's
//! `UPDATED` signal, and on a miss the ledger is asked at most once per
//! `engine.known_codes_refresh_ms` for the codes created since the last read (so a code created
//! on another node is found without Redis, and a miss costs an indexed read of what is new, not
//! of the whole catalogue). It holds only codes the ledger has: junk never enters it.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Instant;

use dashmap::DashSet;

use crate::clock::Millis;
use crate::ledger::{LedgerError, SharedLedger};

/// A re-read asks for codes created this long before the last read started: a code's
/// `created_at` is its creating node's clock, which may lag this one's (nodes follow the
/// ledger's clock, within milliseconds), and a create may commit a while after it took its
/// time.
const CREATED_OVERLAP_MS: Millis = 60_000;

/// Codes read per page of a full read.
const PAGE: i64 = 10_000;

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
    /// The next re-read asks for codes created since this time (set by each successful read).
    since: AtomicI64,
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
            since: AtomicI64::new(Millis::MIN),
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

    /// Reads the codes from the ledger into the set: every code, page by page, the first time;
    /// after that, the codes created since the last read. `now` is the engine's clock.
    pub(crate) async fn load(&self, ledger: &SharedLedger, now: Millis) -> Result<(), LedgerError> {
        self.last_refresh
            .store(self.since_epoch() + 1, Ordering::Release);
        let res = self.read(ledger).await.map(|()| {
            self.since
                .store(now - CREATED_OVERLAP_MS, Ordering::Release);
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

    async fn read(&self, ledger: &SharedLedger) -> Result<(), LedgerError> {
        if self.loaded.load(Ordering::Acquire) {
            let since = self.since.load(Ordering::Acquire);
            for code in ledger.codes_created_since(since).await? {
                self.insert(&code);
            }
            return Ok(());
        }
        let mut after = String::new();
        loop {
            let page = ledger.voucher_codes(Millis::MIN, &after, PAGE).await?;
            for code in &page {
                self.insert(code);
            }
            match page.last() {
                Some(last) if page.len() as i64 >= PAGE => after = last.clone(),
                _ => return Ok(()),
            }
        }
    }

    /// Whether `code` exists: from memory, or after one (shared, throttled) re-read. Misses that
    /// queue behind a read take its result instead of reading again, so a slow or hung ledger
    /// costs one read at a time (each bounded by the ledger's deadline), never a queue of them.
    pub(crate) async fn check(&self, code: &str, ledger: &SharedLedger, now: Millis) -> Known {
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
            if let Err(e) = self.load(ledger, now).await {
                tracing::warn!(error = %e, "read voucher codes");
            }
        }
        self.verdict(code)
    }
}

//! Time as the engine sees it. Lease, expiry and eligibility logic never read the system clock
//! directly: they ask a [`Clock`], so tests can move time with [`ManualClock`].
//!
//! On a shared ledger every node's clock follows the ledger's ([`LedgerClock`]): each heartbeat
//! reads the ledger's clock, and the node corrects its own by the difference. Lease expiry is then
//! judged on one clock for the whole cluster: a node whose system clock runs ahead cannot reap
//! the live leases of others early, and one that runs behind cannot keep serving a lease the
//! others already see as expired.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

/// Milliseconds since the Unix epoch, the unit every ledger timestamp uses.
pub type Millis = i64;

/// A source of wall-clock time.
pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> Millis;

    /// Milliseconds on a clock that never steps back, for rates and throttles (a wall clock
    /// stepped back would refuse everyone for the size of the step). Same unit as `now_ms`.
    fn monotonic_ms(&self) -> Millis {
        self.now_ms()
    }

    /// The ledger's clock reads `ahead_ms` more than this clock: follow it (a clock that cannot
    /// be corrected ignores this).
    fn follow_ledger(&self, _ahead_ms: Millis) {}
}

/// The real clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        chrono::Utc::now().timestamp_millis()
    }

    fn monotonic_ms(&self) -> Millis {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        START
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_millis() as Millis
    }
}

/// A clock that only moves when told to; clones share the same time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    pub fn new(start: Millis) -> Self {
        Self(Arc::new(AtomicI64::new(start)))
    }

    /// Starts at the current system time.
    pub fn starting_now() -> Self {
        Self::new(SystemClock.now_ms())
    }

    pub fn advance_ms(&self, ms: i64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }

    pub fn set_ms(&self, ms: Millis) {
        self.0.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> Millis {
        self.0.load(Ordering::SeqCst)
    }
}

pub type SharedClock = Arc<dyn Clock>;

/// A clock corrected to the ledger's: `inner` plus the offset the heartbeats measure.
pub struct LedgerClock {
    inner: SharedClock,
    /// Added to `inner` (testing only: rehearses a node whose system clock is off).
    skew_ms: Millis,
    /// The ledger's clock minus `inner + skew_ms`, as last measured.
    offset_ms: AtomicI64,
}

/// Beyond half the round trip (what one reading cannot tell), differences smaller than this are
/// left alone: the clock does not step back and forth with every beat.
const FOLLOW_MIN_MS: Millis = 20;

/// A reading whose round trip took longer than this is not used.
pub const MAX_RTT_MS: Millis = 80;

impl LedgerClock {
    pub fn new(inner: SharedClock, skew_ms: Millis) -> Self {
        Self {
            inner,
            skew_ms,
            offset_ms: AtomicI64::new(0),
        }
    }
}

impl Clock for LedgerClock {
    fn now_ms(&self) -> Millis {
        self.inner.now_ms() + self.skew_ms + self.offset_ms.load(Ordering::Acquire)
    }

    fn monotonic_ms(&self) -> Millis {
        self.inner.monotonic_ms()
    }

    fn follow_ledger(&self, ahead_ms: Millis) {
        let total = self.offset_ms.fetch_add(ahead_ms, Ordering::AcqRel) + ahead_ms;
        if ahead_ms.abs() >= 1000 {
            tracing::warn!(
                corrected_by_ms = ahead_ms,
                offset_ms = total,
                "this node's clock was off the ledger's; it follows the ledger's now"
            );
        }
    }
}

/// How far the ledger's clock is ahead of `clock`, from one reading `ledger_ms` taken between
/// `sent` and `received` (on `clock`), against the middle of the round trip. `None` when there
/// is nothing worth correcting: the round trip took over 80 ms, or the difference is within
/// half the round trip plus 20 ms.
pub fn ledger_ahead(ledger_ms: Millis, sent: Millis, received: Millis) -> Option<Millis> {
    let rtt = received - sent;
    if !(0..=MAX_RTT_MS).contains(&rtt) {
        return None;
    }
    let ahead = ledger_ms - (sent + rtt / 2);
    (ahead.abs() > rtt / 2 + FOLLOW_MIN_MS).then_some(ahead)
}

/// Milliseconds since the Unix epoch as RFC 3339 text with milliseconds, in UTC (the API's and
/// the change feed's form).
pub fn rfc3339(ms: Millis) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ledger_clock_follows_the_ledger_and_ignores_jitter() {
        let base = ManualClock::new(1_000_000);
        let c = LedgerClock::new(Arc::new(base.clone()), 30_000);
        assert_eq!(c.now_ms(), 1_030_000, "the skew applies");
        // The ledger read 1_000_050 while this clock went 1_030_000 → 1_030_010.
        let ahead = ledger_ahead(1_000_050, 1_030_000, 1_030_010).unwrap();
        assert_eq!(ahead, -29_955);
        c.follow_ledger(ahead);
        assert_eq!(c.now_ms(), 1_000_045);
        assert_eq!(
            ledger_ahead(1_000_060, 1_000_045, 1_000_055),
            None,
            "within half the round trip plus 20 ms: jitter, left alone"
        );
        base.advance_ms(100);
        assert_eq!(c.now_ms(), 1_000_145, "it runs at the inner clock's rate");
        assert_eq!(
            ledger_ahead(0, 0, 500),
            None,
            "a slow round trip tells nothing"
        );
    }
}

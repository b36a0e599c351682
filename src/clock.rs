//! Time as the engine sees it. Lease, expiry and eligibility logic never read the system clock
//! directly: they ask a [`Clock`], so tests can move time with [`ManualClock`].

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

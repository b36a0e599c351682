//! The node's circuit breaker on the ledger: one per process, shared by every caller.
//!
//! Every ledger call but the heartbeat passes it ([`super::NodeLedger`]; a merged commit counts
//! once, however many batches it carries). After `failures` calls in a row that could not reach
//! the ledger ([`super::LedgerError::Unreachable`], `Deadline`, `WorkerGone`; not a lock
//! timeout, a deadlock victim or a full commit queue, which are the ledger or this node
//! answering) it *opens*: calls fail at once with [`super::LedgerError::CircuitOpen`] and
//! reserves get `503` without reaching an actor, so a dead ledger costs no connection attempts,
//! no queued batches and no waiting clients. After `open_ms` the next call is let through alone
//! as a probe (*half-open*); its success closes the breaker, its failure opens it again. The
//! background jobs call the ledger every half second or so (the switches, the live numbers), so
//! a probe goes out soon after the cool-down even when no client does. Heartbeats do not pass
//! the breaker: a node that stopped beating would be taken for dead and its leases reaped.
//!
//! Time is passed in (milliseconds of a monotonic clock), so the state machine is tested
//! without waiting.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::Instant;

use super::LedgerError;
pub use crate::domain::BreakerState;

/// What the breaker lets a call do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Closed: go ahead.
    Pass,
    /// The one call let through while half-open; its outcome decides.
    Probe,
    /// Open (or a probe is out): fail at once.
    Refuse,
}

const CLOSED: u8 = 0;
const HALF_OPEN: u8 = 1;
const OPEN: u8 = 2;

pub struct Breaker {
    /// Unavailable answers in a row that open the breaker (0: never opens).
    failures: u32,
    /// How long it stays open before a probe may go.
    open_ms: u64,
    state: AtomicU8,
    /// Unavailable answers in a row so far.
    in_a_row: AtomicU32,
    /// When it last opened, on [`Breaker::now_ms`]'s clock.
    opened_at: AtomicU64,
    /// The origin of [`Breaker::now_ms`].
    origin: Instant,
    /// Told of every call that could not reach the ledger (the store looks for a new primary).
    on_outage: Option<Box<dyn Fn() + Send + Sync>>,
    /// How many times the store moved to another server (a promoted standby): a move since the
    /// breaker opened ends its cool-down, so the first call after a failover probes at once.
    moves: Option<Box<dyn Fn() -> u64 + Send + Sync>>,
    /// [`Breaker::moves`] when it last opened.
    moves_at_open: AtomicU64,
    /// The shard it guards (its place in `ledger.shards`), for its metrics' label; `None` for
    /// a node's one ledger.
    shard: Option<String>,
    /// Asked before a probe goes: whether the server refuses connections outright (a stopped
    /// server). Such a probe fails at once instead of waiting out the pool's acquire timeout,
    /// with every reserve merged into it.
    refused: Option<RefusedCheck>,
    /// Probes failed in a row by `refused` alone: every [`MAX_VETOES`]th goes out anyway, so a
    /// check that is wrong (a host it cannot resolve) never keeps the breaker open for good.
    vetoes: AtomicU32,
}

/// Probes `refused` may fail in a row before one goes to the ledger regardless (about ten
/// seconds of them at the default cool-down of 500 ms: a stopped server then costs one probe
/// that waits out the pool every ten seconds or so, and a check that is wrong at most that).
const MAX_VETOES: u32 = 20;

/// See [`Breaker::refused`].
type RefusedCheck = Box<dyn Fn() -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync>;

impl Breaker {
    pub fn new(failures: u32, open_ms: u64) -> Self {
        Self {
            failures,
            open_ms,
            state: AtomicU8::new(CLOSED),
            in_a_row: AtomicU32::new(0),
            opened_at: AtomicU64::new(0),
            origin: Instant::now(),
            on_outage: None,
            moves: None,
            moves_at_open: AtomicU64::new(0),
            shard: None,
            refused: None,
            vetoes: AtomicU32::new(0),
        }
    }

    /// The breaker of shard `shard` (its metrics carry the label).
    pub fn for_shard(mut self, shard: usize) -> Self {
        self.shard = Some(shard.to_string());
        self
    }

    /// The breaker of a sharded ledger's directory: the order claims, placements, the merged
    /// feed (its metrics' `shard` label says `directory`).
    pub fn for_directory(mut self) -> Self {
        self.shard = Some("directory".into());
        self
    }

    /// The breaker, cooling down only while `moves` (the store's switches of server) stays
    /// what it was when it opened.
    pub fn on_move(mut self, moves: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        self.moves = Some(Box::new(moves));
        self
    }

    /// The breaker of calls to `store`: told of its outages (it looks for a new primary), of
    /// its moves to another server, and asking it before each probe whether its server
    /// refuses connections.
    pub fn of_store(self, store: super::SharedLedger) -> Self {
        let (moved, probed) = (store.clone(), store.clone());
        self.on_outage(move || store.lost())
            .on_move(move || moved.failovers())
            .on_probe(move || {
                let store = probed.clone();
                async move { store.refuses_connections().await }
            })
    }

    /// The breaker, asking `refused` before each probe whether the server refuses connections
    /// now (see [`Breaker::refused`]).
    pub fn on_probe<F, Fut>(mut self, refused: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = bool> + Send + 'static,
    {
        self.refused = Some(Box::new(move || Box::pin(refused())));
        self
    }

    fn moves(&self) -> u64 {
        self.moves.as_ref().map_or(0, |m| m())
    }

    /// Open, and still cooling down at `now`: not past `open_ms`, and the store has not moved
    /// to another server since.
    fn cooling(&self, now: u64) -> bool {
        now < self.opened_at.load(Ordering::Acquire) + self.open_ms
            && self.moves() == self.moves_at_open.load(Ordering::Acquire)
    }

    /// The breaker, with `hook` told of every call that could not reach the ledger.
    pub fn on_outage(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_outage = Some(Box::new(hook));
        self
    }

    /// Milliseconds of a monotonic clock private to this breaker.
    pub fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    pub fn state(&self) -> BreakerState {
        match self.state.load(Ordering::Acquire) {
            CLOSED => BreakerState::Closed,
            HALF_OPEN => BreakerState::HalfOpen,
            _ => BreakerState::Open,
        }
    }

    /// Would a call made now be refused? While open and cooling down, or while a probe is out.
    /// Once the cool-down is over, the next call may be the probe: work that ends in a ledger
    /// call (a reserve, through its actor's batch) is let through, so the first of it probes
    /// at once instead of waiting for a background job to.
    pub fn refuses(&self, now: u64) -> bool {
        match self.state.load(Ordering::Acquire) {
            CLOSED => false,
            OPEN => self.cooling(now),
            _ => true,
        }
    }

    /// May a call go to the ledger at `now`?
    pub fn admit(&self, now: u64) -> Admit {
        match self.state.load(Ordering::Acquire) {
            CLOSED => Admit::Pass,
            OPEN if !self.cooling(now) => {
                // Only one caller wins the probe.
                match self.state.compare_exchange(
                    OPEN,
                    HALF_OPEN,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        crate::metrics::breaker_state(
                            self.shard.as_deref(),
                            BreakerState::HalfOpen,
                        );
                        Admit::Probe
                    }
                    Err(_) => Admit::Refuse,
                }
            }
            _ => Admit::Refuse,
        }
    }

    /// Runs `call` if the breaker lets it, and records how it went. A probe dropped before it
    /// finished (its caller gave up) counts as a failed probe, so a probe can never be lost and
    /// leave the breaker half-open for good.
    pub async fn call<T>(
        &self,
        call: impl Future<Output = Result<T, LedgerError>>,
    ) -> Result<T, LedgerError> {
        let admitted = self.admit(self.now_ms());
        if admitted == Admit::Refuse {
            return Err(LedgerError::CircuitOpen);
        }
        let mut pending = Pending {
            breaker: self,
            admitted,
            done: false,
        };
        let moves = self.moves();
        if admitted == Admit::Probe {
            if let Some(refused) = &self.refused {
                let vetoed = self.vetoes.load(Ordering::Acquire);
                if vetoed + 1 < MAX_VETOES && refused().await {
                    self.vetoes.store(vetoed + 1, Ordering::Release);
                    pending.done = true;
                    self.record(admitted, false, self.now_ms());
                    return Err(LedgerError::CircuitOpen);
                }
                self.vetoes.store(0, Ordering::Release);
            }
        }
        let res = call.await;
        pending.done = true;
        if is_outage(&res) && self.moves() != moves {
            // It failed on the server the store has since left: that says nothing of the new
            // one. A probe lost that way lets the next call probe at once.
            if admitted == Admit::Probe {
                self.moves_at_open.store(u64::MAX, Ordering::Release);
                self.state.store(OPEN, Ordering::Release);
                crate::metrics::breaker_state(self.shard.as_deref(), BreakerState::Open);
            }
            return res;
        }
        self.record(admitted, !is_outage(&res), self.now_ms());
        res
    }

    /// The outcome of an admitted call: `available` unless the ledger could not be reached or
    /// did not answer in time.
    pub fn record(&self, admitted: Admit, available: bool, now: u64) {
        if available {
            self.in_a_row.store(0, Ordering::Release);
            if admitted == Admit::Probe {
                self.state.store(CLOSED, Ordering::Release);
                crate::metrics::breaker_state(self.shard.as_deref(), BreakerState::Closed);
                tracing::info!("ledger answers again: circuit closed");
            }
            return;
        }
        if let Some(hook) = &self.on_outage {
            hook();
        }
        let n = self.in_a_row.fetch_add(1, Ordering::AcqRel) + 1;
        let trips = admitted == Admit::Probe || (self.failures > 0 && n >= self.failures);
        if trips && self.state.load(Ordering::Acquire) != OPEN {
            self.moves_at_open.store(self.moves(), Ordering::Release);
            self.opened_at.store(now, Ordering::Release);
            self.state.store(OPEN, Ordering::Release);
            crate::metrics::breaker_state(self.shard.as_deref(), BreakerState::Open);
            if admitted != Admit::Probe {
                crate::metrics::breaker_opened(self.shard.as_deref());
                tracing::warn!(failures = n, "ledger unavailable: circuit open");
            }
        }
    }
}

/// An admitted call in flight: a probe dropped unfinished records a failure.
struct Pending<'a> {
    breaker: &'a Breaker,
    admitted: Admit,
    done: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        // Only a lost probe matters: an ordinary call whose caller gave up says nothing about
        // the ledger.
        if !self.done && self.admitted == Admit::Probe {
            self.breaker
                .record(self.admitted, false, self.breaker.now_ms());
        }
    }
}

/// The ledger could not be reached, or did not answer in time: what the breaker counts. A
/// [`LedgerError::Database`] error is the ledger answering (a lock timeout, a deadlock victim, a
/// constraint), and a full commit queue is this node's own backlog; neither counts.
pub(super) fn is_outage<T>(res: &Result<T, LedgerError>) -> bool {
    matches!(
        res,
        Err(LedgerError::Deadline | LedgerError::WorkerGone | LedgerError::Unreachable { .. })
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn a_move_of_the_store_to_another_server_ends_the_cool_down() {
        let moved = Arc::new(AtomicU64::new(0));
        let seen = moved.clone();
        let b = Breaker::new(1, 10_000).on_move(move || seen.load(Ordering::Acquire));
        b.record(Admit::Pass, false, 0);
        assert_eq!(b.state(), BreakerState::Open);
        assert!(b.refuses(1));
        assert_eq!(b.admit(1), Admit::Refuse);
        moved.store(1, Ordering::Release);
        assert!(!b.refuses(2));
        assert_eq!(b.admit(2), Admit::Probe);
        // A failed probe opens it again, cooling down against the new count.
        b.record(Admit::Probe, false, 3);
        assert!(b.refuses(4));
    }

    #[test]
    fn calls_that_failed_on_the_server_left_behind_do_not_count() {
        let moved = Arc::new(AtomicU64::new(0));
        let seen = moved.clone();
        let b = Breaker::new(2, 10_000).on_move(move || seen.load(Ordering::Acquire));
        let stale = || async {
            moved.fetch_add(1, Ordering::AcqRel);
            Err::<(), _>(LedgerError::Deadline)
        };
        for _ in 0..5 {
            assert!(futures_util::FutureExt::now_or_never(b.call(stale())).is_some());
        }
        assert_eq!(b.state(), BreakerState::Closed, "old failures opened it");
        let fresh = || async { Err::<(), _>(LedgerError::Deadline) };
        for _ in 0..2 {
            let _ = futures_util::FutureExt::now_or_never(b.call(fresh()));
        }
        assert_eq!(b.state(), BreakerState::Open);
    }

    #[test]
    fn opens_after_failures_in_a_row_probes_once_and_closes_on_success() {
        let b = Breaker::new(3, 500);
        assert_eq!(b.admit(0), Admit::Pass);
        b.record(Admit::Pass, false, 0);
        b.record(Admit::Pass, false, 1);
        // A success in between starts the count again.
        b.record(Admit::Pass, true, 2);
        b.record(Admit::Pass, false, 3);
        b.record(Admit::Pass, false, 4);
        assert_eq!(b.state(), BreakerState::Closed);
        b.record(Admit::Pass, false, 10);
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.admit(509), Admit::Refuse, "still cooling down");
        assert!(b.refuses(509));
        assert!(!b.refuses(510), "cooled down: the next call may probe");
        assert_eq!(b.admit(510), Admit::Probe);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert_eq!(b.admit(511), Admit::Refuse, "one probe at a time");
        assert!(b.refuses(511), "a probe is out");
        b.record(Admit::Probe, true, 520);
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.admit(521), Admit::Pass);
    }

    #[test]
    fn a_failed_probe_opens_it_for_another_cool_down() {
        let b = Breaker::new(1, 100);
        b.record(Admit::Pass, false, 0);
        assert_eq!(b.admit(100), Admit::Probe);
        b.record(Admit::Probe, false, 150);
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.admit(249), Admit::Refuse);
        assert_eq!(b.admit(250), Admit::Probe);
    }

    #[tokio::test]
    async fn a_probe_dropped_unfinished_counts_as_a_failure() {
        let b = Breaker::new(1, 0);
        b.record(Admit::Pass, false, 0);
        // The probe's caller gives up before the ledger answers.
        let probe = b.call(std::future::pending::<Result<(), LedgerError>>());
        let timed_out = tokio::time::timeout(std::time::Duration::from_millis(1), probe).await;
        assert!(timed_out.is_err());
        assert_eq!(b.state(), BreakerState::Open, "not stuck half-open");
        assert_eq!(
            b.admit(b.now_ms() + 1),
            Admit::Probe,
            "the next probe may go"
        );
    }

    /// A probe whose server refuses connections fails before its call is made (the call would
    /// have waited out the pool); calls while closed are not checked; a probe to a server
    /// that accepts goes out and closes the breaker.
    #[tokio::test]
    async fn a_probe_to_a_server_that_refuses_connections_fails_at_once() {
        let refusing = Arc::new(AtomicBool::new(true));
        let (asked, seen) = (Arc::new(AtomicU32::new(0)), refusing.clone());
        let counted = asked.clone();
        let b = Breaker::new(1, 0).on_probe(move || {
            counted.fetch_add(1, Ordering::AcqRel);
            let refused = seen.load(Ordering::Acquire);
            async move { refused }
        });
        let fine = b.call(async { Ok::<_, LedgerError>(1) }).await;
        assert!(fine.is_ok());
        assert_eq!(asked.load(Ordering::Acquire), 0, "closed: no check");
        b.record(Admit::Pass, false, 0);
        assert_eq!(b.state(), BreakerState::Open);
        let made = AtomicBool::new(false);
        let probe = b
            .call(async {
                made.store(true, Ordering::Release);
                Ok::<_, LedgerError>(2)
            })
            .await;
        assert!(matches!(probe, Err(LedgerError::CircuitOpen)), "{probe:?}");
        assert!(!made.load(Ordering::Acquire), "the call was not made");
        assert_eq!(b.state(), BreakerState::Open, "opened again");
        refusing.store(false, Ordering::Release);
        let probe = b.call(async { Ok::<_, LedgerError>(3) }).await;
        assert_eq!(probe.ok(), Some(3));
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(asked.load(Ordering::Acquire), 2);
        // A check that always says refused vetoes MAX_VETOES - 1 probes in a row, not the next.
        refusing.store(true, Ordering::Release);
        b.record(Admit::Pass, false, 0);
        for _ in 0..MAX_VETOES - 1 {
            let vetoed = b.call(async { Ok::<_, LedgerError>(4) }).await;
            assert!(matches!(vetoed, Err(LedgerError::CircuitOpen)));
        }
        let goes = b.call(async { Ok::<_, LedgerError>(5) }).await;
        assert_eq!(goes.ok(), Some(5), "that probe goes out");
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[tokio::test]
    async fn only_an_unreachable_ledger_counts() {
        let b = Breaker::new(1, 1000);
        let busy = b.call(async { Err::<(), _>(LedgerError::QueueFull) }).await;
        assert!(busy.is_err());
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "a full queue is the ledger answering"
        );
        let answered = b
            .call(async { Err::<(), _>(LedgerError::database("lock timeout")) })
            .await;
        assert!(answered.is_err());
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "a database error is the ledger answering"
        );
        let down = b.call(async { Err::<(), _>(LedgerError::Deadline) }).await;
        assert!(down.is_err());
        assert_eq!(b.state(), BreakerState::Open);
        let refused = b.call(async { Ok::<(), LedgerError>(()) }).await;
        assert!(matches!(refused, Err(LedgerError::CircuitOpen)));
    }

    #[test]
    fn zero_failures_never_opens() {
        let b = Breaker::new(0, 100);
        for t in 0..100 {
            b.record(Admit::Pass, false, t);
        }
        assert_eq!(b.admit(100), Admit::Pass);
    }
}

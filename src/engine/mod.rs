//! The engine: everything between the HTTP routes and the ledger.
//!
//! [`EngineHandle`] is the cloneable front door routes call. Behind it a registry maps each voucher
//! code to its owner [`actor::VoucherActor`] on this node; actors are spread by hash of the code
//! over the HTTP workers' own arbiters (`engine.actors_on_http_workers`; the shards, one actix
//! `Arbiter` each, host them otherwise and before the workers run), started lazily on first use
//! or by warm-up, and stop after idleness. Reserves go to the actor through a bounded mailbox
//! (`try_send`; full → `503`); everything else (confirm, release, reads, admin) goes to the
//! ledger directly. Restocks from any source pass through [`Core::restocked`], which lowers the
//! sold-out flag and tells the actor.

mod actor;
mod known;
pub mod limits;
pub(crate) mod quota;
pub mod sizing;
pub mod soldout;

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::dev::SendError;
use actix::prelude::*;
use dashmap::DashMap;
use tokio::sync::oneshot;

use crate::clock::{ledger_ahead, Millis, SharedClock};
use crate::config::{EngineSettings, LimitSettings};
use crate::domain::{
    FeedEvent, Ineligible, Reservation, ReserveRequest, Switches, SwitchesPatch, Voucher,
    VoucherPatch,
};
use crate::ledger::{Counters, LedgerError, Restock, SharedLedger};
use crate::metrics::{self as m, Outcome};
use crate::signals::{Publisher, Signal};
use actor::{Drain, Recall, Reload, Reserve, Restocked, SoldOutElsewhere, VoucherActor, Warm};
use known::{Known, KnownCodes};
use limits::{Limited, RateLimits};
use sizing::SizingParams;
use soldout::{SoldOutVerdict, VoucherShared};

/// What the engine answers when it cannot do what was asked. Mapped to HTTP in `api::error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("not found")]
    NotFound,
    #[error("out of stock")]
    OutOfStock,
    #[error("already used")]
    AlreadyUsed,
    #[error("not eligible: {0:?}")]
    NotEligible(Ineligible),
    #[error("temporarily unavailable")]
    Unavailable,
    /// A rate limit refused the request; the next one may pass after this many seconds.
    #[error("rate limited")]
    RateLimited { retry_after_secs: u64 },
    #[error("already exists")]
    AlreadyExists,
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("reservation was released")]
    ReservationReleased,
    #[error("reservation is already confirmed")]
    AlreadyConfirmed,
}

impl From<LedgerError> for EngineError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::AlreadyExists => Self::AlreadyExists,
            LedgerError::NotFound => Self::NotFound,
            LedgerError::Released => Self::ReservationReleased,
            LedgerError::AlreadyConfirmed => Self::AlreadyConfirmed,
            LedgerError::Invalid(why) => Self::Invalid(why.to_string()),
            LedgerError::Fenced
            | LedgerError::Deadline
            | LedgerError::QueueFull
            | LedgerError::WorkerGone
            | LedgerError::Unreachable { .. }
            | LedgerError::Database { .. }
            | LedgerError::CommitFailed(_) => {
                tracing::warn!(error = %e, "ledger call failed");
                Self::Unavailable
            }
            // Said once, when the breaker opened.
            LedgerError::CircuitOpen => Self::Unavailable,
        }
    }
}

/// The metric outcome of a reserve's answer.
pub(crate) fn outcome_of(res: &Result<Reserved, EngineError>) -> Outcome {
    match res {
        Ok(r) if r.replayed => Outcome::Replayed,
        Ok(_) => Outcome::Created,
        Err(e) => error_outcome(e),
    }
}

pub(crate) fn error_outcome(e: &EngineError) -> Outcome {
    match e {
        EngineError::OutOfStock => Outcome::OutOfStock,
        EngineError::AlreadyUsed => Outcome::AlreadyUsed,
        EngineError::NotEligible(_) => Outcome::NotEligible,
        EngineError::NotFound => Outcome::NotFound,
        EngineError::Invalid(_) => Outcome::Invalid,
        EngineError::RateLimited { .. } => Outcome::RateLimited,
        _ => Outcome::Unavailable,
    }
}

/// What the node-wide switches do to new reserves (retries of stored orders still get their
/// `201`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    No,
    /// `422 NOT_ELIGIBLE` with reason `PAUSED`.
    SalesPaused,
    /// `503 UNAVAILABLE`.
    ReadOnly,
}

/// Answers reserves that no lease unit can serve (the voucher is sold out here, not eligible
/// now, or the switches stop new sales) with DESIGN §4's precedence, from the ledger's rows: a
/// retry of a stored order of the same customer gets its `201`; then `503` if the node is
/// read-only; then `422` if the voucher (as `voucher` says) or the sales-paused switch refuses
/// the order; then `409 ALREADY_USED` (the order id is taken, or the customer is at their
/// limit); else `409 OUT_OF_STOCK`. Two ledger reads at most, for all of `reqs` at once.
pub(crate) async fn settle_without_units(
    ledger: &SharedLedger,
    code: &str,
    voucher: Option<&Voucher>,
    now: Millis,
    reqs: &[ReserveRequest],
    stop: Stop,
) -> Result<Vec<Result<Reserved, EngineError>>, LedgerError> {
    let ids: Vec<String> = reqs.iter().map(|r| r.order_id.clone()).collect();
    let found: HashMap<String, Reservation> = ledger
        .find_orders(&ids)
        .await?
        .into_iter()
        .map(|r| (r.order_id.clone(), r))
        .collect();
    let refusal = |req: &ReserveRequest| {
        voucher
            .and_then(|v| v.check_eligible(now, req.order_amount).err())
            .or((stop == Stop::SalesPaused).then_some(Ineligible::Paused))
    };
    let mut customers: Vec<i64> = reqs
        .iter()
        .filter(|r| {
            !found.contains_key(&r.order_id) && refusal(r).is_none() && stop != Stop::ReadOnly
        })
        .map(|r| r.customer_id)
        .collect();
    customers.sort_unstable();
    customers.dedup();
    let used: HashMap<i64, i64> = match (voucher, customers.is_empty()) {
        (Some(_), false) => ledger
            .customer_usage(code, &customers)
            .await?
            .into_iter()
            .collect(),
        _ => HashMap::new(),
    };
    let limit = voucher.map_or(i64::MAX, |v| v.per_user_limit);
    Ok(reqs
        .iter()
        .map(|req| match (found.get(&req.order_id), refusal(req)) {
            _ if voucher.is_some_and(|v| v.refuses_amount(req.order_amount)) => {
                Err(EngineError::NotEligible(Ineligible::MinOrderAmount))
            }
            (Some(r), _) if r.is_retry_of(code, req.customer_id, now) => Ok(Reserved {
                reservation: r.clone(),
                replayed: true,
            }),
            _ if stop == Stop::ReadOnly => Err(EngineError::Unavailable),
            (_, Some(reason)) => Err(EngineError::NotEligible(reason)),
            (Some(_), None) => Err(EngineError::AlreadyUsed),
            (None, None) if used.get(&req.customer_id).is_some_and(|&n| n >= limit) => {
                Err(EngineError::AlreadyUsed)
            }
            (None, None) => Err(EngineError::OutOfStock),
        })
        .collect())
}

/// The frontend's answer to a reserve from a sold-out voucher's flag (DESIGN §4's precedence,
/// with the switches after a possible retry's `201`), or `None` when only the ledger can tell
/// (an order that may have won, a customer who may be at their limit).
pub(crate) fn answer_from_flag(
    verdict: SoldOutVerdict,
    stop: Stop,
) -> Option<Result<Reserved, EngineError>> {
    Some(match verdict {
        SoldOutVerdict::NotEligible(Ineligible::MinOrderAmount) => {
            Err(EngineError::NotEligible(Ineligible::MinOrderAmount))
        }
        SoldOutVerdict::NotEligible(_)
        | SoldOutVerdict::AlreadyUsed
        | SoldOutVerdict::OutOfStock
            if stop == Stop::ReadOnly =>
        {
            Err(EngineError::Unavailable)
        }
        SoldOutVerdict::AlreadyUsed | SoldOutVerdict::OutOfStock if stop == Stop::SalesPaused => {
            Err(EngineError::NotEligible(Ineligible::Paused))
        }
        SoldOutVerdict::OutOfStock => Err(EngineError::OutOfStock),
        SoldOutVerdict::NotEligible(reason) => Err(EngineError::NotEligible(reason)),
        SoldOutVerdict::AlreadyUsed => Err(EngineError::AlreadyUsed),
        SoldOutVerdict::AskLedger | SoldOutVerdict::MaybeAtLimit => return None,
    })
}

/// The "code" the `SWITCHES` signal travels under (no voucher code contains `~`).
const SWITCHES_CHANNEL: &str = "~switches";

/// Counts a reserve as waiting for its actor while alive.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn enter(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Self(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a rate-limit refusal and turns it into the engine's answer.
fn rate_limited(l: Limited) -> EngineError {
    m::rate_limited(l.limiter.label());
    EngineError::RateLimited {
        retry_after_secs: l.retry_after.as_secs_f64().ceil().max(1.0) as u64,
    }
}

/// A successful reserve: the reservation and whether it was a retry of an earlier one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    pub reservation: Reservation,
    pub replayed: bool,
}

/// A voucher with its live counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VoucherView {
    pub voucher: Voucher,
    pub counters: Counters,
}

impl VoucherView {
    pub fn sold_out(&self) -> bool {
        self.counters.free + self.counters.leased_unused == 0
    }
}

/// One registry row: the owner actor of a voucher on this node and the state the frontend reads.
///
/// A request clones the row, its actor's address included: each clone of an `Addr` is a sender
/// with a guaranteed slot in the actor's mailbox, so a burst at a new actor (whose mailbox has
/// actix's default capacity of 16 until it starts) is queued, not refused. One address shared
/// by every request would refuse that burst (the API test of an actor whose thread ends shows
/// it).
#[derive(Clone)]
struct Entry {
    addr: Addr<VoucherActor>,
    shared: Arc<VoucherShared>,
    generation: u64,
    /// The voucher's admission limiter on this node, when admission is limited.
    admission: Option<Arc<limits::Admission>>,
    /// The actor was started on an HTTP worker's arbiter, not on a shard (diagnostics).
    on_worker: bool,
}

/// A voucher code's hash: picks its shard, and keys its customers in the per-customer limiter
/// (which hashes the pair again with a random seed).
fn code_hash(code: &str) -> u64 {
    BuildHasher::hash_one(
        &foldhash::fast::FixedState::with_seed(0x766f_7563_6865_7273),
        code,
    )
}

/// State shared by the handle, the actors and the jobs.
pub(crate) struct Core {
    pub ledger: SharedLedger,
    pub clock: SharedClock,
    pub settings: EngineSettings,
    pub sizing: SizingParams,
    pub node_id: String,
    request_timeout: Duration,
    pub signals: Publisher,
    known: KnownCodes,
    pub(crate) limits: RateLimits,
    /// Reserves waiting for their actor's answer on this node (the tarpit's "busy").
    in_flight: AtomicUsize,
    /// The emergency switches as this node last read them (from the ledger, at least every
    /// `jobs.switches_interval_ms`, and at once on the `SWITCHES` signal).
    sales_paused: AtomicBool,
    read_only: AtomicBool,
    /// The version of the switches applied (see [`Core::apply_switches`]).
    switch_version: std::sync::Mutex<i64>,
    /// Hashed with foldhash (randomly seeded per map), not SipHash: every request looks its
    /// code up here.
    registry: DashMap<String, Entry, foldhash::fast::RandomState>,
    shards: Vec<ArbiterHandle>,
    /// The HTTP workers' arbiters, by thread, as each worker starts (with
    /// `actors_on_http_workers`): actors go there first, so that a reserve and its answer can
    /// stay on one thread.
    workers: std::sync::RwLock<Vec<(std::thread::ThreadId, ArbiterHandle)>>,
    next_generation: AtomicU64,
    /// The node hears other nodes' signals now (always without Redis, where flags rest on the
    /// probes alone). A sold-out flag answers from memory only then: a missed `RESTOCK` could
    /// otherwise refuse the retry of an order another node sold from the restocked units.
    signals_up: AtomicBool,
    /// A task is reaping dead holders' leases: the next beat does not start another.
    reaping: AtomicBool,
    /// Vouchers that sold out here since the live numbers last ran: their books are recounted
    /// then, one after the other (not at once by every actor, competing with the sale's reads).
    recount: std::sync::Mutex<HashSet<String>>,
}

impl Core {
    /// What the switches say about new reserves now.
    pub(crate) fn stop(&self) -> Stop {
        if self.read_only.load(Ordering::Acquire) {
            Stop::ReadOnly
        } else if self.sales_paused.load(Ordering::Acquire) {
            Stop::SalesPaused
        } else {
            Stop::No
        }
    }

    /// Applies switches read from the ledger, unless they are older than what this node holds
    /// (a read that started before a change must not undo it).
    fn apply_switches(&self, s: Switches) {
        let mut held = self
            .switch_version
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if s.version < *held {
            return;
        }
        *held = s.version;
        self.sales_paused.store(s.sales_paused, Ordering::Release);
        self.read_only.store(s.read_only, Ordering::Release);
        m::switches(s.sales_paused, s.read_only);
    }

    /// `code` sold out here: its books are recounted at the next live numbers.
    pub(crate) fn recount_soon(&self, code: &str) {
        self.recount
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(code.to_string());
    }

    /// Units went back to `free` for `code` on this node: act on it and tell the cluster.
    pub(crate) fn restocked(&self, code: &str) {
        self.apply_restock(code);
        self.signals.publish(code, Signal::Restock);
    }

    /// Lowers the sold-out flag and lets the actor lease again.
    fn apply_restock(&self, code: &str) {
        if let Some(e) = self.registry.get(code) {
            e.shared.restock();
            let _ = e.addr.try_send(Restocked);
        }
    }

    /// Removes an actor's registry row when it stops, unless a successor already took it.
    pub(crate) fn forget(&self, code: &str, generation: u64) {
        self.registry
            .remove_if(code, |_, e| e.generation == generation);
    }

    /// The arbiter `code`'s actor starts on, and whether it is an HTTP worker's: a live
    /// worker's, chosen by the code's hash, else the code's shard. A worker that stopped
    /// (shutdown, or a panic actix-server recovered from) leaves the list here.
    fn home(&self, code: &str) -> (ArbiterHandle, bool) {
        let mut workers = self.workers.read().unwrap_or_else(|e| e.into_inner());
        if !workers.iter().all(|(_, a)| a.alive()) {
            drop(workers);
            self.workers
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|(_, a)| a.alive());
            workers = self.workers.read().unwrap_or_else(|e| e.into_inner());
        }
        if !workers.is_empty() {
            let (_, worker) = &workers[(code_hash(code) % workers.len() as u64) as usize];
            return (worker.clone(), true);
        }
        let shard = self.shard_of(code).cloned();
        (shard.unwrap_or_else(Arbiter::current), false)
    }

    /// `code`'s shard, by the code's hash (`None` only without shards).
    fn shard_of(&self, code: &str) -> Option<&ArbiterHandle> {
        let n = self.shards.len().max(1) as u64;
        self.shards.get((code_hash(code) % n) as usize)
    }

    /// Runs `work` for `code` on its shard, away from the calling actor's thread, which may be
    /// ending. Once the shards have stopped (the end of a shutdown, after the drain returned
    /// every lease of the node) it is dropped.
    pub(crate) fn background(
        &self,
        code: &str,
        work: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        match self.shard_of(code) {
            Some(shard) => {
                shard.spawn(work);
            }
            None => {
                actix::spawn(work);
            }
        }
    }

    fn entry(self: &Arc<Self>, code: &str) -> Entry {
        if let Some(e) = self.registry.get(code) {
            return e.clone();
        }
        self.registry
            .entry(code.to_string())
            .or_insert_with(|| {
                let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
                let shared = Arc::new(VoucherShared::default());
                let (home, on_worker) = self.home(code);
                let (core, c, sh) = (self.clone(), code.to_string(), shared.clone());
                let addr = VoucherActor::start_in_arbiter(&home, move |_| {
                    VoucherActor::new(c, core, sh, generation)
                });
                Entry {
                    addr,
                    shared,
                    generation,
                    admission: self.limits.new_admission().map(Arc::new),
                    on_worker,
                }
            })
            .clone()
    }
}

/// The cloneable front door of the engine; the only thing routes see.
#[derive(Clone)]
pub struct EngineHandle {
    core: Arc<Core>,
}

/// The shards of an engine; stop them on shutdown.
pub struct Shards(Vec<Arbiter>);

impl Shards {
    pub fn stop(self) {
        for a in self.0 {
            a.stop();
            let _ = a.join();
        }
    }
}

impl EngineHandle {
    /// Starts the shards. Must run inside an actix `System`.
    pub fn start(
        ledger: SharedLedger,
        clock: SharedClock,
        settings: EngineSettings,
        node_id: String,
        request_timeout: Duration,
        signals: Publisher,
        limit_settings: &LimitSettings,
    ) -> (Self, Shards) {
        let n = if settings.shards == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            settings.shards
        };
        let arbiters: Vec<Arbiter> = (0..n).map(|_| Arbiter::new()).collect();
        let alone = !signals.enabled();
        let core = Core {
            known: KnownCodes::new(settings.known_codes_refresh_ms),
            in_flight: AtomicUsize::new(0),
            sales_paused: AtomicBool::new(false),
            read_only: AtomicBool::new(false),
            switch_version: std::sync::Mutex::new(i64::MIN),
            limits: RateLimits::new(limit_settings, clock.clone()),
            ledger,
            clock,
            sizing: SizingParams::from(&settings),
            settings,
            node_id,
            request_timeout,
            signals,
            registry: DashMap::default(),
            recount: std::sync::Mutex::new(HashSet::new()),
            shards: arbiters.iter().map(Arbiter::handle).collect(),
            workers: std::sync::RwLock::new(Vec::new()),
            next_generation: AtomicU64::new(0),
            // Without Redis no signal can be missed: flags rest on the probes (two intervals).
            signals_up: AtomicBool::new(alone),
            reaping: AtomicBool::new(false),
        };
        (
            Self {
                core: Arc::new(core),
            },
            Shards(arbiters),
        )
    }

    pub fn node_id(&self) -> &str {
        &self.core.node_id
    }

    /// Called on each HTTP worker's thread as it starts: with `engine.actors_on_http_workers`,
    /// voucher actors are started on the workers' arbiters from now on. A reserve that arrives
    /// on its actor's worker is then queued, batched and answered without a wake-up of another
    /// thread; on a 2-core box that hand-over (and the context switches it brings) was the
    /// largest cost of a durable reserve after the ledger's own.
    pub fn host_actors_here(&self) {
        if !self.core.settings.actors_on_http_workers {
            return;
        }
        if let Some(here) = Arbiter::try_current() {
            // Once per worker thread: the factory runs per listener, and again on a restart.
            let thread = std::thread::current().id();
            let mut workers = self.core.workers.write().unwrap_or_else(|e| e.into_inner());
            workers.retain(|(t, a)| a.alive() && *t != thread);
            workers.push((thread, here));
        }
    }

    pub fn now_ms(&self) -> i64 {
        self.core.clock.now_ms()
    }

    /// Reads every voucher code into memory (start-up). On failure the first request for an
    /// unknown code tries again.
    pub async fn load_known_codes(&self) {
        match self.core.known.load(&self.core.ledger).await {
            Ok(()) => tracing::info!(codes = self.core.known.len(), "voucher codes loaded"),
            Err(e) => tracing::warn!(error = %e, "could not load voucher codes yet"),
        }
    }

    /// `404` from memory for a code that does not exist; `503` when that cannot be told.
    ///
    /// While reserves of real vouchers wait on this node, the `404` comes after
    /// `engine.unknown_code_tarpit_ms`: each junk connection then gets one answer per interval
    /// (the request was still parsed), so a bot's connections cannot crowd out real checkouts.
    /// An idle node answers at once.
    async fn known(&self, code: &str) -> Result<(), EngineError> {
        match self.core.known.check(code, &self.core.ledger).await {
            Known::Yes => Ok(()),
            Known::No => {
                let tarpit = self.core.settings.unknown_code_tarpit_ms;
                if tarpit > 0 && self.core.in_flight.load(Ordering::Relaxed) > 0 {
                    tokio::time::sleep(Duration::from_millis(tarpit)).await;
                }
                Err(EngineError::NotFound)
            }
            Known::Unknown => Err(EngineError::Unavailable),
        }
    }

    /// Reserves one unit for an order. A sold-out voucher is answered from memory, except for
    /// orders that may have won, which the ledger answers.
    ///
    /// Outcomes are counted where they are decided: here for what the frontend answers itself,
    /// in the actor for the rest (once per batch where there is one).
    ///
    /// DESIGN §4's precedence starts here: rate limits first (per `client` address, then, for a
    /// code that exists, per customer and per voucher), all in memory and changing nothing.
    pub async fn reserve(
        &self,
        code: &str,
        req: ReserveRequest,
        client: Option<IpAddr>,
    ) -> Result<Reserved, EngineError> {
        if let Some(ip) = client {
            self.core.limits.address(ip).map_err(rate_limited)?;
        }
        if let Err(e) = self.known(code).await {
            m::reservation(error_outcome(&e));
            return Err(e);
        }
        let mut entry = self.core.entry(code);
        let res = self.reserve_on(code, req, &mut entry).await;
        entry.shared.count_outcome(outcome_of(&res));
        res
    }

    /// [`EngineHandle::reserve`] for a code that exists, from its per-customer and per-voucher
    /// limits on; `entry` ends as the registry row that answered.
    async fn reserve_on(
        &self,
        code: &str,
        req: ReserveRequest,
        entry: &mut Entry,
    ) -> Result<Reserved, EngineError> {
        let own = entry.shared.own_limits();
        let limits = &self.core.limits;
        limits
            .customer(code_hash(code), req.customer_id, own.as_deref())
            .map_err(rate_limited)?;
        limits
            .admit(entry.admission.as_deref(), own.as_deref())
            .map_err(rate_limited)?;
        for attempt in 0..3 {
            if attempt > 0 {
                // The actor stopped: its successor's row.
                *entry = self.core.entry(code);
            }
            let now = self.now_ms();
            if self.core.signals_up.load(Ordering::Acquire)
                && entry
                    .shared
                    .trusted(now, self.core.settings.soldout_probe_ms)
            {
                m::sold_out_short_circuit();
                entry.shared.count_short_circuit(now);
                let res = self.answer_sold_out(code, &req, &entry.shared, now).await;
                m::reservation(outcome_of(&res));
                return res;
            }
            if self.ledger_refused() {
                m::reservation(Outcome::Unavailable);
                return Err(EngineError::Unavailable);
            }
            let (tx, rx) = oneshot::channel();
            match entry.addr.try_send(Reserve {
                req: req.clone(),
                reply: tx,
            }) {
                Ok(()) => {}
                Err(SendError::Full(_)) => {
                    m::mailbox_full();
                    m::reservation(Outcome::Unavailable);
                    return Err(EngineError::Unavailable);
                }
                Err(SendError::Closed(_)) => {
                    // The actor stopped after idleness: start a fresh one.
                    self.core.forget(code, entry.generation);
                    continue;
                }
            }
            let _waiting = InFlight::enter(&self.core.in_flight);
            return match tokio::time::timeout(self.core.request_timeout, rx).await {
                Ok(Ok(reply)) => reply.into_result(),
                // The actor stopped without answering. Asking again is safe: a reserve is
                // idempotent by order id, so one that did commit comes back as its 201.
                Ok(Err(_)) => {
                    self.core.forget(code, entry.generation);
                    continue;
                }
                Err(_) => {
                    m::reservation(Outcome::Unavailable);
                    Err(EngineError::Unavailable)
                }
            };
        }
        m::reservation(Outcome::Unavailable);
        Err(EngineError::Unavailable)
    }

    /// DESIGN §4's precedence from memory where it can tell, from the ledger where only the
    /// ledger can (an order that may have won, a customer who may be at their limit).
    async fn answer_sold_out(
        &self,
        code: &str,
        req: &ReserveRequest,
        shared: &VoucherShared,
        now: Millis,
    ) -> Result<Reserved, EngineError> {
        let stop = self.core.stop();
        match answer_from_flag(shared.sold_out_verdict(now, req), stop) {
            Some(answer) => answer,
            None => {
                let voucher = shared.voucher();
                let mut answers = settle_without_units(
                    &self.core.ledger,
                    code,
                    voucher.as_deref(),
                    now,
                    std::slice::from_ref(req),
                    stop,
                )
                .await?;
                answers.pop().unwrap_or(Err(EngineError::OutOfStock))
            }
        }
    }

    /// Whether the frontend answers this voucher from memory now (tests and diagnostics).
    pub fn is_sold_out_locally(&self, code: &str) -> bool {
        self.core
            .registry
            .get(code)
            .is_some_and(|e| e.shared.is_sold_out())
    }

    /// Reserves waiting for their actor on this node now (tests and diagnostics).
    pub fn reserves_in_flight(&self) -> usize {
        self.core.in_flight.load(Ordering::Relaxed)
    }

    /// Whether `code`'s actor on this node lives on an HTTP worker's thread (`None`: it has no
    /// actor here; tests and diagnostics).
    pub fn actor_on_http_worker(&self, code: &str) -> Option<bool> {
        self.core.registry.get(code).map(|e| e.on_worker)
    }

    /// How many vouchers have an actor on this node (tests and diagnostics).
    pub fn actor_count(&self) -> usize {
        self.core.registry.len()
    }

    /// How often this node read the voucher codes from the ledger (tests and diagnostics).
    pub fn known_code_reads(&self) -> u64 {
        self.core.known.reads()
    }

    /// How many reserves of `code` this node answered from memory while it was sold out.
    pub fn short_circuits(&self, code: &str) -> u64 {
        self.core
            .registry
            .get(code)
            .map_or(0, |e| e.shared.short_circuits())
    }

    /// Confirm and release first read the reservation: made-up order ids get `404` from that read
    /// and never take the ledger's writer (on SQLite the one connection every commit needs).
    pub async fn confirm(&self, code: &str, order_id: &str) -> Result<Reservation, EngineError> {
        self.reservation(code, order_id).await?;
        Ok(self
            .core
            .ledger
            .confirm(code, order_id, self.now_ms())
            .await?)
    }

    pub async fn release(&self, code: &str, order_id: &str) -> Result<Reservation, EngineError> {
        self.reservation(code, order_id).await?;
        let (r, restock) = self
            .core
            .ledger
            .release(code, order_id, self.now_ms())
            .await?;
        self.after_restocks(restock.into_iter());
        Ok(r)
    }

    pub async fn reservation(
        &self,
        code: &str,
        order_id: &str,
    ) -> Result<Reservation, EngineError> {
        self.known(code).await?;
        let found = self
            .core
            .ledger
            .find_orders(&[order_id.to_string()])
            .await?;
        found
            .into_iter()
            .find(|r| r.voucher_code == code)
            .ok_or(EngineError::NotFound)
    }

    /// The public view: the voucher and whether nothing is left to sell (one ledger read).
    pub async fn public_voucher(&self, code: &str) -> Result<(Voucher, bool), EngineError> {
        self.known(code).await?;
        let (voucher, available) = self
            .core
            .ledger
            .voucher_stock(code)
            .await?
            .ok_or(EngineError::NotFound)?;
        Ok((voucher, available == 0))
    }

    pub async fn voucher(&self, code: &str) -> Result<VoucherView, EngineError> {
        let voucher = self
            .core
            .ledger
            .voucher(code)
            .await?
            .ok_or(EngineError::NotFound)?;
        let counters = self
            .core
            .ledger
            .counters(code)
            .await?
            .ok_or(EngineError::NotFound)?;
        Ok(VoucherView { voucher, counters })
    }

    pub async fn create_voucher(&self, v: &Voucher) -> Result<(), EngineError> {
        self.core.ledger.create_voucher(v, self.now_ms()).await?;
        self.core.known.insert(&v.code);
        // Other nodes learn the code now rather than at their next re-read.
        self.core.signals.publish(&v.code, Signal::Updated);
        Ok(())
    }

    pub async fn update_voucher(
        &self,
        code: &str,
        patch: &VoucherPatch,
    ) -> Result<Voucher, EngineError> {
        let (voucher, restock) = self.core.ledger.update_voucher(code, patch).await?;
        if let Some(e) = self.core.registry.get(code) {
            let _ = e.addr.try_send(Reload(voucher.clone()));
        }
        self.core.signals.publish(code, Signal::Updated);
        self.after_restocks(restock.into_iter());
        Ok(voucher)
    }

    /// The ledger's feed origin (see [`crate::ledger::Ledger::feed_origin`]).
    pub async fn feed_origin(&self) -> Result<String, EngineError> {
        Ok(self.core.ledger.feed_origin().await?)
    }

    /// The change feed after `after`, at most `limit` events (`GET /admin/events`).
    pub async fn events(&self, after: i64, limit: i64) -> Result<Vec<FeedEvent>, EngineError> {
        Ok(self.core.ledger.events(after, limit).await?)
    }

    /// Warms the voucher on this node and tells every other node to do the same (`WARM`).
    pub async fn warm_everywhere(&self, code: &str) -> Result<(), EngineError> {
        self.warm(code).await?;
        self.core.signals.publish(code, Signal::Warm);
        Ok(())
    }

    /// Pre-heat: warms, on this node, every voucher whose sale starts within
    /// `engine.preheat_ms`, so the first second of the sale is served from leases. Every node
    /// runs it (jobs), so every node is warm. Returns how many vouchers it warmed.
    pub async fn preheat(&self) -> Result<usize, EngineError> {
        let lead = self.core.settings.preheat_ms;
        if lead <= 0 {
            return Ok(0);
        }
        let now = self.now_ms();
        let codes = self.core.ledger.starting_between(now, now + lead).await?;
        // The codes come from the ledger: no existence read per code.
        let warmed = futures_util::future::join_all(codes.iter().map(|c| self.warm_actor(c))).await;
        for (code, res) in codes.iter().zip(&warmed) {
            if let Err(e) = res {
                tracing::warn!(code = %code, error = %e, "pre-heat");
            }
        }
        Ok(warmed.iter().filter(|r| r.is_ok()).count())
    }

    /// Starts the voucher's actor on this node and waits until it holds its first lease.
    pub async fn warm(&self, code: &str) -> Result<(), EngineError> {
        if self.core.ledger.voucher(code).await?.is_none() {
            return Err(EngineError::NotFound);
        }
        self.warm_actor(code).await
    }

    /// Starts the actor of a voucher known to exist and waits until it holds its first lease.
    async fn warm_actor(&self, code: &str) -> Result<(), EngineError> {
        self.core.known.insert(code);
        let entry = self.core.entry(code);
        let (tx, rx) = oneshot::channel();
        entry
            .addr
            .try_send(Warm(tx))
            .map_err(|_| EngineError::Unavailable)?;
        match tokio::time::timeout(self.core.request_timeout, rx).await {
            Ok(Ok(res)) => res,
            _ => Err(EngineError::Unavailable),
        }
    }

    /// The subscription to cluster signals came up (`true`) or ended. While it is down a
    /// `RESTOCK` can be missed, so no sold-out flag answers for the ledger; when it comes back
    /// every flag stays unconfirmed until its actor's next probe finds the same winners (the
    /// winners stay: a flapping link costs one grant per sold-out voucher and probe interval).
    pub fn signals_link(&self, up: bool) {
        if up {
            for e in self.core.registry.iter() {
                e.shared.unverify();
            }
        }
        self.core.signals_up.store(up, Ordering::Release);
    }

    /// Acts on a signal another node published.
    pub fn on_signal(&self, code: &str, signal: Signal) {
        match signal {
            Signal::Restock => self.core.apply_restock(code),
            Signal::SoldOut => {
                if let Some(e) = self.core.registry.get(code) {
                    let _ = e.addr.try_send(SoldOutElsewhere);
                }
            }
            Signal::Recall => {
                if let Some(e) = self.core.registry.get(code) {
                    let _ = e.addr.try_send(Recall);
                }
            }
            Signal::Warm => {
                let (e, code) = (self.clone(), code.to_string());
                tokio::spawn(async move {
                    if let Err(err) = e.warm(&code).await {
                        tracing::warn!(code = %code, error = %err, "warm on signal");
                    }
                });
            }
            Signal::Switches => {
                let e = self.clone();
                tokio::spawn(async move {
                    if let Err(err) = e.refresh_switches().await {
                        tracing::warn!(error = %err, "read switches");
                    }
                });
            }
            Signal::Updated => {
                self.core.known.insert(code);
                let Some(addr) = self.core.registry.get(code).map(|e| e.addr.clone()) else {
                    return;
                };
                let (ledger, code) = (self.core.ledger.clone(), code.to_string());
                tokio::spawn(async move {
                    match ledger.voucher(&code).await {
                        Ok(Some(v)) => {
                            let _ = addr.try_send(Reload(v));
                        }
                        Ok(None) => {}
                        Err(e) => tracing::warn!(code = %code, error = %e, "reload voucher"),
                    }
                });
            }
        }
    }

    /// Graceful stop, after the HTTP server stopped taking requests: actors stop serving, and
    /// every lease this node holds goes back to `free` in one ledger call (which does not need
    /// the actors, whose arbiters may already be stopping).
    pub async fn drain(&self) {
        for e in self.core.registry.iter() {
            let _ = e.addr.try_send(Drain);
        }
        match self
            .core
            .ledger
            .return_node_leases(&self.core.node_id, self.now_ms())
            .await
        {
            Ok(restocks) => {
                let units: i64 = restocks.iter().map(|r| r.units).sum();
                tracing::info!(units, "returned this node's leases");
                for r in restocks {
                    self.core.signals.publish(&r.voucher_code, Signal::Restock);
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not return leases; the reaper will"),
        }
        // Gone from the living: nobody waits for this process, and its row does not linger.
        if let Err(e) = self.core.ledger.retire_node(&self.core.node_id).await {
            tracing::warn!(error = %e, "could not retire this node's heartbeat");
        }
    }

    /// The emergency switches as this node applies them now.
    pub fn switches(&self) -> Switches {
        let version = *self
            .core
            .switch_version
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        Switches {
            sales_paused: self.core.sales_paused.load(Ordering::Acquire),
            read_only: self.core.read_only.load(Ordering::Acquire),
            version,
        }
    }

    /// Changes the switches in the ledger (every node reads them from there within
    /// `jobs.switches_interval_ms`), applies them here at once and signals the cluster.
    pub async fn set_switches(&self, patch: &SwitchesPatch) -> Result<Switches, EngineError> {
        let s = self.core.ledger.set_switches(patch, self.now_ms()).await?;
        self.core.apply_switches(s);
        tracing::warn!(
            sales_paused = s.sales_paused,
            read_only = s.read_only,
            "switches set"
        );
        self.core
            .signals
            .publish(SWITCHES_CHANNEL, Signal::Switches);
        Ok(s)
    }

    /// Reads the switches from the ledger and applies them.
    pub async fn refresh_switches(&self) -> Result<Switches, EngineError> {
        let s = self.core.ledger.switches().await?;
        self.core.apply_switches(s);
        Ok(s)
    }

    /// Live numbers: the units of every voucher whose sale has started and that can still change
    /// (as the reconciler watches), from its row and active leases (no scan of its
    /// reservations), into `vouchers_units`; every node exports the same numbers. Vouchers not
    /// yet started are never exported: their codes are the secret of an unannounced sale.
    pub async fn live_numbers(&self) -> Result<usize, EngineError> {
        // These gauges are set here, so that they never go idle (see `metrics::install`).
        m::actors(self.core.registry.len());
        m::redis_configured(self.core.signals.enabled());
        let now = self.now_ms();
        let units = self
            .core
            .ledger
            .live_units(now, self.watched_after(now))
            .await?;
        units.iter().for_each(m::live_units);
        // Outcome rates per voucher, for vouchers on sale only (as the units).
        let on_sale: HashSet<&str> = units.iter().map(|u| u.code.as_str()).collect();
        for e in self.core.registry.iter() {
            if on_sale.contains(e.key().as_str()) {
                m::voucher_outcomes(e.key(), &e.shared.outcome_counts());
            }
        }
        // The books of a voucher that just sold out, recounted now rather than at the
        // reconciler's next round (one after the other; only vouchers on sale are exported).
        let sold_out: Vec<String> =
            std::mem::take(&mut *self.core.recount.lock().unwrap_or_else(|e| e.into_inner()))
                .into_iter()
                .collect();
        for code in sold_out {
            let started = on_sale.contains(code.as_str());
            if let Err(e) = reconcile_one(&self.core.ledger, &code, started).await {
                // Tried again at the next run.
                tracing::warn!(code = %code, error = %e, "recount after a sell-out failed");
                self.core.recount_soon(&code);
            }
        }
        Ok(units.len())
    }

    /// Vouchers whose window ended after this can still change by themselves (sales, and expiries
    /// up to a reservation TTL later): the reconciler and the live numbers watch them.
    fn watched_after(&self, now: Millis) -> Millis {
        now - self.core.settings.reservation_ttl_ms - 60_000
    }

    /// Rate limiters drop the keys that refilled.
    pub fn limits_upkeep(&self) {
        self.core.limits.upkeep();
        for e in self.core.registry.iter() {
            if let Some(own) = e.shared.own_limits() {
                self.core.limits.upkeep_own(&own);
            }
        }
    }

    /// `Err` says what is down: the ledger, or the node's circuit breaker on it.
    pub async fn ready(&self) -> Result<(), &'static str> {
        match self.core.ledger.ping().await {
            Ok(()) => Ok(()),
            Err(LedgerError::CircuitOpen) => Err("ledger circuit open"),
            Err(_) => Err("ledger does not answer"),
        }
    }

    /// The node's circuit breaker is open and cooling down (or probing): a new reserve would
    /// only fail later. Once it has cooled down, reserves go through, and the first batch probes.
    fn ledger_refused(&self) -> bool {
        self.core
            .ledger
            .breaker()
            .is_some_and(|b| b.refuses(b.now_ms()))
    }

    fn after_restocks(&self, restocks: impl Iterator<Item = Restock>) {
        for r in restocks {
            self.core.restocked(&r.voucher_code);
        }
    }

    /// Releases unconfirmed reservations whose time ran out. Returns how many were released.
    pub async fn expire_due(&self, batch: i64) -> Result<i64, EngineError> {
        let batch = batch.max(1);
        let mut total = 0;
        loop {
            let restocks = self.core.ledger.expire_due(self.now_ms(), batch).await?;
            let n: i64 = restocks.iter().map(|r| r.units).sum();
            total += n;
            self.after_restocks(restocks.into_iter());
            if n < batch {
                break;
            }
        }
        if total > 0 {
            m::expired(total as u64);
        }
        Ok(total)
    }

    /// Reaps leases whose node stopped renewing them. Returns the units given back.
    pub async fn reap_expired(&self) -> Result<i64, EngineError> {
        let restocks = self.core.ledger.reap_expired(self.now_ms()).await?;
        Ok(self.after_reap(restocks))
    }

    /// Beats in the ledger, and corrects this node's clock to the ledger's; the leases of
    /// holders it finds dead are reaped on a task of their own (one at a time per node), so reaping never delays this node's next beat. Returns how
    /// many holders it found dead.
    pub async fn heartbeat(&self, dead_after_ms: i64) -> Result<usize, EngineError> {
        let sent = self.now_ms();
        let beat = self
            .core
            .ledger
            .heartbeat(&self.core.node_id, sent, dead_after_ms)
            .await?;
        if let Some(ahead) = ledger_ahead(beat.ledger_ms, sent, self.now_ms()) {
            self.core.clock.follow_ledger(ahead);
        }
        let dead = beat.dead;
        let found = dead.len();
        if !dead.is_empty() && !self.core.reaping.swap(true, Ordering::AcqRel) {
            let me = self.clone();
            actix_rt::spawn(async move {
                for holder in dead {
                    match me.core.ledger.reap_holder(&holder, me.now_ms()).await {
                        Ok(restocks) => {
                            me.after_reap(restocks);
                        }
                        Err(e) => {
                            m::ledger_error(m::LedgerOp::Jobs);
                            tracing::warn!(holder, error = %e, "reaping a dead holder failed");
                        }
                    }
                }
                me.core.reaping.store(false, Ordering::Release);
            });
        }
        Ok(found)
    }

    fn after_reap(&self, restocks: Vec<Restock>) -> i64 {
        let units = restocks.iter().map(|r| r.units).sum();
        for _ in &restocks {
            m::lease(m::LeaseEvent::Reaped);
        }
        self.after_restocks(restocks.into_iter());
        units
    }

    /// Recomputes the counters of every voucher that can still change (its window has not ended
    /// more than a reservation TTL and a minute ago) from the rows; returns the codes that do
    /// not balance. Vouchers long over stay as they were last seen.
    pub async fn reconcile(&self) -> Result<Vec<String>, EngineError> {
        let now = self.now_ms();
        let ending_after = self.watched_after(now);
        // Which of them started, in one read: the others' series are not exported (see
        // `live_numbers`).
        let started: HashSet<String> = self
            .core
            .ledger
            .live_units(now, ending_after)
            .await?
            .into_iter()
            .map(|u| u.code)
            .collect();
        let mut unbalanced = Vec::new();
        for code in self.core.ledger.voucher_codes(ending_after).await? {
            if !reconcile_one(&self.core.ledger, &code, started.contains(&code)).await? {
                unbalanced.push(code);
            }
        }
        Ok(unbalanced)
    }
}

/// Recounts one voucher and records the verdict (exported only for a voucher whose sale
/// `started`); `false` when its books do not balance. The reconciler runs it for every watched
/// voucher, and an actor the moment its voucher sells out.
pub(crate) async fn reconcile_one(
    ledger: &SharedLedger,
    code: &str,
    started: bool,
) -> Result<bool, LedgerError> {
    let Some(c) = ledger.counters(code).await? else {
        return Ok(true);
    };
    m::reconciled(code, &c, started);
    if !c.balanced {
        tracing::error!(code = %code, counters = ?c, "ledger does not balance");
    }
    Ok(c.balanced)
}

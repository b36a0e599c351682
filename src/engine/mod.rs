//! The engine: everything between the HTTP routes and the ledger.
//!
//! [`EngineHandle`] is the cloneable front door routes call. Behind it the node's state
//! ([`node::Node`]) keeps a registry that maps each voucher code to its owner
//! [`actor::VoucherActor`] on this node; actors are spread by hash of the code over the HTTP
//! workers' own arbiters (`engine.actors_on_http_workers`; the shards, one actix `Arbiter` each,
//! host them otherwise and before the workers run), started lazily on first use or by warm-up,
//! and stop after idleness. Reserves go to the actor through a bounded mailbox (`try_send`; full
//! → `503`); everything else (confirm, release, reads, admin) goes to the ledger directly.
//! Restocks from any source pass through `Node::restocked`, which lowers the sold-out flag and
//! tells the actor.
//!
//! - [`checkout`]: the reserve path and the other checkout calls;
//! - [`admin`]: operators' calls (vouchers, warm-up, switches, the feed);
//! - [`upkeep`]: what the jobs call (expiry, reaping, heartbeat, reconciliation, live numbers,
//!   drain) and what other nodes' signals ask;
//! - [`node`]: the node's state and registry; [`error`]: the engine's answers;
//! - [`backlog`]: the vouchers waiting for a recount and the recounts' shared budget;
//! - [`quota`]: one voucher's protocol as a sans-IO state machine, [`actor`] its actix adapter;
//! - [`soldout`]: the per-voucher state the frontend reads without a message; [`sizing`]: lease
//!   sizing; [`limits`]: rate limits; [`known`]: the voucher codes in memory.

mod actor;
mod admin;
mod backlog;
mod checkout;
mod error;
mod known;
pub mod limits;
mod node;
pub(crate) mod quota;
pub mod sizing;
pub mod soldout;
mod spotlight;
mod upkeep;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use dashmap::DashMap;

use crate::clock::SharedClock;
use crate::config::{EngineSettings, Settings};
use crate::ledger::SharedLedger;
use crate::signals::Publisher;
use known::KnownCodes;
use limits::RateLimits;
use sizing::SizingParams;
use spotlight::Spotlight;

pub use admin::VoucherView;
pub use checkout::Reserved;
pub(crate) use checkout::{answer_from_flag, settle_without_units};
pub use error::EngineError;
pub(crate) use error::{error_outcome, outcome_of};
pub use node::Shards;
pub(crate) use node::{Gate, Node};
pub use upkeep::RECOUNT_IDLE_FACTOR;

/// The cloneable front door of the engine; the only thing routes see.
#[derive(Clone)]
pub struct EngineHandle {
    node: Arc<Node>,
}

impl EngineHandle {
    /// Starts the shards. Must run inside an actix `System`. `settings` is the engine's own;
    /// `all` gives the rate limits, the metrics' view and the reconciler's audit page.
    pub fn start(
        ledger: SharedLedger,
        clock: SharedClock,
        settings: EngineSettings,
        node_id: String,
        request_timeout: Duration,
        signals: Publisher,
        all: &Settings,
    ) -> (Self, Shards) {
        let n = if settings.shards == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            settings.shards
        };
        let arbiters: Vec<Arbiter> = (0..n).map(|_| Arbiter::new()).collect();
        let alone = !signals.enabled();
        let node = Node {
            known: KnownCodes::new(settings.known_codes_refresh_ms),
            in_flight: AtomicUsize::new(0),
            sales_paused: AtomicBool::new(false),
            read_only: AtomicBool::new(false),
            switch_version: std::sync::Mutex::new(i64::MIN),
            limits: Arc::new(RateLimits::new(&all.limits, clock.clone())),
            spotlight: Spotlight::new(all.metrics.top_vouchers, all.metrics.watch.clone()),
            changed: Default::default(),
            pace: Default::default(),
            sell_out_recounts: Default::default(),
            give_back: backlog::GiveBackGate::for_runs_every(all.jobs.live_numbers_interval_ms)
                .holding_past_preheat(all.jobs.preheat_interval_ms),
            audit: std::sync::Mutex::new(String::new()),
            audit_page: all.jobs.reconcile_audit_page.max(1),
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
            given_back_at: AtomicUsize::new(0),
            // Without Redis no signal can be missed: flags rest on the probes (two intervals).
            signals_up: AtomicBool::new(alone),
            reaping: AtomicBool::new(false),
        };
        (
            Self {
                node: Arc::new(node),
            },
            Shards(arbiters),
        )
    }

    pub fn node_id(&self) -> &str {
        &self.node.node_id
    }

    /// Called on each HTTP worker's thread as it starts: with `engine.actors_on_http_workers`,
    /// voucher actors are started on the workers' arbiters from now on. A reserve that arrives
    /// on its actor's worker is then queued, batched and answered without a wake-up of another
    /// thread; on a 2-core box that hand-over (and the context switches it brings) was the
    /// largest cost of a durable reserve after the ledger's own.
    pub fn host_actors_here(&self) {
        if !self.node.settings.actors_on_http_workers {
            return;
        }
        if let Some(here) = Arbiter::try_current() {
            // Once per worker thread: the factory runs per listener, and again on a restart.
            let thread = std::thread::current().id();
            let mut workers = self.node.workers.write().unwrap_or_else(|e| e.into_inner());
            workers.retain(|(t, a)| a.alive() && *t != thread);
            workers.push((thread, here));
        }
    }

    pub fn now_ms(&self) -> i64 {
        self.node.clock.now_ms()
    }

    /// Whether the frontend answers this voucher from memory now (tests and diagnostics).
    pub fn is_sold_out_locally(&self, code: &str) -> bool {
        self.node
            .registry
            .get(code)
            .is_some_and(|e| e.shared.is_sold_out())
    }

    /// Reserves waiting for their actor on this node now (tests and diagnostics).
    pub fn reserves_in_flight(&self) -> usize {
        self.node.in_flight.load(Ordering::Relaxed)
    }

    /// Whether `code`'s actor on this node lives on an HTTP worker's thread (`None`: it has no
    /// actor here; tests and diagnostics).
    pub fn actor_on_http_worker(&self, code: &str) -> Option<bool> {
        self.node.registry.get(code).map(|e| e.on_worker)
    }

    /// Whether a give-back of memory waits for a quiet run of the live numbers (tests and
    /// diagnostics).
    pub fn memory_give_back_due(&self) -> bool {
        self.node.give_back.is_due()
    }

    /// How many times this node gave memory back (tests and diagnostics).
    pub fn memory_give_backs(&self) -> u64 {
        self.node.give_back.runs()
    }

    /// How many vouchers have an actor on this node (tests and diagnostics).
    pub fn actor_count(&self) -> usize {
        self.node.registry.len()
    }

    /// How often this node read the voucher codes from the ledger (tests and diagnostics).
    pub fn known_code_reads(&self) -> u64 {
        self.node.known.reads()
    }

    /// How many reserves of `code` this node answered from memory while it was sold out.
    pub fn short_circuits(&self, code: &str) -> u64 {
        self.node
            .registry
            .get(code)
            .map_or(0, |e| e.shared.short_circuits())
    }

    /// The vouchers with series of their own on this node's `/metrics` now (the last pick of
    /// the live numbers that was exported).
    pub fn shown_on_metrics(&self) -> HashSet<String> {
        self.node.spotlight.shown().into_iter().collect()
    }

    /// How many grants `code`'s actor on this node made that found no units (its sold-out
    /// probes among them).
    pub fn empty_grants(&self, code: &str) -> u64 {
        self.node
            .registry
            .get(code)
            .map_or(0, |e| e.shared.empty_grants())
    }
}

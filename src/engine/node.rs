//! [`Node`]: this node's engine state, shared by the handle, the actors and the jobs: the registry
//! of vouchers that have an actor here, where actors live (HTTP workers, shards), the switches
//! as this node applies them, and the rate limiters.

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use dashmap::DashMap;

use super::actor::{Restocked, VoucherActor};
use super::backlog::{Changed, RecountPace};
use super::known::KnownCodes;
use super::limits::{self, RateLimits};
use super::sizing::SizingParams;
use super::soldout::VoucherShared;
use crate::clock::SharedClock;
use crate::config::EngineSettings;
use crate::domain::Switches;
use crate::ledger::SharedLedger;
use crate::metrics as m;
use crate::signals::{Publisher, Signal};

/// What the node-wide emergency switches let through: the gate new reserves pass (retries of
/// stored orders still get their `201` when it is shut).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// No switch is on.
    Open,
    /// `422 NOT_ELIGIBLE` with reason `PAUSED`.
    SalesPaused,
    /// `503 UNAVAILABLE`.
    ReadOnly,
}

/// One registry row: the owner actor of a voucher on this node and the state the frontend reads.
///
/// A request clones the row, its actor's address included: each clone of an `Addr` is a sender
/// with a guaranteed slot in the actor's mailbox, so a burst at a new actor (whose mailbox has
/// actix's default capacity of 16 until it starts) is queued, not refused. One address shared
/// by every request would refuse that burst (the API test of an actor whose thread ends shows
/// it).
#[derive(Clone)]
pub(super) struct Entry {
    pub(super) addr: Addr<VoucherActor>,
    pub(super) shared: Arc<VoucherShared>,
    pub(super) generation: u64,
    /// The voucher's admission limiter on this node, when admission is limited.
    pub(super) admission: Option<Arc<limits::Admission>>,
    /// The actor was started on an HTTP worker's arbiter, not on a shard (diagnostics).
    pub(super) on_worker: bool,
}

/// A voucher code's hash: picks its shard, and keys its customers in the per-customer limiter
/// (which hashes the pair again with a random seed).
pub(super) fn code_hash(code: &str) -> u64 {
    BuildHasher::hash_one(
        &foldhash::fast::FixedState::with_seed(0x766f_7563_6865_7273),
        code,
    )
}

/// Actors that must have been alive at once since the last give-back of memory for their
/// stopping to call for another ([`Node::tidy_registry`]).
const GIVE_BACK_FROM: usize = 1024;

/// State shared by the handle, the actors and the jobs.
pub(crate) struct Node {
    pub ledger: SharedLedger,
    pub clock: SharedClock,
    pub settings: EngineSettings,
    pub sizing: SizingParams,
    pub node_id: String,
    pub(super) request_timeout: Duration,
    pub signals: Publisher,
    pub(super) known: KnownCodes,
    pub(crate) limits: Arc<RateLimits>,
    /// Reserves waiting for their actor's answer on this node (the tarpit's "busy").
    pub(super) in_flight: AtomicUsize,
    /// The emergency switches as this node last read them (from the ledger, at least every
    /// `jobs.switches_interval_ms`, and at once on the `SWITCHES` signal).
    pub(super) sales_paused: AtomicBool,
    pub(super) read_only: AtomicBool,
    /// The version of the switches applied (see [`Node::apply_switches`]).
    pub(super) switch_version: std::sync::Mutex<i64>,
    /// Hashed with foldhash (randomly seeded per map), not SipHash: every request looks its
    /// code up here.
    pub(super) registry: DashMap<String, Entry, foldhash::fast::RandomState>,
    pub(super) shards: Vec<ArbiterHandle>,
    /// The HTTP workers' arbiters, by thread, as each worker starts (with
    /// `actors_on_http_workers`): actors go there first, so that a reserve and its answer can
    /// stay on one thread.
    pub(super) workers: std::sync::RwLock<Vec<(std::thread::ThreadId, ArbiterHandle)>>,
    pub(super) next_generation: AtomicU64,
    /// The most actors alive since the node last gave memory back ([`Node::tidy_registry`]).
    pub(super) given_back_at: AtomicUsize,
    /// The node hears other nodes' signals now (always without Redis, where flags rest on the
    /// probes alone). A sold-out flag answers from memory only then: a missed `RESTOCK` could
    /// otherwise refuse the retry of an order another node sold from the restocked units.
    pub(super) signals_up: AtomicBool,
    /// A task is reaping dead holders' leases: the next beat does not start another.
    pub(super) reaping: AtomicBool,
    /// Vouchers that sold out here since the live numbers last ran: their books are recounted
    /// then, one after the other (not at once by every actor, competing with the sale's reads).
    pub(super) recount: std::sync::Mutex<HashSet<String>>,
    /// Which vouchers get series of their own on `/metrics`.
    pub(super) spotlight: super::spotlight::Spotlight,
    /// Vouchers whose books this node changed outside their actors (confirm, release, expiry,
    /// reaping, edits) or whose actor stopped, since the reconciler's last run: it recounts
    /// them, and the live numbers work off a backlog of them. Actors mark their own voucher on
    /// its [`VoucherShared`].
    pub(super) changed: Changed,
    /// The budget the reconciler's, the sell-outs' and the backlog's recounts share.
    pub(super) pace: RecountPace,
    /// When each voucher that sold out here lately was recounted for it (at most once per
    /// [`super::backlog::SELL_OUT_RECOUNT_EVERY`]).
    pub(super) sell_out_recounts: super::backlog::SellOutRecounts,
    /// Whether memory goes back at the next run of the live numbers (actors stopped, or a
    /// backlog was recounted, and the node is quiet), not in the middle of a burst.
    pub(super) give_back: super::backlog::GiveBackGate,
    /// Where the reconciler's audit of the whole catalogue goes on (the last code audited).
    pub(super) audit: std::sync::Mutex<String>,
    /// Vouchers the audit covers per run.
    pub(super) audit_page: i64,
}

impl Node {
    /// What the switches say about new reserves now.
    pub(crate) fn gate(&self) -> Gate {
        if self.read_only.load(Ordering::Acquire) {
            Gate::ReadOnly
        } else if self.sales_paused.load(Ordering::Acquire) {
            Gate::SalesPaused
        } else {
            Gate::Open
        }
    }

    /// Applies switches read from the ledger, unless they are older than what this node holds
    /// (a read that started before a change must not undo it).
    pub(super) fn apply_switches(&self, s: Switches) {
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
    pub(super) fn apply_restock(&self, code: &str) {
        if let Some(e) = self.registry.get(code) {
            e.shared.restock();
            let _ = e.addr.try_send(Restocked);
        }
    }

    /// Removes an actor's registry row when it stops, unless a successor already took it.
    pub(crate) fn forget(&self, code: &str, generation: u64) {
        // The follow changes under the registry's lock, in the registry's order: a successor's
        // `follow(code, true)` cannot come before this one's `false`.
        if let Some((_, e)) = self.registry.remove_if(code, |_, e| {
            let gone = e.generation == generation;
            if gone && e.shared.followed() {
                self.signals.follow(code, false);
            }
            gone
        }) {
            if e.shared.take_changed() {
                self.changed(code);
            }
        }
    }

    /// Gives back the registry's room once most of its rows are gone: a flood of first reserves
    /// on a long tail's vouchers grows it to tens of thousands of rows, and their actors stop
    /// a couple of minutes later. Called by the live numbers, once a second; costs a look at
    /// each shard's size unless there is room to give back.
    ///
    /// Says whether memory should go back now ([`Node::give_back_memory`]): at each shrink,
    /// and again each time the actors alive fall to a quarter of what they were at the last
    /// give-back (the shrinks stop while a thousand or so remain, the room a table keeps, and
    /// the pages the last ones leave stay with their threads until those collect).
    pub(crate) fn tidy_registry(&self) -> bool {
        let len = self.registry.len();
        let given_at = self
            .given_back_at
            .fetch_max(len, Ordering::Relaxed)
            .max(len);
        if crate::memory::mostly_empty(self.registry.capacity(), len) {
            self.registry.shrink_to_fit();
        } else if given_at < GIVE_BACK_FROM || len > given_at / 4 {
            return false;
        }
        self.given_back_at.store(len, Ordering::Relaxed);
        true
    }

    /// Has every thread actors ran on, and the ledger's, hand the memory the work left back
    /// to the system ([`crate::memory`]), and the ledger its caches
    /// ([`crate::ledger::Ledger::give_back_memory`]; not `ledger_too`: a give-back forced on a
    /// busy node leaves the caches its requests use). glibc's trim, process-wide, comes last,
    /// once: after the ledger freed its caches into glibc's arenas.
    pub(super) async fn give_back_memory(&self, ledger_too: bool) {
        {
            let workers = self.workers.read().unwrap_or_else(|e| e.into_inner());
            for arbiter in self.shards.iter().chain(workers.iter().map(|(_, a)| a)) {
                arbiter.spawn_fn(crate::memory::collect_thread);
            }
        }
        if ledger_too {
            self.ledger.give_back_memory().await;
        }
        crate::memory::give_back();
    }

    /// This node changed `code`'s books: the reconciler recounts it at its next run.
    pub(crate) fn changed(&self, code: &str) {
        self.changed.mark(code);
    }

    /// The arbiter `code`'s actor starts on, and whether it is an HTTP worker's: a live
    /// worker's, chosen by the code's hash, else the code's shard. A worker that stopped
    /// (shutdown, or a panic actix-server recovered from) leaves the list here.
    pub(super) fn home(&self, code: &str) -> (ArbiterHandle, bool) {
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
    pub(super) fn shard_of(&self, code: &str) -> Option<&ArbiterHandle> {
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

    /// The registry row of `code`, its actor started if it has none; counts a request towards
    /// following its signals on a Redis Cluster ([`VoucherShared::follow_now`]).
    pub(super) fn entry(self: &Arc<Self>, code: &str) -> Entry {
        self.entry_with(code, false)
    }

    /// [`Node::entry`] for a warm-up: its signals are followed at once.
    pub(super) fn warm_entry(self: &Arc<Self>, code: &str) -> Entry {
        self.entry_with(code, true)
    }

    /// `hot`: follow the voucher's signals now rather than from its second request. The follow
    /// is asked under the registry's lock on the row (read or write), so it comes before the
    /// row's removal and its unfollow (see `forget`).
    fn entry_with(self: &Arc<Self>, code: &str, hot: bool) -> Entry {
        let follows = self.signals.follows_signals();
        if let Some(e) = self.registry.get(code) {
            if follows && e.shared.follow_now(hot) {
                self.follow(code, &e.shared);
            }
            return e.clone();
        }
        let mut inserted = false;
        let row = self.registry.entry(code.to_string()).or_insert_with(|| {
            inserted = true;
            let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
            let limits = self.limits.clone();
            let shared = Arc::new(VoucherShared::with_limits(Arc::new(move |spec| {
                limits.own(spec)
            })));
            let (home, on_worker) = self.home(code);
            // Its first request.
            shared.follow_now(false);
            let (node, c, sh) = (self.clone(), code.to_string(), shared.clone());
            let addr = VoucherActor::start_in_arbiter(&home, move |_| {
                VoucherActor::new(c, node, sh, generation)
            });
            Entry {
                addr,
                shared,
                generation,
                admission: self.limits.new_admission().map(Arc::new),
                on_worker,
            }
        });
        // A warm-up; or a request that lost the race to start the row: its second.
        if follows && (hot || !inserted) && row.shared.follow_now(hot) {
            self.follow(code, &row.shared);
        }
        row.clone()
    }

    /// Follows `code`'s signals from now on. A sold-out flag its actor raised before is no
    /// longer taken on trust: a `RESTOCK` sent while the node did not follow the voucher was
    /// never heard, so the next reserve asks the ledger.
    fn follow(&self, code: &str, shared: &VoucherShared) {
        shared.unverify();
        self.signals.follow(code, true);
    }
}

/// The shards of an engine; stop them on shutdown.
pub struct Shards(pub(super) Vec<Arbiter>);

impl Shards {
    pub fn stop(self) {
        for a in self.0 {
            a.stop();
            let _ = a.join();
        }
    }
}

//! The quota protocol of one voucher on one node, as a sans-IO state machine: events in,
//! commands out. No actix, tokio, database driver or clock lives here; the actor
//! ([`super::actor::VoucherActor`]) feeds it events and carries its commands out, and the
//! deterministic simulator (`crate::sim`) drives the same code against the model ledger.
//!
//! What leaves the core, and how:
//! - everything that needs I/O or the cluster: a [`Command`] (ledger calls, answers, signals);
//! - what the frontend answers from without messaging the actor (the sold-out flag and its
//!   winners, the voucher's definition and with it its own rate limiters): written to the one
//!   [`VoucherShared`] the core is given, which is also where it reads the restock epoch and
//!   the short-circuits the frontend counted;
//! - what the node's metrics count: a [`Stat`], drained by the adapter.
//!
//! In debug builds the core checks its local invariants after every event
//! (`check_local_invariants`), so the simulator's runs in `cargo test` check them at every step.
//!
//! # The protocol
//!
//! A node serves a voucher's reserves from **leases**: blocks of units moved out of the ledger's
//! `free` into an ACTIVE lease held by this node (DESIGN §3). Units of a lease are sold only by
//! the node that holds it, so a reserve served from a lease needs no coordination with any other
//! node: only its durable commit.
//!
//! - **Admit.** A reserve that the voucher's definition accepts now joins the queue (`pending`);
//!   one it refuses (paused, ended, amount too low, not started) or that a switch stops is
//!   *diverted* to a lookup: it may be the retry of a stored order, which gets its `201` whatever
//!   the voucher's state now (§4). The queue is bounded (`max_pending`): beyond it, `503`.
//! - **Batch.** While fewer than `batches_in_flight` batches are in flight, the queue's head
//!   becomes a batch on one servable lease (room left, expiry beyond the safety margin), at most
//!   `max_batch` rows: [`Command::Commit`]. Its units count as used until it lands. When it lands
//!   ([`Event::Committed`]) each row gets its own answer; rows that took no unit (replays,
//!   refusals) give theirs back to the lease. A failed commit answers every row `503` and gives
//!   the units back (the ledger's fence refuses the batch should it commit late); a *fenced* one
//!   drops the lease: the ledger no longer counts it as ours.
//! - **Grant.** When the queue is longer than the room, or the room falls under the low-water
//!   mark of the demand rate, or a warm-up waits, the core asks for a block
//!   ([`Command::Grant`]), one grant at a time, sized by [`super::sizing`]. Before the sale starts
//!   a warmed voucher's lease is capped (`prestart_cap`) so pre-start bots cannot pull the
//!   whole voucher into one node.
//! - **Holds.** An empty grant gives a verdict:
//!   - other leases still hold unused units (`leased_unused > 0`): `Waiting`: the queue waits up
//!     to `recall_wait_ms` while a `RECALL` asks other nodes to give idle units back; the ledger
//!     is asked again after [`RECALL_PROBE_MS`];
//!   - nothing anywhere: `Dry`: the queue goes to the lookup (`409 OUT_OF_STOCK` unless a retry),
//!     and the winners are loaded to raise the sold-out flag ([`Command::LoadWinners`]) that lets
//!     the frontend answer late traffic from memory;
//!   - a grant answered after one of this node's own batches landed gives no verdict (it may
//!     have counted that batch's units as leased): it is asked again.
//!
//!   A failed ledger call holds `Down` for 200 ms: what waits gets `503` at once.
//! - **Renew.** Leases whose expiry is nearer than half the TTL are renewed in one call; one the
//!   ledger no longer lists as ours is served no more.
//! - **Return.** Units go back to `free` ([`Command::Return`]) when a lease is idle for
//!   `lease_idle_timeout_ms`, nears its expiry, is fenced, on a `RECALL` (after the batch in
//!   flight, if reserves queue), on drain and on stop. A lease a batch in flight draws on is
//!   never returned before the batch lands. Returns are answered ([`Event::Returned`]); a failed
//!   one is tried again at the next tick, and the core does not stop while one is out.
//! - **Lost answers.** A grant that failed may have applied (its answer lost): after
//!   [`ORPHAN_CHECK_MS`] the core lists the node's ACTIVE leases of the voucher
//!   ([`Command::FindLeases`]) and returns any it neither serves, commits on, nor returns (with
//!   a grant out, once that grant answers, sparing the lease it gives; a grant failing meanwhile
//!   gets a listing of its own). A commit that
//!   failed may have applied too: its units go back to the lease's room, and the ledger's fence
//!   refuses the batch that would overdraw it (the lease is then handed back).
//! - **Sold out.** The flag goes up only if no restock happened since the grant that found the
//!   ledger empty (the restock epoch), and a verdict on the same winners announces nothing. A
//!   flagged or empty-handed node probes the ledger every `soldout_probe_ms` with a grant while
//!   its voucher is asked for (three intervals after the last request); units found lower the
//!   flag.
//! - **Stop.** An actor with nothing held, nothing in flight and no traffic for
//!   `actor_idle_stop_ms` stops ([`Command::Stop`]); every waiter then gets `503`. An actor torn
//!   down unasked (its thread ended: an HTTP worker stopping before the others at shutdown)
//!   hands its waiters back unanswered instead ([`Command::HandBack`]): the front door asks the
//!   voucher's next actor, and a reserve whose batch did commit comes back as its replay.
//!
//! - **The flag's trust.** The frontend answers from the sold-out flag only while the node's
//!   signal link is up (`EngineHandle::signals_link`) and within two probe intervals of the
//!   ledger last confirming it (the verdict that raised it, or a probe finding the same
//!   winners). A link that comes back leaves every flag unconfirmed until its next probe, since
//!   a `RESTOCK` may have been missed; so does a probe that finds units in other leases.
//!
//! The core never decides from a wall clock: every event carries `now` (and the switches as the
//! node reads them), and [`Event::Tick`] must arrive at least every [`TICK_MS`]. When `now` goes
//! back (the node's clock follows the ledger's again), no timer stays further ahead than its own
//! length.

use std::collections::VecDeque;
use std::sync::Arc;

use super::sizing::{block_size, low_water, RateEstimator, SizingParams};
use super::soldout::VoucherShared;
use super::{EngineError, Gate, Reserved};
use crate::clock::Millis;
use crate::config::EngineSettings;
use crate::domain::{Ineligible, ReserveRequest, Voucher};
use crate::ledger::{Batch, BatchRow, Grant, LedgerError, RowOutcome};
use crate::metrics::{LeaseEvent, LedgerOp};
use crate::signals::Signal;

/// A sold-out or dry core probes the ledger only while its voucher saw traffic within this many
/// probe intervals: one more than the flag's trust window.
const PROBE_WHILE_SEEN: Millis = 3;

/// How often the core expects [`Event::Tick`].
pub(crate) const TICK_MS: Millis = 250;
/// How often the core re-reads its voucher's definition.
const VOUCHER_REFRESH_MS: Millis = 1000;
/// How soon a core waiting for recalled units asks the ledger again.
pub(crate) const RECALL_PROBE_MS: Millis = 50;
/// How often a core waiting for units repeats its RECALL.
const RECALL_REPEAT_MS: Millis = 100;
/// How long a failed ledger call holds new batches and grants.
const DOWN_MS: Millis = 200;
/// How long after a failed grant the core looks for a lease it may have been given anyway.
const ORPHAN_CHECK_MS: Millis = 1000;
/// Least time between two recounts of a voucher's books on its sell-outs, per node.
const SOLD_OUT_RECOUNT_MS: Millis = 10_000;

/// The core's answer to one reserve: the engine's own answer, so that one mapping
/// ([`super::outcome_of`]) counts every answer whoever gives it.
pub(crate) type Reply = Result<Reserved, EngineError>;

/// What the core counts for the node's metrics. The core records nothing itself: the adapter
/// drains these ([`VoucherCore::stats`]) after every event and records them; the simulator drops
/// them.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stat {
    Lease(LeaseEvent),
    /// Units a granted lease holds.
    GrantedUnits(i64),
    LedgerError(LedgerOp),
    /// A reserve refused because the queue was full (`engine.max_pending`).
    QueueFull,
}

/// What a sold-out verdict was given on: the winners are loaded, then the flag goes up only if
/// nothing changed since (see [`VoucherShared::set_sold_out`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// The restock epoch when the grant that found the ledger empty was asked.
    pub epoch: u64,
    /// The voucher's reservations ever, as that grant counted them.
    pub ever_reserved: Option<i64>,
}

/// What happens to the core. `R` answers a reserve, `W` a warm-up: the adapter's reply
/// channels, or the simulator's request numbers.
#[derive(Debug)]
pub(crate) enum Event<R, W> {
    /// A reserve reached the actor (it passed the frontend's limits and sold-out flag).
    Reserve(ReserveRequest, R),
    /// Start serving: take a first lease now; answer when it is held or the ledger is empty.
    Warm(W),
    /// The voucher's definition as read for [`Command::ReadVoucher`].
    VoucherRead {
        first: bool,
        res: Result<Option<Voucher>, LedgerError>,
    },
    /// The voucher was edited (signal or API): the new definition.
    Reload(Voucher),
    /// The answer to [`Command::Commit`] `id`.
    Committed {
        id: u64,
        res: Result<Vec<RowOutcome>, LedgerError>,
    },
    /// The answer to [`Command::Grant`].
    Granted(Result<Grant, LedgerError>),
    /// The answer to [`Command::FindLeases`]: this node's ACTIVE leases of the voucher.
    Found(Result<Vec<i64>, LedgerError>),
    /// The answer to [`Command::Renew`]: the leases still ACTIVE and ours.
    Renewed(Result<Vec<i64>, LedgerError>),
    /// The answer to [`Command::Lookup`], one per request in order.
    LookedUp(Result<Vec<Result<Reserved, EngineError>>, LedgerError>),
    /// The answer to [`Command::LoadWinners`].
    WinnersLoaded(Verdict, Result<Vec<(String, i64)>, LedgerError>),
    /// Units came back to `free` (a signal, or this node's own return): the ledger is no longer
    /// taken as empty. The adapter lowers the flag ([`VoucherShared::restock`]) first.
    Restocked,
    /// The answer to a [`Command::Return`]. One that failed leaves the lease ACTIVE with its
    /// unused units, which nobody else serves or returns: the core tries again.
    Returned { lease_id: i64, ok: bool },
    /// Another node ran dry while this one may hold idle units.
    Recall,
    /// Another node saw the voucher sold out.
    SoldOutElsewhere,
    /// Shutting down: stop serving; the engine returns the node's leases in one call.
    Drain,
    /// The adapter stopped (after [`Command::Stop`], or its arbiter went away unasked).
    Stopped,
    /// Time passed (at least every [`TICK_MS`]).
    Tick,
}

/// What the core asks its adapter to do.
#[derive(Debug)]
pub(crate) enum Command<R, W> {
    Answer(R, Reply),
    AnswerWarm(W, Result<(), EngineError>),
    /// Read the voucher's definition; answer with [`Event::VoucherRead`].
    ReadVoucher {
        first: bool,
    },
    /// Commit `batch` (through the node's group committer); answer with [`Event::Committed`].
    Commit {
        id: u64,
        batch: Batch,
    },
    /// Ask for a lease of up to `want` units; answer with [`Event::Granted`].
    Grant {
        want: i64,
        now: Millis,
        ttl_ms: i64,
    },
    /// List this node's ACTIVE leases of the voucher; answer with [`Event::Found`].
    FindLeases,
    /// Renew these leases; answer with [`Event::Renewed`].
    Renew {
        lease_ids: Vec<i64>,
        now: Millis,
        ttl_ms: i64,
    },
    /// Hand a lease's unused units back (a restock it makes goes to the cluster and comes back
    /// as [`Event::Restocked`]); answer with [`Event::Returned`].
    Return {
        lease_id: i64,
        now: Millis,
    },
    /// Answer these reserves from the ledger's orders (`settle_without_units`); answer with
    /// [`Event::LookedUp`].
    Lookup {
        reqs: Vec<ReserveRequest>,
        voucher: Option<Voucher>,
        now: Millis,
        gate: Gate,
    },
    /// Load the voucher's winners; answer with [`Event::WinnersLoaded`].
    LoadWinners(Verdict),
    /// Tell the cluster.
    Publish(Signal),
    /// Recount the voucher's books soon (it sold out here).
    RecountSoon,
    /// Stop the actor; [`Event::Stopped`] follows.
    Stop,
    /// Let this waiter go unanswered: the core was torn down without asking to stop, and the
    /// front door gives the reserve to the voucher's next actor (idempotent by order id).
    HandBack(R),
}

/// A queued reserve.
#[derive(Debug)]
struct Pending<R> {
    req: ReserveRequest,
    reply: R,
    /// When it was queued: a reserve waits at most `recall_wait_ms` for recalled units.
    since: Millis,
}

/// Why a reserve waits for a lookup instead of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Diverted {
    /// The voucher refuses new orders now (paused, ended).
    Refused,
    /// No unit is left to serve it.
    NoUnits,
    /// A switch stops new sales: if it is off again before the lookup, the reserve goes back to
    /// be served from units.
    BySwitch,
}

/// A lease as this node serves it.
#[derive(Debug)]
struct LocalLease {
    id: i64,
    granted: i64,
    /// Units committed or in a batch in flight.
    used: i64,
    expires_at: Millis,
    /// The ledger no longer lists it as ours (a renewal said so): units a batch in flight gives
    /// back when it lands do not make it servable again.
    lost: bool,
}

impl LocalLease {
    fn room(&self) -> i64 {
        if self.lost {
            0
        } else {
            self.granted - self.used
        }
    }
}

/// Why the core is not asking the ledger for units right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// The ledger had no free units and no other node holds any: answer from the ledger's
    /// orders only.
    Dry,
    /// No free units, but other leases hold unused ones: keep reserves queued (up to
    /// `recall_wait_ms`) while they are recalled, and ask again soon.
    Waiting,
    /// The ledger failed (or the node drains): answer `503` until the hold ends.
    Down,
}

/// A batch in flight.
#[derive(Debug)]
struct InFlight<R> {
    id: u64,
    lease_id: i64,
    taken: Vec<Pending<R>>,
}

/// The grant in flight.
#[derive(Debug, Clone, Copy)]
struct Asked {
    epoch: u64,
    /// [`VoucherCore::landed`] when it was asked.
    landed: u64,
}

/// One voucher's quota protocol on one node.
pub(crate) struct VoucherCore<R, W> {
    code: String,
    settings: EngineSettings,
    sizing: SizingParams,
    /// The flag, winners and definition the frontend reads.
    shared: Arc<VoucherShared>,
    /// The events' `now` and switches while an event is handled.
    now: Millis,
    gate: Gate,
    out: Vec<Command<R, W>>,
    /// What the last events counted, for the adapter's metrics.
    stats: Vec<Stat>,
    voucher: Option<Voucher>,
    /// The ledger has no such voucher: answer `404` from memory (a cheap negative cache against
    /// floods of unknown codes) until it appears or the actor stops.
    missing: bool,
    /// A stop was asked: nothing more is started.
    stopping: bool,
    leases: VecDeque<LocalLease>,
    pending: VecDeque<Pending<R>>,
    /// Reserves waiting for a lookup: no unit can serve them, but some may be retries of stored
    /// orders.
    lookups: Vec<(Pending<R>, Diverted)>,
    /// The lookup in flight: one at a time, so a dry spell costs one query at a time, not one
    /// per request.
    looking: Option<Vec<Pending<R>>>,
    warm_waiters: Vec<W>,
    /// The batches in flight (at most `batches_in_flight`; several may draw on one lease).
    committing: Vec<InFlight<R>>,
    next_batch: u64,
    /// Batches of this core that landed so far. A grant answered after one of them landed may
    /// count that batch's units as still leased; it gives no verdict.
    landed: u64,
    granting: Option<Asked>,
    /// The renewal in flight: the leases it renews, and its `now`.
    renewing: Option<(Vec<i64>, Millis)>,
    /// Warmed (by an operator or pre-heat): if the sale has not started, the lease is kept until
    /// it does.
    warmed: bool,
    /// Shutting down: no warm-up may take a lease again.
    draining: bool,
    /// What the ledger last said was free: drives end-game sizing.
    free_hint: Option<i64>,
    hold: Option<(Hold, Millis)>,
    rate: RateEstimator,
    last_activity: Millis,
    next_probe: Millis,
    /// When the voucher definition is next re-read from the ledger (edits made on another node
    /// reach this one even without Redis).
    next_refresh: Millis,
    /// Another node asked for units back while a batch was in flight here: return the idle
    /// leases once it lands.
    recall_pending: bool,
    /// RECALL is published at most once per [`RECALL_REPEAT_MS`].
    next_recall: Millis,
    /// How many reservations the voucher ever had when this node last loaded its winners and
    /// raised the sold-out flag: a verdict that finds the same number has nothing new to load.
    sold_out_at: Option<i64>,
    /// Before the sale starts, the most units this node may hold: the free units it saw at its
    /// first grant over `engine.endgame_divisor`.
    prestart_cap: Option<i64>,
    /// When this core last asked for a recount on a sell-out: at most once per
    /// [`SOLD_OUT_RECOUNT_MS`].
    recounted_at: Option<Millis>,
    /// Set when reserves went back to the queue from the lookups: the scheduler runs again.
    repump: bool,
    /// A grant failed: it may have applied with its answer lost, leaving a lease no core
    /// serves. At this time the core lists its ACTIVE leases and returns any it does not know.
    orphan_check: Option<Millis>,
    /// That listing is in flight.
    finding: bool,
    /// Grants that failed so far: one that fails while the listing is out may apply after it
    /// was read, so it gets a listing of its own.
    failed_grants: u64,
    /// [`Self::failed_grants`] when the listing in flight was asked.
    found_after: u64,
    /// Unknown leases a listing found while a grant was out: settled when that grant answers.
    suspects: Vec<i64>,
    /// Leases fenced while another batch on them was still in flight: handed back when it lands.
    fenced: Vec<i64>,
    /// Leases whose return is in flight: the core does not stop before they are answered.
    returning: Vec<i64>,
    /// Leases whose return failed: returned again at the next tick, so their units do not wait
    /// for the reaper (up to a lease TTL) while this node lives.
    unreturned: Vec<i64>,
}

impl<R, W> VoucherCore<R, W> {
    /// A core for `code`, created at `now`; its first command reads the voucher.
    pub(crate) fn new(
        code: String,
        settings: EngineSettings,
        sizing: SizingParams,
        shared: Arc<VoucherShared>,
        now: Millis,
    ) -> Self {
        Self {
            code,
            settings,
            sizing,
            shared,
            now,
            gate: Gate::Open,
            out: vec![Command::ReadVoucher { first: true }],
            stats: Vec::new(),
            voucher: None,
            missing: false,
            stopping: false,
            leases: VecDeque::new(),
            pending: VecDeque::new(),
            lookups: Vec::new(),
            looking: None,
            warm_waiters: Vec::new(),
            committing: Vec::new(),
            next_batch: 0,
            landed: 0,
            granting: None,
            renewing: None,
            warmed: false,
            draining: false,
            free_hint: None,
            hold: None,
            rate: RateEstimator::new(now),
            last_activity: now,
            next_probe: now,
            next_refresh: now + VOUCHER_REFRESH_MS,
            recall_pending: false,
            next_recall: now,
            sold_out_at: None,
            prestart_cap: None,
            recounted_at: None,
            repump: false,
            orphan_check: None,
            finding: false,
            failed_grants: 0,
            found_after: 0,
            suspects: Vec::new(),
            fenced: Vec::new(),
            returning: Vec::new(),
            unreturned: Vec::new(),
        }
    }

    /// The commands the last events produced, in order.
    pub(crate) fn commands(&mut self) -> std::vec::Drain<'_, Command<R, W>> {
        self.out.drain(..)
    }

    /// What the last events counted, for the node's metrics.
    pub(crate) fn stats(&mut self) -> std::vec::Drain<'_, Stat> {
        self.stats.drain(..)
    }

    /// Units this node may still sell from its leases.
    pub(crate) fn room(&self) -> i64 {
        self.leases.iter().map(LocalLease::room).sum()
    }

    /// Handles one event at `now`, with the switches as the node reads them.
    pub(crate) fn handle(&mut self, now: Millis, gate: Gate, event: Event<R, W>) {
        self.dispatch(now, gate, event);
        self.check_local_invariants();
    }

    fn dispatch(&mut self, now: Millis, gate: Gate, event: Event<R, W>) {
        if now < self.now {
            self.clock_went_back(now);
        }
        self.now = now;
        self.gate = gate;
        match event {
            Event::Reserve(req, reply) => self.on_reserve(req, reply),
            Event::Warm(w) => self.on_warm(w),
            Event::VoucherRead { first: true, res } => self.on_loaded(res),
            Event::VoucherRead { first: false, res } => {
                if let Ok(Some(v)) = res {
                    self.set_voucher(v);
                    self.missing = false;
                }
                return;
            }
            Event::Reload(v) => self.take_definition(v),
            Event::Committed { id, res } => self.on_committed(id, res),
            Event::Granted(res) => self.on_granted(res),
            Event::Renewed(res) => self.on_renewed(res),
            Event::Found(res) => {
                self.on_found(res);
                return;
            }
            Event::LookedUp(res) => self.on_looked_up(res),
            Event::WinnersLoaded(verdict, res) => {
                self.on_winners(verdict, res);
                return;
            }
            Event::Restocked => {
                if matches!(self.hold, Some((Hold::Dry | Hold::Waiting, _))) {
                    self.hold = None;
                }
                self.free_hint = None;
            }
            Event::Returned { lease_id, ok } => {
                self.returning.retain(|&id| id != lease_id);
                if !ok && !self.stopping && !self.unreturned.contains(&lease_id) {
                    self.unreturned.push(lease_id);
                }
                return;
            }
            Event::Recall => {
                // With reserves queued here the units are in use; they go back after the batch
                // in flight if nothing waits by then.
                if self.pending.is_empty() {
                    self.return_idle_leases();
                } else {
                    self.recall_pending = true;
                }
                return;
            }
            Event::SoldOutElsewhere => {
                if self.room() == 0
                    && self.granting.is_none()
                    && self.voucher.is_some()
                    && !self.shared.is_sold_out()
                    && !self.stopping
                {
                    self.start_grant();
                }
                return;
            }
            Event::Drain => {
                self.draining = true;
                self.hold = Some((Hold::Down, Millis::MAX / 4));
                let in_flight = &self.committing;
                self.leases
                    .retain(|l| in_flight.iter().any(|b| b.lease_id == l.id));
                return;
            }
            Event::Stopped => {
                // Unasked (the core never said Stop): the adapter's thread went away, not the
                // voucher's service; the waiters can be served by a successor.
                let asked = std::mem::replace(&mut self.stopping, true);
                self.let_go_all(asked.then_some(EngineError::Unavailable));
                // The core ends here and no batch in flight will be answered: every lease goes
                // back, those under a batch included (the ledger's fence refuses a batch on a
                // returned lease; one that committed first is counted in what the lease used).
                // Kept, such a lease would sit unused until it expired.
                let in_flight = std::mem::take(&mut self.committing);
                for l in std::mem::take(&mut self.leases) {
                    if l.room() > 0 || in_flight.iter().any(|b| b.lease_id == l.id) {
                        self.stats.push(Stat::Lease(LeaseEvent::Returned));
                        self.give_back(l.id);
                    }
                }
                return;
            }
            Event::Tick => {
                if !self.tick() {
                    return;
                }
            }
        }
        self.pump();
        while std::mem::take(&mut self.repump) {
            self.pump();
        }
    }

    /// The core's own invariants, after every event (debug builds:
    /// the simulator in `cargo test` checks them at every step):
    /// - every lease: `0 ≤ used ≤ granted`, and no lease held twice;
    /// - the batches in flight on a lease draw no more than it counts as used;
    /// - at most `batches_in_flight` batches in flight, each with its own id.
    fn check_local_invariants(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        for (i, l) in self.leases.iter().enumerate() {
            debug_assert!(
                0 <= l.used && l.used <= l.granted,
                "{}: lease {} used {} of {}",
                self.code,
                l.id,
                l.used,
                l.granted
            );
            debug_assert!(
                self.leases.iter().skip(i + 1).all(|o| o.id != l.id),
                "{}: lease {} held twice",
                self.code,
                l.id
            );
            let drawn: usize = self
                .committing
                .iter()
                .filter(|b| b.lease_id == l.id)
                .map(|b| b.taken.len())
                .sum();
            debug_assert!(
                drawn as i64 <= l.used,
                "{}: batches in flight draw {drawn} on lease {} that counts {} used",
                self.code,
                l.id,
                l.used
            );
        }
        debug_assert!(
            self.committing.len() <= self.settings.batches_in_flight.max(1),
            "{}: {} batches in flight",
            self.code,
            self.committing.len()
        );
        debug_assert!(
            self.committing.iter().all(|b| b.id < self.next_batch
                && self.committing.iter().filter(|o| o.id == b.id).count() == 1),
            "{}: a batch id in flight twice or not yet issued",
            self.code
        );
    }

    /// The node's clock jumped back (it follows the ledger's again, or was set back): no timer
    /// may now lie further ahead than its own length, or a 200 ms hold would last as long as the
    /// jump (every reserve answered 503 meanwhile).
    fn clock_went_back(&mut self, now: Millis) {
        let probe = self.settings.soldout_probe_ms;
        if let Some((hold, until)) = &mut self.hold {
            let length = match hold {
                Hold::Down if self.draining => Millis::MAX / 4,
                Hold::Down => DOWN_MS,
                Hold::Waiting => RECALL_PROBE_MS,
                Hold::Dry => probe,
            };
            *until = (*until).min(now.saturating_add(length));
        }
        self.next_probe = self.next_probe.min(now + probe);
        self.next_refresh = self.next_refresh.min(now + VOUCHER_REFRESH_MS);
        self.next_recall = self.next_recall.min(now + RECALL_REPEAT_MS);
        if let Some(t) = &mut self.orphan_check {
            *t = (*t).min(now + ORPHAN_CHECK_MS);
        }
        // Waiting reserves keep their patience: it counts from no later than now.
        for p in &mut self.pending {
            p.since = p.since.min(now);
        }
        self.last_activity = self.last_activity.min(now);
        self.rate.clock_went_back(now);
        if let Some(t) = &mut self.recounted_at {
            *t = (*t).min(now);
        }
    }

    fn on_reserve(&mut self, req: ReserveRequest, reply: R) {
        self.last_activity = self.now;
        if self.pending.len() + self.lookups.len() >= self.settings.max_pending {
            self.stats.push(Stat::QueueFull);
            self.out
                .push(Command::Answer(reply, Err(EngineError::Unavailable)));
            return;
        }
        let since = self.now;
        self.admit(Pending { req, reply, since });
    }

    fn on_warm(&mut self, w: W) {
        if self.draining {
            self.out
                .push(Command::AnswerWarm(w, Err(EngineError::Unavailable)));
            return;
        }
        self.last_activity = self.now;
        self.warmed = true;
        if self.missing {
            self.out
                .push(Command::AnswerWarm(w, Err(EngineError::NotFound)));
        } else if self.room() > 0 {
            self.out.push(Command::AnswerWarm(w, Ok(())));
        } else {
            self.warm_waiters.push(w);
            self.hold = None;
        }
    }

    /// The voucher's sale has not started at `now` (as this node's copy says).
    fn before_start(&self) -> bool {
        self.voucher
            .as_ref()
            .is_some_and(|v| self.now < v.starts_at)
    }

    /// Takes a (new) definition of the voucher; the frontend's copy follows.
    fn set_voucher(&mut self, v: Voucher) {
        self.shared.set_voucher(&v);
        self.voucher = Some(v);
    }

    /// Takes a definition; the first one also admits the reserves queued before it (they were
    /// not checked for eligibility yet), whether it came from the first read or a reload.
    fn take_definition(&mut self, v: Voucher) {
        let first = self.voucher.is_none();
        self.set_voucher(v);
        if first {
            for p in std::mem::take(&mut self.pending) {
                self.admit(p);
            }
        }
    }

    /// Answers every waiting reserve and warm-up with `err` (batches in flight answer when they
    /// land, and so does the lookup in flight unless the core stops: a retry of a stored order
    /// in it gets its 201).
    fn fail_all(&mut self, err: EngineError) {
        self.let_go_all(Some(err));
    }

    /// Every waiter leaves: answered `err`, or, with `None`, handed back unanswered (a warm-up
    /// waiter is told `503` either way).
    fn let_go_all(&mut self, err: Option<EngineError>) {
        let lookups = self.lookups.drain(..).map(|(p, _)| p);
        let looking = match self.stopping {
            true => self.looking.take().unwrap_or_default(),
            false => Vec::new(),
        };
        for p in self.pending.drain(..).chain(lookups).chain(looking) {
            self.out.push(match &err {
                Some(e) => Command::Answer(p.reply, Err(e.clone())),
                None => Command::HandBack(p.reply),
            });
        }
        let err = err.unwrap_or(EngineError::Unavailable);
        for w in self.warm_waiters.drain(..) {
            self.out.push(Command::AnswerWarm(w, Err(err.clone())));
        }
    }

    fn on_loaded(&mut self, res: Result<Option<Voucher>, LedgerError>) {
        match res {
            Ok(Some(v)) => self.take_definition(v),
            Ok(None) => {
                self.missing = true;
                self.fail_all(EngineError::NotFound);
            }
            // A reload (signal or edit) already gave the definition, and the core may be
            // serving from it (a grant in flight): carry on with it. Stopping now would leave
            // the grant's lease to the reaper.
            Err(_) if self.voucher.is_some() => {
                self.stats.push(Stat::LedgerError(LedgerOp::LoadVoucher));
            }
            Err(e) => {
                tracing::warn!(code = %self.code, error = %e, "load voucher");
                self.stats.push(Stat::LedgerError(LedgerOp::LoadVoucher));
                self.fail_all(EngineError::Unavailable);
                self.stopping = true;
                self.out.push(Command::Stop);
            }
        }
    }

    /// Queues a reserve that passed eligibility, or answers it at once.
    fn admit(&mut self, p: Pending<R>) {
        let now = self.now;
        if self.missing {
            self.out
                .push(Command::Answer(p.reply, Err(EngineError::NotFound)));
            return;
        }
        let Some(v) = &self.voucher else {
            self.pending.push_back(p);
            return;
        };
        match v.check_eligible(now, p.req.order_amount) {
            // The switches stop new sales; a retry of a stored order still gets its 201.
            Ok(()) if self.gate != Gate::Open => {
                self.lookups.push((p, Diverted::BySwitch));
                return;
            }
            Ok(()) => {}
            // Nothing can have been reserved before the start (`startsAt` never moves). A node
            // whose clock runs behind another's answers a retry of an order that node took at
            // the very start 422 until its own clock gets there: a late answer, never a wrong
            // sale. Below the minimum amount is never a retry (a stored order passed it; see
            // `Voucher::refuses_amount`).
            Err(reason @ (Ineligible::NotStarted | Ineligible::MinOrderAmount)) => {
                // Pre-heat: requests for a warmed voucher that has not started yet are the
                // demand it will meet when it opens; counted, they size the lease it holds at
                // the start (taken now, kept until then).
                if reason == Ineligible::NotStarted && self.warmed && self.gate == Gate::Open {
                    self.rate.record(now, 1);
                }
                let reply = Err(EngineError::NotEligible(reason));
                self.out.push(Command::Answer(p.reply, reply));
                return;
            }
            // DESIGN §4: it may be a retry of an order stored before the pause or the end, which
            // gets its 201 whatever the voucher's state now: the ledger says.
            Err(_) => {
                self.lookups.push((p, Diverted::Refused));
                return;
            }
        }
        // Only eligible demand drives lease sizing (repeats that took nothing are taken back
        // out when their batch lands): refused requests leave no trace.
        self.rate.record(now, 1);
        self.pending.push_back(p);
    }

    /// The scheduler: starts batches while the in-flight limit allows, asks for units when
    /// short, and answers what cannot be served while the ledger is empty or down.
    fn pump(&mut self) {
        if self.voucher.is_none() || self.stopping {
            return;
        }
        // A switch turned on while reserves were queued: none of them becomes a batch now.
        if self.gate != Gate::Open && !self.pending.is_empty() {
            self.lookups
                .extend(self.pending.drain(..).map(|p| (p, Diverted::BySwitch)));
        }
        let now = self.now;
        self.drop_unservable_leases();
        if self.hold.is_some_and(|(_, until)| now >= until) {
            self.hold = None;
        }
        let in_flight = self.settings.batches_in_flight.max(1);
        while self.committing.len() < in_flight && self.start_batch() {}
        let rate = self.rate.per_sec(now);
        let room = self.room();
        let capped = self.before_start() && self.prestart_cap.is_some_and(|cap| room >= cap);
        let short = (self.pending.len() as i64) > room
            || (room < low_water(&self.sizing, rate) && rate > 0.0 && !capped)
            || !self.warm_waiters.is_empty();
        match self.hold {
            None if short && self.granting.is_none() => self.start_grant(),
            // The ledger failed (or the node is draining): what waits gets 503 at once, whatever
            // the lease still holds; no new batch starts while this lasts.
            Some((Hold::Down, _)) => {
                for p in self.pending.drain(..) {
                    let reply = Err(EngineError::Unavailable);
                    self.out.push(Command::Answer(p.reply, reply));
                }
            }
            Some((hold, _))
                if room == 0 && self.committing.is_empty() && self.granting.is_none() =>
            {
                let patience = self.settings.recall_wait_ms;
                let waiting: Vec<Pending<R>> = match hold {
                    Hold::Waiting => {
                        let (give_up, keep): (VecDeque<_>, VecDeque<_>) =
                            std::mem::take(&mut self.pending)
                                .into_iter()
                                .partition(|p| now - p.since >= patience);
                        self.pending = keep;
                        give_up.into()
                    }
                    _ => self.pending.drain(..).collect(),
                };
                self.lookups
                    .extend(waiting.into_iter().map(|p| (p, Diverted::NoUnits)));
            }
            _ => {}
        }
        self.answer_without_units();
    }

    /// Stops serving from leases that are used up or too close to expiry (the node must stop
    /// before a reaper may take the lease); units left in expiring ones are handed back.
    fn drop_unservable_leases(&mut self) {
        let (now, safety) = (self.now, self.settings.lease_safety_ms);
        self.give_back_leases(LeaseEvent::Lost, |l| {
            l.room() > 0 && l.expires_at - safety > now
        });
    }

    /// Stops serving from every lease `keep` rejects (never one a batch in flight draws on) and
    /// hands their unused units back to `free`.
    fn give_back_leases(&mut self, event: LeaseEvent, keep: impl Fn(&LocalLease) -> bool) {
        let in_flight = &self.committing;
        let (kept, dropped): (VecDeque<LocalLease>, VecDeque<LocalLease>) = self
            .leases
            .drain(..)
            .partition(|l| in_flight.iter().any(|b| b.lease_id == l.id) || keep(l));
        self.leases = kept;
        for l in dropped.into_iter().filter(|l| l.room() > 0) {
            self.stats.push(Stat::Lease(event));
            self.give_back(l.id);
        }
    }

    fn give_back(&mut self, lease_id: i64) {
        self.returning.push(lease_id);
        self.out.push(Command::Return {
            lease_id,
            now: self.now,
        });
    }

    /// Sends the next batch to the node's group committer; false when there is nothing to send.
    fn start_batch(&mut self) -> bool {
        if matches!(self.hold, Some((Hold::Down, _))) || self.pending.is_empty() {
            return false;
        }
        let max_batch = self.settings.max_batch.max(1) as i64;
        // Only a lease that is still servable: one kept only because a batch on it is in
        // flight, or one too close to expiry, takes nothing new.
        let (now, safety) = (self.now, self.settings.lease_safety_ms);
        let Some(lease) = self
            .leases
            .iter_mut()
            .find(|l| l.room() > 0 && l.expires_at - safety > now)
        else {
            return false;
        };
        let n = (self.pending.len() as i64).min(lease.room()).min(max_batch) as usize;
        lease.used += n as i64;
        let lease_id = lease.id;
        let taken: Vec<Pending<R>> = self.pending.drain(..n).collect();
        let batch = Batch {
            voucher_code: self.code.clone(),
            lease_id,
            now,
            expires_at: now + self.settings.reservation_ttl_ms,
            rows: taken
                .iter()
                .map(|p| BatchRow {
                    order_id: p.req.order_id.clone(),
                    customer_id: p.req.customer_id,
                })
                .collect(),
        };
        let id = self.next_batch;
        self.next_batch += 1;
        self.committing.push(InFlight {
            id,
            lease_id,
            taken,
        });
        self.out.push(Command::Commit { id, batch });
        true
    }

    fn on_committed(&mut self, id: u64, res: Result<Vec<RowOutcome>, LedgerError>) {
        let Some(i) = self.committing.iter().position(|b| b.id == id) else {
            return;
        };
        let InFlight {
            lease_id, taken, ..
        } = self.committing.swap_remove(i);
        self.landed += 1;
        let n = taken.len() as i64;
        // A lease fenced while this batch was also on it goes back once its last batch lands.
        let last_on_lease = !self.committing.iter().any(|b| b.lease_id == lease_id);
        if last_on_lease && self.fenced.contains(&lease_id) {
            self.fenced.retain(|&id| id != lease_id);
            if !matches!(res, Err(LedgerError::Fenced)) {
                self.give_back(lease_id);
            }
        }
        match res {
            Ok(outcomes) => {
                let mut consumed = 0;
                if outcomes
                    .iter()
                    .any(|o| matches!(o, RowOutcome::NotEligible(_)))
                {
                    self.refresh_voucher();
                }
                let mut outcomes = outcomes.into_iter();
                for p in taken {
                    let reply = match outcomes.next() {
                        Some(RowOutcome::Created(r)) => {
                            consumed += 1;
                            Ok(Reserved {
                                reservation: r,
                                replayed: false,
                            })
                        }
                        Some(RowOutcome::Replayed(r)) => Ok(Reserved {
                            reservation: r,
                            replayed: true,
                        }),
                        Some(RowOutcome::AlreadyUsed) => Err(EngineError::AlreadyUsed),
                        Some(RowOutcome::NotEligible(reason)) => {
                            Err(EngineError::NotEligible(reason))
                        }
                        // A ledger answering fewer rows than asked: those rows are not known
                        // to have committed.
                        None => Err(EngineError::Unavailable),
                    };
                    self.out.push(Command::Answer(p.reply, reply));
                }
                if let Some(l) = self.leases.iter_mut().find(|l| l.id == lease_id) {
                    l.used -= n - consumed;
                }
                // Repeats and refusals took nothing: they are not demand.
                self.rate.forget(self.now, (n - consumed) as u64);
                // A "dry" verdict taken while this batch was in flight counted its rows as units
                // still leased; now that they are settled, ask again (it may be sold out).
                if matches!(self.hold, Some((Hold::Dry | Hold::Waiting, _))) && self.room() == 0 {
                    self.hold = None;
                }
                if self.recall_pending && self.pending.is_empty() {
                    self.return_idle_leases();
                }
            }
            Err(e) => {
                // No 201 without a commit: every request of the batch gets 503 and may retry
                // (idempotently).
                for p in taken {
                    let reply = Err(EngineError::Unavailable);
                    self.out.push(Command::Answer(p.reply, reply));
                }
                if matches!(e, LedgerError::Fenced) {
                    // The lease is gone in the ledger, or holds fewer units than this node
                    // thought (a batch whose answer was lost did commit): stop serving from it
                    // and hand back whatever it still holds (a no-op if it was reaped).
                    self.leases.retain(|l| l.id != lease_id);
                    if self.committing.iter().any(|b| b.lease_id == lease_id) {
                        self.fenced.push(lease_id);
                    } else {
                        self.give_back(lease_id);
                    }
                    self.stats.push(Stat::Lease(LeaseEvent::Fenced));
                    tracing::warn!(code = %self.code, lease_id, "batch fenced: lease no longer active");
                } else {
                    // The transaction failed (it may be shared with every other voucher of the
                    // node): keep the lease and give the batch's units back to its room, so the
                    // sale can still sell them. Should the transaction commit after all (a
                    // deadline passed while it ran), the ledger's fence refuses the batch that
                    // would then overdraw the lease: never an oversell. Back off briefly.
                    if let Some(l) = self.leases.iter_mut().find(|l| l.id == lease_id) {
                        l.used -= n;
                    }
                    self.stats.push(Stat::LedgerError(LedgerOp::CommitBatch));
                    tracing::warn!(code = %self.code, lease_id, error = %e, "batch commit failed");
                    self.hold_for(Hold::Down, DOWN_MS);
                }
            }
        }
    }

    fn hold_for(&mut self, hold: Hold, ms: Millis) {
        self.hold = Some((hold, self.now + ms));
    }

    fn start_grant(&mut self) {
        let now = self.now;
        let rate = self.rate.per_sec(now);
        let waiting = (self.pending.len() as i64 - self.room()).max(0) as usize;
        let mut want = block_size(&self.sizing, rate, waiting, self.free_hint);
        if let (true, Some(cap)) = (self.before_start(), self.prestart_cap) {
            want = want.min((cap - self.room()).max(1));
        }
        self.granting = Some(Asked {
            epoch: self.shared.restock_epoch(),
            landed: self.landed,
        });
        self.out.push(Command::Grant {
            want,
            now,
            ttl_ms: self.settings.lease_ttl_ms,
        });
    }

    fn on_granted(&mut self, res: Result<Grant, LedgerError>) {
        let Some(asked) = self.granting.take() else {
            return;
        };
        // Leases a listing found while this grant was out: all but this grant's own are orphans.
        let suspects = std::mem::take(&mut self.suspects);
        if let Ok(Grant { lease: Some(l), .. }) = &res {
            let mine = l.id;
            self.return_orphans(suspects.into_iter().filter(|&id| id != mine).collect());
        } else {
            self.return_orphans(suspects);
        }
        match res {
            Ok(grant) => {
                self.free_hint = Some(grant.free_after);
                if self.prestart_cap.is_none() && self.before_start() {
                    let seen = grant.free_after + grant.lease.as_ref().map_or(0, |l| l.granted);
                    let p = &self.sizing;
                    self.prestart_cap = Some(
                        (seen / p.prestart_divisor)
                            .max(p.min_block)
                            .min(p.max_block),
                    );
                }
                if let Some(lease) = grant.lease {
                    self.stats.push(Stat::Lease(LeaseEvent::Granted));
                    self.stats.push(Stat::GrantedUnits(lease.granted));
                    self.leases.push_back(LocalLease {
                        id: lease.id,
                        granted: lease.granted,
                        used: 0,
                        expires_at: lease.expires_at,
                        lost: false,
                    });
                    self.hold = None;
                    if self.shared.is_sold_out() {
                        self.shared.restock();
                    }
                } else {
                    self.stats.push(Stat::Lease(LeaseEvent::Empty));
                    let now = self.now;
                    self.next_probe = now + self.settings.soldout_probe_ms;
                    if asked.landed != self.landed && self.room() == 0 {
                        // A batch of ours landed while this grant was out: the ledger may
                        // have counted its units as still leased. No verdict; the pump asks
                        // again (a hold taken on a stale count would keep the queue waiting
                        // for units that are already sold).
                        self.hold = None;
                    } else if grant.leased_unused > 0 {
                        // Units sit in other leases (other nodes', or this node's batch in
                        // flight): wait a little for them instead of refusing at once.
                        self.hold_for(Hold::Waiting, RECALL_PROBE_MS);
                        // Only real demand recalls units (a warm-up asking for a first lease
                        // does not take other nodes' units away).
                        if now >= self.next_recall && !self.pending.is_empty() {
                            self.next_recall = now + RECALL_REPEAT_MS;
                            self.out.push(Command::Publish(Signal::Recall));
                        }
                    } else {
                        self.hold_for(Hold::Dry, self.settings.soldout_probe_ms);
                        let verdict = Verdict {
                            epoch: asked.epoch,
                            ever_reserved: grant.ever_reserved,
                        };
                        if self.announced(verdict) {
                            // A probe found the same winners: the flag is right as it stands.
                            self.shared.verify(self.now);
                        } else if self.room() == 0 {
                            self.out.push(Command::LoadWinners(verdict));
                        }
                    }
                }
                for w in self.warm_waiters.drain(..) {
                    self.out.push(Command::AnswerWarm(w, Ok(())));
                }
            }
            Err(LedgerError::NotFound) => {
                self.missing = true;
                self.voucher = None;
                self.fail_all(EngineError::NotFound);
            }
            Err(e) => {
                self.stats.push(Stat::LedgerError(LedgerOp::Grant));
                tracing::warn!(code = %self.code, error = %e, "lease grant failed");
                self.hold_for(Hold::Down, DOWN_MS);
                self.failed_grants += 1;
                self.orphan_check = Some(self.now + ORPHAN_CHECK_MS);
                for w in self.warm_waiters.drain(..) {
                    self.out
                        .push(Command::AnswerWarm(w, Err(EngineError::Unavailable)));
                }
            }
        }
    }

    /// The flag is already up on exactly these winners: nothing to reload or announce (two
    /// verdicts can cross, one asked again while the first loaded its winners).
    fn announced(&self, v: Verdict) -> bool {
        self.shared.is_sold_out()
            && v.ever_reserved.is_some()
            && v.ever_reserved == self.sold_out_at
    }

    /// The winners of a sold-out verdict are in: raise the flag (unless units came back
    /// meanwhile) and announce it.
    fn on_winners(&mut self, verdict: Verdict, res: Result<Vec<(String, i64)>, LedgerError>) {
        match res {
            Ok(won) => {
                let limit = self.voucher.as_ref().map_or(i64::MAX, |v| v.per_user_limit);
                let same = self.announced(verdict);
                let exact_max = self.settings.won_set_exact_max;
                let raised = self
                    .shared
                    .set_sold_out(verdict.epoch, won, limit, exact_max);
                if raised {
                    self.shared.verify(self.now);
                }
                if raised && !same {
                    self.sold_out_at = verdict.ever_reserved;
                    tracing::info!(code = %self.code, "sold out");
                    self.out.push(Command::Publish(Signal::SoldOut));
                    // The books of a sale are checked soon after it sells out (the live
                    // numbers recount it), not at the reconciler's next round.
                    let now = self.now;
                    if self
                        .recounted_at
                        .is_none_or(|t| now - t >= SOLD_OUT_RECOUNT_MS)
                    {
                        self.recounted_at = Some(now);
                        self.out.push(Command::RecountSoon);
                    }
                }
            }
            Err(e) => {
                self.stats.push(Stat::LedgerError(LedgerOp::WonOrders));
                tracing::warn!(code = %self.code, error = %e, "load winning orders");
            }
        }
    }

    /// Reserves no unit serves (none left, or the voucher refuses new orders now) can still be
    /// retries of stored orders: one ledger lookup at a time for all of them, answered with
    /// DESIGN §4's precedence.
    fn answer_without_units(&mut self) {
        if self.looking.is_some() || self.lookups.is_empty() {
            return;
        }
        // Sent here only by a switch that is off again: they can be served from units.
        if self.gate == Gate::Open && self.lookups.iter().any(|(_, d)| *d == Diverted::BySwitch) {
            let (back, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.lookups)
                .into_iter()
                .partition(|(_, d)| *d == Diverted::BySwitch);
            self.lookups = keep;
            self.pending.extend(back.into_iter().map(|(p, _)| p));
            self.repump = true;
            if self.lookups.is_empty() {
                return;
            }
        }
        let waiting: Vec<Pending<R>> = self.lookups.drain(..).map(|(p, _)| p).collect();
        self.out.push(Command::Lookup {
            reqs: waiting.iter().map(|p| p.req.clone()).collect(),
            voucher: self.voucher.clone(),
            now: self.now,
            gate: self.gate,
        });
        self.looking = Some(waiting);
    }

    fn on_looked_up(&mut self, res: Result<Vec<Result<Reserved, EngineError>>, LedgerError>) {
        let Some(waiting) = self.looking.take() else {
            return;
        };
        match res {
            Ok(answers) => {
                let mut answers = answers.into_iter();
                for p in waiting {
                    let reply = match answers.next() {
                        Some(Ok(r)) => Ok(Reserved {
                            reservation: r.reservation,
                            replayed: true,
                        }),
                        Some(Err(e)) => Err(e),
                        None => Err(EngineError::Unavailable),
                    };
                    self.out.push(Command::Answer(p.reply, reply));
                }
            }
            Err(_) => {
                self.stats.push(Stat::LedgerError(LedgerOp::FindOrders));
                for p in waiting {
                    let reply = Err(EngineError::Unavailable);
                    self.out.push(Command::Answer(p.reply, reply));
                }
            }
        }
    }

    /// Returns every lease no batch in flight draws on (those follow when their batches land).
    fn return_idle_leases(&mut self) {
        self.recall_pending = !self.committing.is_empty();
        self.give_back_leases(LeaseEvent::Recalled, |_| false);
    }

    /// Re-reads the voucher's definition from the ledger.
    fn refresh_voucher(&mut self) {
        self.next_refresh = self.now + VOUCHER_REFRESH_MS;
        self.out.push(Command::ReadVoucher { first: false });
    }

    /// The periodic chores: renewal, idle return, the sold-out probe, voucher refresh and idle
    /// stop. False when the core stops.
    fn tick(&mut self) -> bool {
        let now = self.now;
        if self.stopping {
            return false;
        }
        if now >= self.next_refresh && (self.voucher.is_some() || self.missing) {
            self.refresh_voucher();
        }
        for lease_id in std::mem::take(&mut self.unreturned) {
            self.give_back(lease_id);
        }
        if self.orphan_check.is_some_and(|t| now >= t) && self.granting.is_none() && !self.finding {
            self.finding = true;
            self.found_after = self.failed_grants;
            self.out.push(Command::FindLeases);
        }
        let s = &self.settings;
        let (idle_timeout, probe_ms) = (s.lease_idle_timeout_ms, s.soldout_probe_ms);
        let stop_after = if self.missing {
            s.lease_idle_timeout_ms
        } else {
            s.actor_idle_stop_ms
        };
        // A voucher warmed ahead of its start keeps its lease until then: idleness counts from
        // the start.
        let waiting_for_start = match (&self.voucher, self.warmed) {
            (Some(v), true) => v.starts_at,
            _ => Millis::MIN,
        };
        let idle = now - self.last_activity.max(waiting_for_start);
        // Reserves the frontend answered from the sold-out flag count as traffic: an actor whose
        // voucher is flooded after selling out stays, with its flag and winners.
        let unseen = now
            - self
                .last_activity
                .max(self.shared.last_short_circuit())
                .max(waiting_for_start);
        if idle >= idle_timeout && self.committing.is_empty() && self.pending.is_empty() {
            self.give_back_leases(LeaseEvent::Returned, |_| false);
        }
        self.renew_if_due();
        // A sold-out or dry core with nothing to serve probes the ledger at a fixed rate while
        // its voucher sees traffic (here or at the frontend's flag). The probe is a grant: if
        // units came back it takes them (and lowers the flag); if the ledger is empty
        // everywhere it raises the flag. A voucher nobody asks for is not probed: after a sale,
        // every sold-out voucher of every node would otherwise write to the ledger once a
        // probe interval until its actor stops. Its flag then lapses (it is trusted for two
        // intervals after the ledger last confirmed it), and the first reserves that come
        // back are settled by the ledger until the next probe confirms it again.
        let empty_handed =
            self.room() == 0 && self.committing.is_empty() && self.free_hint == Some(0);
        if (self.shared.is_sold_out() || empty_handed)
            && unseen < PROBE_WHILE_SEEN * probe_ms
            && now >= self.next_probe
            && self.granting.is_none()
            && self.voucher.is_some()
        {
            self.next_probe = now + probe_ms;
            self.start_grant();
        }
        if unseen >= stop_after
            && self.leases.is_empty()
            && self.returning.is_empty()
            && self.unreturned.is_empty()
            && self.orphan_check.is_none()
            && !self.finding
            && self.committing.is_empty()
            && self.granting.is_none()
            && self.looking.is_none()
            && self.pending.is_empty()
            && self.lookups.is_empty()
        {
            self.stopping = true;
            self.out.push(Command::Stop);
            return false;
        }
        true
    }

    fn renew_if_due(&mut self) {
        let (now, ttl) = (self.now, self.settings.lease_ttl_ms);
        if self.renewing.is_some() {
            return;
        }
        let due: Vec<i64> = self
            .leases
            .iter()
            .filter(|l| l.expires_at - now < ttl / 2)
            .map(|l| l.id)
            .collect();
        if due.is_empty() {
            return;
        }
        self.out.push(Command::Renew {
            lease_ids: due.clone(),
            now,
            ttl_ms: ttl,
        });
        self.renewing = Some((due, now));
    }

    /// This node's ACTIVE leases with units left, listed after a failed grant: one the core
    /// neither serves, nor commits on, nor is returning is the lost grant's (or one it stopped
    /// serving without a return, e.g. on drain); either way it goes back.
    fn on_found(&mut self, res: Result<Vec<i64>, LedgerError>) {
        self.finding = false;
        match res {
            Ok(ids) => {
                self.orphan_check =
                    (self.failed_grants != self.found_after).then_some(self.now + ORPHAN_CHECK_MS);
                let unknown: Vec<i64> = ids.into_iter().filter(|&id| !self.knows(id)).collect();
                if self.granting.is_some() {
                    // The grant out now may be one of them: decided when it answers.
                    self.suspects = unknown;
                } else {
                    self.return_orphans(unknown);
                }
            }
            Err(_) => {
                self.stats.push(Stat::LedgerError(LedgerOp::ActiveLeases));
                self.orphan_check = Some(self.now + ORPHAN_CHECK_MS);
            }
        }
    }

    /// The core serves, commits on or is returning lease `id`.
    fn knows(&self, id: i64) -> bool {
        self.leases.iter().any(|l| l.id == id)
            || self.committing.iter().any(|b| b.lease_id == id)
            || self.returning.contains(&id)
            || self.unreturned.contains(&id)
    }

    fn return_orphans(&mut self, ids: Vec<i64>) {
        for id in ids {
            if !self.knows(id) {
                tracing::warn!(code = %self.code, lease_id = id, "returning a lease no grant answer gave");
                self.stats.push(Stat::Lease(LeaseEvent::Returned));
                self.give_back(id);
            }
        }
    }

    fn on_renewed(&mut self, res: Result<Vec<i64>, LedgerError>) {
        let Some((due, asked_at)) = self.renewing.take() else {
            return;
        };
        let ttl = self.settings.lease_ttl_ms;
        match res {
            Ok(alive) => {
                for l in self.leases.iter_mut().filter(|l| due.contains(&l.id)) {
                    if alive.contains(&l.id) {
                        self.stats.push(Stat::Lease(LeaseEvent::Renewed));
                        l.expires_at = asked_at + ttl;
                    } else {
                        // Reaped or returned behind our back: stop serving from it.
                        self.stats.push(Stat::Lease(LeaseEvent::Lost));
                        l.lost = true;
                    }
                }
            }
            Err(e) => {
                self.stats.push(Stat::LedgerError(LedgerOp::Renew));
                tracing::warn!(code = %self.code, error = %e, "lease renewal failed");
            }
        }
    }
}

#[cfg(test)]
mod tests;

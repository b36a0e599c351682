//! The quota protocol of one voucher on one node, as a sans-IO state machine: events in,
//! commands out. No actix, tokio, database driver or clock lives here; the actor
//! ([`super::actor::VoucherActor`]) feeds it events and carries its commands out, and the
//! deterministic simulator (`crate::sim`) drives the same code against the model ledger.
//!
//! What leaves the core, and how:
//! - everything that needs I/O or the cluster: a [`Command`] (ledger calls, answers, signals);
//! - what the frontend answers from without messaging the actor (the sold-out flag and its
//!   winners, the voucher's definition and with it its own rate limiters, which the node's
//!   maker builds when the definition's limits change): written to the one [`VoucherShared`]
//!   the core is given, which is also where it reads the restock epoch and the short-circuits
//!   the frontend counted;
//! - what the node's metrics count: a [`Stat`], drained by the adapter. (Warnings still go to
//!   the log through `tracing`.)
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
//! - **First call.** A core calls nothing until its first event. A reserve (that the switches
//!   let through) asks for the definition and a first lease together ([`Command::Open`]); any
//!   other event reads the definition alone. A failed first read stops the core, unless the
//!   failed call may have granted a lease (an open): then the core stays until its listing of
//!   the node's leases and their returns are settled (see *Lost answers*), and its next
//!   reserve or warm-up calls again.
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
use crate::ledger::{Batch, BatchRow, Grant, LedgerError, Opened, RowOutcome};
use crate::metrics::{LeaseEvent, LedgerOp};
use crate::signals::Signal;

mod leases;
mod serve;
#[cfg(test)]
mod tests;

/// A sold-out or dry core probes the ledger only while its voucher saw traffic within this many
/// probe intervals: one more than the flag's trust window.
const PROBE_WHILE_SEEN: Millis = 3;

/// How often the core expects [`Event::Tick`] while it has work (see
/// [`VoucherCore::next_tick_at`]).
pub(crate) const TICK_MS: Millis = 250;
/// How often an idle core that still holds units (or was asked for lately) expects one.
const IDLE_TICK_MS: Millis = 1000;
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
    /// The answer to [`Command::Open`]: the definition and, if one was asked, the first grant.
    Opened(Result<Opened, LedgerError>),
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
    /// The first call of a core whose first event is a reserve: read the definition and, if it
    /// serves an order of `amount` now, take a first lease of up to `want` units in the same
    /// call ([`crate::ledger::Ledger::open`]); answer with [`Event::Opened`].
    Open {
        want: i64,
        now: Millis,
        ttl_ms: i64,
        amount: i64,
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
struct InFlightBatch<R> {
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
    /// The first call is out or answered (it goes with the first event: see
    /// [`VoucherCore::first_call`]). Cleared when it failed while the core stays: then the next
    /// reserve or warm-up (not any event: a tick during an outage does not call again) makes it.
    called: bool,
    /// The first call failed and is to be made again.
    call_again: bool,
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
    committing: Vec<InFlightBatch<R>>,
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
    /// When the last [`Event::Tick`] came: the next is due [`TICK_MS`] after it (see
    /// [`VoucherCore::next_tick_at`]).
    last_tick: Millis,
    next_probe: Millis,
    /// When the voucher definition is next re-read from the ledger (edits made on another node
    /// reach this one even without Redis).
    next_refresh: Millis,
    /// When the definition was last asked for: a core re-reads it only if the voucher was
    /// asked for since (a voucher given one reserve in a flood of first reserves on cold
    /// vouchers reads its definition once, not once a second for as long as it is seen).
    read_at: Millis,
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
    /// A core for `code`, created at `now`; its first event makes it read the voucher (and,
    /// when that event is a reserve, take a first lease in the same call).
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
            out: Vec::new(),
            stats: Vec::new(),
            voucher: None,
            missing: false,
            called: false,
            call_again: false,
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
            last_tick: now,
            next_probe: now,
            next_refresh: now + VOUCHER_REFRESH_MS,
            read_at: now,
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

    /// When the core next needs [`Event::Tick`]. While it holds, waits for or serves anything,
    /// or its voucher was asked for lately, or is sold out here: [`TICK_MS`] after the last tick.
    /// Quiet (nothing of that): only when it would stop, so an idle voucher's actor costs no
    /// periodic work; any event before then may make it busy again, and the adapter asks again
    /// after every event.
    pub(crate) fn next_tick_at(&self) -> Millis {
        let due = self.last_tick + TICK_MS;
        if !self.idle() {
            return due;
        }
        if !self.quiet() {
            // Holding units or asked for lately, with nothing to do now: its timers (the idle
            // return, renewals, the definition's re-read) are a second apart or more.
            return self.last_tick + IDLE_TICK_MS;
        }
        due.max(self.last_seen() + self.stop_after())
    }

    /// Nothing queued, asked or in flight, and no probing to do: not sold out here, not dry.
    fn idle(&self) -> bool {
        !self.stopping
            && self.pending.is_empty()
            && self.lookups.is_empty()
            && self.looking.is_none()
            && self.committing.is_empty()
            && self.granting.is_none()
            && self.renewing.is_none()
            && self.returning.is_empty()
            && self.unreturned.is_empty()
            && self.orphan_check.is_none()
            && !self.finding
            && self.warm_waiters.is_empty()
            && !self.shared.is_sold_out()
            && self.free_hint != Some(0)
    }

    /// Idle, nothing held, not asked for lately: only its stop is to come.
    fn quiet(&self) -> bool {
        self.idle()
            && self.leases.is_empty()
            && self.now - self.last_seen() >= self.seen_lately_ms()
    }

    /// The last time the voucher was asked for: here, or at the frontend's sold-out flag, or (a
    /// voucher warmed ahead of its start) its start.
    pub(super) fn last_seen(&self) -> Millis {
        let waiting_for_start = match (&self.voucher, self.warmed) {
            (Some(v), true) => v.starts_at,
            _ => Millis::MIN,
        };
        self.last_activity
            .max(self.shared.last_short_circuit())
            .max(waiting_for_start)
    }

    /// How long after its last request a voucher counts as asked for lately: a dry or sold-out
    /// core probes the ledger while it is, and a core re-reads its definition.
    pub(super) fn seen_lately_ms(&self) -> Millis {
        PROBE_WHILE_SEEN * self.settings.soldout_probe_ms
    }

    /// How long a core with nothing held goes unasked before it stops.
    pub(super) fn stop_after(&self) -> Millis {
        if self.missing {
            self.settings.lease_idle_timeout_ms
        } else {
            self.settings.actor_idle_stop_ms
        }
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
        let calls = !self.call_again || matches!(event, Event::Reserve(..) | Event::Warm(_));
        if !self.called && calls {
            self.called = true;
            self.call_again = false;
            self.first_call(&event);
        }
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
            Event::Opened(res) => self.on_opened(res),
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
                self.last_tick = now;
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
        self.read_at = self.read_at.min(now);
        self.next_recall = self.next_recall.min(now + RECALL_REPEAT_MS);
        if let Some(t) = &mut self.orphan_check {
            *t = (*t).min(now + ORPHAN_CHECK_MS);
        }
        // Waiting reserves keep their patience: it counts from no later than now.
        for p in &mut self.pending {
            p.since = p.since.min(now);
        }
        self.last_activity = self.last_activity.min(now);
        self.last_tick = self.last_tick.min(now);
        self.rate.clock_went_back(now);
        if let Some(t) = &mut self.recounted_at {
            *t = (*t).min(now);
        }
    }
}

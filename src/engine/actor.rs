//! `VoucherActor`: the one owner of a voucher's in-memory state on this node. It serves reserves
//! from leased blocks, group-commits them (one commit in flight; the next batch is whatever queued
//! meanwhile), prefetches the next block at the low-water mark, renews, returns idle units, raises
//! the sold-out flag, and stops after long idleness. Nothing else mutates this state.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use actix::prelude::*;
use tokio::sync::oneshot;

use super::sizing::{block_size, low_water, RateEstimator};
use super::soldout::VoucherShared;
use super::{error_outcome, settle_without_units, Core, EngineError, Reserved, Stop};
use crate::clock::Millis;
use crate::domain::{Ineligible, Reservation, ReserveRequest, Voucher};
use crate::ledger::{Batch, BatchRow, Grant, LedgerError, RowOutcome};
use crate::metrics::{self as m, LeaseEvent, Outcome};
use crate::signals::Signal;

/// The actor's answer to one reserve.
#[derive(Debug)]
pub(crate) enum Reply {
    Created(Reservation),
    Replayed(Reservation),
    Failed(EngineError),
}

impl Reply {
    fn outcome(&self) -> Outcome {
        match self {
            Self::Created(_) => Outcome::Created,
            Self::Replayed(_) => Outcome::Replayed,
            Self::Failed(e) => error_outcome(e),
        }
    }

    pub(crate) fn into_result(self) -> Result<Reserved, EngineError> {
        match self {
            Self::Created(reservation) => Ok(Reserved {
                reservation,
                replayed: false,
            }),
            Self::Replayed(reservation) => Ok(Reserved {
                reservation,
                replayed: true,
            }),
            Self::Failed(e) => Err(e),
        }
    }
}

/// Answers reserves and counts them by outcome; the counts are recorded once, when the tally is
/// dropped (once per batch where there is one).
#[derive(Default)]
struct Tally(Vec<(Outcome, u64)>);

impl Tally {
    fn answer(&mut self, p: Pending, reply: Reply) {
        let outcome = reply.outcome();
        match self.0.iter_mut().find(|(o, _)| *o == outcome) {
            Some((_, n)) => *n += 1,
            None => self.0.push((outcome, 1)),
        }
        let _ = p.reply.send(reply);
    }

    /// Answers one reserve on its own.
    fn one(p: Pending, reply: Reply) {
        Tally::default().answer(p, reply);
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        for (outcome, n) in self.0.drain(..) {
            m::reservations(outcome, n);
        }
    }
}

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Reserve {
    pub req: ReserveRequest,
    pub reply: oneshot::Sender<Reply>,
}

/// Units came back to `free`: stop treating the ledger as empty.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Restocked;

/// The voucher was edited: take the new definition.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Reload(pub Voucher);

/// Start serving: take a first lease now, answer when it is held (or the ledger is empty).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Warm(pub oneshot::Sender<Result<(), EngineError>>);

/// Another node saw the voucher sold out: if this node holds nothing, check with the ledger now
/// instead of waiting for the next request.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct SoldOutElsewhere;

/// Shutting down: stop serving.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Drain;

/// Another node ran dry while this one may hold idle units (`RECALL`).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Recall;

/// How often an actor re-reads its voucher's definition.
const VOUCHER_REFRESH_MS: i64 = 1000;
/// How soon an actor waiting for recalled units asks the ledger again.
const RECALL_PROBE_MS: i64 = 50;
/// How often an actor waiting for units repeats its RECALL.
const RECALL_REPEAT_MS: i64 = 100;

struct Pending {
    req: ReserveRequest,
    reply: oneshot::Sender<Reply>,
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

/// Runs the scheduler again (after reserves went back to the queue).
#[derive(Message)]
#[rtype(result = "()")]
struct Pump;

/// A lease as this node serves it.
#[derive(Debug)]
struct LocalLease {
    id: i64,
    granted: i64,
    /// Units committed or in the batch in flight.
    used: i64,
    expires_at: Millis,
}

impl LocalLease {
    fn room(&self) -> i64 {
        self.granted - self.used
    }
}

/// Why the actor is not asking the ledger for units right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// The ledger had no free units and no other node holds any: answer from the ledger's
    /// orders only.
    Dry,
    /// No free units, but other nodes hold unused ones: keep reserves queued (up to
    /// `recall_wait_ms`) while they are recalled, and ask again soon.
    Waiting,
    /// The ledger failed: answer `503` until the backoff ends.
    Down,
}

pub(crate) struct VoucherActor {
    code: String,
    core: Arc<Core>,
    shared: Arc<VoucherShared>,
    /// Tells this actor's registry entry apart from a successor's when it leaves.
    generation: u64,
    voucher: Option<Voucher>,
    /// The ledger has no such voucher: answer `404` from memory (a cheap negative cache against
    /// floods of unknown codes) until it appears or the actor stops.
    missing: bool,
    leases: VecDeque<LocalLease>,
    pending: VecDeque<Pending>,
    /// Reserves waiting for [`Self::answer_without_units`]: no unit can serve them, but some may
    /// be retries of stored orders.
    lookups: Vec<(Pending, Diverted)>,
    warm_waiters: Vec<oneshot::Sender<Result<(), EngineError>>>,
    /// The leases of the batches in flight (at most `engine.batches_in_flight`, 1 by default;
    /// a lease may appear twice). With more than one, a second batch waits in the node's group
    /// committer for the next merged transaction while the first commits.
    committing: Vec<i64>,
    /// Batches of this actor that landed so far. A grant answered after one of them landed may
    /// count that batch's units as still leased; it gives no verdict (see `on_granted`).
    landed: u64,
    granting: bool,
    renewing: bool,
    /// Warmed (by an operator or pre-heat): if the sale has not started, the lease is kept until
    /// it does.
    warmed: bool,
    /// Shutting down: no warm-up may take a lease again.
    draining: bool,
    /// A ledger lookup for reserves that arrived while the ledger had nothing is in flight; the
    /// next waiters go in the next lookup, so a dry spell costs one query at a time, not one per
    /// request.
    looking_up: bool,
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
    /// RECALL is published at most once per probe interval.
    next_recall: Millis,
    /// How many reservations the voucher ever had when this node last loaded its winners and
    /// raised the sold-out flag: a probe that finds the same number has nothing new to load.
    sold_out_at: Option<i64>,
    /// Before the sale starts, the most units this node may hold: the free units it saw at its
    /// first grant over `endgame_divisor`. Pre-start traffic sizes the lease (pre-heat), but a
    /// bot hammering one node before the start cannot pull the voucher into it.
    prestart_cap: Option<i64>,
    /// When this actor last recounted the voucher's books on a sell-out: an end-game of
    /// restocks and sell-outs recounts at most once per `SOLD_OUT_RECOUNT_MS`.
    recounted_at: Option<Millis>,
}

/// Least time between two recounts of a voucher's books on its sell-outs, per node.
const SOLD_OUT_RECOUNT_MS: Millis = 10_000;

impl VoucherActor {
    pub(crate) fn new(
        code: String,
        core: Arc<Core>,
        shared: Arc<VoucherShared>,
        generation: u64,
    ) -> Self {
        let now = core.clock.now_ms();
        Self {
            code,
            core,
            shared,
            generation,
            voucher: None,
            missing: false,
            leases: VecDeque::new(),
            pending: VecDeque::new(),
            lookups: Vec::new(),
            warm_waiters: Vec::new(),
            committing: Vec::new(),
            landed: 0,
            granting: false,
            renewing: false,
            warmed: false,
            draining: false,
            looking_up: false,
            free_hint: None,
            hold: None,
            rate: RateEstimator::new(now),
            last_activity: now,
            next_probe: now,
            next_refresh: now + VOUCHER_REFRESH_MS,
            recall_pending: false,
            next_recall: now,
            sold_out_at: None,
            recounted_at: None,
            prestart_cap: None,
        }
    }

    fn now(&self) -> Millis {
        self.core.clock.now_ms()
    }

    /// The voucher's sale has not started at `now` (as this node's copy says).
    fn before_start(&self, now: Millis) -> bool {
        self.voucher.as_ref().is_some_and(|v| now < v.starts_at)
    }

    /// Takes a (new) definition of the voucher; the frontend's copy follows.
    fn set_voucher(&mut self, v: Voucher) {
        self.shared.set_voucher(&v);
        if self.shared.own_limits_spec() != v.limits {
            self.shared.set_own_limits(self.core.limits.own(v.limits));
        }
        self.voucher = Some(v);
    }

    fn room(&self) -> i64 {
        self.leases.iter().map(LocalLease::room).sum()
    }

    /// Answers every waiting reserve and warm-up with `err`.
    fn fail_all(&mut self, err: EngineError) {
        let mut tally = Tally::default();
        let lookups = self.lookups.drain(..).map(|(p, _)| p);
        for p in self.pending.drain(..).chain(lookups) {
            tally.answer(p, Reply::Failed(err.clone()));
        }
        for w in self.warm_waiters.drain(..) {
            let _ = w.send(Err(err.clone()));
        }
    }

    fn on_loaded(&mut self, res: Result<Option<Voucher>, LedgerError>, ctx: &mut Context<Self>) {
        match res {
            Ok(Some(v)) => {
                self.set_voucher(v);
                let now = self.now();
                let pending = std::mem::take(&mut self.pending);
                for p in pending {
                    self.admit(p, now);
                }
                self.pump(ctx);
            }
            Ok(None) => {
                self.missing = true;
                self.fail_all(EngineError::NotFound);
            }
            Err(e) => {
                tracing::warn!(code = %self.code, error = %e, "load voucher");
                m::ledger_error("load_voucher");
                self.fail_all(EngineError::Unavailable);
                ctx.stop();
            }
        }
    }

    /// Queues a reserve that passed eligibility, or answers it at once.
    fn admit(&mut self, p: Pending, now: Millis) {
        if self.missing {
            Tally::one(p, Reply::Failed(EngineError::NotFound));
            return;
        }
        let Some(v) = &self.voucher else {
            self.pending.push_back(p);
            return;
        };
        match v.check_eligible(now, p.req.order_amount) {
            // The switches stop new sales; a retry of a stored order still gets its 201.
            Ok(()) if self.core.stop() != Stop::No => {
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
                // the start (taken now, kept until then), so the first second is served from
                // memory like the tenth.
                if reason == Ineligible::NotStarted && self.warmed && self.core.stop() == Stop::No {
                    self.rate.record(now, 1);
                }
                Tally::one(p, Reply::Failed(EngineError::NotEligible(reason)));
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

    /// The scheduler: starts a batch if none is in flight, asks for units when short, and answers
    /// what cannot be served while the ledger is empty or down.
    fn pump(&mut self, ctx: &mut Context<Self>) {
        if self.voucher.is_none() {
            return;
        }
        // A switch turned on while reserves were queued: none of them becomes a batch now.
        if self.core.stop() != Stop::No && !self.pending.is_empty() {
            self.lookups
                .extend(self.pending.drain(..).map(|p| (p, Diverted::BySwitch)));
        }
        let now = self.now();
        self.drop_unservable_leases(now);
        if let Some((_, until)) = self.hold {
            if now >= until {
                self.hold = None;
            }
        }
        let in_flight = self.core.settings.batches_in_flight.max(1);
        while self.committing.len() < in_flight && !self.pending.is_empty() {
            if !self.start_batch(ctx) {
                break;
            }
        }
        let rate = self.rate.per_sec(now);
        let room = self.room();
        let capped = self.before_start(now) && self.prestart_cap.is_some_and(|cap| room >= cap);
        let short = (self.pending.len() as i64) > room
            || (room < low_water(&self.core.sizing, rate) && rate > 0.0 && !capped)
            || !self.warm_waiters.is_empty();
        match self.hold {
            None if short && !self.granting => self.start_grant(ctx),
            // The ledger failed (or the node is draining): what waits gets 503 at once, whatever
            // the lease still holds; no new batch starts while this lasts.
            Some((Hold::Down, _)) => {
                let mut tally = Tally::default();
                for p in self.pending.drain(..) {
                    tally.answer(p, Reply::Failed(EngineError::Unavailable));
                }
            }
            Some((hold, _)) if room == 0 && self.committing.is_empty() && !self.granting => {
                let waiting: Vec<Pending> = match hold {
                    Hold::Waiting => {
                        let patience = self.core.settings.recall_wait_ms;
                        let (give_up, keep): (Vec<Pending>, Vec<Pending>) =
                            std::mem::take(&mut self.pending)
                                .into_iter()
                                .partition(|p| now - p.since >= patience);
                        self.pending = keep.into();
                        give_up
                    }
                    _ => self.pending.drain(..).collect(),
                };
                self.lookups
                    .extend(waiting.into_iter().map(|p| (p, Diverted::NoUnits)));
            }
            _ => {}
        }
        self.answer_without_units(ctx);
    }

    /// Stops serving from leases that are used up or too close to expiry (the node must stop
    /// before a reaper may take the lease); units left in expiring ones are handed back.
    fn drop_unservable_leases(&mut self, now: Millis) {
        let safety = self.core.settings.lease_safety_ms;
        self.give_back_leases(now, LeaseEvent::Lost, |l| {
            l.room() > 0 && l.expires_at - safety > now
        });
    }

    /// Stops serving from every lease `keep` rejects (never the one the batch in flight draws
    /// on) and hands their unused units back to `free`.
    fn give_back_leases(
        &mut self,
        now: Millis,
        event: LeaseEvent,
        keep: impl Fn(&LocalLease) -> bool,
    ) {
        let in_flight = &self.committing;
        let (kept, dropped): (VecDeque<LocalLease>, VecDeque<LocalLease>) = self
            .leases
            .drain(..)
            .partition(|l| in_flight.contains(&l.id) || keep(l));
        self.leases = kept;
        for l in dropped.into_iter().filter(|l| l.room() > 0) {
            m::lease(event);
            spawn_return(&self.core, l.id, now);
        }
    }

    /// Sends the next batch to the node's group committer; false when there is nothing to send.
    fn start_batch(&mut self, ctx: &mut Context<Self>) -> bool {
        if matches!(self.hold, Some((Hold::Down, _))) {
            return false;
        }
        let max_batch = self.core.settings.max_batch.max(1) as i64;
        // Only a lease that is still servable: one kept only because a batch on it is in
        // flight, or one too close to expiry, takes nothing new.
        let (now, safety) = (self.now(), self.core.settings.lease_safety_ms);
        let Some(lease) = self
            .leases
            .iter_mut()
            .find(|l| l.room() > 0 && l.expires_at - safety > now)
        else {
            return false;
        };
        let n = (self.pending.len() as i64).min(lease.room()).min(max_batch) as usize;
        if n == 0 {
            return false;
        }
        lease.used += n as i64;
        let lease_id = lease.id;
        let taken: Vec<Pending> = self.pending.drain(..n).collect();
        let now = self.now();
        let batch = Batch {
            voucher_code: self.code.clone(),
            lease_id,
            now,
            expires_at: now + self.core.settings.reservation_ttl_ms,
            rows: taken
                .iter()
                .map(|p| BatchRow {
                    order_id: p.req.order_id.clone(),
                    customer_id: p.req.customer_id,
                })
                .collect(),
        };
        self.committing.push(lease_id);
        let ledger = self.core.ledger.clone();
        let fut = async move {
            let started = Instant::now();
            let res = ledger.commit_batch(&batch).await;
            (res, started.elapsed())
        };
        ctx.spawn(fut.into_actor(self).map(move |(res, took), act, ctx| {
            m::batch(n, took);
            act.on_committed(lease_id, taken, res, ctx);
        }));
        true
    }

    fn on_committed(
        &mut self,
        lease_id: i64,
        taken: Vec<Pending>,
        res: Result<Vec<RowOutcome>, LedgerError>,
        ctx: &mut Context<Self>,
    ) {
        self.landed += 1;
        if let Some(i) = self.committing.iter().position(|&id| id == lease_id) {
            self.committing.swap_remove(i);
        }
        let n = taken.len() as i64;
        match res {
            Ok(outcomes) => {
                let mut consumed = 0;
                if outcomes
                    .iter()
                    .any(|o| matches!(o, RowOutcome::NotEligible(_)))
                {
                    self.refresh_voucher(ctx);
                }
                let mut tally = Tally::default();
                let now = self.now();
                for (p, o) in taken.into_iter().zip(outcomes) {
                    let reply = match o {
                        RowOutcome::Created(r) => {
                            consumed += 1;
                            Reply::Created(r)
                        }
                        RowOutcome::Replayed(r) => Reply::Replayed(r),
                        RowOutcome::AlreadyUsed => Reply::Failed(EngineError::AlreadyUsed),
                        RowOutcome::NotEligible(reason) => {
                            Reply::Failed(EngineError::NotEligible(reason))
                        }
                    };
                    tally.answer(p, reply);
                }
                if let Some(l) = self.leases.iter_mut().find(|l| l.id == lease_id) {
                    l.used -= n - consumed;
                }
                // Repeats and refusals took nothing: they are not demand.
                self.rate.forget(now, (n - consumed) as u64);
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
                let mut tally = Tally::default();
                for p in taken {
                    tally.answer(p, Reply::Failed(EngineError::Unavailable));
                }
                if matches!(e, LedgerError::Fenced) {
                    // The lease is gone in the ledger: stop serving from it.
                    self.leases.retain(|l| l.id != lease_id);
                    m::lease(LeaseEvent::Fenced);
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
                    m::ledger_error("commit_batch");
                    tracing::warn!(code = %self.code, lease_id, error = %e, "batch commit failed");
                    self.hold_for(Hold::Down, 200);
                }
            }
        }
        self.pump(ctx);
    }

    fn hold_for(&mut self, hold: Hold, ms: i64) {
        self.hold = Some((hold, self.now() + ms));
    }

    fn start_grant(&mut self, ctx: &mut Context<Self>) {
        let now = self.now();
        let rate = self.rate.per_sec(now);
        let waiting = (self.pending.len() as i64 - self.room()).max(0) as usize;
        let mut want = block_size(&self.core.sizing, rate, waiting, self.free_hint);
        if let (true, Some(cap)) = (self.before_start(now), self.prestart_cap) {
            want = want.min((cap - self.room()).max(1));
        }
        self.granting = true;
        let epoch = self.shared.restock_epoch();
        let landed = self.landed;
        let (ledger, code, node, ttl) = (
            self.core.ledger.clone(),
            self.code.clone(),
            self.core.node_id.clone(),
            self.core.settings.lease_ttl_ms,
        );
        let fut = async move { ledger.grant(&code, &node, want, now, ttl).await };
        ctx.spawn(
            fut.into_actor(self)
                .map(move |res, act, ctx| act.on_granted(res, epoch, landed, ctx)),
        );
    }

    fn on_granted(
        &mut self,
        res: Result<Grant, LedgerError>,
        epoch: u64,
        landed: u64,
        ctx: &mut Context<Self>,
    ) {
        self.granting = false;
        match res {
            Ok(grant) => {
                self.free_hint = Some(grant.free_after);
                if self.prestart_cap.is_none() && self.before_start(self.now()) {
                    let seen = grant.free_after + grant.lease.as_ref().map_or(0, |l| l.granted);
                    let p = &self.core.sizing;
                    self.prestart_cap =
                        Some((seen / p.endgame_divisor).max(p.min_block).min(p.max_block));
                }
                if let Some(lease) = grant.lease {
                    m::lease(LeaseEvent::Granted);
                    m::lease_granted_units(lease.granted);
                    self.leases.push_back(LocalLease {
                        id: lease.id,
                        granted: lease.granted,
                        used: 0,
                        expires_at: lease.expires_at,
                    });
                    self.hold = None;
                    if self.shared.is_sold_out() {
                        self.shared.restock();
                    }
                } else {
                    m::lease(LeaseEvent::Empty);
                    let now = self.now();
                    self.next_probe = now + self.core.settings.soldout_probe_ms;
                    if landed != self.landed && self.room() == 0 {
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
                            self.core.signals.publish(&self.code, Signal::Recall);
                        }
                    } else {
                        self.hold_for(Hold::Dry, self.core.settings.soldout_probe_ms);
                        // Still sold out with no new winner since the flag went up: nothing to
                        // reload, nothing to announce.
                        let unchanged = self.shared.is_sold_out()
                            && grant.ever_reserved.is_some()
                            && grant.ever_reserved == self.sold_out_at;
                        if self.room() == 0 && !unchanged {
                            self.declare_sold_out(epoch, grant.ever_reserved, ctx);
                        }
                    }
                }
                for w in self.warm_waiters.drain(..) {
                    let _ = w.send(Ok(()));
                }
            }
            Err(LedgerError::NotFound) => {
                self.missing = true;
                self.voucher = None;
                self.fail_all(EngineError::NotFound);
                return;
            }
            Err(e) => {
                m::ledger_error("grant");
                tracing::warn!(code = %self.code, error = %e, "lease grant failed");
                self.hold_for(Hold::Down, 200);
                for w in self.warm_waiters.drain(..) {
                    let _ = w.send(Err(EngineError::Unavailable));
                }
            }
        }
        self.pump(ctx);
    }

    /// The ledger is empty everywhere: load the winners and raise the flag (unless units came
    /// back meanwhile).
    fn declare_sold_out(
        &mut self,
        epoch: u64,
        ever_reserved: Option<i64>,
        ctx: &mut Context<Self>,
    ) {
        let (ledger, code) = (self.core.ledger.clone(), self.code.clone());
        let exact_max = self.core.settings.won_set_exact_max;
        let fut = async move { ledger.won_orders(&code).await };
        ctx.spawn(fut.into_actor(self).map(move |res, act, _| match res {
            Ok(won) => {
                let limit = act.voucher.as_ref().map_or(i64::MAX, |v| v.per_user_limit);
                // Two verdicts can cross (one asked again while the first loaded its
                // winners): the second, on the same winners, announces nothing new.
                let same = act.shared.is_sold_out()
                    && ever_reserved.is_some()
                    && act.sold_out_at == ever_reserved;
                if act.shared.set_sold_out(epoch, won, limit, exact_max) && !same {
                    act.sold_out_at = ever_reserved;
                    tracing::info!(code = %act.code, "sold out");
                    act.core.signals.publish(&act.code, Signal::SoldOut);
                    // The books of a sale are checked soon after it sells out (the live
                    // numbers recount it), not at the reconciler's next round.
                    let now = act.now();
                    if act
                        .recounted_at
                        .is_none_or(|t| now - t >= SOLD_OUT_RECOUNT_MS)
                    {
                        act.recounted_at = Some(now);
                        act.core.recount_soon(&act.code);
                    }
                }
            }
            Err(e) => {
                m::ledger_error("won_orders");
                tracing::warn!(code = %act.code, error = %e, "load winning orders");
            }
        }));
    }

    /// Reserves no unit serves (none left, or the voucher refuses new orders now) can still be
    /// retries of stored orders: one ledger lookup at a time for all of them, answered with
    /// DESIGN §4's precedence ([`settle_without_units`]).
    fn answer_without_units(&mut self, ctx: &mut Context<Self>) {
        if self.looking_up || self.lookups.is_empty() {
            return;
        }
        let stop = self.core.stop();
        // Sent here only by a switch that is off again: they can be served from units.
        if stop == Stop::No && self.lookups.iter().any(|(_, d)| *d == Diverted::BySwitch) {
            let (back, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.lookups)
                .into_iter()
                .partition(|(_, d)| *d == Diverted::BySwitch);
            self.lookups = keep;
            self.pending.extend(back.into_iter().map(|(p, _)| p));
            ctx.notify(Pump);
            if self.lookups.is_empty() {
                return;
            }
        }
        let waiting: Vec<Pending> = std::mem::take(&mut self.lookups)
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        let reqs: Vec<ReserveRequest> = waiting.iter().map(|p| p.req.clone()).collect();
        let (ledger, code, voucher) = (
            self.core.ledger.clone(),
            self.code.clone(),
            self.voucher.clone(),
        );
        let now = self.now();
        self.looking_up = true;
        let fut = async move {
            settle_without_units(&ledger, &code, voucher.as_ref(), now, &reqs, stop).await
        };
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| {
            act.looking_up = false;
            let mut tally = Tally::default();
            match res {
                Ok(answers) => {
                    for (p, answer) in waiting.into_iter().zip(answers) {
                        let reply = match answer {
                            Ok(r) => Reply::Replayed(r.reservation),
                            Err(e) => Reply::Failed(e),
                        };
                        tally.answer(p, reply);
                    }
                }
                Err(_) => {
                    m::ledger_error("find_orders");
                    for p in waiting {
                        tally.answer(p, Reply::Failed(EngineError::Unavailable));
                    }
                }
            }
            act.pump(ctx);
        }));
    }

    /// Returns every lease not drawn on by the batch in flight (that one follows when it lands).
    fn return_idle_leases(&mut self) {
        let now = self.now();
        self.recall_pending = !self.committing.is_empty();
        self.give_back_leases(now, LeaseEvent::Recalled, |_| false);
    }

    /// Re-reads the voucher's definition from the ledger.
    fn refresh_voucher(&mut self, ctx: &mut Context<Self>) {
        self.next_refresh = self.now() + VOUCHER_REFRESH_MS;
        let (ledger, code) = (self.core.ledger.clone(), self.code.clone());
        let fut = async move { ledger.voucher(&code).await };
        ctx.spawn(fut.into_actor(self).map(|res, act, _| {
            if let Ok(Some(v)) = res {
                act.set_voucher(v);
                act.missing = false;
            }
        }));
    }

    /// The periodic chores: renewal, idle return, the sold-out probe, voucher refresh and idle
    /// stop.
    fn tick(&mut self, ctx: &mut Context<Self>) {
        let now = self.now();
        if now >= self.next_refresh && (self.voucher.is_some() || self.missing) {
            self.refresh_voucher(ctx);
        }
        let core = self.core.clone();
        let s = &core.settings;
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
        if idle >= s.lease_idle_timeout_ms && self.committing.is_empty() && self.pending.is_empty()
        {
            self.give_back_leases(now, LeaseEvent::Returned, |_| false);
        }
        self.renew_if_due(now, ctx);
        // A sold-out or dry actor with nothing to serve probes the ledger at a fixed rate. The
        // probe is a grant: if units came back it takes them (and lowers the flag); if the
        // ledger is empty everywhere it raises the flag.
        let empty_handed =
            self.room() == 0 && self.committing.is_empty() && self.free_hint == Some(0);
        if (self.shared.is_sold_out() || empty_handed)
            && now >= self.next_probe
            && !self.granting
            && self.voucher.is_some()
        {
            self.next_probe = now + s.soldout_probe_ms;
            self.start_grant(ctx);
        }
        let stop_after = if self.missing {
            s.lease_idle_timeout_ms
        } else {
            s.actor_idle_stop_ms
        };
        if unseen >= stop_after
            && self.leases.is_empty()
            && self.committing.is_empty()
            && !self.granting
            && !self.looking_up
            && self.pending.is_empty()
            && self.lookups.is_empty()
        {
            ctx.stop();
            return;
        }
        self.pump(ctx);
    }

    fn renew_if_due(&mut self, now: Millis, ctx: &mut Context<Self>) {
        let ttl = self.core.settings.lease_ttl_ms;
        if self.renewing {
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
        self.renewing = true;
        let (ledger, node) = (self.core.ledger.clone(), self.core.node_id.clone());
        let fut = async move {
            ledger
                .renew(&due, &node, now, ttl)
                .await
                .map(|alive| (due, alive))
        };
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| {
            act.renewing = false;
            match res {
                Ok((due, alive)) => {
                    for l in act.leases.iter_mut().filter(|l| due.contains(&l.id)) {
                        if alive.contains(&l.id) {
                            m::lease(LeaseEvent::Renewed);
                            l.expires_at = now + ttl;
                        } else {
                            // Reaped or returned behind our back: stop serving from it.
                            m::lease(LeaseEvent::Lost);
                            l.granted = l.used;
                        }
                    }
                }
                Err(e) => {
                    m::ledger_error("renew");
                    tracing::warn!(code = %act.code, error = %e, "lease renewal failed");
                }
            }
            act.pump(ctx);
        }));
    }
}

/// Hands a lease's unused units back to `free` in the background; the ledger makes it idempotent.
fn spawn_return(core: &Arc<Core>, lease_id: i64, now: Millis) {
    let core = core.clone();
    actix::spawn(async move {
        match core.ledger.return_lease(lease_id, now).await {
            Ok(Some(restock)) => core.restocked(&restock.voucher_code),
            Ok(None) => {}
            Err(e) => {
                m::ledger_error("return_lease");
                tracing::warn!(lease_id, error = %e, "lease return failed; the reaper will take it");
            }
        }
    });
}

impl Actor for VoucherActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(self.core.settings.mailbox_capacity.max(16));
        let (ledger, code) = (self.core.ledger.clone(), self.code.clone());
        let fut = async move { ledger.voucher(&code).await };
        ctx.spawn(
            fut.into_actor(self)
                .map(|res, act, ctx| act.on_loaded(res, ctx)),
        );
        let every = std::time::Duration::from_millis(250);
        ctx.run_interval(every, |act, ctx| act.tick(ctx));
    }

    fn stopped(&mut self, _: &mut Context<Self>) {
        self.fail_all(EngineError::Unavailable);
        self.core.forget(&self.code, self.generation);
        let now = self.now();
        self.give_back_leases(now, LeaseEvent::Returned, |_| false);
    }
}

impl Handler<Reserve> for VoucherActor {
    type Result = ();

    fn handle(&mut self, msg: Reserve, ctx: &mut Context<Self>) {
        let now = self.now();
        self.last_activity = now;
        if self.pending.len() + self.lookups.len() >= self.core.settings.max_pending {
            m::mailbox_full();
            m::reservation(Outcome::Unavailable);
            let _ = msg.reply.send(Reply::Failed(EngineError::Unavailable));
            return;
        }
        self.admit(
            Pending {
                req: msg.req,
                reply: msg.reply,
                since: now,
            },
            now,
        );
        self.pump(ctx);
    }
}

impl Handler<Pump> for VoucherActor {
    type Result = ();

    fn handle(&mut self, _: Pump, ctx: &mut Context<Self>) {
        self.pump(ctx);
    }
}

impl Handler<Restocked> for VoucherActor {
    type Result = ();

    fn handle(&mut self, _: Restocked, ctx: &mut Context<Self>) {
        if matches!(self.hold, Some((Hold::Dry | Hold::Waiting, _))) {
            self.hold = None;
        }
        self.free_hint = None;
        self.pump(ctx);
    }
}

impl Handler<Reload> for VoucherActor {
    type Result = ();

    fn handle(&mut self, msg: Reload, ctx: &mut Context<Self>) {
        self.set_voucher(msg.0);
        self.pump(ctx);
    }
}

impl Handler<Warm> for VoucherActor {
    type Result = ();

    fn handle(&mut self, msg: Warm, ctx: &mut Context<Self>) {
        if self.draining {
            let _ = msg.0.send(Err(EngineError::Unavailable));
            return;
        }
        self.last_activity = self.now();
        self.warmed = true;
        if self.missing {
            let _ = msg.0.send(Err(EngineError::NotFound));
            return;
        }
        if self.room() > 0 {
            let _ = msg.0.send(Ok(()));
            return;
        }
        self.warm_waiters.push(msg.0);
        self.hold = None;
        self.pump(ctx);
    }
}

impl Handler<Recall> for VoucherActor {
    type Result = ();

    /// Another node ran dry: hand back what this node holds but does not need right now. With
    /// reserves queued here the units are in use; they go back after the batch in flight if
    /// nothing waits by then.
    fn handle(&mut self, _: Recall, _: &mut Context<Self>) {
        if self.pending.is_empty() {
            self.return_idle_leases();
        } else {
            self.recall_pending = true;
        }
    }
}

impl Handler<Drain> for VoucherActor {
    type Result = ();

    fn handle(&mut self, _: Drain, _: &mut Context<Self>) {
        // Nothing more is served from here on; the engine returns the leases in one call.
        self.draining = true;
        self.hold_for(Hold::Down, i64::MAX / 4);
        let in_flight = &self.committing;
        self.leases.retain(|l| in_flight.contains(&l.id));
    }
}

impl Handler<SoldOutElsewhere> for VoucherActor {
    type Result = ();

    fn handle(&mut self, _: SoldOutElsewhere, ctx: &mut Context<Self>) {
        if self.room() == 0
            && !self.granting
            && self.voucher.is_some()
            && !self.shared.is_sold_out()
        {
            self.start_grant(ctx);
        }
    }
}

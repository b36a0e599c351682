//! The node's upkeep, called by the background jobs and at shutdown: expiry of unconfirmed
//! reservations, lease reaping (by expiry and of dead holders), the heartbeat, reconciliation,
//! the live numbers, the rate limiters' upkeep, readiness, the drain; and what other nodes'
//! signals ask of this one.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::actor::{Drain, Recall, Reload, SoldOutElsewhere};
use super::{EngineError, EngineHandle};
use crate::clock::{ledger_ahead, Millis};
use crate::ledger::{LedgerError, Restock, SharedLedger};
use crate::metrics as m;
use crate::signals::Signal;

/// Most vouchers this node changed that one reconciler run recounts. A backlog beyond it (a
/// flood of first reserves on a long tail leaves one of its size) is worked off by the live
/// numbers, [`BACKLOG_PER_RUN`] a second.
const MAX_RECOUNTS_PER_RUN: usize = 2_000;
/// Vouchers recounted in one read of each table.
const RECOUNT_PAGE: usize = 500;
/// Vouchers of a backlog the live numbers recount each run (once a second): about 1 % of a
/// core (500 a second showed as 2 % on top of an idle node's 0.4 %), so 150,000 first
/// reserves are recounted within ten minutes.
const BACKLOG_PER_RUN: usize = 250;
/// A recount reads every reservation of the vouchers it recounts, which grows with the sale
/// (tens of millions of rows after a long one): after a reconciler run (`jobs`) the next waits
/// at least this many times its duration, and every recount (the reconciler's, a sell-out's, a
/// backlog page) is charged this many times its duration on the budget the backlog waits for
/// ([`super::backlog::RecountPace`]), so recounts take about 5 % of a core from the sale at
/// most (sell-outs' recounts, due at once, can exceed it while vouchers keep selling out).
pub const RECOUNT_IDLE_FACTOR: u32 = 19;

impl EngineHandle {
    /// The subscription to cluster signals came up (`true`) or ended. While it is down a
    /// `RESTOCK` can be missed, so no sold-out flag answers for the ledger; when it comes back
    /// every flag stays unconfirmed until its actor's next probe finds the same winners (the
    /// winners stay: a flapping link costs one grant per sold-out voucher and probe interval).
    pub fn signals_link(&self, up: bool) {
        if up {
            for e in self.node.registry.iter() {
                e.shared.unverify();
            }
        }
        self.node.signals_up.store(up, Ordering::Release);
    }

    /// Acts on a signal another node published.
    pub fn on_signal(&self, code: &str, signal: Signal) {
        match signal {
            Signal::Restock => self.node.apply_restock(code),
            Signal::SoldOut => {
                if let Some(e) = self.node.registry.get(code) {
                    let _ = e.addr.try_send(SoldOutElsewhere);
                }
            }
            Signal::Recall => {
                if let Some(e) = self.node.registry.get(code) {
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
                self.node.known.insert(code);
                let Some(addr) = self.node.registry.get(code).map(|e| e.addr.clone()) else {
                    return;
                };
                let (ledger, code) = (self.node.ledger.clone(), code.to_string());
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
        for e in self.node.registry.iter() {
            let _ = e.addr.try_send(Drain);
        }
        match self
            .node
            .ledger
            .return_node_leases(&self.node.node_id, self.now_ms())
            .await
        {
            Ok(restocks) => {
                let units: i64 = restocks.iter().map(|r| r.units).sum();
                tracing::info!(units, "returned this node's leases");
                for r in restocks {
                    self.node.signals.publish(&r.voucher_code, Signal::Restock);
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not return leases; the reaper will"),
        }
        // Gone from the living: nobody waits for this process, and its row does not linger.
        if let Err(e) = self.node.ledger.retire_node(&self.node.node_id).await {
            tracing::warn!(error = %e, "could not retire this node's heartbeat");
        }
    }

    /// Live numbers, for the vouchers [`super::spotlight`] picks (the hottest here and the
    /// watched): their units from their row and active leases (no scan of their reservations)
    /// into `vouchers_units`, and their reserves by outcome on this node. Vouchers not yet
    /// started are never exported: their codes are the secret of an unannounced sale. The work
    /// follows the vouchers picked, not the catalogue. Returns how many were exported.
    pub async fn live_numbers(&self) -> Result<usize, EngineError> {
        // These gauges are set here, so that they never go idle (see `metrics::install`).
        m::actors(self.node.registry.len());
        crate::memory::record_heap();
        if self.node.tidy_registry() {
            self.node.give_back.make_due();
        }
        m::redis_configured(self.node.signals.enabled());
        let now = self.now_ms();
        let watched = self.node.ledger.watched_codes().await?;
        let mut picker = self.node.spotlight.picker();
        for e in self.node.registry.iter() {
            picker.offer(e.key(), e.shared.answered(), &e.shared.heat);
        }
        let reserves = picker.answered();
        let picked = picker.finish(&watched);
        let units = self
            .node
            .ledger
            .live_units(now, self.watched_after(now), &picked)
            .await?;
        units.iter().for_each(m::live_units);
        let on_sale: HashSet<&str> = units.iter().map(|u| u.code.as_str()).collect();
        self.node.spotlight.exported(on_sale.iter().copied());
        for code in &on_sale {
            if let Some(e) = self.node.registry.get(*code) {
                m::voucher_outcomes(code, &e.shared.outcome_counts());
            }
        }
        m::voucher_view(on_sale.len(), self.node.known.len());
        // The books of a voucher that just sold out, recounted now rather than at the
        // reconciler's next round (one after the other); charged to the recounts' budget.
        let sold_out: Vec<String> =
            std::mem::take(&mut *self.node.recount.lock().unwrap_or_else(|e| e.into_inner()))
                .into_iter()
                .collect();
        // A voucher recounted at a sell-out lately waits for the reconciler instead.
        let (sold_out, later) = self.node.sell_out_recounts.due(sold_out, Instant::now());
        later.iter().for_each(|c| self.node.changed(c));
        for page in sold_out.chunks(RECOUNT_PAGE) {
            let started = Instant::now();
            // What was not read is tried again at the next run.
            match recount(&self.node.ledger, page, |c| on_sale.contains(c)).await {
                Ok(r) => r.unread.iter().for_each(|c| self.node.recount_soon(c)),
                Err(e) => {
                    tracing::warn!(vouchers = page.len(), error = %e, "recount after a sell-out failed");
                    page.iter().for_each(|c| self.node.recount_soon(c));
                }
            }
            self.node.pace.spent(Instant::now(), started.elapsed());
        }
        // A backlog of changed vouchers, beyond what the reconciler's next run takes: some of
        // it now, when the recounts' budget allows. A flood's first reserves are recounted
        // within minutes at about 1 % of a core, rather than over half an hour of reconciler
        // runs with their codes held here, or in bursts that would show as a core's seconds.
        let started = Instant::now();
        if self.node.pace.ready(started) {
            let mut backlog = self
                .node
                .changed
                .take_backlog(BACKLOG_PER_RUN, MAX_RECOUNTS_PER_RUN);
            if !backlog.is_empty() {
                match recount(&self.node.ledger, &backlog, |c| on_sale.contains(c)).await {
                    Ok(r) if r.unread.is_empty() => {}
                    Ok(r) => {
                        r.unread.iter().for_each(|c| self.node.changed(c));
                        backlog.failed();
                    }
                    Err(e) => {
                        tracing::warn!(vouchers = backlog.len(), error = %e, "recount of changed vouchers failed");
                        backlog.iter().for_each(|c| self.node.changed(c));
                        backlog.failed();
                    }
                }
                self.node.pace.spent(Instant::now(), started.elapsed());
            }
        }
        if self.node.changed.backlog_done() {
            // The flood's last codes are recounted: what the recounts' reads and the set's
            // room held goes back, not at the next flood.
            self.node.give_back.make_due();
        }
        // While the node is quiet: a give-back collects on every arbiter at once and waits for
        // the writer's one `PRAGMA shrink_memory`.
        // Not while a sale is about to start (or just started): its caches stay warm.
        if self.node.give_back.at_run(reserves, self.now_ms()) {
            // Forced on a busy node (five minutes without a quiet run): the threads' pages
            // only, not the ledger's caches the busy node reads through.
            let forced = self.node.give_back.forced();
            self.node.give_back_memory(!forced).await;
        }
        Ok(units.len())
    }

    /// Vouchers whose window ended after this can still change by themselves (sales, and expiries
    /// up to a reservation TTL later): the reconciler and the live numbers watch them.
    fn watched_after(&self, now: Millis) -> Millis {
        now - self.node.settings.reservation_ttl_ms - 60_000
    }

    /// Rate limiters drop the keys that refilled.
    pub fn limits_upkeep(&self) {
        self.node.limits.upkeep();
        for e in self.node.registry.iter() {
            if let Some(own) = e.shared.own_limits() {
                self.node.limits.upkeep_own(&own);
            }
        }
    }

    /// `Err` says what is down: the ledger, or the node's circuit breaker on it.
    pub async fn ready(&self) -> Result<(), &'static str> {
        match self.node.ledger.ping().await {
            Ok(()) => Ok(()),
            Err(LedgerError::CircuitOpen) => Err("ledger circuit open"),
            Err(_) => Err("ledger does not answer"),
        }
    }

    /// The ledger server this node writes to and the failovers it has seen (`None`: embedded).
    pub fn ledger_server(&self) -> Option<(String, u64)> {
        self.node.ledger.server()
    }

    pub(super) fn after_restocks(&self, restocks: impl Iterator<Item = Restock>) {
        for r in restocks {
            self.node.changed(&r.voucher_code);
            self.node.restocked(&r.voucher_code);
        }
    }

    /// Releases unconfirmed reservations whose time ran out. Returns how many were released.
    pub async fn expire_due(&self, batch: i64) -> Result<i64, EngineError> {
        let batch = batch.max(1);
        let mut total = 0;
        loop {
            let restocks = self.node.ledger.expire_due(self.now_ms(), batch).await?;
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
        let restocks = self.node.ledger.reap_expired(self.now_ms()).await?;
        Ok(self.after_reap(restocks))
    }

    /// Beats in the ledger, and corrects this node's clock to the ledger's; the leases of
    /// holders it finds dead are reaped on a task of their own (one at a time per node), so reaping never delays this node's next beat. Returns how
    /// many holders it found dead.
    pub async fn heartbeat(&self, dead_after_ms: i64) -> Result<usize, EngineError> {
        let sent = self.now_ms();
        let beat = self
            .node
            .ledger
            .heartbeat(&self.node.node_id, sent, dead_after_ms)
            .await?;
        if let Some(ahead) = ledger_ahead(beat.ledger_ms, sent, self.now_ms()) {
            self.node.clock.follow_ledger(ahead);
        }
        let dead = beat.dead;
        let found = dead.len();
        if !dead.is_empty() && !self.node.reaping.swap(true, Ordering::AcqRel) {
            let me = self.clone();
            actix_rt::spawn(async move {
                for holder in dead {
                    match me.node.ledger.reap_holder(&holder, me.now_ms()).await {
                        Ok(restocks) => {
                            me.after_reap(restocks);
                        }
                        Err(e) => {
                            m::ledger_error(m::LedgerOp::Jobs);
                            tracing::warn!(holder, error = %e, "reaping a dead holder failed");
                        }
                    }
                }
                me.node.reaping.store(false, Ordering::Release);
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

    /// Recomputes from the rows the books of every voucher this node changed since the last
    /// run, then of the next `jobs.reconcile_audit_page` vouchers of the catalogue that can
    /// still change (their window has not ended more than a reservation TTL and a minute ago),
    /// in code order, going round: what nobody touches is checked too, slowly, and a run costs
    /// what changed, not the catalogue. Returns the codes that do not balance.
    pub async fn reconcile(&self) -> Result<Vec<String>, EngineError> {
        let now = self.now_ms();
        let ending_after = self.watched_after(now);
        let started = Instant::now();
        {
            let mut changed = self.node.changed.lock();
            for e in self.node.registry.iter() {
                if e.shared.take_changed() {
                    changed.mark(e.key());
                }
            }
        }
        // A run recounts at most this many of them; the live numbers work off the rest. Held
        // (in flight) until this run's recounts are done.
        let mut taken = self.node.changed.take(MAX_RECOUNTS_PER_RUN);
        let mut codes: HashSet<String> = taken.iter().cloned().collect();
        let after = self
            .node
            .audit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let page = self
            .node
            .ledger
            .voucher_codes(ending_after, &after, self.node.audit_page)
            .await;
        let page = match page {
            Ok(page) => page,
            Err(e) => {
                // The changed vouchers taken wait for the next run.
                taken.iter().for_each(|c| self.node.changed(c));
                taken.failed();
                return Err(e.into());
            }
        };
        let next = match page.last() {
            Some(last) if page.len() as i64 >= self.node.audit_page => last.clone(),
            // The end of the catalogue: the next run starts over.
            _ => String::new(),
        };
        *self.node.audit.lock().unwrap_or_else(|e| e.into_inner()) = next;
        codes.extend(page);
        // The shown vouchers' verdict series are kept fresh (gauges nobody sets leave the page).
        codes.extend(self.node.spotlight.shown());
        let mut codes: Vec<String> = codes.into_iter().collect();
        codes.sort();
        let mut unbalanced = Vec::new();
        let mut failed = None;
        for page in codes.chunks(RECOUNT_PAGE) {
            match recount(&self.node.ledger, page, |c| self.node.spotlight.shows(c)).await {
                Ok(r) => {
                    unbalanced.extend(r.unbalanced);
                    if !r.unread.is_empty() {
                        // Those of a shard that did not answer: at the next run.
                        r.unread.iter().for_each(|c| self.node.changed(c));
                        taken.failed();
                    }
                }
                Err(e) => {
                    // This page at the next run; the next pages are tried still (with shards,
                    // a page whose vouchers are all on a shard that is down says nothing of
                    // the others; a ledger that is down refuses them at once, its breaker
                    // open).
                    page.iter().for_each(|c| self.node.changed(c));
                    taken.failed();
                    failed.get_or_insert(e);
                }
            }
        }
        drop(taken);
        self.node.pace.spent(Instant::now(), started.elapsed());
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(unbalanced),
        }
    }
}

/// What a recount found: the vouchers whose books do not balance, and those it could not read
/// (their shard did not answer: to be recounted again).
struct Recounted {
    unbalanced: Vec<String>,
    unread: Vec<String>,
}

/// Recounts `codes` (at most [`RECOUNT_PAGE`] of them: one read of each table) and records each
/// verdict (a series of its own only for a voucher `shown` on `/metrics`). The reconciler runs
/// it for what changed and its audit, and the live numbers the moment a voucher sells out here.
/// An error when nothing could be read (with shards: when none of theirs answered, or one
/// answered with an error of the database's).
async fn recount(
    ledger: &SharedLedger,
    codes: &[String],
    shown: impl Fn(&str) -> bool,
) -> Result<Recounted, LedgerError> {
    let (counters, unread) = ledger.counters_each(codes).await?;
    let mut unbalanced = Vec::new();
    for (code, c) in codes.iter().zip(counters) {
        let Some(c) = c else { continue };
        m::reconciled(code, &c, shown(code));
        if !c.balanced {
            tracing::error!(code = %code, counters = ?c, "ledger does not balance");
            unbalanced.push(code.clone());
        }
    }
    Ok(Recounted {
        unbalanced,
        unread: unread
            .into_iter()
            .filter_map(|p| codes.get(p).cloned())
            .collect(),
    })
}

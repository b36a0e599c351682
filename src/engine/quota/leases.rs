//! Units: grants and the verdicts of empty ones (waiting for a recall, dry, sold out with its
//! winners), renewals, returns, the leases a lost answer may have left, and the tick that drives
//! every timer.

use super::*;

impl<R, W> VoucherCore<R, W> {
    /// Stops serving from leases that are used up or too close to expiry (the node must stop
    /// before a reaper may take the lease); units left in expiring ones are handed back.
    pub(super) fn drop_unservable_leases(&mut self) {
        let (now, safety) = (self.now, self.settings.lease_safety_ms);
        self.give_back_leases(LeaseEvent::Lost, |l| {
            l.room() > 0 && l.expires_at - safety > now
        });
    }

    /// Stops serving from every lease `keep` rejects (never one a batch in flight draws on) and
    /// hands their unused units back to `free`.
    pub(super) fn give_back_leases(
        &mut self,
        event: LeaseEvent,
        keep: impl Fn(&LocalLease) -> bool,
    ) {
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

    pub(super) fn give_back(&mut self, lease_id: i64) {
        self.returning.push(lease_id);
        self.shared.mark_changed();
        self.out.push(Command::Return {
            lease_id,
            now: self.now,
        });
    }

    pub(super) fn hold_for(&mut self, hold: Hold, ms: Millis) {
        self.hold = Some((hold, self.now + ms));
    }

    pub(super) fn start_grant(&mut self) {
        let now = self.now;
        let rate = self.rate.per_sec(now);
        let waiting = (self.pending.len() as i64 - self.room()).max(0) as usize;
        let mut want = block_size(&self.sizing, rate, waiting, self.free_hint);
        if let (true, Some(cap)) = (self.before_start(), self.prestart_cap) {
            want = want.min((cap - self.room()).max(1));
        }
        self.grant_asked();
        self.out.push(Command::Grant {
            want,
            now,
            ttl_ms: self.settings.lease_ttl_ms,
        });
    }

    /// A grant goes out now (alone, or in the first call): what the answer is judged against.
    pub(super) fn grant_asked(&mut self) {
        self.granting = Some(Asked {
            epoch: self.shared.restock_epoch(),
            landed: self.landed,
        });
        self.shared.mark_changed();
    }

    pub(super) fn on_granted(&mut self, res: Result<Grant, LedgerError>) {
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
                    self.shared.count_empty_grant();
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
    pub(super) fn announced(&self, v: Verdict) -> bool {
        self.shared.is_sold_out()
            && v.ever_reserved.is_some()
            && v.ever_reserved == self.sold_out_at
    }

    /// The winners of a sold-out verdict are in: raise the flag (unless units came back
    /// meanwhile) and announce it.
    pub(super) fn on_winners(
        &mut self,
        verdict: Verdict,
        res: Result<Vec<(String, i64)>, LedgerError>,
    ) {
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

    /// Returns every lease no batch in flight draws on (those follow when their batches land).
    pub(super) fn return_idle_leases(&mut self) {
        self.recall_pending = !self.committing.is_empty();
        self.give_back_leases(LeaseEvent::Recalled, |_| false);
    }

    /// The periodic chores: renewal, idle return, the sold-out probe, voucher refresh and idle
    /// stop. False when the core stops.
    pub(super) fn tick(&mut self) -> bool {
        let now = self.now;
        if self.stopping {
            return false;
        }
        // The definition is re-read at most once a second while the voucher is asked for (edits
        // made on another node reach this one even without Redis), and only if it was asked
        // for since the last read; a core nobody asks reads nothing: the ledger refuses what a
        // stale definition would admit (paused, ended), and the next reserve makes the next
        // tick read it again.
        let asked = self.last_seen() > self.read_at;
        if now >= self.next_refresh && (self.voucher.is_some() || self.missing) && asked {
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
        let stop_after = self.stop_after();
        // A voucher warmed ahead of its start keeps its lease until then: idleness counts from
        // the start.
        let waiting_for_start = match (&self.voucher, self.warmed) {
            (Some(v), true) => v.starts_at,
            _ => Millis::MIN,
        };
        let idle = now - self.last_activity.max(waiting_for_start);
        // Reserves the frontend answered from the sold-out flag count as traffic: an actor whose
        // voucher is flooded after selling out stays, with its flag and winners.
        let unseen = now - self.last_seen();
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

    pub(super) fn renew_if_due(&mut self) {
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
    pub(super) fn on_found(&mut self, res: Result<Vec<i64>, LedgerError>) {
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
    pub(super) fn knows(&self, id: i64) -> bool {
        self.leases.iter().any(|l| l.id == id)
            || self.committing.iter().any(|b| b.lease_id == id)
            || self.returning.contains(&id)
            || self.unreturned.contains(&id)
    }

    pub(super) fn return_orphans(&mut self, ids: Vec<i64>) {
        for id in ids {
            if !self.knows(id) {
                tracing::warn!(code = %self.code, lease_id = id, "returning a lease no grant answer gave");
                self.stats.push(Stat::Lease(LeaseEvent::Returned));
                self.give_back(id);
            }
        }
    }

    pub(super) fn on_renewed(&mut self, res: Result<Vec<i64>, LedgerError>) {
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

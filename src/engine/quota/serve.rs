//! Serving reserves: admission against the voucher's definition, the queue, batches on the
//! leases and their commits, and the lookups that answer what no unit can serve (retries of
//! stored orders, refusals with DESIGN §4's precedence).

use super::*;

impl<R, W> VoucherCore<R, W> {
    pub(super) fn on_reserve(&mut self, req: ReserveRequest, reply: R) {
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

    pub(super) fn on_warm(&mut self, w: W) {
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
    pub(super) fn before_start(&self) -> bool {
        self.voucher
            .as_ref()
            .is_some_and(|v| self.now < v.starts_at)
    }

    /// Takes a (new) definition of the voucher; the frontend's copy follows.
    pub(super) fn set_voucher(&mut self, v: Voucher) {
        self.shared.set_voucher(&v);
        self.voucher = Some(v);
    }

    /// Takes a definition; the first one also admits the reserves queued before it (they were
    /// not checked for eligibility yet), whether it came from the first read or a reload.
    pub(super) fn take_definition(&mut self, v: Voucher) {
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
    pub(super) fn fail_all(&mut self, err: EngineError) {
        self.let_go_all(Some(err));
    }

    /// Every waiter leaves: answered `err`, or, with `None`, handed back unanswered (a warm-up
    /// waiter is told `503` either way).
    pub(super) fn let_go_all(&mut self, err: Option<EngineError>) {
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

    /// The core's first call, made with its first event. A reserve (that the switches let
    /// through) asks for the definition and a first lease together ([`Command::Open`]): the
    /// first reserve on a cold voucher waits for one round of the node's merged calls instead
    /// of a read's and then a grant's. Anything else reads the definition alone.
    pub(super) fn first_call(&mut self, event: &Event<R, W>) {
        let amount = match event {
            // Not while a failed call holds the core down: a plain read, then the pump's grant.
            Event::Reserve(req, _)
                if self.gate == Gate::Open
                    && !self.draining
                    && !matches!(self.hold, Some((Hold::Down, until)) if self.now < until) =>
            {
                req.order_amount
            }
            _ => {
                self.out.push(Command::ReadVoucher { first: true });
                return;
            }
        };
        let want = block_size(&self.sizing, self.rate.per_sec(self.now), 1, None);
        self.grant_asked();
        self.out.push(Command::Open {
            want,
            now: self.now,
            ttl_ms: self.settings.lease_ttl_ms,
            amount,
        });
    }

    /// The answer to the first call: the definition as a first read's, then the grant (if one
    /// was asked) as any grant's answer. A failed call may have granted with its answer lost:
    /// it counts as a failed grant first (its listing returns such a lease), then as a failed
    /// first read, which keeps the core until that listing ran.
    pub(super) fn on_opened(&mut self, res: Result<Opened, LedgerError>) {
        match res {
            Ok(Opened { voucher, grant }) => {
                self.on_loaded(Ok(voucher));
                match grant {
                    Some(g) => self.on_granted(g),
                    None => {
                        // Leases a listing found while this call was out are settled as any
                        // grant answer settles them: none of them is this call's.
                        self.granting = None;
                        let suspects = std::mem::take(&mut self.suspects);
                        self.return_orphans(suspects);
                    }
                }
            }
            Err(e) => {
                let e = Arc::new(e);
                self.on_granted(Err(LedgerError::CommitFailed(e.clone())));
                self.on_loaded(Err(LedgerError::CommitFailed(e)));
            }
        }
    }

    pub(super) fn on_loaded(&mut self, res: Result<Option<Voucher>, LedgerError>) {
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
                let settling = self.orphan_check.is_some()
                    || self.finding
                    || !self.suspects.is_empty()
                    || !self.returning.is_empty()
                    || !self.unreturned.is_empty();
                if settling {
                    // A failed first call may have granted a lease with its answer lost: the
                    // core stays until its listing has found and returned it, and the return
                    // was answered (a stopped core would leave it to the reaper for up to a
                    // lease TTL); its next reserve or warm-up makes the first call again.
                    self.called = false;
                    self.call_again = true;
                } else {
                    self.stopping = true;
                    self.out.push(Command::Stop);
                }
            }
        }
    }

    /// Queues a reserve that passed eligibility, or answers it at once.
    pub(super) fn admit(&mut self, p: Pending<R>) {
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
    pub(super) fn pump(&mut self) {
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

    /// Sends the next batch to the node's group committer; false when there is nothing to send.
    pub(super) fn start_batch(&mut self) -> bool {
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
        self.committing.push(InFlightBatch {
            id,
            lease_id,
            taken,
        });
        self.shared.mark_changed();
        self.out.push(Command::Commit { id, batch });
        true
    }

    pub(super) fn on_committed(&mut self, id: u64, res: Result<Vec<RowOutcome>, LedgerError>) {
        let Some(i) = self.committing.iter().position(|b| b.id == id) else {
            return;
        };
        let InFlightBatch {
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

    /// Reserves no unit serves (none left, or the voucher refuses new orders now) can still be
    /// retries of stored orders: one ledger lookup at a time for all of them, answered with
    /// DESIGN §4's precedence.
    pub(super) fn answer_without_units(&mut self) {
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

    pub(super) fn on_looked_up(
        &mut self,
        res: Result<Vec<Result<Reserved, EngineError>>, LedgerError>,
    ) {
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

    /// Re-reads the voucher's definition from the ledger.
    pub(super) fn refresh_voucher(&mut self) {
        self.next_refresh = self.now + VOUCHER_REFRESH_MS;
        self.read_at = self.now;
        self.out.push(Command::ReadVoucher { first: false });
    }
}

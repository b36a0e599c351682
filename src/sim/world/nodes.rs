//! The nodes: the cores' events and commands, the ledger calls with their faults, signals
//! between nodes, heartbeats, crashes and restarts, switches and operators' changes.

use super::*;
use crate::ledger::OpenAsk;

impl World {
    /// Hands an event to a core and carries out its commands.
    pub(super) fn feed(&mut self, n: usize, v: usize, event: Event<Tag, ()>) {
        let (now, gate) = (self.node_now(n), self.nodes[n].gate);
        if !self.nodes[n].cores.contains_key(&v) {
            return;
        }
        if self.trace.is_some() {
            let what = event_name(&event);
            let code = self.vouchers[v].code.clone();
            self.note(|| format!("node {n} {code} <- {what}"));
        }
        if let Some(slot) = self.nodes[n].cores.get_mut(&v) {
            slot.core.handle(now, gate, event);
        }
        self.carry_out(n, v);
    }

    pub(super) fn carry_out(&mut self, n: usize, v: usize) {
        let inc = self.nodes[n].inc;
        let mut stopped = false;
        loop {
            let Some(slot) = self.nodes[n].cores.get_mut(&v) else {
                return;
            };
            let slot_id = slot.id;
            let commands: Vec<_> = slot.core.commands().collect();
            // The simulator keeps no metrics.
            slot.core.stats().for_each(drop);
            if commands.is_empty() {
                break;
            }
            for command in commands {
                if self.trace.is_some() {
                    let what = command_name(&command);
                    let code = self.vouchers[v].code.clone();
                    self.note(|| format!("node {n} {code} -> {what}"));
                }
                match command {
                    Command::Answer((client, attempt), reply) => {
                        self.reply(n, client, attempt, reply, false)
                    }
                    Command::AnswerWarm(..) | Command::RecountSoon => {}
                    // Only a core torn down unasked hands back, and the simulation tears none
                    // down that way (a crash drops a node's cores whole): its client's deadline
                    // would send the reserve again.
                    Command::HandBack(_) => {}
                    Command::Publish(signal) => self.publish(n, v, signal),
                    Command::Stop => {
                        stopped = true;
                        let (now, gate) = (self.node_now(n), self.nodes[n].gate);
                        if let Some(slot) = self.nodes[n].cores.get_mut(&v) {
                            slot.core.handle(now, gate, Event::Stopped);
                        }
                    }
                    call => {
                        let d = self.hop();
                        self.at(
                            d,
                            Job::AtLedger {
                                node: n,
                                inc,
                                voucher: v,
                                core: slot_id,
                                call,
                            },
                        );
                    }
                }
            }
        }
        if stopped {
            self.nodes[n].cores.remove(&v);
        }
    }

    /// A core's call at the ledger: it may fail before it applies, apply and lose its answer,
    /// or answer late. A crashed process's calls still apply (they were sent); their answers
    /// find nobody.
    pub(super) fn at_ledger(
        &mut self,
        n: usize,
        inc: i64,
        core: u64,
        v: usize,
        call: Command<Tag, ()>,
    ) -> Result<(), Finding> {
        // A shard that is down fails every call to it (drawn first: the draws stay the same);
        // with several shards a commit claims its orders on the first shard before its own, so
        // the first one down fails every commit.
        let claims_down =
            matches!(call, Command::Commit { .. }) && self.shards.len() > 1 && self.shard_down(0);
        let fail_before = self.fault(Fault::LedgerFail, 2)
            | self.shard_down(self.vouchers[v].shard)
            | claims_down;
        let lose_answer = self.fault(Fault::LedgerLost, 2);
        let mut delay = self.hop();
        if self.shard_slow(v) {
            delay += self.srng.range(100, 1500);
        }
        let slow = self.draw(50, 3000);
        let late = self.fault(Fault::LedgerSlow, 3);
        if late {
            delay += slow;
        }
        // The committer's deadline passes while the transaction runs: the batch is answered
        // 503 at once and commits later (or is fenced then).
        let late_commit = self.fault(Fault::LedgerSlow, 2);
        if fail_before || lose_answer || late || late_commit {
            self.out.faults_injected += 1;
        }
        let holder = holder_name(&self.nodes[n].name, inc);
        let code = self.vouchers[v].code.clone();
        let ledger = self.ledger_of(v);
        let event = match call {
            Command::ReadVoucher { first } => Event::VoucherRead {
                first,
                res: attempt(fail_before, || ready(ledger.voucher(&code))),
            },
            Command::Commit { id, batch } if late_commit && !fail_before => {
                self.at(slow, Job::LateCommit { voucher: v, batch });
                Event::Committed {
                    id,
                    res: Err(failed()),
                }
            }
            Command::Commit { id, batch } => Event::Committed {
                id,
                res: attempt(fail_before, || {
                    let res = ready(ledger.commit_batch(&batch));
                    self.books.stored(&res, self.now);
                    res
                }),
            },
            Command::Open {
                want,
                now,
                ttl_ms,
                amount,
            } => {
                let ask = OpenAsk::new(code.clone(), holder.clone(), want, now, ttl_ms, amount);
                Event::Opened(attempt(fail_before, || ready(ledger.open(&ask))))
            }
            Command::Grant { want, now, ttl_ms } => Event::Granted(attempt(fail_before, || {
                ready(ledger.grant(&code, &holder, want, now, ttl_ms))
            })),
            Command::FindLeases => Event::Found(attempt(fail_before, || {
                ready(ledger.active_leases(&code, &holder))
            })),
            Command::Renew {
                lease_ids,
                now,
                ttl_ms,
            } => Event::Renewed(attempt(fail_before, || {
                ready(ledger.renew(&lease_ids, &holder, now, ttl_ms))
            })),
            Command::Lookup {
                reqs,
                voucher,
                now,
                gate,
            } => Event::LookedUp(attempt(fail_before, || {
                ready(settle_without_units(
                    &ledger,
                    &code,
                    voucher.as_ref(),
                    now,
                    &reqs,
                    gate,
                ))
            })),
            Command::LoadWinners(verdict) => Event::WinnersLoaded(
                verdict,
                attempt(fail_before, || ready(ledger.won_orders(&code))),
            ),
            Command::Return { lease_id, now } => {
                let alive = self.nodes[n].inc == inc && self.nodes[n].up;
                let ok = !fail_before
                    && match ready(ledger.return_lease(lease_id, now)) {
                        Ok(Some(r)) if alive => {
                            self.restocked(n, r);
                            true
                        }
                        Ok(_) => true,
                        Err(_) => false,
                    };
                Event::Returned {
                    lease_id,
                    ok: ok && !lose_answer,
                }
            }
            _ => return Ok(()),
        };
        self.check_voucher(v)?;
        let event = if lose_answer { lost(event) } else { event };
        self.at(
            delay,
            Job::Deliver {
                node: n,
                inc,
                voucher: v,
                core,
                event,
            },
        );
        Ok(())
    }

    pub(super) fn check_voucher(&mut self, v: usize) -> Result<(), Finding> {
        self.out.checks += 1;
        check::balanced(&self.ledger_of(v), &self.vouchers[v].code, self.model_of(v))
    }

    /// Units went back to `free` on node `n`: its own flag comes down, and the cluster hears.
    pub(super) fn restocked(&mut self, n: usize, r: Restock) {
        let Some(v) = self.vouchers.iter().position(|x| x.code == r.voucher_code) else {
            return;
        };
        self.apply_restock(n, v);
        self.publish(n, v, Signal::Restock);
    }

    pub(super) fn apply_restock(&mut self, n: usize, v: usize) {
        if let Some(slot) = self.nodes[n].cores.get(&v) {
            slot.shared.restock();
            self.feed(n, v, Event::Restocked);
        }
    }

    /// A signal through Redis to every other node: dropped, late, doubled, as the faults say.
    pub(super) fn publish(&mut self, from: usize, v: usize, signal: Signal) {
        if !self.calm && self.now < self.redis_down_until {
            return;
        }
        for node in (0..self.nodes.len()).filter(|&m| m != from) {
            let dropped = self.fault(Fault::SignalDrop, 5);
            let copies = if self.fault(Fault::SignalDup, 5) {
                2
            } else {
                1
            };
            let gap = self.draw(10, 500);
            if dropped {
                // Lost at the receiver: its link broke (a full output buffer, a reset), it
                // notices and links again. (Lost at the sender, no one notices: flags rest on
                // their probes then; not simulated.)
                self.out.faults_injected += 1;
                self.unlink(node, gap);
                continue;
            }
            for _ in 0..copies {
                let mut d = self.rng.range(1, 5);
                let late = self.draw(50, 1500);
                if self.fault(Fault::SignalDelay, 10) {
                    d += late;
                }
                if signal == Signal::Restock {
                    let now = self.now;
                    let (until, since) = self.restock_on_way.entry((node, v)).or_insert((0, 0));
                    if *until <= now {
                        *since = now;
                    }
                    *until = (*until).max(now + d);
                }
                self.at(
                    d,
                    Job::Signal {
                        node,
                        voucher: v,
                        signal,
                    },
                );
            }
        }
    }

    pub(super) fn signal_arrives(&mut self, n: usize, v: usize, signal: Signal) {
        if !self.nodes[n].up {
            return;
        }
        let code = self.vouchers[v].code.clone();
        self.note(|| format!("node {n} {code} hears {signal:?}"));
        match signal {
            Signal::Restock => self.apply_restock(n, v),
            Signal::SoldOut => self.feed(n, v, Event::SoldOutElsewhere),
            Signal::Recall => self.feed(n, v, Event::Recall),
            Signal::Updated => {
                if let Ok(Some(voucher)) = self.on_voucher(v, |l| ready(l.voucher(&code))) {
                    self.feed(n, v, Event::Reload(voucher));
                }
            }
            Signal::Switches | Signal::Warm => {}
        }
    }

    /// The node's jobs: its heartbeat (reaping the dead holders it reports), the lease reaper
    /// and the expiry sweep.
    /// As on PostgreSQL: liveness is judged on the ledger's clock, and the node's clock follows
    /// the ledger's at every beat (a clock that jumped is right again after one beat, unless
    /// beats fail or the process is paused).
    pub(super) fn beat(&mut self, n: usize) -> Result<(), Finding> {
        let holder = holder_name(&self.nodes[n].name, self.nodes[n].inc);
        if let Ok(switches) = self.on_first(|l| ready(l.switches())) {
            self.apply_switches(n, switches);
        }
        let mut restocks = Vec::new();
        if self.fault(Fault::LedgerFail, 5) {
            // The beat's call failed: this holder looks silent for one beat more.
            self.out.faults_injected += 1;
            return Ok(());
        }
        // As the sharded ledger beats: on every shard that is up, the first shard's clock, the
        // holders dead on any shard that answered (each shard judging by its own beats),
        // reaped on every shard that is up. The first shard must answer.
        let mut dead = std::collections::BTreeSet::new();
        let up: Vec<usize> = (0..self.shards.len())
            .filter(|s| !self.shard_down(*s))
            .collect();
        // Every shard that is up records the beat; the clock and the dead come only with the
        // first shard's answer (as the sharded ledger's beat fails without it).
        let mut first = None;
        for &s in &up {
            let beat = ready(
                self.shards[s]
                    .ledger
                    .heartbeat(&holder, self.now, DEAD_AFTER_MS),
            );
            match (s, beat) {
                (0, Ok(beat)) => first = Some(beat),
                (_, Ok(beat)) => dead.extend(beat.dead),
                _ => {}
            }
        }
        if let Some(beat) = first {
            self.nodes[n].skew = beat.ledger_ms - self.now;
            dead.extend(beat.dead);
            let now = self.node_now(n);
            for dead in dead {
                self.note(|| format!("node {n} reaps {dead}"));
                for &s in &up {
                    let reaped = ready(self.shards[s].ledger.reap_holder(&dead, now));
                    restocks.extend(reaped.unwrap_or_default());
                }
            }
        }
        let now = self.node_now(n);
        for &s in &up {
            let ledger = self.shards[s].ledger.clone();
            restocks.extend(ready(ledger.reap_expired(now)).unwrap_or_default());
            restocks.extend(ready(ledger.expire_due(now, 100)).unwrap_or_default());
        }
        for r in restocks {
            self.restocked(n, r);
        }
        for v in 0..self.vouchers.len() {
            self.check_voucher(v)?;
        }
        Ok(())
    }

    /// Node `n`'s subscription ends; it is back after `ms`.
    pub(super) fn unlink(&mut self, n: usize, ms: Millis) {
        self.note(|| format!("node {n} loses its signal link"));
        self.nodes[n].linked = false;
        self.at(ms, Job::Relink(n));
    }

    /// What `EngineHandle::signals_link(true)` does: every flag unconfirmed until its probe.
    pub(super) fn relink(&mut self, n: usize) {
        if !self.nodes[n].up || self.nodes[n].linked {
            return;
        }
        if self.now < self.redis_down_until && !self.calm {
            let wait = self.redis_down_until - self.now;
            self.at(wait, Job::Relink(n));
            return;
        }
        self.note(|| format!("node {n} links again"));
        for slot in self.nodes[n].cores.values() {
            slot.shared.unverify();
        }
        self.nodes[n].linked = true;
    }

    /// What `Core::apply_switches` does: a read older than what the node holds changes nothing.
    pub(super) fn apply_switches(&mut self, n: usize, s: Switches) {
        let node = &mut self.nodes[n];
        if s.version < node.switch_version {
            return;
        }
        node.switch_version = s.version;
        node.gate = if s.read_only {
            Gate::ReadOnly
        } else if s.sales_paused {
            Gate::SalesPaused
        } else {
            Gate::Open
        };
        let gate = node.gate;
        self.note(|| format!("node {n} switches {gate:?}"));
    }

    pub(super) fn crash(&mut self, n: usize) {
        if self.calm || !self.nodes[n].up {
            return;
        }
        self.out.faults_injected += 1;
        self.note(|| format!("node {n} crashes"));
        let node = &mut self.nodes[n];
        node.up = false;
        node.cores.clear();
        let back = self.rng.range(50, 5000);
        self.at(back, Job::Restart(n));
    }

    pub(super) fn restart(&mut self, n: usize) {
        if self.nodes[n].up {
            return;
        }
        let now = self.node_now(n);
        let name = self.nodes[n].name.clone();
        let Ok(inc) = self.register_node(&name, now) else {
            // A node cannot start while the first shard is down: tried again once it is back.
            if self.shard_down(0) {
                let back = self.shards[0].down_until - self.now + 1;
                self.at(back, Job::Restart(n));
            }
            return;
        };
        self.note(|| format!("node {n} restarts as {}", inc.holder));
        let node = &mut self.nodes[n];
        node.inc = inc.number;
        node.up = true;
        node.linked = false;
        self.at(0, Job::Relink(n));
        let node = &mut self.nodes[n];
        node.switch_version = 0;
        if let Ok(s) = self.on_first(|l| ready(l.switches())) {
            self.apply_switches(n, s);
        }
        self.at(
            0,
            Job::Tick {
                node: n,
                inc: inc.number,
            },
        );
        self.at(
            0,
            Job::Beat {
                node: n,
                inc: inc.number,
            },
        );
    }

    /// An operator or a customer acts: pause or resume sales, raise a total, release an order.
    pub(super) fn admin(&mut self) -> Result<(), Finding> {
        if self.calm {
            return Ok(());
        }
        let n = self.rng.pick(self.nodes.len());
        let v = self.rng.pick(self.vouchers.len());
        let code = self.vouchers[v].code.clone();
        let op = self.rng.pick(4);
        let next = self.rng.range(100, 2000);
        self.at(next, Job::Admin);
        // An operator's or customer's call goes through a running process (HTTP): a crashed
        // or paused one takes none.
        if !self.nodes[n].up || self.nodes[n].paused_until > self.now {
            return Ok(());
        }
        match op {
            0 if self.faults.has(Fault::Switches) => {
                let paused = self.rng.chance(50);
                let patch = SwitchesPatch {
                    sales_paused: Some(paused),
                    read_only: None,
                };
                self.out.faults_injected += 1;
                let now = self.node_now(n);
                if let Ok(switches) = self.on_first(|l| ready(l.set_switches(&patch, now))) {
                    self.note(|| format!("sales paused: {paused} (every node)"));
                    for node in 0..self.nodes.len() {
                        let d = self.rng.range(0, 300);
                        self.at(d, Job::Switch { node, switches });
                    }
                }
            }
            1 if self.faults.has(Fault::Raise) => {
                let Ok(Some(old)) = self.on_voucher(v, |l| ready(l.voucher(&code))) else {
                    return Ok(());
                };
                let patch = VoucherPatch {
                    total_limit: Some(old.total_limit + self.rng.range(1, 10)),
                    ..VoucherPatch::default()
                };
                self.out.faults_injected += 1;
                let updated = self.on_voucher(v, |l| ready(l.update_voucher(&code, &patch)));
                if let Ok((voucher, restock)) = updated {
                    self.note(|| format!("{code} total raised to {}", voucher.total_limit));
                    self.feed(n, v, Event::Reload(voucher));
                    self.publish(n, v, Signal::Updated);
                    if let Some(r) = restock {
                        self.restocked(n, r);
                    }
                }
                self.check_voucher(v)?;
            }
            2 if self.faults.has(Fault::Release) => {
                let Some(order) = self.books.pick_acked(&mut self.rng, &code) else {
                    return Ok(());
                };
                self.out.faults_injected += 1;
                let now = self.node_now(n);
                let released = self.on_voucher(v, |l| ready(l.release(&code, &order, now)));
                if let Ok((_, restock)) = released {
                    self.note(|| format!("{code} {order} released"));
                    self.books.released(&order);
                    if let Some(r) = restock {
                        self.restocked(n, r);
                    }
                }
                self.check_voucher(v)?;
            }
            3 if self.faults.has(Fault::Confirm) => {
                let Some(order) = self.books.pick_acked(&mut self.rng, &code) else {
                    return Ok(());
                };
                let now = self.node_now(n);
                if self
                    .on_voucher(v, |l| ready(l.confirm(&code, &order, now)))
                    .is_ok()
                {
                    self.note(|| format!("{code} {order} confirmed"));
                }
                self.check_voucher(v)?;
            }
            _ => {}
        }
        Ok(())
    }
}

/// `call`'s answer, or the failure its caller sees when the call `fails` before it applies.
pub(super) fn attempt<T>(
    fails: bool,
    call: impl FnOnce() -> Result<T, LedgerError>,
) -> Result<T, LedgerError> {
    if fails {
        Err(failed())
    } else {
        call()
    }
}

/// A ledger call that failed (or whose answer was lost), as its caller sees it.
pub(super) fn failed() -> LedgerError {
    LedgerError::Deadline
}

/// The same answer, lost on the way back: the call applied, the caller sees a failure.
pub(super) fn lost(event: Event<Tag, ()>) -> Event<Tag, ()> {
    match event {
        Event::VoucherRead { first, .. } => Event::VoucherRead {
            first,
            res: Err(failed()),
        },
        Event::Committed { id, .. } => Event::Committed {
            id,
            res: Err(failed()),
        },
        Event::Granted(_) => Event::Granted(Err(failed())),
        Event::Opened(_) => Event::Opened(Err(failed())),
        Event::Renewed(_) => Event::Renewed(Err(failed())),
        Event::Found(_) => Event::Found(Err(failed())),
        Event::Returned { lease_id, .. } => Event::Returned {
            lease_id,
            ok: false,
        },
        Event::LookedUp(_) => Event::LookedUp(Err(failed())),
        Event::WinnersLoaded(v, _) => Event::WinnersLoaded(v, Err(failed())),
        other => other,
    }
}

//! The customers: new clients, their sends, what the frontend and the core answer them (checked
//! against the books as they arrive), their retries, and the calm phase's demand and liveness.

use super::*;

impl World {
    pub(super) fn new_client(&mut self, voucher: usize, customer: i64) -> usize {
        let c = self.clients.len();
        self.clients.push(Client {
            voucher,
            customer,
            order: format!("o{c}"),
            attempt: 0,
            outstanding: None,
            done: false,
            resends: 0,
            arrive_skew: 0,
        });
        c
    }

    pub(super) fn send(&mut self, c: usize) {
        let client = &mut self.clients[c];
        if client.done || client.outstanding.is_some() {
            return;
        }
        client.attempt += 1;
        let attempt = client.attempt;
        let node = self.rng.pick(self.nodes.len());
        self.clients[c].outstanding = Some((node, self.now));
        self.out.reserves += 1;
        let d = self.hop();
        self.at(
            d,
            Job::Arrive {
                node,
                client: c,
                attempt,
            },
        );
        self.at(REQUEST_TIMEOUT_MS, Job::Deadline { client: c, attempt });
    }

    /// Creates the voucher's core on `node` if it has none.
    pub(super) fn slot(&mut self, n: usize, v: usize) {
        if self.nodes[n].cores.contains_key(&v) {
            return;
        }
        let shared = Arc::new(VoucherShared::default());
        let core = Core::new(
            self.vouchers[v].code.clone(),
            self.settings.clone(),
            self.sizing,
            shared.clone(),
            self.node_now(n),
        );
        self.cores_made += 1;
        let id = self.cores_made;
        self.nodes[n].cores.insert(v, Slot { core, shared, id });
        self.carry_out(n, v);
    }

    /// A reserve reaches a node's frontend: the sold-out flag first, then the core.
    pub(super) fn arrive(&mut self, n: usize, c: usize, attempt: u32) -> Result<(), Finding> {
        let (v, customer, order) = {
            let cl = &self.clients[c];
            (cl.voucher, cl.customer, cl.order.clone())
        };
        if !self.nodes[n].up {
            self.reply(n, c, attempt, Err(EngineError::Unavailable), false);
            return Ok(());
        }
        self.clients[c].arrive_skew = self.nodes[n].skew.abs();
        let req = ReserveRequest {
            customer_id: customer,
            order_id: order,
            order_amount: self.order_amount,
        };
        self.slot(n, v);
        let (now, gate) = (self.node_now(n), self.nodes[n].gate);
        let shared = self.nodes[n].cores[&v].shared.clone();
        if self.nodes[n].linked && shared.trusted(now, self.settings.soldout_probe_ms) {
            shared.count_short_circuit(now);
            let answer = match answer_from_flag(shared.sold_out_verdict(now, &req), gate) {
                Some(a) => a,
                // Its shard down, or the first one (the claims' directory) with several: the
                // frontend answers 503 (that breaker refuses).
                None if self.shard_down(self.vouchers[v].shard)
                    || (self.shards.len() > 1 && self.shard_down(0)) =>
                {
                    Err(EngineError::Unavailable)
                }
                None => {
                    let voucher = shared.voucher();
                    let code = &self.vouchers[v].code;
                    let reqs = std::slice::from_ref(&req);
                    ready(settle_without_units(
                        &self.ledger_of(v),
                        code,
                        voucher.as_deref(),
                        now,
                        reqs,
                        gate,
                    ))
                    .map_err(EngineError::from)
                    .and_then(|mut a| a.pop().unwrap_or(Err(EngineError::OutOfStock)))
                }
            };
            let reply = answer;
            let code = self.vouchers[v].code.clone();
            self.note(|| format!("node {n} {code}: {} answered from the flag", req.order_id));
            // A RESTOCK was on its way here, published before the order was stored: the flag
            // could not know the unit it was sold from.
            let excused = matches!(reply, Err(EngineError::OutOfStock))
                && self
                    .restock_on_way
                    .get(&(n, v))
                    .is_some_and(|&(until, since)| {
                        self.now < until
                            && self
                                .books
                                .stored_at(&self.clients[c].order)
                                .is_some_and(|t| t >= since)
                    });
            self.reply(n, c, attempt, reply, excused);
            return Ok(());
        }
        self.feed(n, v, Event::Reserve(req, (c, attempt)));
        Ok(())
    }

    /// Sends an answer back to the client, one hop away.
    pub(super) fn reply(
        &mut self,
        n: usize,
        client: usize,
        attempt: u32,
        reply: Reply,
        excused: bool,
    ) {
        let d = self.hop();
        let skew = self.nodes[n].skew.abs();
        self.at(
            d,
            Job::Answer {
                client,
                attempt,
                reply,
                excused,
                skew,
            },
        );
    }

    pub(super) fn answered(
        &mut self,
        c: usize,
        attempt: u32,
        reply: Reply,
        excused: bool,
        skew: Millis,
    ) -> Result<(), Finding> {
        let client = &self.clients[c];
        let Some((_, sent)) = client.outstanding.filter(|_| client.attempt == attempt) else {
            // An answer after its deadline: the frontend had already answered 503.
            return Ok(());
        };
        self.clients[c].outstanding = None;
        let v = self.clients[c].voucher;
        let (code, per_user) = (self.vouchers[v].code.clone(), self.vouchers[v].per_user);
        self.out.checks += 1;
        // How far the node's clock may have been off when it decided (when the reserve arrived,
        // or when it answered), plus a tick.
        let skew = skew.max(self.clients[c].arrive_skew) + TICK_MS;
        let verdict = check::answer(
            &self.ledger_of(v),
            &mut self.books,
            &self.clients[c].order,
            self.clients[c].customer,
            &code,
            per_user,
            &reply,
            sent,
            self.now,
            skew,
            excused,
        );
        if self.calm
            && sent >= self.quiet_at + CALM_GRACE_MS
            && matches!(reply, Err(EngineError::Unavailable))
        {
            let order = self.clients[c].order.clone();
            return Err((
                format!("liveness: {order} answered 503 after faults stopped"),
                Some(code),
            ));
        }
        if self.trace.is_some() {
            let order = self.clients[c].order.clone();
            self.note(|| format!("client {code} {order} gets {}", reply_name(&reply)));
        }
        verdict?;
        match reply {
            Err(EngineError::Unavailable) => {
                let d = self.rng.range(5, 300);
                self.at(d, Job::Send(c));
            }
            Err(EngineError::NotEligible(_)) if !self.calm => {
                let d = self.rng.range(100, 1000);
                self.at(d, Job::Send(c));
            }
            Ok(_) if self.clients[c].resends > 0 => {
                self.clients[c].resends -= 1;
                let d = self.rng.range(1, 3000);
                self.at(d, Job::Send(c));
            }
            _ => self.clients[c].done = true,
        }
        Ok(())
    }

    /// The frontend's timeout: `503`, and a liveness failure once faults stopped.
    pub(super) fn deadline(&mut self, c: usize, attempt: u32) -> Result<(), Finding> {
        let client = &self.clients[c];
        let Some((node, sent)) = client.outstanding.filter(|_| client.attempt == attempt) else {
            return Ok(());
        };
        if self.calm && sent >= self.calm_at && self.nodes[node].paused_until <= sent {
            let code = self.vouchers[client.voucher].code.clone();
            return Err((
                format!(
                    "liveness: {} of {code} on node {node} waited {REQUEST_TIMEOUT_MS} ms \
                     without an answer after faults stopped",
                    client.order
                ),
                Some(code),
            ));
        }
        self.answered(c, attempt, Err(EngineError::Unavailable), false, 0)
    }

    /// Faults stop: every process is up with a right clock, sales resume, the network is clean;
    /// new customers come for every voucher until it sells out.
    pub(super) fn calm_down(&mut self) {
        self.calm = true;
        self.note(|| "calm: faults stop".into());
        for s in &mut self.shards {
            (s.down_until, s.slow_until) = (0, 0);
        }
        for n in 0..self.nodes.len() {
            self.nodes[n].skew = 0;
            if !self.nodes[n].up {
                self.restart(n);
            }
        }
        let patch = SwitchesPatch {
            sales_paused: Some(false),
            read_only: None,
        };
        if let Ok(switches) = ready(self.shards[0].ledger.set_switches(&patch, self.now)) {
            for n in 0..self.nodes.len() {
                self.apply_switches(n, switches);
            }
        }
        for v in 0..self.vouchers.len() {
            self.at(0, Job::Demand(v));
        }
        // A paused process resumes when its pause ends; liveness counts from then.
        let quiet = self
            .nodes
            .iter()
            .map(|n| n.paused_until)
            .max()
            .unwrap_or(0)
            .max(self.now);
        self.quiet_at = quiet;
        self.at(quiet - self.now + LIVENESS_MS, Job::Liveness);
    }

    /// A new customer for voucher `v`, until it sells out.
    pub(super) fn demand(&mut self, v: usize) -> Result<(), Finding> {
        if self.vouchers[v].sold_at.is_some() {
            return Ok(());
        }
        let c = check::counters(&self.ledger_of(v), &self.vouchers[v].code)?;
        if c.reserved + c.confirmed == c.total_limit {
            self.vouchers[v].sold_at = Some(self.now);
            self.out.sold += c.total_limit;
            self.out.offered += c.total_limit;
            return Ok(());
        }
        let sv = &mut self.vouchers[v];
        sv.calm_clients += 1;
        let customer = 1_000_000 + sv.calm_clients as i64;
        let client = self.new_client(v, customer);
        self.at(0, Job::Send(client));
        let next = self.rng.range(1, 20);
        self.at(next, Job::Demand(v));
        Ok(())
    }

    pub(super) fn liveness(&mut self) -> Result<(), Finding> {
        for (i, v) in self.vouchers.iter().enumerate() {
            if v.sold_at.is_none() {
                let c = check::counters(&self.ledger_of(i), &v.code)?;
                self.out.sold += c.reserved + c.confirmed;
                self.out.offered += c.total_limit;
                return Err((
                    format!(
                        "liveness: {} sold {} of {} within {LIVENESS_MS} ms after faults stopped \
                         (free {}, unused in leases {}: (id, holder, unused, expires) {:?})",
                        v.code,
                        c.reserved + c.confirmed,
                        c.total_limit,
                        c.free,
                        c.leased_unused,
                        self.model_of(i).unused_leases(&v.code),
                    ),
                    Some(v.code.clone()),
                ));
            }
        }
        Ok(())
    }

    /// The round's last checks: every acknowledged order still in the ledger as it was
    /// answered, every voucher's books balanced and sold out.
    pub(super) fn finish(&mut self) -> Result<(), Finding> {
        for v in 0..self.vouchers.len() {
            self.check_voucher(v)?;
        }
        self.out.checks += 1;
        let ledgers: Vec<SharedLedger> = self.shards.iter().map(|s| s.ledger.clone()).collect();
        self.books.all_durable(&ledgers)
    }
}

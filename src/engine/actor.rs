//! `VoucherActor`: the actix home of one voucher's [`VoucherCore`] on this node. It is an
//! adapter and decides nothing: every message and every ledger answer becomes an [`Event`] for
//! the core (with the node's clock and switches), and every [`Command`] the core gives back is
//! carried out here: ledger calls as futures on the actor (their answers come back as events),
//! returns in the background, answers on the reserves' channels, signals to the cluster.
//!
//! The protocol itself, and its specification, are in [`super::quota`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;

use super::quota::{Command, Event, Reply, Stat, VoucherCore};
use super::soldout::VoucherShared;
use super::{outcome_of, settle_without_units, EngineError, Node};
use crate::clock::Millis;
use crate::domain::{ReserveRequest, Voucher};
use crate::ledger::OpenAsk;
use crate::metrics::{self as m, Outcome};

type ReplyTo = oneshot::Sender<Reply>;
type WarmTo = oneshot::Sender<Result<(), EngineError>>;

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Reserve {
    pub req: ReserveRequest,
    pub reply: ReplyTo,
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
pub(crate) struct Warm(pub WarmTo);

/// Another node saw the voucher sold out: if this node holds nothing, check with the ledger now
/// instead of waiting for the next request.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct SoldOutElsewhere;

/// Shutting down: stop serving.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Drain;

/// A return of this lease was answered (true) or failed.
#[derive(Message)]
#[rtype(result = "()")]
struct Returned(i64, bool);

/// Another node ran dry while this one may hold idle units (`RECALL`).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Recall;

/// Counts answered reserves by outcome; recorded once per batch of commands.
#[derive(Default)]
struct Tally(Vec<(Outcome, u64)>);

impl Tally {
    fn answer(&mut self, to: ReplyTo, reply: Reply) {
        let outcome = outcome_of(&reply);
        match self.0.iter_mut().find(|(o, _)| *o == outcome) {
            Some((_, n)) => *n += 1,
            None => self.0.push((outcome, 1)),
        }
        let _ = to.send(reply);
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        for (outcome, n) in self.0.drain(..) {
            m::reservations(outcome, n);
        }
    }
}

pub(crate) struct VoucherActor {
    code: String,
    node: Arc<Node>,
    /// Tells this actor's registry entry apart from a successor's when it leaves.
    generation: u64,
    core: VoucherCore<ReplyTo, WarmTo>,
    /// The core's next tick, as scheduled: when it is due (node clock) and its timer. A busy
    /// core ticks every [`super::quota::TICK_MS`]; a quiet one only when it would stop (see
    /// [`VoucherCore::next_tick_at`]), so thousands of idle actors cost no timer wake-ups.
    tick: Option<(Millis, SpawnHandle)>,
}

impl VoucherActor {
    pub(crate) fn new(
        code: String,
        node: Arc<Node>,
        shared: Arc<VoucherShared>,
        generation: u64,
    ) -> Self {
        let core = VoucherCore::new(
            code.clone(),
            node.settings.clone(),
            node.sizing,
            shared,
            node.clock.now_ms(),
        );
        Self {
            code,
            node,
            generation,
            core,
            tick: None,
        }
    }

    /// Hands `event` to the core, with the node's clock and switches, and carries out what it
    /// asks.
    fn feed(&mut self, event: Event<ReplyTo, WarmTo>, ctx: &mut Context<Self>) {
        let (now, gate) = (self.node.clock.now_ms(), self.node.gate());
        self.core.handle(now, gate, event);
        self.carry_out(ctx);
        self.schedule_tick(now, ctx);
    }

    /// Keeps a timer for the core's next tick: a new one when the core wants it sooner than
    /// the one set (a quiet core got busy), none once the core stopped.
    fn schedule_tick(&mut self, now: Millis, ctx: &mut Context<Self>) {
        if ctx.state() != ActorState::Running {
            return;
        }
        let at = self.core.next_tick_at();
        if self.tick.as_ref().is_some_and(|&(set, _)| set <= at) {
            return;
        }
        if let Some((_, old)) = self.tick.take() {
            ctx.cancel_future(old);
        }
        let wait = Duration::from_millis(at.saturating_sub(now).max(0) as u64);
        let handle = ctx.run_later(wait, |act, ctx| {
            act.tick = None;
            act.feed(Event::Tick, ctx);
        });
        self.tick = Some((at, handle));
    }

    /// Runs `call` on the ledger as a future of this actor; its answer becomes an event.
    fn call<F, T>(&self, ctx: &mut Context<Self>, call: F, event: fn(T) -> Event<ReplyTo, WarmTo>)
    where
        F: std::future::Future<Output = T> + 'static,
        T: 'static,
    {
        ctx.spawn(
            call.into_actor(self)
                .map(move |res, act, ctx| act.feed(event(res), ctx)),
        );
    }

    fn carry_out(&mut self, ctx: &mut Context<Self>) {
        for stat in self.core.stats() {
            match stat {
                Stat::Lease(event) => m::lease(event),
                Stat::GrantedUnits(units) => m::lease_granted_units(units),
                Stat::LedgerError(op) => m::ledger_error(op),
                Stat::QueueFull => m::mailbox_full(),
            }
        }
        let mut tally = Tally::default();
        let commands: Vec<_> = self.core.commands().collect();
        let (ledger, code) = (self.node.ledger.clone(), self.code.clone());
        for command in commands {
            let (ledger, code) = (ledger.clone(), code.clone());
            match command {
                Command::Answer(to, reply) => tally.answer(to, reply),
                Command::AnswerWarm(to, res) => {
                    let _ = to.send(res);
                }
                // Dropping the sender is the hand-back: `EngineHandle::reserve` sees the channel
                // close and asks the voucher's next actor.
                Command::HandBack(to) => drop(to),
                Command::ReadVoucher { first } => {
                    let read = async move { ledger.voucher(&code).await };
                    ctx.spawn(read.into_actor(self).map(move |res, act, ctx| {
                        act.feed(Event::VoucherRead { first, res }, ctx)
                    }));
                }
                Command::Open {
                    want,
                    now,
                    ttl_ms,
                    amount,
                } => {
                    let node = self.node.node_id.clone();
                    let ask = OpenAsk::new(code, node, want, now, ttl_ms, amount);
                    let open = async move { ledger.open(&ask).await };
                    self.call(ctx, open, Event::Opened);
                }
                Command::Commit { id, batch } => {
                    let commit = async move {
                        let started = Instant::now();
                        let res = ledger.commit_batch(&batch).await;
                        m::batch(batch.rows.len(), started.elapsed());
                        res
                    };
                    ctx.spawn(
                        commit
                            .into_actor(self)
                            .map(move |res, act, ctx| act.feed(Event::Committed { id, res }, ctx)),
                    );
                }
                Command::Grant { want, now, ttl_ms } => {
                    let node = self.node.node_id.clone();
                    let grant = async move { ledger.grant(&code, &node, want, now, ttl_ms).await };
                    self.call(ctx, grant, Event::Granted);
                }
                Command::FindLeases => {
                    let node = self.node.node_id.clone();
                    let find = async move { ledger.active_leases(&code, &node).await };
                    self.call(ctx, find, Event::Found);
                }
                Command::Renew {
                    lease_ids,
                    now,
                    ttl_ms,
                } => {
                    let node = self.node.node_id.clone();
                    let renew = async move { ledger.renew(&lease_ids, &node, now, ttl_ms).await };
                    self.call(ctx, renew, Event::Renewed);
                }
                Command::Return { lease_id, now } => {
                    spawn_return(&self.node, &self.code, ctx.address(), lease_id, now)
                }
                Command::Lookup {
                    reqs,
                    voucher,
                    now,
                    gate,
                } => {
                    let lookup = async move {
                        settle_without_units(&ledger, &code, voucher.as_ref(), now, &reqs, gate)
                            .await
                    };
                    self.call(ctx, lookup, Event::LookedUp);
                }
                Command::LoadWinners(verdict) => {
                    let load = async move { ledger.won_orders(&code).await };
                    ctx.spawn(load.into_actor(self).map(move |res, act, ctx| {
                        act.feed(Event::WinnersLoaded(verdict, res), ctx)
                    }));
                }
                Command::Publish(signal) => self.node.signals.publish(&self.code, signal),
                Command::RecountSoon => self.node.recount_soon(&self.code),
                Command::Stop => ctx.stop(),
            }
        }
    }
}

/// Hands a lease's unused units back to `free` in the background (it outlives a stopping actor;
/// the ledger makes it idempotent). A failure goes back to the actor, which tries again; once the
/// actor is gone, the reaper takes the lease.
fn spawn_return(
    node: &Arc<Node>,
    code: &str,
    actor: Addr<VoucherActor>,
    lease_id: i64,
    now: Millis,
) {
    let engine = node.clone();
    // Not on the actor's own arbiter: an actor torn down with its thread (an HTTP worker that
    // stopped) returns its leases from `stopped`, when that thread runs nothing more.
    node.background(code, async move {
        match engine.ledger.return_lease(lease_id, now).await {
            Ok(restock) => {
                if let Some(r) = restock {
                    engine.restocked(&r.voucher_code);
                }
                actor.do_send(Returned(lease_id, true));
            }
            Err(e) => {
                m::ledger_error(m::LedgerOp::ReturnLease);
                tracing::warn!(lease_id, error = %e, "lease return failed; retried at the next tick");
                actor.do_send(Returned(lease_id, false));
            }
        }
    });
}

impl Actor for VoucherActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.set_mailbox_capacity(self.node.settings.mailbox_capacity.max(16));
        self.carry_out(ctx);
        let now = self.node.clock.now_ms();
        self.schedule_tick(now, ctx);
    }

    fn stopped(&mut self, ctx: &mut Context<Self>) {
        self.feed(Event::Stopped, ctx);
        self.node.forget(&self.code, self.generation);
    }
}

/// Each message is one event of the core.
macro_rules! feeds {
    ($($msg:ty => |$m:ident| $event:expr;)*) => {$(
        impl Handler<$msg> for VoucherActor {
            type Result = ();

            fn handle(&mut self, $m: $msg, ctx: &mut Context<Self>) {
                self.feed($event, ctx);
            }
        }
    )*};
}

feeds! {
    Reserve => |msg| Event::Reserve(msg.req, msg.reply);
    Restocked => |_msg| Event::Restocked;
    Reload => |msg| Event::Reload(msg.0);
    Warm => |msg| Event::Warm(msg.0);
    Recall => |_msg| Event::Recall;
    Returned => |msg| Event::Returned { lease_id: msg.0, ok: msg.1 };
    Drain => |_msg| Event::Drain;
    SoldOutElsewhere => |_msg| Event::SoldOutElsewhere;
}

//! One simulated round: the nodes, the network, the clients and the fault schedule, all driven
//! by one seeded RNG and one queue of timed jobs. A step is one job.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::check::{self, Books, Finding};
use super::faults::{Fault, Faults};
use super::rng::Rng;
use super::{ready, Violation, LIVENESS_MS};
use crate::clock::Millis;
use crate::config::{EngineSettings, Settings};
use crate::domain::{
    ReserveRequest, Switches, SwitchesPatch, Voucher, VoucherLimits, VoucherPatch, VoucherStatus,
};
use crate::engine::quota::{Command, Event, Reply, VoucherCore, TICK_MS};
use crate::engine::sizing::SizingParams;
use crate::engine::soldout::VoucherShared;
use crate::engine::{answer_from_flag, settle_without_units, EngineError, Gate};
use crate::ledger::model::ModelLedger;
use crate::ledger::{holder_name, LedgerError, Restock, SharedLedger};
use crate::signals::Signal;

mod clients;
mod nodes;
mod trace;

use trace::{command_name, event_name, reply_name};

/// What one round did.
#[derive(Debug, Default)]
pub struct RoundOutcome {
    pub steps: u64,
    pub checks: u64,
    pub sold: i64,
    pub offered: i64,
    pub reserves: u64,
    pub faults_injected: u64,
    pub violation: Option<Violation>,
}

/// A reserve's answer channel in the simulation: the client and its attempt.
type Tag = (usize, u32);
type Core = VoucherCore<Tag, ()>;

/// The frontend's request timeout (`http.request_timeout_ms`).
const REQUEST_TIMEOUT_MS: Millis = 5000;
const HEARTBEAT_MS: Millis = 250;
const DEAD_AFTER_MS: Millis = 1500;
/// After faults stop (and the last pause ends), every answer is final by then: no 503.
const CALM_GRACE_MS: Millis = 3000;

struct Slot {
    core: Core,
    shared: Arc<VoucherShared>,
    /// Tells this core apart from a successor on the same node: a ledger answer goes to the
    /// core that asked (the actor's futures die with it).
    id: u64,
}

struct Node {
    name: String,
    /// The ledger's number of this process; jobs of an older one are dropped.
    inc: i64,
    up: bool,
    paused_until: Millis,
    skew: Millis,
    gate: Gate,
    /// Its subscription to signals is up (`EngineHandle::signals_link`): only then does a
    /// sold-out flag answer from memory.
    linked: bool,
    /// The version of the switches applied: an older read never undoes a newer one.
    switch_version: i64,
    cores: BTreeMap<usize, Slot>,
}

struct SimVoucher {
    code: String,
    /// The shard of the ledger it lives on.
    shard: usize,
    per_user: i64,
    /// When the calm phase saw it sold out.
    sold_at: Option<Millis>,
    /// Customers the calm phase sent so far.
    calm_clients: usize,
}

pub(super) struct Client {
    pub voucher: usize,
    pub customer: i64,
    pub order: String,
    pub attempt: u32,
    /// Where its current attempt went, and when it was sent.
    pub outstanding: Option<(usize, Millis)>,
    pub done: bool,
    /// Times it sends its order again after a `201` (a double click, a lost response).
    pub resends: u8,
    /// How far the clock of the node its current attempt reached was off then.
    pub arrive_skew: Millis,
}

/// One shard of the simulated ledger.
struct SimShard {
    ledger: SharedLedger,
    /// The same ledger, for diagnosis.
    model: Arc<ModelLedger>,
    /// Until when it is down: every call to it fails before it applies.
    down_until: Millis,
    /// Until when it answers late: every call to it waits longer.
    slow_until: Millis,
}

enum Job {
    Send(usize),
    /// Shard `shard` goes down (or answers late: `slow`) for `ms`.
    Shard {
        shard: usize,
        ms: Millis,
        slow: bool,
    },
    Arrive {
        node: usize,
        client: usize,
        attempt: u32,
    },
    Answer {
        client: usize,
        attempt: u32,
        reply: Reply,
        /// Answered from a sold-out flag while a `RESTOCK` for it was on its way to the node:
        /// the design's window (signals are asynchronous), not a bug; a refusal then is excused.
        excused: bool,
        /// How far the answering node's clock was off.
        skew: Millis,
    },
    Deadline {
        client: usize,
        attempt: u32,
    },
    /// An event for a core (a ledger answer, a reload).
    Deliver {
        node: usize,
        inc: i64,
        voucher: usize,
        core: u64,
        event: Event<Tag, ()>,
    },
    /// A core's call reaches the ledger.
    AtLedger {
        node: usize,
        inc: i64,
        voucher: usize,
        core: u64,
        call: Command<Tag, ()>,
    },
    Signal {
        node: usize,
        voucher: usize,
        signal: Signal,
    },
    /// The `SWITCHES` signal's effect: the node reads the switches (at this version).
    Switch {
        node: usize,
        switches: Switches,
    },
    Warm {
        node: usize,
        voucher: usize,
    },
    Tick {
        node: usize,
        inc: i64,
    },
    Beat {
        node: usize,
        inc: i64,
    },
    Crash(usize),
    Restart(usize),
    Pause(usize),
    Jump(usize),
    /// A batch whose caller was already answered 503 reaches the ledger.
    LateCommit {
        voucher: usize,
        batch: crate::ledger::Batch,
    },
    Admin,
    RedisDown,
    /// A node's subscription to signals is up again.
    Relink(usize),
    Calm,
    Demand(usize),
    Liveness,
}

impl Job {
    /// The node whose process runs this job (a paused process runs nothing until it resumes).
    fn runs_on(&self) -> Option<usize> {
        match self {
            Job::Arrive { node, .. }
            | Job::Deliver { node, .. }
            | Job::Signal { node, .. }
            | Job::Switch { node, .. }
            | Job::Warm { node, .. }
            | Job::Tick { node, .. }
            | Job::Beat { node, .. } => Some(*node),
            _ => None,
        }
    }
}

struct Queued {
    at: Millis,
    seq: u64,
    job: Job,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    /// Earliest first in a max-heap.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

pub(super) struct World {
    seed: u64,
    faults: Faults,
    rng: Rng,
    pub now: Millis,
    seq: u64,
    queue: BinaryHeap<Queued>,
    /// The ledger in shards (1 to 3 a round), each voucher on one, as `ledger.shards` runs it:
    /// each shard a model ledger of its own, which can be down or late on its own.
    shards: Vec<SimShard>,
    /// The draws about shards, apart from the round's RNG: a round's other draws do not move
    /// with them (rounds of one shard run as they did before shards).
    srng: Rng,
    settings: EngineSettings,
    sizing: SizingParams,
    nodes: Vec<Node>,
    vouchers: Vec<SimVoucher>,
    pub clients: Vec<Client>,
    books: Books,
    calm_at: Millis,
    calm: bool,
    /// Until when a `RESTOCK` of voucher `v` is on its way to node `n`.
    restock_on_way: BTreeMap<(usize, usize), (Millis, Millis)>,
    /// Cores created so far (each one's id).
    cores_made: u64,
    /// When the calm phase is quiet: faults stopped and the last pause ended.
    quiet_at: Millis,
    redis_down_until: Millis,
    order_amount: i64,
    pub out: RoundOutcome,
    trace: Option<Vec<String>>,
}

/// Runs round `seed` with the fault kinds of `faults` it draws; `trace` records every step.
pub fn run_round(seed: u64, faults: Faults, trace: bool) -> RoundOutcome {
    run_round_traced(seed, faults, trace).0
}

/// [`run_round`], and the whole trace of the round (empty unless `trace`), whether or not it
/// failed: a regression seed checks that its round still reaches what it was filed for.
pub fn run_round_traced(seed: u64, faults: Faults, trace: bool) -> (RoundOutcome, Vec<String>) {
    let mut world = World::new(seed, faults, trace);
    let res = catch_unwind(AssertUnwindSafe(|| world.run()));
    let (at, step) = (world.now, world.out.steps);
    let failure = match res {
        Ok(Ok(())) => None,
        Ok(Err((what, code))) => Some((what, code)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            Some((
                format!("panicked (a CHECK constraint of the model, or the core): {what}"),
                None,
            ))
        }
    };
    let mut out = std::mem::take(&mut world.out);
    out.violation = failure.map(|(what, code)| Violation {
        round_seed: seed,
        faults,
        at_ms: at,
        step,
        what,
        code,
        trace: world.trace.clone().unwrap_or_default(),
    });
    (out, world.trace.take().unwrap_or_default())
}

impl World {
    fn new(seed: u64, allowed: Faults, trace: bool) -> Self {
        let mut rng = Rng::new(seed);
        let faults = allowed.draw(&mut rng);
        let mut settings = Settings::defaults().engine;
        settings.max_batch = rng.range(1, 64) as usize;
        settings.batches_in_flight = rng.range(1, 2) as usize;
        settings.lease_idle_timeout_ms = rng.range(300, 5000);
        settings.actor_idle_stop_ms = settings.lease_idle_timeout_ms * 2;
        settings.max_block = rng.range(4, 64);
        settings.min_block = rng.range(1, 4);
        if rng.chance(50) {
            settings.reservation_ttl_ms = rng.range(2000, 20_000);
        }
        let sizing = SizingParams::from(&settings);
        let mut srng = Rng::new(seed ^ 0x5a4d_5eed_0000_0001);
        let shards = (0..srng.range(1, 3))
            .map(|_| {
                let model = Arc::new(ModelLedger::new("sim"));
                SimShard {
                    ledger: model.clone(),
                    model,
                    down_until: 0,
                    slow_until: 0,
                }
            })
            .collect();
        let mut world = World {
            seed,
            faults,
            rng,
            now: 1_000_000,
            seq: 0,
            queue: BinaryHeap::new(),
            shards,
            srng,
            settings,
            sizing,
            nodes: Vec::new(),
            vouchers: Vec::new(),
            clients: Vec::new(),
            books: Books::default(),
            calm_at: 0,
            calm: false,
            quiet_at: Millis::MAX / 2,
            cores_made: 0,
            restock_on_way: BTreeMap::new(),
            redis_down_until: 0,
            order_amount: 1000,
            out: RoundOutcome::default(),
            trace: trace.then(Vec::new),
        };
        world.setup();
        world
    }

    fn note(&mut self, line: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            t.push(format!("{:>8} ms  {}", self.now - 1_000_000, line()));
        }
    }

    fn at(&mut self, delay: Millis, job: Job) {
        self.seq += 1;
        self.queue.push(Queued {
            at: self.now + delay.max(0),
            seq: self.seq,
            job,
        });
    }

    /// One network hop.
    fn hop(&mut self) -> Millis {
        self.rng.range(0, 3)
    }

    fn node_now(&self, n: usize) -> Millis {
        self.now + self.nodes[n].skew
    }

    fn setup(&mut self) {
        let rng = &mut self.rng;
        let (nodes, vouchers) = (rng.range(1, 4) as usize, rng.range(1, 3) as usize);
        let fault_ms = rng.range(3000, 40_000);
        self.calm_at = self.now + fault_ms;
        for i in 0..nodes {
            let name = format!("n{i}");
            let inc = self
                .register_node(&name, self.now)
                .map(|i| i.number)
                .unwrap_or(1);
            self.nodes.push(Node {
                name,
                inc,
                up: true,
                paused_until: 0,
                skew: 0,
                gate: Gate::Open,
                switch_version: 0,
                linked: true,
                cores: BTreeMap::new(),
            });
            let (t, b) = (self.rng.range(0, TICK_MS), self.rng.range(0, HEARTBEAT_MS));
            self.at(t, Job::Tick { node: i, inc });
            self.at(b, Job::Beat { node: i, inc });
        }
        for v in 0..vouchers {
            let total = self.rng.range(5, 120);
            let per_user = self.rng.range(1, 3);
            let starts_later = self.rng.chance(20);
            let starts_at = if starts_later {
                self.now + self.rng.range(200, 3000)
            } else {
                self.now
            };
            let code = format!("V{v}S{}", self.seed % 100_000);
            let voucher = Voucher {
                code: code.clone(),
                discount_amount: 100,
                min_order_amount: 0,
                total_limit: total,
                per_user_limit: per_user,
                starts_at,
                ends_at: self.now + 3_600_000 * 24,
                status: VoucherStatus::Active,
                limits: VoucherLimits::default(),
            };
            let shard = v % self.shards.len();
            if let Err(e) = ready(self.shards[shard].ledger.create_voucher(&voucher, self.now)) {
                unreachable!("a fresh model ledger creates {code}: {e}");
            }
            self.vouchers.push(SimVoucher {
                code,
                shard,
                per_user,
                sold_at: None,
                calm_clients: 0,
            });
            if starts_later {
                for node in 0..nodes {
                    let d = self.rng.range(0, 100);
                    self.at(d, Job::Warm { node, voucher: v });
                }
            }
            // The fault phase's demand: up to three times the units, spread over the phase.
            let demand = self.rng.range(total / 2, total * 3) as usize;
            let customers = (demand as i64 * 3 / 4).max(1);
            for _ in 0..demand {
                let customer = self.rng.range(1, customers);
                let c = self.new_client(v, customer);
                let resends = self.draw(1, 2) as u8;
                if self.fault(Fault::Copies, 15) {
                    self.clients[c].resends = resends;
                }
                let when = self.rng.range(0, fault_ms);
                self.at(when, Job::Send(c));
                let d = self.draw(0, 30);
                if self.fault(Fault::Copies, 10) {
                    // The same order sent again, to any node, at about the same time.
                    let twin = self.clients.len();
                    let order = self.clients[c].order.clone();
                    self.clients.push(Client {
                        voucher: v,
                        customer,
                        order,
                        attempt: 0,
                        outstanding: None,
                        done: false,
                        resends: 0,
                        arrive_skew: 0,
                    });
                    self.at(when + d, Job::Send(twin));
                }
            }
        }
        self.schedule_faults(fault_ms);
        self.at(fault_ms, Job::Calm);
    }

    fn schedule_faults(&mut self, fault_ms: Millis) {
        let n = self.nodes.len();
        let per = |rng: &mut Rng, kind: Fault, faults: Faults| {
            let n = rng.range(1, 4);
            if faults.has(kind) {
                n
            } else {
                0
            }
        };
        let faults = self.faults;
        for kind in [Fault::Crash, Fault::Pause, Fault::Clock, Fault::RedisDown] {
            for _ in 0..per(&mut self.rng, kind, faults) {
                let when = self.rng.range(0, fault_ms);
                let node = self.rng.pick(n);
                let job = match kind {
                    Fault::Crash => Job::Crash(node),
                    Fault::Pause => Job::Pause(node),
                    Fault::Clock => Job::Jump(node),
                    _ => Job::RedisDown,
                };
                self.at(when, job);
            }
        }
        // One shard down or late on its own, with several shards (drawn apart, see `srng`).
        // Drawn whether or not the kind is on, so shrinking one kind leaves the other's as it was.
        for (kind, slow) in [(Fault::ShardDown, false), (Fault::ShardSlow, true)] {
            if self.shards.len() < 2 {
                break;
            }
            for _ in 0..self.srng.range(1, 3) {
                let when = self.srng.range(0, fault_ms);
                let shard = self.srng.pick(self.shards.len());
                let ms = self.srng.range(200, 6000);
                if faults.has(kind) {
                    self.at(when, Job::Shard { shard, ms, slow });
                }
            }
        }
        if [
            Fault::Switches,
            Fault::Raise,
            Fault::Release,
            Fault::Confirm,
        ]
        .into_iter()
        .any(|k| faults.has(k))
        {
            let first = self.rng.range(0, 1000);
            self.at(first, Job::Admin);
        }
    }

    /// Whether fault `kind` strikes now (`percent` odds, in the fault phase, when the round
    /// injects that kind). It draws from the RNG either way, so a round with a kind turned off
    /// (when shrinking) keeps the same draws for everything else.
    fn fault(&mut self, kind: Fault, percent: u64) -> bool {
        let hit = self.rng.chance(percent);
        hit && !self.calm && self.faults.has(kind)
    }

    /// A draw in `lo..=hi` made whether or not it is used (see [`World::fault`]).
    fn draw(&mut self, lo: i64, hi: i64) -> i64 {
        self.rng.range(lo, hi)
    }

    /// Runs jobs until the round ends.
    fn run(&mut self) -> Result<(), Finding> {
        while let Some(Queued { at, job, .. }) = self.queue.pop() {
            self.now = at;
            if let Some(n) = job.runs_on() {
                let paused_until = self.nodes[n].paused_until;
                if paused_until > self.now {
                    self.seq += 1;
                    self.queue.push(Queued {
                        at: paused_until,
                        seq: self.seq,
                        job,
                    });
                    continue;
                }
            }
            self.out.steps += 1;
            if self.step(job)? {
                return self.finish();
            }
        }
        self.finish()
    }

    /// Runs one job; true when the round is over.
    fn step(&mut self, job: Job) -> Result<bool, Finding> {
        match job {
            Job::Send(c) => self.send(c),
            Job::Arrive {
                node,
                client,
                attempt,
            } => self.arrive(node, client, attempt)?,
            Job::Answer {
                client,
                attempt,
                reply,
                excused,
                skew,
            } => self.answered(client, attempt, reply, excused, skew)?,
            Job::Deadline { client, attempt } => self.deadline(client, attempt)?,
            Job::Deliver {
                node,
                inc,
                voucher,
                core,
                event,
            } => {
                let asked = self.nodes[node]
                    .cores
                    .get(&voucher)
                    .is_some_and(|s| s.id == core);
                if self.nodes[node].inc == inc && self.nodes[node].up && asked {
                    self.feed(node, voucher, event);
                }
            }
            Job::AtLedger {
                node,
                inc,
                voucher,
                core,
                call,
            } => self.at_ledger(node, inc, core, voucher, call)?,
            Job::Signal {
                node,
                voucher,
                signal,
            } => self.signal_arrives(node, voucher, signal),
            Job::Switch { node, switches } => self.apply_switches(node, switches),
            Job::Warm { node, voucher } => {
                if self.nodes[node].up {
                    self.slot(node, voucher);
                    self.feed(node, voucher, Event::Warm(()));
                }
            }
            Job::Tick { node, inc } => {
                if self.nodes[node].inc == inc && self.nodes[node].up {
                    // As the actor does: a core gets the tick it asks for (every TICK_MS while
                    // busy, only when it would stop while quiet).
                    let now = self.node_now(node);
                    let due: Vec<usize> = self.nodes[node]
                        .cores
                        .iter()
                        .filter(|(_, slot)| now >= slot.core.next_tick_at())
                        .map(|(v, _)| *v)
                        .collect();
                    for v in due {
                        self.feed(node, v, Event::Tick);
                    }
                    self.at(TICK_MS, Job::Tick { node, inc });
                }
            }
            Job::Beat { node, inc } => {
                if self.nodes[node].inc == inc && self.nodes[node].up {
                    self.beat(node)?;
                    self.at(HEARTBEAT_MS, Job::Beat { node, inc });
                }
            }
            Job::Crash(n) => self.crash(n),
            Job::Restart(n) => self.restart(n),
            Job::Pause(n) => {
                if !self.calm {
                    let ms = self.rng.range(500, self.settings.lease_ttl_ms + 10_000);
                    self.out.faults_injected += 1;
                    self.note(|| format!("node {n} pauses for {ms} ms"));
                    let until = self.now + ms;
                    let node = &mut self.nodes[n];
                    node.paused_until = node.paused_until.max(until);
                }
            }
            Job::Jump(n) => {
                if !self.calm {
                    let by = self.rng.range(-8000, 8000);
                    self.out.faults_injected += 1;
                    self.note(|| format!("node {n} clock jumps {by} ms"));
                    let node = &mut self.nodes[n];
                    node.skew = (node.skew + by).clamp(-20_000, 20_000);
                }
            }
            Job::RedisDown => {
                if !self.calm {
                    let ms = self.rng.range(100, 5000);
                    self.out.faults_injected += 1;
                    self.note(|| format!("redis down for {ms} ms (every node)"));
                    self.redis_down_until = self.now + ms;
                    for n in 0..self.nodes.len() {
                        self.unlink(n, ms);
                    }
                }
            }
            Job::Relink(n) => self.relink(n),
            Job::Shard { shard, ms, slow } => {
                if !self.calm {
                    self.out.faults_injected += 1;
                    let what = if slow { "answers late" } else { "is down" };
                    self.note(|| format!("shard {shard} {what} for {ms} ms"));
                    let s = &mut self.shards[shard];
                    let until = if slow {
                        &mut s.slow_until
                    } else {
                        &mut s.down_until
                    };
                    *until = (*until).max(self.now + ms);
                }
            }
            Job::LateCommit { voucher, batch } => {
                // Sent before its shard went down, it may still land there, or not (its caller
                // was answered 503 already either way).
                let lands = self.srng.chance(50);
                let res = match lands {
                    true => ready(self.ledger_of(voucher).commit_batch(&batch)),
                    false => self.on_voucher(voucher, |l| ready(l.commit_batch(&batch))),
                };
                let code = batch.voucher_code.clone();
                self.note(|| format!("{code} late commit on lease {}: {res:?}", batch.lease_id));
                self.books.stored(&res, self.now);
                self.check_voucher(voucher)?;
            }
            Job::Admin => self.admin()?,
            Job::Calm => self.calm_down(),
            Job::Demand(v) => self.demand(v)?,
            Job::Liveness => return self.liveness().map(|()| true),
        }
        Ok(self.calm && self.vouchers.iter().all(|v| v.sold_at.is_some()) && self.idle())
    }

    /// The ledger of voucher `v`'s shard (whether or not it is down: the checks read it).
    fn ledger_of(&self, v: usize) -> SharedLedger {
        self.shards[self.vouchers[v].shard].ledger.clone()
    }

    fn model_of(&self, v: usize) -> &ModelLedger {
        &self.shards[self.vouchers[v].shard].model
    }

    /// Whether shard `s` is down now.
    fn shard_down(&self, s: usize) -> bool {
        self.now < self.shards[s].down_until
    }

    /// Whether voucher `v`'s shard answers late now.
    fn shard_slow(&self, v: usize) -> bool {
        self.now < self.shards[self.vouchers[v].shard].slow_until
    }

    /// A node's call about voucher `v`: it fails before it applies while the shard is down.
    fn on_voucher<T>(
        &self,
        v: usize,
        call: impl FnOnce(&SharedLedger) -> Result<T, LedgerError>,
    ) -> Result<T, LedgerError> {
        match self.shard_down(self.vouchers[v].shard) {
            true => Err(LedgerError::Deadline),
            false => call(&self.shards[self.vouchers[v].shard].ledger),
        }
    }

    /// A call of the node as a whole on the first shard (its number, the switches), as the
    /// sharded ledger makes it: it fails while that shard is down.
    fn on_first<T>(
        &self,
        call: impl FnOnce(&SharedLedger) -> Result<T, LedgerError>,
    ) -> Result<T, LedgerError> {
        match self.shard_down(0) {
            true => Err(LedgerError::Deadline),
            false => call(&self.shards[0].ledger),
        }
    }

    /// Registers a process: numbered by the first shard, recorded on the others by a beat (a
    /// shard that is down records it at its first beat there).
    fn register_node(
        &self,
        name: &str,
        now: Millis,
    ) -> Result<crate::ledger::Incarnation, LedgerError> {
        let inc = self.on_first(|l| ready(l.register_node(name, now, DEAD_AFTER_MS)))?;
        for s in 1..self.shards.len() {
            if !self.shard_down(s) {
                let _ = ready(
                    self.shards[s]
                        .ledger
                        .heartbeat(&inc.holder, now, DEAD_AFTER_MS),
                );
            }
        }
        Ok(inc)
    }

    /// No client waits for an answer.
    fn idle(&self) -> bool {
        self.clients.iter().all(|c| c.outstanding.is_none())
    }
}

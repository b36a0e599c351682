//! One simulated round: the nodes, the network, the clients and the fault schedule, all driven
//! by one seeded RNG and one queue of timed jobs. A step is one job.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::check::{self, Books};
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

/// splitmix64: small, fast, and the same everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next() % ((hi - lo + 1) as u64)) as i64
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 1000 < percent * 10
    }

    fn pick(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The fault kinds a round may inject (a bit set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Faults(u32);

const KINDS: [(&str, u32); 15] = [
    ("crash", 1),
    ("pause", 1 << 1),
    ("clock", 1 << 2),
    ("ledger-fail", 1 << 3),
    ("ledger-lost", 1 << 4),
    ("ledger-slow", 1 << 5),
    ("signal-drop", 1 << 6),
    ("signal-delay", 1 << 7),
    ("signal-dup", 1 << 8),
    ("redis-down", 1 << 9),
    ("copies", 1 << 10),
    ("switches", 1 << 11),
    ("raise", 1 << 12),
    ("release", 1 << 13),
    ("confirm", 1 << 14),
];

impl Faults {
    pub fn all() -> Self {
        Self(KINDS.iter().map(|(_, b)| b).fold(0, |a, b| a | b))
    }

    pub fn none() -> Self {
        Self(0)
    }

    fn has(self, name: &str) -> bool {
        KINDS.iter().any(|(n, b)| *n == name && self.0 & b != 0)
    }

    /// The kinds in this set, by name.
    pub fn kinds(self) -> Vec<&'static str> {
        KINDS
            .iter()
            .filter(|(_, b)| self.0 & b != 0)
            .map(|(n, _)| *n)
            .collect()
    }

    pub fn without(self, name: &str) -> Self {
        let bit = KINDS
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, b)| *b);
        Self(self.0 & !bit)
    }

    /// `crash,pause,…` (or `none`).
    pub fn names(self) -> String {
        let kinds = self.kinds();
        if kinds.is_empty() {
            "none".into()
        } else {
            kinds.join(",")
        }
    }

    /// Parses [`Faults::names`]' form (`all` too).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "all" => return Ok(Self::all()),
            "none" | "" => return Ok(Self::none()),
            _ => {}
        }
        s.split(',').try_fold(Self::none(), |acc, name| {
            KINDS
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, b)| Self(acc.0 | b))
                .ok_or_else(|| format!("unknown fault kind {name:?}"))
        })
    }

    /// A random subset of `self` (each kind with even odds).
    fn draw(self, rng: &mut Rng) -> Self {
        Self(self.0 & rng.next() as u32)
    }
}

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

enum Job {
    Send(usize),
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
    ledger: SharedLedger,
    /// The same ledger, for diagnosis.
    model: Arc<ModelLedger>,
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
        trace: world.trace.take().unwrap_or_default(),
    });
    out
}

/// A broken invariant: what, and the voucher involved.
pub(super) type Broken = (String, Option<String>);

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
        let model = Arc::new(ModelLedger::new("sim"));
        let ledger: SharedLedger = model.clone();
        let mut world = World {
            seed,
            faults,
            rng,
            now: 1_000_000,
            seq: 0,
            queue: BinaryHeap::new(),
            ledger,
            model,
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
            let inc = ready(self.ledger.register_node(&name, self.now, DEAD_AFTER_MS))
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
            if let Err(e) = ready(self.ledger.create_voucher(&voucher, self.now)) {
                unreachable!("a fresh model ledger creates {code}: {e}");
            }
            self.vouchers.push(SimVoucher {
                code,
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
                if self.fault("copies", 15) {
                    self.clients[c].resends = resends;
                }
                let when = self.rng.range(0, fault_ms);
                self.at(when, Job::Send(c));
                let d = self.draw(0, 30);
                if self.fault("copies", 10) {
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

    fn new_client(&mut self, voucher: usize, customer: i64) -> usize {
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

    fn schedule_faults(&mut self, fault_ms: Millis) {
        let n = self.nodes.len();
        let per = |rng: &mut Rng, name: &str, faults: Faults| {
            let n = rng.range(1, 4);
            if faults.has(name) {
                n
            } else {
                0
            }
        };
        let faults = self.faults;
        for (kind, job) in [
            ("crash", 0u8),
            ("pause", 1),
            ("clock", 2),
            ("redis-down", 3),
        ] {
            for _ in 0..per(&mut self.rng, kind, faults) {
                let when = self.rng.range(0, fault_ms);
                let node = self.rng.pick(n);
                let job = match job {
                    0 => Job::Crash(node),
                    1 => Job::Pause(node),
                    2 => Job::Jump(node),
                    _ => Job::RedisDown,
                };
                self.at(when, job);
            }
        }
        if ["switches", "raise", "release", "confirm"]
            .iter()
            .any(|k| faults.has(k))
        {
            let first = self.rng.range(0, 1000);
            self.at(first, Job::Admin);
        }
    }

    /// Whether fault `kind` strikes now (`percent` odds, in the fault phase, when the round
    /// injects that kind). It draws from the RNG either way, so a round with a kind turned off
    /// (when shrinking) keeps the same draws for everything else.
    fn fault(&mut self, kind: &str, percent: u64) -> bool {
        let hit = self.rng.chance(percent);
        hit && !self.calm && self.faults.has(kind)
    }

    /// A draw in `lo..=hi` made whether or not it is used (see [`World::fault`]).
    fn draw(&mut self, lo: i64, hi: i64) -> i64 {
        self.rng.range(lo, hi)
    }

    /// Runs jobs until the round ends.
    fn run(&mut self) -> Result<(), Broken> {
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
    fn step(&mut self, job: Job) -> Result<bool, Broken> {
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
                    let vouchers: Vec<usize> = self.nodes[node].cores.keys().copied().collect();
                    for v in vouchers {
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
            Job::LateCommit { voucher, batch } => {
                let res = ready(self.ledger.commit_batch(&batch));
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

    /// No client waits for an answer.
    fn idle(&self) -> bool {
        self.clients.iter().all(|c| c.outstanding.is_none())
    }

    fn send(&mut self, c: usize) {
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
    fn slot(&mut self, n: usize, v: usize) {
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
    fn arrive(&mut self, n: usize, c: usize, attempt: u32) -> Result<(), Broken> {
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
                None => {
                    let voucher = shared.voucher();
                    let code = &self.vouchers[v].code;
                    let reqs = std::slice::from_ref(&req);
                    ready(settle_without_units(
                        &self.ledger,
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
    fn reply(&mut self, n: usize, client: usize, attempt: u32, reply: Reply, excused: bool) {
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

    /// Hands an event to a core and carries out its commands.
    fn feed(&mut self, n: usize, v: usize, event: Event<Tag, ()>) {
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

    fn carry_out(&mut self, n: usize, v: usize) {
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
    fn at_ledger(
        &mut self,
        n: usize,
        inc: i64,
        core: u64,
        v: usize,
        call: Command<Tag, ()>,
    ) -> Result<(), Broken> {
        let fail_before = self.fault("ledger-fail", 2);
        let lose_answer = self.fault("ledger-lost", 2);
        let mut delay = self.hop();
        let slow = self.draw(50, 3000);
        let late = self.fault("ledger-slow", 3);
        if late {
            delay += slow;
        }
        // The committer's deadline passes while the transaction runs: the batch is answered
        // 503 at once and commits later (or is fenced then).
        let late_commit = self.fault("ledger-slow", 2);
        if fail_before || lose_answer || late || late_commit {
            self.out.faults_injected += 1;
        }
        let holder = holder_name(&self.nodes[n].name, inc);
        let code = self.vouchers[v].code.clone();
        let ledger = self.ledger.clone();
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

    fn check_voucher(&mut self, v: usize) -> Result<(), Broken> {
        self.out.checks += 1;
        check::balanced(&self.ledger, &self.vouchers[v].code, &self.model)
    }

    /// Units went back to `free` on node `n`: its own flag comes down, and the cluster hears.
    fn restocked(&mut self, n: usize, r: Restock) {
        let Some(v) = self.vouchers.iter().position(|x| x.code == r.voucher_code) else {
            return;
        };
        self.apply_restock(n, v);
        self.publish(n, v, Signal::Restock);
    }

    fn apply_restock(&mut self, n: usize, v: usize) {
        if let Some(slot) = self.nodes[n].cores.get(&v) {
            slot.shared.restock();
            self.feed(n, v, Event::Restocked);
        }
    }

    /// A signal through Redis to every other node: dropped, late, doubled, as the faults say.
    fn publish(&mut self, from: usize, v: usize, signal: Signal) {
        if !self.calm && self.now < self.redis_down_until {
            return;
        }
        for node in (0..self.nodes.len()).filter(|&m| m != from) {
            let dropped = self.fault("signal-drop", 5);
            let copies = if self.fault("signal-dup", 5) { 2 } else { 1 };
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
                if self.fault("signal-delay", 10) {
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

    fn signal_arrives(&mut self, n: usize, v: usize, signal: Signal) {
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
                if let Ok(Some(voucher)) = ready(self.ledger.voucher(&code)) {
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
    fn beat(&mut self, n: usize) -> Result<(), Broken> {
        let holder = holder_name(&self.nodes[n].name, self.nodes[n].inc);
        if let Ok(switches) = ready(self.ledger.switches()) {
            self.apply_switches(n, switches);
        }
        let mut restocks = Vec::new();
        if self.fault("ledger-fail", 5) {
            // The beat's call failed: this holder looks silent for one beat more.
            self.out.faults_injected += 1;
            return Ok(());
        }
        if let Ok(beat) = ready(self.ledger.heartbeat(&holder, self.now, DEAD_AFTER_MS)) {
            self.nodes[n].skew = beat.ledger_ms - self.now;
            let now = self.node_now(n);
            for dead in beat.dead {
                self.note(|| format!("node {n} reaps {dead}"));
                restocks.extend(ready(self.ledger.reap_holder(&dead, now)).unwrap_or_default());
            }
        }
        let now = self.node_now(n);
        restocks.extend(ready(self.ledger.reap_expired(now)).unwrap_or_default());
        restocks.extend(ready(self.ledger.expire_due(now, 100)).unwrap_or_default());
        for r in restocks {
            self.restocked(n, r);
        }
        for v in 0..self.vouchers.len() {
            self.check_voucher(v)?;
        }
        Ok(())
    }

    /// Node `n`'s subscription ends; it is back after `ms`.
    fn unlink(&mut self, n: usize, ms: Millis) {
        self.note(|| format!("node {n} loses its signal link"));
        self.nodes[n].linked = false;
        self.at(ms, Job::Relink(n));
    }

    /// What `EngineHandle::signals_link(true)` does: every flag unconfirmed until its probe.
    fn relink(&mut self, n: usize) {
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
    fn apply_switches(&mut self, n: usize, s: Switches) {
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

    fn crash(&mut self, n: usize) {
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

    fn restart(&mut self, n: usize) {
        if self.nodes[n].up {
            return;
        }
        let now = self.node_now(n);
        let name = self.nodes[n].name.clone();
        let Ok(inc) = ready(self.ledger.register_node(&name, now, DEAD_AFTER_MS)) else {
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
        if let Ok(s) = ready(self.ledger.switches()) {
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
    fn admin(&mut self) -> Result<(), Broken> {
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
            0 if self.faults.has("switches") => {
                let paused = self.rng.chance(50);
                let patch = SwitchesPatch {
                    sales_paused: Some(paused),
                    read_only: None,
                };
                self.out.faults_injected += 1;
                if let Ok(switches) = ready(self.ledger.set_switches(&patch, self.node_now(n))) {
                    self.note(|| format!("sales paused: {paused} (every node)"));
                    for node in 0..self.nodes.len() {
                        let d = self.rng.range(0, 300);
                        self.at(d, Job::Switch { node, switches });
                    }
                }
            }
            1 if self.faults.has("raise") => {
                let Ok(Some(old)) = ready(self.ledger.voucher(&code)) else {
                    return Ok(());
                };
                let patch = VoucherPatch {
                    total_limit: Some(old.total_limit + self.rng.range(1, 10)),
                    ..VoucherPatch::default()
                };
                self.out.faults_injected += 1;
                if let Ok((voucher, restock)) = ready(self.ledger.update_voucher(&code, &patch)) {
                    self.note(|| format!("{code} total raised to {}", voucher.total_limit));
                    self.feed(n, v, Event::Reload(voucher));
                    self.publish(n, v, Signal::Updated);
                    if let Some(r) = restock {
                        self.restocked(n, r);
                    }
                }
                self.check_voucher(v)?;
            }
            2 if self.faults.has("release") => {
                let Some(order) = self.books.pick_acked(&mut self.rng, &code) else {
                    return Ok(());
                };
                self.out.faults_injected += 1;
                let now = self.node_now(n);
                if let Ok((_, restock)) = ready(self.ledger.release(&code, &order, now)) {
                    self.note(|| format!("{code} {order} released"));
                    self.books.released(&order);
                    if let Some(r) = restock {
                        self.restocked(n, r);
                    }
                }
                self.check_voucher(v)?;
            }
            3 if self.faults.has("confirm") => {
                let Some(order) = self.books.pick_acked(&mut self.rng, &code) else {
                    return Ok(());
                };
                let now = self.node_now(n);
                if ready(self.ledger.confirm(&code, &order, now)).is_ok() {
                    self.note(|| format!("{code} {order} confirmed"));
                }
                self.check_voucher(v)?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Faults stop: every process is up with a right clock, sales resume, the network is clean;
    /// new customers come for every voucher until it sells out.
    fn calm_down(&mut self) {
        self.calm = true;
        self.note(|| "calm: faults stop".into());
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
        if let Ok(switches) = ready(self.ledger.set_switches(&patch, self.now)) {
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
    fn demand(&mut self, v: usize) -> Result<(), Broken> {
        if self.vouchers[v].sold_at.is_some() {
            return Ok(());
        }
        let c = check::counters(&self.ledger, &self.vouchers[v].code)?;
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

    fn liveness(&mut self) -> Result<(), Broken> {
        for v in &self.vouchers {
            if v.sold_at.is_none() {
                let c = check::counters(&self.ledger, &v.code)?;
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
                        self.model.unused_leases(&v.code),
                    ),
                    Some(v.code.clone()),
                ));
            }
        }
        Ok(())
    }

    fn answered(
        &mut self,
        c: usize,
        attempt: u32,
        reply: Reply,
        excused: bool,
        skew: Millis,
    ) -> Result<(), Broken> {
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
            &self.ledger,
            &mut self.books,
            &self.clients[c],
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
    fn deadline(&mut self, c: usize, attempt: u32) -> Result<(), Broken> {
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

    /// The round's last checks: every acknowledged order still in the ledger as it was
    /// answered, every voucher's books balanced and sold out.
    fn finish(&mut self) -> Result<(), Broken> {
        for v in 0..self.vouchers.len() {
            self.check_voucher(v)?;
        }
        self.out.checks += 1;
        self.books.all_durable(&self.ledger)
    }
}

/// `call`'s answer, or the failure its caller sees when the call `fails` before it applies.
fn attempt<T>(
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
fn failed() -> LedgerError {
    LedgerError::Deadline
}

/// The same answer, lost on the way back: the call applied, the caller sees a failure.
fn lost(event: Event<Tag, ()>) -> Event<Tag, ()> {
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

fn event_name(e: &Event<Tag, ()>) -> String {
    match e {
        Event::Reserve(r, _) => format!("reserve {} (customer {})", r.order_id, r.customer_id),
        Event::Committed { id, res } => format!("committed batch {id}: {res:?}"),
        Event::Granted(res) => format!("granted {res:?}"),
        Event::Renewed(res) => format!("renewed {res:?}"),
        Event::LookedUp(res) => format!(
            "looked up {}",
            res.as_ref()
                .map_or("failed".into(), |a| format!("{} answers", a.len()))
        ),
        Event::WinnersLoaded(v, res) => format!(
            "winners {v:?} {}",
            res.as_ref()
                .map_or("failed".into(), |w| format!("{} orders", w.len()))
        ),
        Event::VoucherRead { first, res } => {
            format!("voucher read (first {first}) ok {}", res.is_ok())
        }
        other => format!("{other:?}"),
    }
}

fn command_name(c: &Command<Tag, ()>) -> String {
    match c {
        Command::Answer((client, _), reply) => {
            format!("answer client {client}: {}", reply_name(reply))
        }
        Command::Commit { id, batch } => format!(
            "commit batch {id} on lease {}: {}",
            batch.lease_id,
            batch
                .rows
                .iter()
                .map(|r| r.order_id.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        ),
        other => format!("{other:?}"),
    }
}

fn reply_name(r: &Reply) -> String {
    match r {
        Ok(x) if x.replayed => format!("201 (replay) {}", x.reservation.order_id),
        Ok(x) => format!("201 {}", x.reservation.order_id),
        Err(e) => format!("{e:?}"),
    }
}

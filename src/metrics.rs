//! Every metric name and label the service exports lives here, with the helpers that record them.
//! Labels are bounded: outcomes, routes and event kinds, never codes of customers or orders.
//! Per-voucher gauges carry the voucher code: only the vouchers the live numbers pick get them
//! (the hottest here and the watched), and the page ([`render`]) shows only the current pick.
//!
//! Every layer records here, so this module imports none of them: what it is handed is plain
//! numbers, its own label enums, or `domain`'s data.

use std::collections::HashSet;
use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::domain::{BreakerState, Counters, LiveUnits};

pub const RESERVATIONS: &str = "vouchers_reservations_total";
/// [`RESERVATIONS`] per voucher (on sale) and node, a running count set every second by the
/// live numbers.
pub const VOUCHER_RESERVATIONS: &str = "vouchers_voucher_reservations";
pub const REQUEST_SECONDS: &str = "vouchers_http_request_duration_seconds";
pub const SOLD_OUT_SHORT_CIRCUITS: &str = "vouchers_sold_out_short_circuits_total";
pub const LEASE_EVENTS: &str = "vouchers_lease_events_total";
pub const LEASE_GRANTED_UNITS: &str = "vouchers_lease_granted_units_total";
pub const BATCH_SIZE: &str = "vouchers_batch_size";
pub const BATCH_COMMIT_SECONDS: &str = "vouchers_batch_commit_duration_seconds";
pub const LEDGER_COMMITS: &str = "vouchers_ledger_commits_total";
pub const COMMITS_IN_FLIGHT: &str = "vouchers_ledger_commits_in_flight";
pub const COMMIT_BATCHES: &str = "vouchers_ledger_commit_batches";
pub const COMMIT_ROWS: &str = "vouchers_ledger_commit_rows";
pub const COMMIT_SECONDS: &str = "vouchers_ledger_commit_duration_seconds";
pub const LEDGER_ERRORS: &str = "vouchers_ledger_errors_total";
pub const MAILBOX_FULL: &str = "vouchers_mailbox_full_total";
pub const VOUCHER_UNITS: &str = "vouchers_units";
pub const RECONCILE_MISMATCHES: &str = "vouchers_reconcile_mismatches_total";
pub const RECONCILE_BALANCED: &str = "vouchers_reconcile_balanced";
pub const EXPIRED: &str = "vouchers_expired_reservations_total";
pub const ACTIVE_ACTORS: &str = "vouchers_active_actors";
/// How many vouchers of the catalogue have series of their own on this page (`view="shown"`)
/// and how many count only in the node-wide series (`view="not_shown"`): the per-voucher view
/// is capped (`metrics.top_vouchers` hottest here, plus the watched).
pub const VOUCHER_VIEW: &str = "vouchers_voucher_view";
pub const SWITCH: &str = "vouchers_switch";
/// Only in a `heap-count` build (diagnosis): not part of what a serving node exports.
#[cfg(feature = "heap-count")]
pub const HEAP_BYTES: &str = "vouchers_heap_bytes";
pub const KNOWN_CODES_READS: &str = "vouchers_known_codes_reads_total";
pub const RATE_LIMITED: &str = "vouchers_rate_limited_total";
pub const RATE_LIMIT_RESETS: &str = "vouchers_rate_limit_resets_total";
/// Loads of a voucher's per-customer usage into the SQLite writer's memory, and the rows they
/// read (`src/ledger/sqlite/usage.rs`): each stalls the node's commits while it reads.
pub const USAGE_LOADS: &str = "vouchers_ledger_usage_loads_total";
pub const USAGE_LOADED_ROWS: &str = "vouchers_ledger_usage_loaded_rows_total";
/// The SQLite writer's usage counts found off the books (and dropped), or loaded from rows
/// that already disagreed with the books.
pub const USAGE_MISMATCHES: &str = "vouchers_ledger_usage_mismatches_total";
/// The `limiter` labels of [`RATE_LIMITED`].
const LIMITERS: [&str; 3] = ["address", "customer", "voucher"];

/// Outcome label of [`RESERVATIONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Created,
    Replayed,
    OutOfStock,
    AlreadyUsed,
    NotEligible,
    Invalid,
    RateLimited,
    Unavailable,
    NotFound,
}

impl Outcome {
    pub const COUNT: usize = 9;
    /// Every outcome, in [`Outcome::index`] order.
    pub const ALL: [Outcome; Self::COUNT] = OUTCOMES;

    /// This outcome's place in [`Outcome::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Created => "created",
            Self::Replayed => "replayed",
            Self::OutOfStock => "out_of_stock",
            Self::AlreadyUsed => "already_used",
            Self::NotEligible => "not_eligible",
            Self::Invalid => "invalid",
            Self::RateLimited => "rate_limited",
            Self::Unavailable => "unavailable",
            Self::NotFound => "not_found",
        }
    }
}

/// Lease event label of [`LEASE_EVENTS`].
#[derive(Debug, Clone, Copy)]
pub enum LeaseEvent {
    Granted,
    Empty,
    Returned,
    Reaped,
    Renewed,
    Lost,
    Fenced,
    Recalled,
}

impl LeaseEvent {
    fn label(self) -> &'static str {
        match self {
            Self::Granted => "granted",
            Self::Empty => "empty",
            Self::Returned => "returned",
            Self::Reaped => "reaped",
            Self::Renewed => "renewed",
            Self::Lost => "lost",
            Self::Fenced => "fenced",
            Self::Recalled => "recalled",
        }
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];
const SIZE_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Handles of the metrics recorded on every request, resolved once when the recorder is
/// installed: recording through them is an atomic add, not a registry lookup by name and labels.
struct Hot {
    /// One per [`Outcome`], in `OUTCOMES` order.
    reservations: Vec<metrics::Counter>,
    short_circuits: metrics::Counter,
    /// One per route label of [`ROUTES`].
    latency: Vec<metrics::Histogram>,
    batch_size: metrics::Histogram,
    batch_seconds: metrics::Histogram,
}

static HOT: OnceLock<Hot> = OnceLock::new();

/// The `route` labels of [`REQUEST_SECONDS`].
const ROUTES: [&str; 8] = [
    "reserve",
    "reservation",
    "confirm",
    "voucher",
    "admin",
    "metrics",
    "health",
    "other",
];

fn hot() -> Option<&'static Hot> {
    HOT.get()
}

/// How long a gauge stays in /metrics without being set.
const GAUGE_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// How often histogram samples are folded into their buckets when nobody scrapes.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// Histogram samples wait in a queue until the next render or upkeep: without a scraper (the
/// embedded default, or a Prometheus outage) that queue grows with every request. A plain
/// thread folds them in every few seconds, so memory stays flat whether or not anyone scrapes.
fn spawn_upkeep(handle: PrometheusHandle) {
    let spawned = std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(UPKEEP_INTERVAL);
            handle.run_upkeep();
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "metrics upkeep thread did not start");
    }
}

/// The `/metrics` page: every series, except the per-voucher ones of vouchers not `shown` now.
/// A voucher that left the pick keeps its gauges in the recorder until they idle out
/// ([`GAUGE_IDLE_TIMEOUT`]); under traffic that moves the pick every second (a long tail's
/// first reserves, each voucher asked once) that was thousands of vouchers' series on the page
/// (20 new vouchers a second, for ten minutes). The page carries the current pick only: at most
/// `metrics.top_vouchers` and the watched.
pub fn render(handle: &PrometheusHandle, shown: &HashSet<String>) -> String {
    shown_only(&handle.render(), shown)
}

/// `page` without the lines of a per-voucher series whose voucher is not in `shown`.
fn shown_only(page: &str, shown: &HashSet<String>) -> String {
    let mut out = String::with_capacity(page.len());
    for line in page.split_inclusive('\n') {
        match voucher_label(line) {
            Some(code) if !shown.contains(code) => {}
            _ => out.push_str(line),
        }
    }
    out
}

/// The `voucher` label's value of a series line (codes hold no quotes: `domain::valid_code`).
fn voucher_label(line: &str) -> Option<&str> {
    if line.starts_with('#') {
        return None;
    }
    let start = ["{voucher=\"", ",voucher=\""]
        .iter()
        .find_map(|l| line.find(l).map(|at| at + l.len()))?;
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}

/// Installs the process-wide Prometheus recorder once and returns its handle.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                // Gauges nobody set for this long leave /metrics: the per-voucher series of a
                // voucher that ended (the reconciler stops a reservation TTL after its end, the
                // live numbers once it is over). Every other gauge is set at least every few
                // seconds (switches and actors by jobs; Redis by the subscriber's heartbeat and
                // reconnects).
                .idle_timeout(
                    metrics_util::MetricKindMask::GAUGE,
                    Some(GAUGE_IDLE_TIMEOUT),
                )
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), SIZE_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(COMMIT_BATCHES.into()), SIZE_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(COMMIT_ROWS.into()), SIZE_BUCKETS)
                });
            match builder.and_then(|b| b.install_recorder()) {
                Ok(handle) => {
                    register_catalogue();
                    let _ = HOT.set(Hot {
                        reservations: OUTCOMES
                            .iter()
                            .map(|o| counter!(RESERVATIONS, "outcome" => o.label()))
                            .collect(),
                        short_circuits: counter!(SOLD_OUT_SHORT_CIRCUITS),
                        latency: ROUTES
                            .iter()
                            .map(|r| histogram!(REQUEST_SECONDS, "route" => *r))
                            .collect(),
                        batch_size: histogram!(BATCH_SIZE),
                        batch_seconds: histogram!(BATCH_COMMIT_SECONDS),
                    });
                    spawn_upkeep(handle.clone());
                    handle
                }
                // Another recorder is installed (only in odd embeddings): render an empty one.
                Err(_) => PrometheusBuilder::new().build_recorder().handle(),
            }
        })
        .clone()
}

const OUTCOMES: [Outcome; Outcome::COUNT] = [
    Outcome::Created,
    Outcome::Replayed,
    Outcome::OutOfStock,
    Outcome::AlreadyUsed,
    Outcome::NotEligible,
    Outcome::Invalid,
    Outcome::RateLimited,
    Outcome::Unavailable,
    Outcome::NotFound,
];
const LEASE_EVENTS_ALL: [LeaseEvent; 8] = [
    LeaseEvent::Granted,
    LeaseEvent::Empty,
    LeaseEvent::Returned,
    LeaseEvent::Reaped,
    LeaseEvent::Renewed,
    LeaseEvent::Lost,
    LeaseEvent::Fenced,
    LeaseEvent::Recalled,
];
const SIGNAL_KINDS: [&str; 6] = [
    "SOLD_OUT", "RESTOCK", "RECALL", "UPDATED", "SWITCHES", "WARM",
];

/// Declares [`LedgerOp`] with its labels and the list of every variant, from one table: a
/// variant cannot be left out of the list the catalogue registers.
macro_rules! ledger_ops {
    ($($(#[$doc:meta])* $op:ident => $label:literal,)+) => {
        /// A ledger operation that can fail: the `op` label of [`LEDGER_ERRORS`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum LedgerOp {
            $($(#[$doc])* $op,)+
        }

        impl LedgerOp {
            /// Every operation, in declaration order.
            pub const ALL: &'static [LedgerOp] = &[$(LedgerOp::$op,)+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(LedgerOp::$op => $label,)+
                }
            }
        }
    };
}

ledger_ops! {
    LoadVoucher => "load_voucher",
    CommitBatch => "commit_batch",
    Grant => "grant",
    Renew => "renew",
    ReturnLease => "return_lease",
    WonOrders => "won_orders",
    FindOrders => "find_orders",
    /// The listing of a node's active leases after a grant whose answer was lost.
    ActiveLeases => "active_leases",
    Jobs => "jobs",
    /// A grant the ledger refused because it would hand out more than total_limit.
    GrantPastTotal => "grant_past_total",
}

/// Every counter and gauge of the catalogue exists from start-up at zero, so dashboards and
/// alerts see a series (and a rate of zero) before the first event.
fn register_catalogue() {
    for o in OUTCOMES {
        counter!(RESERVATIONS, "outcome" => o.label()).increment(0);
    }
    for e in LEASE_EVENTS_ALL {
        counter!(LEASE_EVENTS, "event" => e.label()).increment(0);
    }
    for op in LedgerOp::ALL {
        counter!(LEDGER_ERRORS, "op" => op.as_str()).increment(0);
    }
    for event in ["published", "received", "dropped"] {
        for kind in SIGNAL_KINDS {
            counter!(SIGNALS, "event" => event, "kind" => kind).increment(0);
        }
    }
    counter!(FEED_RELAYED).increment(0);
    counter!(FEED_RELAY_ERRORS).increment(0);
    counter!(SOLD_OUT_SHORT_CIRCUITS).increment(0);
    counter!(LEASE_GRANTED_UNITS).increment(0);
    counter!(MAILBOX_FULL).increment(0);
    for result in ["ok", "failed"] {
        counter!(LEDGER_COMMITS, "result" => result).increment(0);
    }
    gauge!(COMMITS_IN_FLIGHT).increment(0.0);
    counter!(RECONCILE_MISMATCHES).increment(0);
    counter!(USAGE_LOADS).increment(0);
    counter!(USAGE_LOADED_ROWS).increment(0);
    counter!(USAGE_MISMATCHES).increment(0);
    counter!(BREAKER_OPENED).increment(0);
    counter!(LEDGER_FAILOVERS).increment(0);
    breaker_state(None, BreakerState::Closed);
    counter!(EXPIRED).increment(0);
    counter!(KNOWN_CODES_READS).increment(0);
    switches(false, false);
    for l in LIMITERS {
        counter!(RATE_LIMITED, "limiter" => l).increment(0);
        counter!(RATE_LIMIT_RESETS, "limiter" => l).increment(0);
    }
    actors(0);
}

/// Reserves of one voucher answered on this node, by outcome (a voucher whose sale started: see
/// `live_units`). A gauge holding a running count, set every second: `rate()` reads it like a
/// counter (a new actor starting from zero is a reset), and unlike a counter it leaves
/// `/metrics` once nobody sets it (the voucher ended or went idle).
pub fn voucher_outcomes(code: &str, counts: &[(Outcome, u64)]) {
    for (o, n) in counts {
        gauge!(VOUCHER_RESERVATIONS, "voucher" => code.to_string(), "outcome" => o.label())
            .set(*n as f64);
    }
}

pub fn reservation(outcome: Outcome) {
    reservations(outcome, 1);
}

pub fn reservations(outcome: Outcome, n: u64) {
    if n == 0 {
        return;
    }
    let cached = hot().and_then(|h| {
        let i = OUTCOMES.iter().position(|o| *o == outcome)?;
        h.reservations.get(i)
    });
    match cached {
        Some(c) => c.increment(n),
        None => counter!(RESERVATIONS, "outcome" => outcome.label()).increment(n),
    }
}

pub fn request_latency(route: &'static str, elapsed: Duration) {
    let cached = hot().and_then(|h| {
        let i = ROUTES.iter().position(|r| *r == route)?;
        h.latency.get(i)
    });
    match cached {
        Some(h) => h.record(elapsed.as_secs_f64()),
        None => histogram!(REQUEST_SECONDS, "route" => route).record(elapsed.as_secs_f64()),
    }
}

pub fn sold_out_short_circuit() {
    match hot() {
        Some(h) => h.short_circuits.increment(1),
        None => counter!(SOLD_OUT_SHORT_CIRCUITS).increment(1),
    }
}

pub fn lease(event: LeaseEvent) {
    counter!(LEASE_EVENTS, "event" => event.label()).increment(1);
}

pub fn lease_granted_units(units: i64) {
    counter!(LEASE_GRANTED_UNITS).increment(units.max(0) as u64);
}

pub fn batch(size: usize, elapsed: Duration) {
    match hot() {
        Some(h) => {
            h.batch_size.record(size as f64);
            h.batch_seconds.record(elapsed.as_secs_f64());
        }
        None => {
            histogram!(BATCH_SIZE).record(size as f64);
            histogram!(BATCH_COMMIT_SECONDS).record(elapsed.as_secs_f64());
        }
    }
}

/// A merged transaction of the node-wide group committer goes out ([`merged_commit`] when it
/// ends): the in-flight gauge lets an operator (or a test) see that none is left.
pub fn merged_commit_started() {
    gauge!(COMMITS_IN_FLIGHT).increment(1.0);
}

/// One merged transaction of the node-wide group committer: how many batches (vouchers) and
/// rows it carried, how long it took, and whether it committed.
pub fn merged_commit(batches: usize, rows: usize, elapsed: Duration, ok: bool) {
    gauge!(COMMITS_IN_FLIGHT).decrement(1.0);
    counter!(LEDGER_COMMITS, "result" => if ok { "ok" } else { "failed" }).increment(1);
    histogram!(COMMIT_BATCHES).record(batches as f64);
    histogram!(COMMIT_ROWS).record(rows as f64);
    histogram!(COMMIT_SECONDS).record(elapsed.as_secs_f64());
}

pub fn ledger_error(op: LedgerOp) {
    counter!(LEDGER_ERRORS, "op" => op.as_str()).increment(1);
}

/// A request refused by a rate limit (`limiter`: address, customer or voucher).
pub fn rate_limited(limiter: &'static str) {
    counter!(RATE_LIMITED, "limiter" => limiter).increment(1);
    reservation(Outcome::RateLimited);
}

/// The emergency switches as this node applies them (1: on).
pub fn switches(sales_paused: bool, read_only: bool) {
    gauge!(SWITCH, "switch" => "sales_paused").set(f64::from(u8::from(sales_paused)));
    gauge!(SWITCH, "switch" => "read_only").set(f64::from(u8::from(read_only)));
}

/// The node read every voucher code from the ledger (start-up, or a miss after the interval).
pub fn known_codes_read() {
    counter!(KNOWN_CODES_READS).increment(1);
}

/// A keyed limiter outgrew its bound and started over.
pub fn rate_limit_reset(limiter: &'static str) {
    counter!(RATE_LIMIT_RESETS, "limiter" => limiter).increment(1);
}

pub fn mailbox_full() {
    counter!(MAILBOX_FULL).increment(1);
}

pub fn expired(n: u64) {
    counter!(EXPIRED).increment(n);
}

/// The per-voucher view: `shown` vouchers have series of their own, the rest of the `catalogue`
/// (the voucher codes this node knows) does not.
pub fn voucher_view(shown: usize, catalogue: usize) {
    gauge!(VOUCHER_VIEW, "view" => "shown").set(shown as f64);
    gauge!(VOUCHER_VIEW, "view" => "not_shown").set(catalogue.saturating_sub(shown) as f64);
}

/// `vouchers_heap_bytes{kind}` of a `heap-count` build: `live`, the bytes Rust's allocations
/// hold; `committed`, what mimalloc has committed from the system for them; `glibc`, what
/// glibc's malloc has handed out and not had back (SQLite's page caches and statements).
#[cfg(feature = "heap-count")]
pub fn heap_bytes(live: i64, committed: usize, glibc: usize) {
    gauge!(HEAP_BYTES, "kind" => "live").set(live as f64);
    gauge!(HEAP_BYTES, "kind" => "committed").set(committed as f64);
    gauge!(HEAP_BYTES, "kind" => "glibc").set(glibc as f64);
}

/// Voucher actors on this node (set every second by the live numbers).
pub fn actors(n: usize) {
    gauge!(ACTIVE_ACTORS).set(n as f64);
}

/// The reconciler's verdict on a voucher: the mismatch counter always, the per-voucher series
/// only for a voucher `shown` on `/metrics` (picked, and its sale started).
pub fn reconciled(code: &str, c: &Counters, shown: bool) {
    if !shown {
        if !c.balanced {
            reconcile_mismatch();
        }
        return;
    }
    gauge!(RECONCILE_BALANCED, "voucher" => code.to_string()).set(if c.balanced {
        1.0
    } else {
        0.0
    });
    if !c.balanced {
        reconcile_mismatch();
    }
}

/// One voucher's usage loaded into the SQLite writer's memory, `rows` rows read.
pub fn usage_loaded(rows: i64) {
    counter!(USAGE_LOADS).increment(1);
    counter!(USAGE_LOADED_ROWS).increment(rows.max(0) as u64);
}

/// The SQLite writer's usage counts of a voucher disagreed with its books.
pub fn usage_mismatch() {
    counter!(USAGE_MISMATCHES).increment(1);
}

/// A voucher whose counters do not balance (also for vouchers whose series are not exported).
pub fn reconcile_mismatch() {
    counter!(RECONCILE_MISMATCHES).increment(1);
}

/// `vouchers_units{voucher, kind}` from the live numbers (every second, for every voucher on
/// sale): free, leased_unused, reserved, confirmed, released, total.
pub fn live_units(u: &LiveUnits) {
    for (kind, v) in [
        ("free", u.free),
        ("leased_unused", u.leased_unused),
        ("reserved", u.reserved),
        ("confirmed", u.confirmed),
        ("released", u.released),
        ("total", u.total_limit),
    ] {
        gauge!(VOUCHER_UNITS, "voucher" => u.code.clone(), "kind" => kind).set(v as f64);
    }
}

pub const SIGNALS: &str = "vouchers_signals_total";
pub const REDIS_UP: &str = "vouchers_redis_up";
pub const FEED_RELAYED: &str = "vouchers_feed_relayed_total";
pub const FEED_RELAY_ERRORS: &str = "vouchers_feed_relay_errors_total";

/// Events of the change feed this node copied to the Redis Stream.
pub fn feed_relayed(n: u64) {
    counter!(FEED_RELAYED).increment(n);
}

/// A relay round that failed (Redis or the ledger); the next round tries again.
pub fn feed_relay_error() {
    counter!(FEED_RELAY_ERRORS).increment(1);
}

/// A Redis signal `published`, `received` or `dropped`.
pub fn signal(event: &'static str, kind: &'static str) {
    counter!(SIGNALS, "event" => event, "kind" => kind).increment(1);
}

pub const REDIS_CONFIGURED: &str = "vouchers_redis_configured";

/// Whether this node is configured with Redis at all (the dashboard says "no Redis" rather than
/// nothing on the embedded default).
pub fn redis_configured(yes: bool) {
    gauge!(REDIS_CONFIGURED).set(if yes { 1.0 } else { 0.0 });
}

pub fn redis_up(up: bool) {
    gauge!(REDIS_UP).set(if up { 1.0 } else { 0.0 });
}

pub const BREAKER_STATE: &str = "vouchers_ledger_breaker_state";
/// 1 on the ledger server this node writes to, 0 on the other listed ones (`server` is
/// `host:port` from `ledger.url`, so bounded by the configuration; `embedded` for SQLite).
pub const LEDGER_SERVER: &str = "vouchers_ledger_server";
/// Times this node moved to another ledger server (a promoted standby) since it started.
pub const LEDGER_FAILOVERS: &str = "vouchers_ledger_failovers_total";
pub const BREAKER_OPENED: &str = "vouchers_ledger_breaker_opened_total";

/// The ledger circuit breaker's state: 0 closed, 1 half-open (a probe is out), 2 open. With
/// shards, one series per shard (`shard`: its place in `ledger.shards`, at most 256).
pub fn breaker_state(shard: Option<&str>, state: BreakerState) {
    match shard {
        None => gauge!(BREAKER_STATE).set(state.level()),
        Some(s) => gauge!(BREAKER_STATE, "shard" => s.to_string()).set(state.level()),
    }
}

/// The server this node writes to is `labels[current]`.
pub fn ledger_server(labels: &[&str], current: usize) {
    for (i, label) in labels.iter().enumerate() {
        gauge!(LEDGER_SERVER, "server" => label.to_string()).set(if i == current {
            1.0
        } else {
            0.0
        });
    }
}

/// The node moved to another ledger server.
pub fn ledger_failover() {
    counter!(LEDGER_FAILOVERS).increment(1);
}

/// The breaker opened after failures in a row (a failed probe reopening it is not counted).
pub fn breaker_opened(shard: Option<&str>) {
    match shard {
        None => counter!(BREAKER_OPENED).increment(1),
        Some(s) => counter!(BREAKER_OPENED, "shard" => s.to_string()).increment(1),
    }
}

#[cfg(test)]
mod tests {
    use super::{shown_only, LedgerOp, Outcome};

    #[test]
    fn the_page_keeps_only_the_shown_vouchers_series() {
        let page = "# TYPE vouchers_units gauge\n\
            vouchers_units{voucher=\"HOT\",kind=\"free\"} 3\n\
            vouchers_units{voucher=\"GONE\",kind=\"free\"} 1\n\
            vouchers_reconcile_balanced{voucher=\"GONE\"} 1\n\
            vouchers_voucher_reservations{outcome=\"created\",voucher=\"GONE\"} 2\n\
            vouchers_voucher_view{view=\"not_shown\"} 7\n\
            vouchers_reservations_total{outcome=\"created\"} 9\n";
        let shown = ["HOT".to_string()].into_iter().collect();
        assert_eq!(
            shown_only(page, &shown),
            "# TYPE vouchers_units gauge\n\
            vouchers_units{voucher=\"HOT\",kind=\"free\"} 3\n\
            vouchers_voucher_view{view=\"not_shown\"} 7\n\
            vouchers_reservations_total{outcome=\"created\"} 9\n"
        );
    }

    #[test]
    fn outcomes_are_indexed_in_their_list_order() {
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(o.index(), i, "{o:?}");
        }
    }

    #[test]
    fn ledger_op_labels_are_distinct() {
        let mut labels: Vec<&str> = LedgerOp::ALL.iter().map(|op| op.as_str()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), LedgerOp::ALL.len());
        assert!(labels.contains(&"active_leases"));
    }
}

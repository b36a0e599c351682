//! The deterministic simulator: the engine's quota protocol ([`crate::engine::quota`]) on N
//! nodes against the model ledger ([`crate::ledger::model`]), under one seeded RNG, a simulated
//! clock and a simulated network, with faults injected and the invariants checked after every
//! step. TigerBeetle's VOPR and FoundationDB's simulator are the models.
//!
//! A run is a sequence of **rounds**, each a whole sale with its own seed (derived from the
//! run's): a fresh ledger in 1–3 shards (each voucher on one, each shard a model ledger that can
//! be down or late on its own), 1–4 nodes, 1–3 vouchers, and customers sending reserves through
//! the frontend's path (the sold-out flag first, then the voucher's core). A round has two
//! phases:
//!
//! - **Faults** (3 to 40 simulated seconds): nodes crash (memory lost) and restart as a new
//!   incarnation, pause past their lease TTL, their clocks jump (and follow the ledger's clock
//!   again at their next beat, as on PostgreSQL); ledger calls fail before they apply, apply but
//!   lose their answer, come back late, or commit after their caller was answered 503 (the
//!   committer's deadline); heartbeats fail; signals are dropped (the receiver's link breaks and
//!   comes back), delayed (so reordered), duplicated, or Redis is down for a while; clients retry,
//!   send copies of one order to two nodes and resend after a 201; operators pause sales and
//!   raise totals through a running node; customers release and confirm; reservations expire.
//!   Which faults a round injects is drawn from its seed.
//! - **Calm**: faults stop (nodes up, clocks right, network clean) and new customers keep
//!   coming until every voucher sells out.
//!
//! Checked after every step (see [`check`]): the accounting equation of DESIGN §3 on every
//! voucher the step touched (recomputed by [`check`] from the model's rows, never the production
//! reconciler's verdict); never
//! more units sold than the total; every `201` the clients saw is in the ledger, as the same
//! reservation every time (idempotency by order id); no customer holding more live reservations
//! than the limit; a retry of an order the ledger stored before the retry was sent, still live,
//! is never refused (one case excused: a sold-out flag answering `OUT_OF_STOCK` while a `RESTOCK`
//! published before that order was stored was on its way to the node, the design's
//! asynchronous window). And liveness: in the calm phase every voucher
//! sells 100 % within [`LIVENESS_MS`] of simulated time, no reserve waits past its deadline, and
//! none is answered 503 after a short grace.
//!
//! A round that breaks an invariant (or makes the model ledger panic on a CHECK constraint)
//! stops there. The runner then **shrinks** it: it turns off each fault kind in turn and keeps
//! it off while the round still fails, replays the smallest failing round with tracing on, and
//! prints the trace trimmed to the failing voucher, with a one-line command that replays it.

mod check;
mod faults;
mod rng;
mod world;

use std::future::Future;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

pub use faults::{Fault, Faults};

use crate::clock::Millis;

/// Runs the model ledger's futures: they never wait (every call is a step under one lock).
fn ready<F: Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("the model ledger never waits"),
    }
}

/// In the calm phase every voucher must sell out within this much simulated time.
pub const LIVENESS_MS: Millis = 10_000;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The run's seed; round `i` runs with [`round_seed`]`(seed, i)`.
    pub seed: u64,
    /// Stop after this many steps (whole rounds: the last one ends).
    pub steps: u64,
    /// Stop after this many rounds.
    pub rounds: u64,
    /// The fault kinds rounds may draw from.
    pub faults: Faults,
    /// Replay exactly this round seed (one round), as a failure printed it.
    pub replay: Option<u64>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            seed: 1,
            steps: u64::MAX,
            rounds: u64::MAX,
            faults: Faults::all(),
            replay: None,
        }
    }
}

/// A broken invariant.
#[derive(Debug, Clone)]
pub struct Violation {
    pub round_seed: u64,
    pub faults: Faults,
    pub at_ms: Millis,
    pub step: u64,
    pub what: String,
    /// The voucher involved, if one is: the trace is trimmed to it.
    pub code: Option<String>,
    /// The trimmed trace of the shrunk round.
    pub trace: Vec<String>,
}

impl Violation {
    /// The one-line command that replays this failure.
    pub fn replay_command(&self) -> String {
        format!(
            "cargo run --release --bin simulate -- --replay {} --faults {}",
            self.round_seed,
            self.faults.names()
        )
    }
}

/// What a run did.
#[derive(Debug, Default)]
pub struct Report {
    pub rounds: u64,
    pub steps: u64,
    pub checks: u64,
    pub violations: Vec<Violation>,
    pub elapsed_secs: f64,
    /// Units sold when each voucher's calm phase ended (at its sell-out, or at the liveness
    /// deadline), and units offered then: the calm phases' sell-through.
    pub sold: i64,
    pub offered: i64,
    pub reserves: u64,
    pub faults_injected: u64,
}

impl Report {
    pub fn steps_per_sec(&self) -> f64 {
        self.steps as f64 / self.elapsed_secs.max(1e-9)
    }

    /// `N steps, N invariant checks, N violations, N steps/s`.
    pub fn last_line(&self) -> String {
        format!(
            "{} steps, {} invariant checks, {} violations, {:.0} steps/s",
            self.steps,
            self.checks,
            self.violations.len(),
            self.steps_per_sec()
        )
    }
}

/// The seed of round `i` of a run seeded `seed` (splitmix64).
pub fn round_seed(seed: u64, i: u64) -> u64 {
    rng::Rng::new(seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next()
}

/// Runs rounds until the step or round budget is spent, or one fails (it is then shrunk).
pub fn run(opts: &Options) -> Report {
    let started = Instant::now();
    let mut report = Report::default();
    let mut i = 0;
    while report.steps < opts.steps && report.rounds < opts.rounds {
        let seed = opts.replay.unwrap_or_else(|| round_seed(opts.seed, i));
        i += 1;
        let outcome = world::run_round(seed, opts.faults, false);
        report.rounds += 1;
        report.steps += outcome.steps;
        report.checks += outcome.checks;
        report.sold += outcome.sold;
        report.offered += outcome.offered;
        report.reserves += outcome.reserves;
        report.faults_injected += outcome.faults_injected;
        if let Some(v) = outcome.violation {
            report.violations.push(shrink(v));
            break;
        }
        if opts.replay.is_some() {
            break;
        }
    }
    report.elapsed_secs = started.elapsed().as_secs_f64();
    report
}

/// Turns off each fault kind the failing round used while it still fails, then replays the
/// smallest failing round with tracing on and keeps the trace of the failing voucher.
fn shrink(mut v: Violation) -> Violation {
    for kind in v.faults.kinds() {
        let fewer = v.faults.without(kind);
        if let Some(smaller) = world::run_round(v.round_seed, fewer, false).violation {
            v = smaller;
        }
    }
    let traced = world::run_round(v.round_seed, v.faults, true);
    match traced.violation {
        Some(t) => {
            let trace = trim(&t.trace, t.code.as_deref());
            Violation { trace, ..t }
        }
        None => v,
    }
}

/// The lines of `trace` that concern `code` or no voucher at all (crashes, pauses, clock jumps,
/// switches, reaps), the last [`TRACE_LINES`] of them.
fn trim(trace: &[String], code: Option<&str>) -> Vec<String> {
    // Every code of a round ends with the round's own suffix (`V1S4242`: `S4242`).
    let suffix = code.and_then(|c| c.find('S').map(|i| &c[i..]));
    let keep: Vec<&String> = trace
        .iter()
        .filter(|l| match (code, suffix) {
            (Some(c), Some(s)) => l.contains(c) || !l.contains(s),
            _ => true,
        })
        .collect();
    let lines = std::env::var("SIM_TRACE_LINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(TRACE_LINES);
    let from = keep.len().saturating_sub(lines);
    keep[from..].iter().map(|s| s.to_string()).collect()
}

/// How many lines of a failing round's trimmed trace are printed (`SIM_TRACE_LINES` overrides).
const TRACE_LINES: usize = 80;

#[cfg(test)]
mod tests {
    use super::*;

    /// The CI budget: a fixed run of seeds, every fault kind (about 30 s on a 2-core machine
    /// in a debug build, beside the rest of the suite).
    #[test]
    fn a_fixed_budget_of_seeds_breaks_no_invariant() {
        // `SIM_ROUNDS` shortens it (mutation testing runs the suite once per mutant).
        let rounds = std::env::var("SIM_ROUNDS")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(400);
        let report = run(&Options {
            seed: 20261130,
            rounds,
            ..Options::default()
        });
        for v in &report.violations {
            eprintln!("{}\n{}", v.what, v.trace.join("\n"));
            eprintln!("replay: {}", v.replay_command());
        }
        assert!(report.violations.is_empty(), "{}", report.last_line());
        assert_eq!(report.rounds, rounds);
        assert!(report.sold > 0 && report.sold == report.offered);
        assert!(report.faults_injected > 0);
    }

    /// Regression seeds: each failed before the fix named.
    /// A trace line's node, voucher and what follows (`node 2 V0S1 <- granted …`).
    fn parts(line: &str) -> Option<(&str, &str, &str)> {
        let rest = line.split_once(" ms  node ")?.1;
        let (node, rest) = rest.split_once(' ')?;
        let (code, what) = rest.split_once(' ')?;
        Some((node, code.trim_end_matches(':'), what))
    }

    /// A line `to` for the same node and voucher comes after a line `from`, with a line `between`
    /// of theirs in the middle (any, when `between` is empty).
    fn in_order(trace: &[String], from: &str, between: &str, to: &str) -> bool {
        trace.iter().enumerate().any(|(i, l)| {
            let Some((n, c, w)) = parts(l) else {
                return false;
            };
            if !w.starts_with(from) {
                return false;
            }
            let mut seen_between = between.is_empty();
            for later in &trace[i + 1..] {
                match parts(later) {
                    Some((n2, c2, w2)) if n2 == n && c2 == c => {
                        if w2.starts_with(between) && !between.is_empty() {
                            seen_between = true;
                        } else if w2.starts_with(to) {
                            return seen_between;
                        }
                    }
                    _ => {}
                }
            }
            false
        })
    }

    /// What each regression seed was filed for, as a predicate on its round's trace: a seed
    /// whose round no longer reaches it (a change to the order of RNG draws moves every round)
    /// fails loudly instead of passing without exercising its bug.
    fn failed_return(t: &[String]) -> bool {
        t.iter()
            .any(|l| l.contains("<- Returned {") && l.contains("ok: false"))
    }
    fn lost_grant_then_listing_with_leases(t: &[String]) -> bool {
        in_order(t, "<- granted Err", "", "<- Found(Ok([")
            && t.iter().any(|l| {
                l.split_once("<- Found(Ok([")
                    .is_some_and(|(_, r)| r.starts_with(|c: char| c.is_ascii_digit()))
            })
    }
    fn second_failure_while_listing_out(t: &[String]) -> bool {
        in_order(t, "-> FindLeases", "<- granted Err", "<- Found")
    }
    /// A core told of a reload (`UPDATED`) whose first read then fails, and that stops.
    fn reload_then_failed_first_read_then_stop(t: &[String]) -> bool {
        in_order(
            t,
            "hears Updated",
            "<- voucher read (first true) ok false",
            "-> Stop",
        )
    }
    /// A node whose sold-out flag answered, its signal link down, sends a reserve of that
    /// voucher to the ledger instead of answering from the flag.
    fn flag_not_trusted_while_unlinked(t: &[String]) -> bool {
        let mut unlinked = std::collections::BTreeSet::new();
        let mut flagged = std::collections::BTreeSet::new();
        t.iter().any(|l| {
            let Some(rest) = l.split_once(" ms  node ").map(|(_, r)| r) else {
                return false;
            };
            let node = rest.split(' ').next().unwrap_or("");
            if rest.ends_with("loses its signal link") {
                unlinked.insert(node.to_string());
            } else if rest.ends_with("links again") {
                unlinked.remove(node);
            }
            let Some((n, code, what)) = parts(l) else {
                return false;
            };
            if what.ends_with("answered from the flag") {
                flagged.insert((n.to_string(), code.to_string()));
            }
            what.starts_with("-> Lookup")
                && unlinked.contains(n)
                && flagged.contains(&(n.to_string(), code.to_string()))
        })
    }
    fn listing_answered_while_a_grant_was_out(t: &[String]) -> bool {
        in_order(t, "-> FindLeases", "-> Grant", "<- Found(Ok([")
    }
    fn clock_jump_of_seconds(t: &[String]) -> bool {
        t.iter().any(|l| {
            l.split_once("clock jumps ")
                .and_then(|(_, r)| r.trim_end_matches(" ms").parse::<i64>().ok())
                .is_some_and(|ms| ms.abs() >= 5000)
        })
    }

    /// A holder reaped while it was paused asks for a grant before its next beat has recorded
    /// it again, and is refused.
    fn reaped_holder_refused_a_grant(t: &[String]) -> bool {
        t.iter()
            .position(|l| l.contains(" reaps "))
            .is_some_and(|i| t[i..].iter().any(|l| l.contains("NotLive")))
    }

    type Reaches = fn(&[String]) -> bool;

    #[test]
    fn regression_seeds_hold() {
        let seeds: [(u64, &str, &str, Reaches); 8] = [
            // A return that failed while the idle core stopped in the same tick: the lease kept
            // its units until its TTL. Returns are now answered; a failed one is retried, and a
            // core does not stop while one is in flight.
            // (Its first seeds, 12547834261842864952 with `ledger-fail` and 13540708610925415132,
            // stopped failing a return: re-picked with `seeds_reaching`, the second time after
            // cores stopped re-reading definitions nobody asked for.)
            (
                2766307388729113274,
                "ledger-fail,release",
                "failed return stranded units",
                failed_return,
            ),
            // A grant whose answer was lost left a lease no core knew of until its TTL. A failed
            // grant is now followed by a listing of the node's leases; unknown ones go back.
            (
                14132286811622812841,
                "crash,ledger-lost,signal-dup,switches",
                "lost grant answer stranded units",
                lost_grant_then_listing_with_leases,
            ),
            // A second grant failed while that listing was out: the listing must not clear the
            // check the second failure asked for.
            // (Its first seeds, 12021778221612618265, 12009981336541799024 and
            // 14553950063185975115, stopped having a grant fail while a listing is out:
            // re-picked with `seeds_reaching`, the last time with `SEED_SCAN_ROUNDS=3000` after
            // a cold core's first grant went into its first read.)
            (
                10369396081915058627,
                "ledger-lost,ledger-slow",
                "listing cleared a newer failure's check",
                second_failure_while_listing_out,
            ),
            // A reload reached a new core before its first read, which then failed: the core
            // stopped with a grant in flight, whose lease nobody served until its TTL. (The
            // round reaches the reload, the failed first read and the stop; the grant in
            // flight is no longer drawn, and a scan of 400 seeds found no round that draws it.
            // Re-picked with `seeds_reaching` after cores stopped re-reading definitions
            // nobody asked for: 12493531915866343102 no longer reached the stop; and again,
            // 2959352562695820255 and 2030832850625747548, after a cold core's first grant went
            // into its first read and a core kept to settle a lost one stopped calling on ticks.)
            (
                13859604220557459431,
                "pause,ledger-fail,ledger-lost,ledger-slow,signal-drop,copies,switches,raise,release,confirm",
                "stop with a grant in flight",
                reload_then_failed_first_read_then_stop,
            ),
            // With Redis down, a sold-out flag that missed a RESTOCK refused a winner's retry.
            // Flags now answer only while the link is up: the round reaches a flagged voucher's
            // reserve going to the ledger with the link down.
            (
                3432157241784470725,
                "redis-down,copies",
                "stale flag while unlinked",
                flag_not_trusted_while_unlinked,
            ),
            // Under steady demand a grant was nearly always out when the lease listing came
            // back, so the listing was thrown away again and again and a lost grant's lease
            // waited for its TTL. The listing is now settled when that grant answers.
            // (Its first seeds, 9358027812662690846 and 9219112618581991474, no longer had a
            // grant out when a listing came back: re-picked with `seeds_reaching`.)
            (
                6387777158891554393,
                "crash,ledger-lost,ledger-slow,copies,release",
                "listing discarded while grants were out",
                listing_answered_while_a_grant_was_out,
            ),
            // A clock 8 s ahead set a 200 ms hold; the clock came back and the hold lasted 8 s
            // (every reserve 503). Timers are now clamped to their length when time goes back.
            (
                6850249337611827211,
                "pause,clock,ledger-fail,ledger-slow,raise",
                "backward clock jump stretched a hold",
                clock_jump_of_seconds,
            ),
            // A holder reaped while paused took leases when it resumed, then crashed before
            // its next beat: no row, so no beat listed it, and its units waited for the lease
            // TTL (30 s). A grant now needs the holder's live row.
            (
                5693623272484113371,
                "crash,pause,ledger-fail,ledger-lost,signal-drop,signal-dup,redis-down,raise,confirm",
                "reaped holder's grants stranded units",
                reaped_holder_refused_a_grant,
            ),
        ];
        let mut lost = Vec::new();
        for (seed, faults, found, reaches) in seeds {
            let faults = Faults::parse(faults).expect("fault kinds");
            let (out, trace) = world::run_round_traced(seed, faults, true);
            assert!(
                out.violation.is_none(),
                "{found}: {:?}",
                out.violation.map(|v| v.what)
            );
            if !reaches(&trace) {
                lost.push((seed, found));
            }
        }
        assert!(
            lost.is_empty(),
            "regression seeds that no longer reach what they were filed for (find new ones \
             with `simulate`, or a scan like `seeds_reaching` below): {lost:?}"
        );
    }

    /// Finds rounds that reach what a regression seed is filed for, without a violation, for
    /// when `regression_seeds_hold` says a seed no longer does: `SEED_SCAN=<kind>` (one of the
    /// `found` texts there) `cargo test --lib seeds_reaching -- --ignored --nocapture`
    /// (`SEED_SCAN_ROUNDS`, 400 by default, rounds per kind).
    #[test]
    #[ignore = "a tool: run by hand"]
    fn seeds_reaching() {
        let want = std::env::var("SEED_SCAN").unwrap_or_default();
        let wanted: [(&str, &str, Reaches); 5] = [
            (
                "failed return stranded units",
                "ledger-fail,release",
                failed_return,
            ),
            (
                "listing cleared a newer failure's check",
                "ledger-lost,ledger-slow",
                second_failure_while_listing_out,
            ),
            (
                "stop with a grant in flight",
                "pause,ledger-fail,ledger-lost,ledger-slow,signal-drop,copies,switches,raise,\
                 release,confirm",
                reload_then_failed_first_read_then_stop,
            ),
            (
                "stale flag while unlinked",
                "redis-down,copies",
                flag_not_trusted_while_unlinked,
            ),
            (
                "listing discarded while grants were out",
                "crash,ledger-lost,ledger-slow,copies,release",
                listing_answered_while_a_grant_was_out,
            ),
        ];
        let rounds: usize = std::env::var("SEED_SCAN_ROUNDS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(400);
        let mut rng = rng::Rng::new(0x5eed);
        for (found, faults, reaches) in wanted {
            if !want.is_empty() && want != found {
                continue;
            }
            let faults = Faults::parse(faults).expect("fault kinds");
            let hit = (0..rounds).map(|_| rng.next()).find(|&seed| {
                let (out, trace) = world::run_round_traced(seed, faults, true);
                out.violation.is_none() && reaches(&trace)
            });
            eprintln!("{found}: {hit:?}");
        }
    }

    #[test]
    fn a_round_is_a_function_of_its_seed() {
        let a = world::run_round(7, Faults::all(), false);
        let b = world::run_round(7, Faults::all(), false);
        assert_eq!((a.steps, a.checks, a.sold), (b.steps, b.checks, b.sold));
        let c = world::run_round(8, Faults::all(), false);
        assert_ne!((a.steps, a.checks), (c.steps, c.checks));
    }
}

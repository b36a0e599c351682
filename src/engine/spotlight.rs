//! Which vouchers get series of their own on this node's `/metrics`: the hottest by recent
//! traffic (at most `metrics.top_vouchers`) among the vouchers with an actor here, and every
//! voucher an operator watches (`metrics.watch`, or `PUT /admin/vouchers/{code}/watch`).
//! Everything else counts only in the node-wide series, and `vouchers_voucher_view` says how
//! many vouchers that is: the page stays bounded however many vouchers are on sale.
//!
//! A voucher's heat is the reserves answered for it since the last pick, plus half its heat at
//! that pick: a burst counts for a few rounds, a voucher nobody asks for fades out.

use std::cmp::{Ordering as Order, Reverse};
use std::collections::{BinaryHeap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The pick, kept between rounds of the live numbers.
pub(crate) struct Spotlight {
    /// The most vouchers picked for their traffic.
    top: usize,
    /// Watched by configuration, whatever the ledger says.
    configured: Vec<String>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// What the last pick exported (the picked vouchers whose sale started).
    shown: HashSet<String>,
}

/// A voucher's standing in the pick, kept in its shared state rather than in a map of the
/// spotlight's: with tens of thousands of vouchers just touched, a pick that copied every code
/// into a map and sorted them all kept a core busy. Written only by the pick in progress.
#[derive(Debug, Default)]
pub(crate) struct Heat {
    /// Reserves answered for the voucher at the last pick.
    answered: AtomicU64,
    /// Its heat then, as `f64` bits.
    heat: AtomicU64,
}

/// A voucher in the running for the top: hotter is greater, and between equals the smaller code.
struct Ranked {
    heat: f64,
    code: String,
}

impl Ranked {
    fn beats(heat: f64, code: &str, other: &Ranked) -> bool {
        heat.total_cmp(&other.heat)
            .then_with(|| other.code.as_str().cmp(code))
            .is_gt()
    }
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Order::Equal
    }
}
impl Eq for Ranked {}
impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Order> {
        Some(self.cmp(other))
    }
}
impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Order {
        self.heat
            .total_cmp(&other.heat)
            .then_with(|| other.code.cmp(&self.code))
    }
}

/// One pick in progress: every voucher with an actor here is offered once, then
/// [`Picker::finish`] adds the watched ones.
pub(crate) struct Picker<'a> {
    spotlight: &'a Spotlight,
    /// Held so that two picks never interleave their writes to [`Heat`].
    _state: MutexGuard<'a, State>,
    /// The `top` hottest so far, coldest first out.
    top: BinaryHeap<Reverse<Ranked>>,
    /// Reserves answered since the last pick by the vouchers offered so far.
    answered: u64,
}

impl Picker<'_> {
    /// Offers a voucher with the reserves answered for it so far on this node. Its heat is
    /// what it answered since the last pick plus half its heat then; a voucher new to the
    /// pick counts everything it answered so far.
    pub(crate) fn offer(&mut self, code: &str, answered: u64, standing: &Heat) {
        let before = standing.answered.swap(answered, Ordering::Relaxed);
        let was = f64::from_bits(standing.heat.load(Ordering::Relaxed));
        let since = answered.saturating_sub(before);
        self.answered = self.answered.saturating_add(since);
        let heat = since as f64 + was / 2.0;
        standing.heat.store(heat.to_bits(), Ordering::Relaxed);
        let k = self.spotlight.top;
        if k == 0 {
            return;
        }
        if self.top.len() == k {
            match self.top.peek() {
                Some(Reverse(coldest)) if Ranked::beats(heat, code, coldest) => {
                    self.top.pop();
                }
                _ => return,
            }
        }
        self.top.push(Reverse(Ranked {
            heat,
            code: code.to_string(),
        }));
    }

    /// Reserves the vouchers offered so far answered since the last pick (a voucher new to the
    /// pick: since its actor started): whether the node is quiet.
    pub(crate) fn answered(&self) -> u64 {
        self.answered
    }

    /// The vouchers to show until the next pick: the hottest offered, then every watched one
    /// (`watched`, from the ledger, and the configured ones), in code order. What is exported
    /// of them is told back with [`Spotlight::exported`].
    pub(crate) fn finish(self, watched: &[String]) -> Vec<String> {
        let mut picked: HashSet<String> = self.top.into_iter().map(|Reverse(r)| r.code).collect();
        picked.extend(watched.iter().cloned());
        picked.extend(self.spotlight.configured.iter().cloned());
        let mut codes: Vec<String> = picked.into_iter().collect();
        codes.sort();
        codes
    }
}

impl Spotlight {
    pub(crate) fn new(top: usize, configured: Vec<String>) -> Self {
        Self {
            top,
            configured,
            state: Mutex::new(State::default()),
        }
    }

    /// Starts a pick: offer it every voucher with an actor here, then finish it. The work is
    /// one atomic swap per voucher and a heap of `top`: a code is copied only while it ranks.
    pub(crate) fn picker(&self) -> Picker<'_> {
        Picker {
            spotlight: self,
            _state: self.state.lock().unwrap_or_else(|e| e.into_inner()),
            top: BinaryHeap::with_capacity(self.top + 1),
            answered: 0,
        }
    }

    /// The picked vouchers that were exported (their sale started): the reconciler gives these
    /// a verdict series of their own until the next pick.
    pub(crate) fn exported<'a>(&self, codes: impl Iterator<Item = &'a str>) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).shown =
            codes.map(str::to_string).collect();
    }

    /// What the last pick exported.
    pub(crate) fn shown(&self) -> Vec<String> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.shown.iter().cloned().collect()
    }

    /// Whether the last pick exported `code`.
    pub(crate) fn shows(&self, code: &str) -> bool {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .shown
            .contains(code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A pick over `active`, each voucher's standing kept in `heat` between picks (a voucher
    /// missing from `active` left the node: its standing goes with it).
    fn pick(
        s: &Spotlight,
        heat: &mut HashMap<String, Heat>,
        active: &[(&str, u64)],
        watched: &[&str],
    ) -> Vec<String> {
        heat.retain(|c, _| active.iter().any(|(a, _)| a == c));
        let mut p = s.picker();
        for (code, answered) in active {
            p.offer(code, *answered, heat.entry(code.to_string()).or_default());
        }
        let watched: Vec<String> = watched.iter().map(|c| c.to_string()).collect();
        p.finish(&watched)
    }

    #[test]
    fn the_hottest_and_the_watched_are_shown_and_nothing_else() {
        let s = Spotlight::new(2, vec!["CONF".into()]);
        let mut h = HashMap::new();
        // First pick: everyone's heat is zero; ties go by code.
        assert_eq!(
            pick(&s, &mut h, &[("A", 0), ("B", 0), ("C", 0)], &["W"]),
            ["A", "B", "CONF", "W"]
        );
        // C gets the traffic: it is shown, the coldest of the others is not.
        assert_eq!(
            pick(&s, &mut h, &[("A", 5), ("B", 0), ("C", 100)], &[]),
            ["A", "C", "CONF"]
        );
        s.exported(["A", "C"].into_iter());
        assert!(s.shows("C") && !s.shows("B"));
        // Traffic moves to B; C's heat halves each round without it.
        assert_eq!(
            pick(&s, &mut h, &[("A", 5), ("B", 80), ("C", 100)], &[]),
            ["B", "C", "CONF"]
        );
        assert_eq!(
            pick(&s, &mut h, &[("A", 5), ("B", 200), ("C", 100)], &[]),
            ["B", "C", "CONF"]
        );
        // A voucher that left the node (its actor stopped) is forgotten.
        assert_eq!(pick(&s, &mut h, &[("A", 5)], &[]), ["A", "CONF"]);
    }

    #[test]
    fn a_pick_counts_the_reserves_answered_since_the_last_one() {
        let s = Spotlight::new(1, Vec::new());
        let (a, b) = (Heat::default(), Heat::default());
        let mut p = s.picker();
        p.offer("A", 7, &a);
        assert_eq!(
            p.answered(),
            7,
            "a voucher new to the pick counts all it answered"
        );
        drop(p);
        let mut p = s.picker();
        p.offer("A", 7, &a);
        assert_eq!(p.answered(), 0, "quiet since");
        p.offer("B", 3, &b);
        assert_eq!(p.answered(), 3);
        drop(p);
        let mut p = s.picker();
        p.offer("A", 9, &a);
        p.offer("B", 3, &b);
        assert_eq!(p.answered(), 2);
    }
}

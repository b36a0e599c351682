//! Which vouchers get series of their own on this node's `/metrics`: the hottest by recent
//! traffic (at most `metrics.top_vouchers`) among the vouchers with an actor here, and every
//! voucher an operator watches (`metrics.watch`, or `PUT /admin/vouchers/{code}/watch`).
//! Everything else counts only in the node-wide series, and `vouchers_voucher_view` says how
//! many vouchers that is: the page stays bounded however many vouchers are on sale.
//!
//! A voucher's heat is the reserves answered for it since the last pick, plus half its heat at
//! that pick: a burst counts for a few rounds, a voucher nobody asks for fades out.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

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
    /// Per voucher with an actor here: its answered reserves at the last pick, and its heat.
    heat: HashMap<String, (u64, f64)>,
    /// What the last pick exported (the picked vouchers whose sale started).
    shown: HashSet<String>,
}

impl Spotlight {
    pub(crate) fn new(top: usize, configured: Vec<String>) -> Self {
        Self {
            top,
            configured,
            state: Mutex::new(State::default()),
        }
    }

    /// Picks the vouchers to show until the next pick: the `top` hottest of `active` (each a
    /// code with the reserves answered for it so far on this node), then every watched one
    /// (`watched`, from the ledger, and the configured ones). Returns them in code order; what
    /// is exported of them is told back with [`Spotlight::exported`].
    pub(crate) fn pick<'a>(
        &self,
        active: impl Iterator<Item = (&'a str, u64)>,
        watched: &[String],
    ) -> Vec<String> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut heat: HashMap<String, (u64, f64)> = HashMap::new();
        for (code, answered) in active {
            // A voucher new to the pick counts everything it answered so far.
            let (before, was) = state.heat.get(code).copied().unwrap_or((0, 0.0));
            let now = answered.saturating_sub(before) as f64 + was / 2.0;
            heat.insert(code.to_string(), (answered, now));
        }
        let mut ranked: Vec<(&String, f64)> = heat.iter().map(|(c, (_, h))| (c, *h)).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        let mut picked: HashSet<String> = ranked
            .into_iter()
            .take(self.top)
            .map(|(c, _)| c.clone())
            .collect();
        picked.extend(watched.iter().cloned());
        picked.extend(self.configured.iter().cloned());
        state.heat = heat;
        let mut codes: Vec<String> = picked.into_iter().collect();
        codes.sort();
        codes
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

    fn pick(s: &Spotlight, active: &[(&str, u64)], watched: &[&str]) -> Vec<String> {
        let watched: Vec<String> = watched.iter().map(|c| c.to_string()).collect();
        s.pick(active.iter().copied(), &watched)
    }

    #[test]
    fn the_hottest_and_the_watched_are_shown_and_nothing_else() {
        let s = Spotlight::new(2, vec!["CONF".into()]);
        // First pick: everyone's heat is zero; ties go by code.
        assert_eq!(
            pick(&s, &[("A", 0), ("B", 0), ("C", 0)], &["W"]),
            ["A", "B", "CONF", "W"]
        );
        // C gets the traffic: it is shown, the coldest of the others is not.
        assert_eq!(
            pick(&s, &[("A", 5), ("B", 0), ("C", 100)], &[]),
            ["A", "C", "CONF"]
        );
        s.exported(["A", "C"].into_iter());
        assert!(s.shows("C") && !s.shows("B"));
        // Traffic moves to B; C's heat halves each round without it.
        assert_eq!(
            pick(&s, &[("A", 5), ("B", 80), ("C", 100)], &[]),
            ["B", "C", "CONF"]
        );
        assert_eq!(
            pick(&s, &[("A", 5), ("B", 200), ("C", 100)], &[]),
            ["B", "C", "CONF"]
        );
        // A voucher that left the node (its actor stopped) is forgotten.
        assert_eq!(pick(&s, &[("A", 5)], &[]), ["A", "CONF"]);
    }
}

//! The per-voucher state the HTTP frontend reads without messaging the actor: the sold-out flag
//! and the set of orders that won (DESIGN §5), so that a retry of a winning order still gets its
//! `201` after the voucher sold out while everyone else is answered by a memory read.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::RwLock;

/// Shared between a voucher's actor (writer) and the frontend (reader).
#[derive(Debug, Default)]
pub struct VoucherShared {
    sold_out: AtomicBool,
    /// Bumped on every restock; an actor only raises the flag if no restock happened since it
    /// saw the ledger empty, so a release racing the sold-out decision is never lost.
    restock_epoch: AtomicU64,
    won: RwLock<WonSet>,
    /// Reserves answered here without a message to the actor, for tests and diagnostics.
    short_circuits: AtomicU64,
}

#[derive(Debug, Default)]
enum WonSet {
    #[default]
    Empty,
    Exact(HashSet<String>),
    /// Large sales: a Bloom filter. A miss is certain; a hit is checked against the ledger.
    Bloom(Bloom),
}

impl VoucherShared {
    pub fn is_sold_out(&self) -> bool {
        self.sold_out.load(Ordering::Acquire)
    }

    pub fn restock_epoch(&self) -> u64 {
        self.restock_epoch.load(Ordering::Acquire)
    }

    /// Raises the flag with the winning orders, unless a restock happened after `epoch`.
    /// Returns whether the flag is now up.
    pub fn set_sold_out(&self, epoch: u64, won: Vec<String>, exact_max: usize) -> bool {
        let mut guard = self.won.write().unwrap_or_else(|e| e.into_inner());
        if self.restock_epoch() != epoch {
            return false;
        }
        *guard = if won.len() <= exact_max {
            WonSet::Exact(won.into_iter().collect())
        } else {
            let mut bloom = Bloom::with_capacity(won.len());
            won.iter().for_each(|o| bloom.insert(o));
            WonSet::Bloom(bloom)
        };
        self.sold_out.store(true, Ordering::Release);
        true
    }

    /// Units came back: the frontend sends traffic to the actor again.
    pub fn restock(&self) {
        let mut guard = self.won.write().unwrap_or_else(|e| e.into_inner());
        self.restock_epoch.fetch_add(1, Ordering::AcqRel);
        self.sold_out.store(false, Ordering::Release);
        *guard = WonSet::Empty;
    }

    pub fn count_short_circuit(&self) {
        self.short_circuits.fetch_add(1, Ordering::Relaxed);
    }

    pub fn short_circuits(&self) -> u64 {
        self.short_circuits.load(Ordering::Relaxed)
    }

    /// Whether `order_id` may be a winner of this voucher: false is certain, true needs the ledger.
    pub fn may_have_won(&self, order_id: &str) -> bool {
        match &*self.won.read().unwrap_or_else(|e| e.into_inner()) {
            WonSet::Empty => false,
            WonSet::Exact(set) => set.contains(order_id),
            WonSet::Bloom(bloom) => bloom.may_contain(order_id),
        }
    }
}

/// A plain Bloom filter: ten bits and seven probes per element, about 1% false positives.
#[derive(Debug)]
struct Bloom {
    bits: Vec<u64>,
}

const BLOOM_PROBES: u64 = 7;

impl Bloom {
    fn with_capacity(n: usize) -> Self {
        let words = (n.max(1) * 10).div_ceil(64);
        Self {
            bits: vec![0; words],
        }
    }

    fn probes(&self, item: &str) -> impl Iterator<Item = usize> {
        let hash = |seed: u64| {
            let mut h = DefaultHasher::new();
            seed.hash(&mut h);
            item.hash(&mut h);
            h.finish()
        };
        let (a, b) = (hash(0x9e37_79b9), hash(0x85eb_ca6b) | 1);
        let m = (self.bits.len() * 64) as u64;
        (0..BLOOM_PROBES).map(move |i| (a.wrapping_add(i.wrapping_mul(b)) % m) as usize)
    }

    fn insert(&mut self, item: &str) {
        let probes: Vec<usize> = self.probes(item).collect();
        for bit in probes {
            self.bits[bit / 64] |= 1 << (bit % 64);
        }
    }

    fn may_contain(&self, item: &str) -> bool {
        self.probes(item)
            .all(|bit| self.bits[bit / 64] & (1 << (bit % 64)) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_holds_the_winners_and_restock_clears_it() {
        let s = VoucherShared::default();
        let epoch = s.restock_epoch();
        assert!(s.set_sold_out(epoch, vec!["a".into()], 10));
        assert!(s.is_sold_out());
        assert!(s.may_have_won("a"));
        assert!(!s.may_have_won("b"));
        s.restock();
        assert!(!s.is_sold_out());
        assert!(!s.may_have_won("a"));
    }

    #[test]
    fn a_restock_after_the_decision_keeps_the_flag_down() {
        let s = VoucherShared::default();
        let epoch = s.restock_epoch();
        s.restock();
        assert!(!s.set_sold_out(epoch, vec![], 10));
        assert!(!s.is_sold_out());
    }

    #[test]
    fn large_sets_use_a_bloom_filter_without_false_negatives() {
        let s = VoucherShared::default();
        let won: Vec<String> = (0..5000).map(|i| format!("order-{i}")).collect();
        assert!(s.set_sold_out(0, won.clone(), 100));
        assert!(won.iter().all(|o| s.may_have_won(o)));
        let false_hits = (0..5000)
            .filter(|i| s.may_have_won(&format!("other-{i}")))
            .count();
        assert!(false_hits < 250, "{false_hits} false positives of 5000");
    }
}

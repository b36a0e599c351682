//! The per-voucher state the HTTP frontend reads without messaging the actor: the sold-out flag
//! and the set of orders that won (DESIGN §5), so that a retry of a winning order still gets its
//! `201` after the voucher sold out while everyone else is answered by a memory read; the
//! voucher's definition (for §4's precedence there) and its own rate limiters.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, RwLock};

use super::limits::OwnLimits;
use crate::clock::Millis;
use crate::domain::{Ineligible, ReserveRequest, Voucher, VoucherLimits};
use crate::metrics::Outcome;

/// Shared between a voucher's actor (writer) and the frontend (reader).
#[derive(Debug, Default)]
pub struct VoucherShared {
    sold_out: AtomicBool,
    /// Bumped on every restock; an actor only raises the flag if no restock happened since it
    /// saw the ledger empty, so a release racing the sold-out decision is never lost.
    restock_epoch: AtomicU64,
    won: RwLock<Winners>,
    /// The actor's copy of the voucher's definition, so that the sold-out short-circuit answers
    /// with DESIGN §4's precedence (`422` before `409`) without a message.
    voucher: RwLock<Option<Arc<Voucher>>>,
    /// Reserves answered here without a message to the actor, for tests and diagnostics.
    short_circuits: AtomicU64,
    /// When the last of them was answered: the actor counts them as traffic (idle stop).
    last_short_circuit: AtomicI64,
    /// When the ledger last confirmed the flag and its winners (the verdict that raised it, or a
    /// probe that found the same winners): the frontend trusts the flag only for a while after
    /// (see [`VoucherShared::trusted`]), so a missed `RESTOCK` cannot keep it answering.
    verified_at: AtomicI64,
    /// The voucher's own rate limiters, when it sets any (the node's defaults apply otherwise).
    own_limits: RwLock<Option<Arc<OwnLimits>>>,
    /// Makes the voucher's own limiters from its definition: they follow every definition the
    /// actor publishes here (none in the simulator, which has no rate limits).
    make_limits: MakeLimits,
    /// The actor asked the ledger for a change of this voucher's books (a batch, a grant, a
    /// return) since the reconciler last looked: it recounts the voucher.
    changed: AtomicBool,
    /// Reserves of this voucher answered on this node, by outcome (`Outcome::index`): the
    /// per-voucher outcome rates of the live numbers, one atomic add per request.
    outcomes: [AtomicU64; Outcome::COUNT],
    /// Its standing in the pick of the vouchers shown on `/metrics` (`super::spotlight`).
    pub(crate) heat: super::spotlight::Heat,
    /// Grants of the actor that found no units (a sold-out voucher's probes among them), for
    /// tests and diagnostics: the node-wide metric counts every voucher's.
    empty_grants: AtomicU64,
    /// On a Redis Cluster, how far this row is from having its signals followed: requests seen
    /// (0, 1), then [`FOLLOWED`] from its second request or a warm-up on (see
    /// [`VoucherShared::follow_now`]).
    follow: AtomicU8,
}

/// [`VoucherShared::follow`]: the voucher's sharded channel is (being) subscribed.
const FOLLOWED: u8 = 2;

/// Makes a voucher's own limiters from the limits its definition sets (`None`: it sets none).
pub(crate) type LimitsMaker = Arc<dyn Fn(VoucherLimits) -> Option<OwnLimits> + Send + Sync>;

#[derive(Default)]
struct MakeLimits(Option<LimitsMaker>);

impl std::fmt::Debug for MakeLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "MakeLimits(..)"
        } else {
            "MakeLimits(none)"
        })
    }
}

/// What a sold-out voucher knows about who won: the orders with their customers (a retry of one
/// gets its `201`, anyone else using its id `ALREADY_USED`) and the customers at their limit (a
/// new order of theirs gets `ALREADY_USED`, not `OUT_OF_STOCK`). Exact while small: then only a
/// winner's own retry needs the ledger (for its stored body).
#[derive(Debug, Default)]
struct Winners {
    orders: Members<String, i64>,
    at_limit: Members<i64, ()>,
}

/// A map that is exact when small and a Bloom filter of its keys when large (a miss is certain;
/// a hit is checked against the ledger).
#[derive(Debug)]
enum Members<K, V> {
    Exact(HashMap<K, V>),
    Bloom(Bloom),
}

impl<K, V> Default for Members<K, V> {
    fn default() -> Self {
        Self::Exact(HashMap::new())
    }
}

/// What a [`Members`] knows of a key.
#[derive(Debug, PartialEq, Eq)]
enum Lookup<'a, V> {
    No,
    Yes(&'a V),
    Maybe,
}

impl<K: Hash + Eq, V> Members<K, V> {
    fn new(items: Vec<(K, V)>, exact_max: usize) -> Self {
        if items.len() <= exact_max {
            Self::Exact(items.into_iter().collect())
        } else {
            let mut bloom = Bloom::with_capacity(items.len());
            items.iter().for_each(|(k, _)| bloom.insert(k));
            Self::Bloom(bloom)
        }
    }

    fn lookup<Q>(&self, key: &Q) -> Lookup<'_, V>
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        match self {
            Self::Exact(map) => map.get(key).map_or(Lookup::No, Lookup::Yes),
            Self::Bloom(bloom) if bloom.may_contain(key) => Lookup::Maybe,
            Self::Bloom(_) => Lookup::No,
        }
    }
}

/// What the frontend may answer a reserve of a sold-out voucher from memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SoldOutVerdict {
    /// The order may have won: only the ledger can say (a retry gets its `201`).
    AskLedger,
    NotEligible(Ineligible),
    AlreadyUsed,
    /// The customer may be at their limit: the ledger's usage decides.
    MaybeAtLimit,
    OutOfStock,
}

impl VoucherShared {
    /// The state of a voucher whose own limiters `make` builds from its definition.
    pub(crate) fn with_limits(make: LimitsMaker) -> Self {
        Self {
            make_limits: MakeLimits(Some(make)),
            ..Self::default()
        }
    }

    /// Counts a request (or, `hot`, a warm-up) towards following this voucher's signals on a
    /// Redis Cluster: `true` exactly once, at its second request or first warm-up. A voucher
    /// asked for once (a long tail's first reserve) is never subscribed: its lease's units go
    /// back at the idle timeout without a `RECALL`, and a sold-out answer comes from the ledger.
    pub(crate) fn follow_now(&self, hot: bool) -> bool {
        if self.follow.load(Ordering::Relaxed) >= FOLLOWED {
            return false;
        }
        let before = if hot {
            self.follow.swap(FOLLOWED, Ordering::AcqRel)
        } else {
            self.follow.fetch_add(1, Ordering::AcqRel)
        };
        before == FOLLOWED - 1 || (hot && before < FOLLOWED)
    }

    /// Whether this voucher's signals are followed (its row unsubscribes when it leaves).
    pub(crate) fn followed(&self) -> bool {
        self.follow.load(Ordering::Acquire) >= FOLLOWED
    }

    /// The actor changes the voucher's books (see [`VoucherShared::take_changed`]).
    pub(crate) fn mark_changed(&self) {
        if !self.changed.load(Ordering::Relaxed) {
            self.changed.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the books changed since the last call.
    pub(crate) fn take_changed(&self) -> bool {
        self.changed.swap(false, Ordering::Relaxed)
    }

    /// Reserves of this voucher answered here so far, whatever the outcome.
    pub(crate) fn answered(&self) -> u64 {
        self.outcomes
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .sum()
    }

    pub fn count_outcome(&self, outcome: Outcome) {
        self.outcomes[outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// The reserves answered so far by this voucher's registry row, by outcome, as
    /// `(outcome, n)` with `n > 0`.
    pub fn outcome_counts(&self) -> Vec<(Outcome, u64)> {
        Outcome::ALL
            .iter()
            .map(|&o| (o, self.outcomes[o.index()].load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    pub fn is_sold_out(&self) -> bool {
        self.sold_out.load(Ordering::Acquire)
    }

    /// The flag is up and the ledger confirmed it within two probe intervals (`probe_ms`) of
    /// `now`: one probe may fail or come late before the flag stops answering.
    pub fn trusted(&self, now: Millis, probe_ms: Millis) -> bool {
        self.is_sold_out() && now - self.verified_at.load(Ordering::Acquire) <= 2 * probe_ms
    }

    /// The ledger confirmed the flag and its winners at `now`.
    pub fn verify(&self, now: Millis) {
        self.verified_at.fetch_max(now, Ordering::AcqRel);
    }

    /// The flag may have missed a `RESTOCK` (the signal link broke): not trusted until the
    /// ledger confirms it again; the winners stay.
    pub fn unverify(&self) {
        self.verified_at.store(Millis::MIN / 2, Ordering::Release);
    }

    pub fn restock_epoch(&self) -> u64 {
        self.restock_epoch.load(Ordering::Acquire)
    }

    /// Raises the flag with the winning `(order, customer)` pairs, unless a restock happened
    /// after `epoch`. Returns whether the flag is now up.
    pub fn set_sold_out(
        &self,
        epoch: u64,
        won: Vec<(String, i64)>,
        per_user_limit: i64,
        exact_max: usize,
    ) -> bool {
        let mut guard = self.won.write().unwrap_or_else(|e| e.into_inner());
        if self.restock_epoch() != epoch {
            return false;
        }
        let mut per_customer: HashMap<i64, i64> = HashMap::new();
        for (_, c) in &won {
            *per_customer.entry(*c).or_default() += 1;
        }
        let at_limit = per_customer
            .into_iter()
            .filter(|&(_, n)| n >= per_user_limit)
            .map(|(c, _)| (c, ()))
            .collect();
        *guard = Winners {
            orders: Members::new(won, exact_max),
            at_limit: Members::new(at_limit, exact_max),
        };
        self.sold_out.store(true, Ordering::Release);
        true
    }

    /// Units came back: the frontend sends traffic to the actor again.
    pub fn restock(&self) {
        let mut guard = self.won.write().unwrap_or_else(|e| e.into_inner());
        self.restock_epoch.fetch_add(1, Ordering::AcqRel);
        self.sold_out.store(false, Ordering::Release);
        *guard = Winners::default();
    }

    /// The actor loaded or reloaded the voucher's definition; the voucher's own limiters follow
    /// the limits it sets.
    pub fn set_voucher(&self, v: &Voucher) {
        *self.voucher.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(v.clone()));
        if let Some(make) = &self.make_limits.0 {
            if self.own_limits_spec() != v.limits {
                self.set_own_limits(make(v.limits));
            }
        }
    }

    pub(crate) fn own_limits(&self) -> Option<Arc<OwnLimits>> {
        self.own_limits
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The limits the voucher's own limiters were made from (the default when it has none).
    fn own_limits_spec(&self) -> VoucherLimits {
        self.own_limits()
            .map_or_else(VoucherLimits::default, |o| o.spec())
    }

    fn set_own_limits(&self, own: Option<OwnLimits>) {
        *self.own_limits.write().unwrap_or_else(|e| e.into_inner()) = own.map(Arc::new);
    }

    pub fn voucher(&self) -> Option<Arc<Voucher>> {
        self.voucher
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn count_short_circuit(&self, now: Millis) {
        self.short_circuits.fetch_add(1, Ordering::Relaxed);
        self.last_short_circuit.fetch_max(now, Ordering::Relaxed);
    }

    /// When the frontend last answered a reserve from the flag.
    pub fn last_short_circuit(&self) -> Millis {
        self.last_short_circuit.load(Ordering::Relaxed)
    }

    pub fn short_circuits(&self) -> u64 {
        self.short_circuits.load(Ordering::Relaxed)
    }

    pub(crate) fn count_empty_grant(&self) {
        self.empty_grants.fetch_add(1, Ordering::Relaxed);
    }

    pub fn empty_grants(&self) -> u64 {
        self.empty_grants.load(Ordering::Relaxed)
    }

    /// Whether `order_id` may be a winner of this voucher: false is certain, true needs the ledger.
    /// (The frontend asks [`Self::sold_out_verdict`]; this serves the tests of the sets.)
    #[cfg(test)]
    fn may_have_won(&self, order_id: &str) -> bool {
        self.won
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .orders
            .lookup(order_id)
            != Lookup::No
    }

    /// DESIGN §4's precedence for a reserve of a sold-out voucher, as far as memory can tell.
    pub fn sold_out_verdict(&self, now: Millis, req: &ReserveRequest) -> SoldOutVerdict {
        let voucher = self.voucher();
        if voucher
            .as_ref()
            .is_some_and(|v| v.refuses_amount(req.order_amount))
        {
            return SoldOutVerdict::NotEligible(Ineligible::MinOrderAmount);
        }
        let won = self.won.read().unwrap_or_else(|e| e.into_inner());
        let refused = voucher.and_then(|v| v.check_eligible(now, req.order_amount).err());
        match (won.orders.lookup(req.order_id.as_str()), refused) {
            (Lookup::Yes(&c), _) if c == req.customer_id => return SoldOutVerdict::AskLedger,
            (Lookup::Maybe, _) => return SoldOutVerdict::AskLedger,
            (_, Some(reason)) => return SoldOutVerdict::NotEligible(reason),
            (Lookup::Yes(_), None) => return SoldOutVerdict::AlreadyUsed,
            (Lookup::No, None) => {}
        }
        match won.at_limit.lookup(&req.customer_id) {
            Lookup::Yes(()) => SoldOutVerdict::AlreadyUsed,
            Lookup::Maybe => SoldOutVerdict::MaybeAtLimit,
            Lookup::No => SoldOutVerdict::OutOfStock,
        }
    }
}

/// A plain Bloom filter: ten bits and seven probes per element, about 1% false positives.
#[derive(Debug)]
struct Bloom {
    bits: Vec<u64>,
    /// Its probes' hasher, both seeds from the OS's randomness (as the rate limiters'): the
    /// items are ids clients choose, and one who could compute the probes could craft ids the
    /// filter takes for winners (each one a ledger read).
    hasher: super::limits::Hasher,
}

const BLOOM_PROBES: u64 = 7;

impl Bloom {
    fn with_capacity(n: usize) -> Self {
        let words = (n.max(1) * 10).div_ceil(64);
        Self {
            bits: vec![0; words],
            hasher: super::limits::hasher(),
        }
    }

    fn probes<Q: Hash + ?Sized>(&self, item: &Q) -> impl Iterator<Item = usize> {
        let hash = |salt: u64| self.hasher.hash_one((salt, item));
        let (a, b) = (hash(0x9e37_79b9), hash(0x85eb_ca6b) | 1);
        let m = (self.bits.len() * 64) as u64;
        (0..BLOOM_PROBES).map(move |i| (a.wrapping_add(i.wrapping_mul(b)) % m) as usize)
    }

    fn insert<Q: Hash + ?Sized>(&mut self, item: &Q) {
        let probes: Vec<usize> = self.probes(item).collect();
        for bit in probes {
            self.bits[bit / 64] |= 1 << (bit % 64);
        }
    }

    fn may_contain<Q: Hash + ?Sized>(&self, item: &Q) -> bool {
        self.probes(item)
            .all(|bit| self.bits[bit / 64] & (1 << (bit % 64)) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_voucher_is_followed_once_from_its_second_request_or_a_warm_up() {
        // Its row starts with its first request counted.
        let v = VoucherShared::default();
        assert!(!v.follow_now(false));
        assert!(!v.followed());
        assert!(v.follow_now(false), "the second request");
        assert!(v.followed());
        assert!(!v.follow_now(false) && !v.follow_now(true), "once only");
        let w = VoucherShared::default();
        assert!(!w.follow_now(false));
        assert!(w.follow_now(true), "a warm-up after one request");
        assert!(!w.follow_now(false));
        let x = VoucherShared::default();
        assert!(x.follow_now(true), "a warm-up first");
        assert!(!x.follow_now(false) && !x.follow_now(false));
        // Many requests at once: exactly one of them asks.
        let y = Arc::new(VoucherShared::default());
        let asked: usize = (0..8)
            .map(|_| {
                let y = y.clone();
                std::thread::spawn(move || (0..100).filter(|_| y.follow_now(false)).count())
            })
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(asked, 1);
    }

    #[test]
    fn flag_holds_the_winners_and_restock_clears_it() {
        let s = VoucherShared::default();
        let epoch = s.restock_epoch();
        assert!(s.set_sold_out(epoch, vec![("a".into(), 7)], 1, 10));
        assert!(s.is_sold_out());
        assert!(s.may_have_won("a"));
        assert!(!s.may_have_won("b"));
        s.restock();
        assert!(!s.is_sold_out());
        assert!(!s.may_have_won("a"));
    }

    #[test]
    fn sold_out_answers_follow_the_precedence_rule() {
        use crate::domain::VoucherStatus;
        let s = VoucherShared::default();
        let mut v = Voucher {
            code: "V".into(),
            discount_amount: 100,
            min_order_amount: 500,
            total_limit: 2,
            per_user_limit: 1,
            starts_at: 1_000,
            ends_at: 2_000,
            status: VoucherStatus::Active,
            limits: Default::default(),
        };
        s.set_voucher(&v);
        assert!(s.set_sold_out(0, vec![("a".into(), 7), ("b".into(), 8)], 2, 10));
        let req = |order: &str, customer, amount| ReserveRequest {
            customer_id: customer,
            order_id: order.into(),
            order_amount: amount,
        };
        use SoldOutVerdict as V;
        assert_eq!(s.sold_out_verdict(1_500, &req("a", 7, 500)), V::AskLedger);
        assert_eq!(s.sold_out_verdict(1_500, &req("n", 9, 500)), V::OutOfStock);
        // Customers 7 and 8 used 1 of 2: not at their limit.
        assert_eq!(s.sold_out_verdict(1_500, &req("n", 7, 500)), V::OutOfStock);
        s.restock();
        assert!(s.set_sold_out(1, vec![("a".into(), 7), ("b".into(), 8)], 1, 10));
        assert_eq!(s.sold_out_verdict(1_500, &req("n", 7, 500)), V::AlreadyUsed);
        assert_eq!(
            s.sold_out_verdict(1_500, &req("a", 9, 500)),
            V::AlreadyUsed,
            "a winning order id under another customer"
        );
        assert_eq!(
            s.sold_out_verdict(1_500, &req("n", 7, 499)),
            V::NotEligible(Ineligible::MinOrderAmount)
        );
        assert_eq!(
            s.sold_out_verdict(1_500, &req("a", 7, 499)),
            V::NotEligible(Ineligible::MinOrderAmount),
            "below the minimum is never a retry, whichever path answers"
        );
        v.status = VoucherStatus::Paused;
        s.set_voucher(&v);
        assert_eq!(
            s.sold_out_verdict(1_500, &req("n", 7, 500)),
            V::NotEligible(Ineligible::Paused)
        );
        assert_eq!(s.sold_out_verdict(1_500, &req("a", 7, 500)), V::AskLedger);
        assert_eq!(
            s.sold_out_verdict(2_000, &req("n", 9, 500)),
            V::NotEligible(Ineligible::Paused)
        );
    }

    #[test]
    fn a_restock_after_the_decision_keeps_the_flag_down() {
        let s = VoucherShared::default();
        let epoch = s.restock_epoch();
        s.restock();
        assert!(!s.set_sold_out(epoch, vec![], 1, 10));
        assert!(!s.is_sold_out());
    }

    #[test]
    fn large_sets_use_a_bloom_filter_without_false_negatives() {
        let s = VoucherShared::default();
        let won: Vec<(String, i64)> = (0..5000).map(|i| (format!("order-{i}"), i)).collect();
        assert!(s.set_sold_out(0, won.clone(), 1, 100));
        assert!(won.iter().all(|(o, _)| s.may_have_won(o)));
        let false_hits = (0..5000)
            .filter(|i| s.may_have_won(&format!("other-{i}")))
            .count();
        assert!(false_hits < 250, "{false_hits} false positives of 5000");
    }
}

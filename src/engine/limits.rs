//! Rate limits (DESIGN §6): per client address, per customer of a voucher, and per-voucher
//! admission. Decided in memory before anything else, they answer `429 RATE_LIMITED` with
//! `Retry-After` and change nothing. GCRA on the engine's injected clock: `governor`'s for
//! admission, the same algorithm over a sharded map of our own for the keyed limits
//! ([`Bounded`]). The node's settings are the defaults; a voucher may set its own
//! ([`OwnLimits`]).
//!
//! Keyed state is bounded: a keyed limiter's shard past its share of `limits.max_keys` first
//! drops the keys that have refilled (they hold nothing a fresh key would not), and if that is
//! not enough (a flood of distinct keys inside one refill period), starts over empty. Starting
//! over lets each of its keys have its burst again once: memory stays bounded at the price of
//! one burst per key per reset, which is counted (`vouchers_rate_limit_resets_total`).

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash};
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use governor::clock::Clock;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};

use crate::clock::{Millis, SharedClock};
use crate::config::LimitSettings;
use crate::domain::VoucherLimits;
use crate::metrics as m;

/// `governor`'s view of the engine's monotonic clock: nanoseconds since the limiters were made.
#[derive(Clone)]
pub struct LimiterClock {
    clock: SharedClock,
    base: Millis,
}

impl LimiterClock {
    /// Nanoseconds since the limiters were made.
    fn now_ns(&self) -> u64 {
        (self.clock.monotonic_ms() - self.base).max(0) as u64 * 1_000_000
    }
}

impl Clock for LimiterClock {
    type Instant = Nanos;

    fn now(&self) -> Nanos {
        Nanos::from(self.now_ns())
    }
}

/// Keys are hashed with foldhash rather than SipHash: on a flood of distinct customers every
/// request inserts a key. Clients choose the keys (customer ids), so both of foldhash's seeds
/// come from the OS's randomness ([`hasher`]).
pub(crate) type Hasher = foldhash::fast::SeedableRandomState;

/// A keyed map's hasher: a seed of its own, and the process's shared one, both random.
pub(crate) fn hasher() -> Hasher {
    static SHARED: std::sync::OnceLock<foldhash::SharedSeed> = std::sync::OnceLock::new();
    // std's `RandomState` keys come from the OS's random source.
    let random = || std::hash::RandomState::new().hash_one(0_u64);
    let shared = SHARED.get_or_init(|| foldhash::SharedSeed::from_u64(random()));
    Hasher::with_seed(random(), shared)
}
/// One voucher's admission limiter.
pub(crate) type Admission =
    RateLimiter<NotKeyed, InMemoryState, LimiterClock, NoOpMiddleware<Nanos>>;

/// Which limit refused a request: the `limiter` label of `vouchers_rate_limited_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limiter {
    Address,
    Customer,
    Voucher,
}

impl Limiter {
    pub fn label(self) -> &'static str {
        match self {
            Self::Address => "address",
            Self::Customer => "customer",
            Self::Voucher => "voucher",
        }
    }
}

/// A refusal: which limit, and when the next request of that key would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limited {
    pub limiter: Limiter,
    pub retry_after: Duration,
}

/// Shards of a keyed limiter: two HTTP workers checking different keys rarely meet on a lock.
const SHARDS: usize = 64;

/// A keyed limiter whose memory is bounded (see the module docs): GCRA, as `governor` does it,
/// over a map from the key's seeded 64-bit hash to its theoretical arrival time.
///
/// Not `governor`'s keyed store: on a flood of distinct customers every check inserts a key, and
/// its map (a `DashMap` of full keys, behind a lock and a shared counter every check wrote) was
/// the largest cost of a request the frontend answers from memory. Here a check takes one
/// uncontended lock of one shard and touches one 16-byte slot. Two keys whose hashes collide
/// share one bucket (with a million keys, odds of about 3 in 10^8 for any pair at all), which
/// can only refuse early, never admit past a limit.
struct Bounded<K: Hash> {
    limiter: Limiter,
    /// Nanoseconds one request takes from the bucket to refill (GCRA's emission interval).
    t: u64,
    /// How far ahead of now a key's arrival time may run and still pass: `t` times the burst
    /// less one (`governor`'s tolerance).
    tau: u64,
    clock: LimiterClock,
    /// Keys a shard holds before it drops the refilled ones: `max_keys` over the shards.
    max_per_shard: usize,
    hasher: Hasher,
    shards: Box<[Shard]>,
    /// Shards that started over (tests; the metric counts them too).
    resets: AtomicU64,
    _key: std::marker::PhantomData<fn(&K)>,
}

/// One shard's keys, on a cache line of its own.
#[repr(align(64))]
#[derive(Default)]
struct Shard(Mutex<Keys>);

/// Keys (hashes) and their theoretical arrival times.
#[derive(Default)]
struct Keys {
    tat: HashMap<u64, u64, BuildHasherDefault<Prehashed>>,
    /// The size at which the refilled keys are dropped next: twice what the last sweep left.
    /// A key refills one emission interval after a single request, so under a flood of
    /// distinct customers the map holds about two intervals' worth of keys, not `max_keys`: it
    /// stays in cache, and a check is not a cache miss into a map of a million keys.
    sweep_at: usize,
}

impl Keys {
    /// Drops the keys that refilled by `now` (they hold nothing a fresh key would not); the
    /// next sweep comes when the map has doubled from what is left.
    fn sweep(&mut self, now: u64) {
        self.tat.retain(|_, tat| *tat > now);
        self.sweep_at = 2 * self.tat.len();
    }
}

/// The least size a shard sweeps at.
const MIN_SWEEP: usize = 64;

/// The shard maps' keys are already seeded hashes: hashing them again would only cost.
#[derive(Default)]
struct Prehashed(u64);

impl std::hash::Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

impl<K: Hash> Bounded<K> {
    fn new(limiter: Limiter, quota: Quota, clock: &LimiterClock, max_keys: usize) -> Self {
        // At least a nanosecond, as `governor` has it: zero would admit everything.
        let t = (quota.replenish_interval().as_nanos() as u64).max(1);
        Self {
            limiter,
            t,
            tau: t.saturating_mul(u64::from(quota.burst_size().get() - 1)),
            clock: clock.clone(),
            max_per_shard: max_keys.max(1).div_ceil(SHARDS),
            hasher: hasher(),
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            resets: AtomicU64::new(0),
            _key: std::marker::PhantomData,
        }
    }

    fn shard(&self, hash: u64) -> MutexGuard<'_, Keys> {
        // Bits the map's own probing uses least (it takes the low bits and the top seven).
        let shard = &self.shards[(hash >> 40) as usize % SHARDS];
        shard.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(&self, key: &K) -> Result<(), Limited> {
        let hash = self.hasher.hash_one(key);
        let now = self.clock.now_ns();
        let mut keys = self.shard(hash);
        let tat = keys.tat.get(&hash).copied().unwrap_or(now);
        let earliest = tat.saturating_sub(self.tau);
        if now < earliest {
            return Err(Limited {
                limiter: self.limiter,
                retry_after: Duration::from_nanos(earliest - now),
            });
        }
        keys.tat.insert(hash, tat.max(now) + self.t);
        if keys.tat.len() > keys.sweep_at.max(MIN_SWEEP).min(self.max_per_shard)
            && self.bound(&mut keys, now)
        {
            drop(keys);
            self.resets.fetch_add(1, Ordering::Relaxed);
            m::rate_limit_reset(self.limiter.label());
            tracing::warn!(
                limiter = self.limiter.label(),
                max_keys = self.max_per_shard * SHARDS,
                "rate limiter full: a shard started over"
            );
        }
        Ok(())
    }

    /// A shard at its sweep size, or past its share of `max_keys`, drops the keys that refilled
    /// (they hold nothing a fresh key would not). If it is still past three quarters of its
    /// share (a flood of distinct keys inside one refill period), it starts over empty: every
    /// key gets its burst once more. A sweep follows at least as many new keys as it kept (or
    /// a quarter-share), so its cost per check stays constant.
    ///
    /// True when it started over (counted and logged by the caller, off the shard's lock).
    fn bound(&self, keys: &mut Keys, now: u64) -> bool {
        keys.sweep(now);
        if keys.tat.len() <= self.max_per_shard - self.max_per_shard / 4 {
            return false;
        }
        keys.tat.clear();
        keys.sweep_at = 0;
        true
    }

    /// Drops keys that refilled (periodic, so an idle node gives the memory back).
    fn upkeep(&self) {
        let now = self.clock.now_ns();
        for shard in &self.shards {
            let mut keys = shard.0.lock().unwrap_or_else(|e| e.into_inner());
            keys.sweep(now);
            keys.tat.shrink_to_fit();
        }
    }

    /// Keys held (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.0.lock().unwrap_or_else(|e| e.into_inner()).tat.len())
            .sum()
    }
}

fn quota(per_sec: u32, burst: u32) -> Option<Quota> {
    let rate = NonZeroU32::new(per_sec)?;
    let burst = NonZeroU32::new(burst).unwrap_or(rate);
    Some(Quota::per_second(rate).allow_burst(burst))
}

/// One voucher's own limiters, for a voucher that sets any limit of its own.
pub(crate) struct OwnLimits {
    spec: VoucherLimits,
    /// `None`: the node's per-customer limiter applies; `Some(None)`: none for this voucher.
    customer: Option<Option<Bounded<i64>>>,
    /// `None`: the node's default admission applies; `Some(None)`: none for this voucher.
    admission: Option<Option<Admission>>,
}

impl std::fmt::Debug for OwnLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnLimits")
            .field("spec", &self.spec)
            .finish()
    }
}

impl OwnLimits {
    pub(crate) fn spec(&self) -> VoucherLimits {
        self.spec
    }
}

/// Every rate limit of a node.
pub(crate) struct RateLimits {
    settings: LimitSettings,
    clock: LimiterClock,
    address: Option<Bounded<IpAddr>>,
    /// Keyed by (hash of the voucher code, customer): compact, and a collision of two codes'
    /// hashes only shares one customer's bucket between two vouchers.
    customer: Option<Bounded<(u64, i64)>>,
    admission: Option<Quota>,
}

impl RateLimits {
    pub(crate) fn new(s: &LimitSettings, clock: SharedClock) -> Self {
        let clock = LimiterClock {
            base: clock.monotonic_ms(),
            clock,
        };
        Self {
            address: quota(s.per_address_per_sec, s.per_address_burst)
                .map(|q| Bounded::new(Limiter::Address, q, &clock, s.max_keys)),
            customer: quota(s.per_customer_per_sec, s.per_customer_burst)
                .map(|q| Bounded::new(Limiter::Customer, q, &clock, s.max_keys)),
            admission: quota(s.admission_per_sec, s.admission_per_sec),
            settings: s.clone(),
            clock,
        }
    }

    /// A voucher's own limiters; `None` when it sets no limit of its own.
    pub(crate) fn own(&self, spec: VoucherLimits) -> Option<OwnLimits> {
        if spec == VoucherLimits::default() {
            return None;
        }
        let s = &self.settings;
        let customer =
            (spec.customer_per_sec.is_some() || spec.customer_burst.is_some()).then(|| {
                quota(
                    spec.customer_per_sec.unwrap_or(s.per_customer_per_sec),
                    spec.customer_burst.unwrap_or(s.per_customer_burst),
                )
                .map(|q| Bounded::new(Limiter::Customer, q, &self.clock, s.max_keys))
            });
        let admission = spec.admission_per_sec.map(|rate| {
            quota(rate, rate).map(|q| RateLimiter::direct_with_clock(q, self.clock.clone()))
        });
        Some(OwnLimits {
            spec,
            customer,
            admission,
        })
    }

    /// IPv6 addresses are limited per /64: one host commonly holds a whole /64.
    pub(crate) fn address(&self, ip: IpAddr) -> Result<(), Limited> {
        let key = match ip {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6((u128::from(v6) & !(u64::MAX as u128)).into()),
            },
            v4 => v4,
        };
        self.address.as_ref().map_or(Ok(()), |l| l.check(&key))
    }

    /// The voucher's own per-customer limit if it sets one, else the node's.
    pub(crate) fn customer(
        &self,
        code_hash: u64,
        customer: i64,
        own: Option<&OwnLimits>,
    ) -> Result<(), Limited> {
        match own.and_then(|o| o.customer.as_ref()) {
            Some(Some(l)) => l.check(&customer),
            Some(None) => Ok(()),
            None => self
                .customer
                .as_ref()
                .map_or(Ok(()), |l| l.check(&(code_hash, customer))),
        }
    }

    /// A new voucher's admission limiter, if admission is limited.
    pub(crate) fn new_admission(&self) -> Option<Admission> {
        self.admission
            .map(|q| RateLimiter::direct_with_clock(q, self.clock.clone()))
    }

    /// The voucher's own admission limit if it sets one, else `default` (the node's).
    pub(crate) fn admit(
        &self,
        default: Option<&Admission>,
        own: Option<&OwnLimits>,
    ) -> Result<(), Limited> {
        let limiter = match own.and_then(|o| o.admission.as_ref()) {
            Some(own) => own.as_ref(),
            None => default,
        };
        limiter.map_or(Ok(()), |a| {
            a.check().map_err(|not_until| Limited {
                limiter: Limiter::Voucher,
                retry_after: not_until.wait_time_from(self.clock.now()),
            })
        })
    }

    pub(crate) fn upkeep_own(&self, own: &OwnLimits) {
        if let Some(Some(l)) = &own.customer {
            l.upkeep();
        }
    }

    pub(crate) fn upkeep(&self) {
        if let Some(l) = &self.address {
            l.upkeep();
        }
        if let Some(l) = &self.customer {
            l.upkeep();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::clock::ManualClock;

    fn settings() -> LimitSettings {
        LimitSettings {
            per_customer_per_sec: 10,
            per_customer_burst: 5,
            per_address_per_sec: 0,
            per_address_burst: 0,
            address_header: String::new(),
            admission_per_sec: 0,
            max_keys: 100,
        }
    }

    #[test]
    fn a_customer_gets_its_burst_then_waits_for_the_refill() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let limits = RateLimits::new(&settings(), clock.clone());
        for _ in 0..5 {
            assert_eq!(limits.customer(1, 7, None), Ok(()));
        }
        let refused = limits.customer(1, 7, None).unwrap_err();
        assert_eq!(refused.limiter, Limiter::Customer);
        assert_eq!(refused.retry_after, Duration::from_millis(100));
        // Other customers, and the same customer of another voucher, are not affected.
        assert_eq!(limits.customer(1, 8, None), Ok(()));
        assert_eq!(limits.customer(2, 7, None), Ok(()));
        clock.advance_ms(100);
        assert_eq!(limits.customer(1, 7, None), Ok(()));
        assert!(limits.customer(1, 7, None).is_err());
    }

    #[test]
    fn keyed_state_stays_bounded_under_distinct_keys() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let limits = RateLimits::new(&settings(), clock.clone());
        let customer = limits.customer.as_ref().unwrap();
        let most = 100_usize.div_ceil(SHARDS) * SHARDS;
        for c in 0..10_000 {
            assert_eq!(
                limits.customer(1, c, None),
                Ok(()),
                "a new key has its burst"
            );
            let len = customer.len();
            assert!(len <= most, "{len} keys");
        }
        // Refilled keys go at the next upkeep.
        assert!(customer.len() > 0);
        clock.advance_ms(1_000);
        limits.upkeep();
        assert_eq!(customer.len(), 0);
    }

    /// The keyed limiter decides as `governor`'s GCRA does, refusals and their Retry-After
    /// included, over a long run of checks on a few keys at uneven times.
    #[test]
    fn keyed_checks_agree_with_governor() {
        let manual = Arc::new(ManualClock::new(5_000));
        let clock = LimiterClock {
            base: crate::clock::Clock::monotonic_ms(&*manual),
            clock: manual.clone(),
        };
        for (rate, burst) in [(10, 5), (1, 1), (100, 3), (7, 128)] {
            let q = quota(rate, burst).unwrap();
            let ours = Bounded::<u32>::new(Limiter::Customer, q, &clock, 1_000);
            let theirs = RateLimiter::dashmap_with_clock(q, clock.clone());
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            let (mut passed, mut refused) = (0, 0);
            for _ in 0..20_000 {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let key = (x >> 60) as u32 % 5;
                if (x >> 40).is_multiple_of(4) {
                    manual.advance_ms((x >> 20) as i64 % 60);
                }
                let want = theirs
                    .check_key(&key)
                    .map_err(|n| n.wait_time_from(clock.now()));
                let got = ours.check(&key).map_err(|l| l.retry_after);
                assert_eq!(got, want, "rate {rate}, burst {burst}, key {key}");
                if got.is_ok() {
                    passed += 1;
                } else {
                    refused += 1;
                }
            }
            assert!(
                passed > 0 && refused > 0,
                "{passed} passed, {refused} refused"
            );
        }
    }

    /// Sweeps drop only refilled keys: a customer who used up their burst stays refused while
    /// a flood of one-off customers makes the shards sweep many times. Only shards kept past
    /// three quarters of their share start over.
    #[test]
    fn sweeps_keep_limited_keys_and_only_a_full_shard_starts_over() {
        let manual = Arc::new(ManualClock::new(0));
        let clock = LimiterClock {
            base: 0,
            clock: manual.clone(),
        };
        let l = Bounded::<u64>::new(Limiter::Customer, quota(10, 5).unwrap(), &clock, 64_000);
        let heavy = u64::MAX;
        for round in 0..400_u64 {
            while l.check(&heavy).is_ok() {}
            let wait = l.check(&heavy).unwrap_err().retry_after;
            // A thousand one-off customers; each refills 100 ms (ten rounds) later.
            for k in 0..1_000 {
                assert_eq!(
                    l.check(&(round * 1_000 + k)),
                    Ok(()),
                    "a new key has its burst"
                );
            }
            assert_eq!(
                l.check(&heavy).map_err(|e| e.retry_after),
                Err(wait),
                "round {round}: the heavy key was dropped"
            );
            manual.advance_ms(10);
        }
        // 400k keys went in; the shards hold about ten rounds' worth.
        assert!(l.len() < 40_000, "{} keys: no sweeps", l.len());
        assert_eq!(l.resets.load(Ordering::Relaxed), 0);
        // Past three quarters of every share inside one refill period: shards start over.
        for k in 0..(2_000 * SHARDS as u64) {
            assert_eq!(l.check(&(1 << 40 | k)), Ok(()), "a new key has its burst");
        }
        assert!(l.resets.load(Ordering::Relaxed) >= SHARDS as u64);
        assert!(l.len() <= 64_000);
    }

    #[test]
    fn an_ipv6_host_is_limited_per_64() {
        let clock = Arc::new(ManualClock::new(0));
        let mut s = settings();
        (s.per_address_per_sec, s.per_address_burst) = (1, 2);
        let limits = RateLimits::new(&s, clock);
        let host = |i: u16| IpAddr::from([0x2001, 0xdb8, 0, 1, 0, 0, 0, i]);
        assert_eq!(limits.address(host(1)), Ok(()));
        assert_eq!(limits.address(host(2)), Ok(()));
        assert!(limits.address(host(3)).is_err(), "same /64");
        assert_eq!(
            limits.address(IpAddr::from([0x2001, 0xdb8, 0, 2, 0, 0, 0, 1])),
            Ok(())
        );
    }

    #[test]
    fn a_voucher_may_set_its_own_limits_or_turn_them_off() {
        let clock = Arc::new(ManualClock::new(0));
        let limits = RateLimits::new(&settings(), clock);
        assert!(limits.own(VoucherLimits::default()).is_none());
        let tight = limits
            .own(VoucherLimits {
                customer_burst: Some(1),
                admission_per_sec: Some(2),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(limits.customer(1, 7, Some(&tight)), Ok(()));
        assert!(limits.customer(1, 7, Some(&tight)).is_err(), "burst of 1");
        assert_eq!(limits.admit(None, Some(&tight)), Ok(()));
        assert_eq!(limits.admit(None, Some(&tight)), Ok(()));
        assert!(
            limits.admit(None, Some(&tight)).is_err(),
            "2 a second, burst 2"
        );
        let off = limits
            .own(VoucherLimits {
                customer_per_sec: Some(0),
                ..Default::default()
            })
            .unwrap();
        for _ in 0..100 {
            assert_eq!(limits.customer(1, 8, Some(&off)), Ok(()));
        }
    }

    #[test]
    fn limits_set_to_zero_are_off() {
        let clock = Arc::new(ManualClock::new(0));
        let limits = RateLimits::new(&settings(), clock);
        for _ in 0..1000 {
            assert_eq!(limits.address("10.0.0.1".parse().unwrap()), Ok(()));
        }
        assert!(limits.new_admission().is_none());
    }
}

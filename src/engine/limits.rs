//! Rate limits (DESIGN §6): per client address, per customer of a voucher, and per-voucher
//! admission. Decided in memory before anything else, they answer `429 RATE_LIMITED` with
//! `Retry-After` and change nothing. GCRA from `governor`, on the engine's injected clock.
//! The node's settings are the defaults; a voucher may set its own ([`OwnLimits`]).
//!
//! Keyed state is bounded: a keyed limiter past `limits.max_keys` first drops the keys that have
//! refilled (they hold nothing a fresh key would not), and if that is not enough (millions of
//! distinct keys inside one refill period), starts over empty. Starting over lets every key have
//! its burst again once: memory stays bounded at the price of one burst per key per reset, which
//! is counted (`vouchers_rate_limit_resets_total`).

use std::hash::{BuildHasher, Hash};
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::Duration;

use governor::clock::Clock;
use governor::middleware::NoOpMiddleware;
use governor::nanos::Nanos;
use governor::state::keyed::DashMapStateStore;
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

impl Clock for LimiterClock {
    type Instant = Nanos;

    fn now(&self) -> Nanos {
        Nanos::from((self.clock.monotonic_ms() - self.base).max(0) as u64 * 1_000_000)
    }
}

/// Keyed state hashed with foldhash rather than SipHash: on a flood of distinct customers every
/// request inserts a key, and SipHash was most of the per-customer check. Clients choose the
/// keys (customer ids), so both of foldhash's seeds come from the OS's randomness ([`hasher`]).
type Keyed<K> = RateLimiter<K, DashMapStateStore<K, Hasher>, LimiterClock, NoOpMiddleware<Nanos>>;
type Hasher = foldhash::fast::SeedableRandomState;

/// A keyed map's hasher: a seed of its own, and the process's shared one.
fn hasher() -> Hasher {
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

/// How many checks pass between two looks at a keyed limiter's size.
const SIZE_CHECK_EVERY: u64 = 1024;

/// A keyed limiter whose memory is bounded (see the module docs).
struct Bounded<K: Hash + Eq + Clone> {
    limiter: Limiter,
    quota: Quota,
    clock: LimiterClock,
    max_keys: usize,
    inner: RwLock<Keyed<K>>,
    checks: AtomicU64,
}

impl<K: Hash + Eq + Clone> Bounded<K> {
    fn new(limiter: Limiter, quota: Quota, clock: &LimiterClock, max_keys: usize) -> Self {
        Self {
            limiter,
            quota,
            clock: clock.clone(),
            max_keys: max_keys.max(1),
            inner: RwLock::new(RateLimiter::dashmap_with_clock_and_hasher(
                quota,
                clock.clone(),
                hasher(),
            )),
            checks: AtomicU64::new(0),
        }
    }

    fn check(&self, key: &K) -> Result<(), Limited> {
        if self
            .checks
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(SIZE_CHECK_EVERY)
        {
            self.bound();
        }
        let inner = self.inner.read().unwrap_or_else(|e| e.into_inner());
        inner.check_key(key).map_err(|not_until| Limited {
            limiter: self.limiter,
            retry_after: not_until.wait_time_from(self.clock.now()),
        })
    }

    fn bound(&self) {
        {
            let inner = self.inner.read().unwrap_or_else(|e| e.into_inner());
            if inner.len() <= self.max_keys {
                return;
            }
            inner.retain_recent();
            inner.shrink_to_fit();
            if inner.len() <= self.max_keys {
                return;
            }
        }
        *self.inner.write().unwrap_or_else(|e| e.into_inner()) =
            RateLimiter::dashmap_with_clock_and_hasher(self.quota, self.clock.clone(), hasher());
        m::rate_limit_reset(self.limiter.label());
        tracing::warn!(
            limiter = self.limiter.label(),
            max_keys = self.max_keys,
            "rate limiter full: started over"
        );
    }

    /// Drops keys that refilled (periodic, so an idle node gives the memory back).
    fn upkeep(&self) {
        let inner = self.inner.read().unwrap_or_else(|e| e.into_inner());
        inner.retain_recent();
        inner.shrink_to_fit();
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
        for c in 0..10_000 {
            let _ = limits.customer(1, c, None);
            let len = customer.inner.read().unwrap().len();
            assert!(len <= 100 + SIZE_CHECK_EVERY as usize, "{len} keys");
        }
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

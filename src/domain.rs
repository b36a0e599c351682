//! The vocabulary shared by every layer: vouchers, reservations, eligibility and the input rules
//! of DESIGN §6, and the ledger's numbers as the admin API and the metrics show them (counters,
//! live units, the circuit breaker's state). Pure data and pure checks; no I/O, and nothing
//! imported but the clock's `Millis`: the ledger and the metrics both read these types, so
//! neither needs the other's.

use serde::{Deserialize, Serialize};

use crate::clock::Millis;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum VoucherStatus {
    Active,
    Paused,
}

impl VoucherStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "ACTIVE",
            Self::Paused => "PAUSED",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "ACTIVE" => Some(Self::Active),
            "PAUSED" => Some(Self::Paused),
            _ => None,
        }
    }
}

/// A voucher's definition as the ledger stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Voucher {
    pub code: String,
    pub discount_amount: i64,
    pub min_order_amount: i64,
    pub total_limit: i64,
    pub per_user_limit: i64,
    pub starts_at: Millis,
    pub ends_at: Millis,
    pub status: VoucherStatus,
    pub limits: VoucherLimits,
}

/// A voucher's own rate limits (DESIGN §6), per node. `None` takes the node's configured
/// default; `Some(0)` turns that limit off for this voucher.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VoucherLimits {
    /// Reserves per second one customer may make on this voucher, after a burst of
    /// `customer_burst`.
    pub customer_per_sec: Option<u32>,
    pub customer_burst: Option<u32>,
    /// Reserves per second this voucher admits.
    pub admission_per_sec: Option<u32>,
}

/// The node-wide emergency switches (DESIGN §6), held by the ledger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Switches {
    /// New reserves get `422 NOT_ELIGIBLE` (`PAUSED`); retries of stored orders their `201`.
    pub sales_paused: bool,
    /// New reserves get `503 UNAVAILABLE`; retries of stored orders their `201`; confirm and
    /// release work.
    pub read_only: bool,
    /// Bumped by every change, so that a read that started before a change cannot undo it.
    pub version: i64,
}

/// A change of the switches: `None` leaves one as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwitchesPatch {
    pub sales_paused: Option<bool>,
    pub read_only: Option<bool>,
}

/// Why a reserve is refused with `422 NOT_ELIGIBLE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Ineligible {
    NotStarted,
    Ended,
    MinOrderAmount,
    Paused,
}

impl Voucher {
    /// An order amount below the minimum is refused before anything else about the order, on
    /// every path: a stored order passed the minimum (which never changes), so a request below
    /// it is never a retry of one.
    pub fn refuses_amount(&self, order_amount: i64) -> bool {
        order_amount < self.min_order_amount
    }

    /// Checks everything about a reserve that does not need stock: status, window and amount.
    pub fn check_eligible(&self, now: Millis, order_amount: i64) -> Result<(), Ineligible> {
        if self.status == VoucherStatus::Paused {
            return Err(Ineligible::Paused);
        }
        if now < self.starts_at {
            return Err(Ineligible::NotStarted);
        }
        if now >= self.ends_at {
            return Err(Ineligible::Ended);
        }
        if order_amount < self.min_order_amount {
            return Err(Ineligible::MinOrderAmount);
        }
        Ok(())
    }
}

/// Fields an operator may change on a live voucher (`PATCH /admin/vouchers/{code}`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VoucherPatch {
    pub status: Option<VoucherStatus>,
    pub ends_at: Option<Millis>,
    pub total_limit: Option<i64>,
    /// Each limit: `None` leaves it, `Some(None)` returns it to the node's default.
    pub customer_per_sec: Option<Option<u32>>,
    pub customer_burst: Option<Option<u32>>,
    pub admission_per_sec: Option<Option<u32>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ReservationStatus {
    Reserved,
    Confirmed,
    Released,
}

impl ReservationStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reserved => "RESERVED",
            Self::Confirmed => "CONFIRMED",
            Self::Released => "RELEASED",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "RESERVED" => Some(Self::Reserved),
            "CONFIRMED" => Some(Self::Confirmed),
            "RELEASED" => Some(Self::Released),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub order_id: String,
    pub voucher_code: String,
    pub customer_id: i64,
    pub discount_amount: i64,
    pub status: ReservationStatus,
    pub expires_at: Millis,
}

impl Reservation {
    /// Whether a repeat of `(code, customer)` at `now` for this order is the same order again (a
    /// retry), which gets the original `201`, rather than a clash, which gets `409 ALREADY_USED`:
    /// not once the reservation was released, nor once it expired unconfirmed (even before the
    /// sweeper released it: confirm would refuse it).
    pub fn is_retry_of(&self, code: &str, customer_id: i64, now: Millis) -> bool {
        self.voucher_code == code
            && self.customer_id == customer_id
            && match self.status {
                ReservationStatus::Released => false,
                ReservationStatus::Reserved => self.expires_at > now,
                ReservationStatus::Confirmed => true,
            }
    }
}

/// What happened to a reservation, as the change feed tells it (DESIGN §6, `GET /admin/events`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EventKind {
    Reserved,
    Confirmed,
    /// Released by its customer (`DELETE`).
    Released,
    /// Released by the expiry sweep: it was never confirmed.
    Expired,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reserved => "RESERVED",
            Self::Confirmed => "CONFIRMED",
            Self::Released => "RELEASED",
            Self::Expired => "EXPIRED",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "RESERVED" => Some(Self::Reserved),
            "CONFIRMED" => Some(Self::Confirmed),
            "RELEASED" => Some(Self::Released),
            "EXPIRED" => Some(Self::Expired),
            _ => None,
        }
    }
}

/// One entry of the change feed. `seq` is given in the transaction that made the change, from
/// one counter per ledger: the feed is ordered and has no gaps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedEvent {
    pub seq: i64,
    pub kind: EventKind,
    pub voucher_code: String,
    pub order_id: String,
    pub customer_id: i64,
    pub at: Millis,
}

/// A validated reserve request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveRequest {
    pub customer_id: i64,
    pub order_id: String,
    pub order_amount: i64,
}

pub const MAX_CODE_LEN: usize = 32;
pub const MAX_ORDER_ID_LEN: usize = 64;

/// A voucher code that passed the rule of DESIGN §6 (1–32 chars of `A–Z a–z 0–9 _ -`): parsed
/// once where it enters (the HTTP routes), then passed on as a `&str` that is known good.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VoucherCode(String);

/// A code that breaks the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", VoucherCode::RULE)]
pub struct BadCode;

impl VoucherCode {
    /// The rule, as the API's error detail says it.
    pub const RULE: &'static str = "code must be 1-32 characters of A-Z a-z 0-9 _ -";
    /// The rule as a regular expression, for the OpenAPI document.
    pub const PATTERN: &'static str = r"^[A-Za-z0-9_-]{1,32}$";

    pub fn parse(code: impl Into<String>) -> Result<Self, BadCode> {
        let code = code.into();
        if valid_code(&code) {
            Ok(Self(code))
        } else {
            Err(BadCode)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl std::ops::Deref for VoucherCode {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for VoucherCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The rule for an `orderId`, as the OpenAPI document states it.
pub const ORDER_ID_PATTERN: &str = r"^[\x20-\x7E]{1,64}$";

/// `code`: 1–32 chars of `A–Z a–z 0–9 _ -` (see [`VoucherCode`]).
pub fn valid_code(code: &str) -> bool {
    !code.is_empty()
        && code.len() <= MAX_CODE_LEN
        && code
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `orderId`: 1–64 printable ASCII characters.
pub fn valid_order_id(order_id: &str) -> bool {
    !order_id.is_empty()
        && order_id.len() <= MAX_ORDER_ID_LEN
        && order_id.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

/// Units of a voucher as the ledger's counters and rows see them (`GET /admin/vouchers/{code}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    pub total_limit: i64,
    pub free: i64,
    pub leased_unused: i64,
    pub reserved: i64,
    pub confirmed: i64,
    pub released: i64,
    /// Every term recomputed from the rows agrees with the counters and
    /// `total = free + leased_unused + reserved + confirmed`.
    pub balanced: bool,
}

/// A voucher's units as its row and its leases say now, without scanning its reservations: the
/// live numbers of the dashboard (the reconciler recomputes everything, less often).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveUnits {
    pub code: String,
    pub total_limit: i64,
    pub free: i64,
    pub leased_unused: i64,
    pub reserved: i64,
    pub confirmed: i64,
    pub released: i64,
}

/// The state of a node's circuit breaker on its ledger (`ledger::breaker`), as readiness and the
/// metrics show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    HalfOpen,
    Open,
}

impl BreakerState {
    /// The gauge's value: 0 closed, 1 half-open, 2 open.
    pub fn level(self) -> f64 {
        match self {
            Self::Closed => 0.0,
            Self::HalfOpen => 1.0,
            Self::Open => 2.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn voucher() -> Voucher {
        Voucher {
            code: "V".into(),
            discount_amount: 100,
            min_order_amount: 500,
            total_limit: 10,
            per_user_limit: 1,
            starts_at: 1_000,
            ends_at: 2_000,
            status: VoucherStatus::Active,
            limits: VoucherLimits::default(),
        }
    }

    #[test]
    fn eligibility_checks_status_window_and_amount() {
        let v = voucher();
        assert_eq!(v.check_eligible(999, 500), Err(Ineligible::NotStarted));
        assert_eq!(v.check_eligible(2_000, 500), Err(Ineligible::Ended));
        assert_eq!(
            v.check_eligible(1_500, 499),
            Err(Ineligible::MinOrderAmount)
        );
        assert_eq!(v.check_eligible(1_000, 500), Ok(()));
        let paused = Voucher {
            status: VoucherStatus::Paused,
            ..v
        };
        assert_eq!(paused.check_eligible(1_500, 500), Err(Ineligible::Paused));
    }

    #[test]
    fn codes_and_order_ids_follow_the_contract() {
        assert!(valid_code("SALE-2026_a"));
        assert!(!valid_code(""));
        assert!(!valid_code(&"A".repeat(33)));
        assert!(!valid_code("bad code"));
        assert!(!valid_code("é"));
        assert!(valid_order_id("order #1"));
        assert!(valid_order_id(&"o".repeat(64)));
        assert!(!valid_order_id(&"o".repeat(65)));
        assert!(!valid_order_id(""));
        assert!(!valid_order_id("tab\there"));
    }
}

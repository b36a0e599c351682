//! Row decoding and SQL text shared by both SQL ledgers. The text numbers its parameters
//! `$N`, which SQLite reads as PostgreSQL does.

use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::domain::{Reservation, ReservationStatus, Voucher, VoucherLimits, VoucherStatus};

pub const RESERVATION_COLUMNS: &str =
    "order_id, voucher_code, customer_id, discount_amount, status, expires_at";
pub const VOUCHER_COLUMNS: &str = "code, discount_amount, min_order_amount, total_limit, \
     per_user_limit, starts_at, ends_at, status, customer_rate, customer_burst, admission_rate";

/// A page of the codes of vouchers whose window ends after `$1`, after `$2`, at most `$3`.
pub const LIVE_CODES_SQL: &str =
    "SELECT code FROM vouchers WHERE ends_at > $1 AND code > $2 ORDER BY code LIMIT $3";

/// Codes of vouchers created at or after `$1`.
pub const CREATED_SINCE_SQL: &str = "SELECT code FROM vouchers WHERE created_at >= $1";

/// The watched vouchers' codes.
pub const WATCHED_SQL: &str = "SELECT code FROM watched_vouchers ORDER BY code";

/// Watches `$1` (no-op if already watched). The voucher must exist (foreign key).
pub const WATCH_SQL: &str =
    "INSERT INTO watched_vouchers (code) SELECT code FROM vouchers WHERE code = $1 \
     ON CONFLICT (code) DO NOTHING";

/// Stops watching `$1`.
pub const UNWATCH_SQL: &str = "DELETE FROM watched_vouchers WHERE code = $1";

/// The ACTIVE leases of voucher `$1` held by `$2` with units left, by id.
pub const ACTIVE_LEASES_SQL: &str = "SELECT id FROM leases WHERE voucher_code = $1 \
     AND node_id = $2 AND state = 'ACTIVE' AND consumed < granted ORDER BY id";

/// `(order id, customer)` of voucher `$1`'s live (reserved or confirmed) reservations.
pub const WON_ORDERS_SQL: &str = "SELECT order_id, customer_id FROM reservations \
     WHERE voucher_code = $1 AND status <> 'RELEASED'";

/// Marks holder `$1` dead at once, whatever its limit.
pub const RETIRE_SQL: &str = "UPDATE nodes SET beat_at = 0, dead_after = 1 WHERE holder = $1";

/// Active vouchers whose sale starts in `($1, $2]`, soonest first: the ones to pre-heat.
pub const STARTING_SQL: &str = "SELECT code FROM vouchers WHERE status = 'ACTIVE' \
     AND starts_at > $1 AND starts_at <= $2 ORDER BY starts_at LIMIT 1000";

/// The settled half of the change feed after `$1` (at most `$2` events): each reservation's
/// second event, whose number lives on its row. Both ledgers' feed queries end with it.
macro_rules! settled_events {
    () => {
        "SELECT * FROM (SELECT settled_seq AS seq, CASE WHEN status = 'CONFIRMED' THEN 'CONFIRMED' \
         WHEN expired THEN 'EXPIRED' ELSE 'RELEASED' END AS kind, voucher_code, order_id, \
         customer_id, updated_at AS at FROM reservations \
         WHERE settled_seq > $1 AND settled_seq <= $1 + $2 ORDER BY settled_seq LIMIT $2) AS s"
    };
}
pub(crate) use settled_events;

/// One row of a ledger's feed query: seq, kind, voucher, order, customer, at.
pub type EventRow = (i64, String, String, String, i64, i64);

pub fn event_from(
    (seq, kind, voucher_code, order_id, customer_id, at): EventRow,
) -> Result<crate::domain::FeedEvent, super::LedgerError> {
    Ok(crate::domain::FeedEvent {
        seq,
        kind: crate::domain::EventKind::parse(&kind)
            .ok_or(super::LedgerError::Inconsistent("stored event kind"))?,
        voucher_code,
        order_id,
        customer_id,
        at,
    })
}

/// This ledger's feed origin (see `Ledger::feed_origin`).
pub const FEED_ORIGIN_SQL: &str = "SELECT origin FROM feed_head WHERE id = 1";

/// The emergency switches' one row.
pub const SWITCHES_SQL: &str = "SELECT sales_paused, read_only, version FROM switches WHERE id = 1";
/// Changes the switches (`NULL` leaves one as it is) and bumps their version.
pub const SET_SWITCHES_SQL: &str =
    "UPDATE switches SET sales_paused = COALESCE($1, sales_paused), \
     read_only = COALESCE($2, read_only), updated_at = $3, version = version + 1 WHERE id = 1 \
     RETURNING sales_paused, read_only, version";

/// The switches from their row: sales paused, read-only, version.
pub fn switches_from(
    (sales_paused, read_only, version): (bool, bool, i64),
) -> crate::domain::Switches {
    crate::domain::Switches {
        sales_paused,
        read_only,
        version,
    }
}

/// A voucher and the units still to be had: `free` plus the unused part of active leases.
pub const VOUCHER_STOCK_SQL: &str = "SELECT code, discount_amount, min_order_amount, total_limit, \
     per_user_limit, starts_at, ends_at, status, customer_rate, customer_burst, admission_rate, CAST(free + COALESCE((SELECT SUM(l.granted - \
     l.consumed) FROM leases l WHERE l.voucher_code = vouchers.code AND l.state = 'ACTIVE'), 0) \
     AS BIGINT) AS available FROM vouchers WHERE code = $1";

pub fn reservation_from<'r, R>(row: &'r R) -> Result<Reservation, sqlx::Error>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let status: String = row.try_get("status")?;
    Ok(Reservation {
        order_id: row.try_get("order_id")?,
        voucher_code: row.try_get("voucher_code")?,
        customer_id: row.try_get("customer_id")?,
        discount_amount: row.try_get("discount_amount")?,
        status: ReservationStatus::parse(&status)
            .ok_or_else(|| sqlx::Error::Decode("reservation status".into()))?,
        expires_at: row.try_get("expires_at")?,
    })
}

pub fn voucher_from<'r, R>(row: &'r R) -> Result<Voucher, sqlx::Error>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i32>: Decode<'r, R::Database> + Type<R::Database>,
{
    let status: String = row.try_get("status")?;
    let limit = |column: &'static str| -> Result<Option<u32>, sqlx::Error> {
        let v: Option<i32> = row.try_get(column)?;
        Ok(v.map(|n| n.max(0) as u32))
    };
    Ok(Voucher {
        code: row.try_get("code")?,
        discount_amount: row.try_get("discount_amount")?,
        min_order_amount: row.try_get("min_order_amount")?,
        total_limit: row.try_get("total_limit")?,
        per_user_limit: row.try_get("per_user_limit")?,
        starts_at: row.try_get("starts_at")?,
        ends_at: row.try_get("ends_at")?,
        status: VoucherStatus::parse(&status)
            .ok_or_else(|| sqlx::Error::Decode("voucher status".into()))?,
        limits: VoucherLimits {
            customer_per_sec: limit("customer_rate")?,
            customer_burst: limit("customer_burst")?,
            admission_per_sec: limit("admission_rate")?,
        },
    })
}

/// A [`LiveUnits`](super::LiveUnits) from its query's row: code, total, free, leased unused,
/// reserved, confirmed, released.
pub fn live_units_from(
    (code, total_limit, free, leased_unused, reserved, confirmed, released): (
        String,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
    ),
) -> super::LiveUnits {
    super::LiveUnits {
        code,
        total_limit,
        free,
        leased_unused,
        reserved,
        confirmed,
        released,
    }
}

/// A limit as its column stores it (the API caps limits far below `i32::MAX`).
pub fn limit_column(v: Option<u32>) -> Option<i32> {
    v.map(|n| n.min(i32::MAX as u32) as i32)
}

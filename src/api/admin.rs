//! `/admin/vouchers…`: create, inspect (with the ledger's counters), edit, warm up; and
//! `/admin/switches`, the emergency switches; `/admin/events`, the change feed. The `/admin`
//! scope's middleware (`api::admit`) checks the bearer token before any of these runs, so a
//! refused request changes nothing.

use actix_web::{web, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::ErrorBody;
use super::{json_body, timestamp, ApiError, AppState};
use crate::domain::{
    Counters, Switches, SwitchesPatch, Voucher, VoucherCode, VoucherLimits, VoucherPatch,
    VoucherStatus,
};
use crate::engine::VoucherView;

/// Largest `totalLimit` accepted: far above any real sale, far below integer trouble.
const MAX_TOTAL_LIMIT: i64 = 1_000_000_000;

/// A new voucher. `startsAt` defaults to now, `endsAt` to a year after the start.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateBody {
    code: String,
    /// In minor units.
    #[schema(minimum = 0)]
    discount_amount: i64,
    #[serde(default)]
    #[schema(minimum = 0)]
    min_order_amount: i64,
    #[schema(minimum = 1, maximum = 1_000_000_000)]
    total_limit: i64,
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 1_000_000_000)]
    per_user_limit: i64,
    #[schema(value_type = Option<String>, format = DateTime)]
    starts_at: Option<DateTime<Utc>>,
    /// After `startsAt`.
    #[schema(value_type = Option<String>, format = DateTime)]
    ends_at: Option<DateTime<Utc>>,
    status: Option<VoucherStatus>,
    /// This voucher's per-customer rate limit (reserves per second, per node); absent or null:
    /// the node's default; 0: off.
    #[schema(maximum = 1_000_000)]
    customer_rate_per_sec: Option<u32>,
    /// The per-customer burst; absent or null: the node's default.
    #[schema(maximum = 1_000_000)]
    customer_burst: Option<u32>,
    /// Reserves per second this voucher admits on each node; absent or null: the node's
    /// default; 0: no limit.
    #[schema(maximum = 1_000_000)]
    admission_rate_per_sec: Option<u32>,
}

/// Largest rate or burst a voucher may set.
const MAX_RATE: u32 = 1_000_000;

fn check_rates(rates: &[Option<u32>]) -> Result<(), ApiError> {
    if rates.iter().flatten().any(|&r| r > MAX_RATE) {
        return Err(ApiError::invalid("rate limits must be at most 1000000"));
    }
    Ok(())
}

/// Deserializes a present field (even `null`) as `Some`, so that absent and `null` differ.
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

fn one() -> i64 {
    1
}

impl CreateBody {
    fn validate(self, now: i64) -> Result<Voucher, ApiError> {
        let code = VoucherCode::parse(self.code)?.into_string();
        if self.discount_amount < 0 {
            return Err(ApiError::invalid("discountAmount must not be negative"));
        }
        if self.min_order_amount < 0 {
            return Err(ApiError::invalid("minOrderAmount must not be negative"));
        }
        if !(1..=MAX_TOTAL_LIMIT).contains(&self.total_limit) {
            return Err(ApiError::invalid(
                "totalLimit must be between 1 and 1000000000",
            ));
        }
        if !(1..=MAX_TOTAL_LIMIT).contains(&self.per_user_limit) {
            return Err(ApiError::invalid("perUserLimit must be at least 1"));
        }
        let starts_at = self.starts_at.map_or(now, |t| t.timestamp_millis());
        let ends_at = self
            .ends_at
            .map_or(starts_at + 365 * 24 * 3600 * 1000, |t| t.timestamp_millis());
        if ends_at <= starts_at {
            return Err(ApiError::invalid("endsAt must be after startsAt"));
        }
        check_rates(&[
            self.customer_rate_per_sec,
            self.customer_burst,
            self.admission_rate_per_sec,
        ])?;
        Ok(Voucher {
            code,
            discount_amount: self.discount_amount,
            min_order_amount: self.min_order_amount,
            total_limit: self.total_limit,
            per_user_limit: self.per_user_limit,
            starts_at,
            ends_at,
            status: self.status.unwrap_or(VoucherStatus::Active),
            limits: VoucherLimits {
                customer_per_sec: self.customer_rate_per_sec,
                customer_burst: self.customer_burst,
                admission_per_sec: self.admission_rate_per_sec,
            },
        })
    }
}

/// Any of: pause or resume, move the end, raise the total (it may only grow).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PatchBody {
    status: Option<VoucherStatus>,
    /// After `startsAt`.
    #[schema(value_type = Option<String>, format = DateTime)]
    ends_at: Option<DateTime<Utc>>,
    #[schema(minimum = 1, maximum = 1_000_000_000)]
    total_limit: Option<i64>,
    /// Set this voucher's limits; `null` returns one to the node's default, 0 turns it off.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>, maximum = 1_000_000)]
    customer_rate_per_sec: Option<Option<u32>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>, maximum = 1_000_000)]
    customer_burst: Option<Option<u32>>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>, maximum = 1_000_000)]
    admission_rate_per_sec: Option<Option<u32>>,
}

/// A voucher's definition.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdminVoucher<'a> {
    code: &'a str,
    discount_amount: i64,
    min_order_amount: i64,
    total_limit: i64,
    per_user_limit: i64,
    #[schema(value_type = String, format = DateTime)]
    starts_at: String,
    #[schema(value_type = String, format = DateTime)]
    ends_at: String,
    #[schema(value_type = VoucherStatus)]
    status: &'static str,
    /// This voucher's own limits; null: the node's default.
    customer_rate_per_sec: Option<u32>,
    customer_burst: Option<u32>,
    admission_rate_per_sec: Option<u32>,
}

impl<'a> From<&'a Voucher> for AdminVoucher<'a> {
    fn from(v: &'a Voucher) -> Self {
        Self {
            code: &v.code,
            discount_amount: v.discount_amount,
            min_order_amount: v.min_order_amount,
            total_limit: v.total_limit,
            per_user_limit: v.per_user_limit,
            starts_at: timestamp(v.starts_at),
            ends_at: timestamp(v.ends_at),
            status: v.status.as_str(),
            customer_rate_per_sec: v.limits.customer_per_sec,
            customer_burst: v.limits.customer_burst,
            admission_rate_per_sec: v.limits.admission_per_sec,
        }
    }
}

/// The ledger's counters of a voucher (DESIGN §3) and whether they balance.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CounterView {
    free: i64,
    leased_unused: i64,
    reserved: i64,
    confirmed: i64,
    released: i64,
    balanced: bool,
}

impl From<&Counters> for CounterView {
    fn from(c: &Counters) -> Self {
        Self {
            free: c.free,
            leased_unused: c.leased_unused,
            reserved: c.reserved,
            confirmed: c.confirmed,
            released: c.released,
            balanced: c.balanced,
        }
    }
}

/// The voucher, its counters at the top level and again under `counters`.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdminView<'a> {
    #[serde(flatten)]
    voucher: AdminVoucher<'a>,
    #[serde(flatten)]
    flat: CounterView,
    counters: CounterView,
    sold_out: bool,
}

impl<'a> From<&'a VoucherView> for AdminView<'a> {
    fn from(v: &'a VoucherView) -> Self {
        Self {
            voucher: AdminVoucher::from(&v.voucher),
            flat: CounterView::from(&v.counters),
            counters: CounterView::from(&v.counters),
            sold_out: v.sold_out(),
        }
    }
}

/// Create a voucher.
#[utoipa::path(
    post, operation_id = "createVoucher", path = "/admin/vouchers", tag = "admin",
    request_body = CreateBody,
    security(("admin_token" = [])),
    responses(
        (status = 201, description = "Created", body = AdminVoucher),
        (status = 409, description = "ALREADY_EXISTS", body = ErrorBody),
    )
)]
pub async fn create(
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: CreateBody = json_body(payload, state.body_limit).await?;
    let voucher = body.validate(state.engine.now_ms())?;
    state.engine.create_voucher(&voucher).await?;
    Ok(HttpResponse::Created().json(AdminVoucher::from(&voucher)))
}

/// A voucher with the ledger's counters.
#[utoipa::path(
    get, operation_id = "adminGetVoucher", path = "/admin/vouchers/{code}", tag = "admin",
    params(("code" = String, Path, description = "The voucher code")),
    security(("admin_token" = [])),
    responses(
        (status = 200, description = "The voucher and its counters", body = AdminView),
    )
)]
pub async fn get(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let code = VoucherCode::parse(path.into_inner())?;
    let view = state.engine.voucher(&code).await?;
    Ok(HttpResponse::Ok().json(AdminView::from(&view)))
}

/// Edit a voucher: pause or resume it, move its end, raise its total.
#[utoipa::path(
    patch, operation_id = "patchVoucher", path = "/admin/vouchers/{code}", tag = "admin",
    params(("code" = String, Path, description = "The voucher code")),
    security(("admin_token" = [])),
    request_body = PatchBody,
    responses(
        (status = 200, description = "The edited voucher and its counters", body = AdminView),
    )
)]
pub async fn patch(
    state: web::Data<AppState>,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let code = VoucherCode::parse(path.into_inner())?;
    let body: PatchBody = json_body(payload, state.body_limit).await?;
    if let Some(total) = body.total_limit {
        if !(1..=MAX_TOTAL_LIMIT).contains(&total) {
            return Err(ApiError::invalid(
                "totalLimit must be between 1 and 1000000000",
            ));
        }
    }
    check_rates(&[
        body.customer_rate_per_sec.flatten(),
        body.customer_burst.flatten(),
        body.admission_rate_per_sec.flatten(),
    ])?;
    let patch = VoucherPatch {
        status: body.status,
        ends_at: body.ends_at.map(|t| t.timestamp_millis()),
        total_limit: body.total_limit,
        customer_per_sec: body.customer_rate_per_sec,
        customer_burst: body.customer_burst,
        admission_per_sec: body.admission_rate_per_sec,
    };
    state.engine.update_voucher(&code, &patch).await?;
    let view = state.engine.voucher(&code).await?;
    Ok(HttpResponse::Ok().json(AdminView::from(&view)))
}

/// Start the voucher's actor on this node and take its first lease; every other node does the
/// same on the `WARM` signal.
#[utoipa::path(
    post, operation_id = "warmVoucher", path = "/admin/vouchers/{code}/warm", tag = "admin",
    params(("code" = String, Path, description = "The voucher code")),
    security(("admin_token" = [])),
    responses(
        (status = 204, description = "Warm: the first lease is held (or nothing is left)"),
    )
)]
pub async fn warm(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let code = VoucherCode::parse(path.into_inner())?;
    state.engine.warm_everywhere(&code).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// Watch a voucher: every node exports its live numbers (`vouchers_units`, its reserves by
/// outcome, its reconciliation verdict) whatever its traffic, besides its hottest vouchers.
#[utoipa::path(
    put, operation_id = "watchVoucher", path = "/admin/vouchers/{code}/watch", tag = "admin",
    params(("code" = String, Path, description = "The voucher code")),
    security(("admin_token" = [])),
    responses((status = 204, description = "Watched (idempotent)"))
)]
pub async fn watch(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let code = VoucherCode::parse(path.into_inner())?;
    state.engine.watch(&code, true).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// Stop watching a voucher: it keeps series of its own only while it is among the hottest.
#[utoipa::path(
    delete, operation_id = "unwatchVoucher", path = "/admin/vouchers/{code}/watch", tag = "admin",
    params(("code" = String, Path, description = "The voucher code")),
    security(("admin_token" = [])),
    responses((status = 204, description = "Not watched (idempotent)"))
)]
pub async fn unwatch(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let code = VoucherCode::parse(path.into_inner())?;
    state.engine.watch(&code, false).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// A change of the emergency switches; a key left out stays as it is.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SwitchesBody {
    /// New reserves get `422 NOT_ELIGIBLE` (`PAUSED`), on every voucher.
    sales_paused: Option<bool>,
    /// New reserves get `503 UNAVAILABLE`; confirm and release keep working.
    read_only: Option<bool>,
}

/// The emergency switches. Retries of stored orders get their `201` whatever they say.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SwitchesView {
    sales_paused: bool,
    read_only: bool,
}

impl From<Switches> for SwitchesView {
    fn from(s: Switches) -> Self {
        Self {
            sales_paused: s.sales_paused,
            read_only: s.read_only,
        }
    }
}

/// The emergency switches as this node applies them.
#[utoipa::path(
    get, operation_id = "getSwitches", path = "/admin/switches", tag = "admin",
    security(("admin_token" = [])),
    responses((status = 200, description = "The switches", body = SwitchesView))
)]
pub async fn get_switches(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(SwitchesView::from(state.engine.switches())))
}

/// Stop every sale at once, or put the service in read-only mode. Held by the ledger: every
/// node applies a change within `jobs.switches_interval_ms` (at once with Redis).
#[utoipa::path(
    put, operation_id = "putSwitches", path = "/admin/switches", tag = "admin",
    request_body = SwitchesBody,
    security(("admin_token" = [])),
    responses((status = 200, description = "The switches as they now are", body = SwitchesView))
)]
pub async fn put_switches(
    state: web::Data<AppState>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: SwitchesBody = json_body(payload, state.body_limit).await?;
    let patch = SwitchesPatch {
        sales_paused: body.sales_paused,
        read_only: body.read_only,
    };
    let s = state.engine.set_switches(&patch).await?;
    Ok(HttpResponse::Ok().json(SwitchesView::from(s)))
}

/// Most events one read of the feed returns.
pub const MAX_EVENTS: i64 = 1_000;

/// Where to read the feed from.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Events with a higher sequence number than this; 0 (the default) reads from the start.
    #[param(minimum = 0, maximum = 9.0e18)]
    after: Option<i64>,
    /// How many events at most (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// One change of a reservation.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventView {
    seq: i64,
    #[serde(rename = "type")]
    kind: crate::domain::EventKind,
    code: String,
    order_id: String,
    customer_id: i64,
    #[schema(format = DateTime)]
    at: String,
}

/// A page of the feed; `next` is the `after` of the next page.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventsPage {
    events: Vec<EventView>,
    next: i64,
}

/// The change feed: every reservation's changes (reserved, confirmed, released, expired) in
/// the order the ledger committed them. Numbers have no gaps: a reader that asks again from
/// `next` misses nothing and sees nothing twice.
#[utoipa::path(
    get, operation_id = "getEvents", path = "/admin/events", tag = "admin",
    params(EventsQuery),
    security(("admin_token" = [])),
    responses((status = 200, description = "Events after `after`, in order", body = EventsPage))
)]
pub async fn events(
    req: HttpRequest,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let q = web::Query::<EventsQuery>::from_query(req.query_string())
        .map_err(|e| ApiError::invalid(e.to_string()))?
        .into_inner();
    let after = q.after.unwrap_or(0);
    let limit = q.limit.unwrap_or(100);
    if !(0..=i64::MAX - MAX_EVENTS).contains(&after) {
        return Err(ApiError::invalid(format!(
            "after must be between 0 and {}",
            i64::MAX - MAX_EVENTS
        )));
    }
    if !(1..=MAX_EVENTS).contains(&limit) {
        return Err(ApiError::invalid(format!(
            "limit must be between 1 and {MAX_EVENTS}"
        )));
    }
    let events = state.engine.events(after, limit).await?;
    let next = events.last().map_or(after, |e| e.seq);
    let events = events
        .into_iter()
        .map(|e| EventView {
            seq: e.seq,
            kind: e.kind,
            code: e.voucher_code,
            order_id: e.order_id,
            customer_id: e.customer_id,
            at: timestamp(e.at),
        })
        .collect();
    Ok(HttpResponse::Ok().json(EventsPage { events, next }))
}

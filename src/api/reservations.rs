//! `/vouchers/{code}/reservations…`: reserve, read, confirm, release.

use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};

use utoipa::ToSchema;

use super::error::ErrorBody;
use super::{check_order_id, json_body, timestamp, ApiError, AppState};
use crate::domain::VoucherCode;
use crate::domain::{Reservation, ReservationStatus, ReserveRequest};

/// A reserve: one unit of the voucher for one order of one customer.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReserveBody {
    #[schema(minimum = 1)]
    customer_id: i64,
    /// The caller's order id: a retry with the same id is the same reserve.
    #[schema(min_length = 1, max_length = 64)]
    order_id: String,
    /// In minor units.
    #[schema(minimum = 0)]
    order_amount: i64,
}

impl ReserveBody {
    fn validate(self) -> Result<ReserveRequest, ApiError> {
        if self.customer_id <= 0 {
            return Err(ApiError::invalid("customerId must be greater than 0"));
        }
        if self.order_amount < 0 {
            return Err(ApiError::invalid("orderAmount must not be negative"));
        }
        check_order_id(&self.order_id)?;
        Ok(ReserveRequest {
            customer_id: self.customer_id,
            order_id: self.order_id,
            order_amount: self.order_amount,
        })
    }
}

/// The `201` body; a retry gets the same bytes.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Created<'a> {
    order_id: &'a str,
    discount_amount: i64,
    /// When the reservation is released unless confirmed.
    #[schema(value_type = String, format = DateTime)]
    expires_at: String,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct View<'a> {
    order_id: &'a str,
    customer_id: i64,
    #[schema(value_type = ReservationStatus)]
    status: &'static str,
    discount_amount: i64,
    #[schema(value_type = String, format = DateTime)]
    expires_at: String,
}

impl<'a> From<&'a Reservation> for View<'a> {
    fn from(r: &'a Reservation) -> Self {
        Self {
            order_id: &r.order_id,
            customer_id: r.customer_id,
            status: r.status.as_str(),
            discount_amount: r.discount_amount,
            expires_at: timestamp(r.expires_at),
        }
    }
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct StatusBody<'a> {
    order_id: &'a str,
    #[schema(value_type = ReservationStatus)]
    status: &'static str,
}

/// Reserve one unit for an order. Answered in DESIGN §4's precedence: `429`, a retry's `201`,
/// `422`, `409 ALREADY_USED`, `409 OUT_OF_STOCK`. A `201` is durable.
#[utoipa::path(
    post, operation_id = "reserve", path = "/vouchers/{code}/reservations", tag = "checkout",
    params(("code" = String, Path, description = "The voucher code")),
    request_body = ReserveBody,
    security((), ("checkout_token" = [])),
    responses(
        (status = 201, description = "Reserved (or a retry of a stored order)", body = Created),
        (status = 409, description = "OUT_OF_STOCK or ALREADY_USED", body = ErrorBody),
        (status = 422, description = "NOT_ELIGIBLE, with the reason", body = ErrorBody),
        (status = 429, description = "RATE_LIMITED", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds until a retry may pass"))),
    )
)]
pub async fn reserve(
    state: web::Data<AppState>,
    http: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let code = VoucherCode::parse(path.into_inner())?;
    let body: ReserveBody = json_body(payload, state.body_limit)
        .await
        .inspect_err(|_| {
            crate::metrics::reservation(crate::metrics::Outcome::Invalid);
        })?;
    let req = body.validate().inspect_err(|_| {
        crate::metrics::reservation(crate::metrics::Outcome::Invalid);
    })?;
    let client = state.client_address.of(&http);
    let r = state.engine.reserve(&code, req, client).await?.reservation;
    Ok(HttpResponse::Created().json(Created {
        order_id: &r.order_id,
        discount_amount: r.discount_amount,
        expires_at: timestamp(r.expires_at),
    }))
}

fn ids(path: web::Path<(String, String)>) -> Result<(VoucherCode, String), ApiError> {
    let (code, order_id) = path.into_inner();
    let code = VoucherCode::parse(code)?;
    check_order_id(&order_id)?;
    Ok((code, order_id))
}

/// A reservation.
#[utoipa::path(
    get, operation_id = "getReservation", path = "/vouchers/{code}/reservations/{order_id}", tag = "checkout",
    params(
        ("code" = String, Path, description = "The voucher code"),
        ("order_id" = String, Path, description = "The order id"),
    ),
    security((), ("checkout_token" = [])),
    responses(
        (status = 200, description = "The reservation", body = View),
    )
)]
pub async fn get(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (code, order_id) = ids(path)?;
    let r = state.engine.reservation(&code, &order_id).await?;
    Ok(HttpResponse::Ok().json(View::from(&r)))
}

/// Confirm a reservation after payment (idempotent).
#[utoipa::path(
    post, operation_id = "confirmReservation", path = "/vouchers/{code}/reservations/{order_id}/confirm", tag = "checkout",
    params(
        ("code" = String, Path, description = "The voucher code"),
        ("order_id" = String, Path, description = "The order id"),
    ),
    security((), ("checkout_token" = [])),
    responses(
        (status = 200, description = "Confirmed", body = StatusBody),
        (status = 409, description = "RESERVATION_RELEASED", body = ErrorBody),
    )
)]
pub async fn confirm(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (code, order_id) = ids(path)?;
    let r = state.engine.confirm(&code, &order_id).await?;
    Ok(HttpResponse::Ok().json(StatusBody {
        order_id: &r.order_id,
        status: r.status.as_str(),
    }))
}

/// Release a reservation: its unit goes back on sale (idempotent).
#[utoipa::path(
    delete, operation_id = "releaseReservation", path = "/vouchers/{code}/reservations/{order_id}", tag = "checkout",
    params(
        ("code" = String, Path, description = "The voucher code"),
        ("order_id" = String, Path, description = "The order id"),
    ),
    security((), ("checkout_token" = [])),
    responses(
        (status = 200, description = "Released", body = StatusBody),
        (status = 409, description = "ALREADY_CONFIRMED", body = ErrorBody),
    )
)]
pub async fn release(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (code, order_id) = ids(path)?;
    let r = state.engine.release(&code, &order_id).await?;
    Ok(HttpResponse::Ok().json(StatusBody {
        order_id: &r.order_id,
        status: r.status.as_str(),
    }))
}

//! `/vouchers/{code}/reservations…`: reserve, read, confirm, release.

use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};

use super::{check_code, check_order_id, json_body, timestamp, ApiError, AppState};
use crate::domain::{Reservation, ReserveRequest};

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReserveBody {
    customer_id: i64,
    order_id: String,
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
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Created<'a> {
    order_id: &'a str,
    discount_amount: i64,
    expires_at: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct View<'a> {
    order_id: &'a str,
    customer_id: i64,
    status: &'static str,
    discount_amount: i64,
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

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct StatusBody<'a> {
    order_id: &'a str,
    status: &'static str,
}

pub async fn reserve(
    state: web::Data<AppState>,
    http: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    state.authorize_checkout(&http)?;
    let code = path.into_inner();
    check_code(&code)?;
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

fn ids(path: web::Path<(String, String)>) -> Result<(String, String), ApiError> {
    let (code, order_id) = path.into_inner();
    check_code(&code)?;
    check_order_id(&order_id)?;
    Ok((code, order_id))
}

pub async fn get(
    state: web::Data<AppState>,
    http: HttpRequest,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    state.authorize_checkout(&http)?;
    let (code, order_id) = ids(path)?;
    let r = state.engine.reservation(&code, &order_id).await?;
    Ok(HttpResponse::Ok().json(View::from(&r)))
}

pub async fn confirm(
    state: web::Data<AppState>,
    http: HttpRequest,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    state.authorize_checkout(&http)?;
    let (code, order_id) = ids(path)?;
    let r = state.engine.confirm(&code, &order_id).await?;
    Ok(HttpResponse::Ok().json(StatusBody {
        order_id: &r.order_id,
        status: r.status.as_str(),
    }))
}

pub async fn release(
    state: web::Data<AppState>,
    http: HttpRequest,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    state.authorize_checkout(&http)?;
    let (code, order_id) = ids(path)?;
    let r = state.engine.release(&code, &order_id).await?;
    Ok(HttpResponse::Ok().json(StatusBody {
        order_id: &r.order_id,
        status: r.status.as_str(),
    }))
}

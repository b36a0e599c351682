//! `GET /vouchers/{code}`: the public view of a voucher.

use actix_web::{web, HttpResponse};
use serde::Serialize;

use super::{check_code, timestamp, ApiError, AppState};
use crate::domain::Voucher;

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PublicVoucher<'a> {
    code: &'a str,
    discount_amount: i64,
    min_order_amount: i64,
    starts_at: String,
    ends_at: String,
    status: &'static str,
    sold_out: bool,
}

impl<'a> PublicVoucher<'a> {
    fn new(v: &'a Voucher, sold_out: bool) -> Self {
        Self {
            code: &v.code,
            discount_amount: v.discount_amount,
            min_order_amount: v.min_order_amount,
            starts_at: timestamp(v.starts_at),
            ends_at: timestamp(v.ends_at),
            status: v.status.as_str(),
            sold_out,
        }
    }
}

pub async fn get(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let code = path.into_inner();
    check_code(&code)?;
    let (voucher, sold_out) = state.engine.public_voucher(&code).await?;
    Ok(HttpResponse::Ok().json(PublicVoucher::new(&voucher, sold_out)))
}

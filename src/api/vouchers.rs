//! `GET /vouchers/{code}`: the public view of a voucher.

use actix_web::{web, HttpResponse};
use serde::Serialize;

use super::{check_code, timestamp, ApiError, AppState};
use crate::engine::VoucherView;

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

impl<'a> From<&'a VoucherView> for PublicVoucher<'a> {
    fn from(v: &'a VoucherView) -> Self {
        Self {
            code: &v.voucher.code,
            discount_amount: v.voucher.discount_amount,
            min_order_amount: v.voucher.min_order_amount,
            starts_at: timestamp(v.voucher.starts_at),
            ends_at: timestamp(v.voucher.ends_at),
            status: v.voucher.status.as_str(),
            sold_out: v.sold_out(),
        }
    }
}

pub async fn get(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let code = path.into_inner();
    check_code(&code)?;
    let view = state.engine.voucher(&code).await?;
    Ok(HttpResponse::Ok().json(PublicVoucher::from(&view)))
}

//! `GET /vouchers/{code}`: the public view of a voucher.

use actix_web::{web, HttpResponse};
use serde::Serialize;

use utoipa::ToSchema;

use super::{timestamp, ApiError, AppState};
use crate::domain::VoucherCode;
use crate::domain::{Voucher, VoucherStatus};

/// What anyone may see of a voucher.
#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PublicVoucher<'a> {
    code: &'a str,
    discount_amount: i64,
    min_order_amount: i64,
    #[schema(value_type = String, format = DateTime)]
    starts_at: String,
    #[schema(value_type = String, format = DateTime)]
    ends_at: String,
    #[schema(value_type = VoucherStatus)]
    status: &'static str,
    /// Nothing is left to sell (free and leased units are all gone).
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

/// The public view of a voucher.
#[utoipa::path(
    get, operation_id = "getVoucher", path = "/vouchers/{code}", tag = "checkout",
    params(("code" = String, Path, description = "The voucher code")),
    responses(
        (status = 200, description = "The voucher", body = PublicVoucher),
    )
)]
pub async fn get(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let code = VoucherCode::parse(path.into_inner())?;
    let (voucher, sold_out) = state.engine.public_voucher(&code).await?;
    Ok(HttpResponse::Ok().json(PublicVoucher::new(&voucher, sold_out)))
}

//! The one place errors become HTTP: status, `{"error": CODE, ...}` body and headers. The body's
//! type ([`ErrorBody`]) is also what the OpenAPI document shows, so the two cannot drift.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;
use utoipa::ToSchema;

use crate::domain::Ineligible;
use crate::engine::EngineError;

/// Everything a route can answer besides success.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("payload too large")]
    PayloadTooLarge,
    #[error("unauthorized")]
    Unauthorized,
    #[error("not found")]
    NotFound,
    /// Readiness: what is down.
    #[error("not ready: {0}")]
    NotReady(&'static str),
}

/// The `error` field of every error body (DESIGN §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    InvalidRequest,
    PayloadTooLarge,
    Unauthorized,
    NotFound,
    OutOfStock,
    AlreadyUsed,
    AlreadyExists,
    ReservationReleased,
    AlreadyConfirmed,
    NotEligible,
    RateLimited,
    Unavailable,
}

/// Every error answer: `{"error": CODE}`, with `reason` for `NOT_ELIGIBLE`, and `detail` for
/// `INVALID_REQUEST` and for readiness's `UNAVAILABLE` (what is down).
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorCode,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Ineligible>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl ApiError {
    pub fn invalid(detail: impl Into<String>) -> Self {
        Self::InvalidRequest(detail.into())
    }

    fn parts(&self) -> (StatusCode, ErrorBody) {
        use EngineError as E;
        use ErrorCode as C;
        let plain = |status, error| {
            (
                status,
                ErrorBody {
                    error,
                    reason: None,
                    detail: None,
                },
            )
        };
        match self {
            Self::InvalidRequest(detail) | Self::Engine(E::Invalid(detail)) => (
                StatusCode::BAD_REQUEST,
                ErrorBody {
                    error: C::InvalidRequest,
                    reason: None,
                    detail: Some(detail.clone()),
                },
            ),
            Self::NotReady(what) => (
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorBody {
                    error: C::Unavailable,
                    reason: None,
                    detail: Some(what.to_string()),
                },
            ),
            Self::PayloadTooLarge => plain(StatusCode::PAYLOAD_TOO_LARGE, C::PayloadTooLarge),
            Self::Unauthorized => plain(StatusCode::UNAUTHORIZED, C::Unauthorized),
            Self::NotFound | Self::Engine(E::NotFound) => plain(StatusCode::NOT_FOUND, C::NotFound),
            Self::Engine(E::OutOfStock) => plain(StatusCode::CONFLICT, C::OutOfStock),
            Self::Engine(E::AlreadyUsed) => plain(StatusCode::CONFLICT, C::AlreadyUsed),
            Self::Engine(E::AlreadyExists) => plain(StatusCode::CONFLICT, C::AlreadyExists),
            Self::Engine(E::ReservationReleased) => {
                plain(StatusCode::CONFLICT, C::ReservationReleased)
            }
            Self::Engine(E::AlreadyConfirmed) => plain(StatusCode::CONFLICT, C::AlreadyConfirmed),
            Self::Engine(E::NotEligible(reason)) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorBody {
                    error: C::NotEligible,
                    reason: Some(*reason),
                    detail: None,
                },
            ),
            Self::Engine(E::Unavailable) => plain(StatusCode::SERVICE_UNAVAILABLE, C::Unavailable),
            Self::Engine(E::RateLimited { .. }) => {
                plain(StatusCode::TOO_MANY_REQUESTS, C::RateLimited)
            }
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.parts().0
    }

    fn error_response(&self) -> HttpResponse {
        let (status, body) = self.parts();
        let mut res = HttpResponse::build(status);
        match self {
            Self::Engine(EngineError::RateLimited { retry_after_secs }) => {
                res.insert_header(("Retry-After", retry_after_secs.to_string()));
            }
            _ if status == StatusCode::SERVICE_UNAVAILABLE => {
                res.insert_header(("Retry-After", "1"));
            }
            _ => {}
        }
        res.json(body)
    }
}

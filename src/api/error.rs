//! The one place errors become HTTP: status, `{"error": CODE, ...}` body and headers.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

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
}

impl ApiError {
    pub fn invalid(detail: impl Into<String>) -> Self {
        Self::InvalidRequest(detail.into())
    }

    fn parts(&self) -> (StatusCode, serde_json::Value) {
        use EngineError as E;
        let plain = |status, code: &str| (status, json!({ "error": code }));
        match self {
            Self::InvalidRequest(detail) | Self::Engine(E::Invalid(detail)) => (
                StatusCode::BAD_REQUEST,
                json!({ "error": "INVALID_REQUEST", "detail": detail }),
            ),
            Self::PayloadTooLarge => plain(StatusCode::PAYLOAD_TOO_LARGE, "PAYLOAD_TOO_LARGE"),
            Self::Unauthorized => plain(StatusCode::UNAUTHORIZED, "UNAUTHORIZED"),
            Self::NotFound | Self::Engine(E::NotFound) => plain(StatusCode::NOT_FOUND, "NOT_FOUND"),
            Self::Engine(E::OutOfStock) => plain(StatusCode::CONFLICT, "OUT_OF_STOCK"),
            Self::Engine(E::AlreadyUsed) => plain(StatusCode::CONFLICT, "ALREADY_USED"),
            Self::Engine(E::AlreadyExists) => plain(StatusCode::CONFLICT, "ALREADY_EXISTS"),
            Self::Engine(E::ReservationReleased) => {
                plain(StatusCode::CONFLICT, "RESERVATION_RELEASED")
            }
            Self::Engine(E::AlreadyConfirmed) => plain(StatusCode::CONFLICT, "ALREADY_CONFIRMED"),
            Self::Engine(E::NotEligible(reason)) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                json!({ "error": "NOT_ELIGIBLE", "reason": reason }),
            ),
            Self::Engine(E::Unavailable) => plain(StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE"),
            Self::Engine(E::RateLimited { .. }) => {
                plain(StatusCode::TOO_MANY_REQUESTS, "RATE_LIMITED")
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

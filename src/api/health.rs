//! Liveness, readiness and the Prometheus scrape endpoint.

use actix_web::{web, HttpResponse};
use serde_json::json;

use super::{ApiError, AppState};
use crate::engine::EngineError;

pub async fn live() -> HttpResponse {
    HttpResponse::Ok().json(json!({ "status": "ok" }))
}

/// `503` when the ledger does not answer.
pub async fn ready(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    if state.engine.ready().await {
        Ok(HttpResponse::Ok().json(json!({ "status": "ok" })))
    } else {
        Err(EngineError::Unavailable.into())
    }
}

pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.metrics.render())
}

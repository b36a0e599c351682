//! Liveness, readiness and the Prometheus scrape endpoint.

use actix_web::{web, HttpResponse};
use serde_json::json;

use super::error::ErrorBody;
use super::{ApiError, AppState};

/// `{"status": "ok"}`.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct Health {
    #[schema(example = "ok")]
    status: String,
}

/// Readiness, with the emergency switches this node applies (so a load balancer's health view
/// shows a paused or read-only service).
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Ready {
    #[schema(example = "ok")]
    status: &'static str,
    sales_paused: bool,
    read_only: bool,
    /// The ledger server this node writes to (`host:port`); absent on the embedded ledger.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "10.0.0.2:5432")]
    ledger_server: Option<String>,
    /// How many times this node moved to another ledger server (a promoted standby).
    ledger_failovers: u64,
}

/// The process is up.
#[utoipa::path(get, operation_id = "live", path = "/health/live", tag = "operations",
    responses((status = 200, description = "Alive", body = Health)))]
pub async fn live() -> HttpResponse {
    HttpResponse::Ok().json(json!({ "status": "ok" }))
}

/// `503` when the ledger does not answer, or the node's circuit breaker on it is open; `detail`
/// says which.
#[utoipa::path(get, operation_id = "ready", path = "/health/ready", tag = "operations",
    responses(
        (status = 200, description = "The ledger answers", body = Ready),
        (status = 503, description = "The ledger does not answer", body = ErrorBody,
            headers(("Retry-After" = u64, description = "Seconds to wait before retrying"))),
    ))]
pub async fn ready(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    match state.engine.ready().await {
        Ok(()) => {
            let s = state.engine.switches();
            let (ledger_server, ledger_failovers) = match state.engine.ledger_server() {
                Some((server, failovers)) => (Some(server), failovers),
                None => (None, 0),
            };
            Ok(HttpResponse::Ok().json(Ready {
                status: "ok",
                sales_paused: s.sales_paused,
                read_only: s.read_only,
                ledger_server,
                ledger_failovers,
            }))
        }
        Err(what) => Err(ApiError::NotReady(what)),
    }
}

/// Prometheus text exposition.
#[utoipa::path(get, operation_id = "metrics", path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text", body = String, content_type = "text/plain")))]
pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(crate::metrics::render(
            &state.metrics,
            &state.engine.shown_on_metrics(),
        ))
}

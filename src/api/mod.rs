//! The HTTP surface of DESIGN §6. Routes parse and validate, then call [`EngineHandle`]; they
//! never touch actors, channels or SQL. One file per resource; errors map to HTTP in [`error`].

pub mod admin;
pub mod error;
pub mod health;
pub mod openapi;
pub mod reservations;
pub mod vouchers;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use actix_web::body::BoxBody;
use actix_web::dev::{Service, ServiceRequest, ServiceResponse};
use actix_web::middleware::{from_fn, Next};
use actix_web::{web, HttpRequest, HttpResponse};
use futures_util::StreamExt;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::de::DeserializeOwned;

use crate::clock::Millis;
use crate::domain::BadCode;
use crate::engine::EngineHandle;
pub use error::ApiError;

/// What every route can reach.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub admin_token: String,
    pub metrics: PrometheusHandle,
    pub body_limit: usize,
    pub client_address: ClientAddress,
    /// Bearer tokens the checkout routes (reserve, read, confirm, release) accept; empty: open.
    /// A list, so a new token can be rolled out before the old one is withdrawn.
    pub checkout_tokens: Vec<String>,
}

impl AppState {
    /// Whether a checkout route may serve `req`: it carries one of the configured tokens, or
    /// none is configured.
    fn admits_checkout(&self, req: &HttpRequest) -> bool {
        if self.checkout_tokens.is_empty() {
            return true;
        }
        let given = bearer(req);
        // Every token is compared, so the time taken says nothing about which one nearly matched.
        self.checkout_tokens
            .iter()
            .fold(false, |ok, t| ok | token_matches(given, t))
    }

    /// Whether an admin route may serve `req`: it carries the admin token.
    fn admits_admin(&self, req: &HttpRequest) -> bool {
        !self.admin_token.is_empty() && token_matches(bearer(req), &self.admin_token)
    }
}

/// Middleware of the checkout scope: see [`admit`].
async fn require_checkout(
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    admit(req, next, AppState::admits_checkout).await
}

/// Middleware of the admin scope: see [`admit`].
async fn require_admin(
    req: ServiceRequest,
    next: Next<BoxBody>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    admit(req, next, AppState::admits_admin).await
}

/// A scope's token check: a request without the token its scope requires gets `401` before its
/// handler runs (before its path, query or body is read), so a refused request changes nothing,
/// and a route added to the scope cannot forget the check.
async fn admit(
    req: ServiceRequest,
    next: Next<BoxBody>,
    admits: fn(&AppState, &HttpRequest) -> bool,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let admitted = req
        .app_data::<web::Data<AppState>>()
        .is_some_and(|s| admits(s, req.request()));
    if admitted {
        next.call(req).await
    } else {
        Ok(req.into_response(ApiError::Unauthorized.error_response_owned()))
    }
}

/// The bearer token a request carries ("" if none; the scheme's name is case-insensitive).
pub fn bearer(req: &HttpRequest) -> &str {
    req.headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map_or("", |(_, token)| token.trim())
}

/// Compares a given token with an expected (non-empty) one in time that depends only on the
/// expected token's length, not on the given one or on where they differ.
pub fn token_matches(given: &str, expected: &str) -> bool {
    let (a, b) = (given.as_bytes(), expected.as_bytes());
    let mut diff = u8::from(a.len() != b.len() || b.is_empty());
    for (i, y) in b.iter().enumerate() {
        diff |= a.get(i).copied().unwrap_or(0) ^ y;
    }
    diff == 0
}

/// Where a reserve's client address (for the per-address rate limit) comes from.
#[derive(Clone, Debug, Default)]
pub enum ClientAddress {
    /// The per-address limit is off: no address is taken.
    #[default]
    Off,
    /// The connection's peer.
    Peer,
    /// A header a trusted proxy sets, else the peer. Its last entry is used: a proxy appends
    /// the address it saw to whatever the client sent, so only the last one is the proxy's word.
    Header(actix_web::http::header::HeaderName),
}

impl ClientAddress {
    pub fn from_settings(s: &crate::config::LimitSettings) -> anyhow::Result<Self> {
        use anyhow::Context;
        Ok(if s.per_address_per_sec == 0 {
            Self::Off
        } else if s.address_header.is_empty() {
            tracing::warn!(
                "limits.per_address_per_sec is on without limits.address_header: every client \
                 behind one proxy or checkout service shares one address's limit"
            );
            Self::Peer
        } else {
            Self::Header(
                s.address_header
                    .parse()
                    .context("limits.address_header is not a header name")?,
            )
        })
    }

    pub fn of(&self, req: &HttpRequest) -> Option<std::net::IpAddr> {
        let peer = || req.peer_addr().map(|a| a.ip());
        match self {
            Self::Off => None,
            Self::Peer => peer(),
            Self::Header(name) => req
                .headers()
                .get_all(name)
                .last()
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.rsplit(',').next())
                .and_then(|v| v.trim().parse().ok())
                .or_else(peer),
        }
    }
}

/// Registers every route. Authorization is the scopes' middleware ([`admit`]): the
/// reservation routes need a checkout token (when any is configured), everything under `/admin`
/// the admin token.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::scope("/vouchers/{code}")
            .route("", web::get().to(vouchers::get))
            .service(
                web::scope("/reservations")
                    .wrap(from_fn(require_checkout))
                    .route("", web::post().to(reservations::reserve))
                    .route("/{order_id}", web::get().to(reservations::get))
                    .route("/{order_id}", web::delete().to(reservations::release))
                    .route("/{order_id}/confirm", web::post().to(reservations::confirm)),
            ),
    )
    .service(
        web::scope("/admin")
            .wrap(from_fn(require_admin))
            .route("/vouchers", web::post().to(admin::create))
            .route("/vouchers/{code}", web::get().to(admin::get))
            .route("/vouchers/{code}", web::patch().to(admin::patch))
            .route("/vouchers/{code}/warm", web::post().to(admin::warm))
            .route("/vouchers/{code}/watch", web::put().to(admin::watch))
            .route("/vouchers/{code}/watch", web::delete().to(admin::unwatch))
            .route("/events", web::get().to(admin::events))
            .route("/switches", web::get().to(admin::get_switches))
            .route("/switches", web::put().to(admin::put_switches)),
    )
    .route("/openapi.json", web::get().to(openapi::openapi_json))
    .route("/metrics", web::get().to(health::metrics))
    .route("/health/live", web::get().to(health::live))
    .route("/health/ready", web::get().to(health::ready));
}

/// Builds the actix app for one worker.
pub fn app(
    state: AppState,
) -> actix_web::App<
    impl actix_web::dev::ServiceFactory<
        ServiceRequest,
        Config = (),
        Response = ServiceResponse<BoxBody>,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    actix_web::App::new()
        .app_data(web::Data::new(state))
        // A path segment that does not decode gets the contract's 400, not actix's plain text.
        .app_data(
            web::PathConfig::default()
                .error_handler(|e, _| ApiError::invalid(format!("invalid path: {e}")).into()),
        )
        .configure(configure)
        .default_service(web::to(|| async {
            ApiError::NotFound.error_response_owned()
        }))
        .wrap_fn(|req, srv| {
            let started = Instant::now();
            let fut = srv.call(req);
            async move {
                let res = fut.await?;
                let route = route_label(res.request().path());
                crate::metrics::request_latency(route, started.elapsed());
                Ok(drop_request_headers(res))
            }
        })
}

/// Drops the request's headers once its response is built, so the request actix keeps for reuse
/// does not keep its connection's read buffer.
///
/// actix-http parses header values as slices of the connection's 8 KiB read buffer, and both of
/// actix's request pools (128 requests per HTTP worker each) keep a finished request's headers
/// until the request is reused. After a flood, each pooled request kept the read buffer of the
/// last connection it served, allocated amid the flood's short-lived blocks, so each held a
/// mimalloc page that was otherwise empty once every actor had idled out (docs/PERFORMANCE.md,
/// "The long tail"). Nothing reads a request's headers after its response is built.
///
/// The request is normally the only handle on it here; when something still holds a copy (a
/// body that streams from it, say), actix would panic on the mutable borrow. That is caught,
/// logged once, and the clearing is off for the rest of the process: memory, never a request,
/// pays for it.
fn drop_request_headers(res: ServiceResponse) -> ServiceResponse {
    static OFF: AtomicBool = AtomicBool::new(false);
    drop_headers_unless(&OFF, res)
}

/// [`drop_request_headers`], with the switch that turns it off given (tests have their own).
fn drop_headers_unless(off: &AtomicBool, res: ServiceResponse) -> ServiceResponse {
    // Built to abort on a panic, a shared request would end the process: then never.
    if !cfg!(panic = "unwind") || off.load(Ordering::Relaxed) {
        return res;
    }
    let (req, res) = res.into_parts();
    let mut req = ServiceRequest::from_request(req);
    let cleared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        empty_headers(&mut req.head_mut().headers)
    }));
    if cleared.is_err() && !off.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "a request was still shared after its response: request headers are kept from now on"
        );
    }
    ServiceResponse::new(req.into_parts().0, res)
}

/// Empties a finished request's header map. A table with room for more than [`KEPT_HEADERS`]
/// goes: actix-http gives every new request head room for 16 headers (a 6.7 KB table) and its
/// `clear` keeps it, and after a flood the pooled heads' tables were most of what the flood
/// left allocated (heaptrack: 1.73 MB of 2.9). A smaller table, grown by the requests a head
/// served, stays: a head reused by the same kind of request allocates nothing.
fn empty_headers(headers: &mut actix_web::http::header::HeaderMap) {
    if headers.capacity() > KEPT_HEADERS {
        drop(std::mem::take(headers));
    } else {
        headers.clear();
    }
}

/// The most headers a pooled request's emptied map keeps room for: 16 buckets (3.2 KB), what a
/// request of up to 14 headers grows. A browser's request with more grows a larger table each
/// time; a checkout service's few headers fit.
const KEPT_HEADERS: usize = 14;

/// A bounded label for the latency histogram, from the path by hand: asking the router for the
/// matched pattern would match the path against every route's regex a second time.
fn route_label(path: &str) -> &'static str {
    let mut parts = path.trim_start_matches('/').split('/');
    match (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) {
        (Some("vouchers"), Some(_), None, ..) => "voucher",
        (Some("vouchers"), Some(_), Some("reservations"), None, _) => "reserve",
        (Some("vouchers"), Some(_), Some("reservations"), Some(_), None) => "reservation",
        (Some("vouchers"), Some(_), Some("reservations"), Some(_), Some("confirm"))
            if parts.next().is_none() =>
        {
            "confirm"
        }
        (Some("admin"), ..) => "admin",
        (Some("metrics"), None, ..) => "metrics",
        (Some("health"), ..) => "health",
        _ => "other",
    }
}

impl ApiError {
    fn error_response_owned(self) -> HttpResponse {
        actix_web::ResponseError::error_response(&self)
    }
}

/// Reads a JSON body of at most `limit` bytes: `413` above it, `400` with a detail when it does
/// not parse into `T`.
pub async fn json_body<T: DeserializeOwned>(
    mut payload: web::Payload,
    limit: usize,
) -> Result<T, ApiError> {
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| match e {
            actix_web::error::PayloadError::Overflow => ApiError::PayloadTooLarge,
            other => ApiError::invalid(format!("could not read body: {other}")),
        })?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::PayloadTooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
}

/// Milliseconds as the RFC 3339 text the API uses.
pub fn timestamp(ms: Millis) -> String {
    crate::clock::rfc3339(ms)
}

impl From<BadCode> for ApiError {
    fn from(e: BadCode) -> Self {
        Self::invalid(e.to_string())
    }
}

pub fn check_order_id(order_id: &str) -> Result<(), ApiError> {
    if crate::domain::valid_order_id(order_id) {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "orderId must be 1-64 printable ASCII characters",
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use actix_web::dev::Service;
    use actix_web::test as http;
    use actix_web::{web, App, HttpRequest, HttpResponse};

    use super::{drop_headers_unless, empty_headers, route_label, KEPT_HEADERS};

    /// An app behind the clearing switched by `$off`: `/echo/{name}` answers its name and the
    /// `x-secret` header it was sent, `/shared` answers with a body that still holds the request.
    macro_rules! echo_app {
        ($off:expr) => {
            http::init_service(
                App::new()
                    .wrap_fn(|req, srv| {
                        let fut = srv.call(req);
                        async move { Ok(drop_headers_unless($off, fut.await?)) }
                    })
                    .route(
                        "/echo/{name}",
                        web::get().to(|req: HttpRequest| async move {
                            let secret = req
                                .headers()
                                .get("x-secret")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("");
                            let name = req.match_info().get("name").unwrap_or("");
                            HttpResponse::Ok().body(format!("{name} {secret}"))
                        }),
                    )
                    .route(
                        "/shared",
                        web::get().to(|req: HttpRequest| async move {
                            HttpResponse::Ok().streaming(futures_util::stream::once(async move {
                                Ok::<_, actix_web::Error>(web::Bytes::from(req.path().to_string()))
                            }))
                        }),
                    ),
            )
            .await
        };
    }

    #[test]
    fn an_emptied_header_map_keeps_a_small_table_and_drops_a_large_one() {
        use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};
        let header = |i: usize| {
            (
                HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap(),
                HeaderValue::from_static("v"),
            )
        };
        // What actix-http gives a new request head.
        let mut fresh = HeaderMap::with_capacity(16);
        fresh.insert(header(0).0, header(0).1);
        assert!(fresh.capacity() > KEPT_HEADERS);
        empty_headers(&mut fresh);
        assert!(fresh.is_empty());
        assert_eq!(fresh.capacity(), 0, "the large table is gone");
        // What a head reused by a request of three headers grew.
        let mut grown = HeaderMap::new();
        for i in 0..3 {
            grown.insert(header(i).0, header(i).1);
        }
        let room = grown.capacity();
        assert!(room > 0 && room <= KEPT_HEADERS);
        empty_headers(&mut grown);
        assert!(grown.is_empty());
        assert_eq!(
            grown.capacity(),
            room,
            "the small table stays for the next request"
        );
    }

    #[actix_web::test]
    async fn a_request_keeps_no_headers_once_answered() {
        static OFF: AtomicBool = AtomicBool::new(false);
        let app = echo_app!(&OFF);
        let res = http::call_service(
            &app,
            http::TestRequest::get()
                .uri("/echo/e1?q=1")
                .insert_header(("x-secret", "s3"))
                .to_request(),
        )
        .await;
        assert!(
            res.request().headers().is_empty(),
            "{:?}",
            res.request().headers()
        );
        assert!(!OFF.load(Ordering::Relaxed));
        assert_eq!(
            http::read_body(res).await,
            "e1 s3",
            "the handler saw its path and the header"
        );
    }

    #[actix_web::test]
    async fn a_request_still_shared_keeps_its_headers_and_turns_the_clearing_off() {
        static OFF: AtomicBool = AtomicBool::new(false);
        let app = echo_app!(&OFF);
        let res = http::call_service(
            &app,
            http::TestRequest::get()
                .uri("/shared")
                .insert_header(("x-secret", "s3"))
                .to_request(),
        )
        .await;
        assert_eq!(res.request().headers().len(), 1);
        assert!(OFF.load(Ordering::Relaxed));
        assert_eq!(
            http::read_body(res).await,
            "/shared",
            "the body was still served"
        );
        // Off for every later request.
        let res = http::call_service(
            &app,
            http::TestRequest::get()
                .uri("/echo/e2")
                .insert_header(("x-secret", "s3"))
                .to_request(),
        )
        .await;
        assert_eq!(res.request().headers().len(), 1);
    }

    #[test]
    fn route_labels_follow_the_routes() {
        for (path, label) in [
            ("/vouchers/A", "voucher"),
            ("/vouchers/A/reservations", "reserve"),
            ("/vouchers/A/reservations/o-1", "reservation"),
            ("/vouchers/A/reservations/o-1/confirm", "confirm"),
            ("/vouchers/A/reservations/o-1/confirm/x", "other"),
            ("/vouchers/A/other", "other"),
            ("/admin/vouchers/A", "admin"),
            ("/metrics", "metrics"),
            ("/health/ready", "health"),
            ("/", "other"),
        ] {
            assert_eq!(route_label(path), label, "{path}");
        }
    }
}

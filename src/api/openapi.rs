//! `GET /openapi.json`: the OpenAPI document of the HTTP contract (DESIGN §6), derived from the
//! handlers' `#[utoipa::path]` attributes and the body types' `ToSchema` derives, so it changes
//! with them. A unit test below checks that every documented operation is routed.

use actix_web::HttpResponse;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{admin, health, reservations, vouchers};
use crate::domain::{VoucherCode, ORDER_ID_PATTERN};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Flash-sale voucher engine",
        description = "Reserve, confirm and release voucher units under a flood, never overselling. \
                       Every error body is {\"error\": CODE, ...}.",
        license(name = "Proprietary"),
    ),
    paths(
        reservations::reserve,
        reservations::get,
        reservations::confirm,
        reservations::release,
        vouchers::get,
        admin::create,
        admin::get,
        admin::patch,
        admin::warm,
        admin::watch,
        admin::unwatch,
        admin::events,
        admin::get_switches,
        admin::put_switches,
        health::live,
        health::ready,
        health::metrics,
        openapi_json,
    ),
    components(schemas(super::error::ErrorBody)),
    modifiers(&BearerSchemes, &CommonErrors, &InputRules),
    tags(
        (name = "checkout", description = "What a checkout service calls"),
        (name = "admin", description = "Operators; bearer admin token"),
        (name = "operations", description = "Health, metrics and this document"),
    )
)]
pub struct ApiDoc;

/// The input rules of DESIGN §6, stated once (in `domain`) and set here on every place the
/// document names a voucher code or an order id: the `{code}` and `{order_id}` path parameters,
/// and the bodies' `code` and `orderId`.
struct InputRules;

impl Modify for InputRules {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{RefOr, Schema};
        let pattern_of = |name: &str| match name {
            "code" => Some(VoucherCode::PATTERN),
            "order_id" | "orderId" => Some(ORDER_ID_PATTERN),
            _ => None,
        };
        let set = |schema: Option<&mut RefOr<Schema>>, pattern: &str| {
            if let Some(RefOr::T(Schema::Object(o))) = schema {
                o.pattern = Some(pattern.to_string());
            }
        };
        for item in openapi.paths.paths.values_mut() {
            let ops = [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.patch,
                &mut item.delete,
            ];
            for op in ops.into_iter().flatten() {
                for p in op.parameters.iter_mut().flatten() {
                    let RefOr::T(p) = p else { continue };
                    if let Some(pattern) = pattern_of(&p.name) {
                        set(p.schema.as_mut(), pattern);
                    }
                }
            }
        }
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        for body in ["CreateBody", "ReserveBody"] {
            if let Some(RefOr::T(Schema::Object(o))) = components.schemas.get_mut(body) {
                for (name, property) in o.properties.iter_mut() {
                    if let Some(pattern) = pattern_of(name) {
                        set(Some(property), pattern);
                    }
                }
            }
        }
    }
}

/// The two bearer schemes: the admin token, and the optional checkout tokens.
struct BearerSchemes;

impl Modify for BearerSchemes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        for name in ["admin_token", "checkout_token"] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
        }
    }
}

/// The error answers that follow from how a route is built rather than from what it does, added
/// to every operation they apply to (so each handler documents only its own): a `{code}` in the
/// path is checked (`400`) and looked up (`404`); a query is parsed (`400`); a body is parsed
/// (`400`) and capped (`413`);
/// admin routes check their token (`401`), and so do checkout routes when tokens are configured;
/// anything that reaches the ledger may find it unavailable (`503` with `Retry-After`).
struct CommonErrors;

impl Modify for CommonErrors {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, item) in openapi.paths.paths.iter_mut() {
            let ops = [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.patch,
                &mut item.delete,
            ];
            for op in ops.into_iter().flatten() {
                let mut add = |status: &str, description: &str, retry_after: bool| {
                    op.responses
                        .responses
                        .entry(status.into())
                        .or_insert_with(|| error_response(description, retry_after).into());
                };
                if path.contains("{code}") {
                    add(
                        "400",
                        "INVALID_REQUEST: a malformed code, order id or body",
                        false,
                    );
                    add("404", "NOT_FOUND: no such voucher (or reservation)", false);
                }
                if op.request_body.is_some() {
                    add(
                        "400",
                        "INVALID_REQUEST: a malformed code, order id or body",
                        false,
                    );
                    add("413", "PAYLOAD_TOO_LARGE", false);
                }
                let query = op.parameters.as_ref().is_some_and(|ps| {
                    ps.iter().any(|p| {
                        matches!(p, utoipa::openapi::RefOr::T(p)
                            if matches!(p.parameter_in, utoipa::openapi::path::ParameterIn::Query))
                    })
                });
                if query {
                    add(
                        "400",
                        "INVALID_REQUEST: a malformed or unknown query parameter",
                        false,
                    );
                }
                if path.starts_with("/admin/") {
                    add("401", "UNAUTHORIZED: missing or wrong admin token", false);
                }
                if path.starts_with("/vouchers/{code}/reservations") {
                    add(
                        "401",
                        "UNAUTHORIZED: checkout tokens are configured and none was given",
                        false,
                    );
                }
                if path.starts_with("/vouchers/") || path.starts_with("/admin/") {
                    add("503", "UNAVAILABLE: the ledger cannot be reached now", true);
                }
            }
        }
    }
}

fn error_response(description: &str, retry_after: bool) -> utoipa::openapi::Response {
    use utoipa::openapi::{ContentBuilder, HeaderBuilder, Ref, ResponseBuilder};
    let mut response = ResponseBuilder::new().description(description).content(
        "application/json",
        ContentBuilder::new()
            .schema(Some(Ref::from_schema_name("ErrorBody")))
            .build(),
    );
    if retry_after {
        response = response.header(
            "Retry-After",
            HeaderBuilder::new()
                .schema(Some(
                    utoipa::openapi::ObjectBuilder::new()
                        .schema_type(utoipa::openapi::schema::Type::Integer)
                        .minimum(Some(0)),
                ))
                .description(Some("Seconds to wait before retrying"))
                .build(),
        );
    }
    response.build()
}

/// This document.
#[utoipa::path(get, operation_id = "openapi", path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "The OpenAPI document", body = Object)))]
pub async fn openapi_json() -> HttpResponse {
    // Built once: the route needs no token, and building the document costs far more than
    // serving it.
    static DOCUMENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let body =
        DOCUMENT.get_or_init(|| serde_json::to_string(&ApiDoc::openapi()).unwrap_or_default());
    HttpResponse::Ok()
        .content_type(actix_web::http::header::ContentType::json())
        .body(body.as_str())
}

#[cfg(test)]
mod tests {
    use actix_web::http::StatusCode;
    use actix_web::test::{call_service, init_service, TestRequest};
    use actix_web::{web, App, HttpResponse};

    use super::ApiDoc;
    use utoipa::OpenApi;

    /// Every documented operation reaches a handler: the router answers something other than
    /// its fallback (which answers 599 here) for each method and path of the document.
    #[actix_web::test]
    async fn every_documented_operation_is_routed() {
        let doc = ApiDoc::openapi();
        let app = init_service(
            App::new()
                .configure(super::super::configure)
                .default_service(web::to(|| async {
                    HttpResponse::build(StatusCode::from_u16(599).unwrap()).finish()
                })),
        )
        .await;
        let mut checked = 0;
        for (path, item) in &doc.paths.paths {
            let concrete = path.replace("{code}", "C").replace("{order_id}", "o");
            for (method, op) in [
                ("GET", &item.get),
                ("POST", &item.post),
                ("PUT", &item.put),
                ("PATCH", &item.patch),
                ("DELETE", &item.delete),
            ] {
                if op.is_none() {
                    continue;
                }
                let req = TestRequest::default()
                    .method(method.parse().unwrap())
                    .uri(&concrete)
                    .to_request();
                let res = call_service(&app, req).await;
                assert_ne!(
                    res.status().as_u16(),
                    599,
                    "{method} {path} is documented but not routed"
                );
                checked += 1;
            }
        }
        assert_eq!(
            checked, 18,
            "every operation of DESIGN §6 that exists is documented"
        );
    }

    /// Every code and order id the document names carries the rule `domain` states.
    #[test]
    fn every_code_and_order_id_carries_its_pattern() {
        let doc = serde_json::to_value(ApiDoc::openapi()).unwrap();
        let mut seen = 0;
        for item in doc["paths"].as_object().unwrap().values() {
            for op in item.as_object().unwrap().values() {
                for p in op["parameters"].as_array().into_iter().flatten() {
                    let want = match p["name"].as_str() {
                        Some("code") => crate::domain::VoucherCode::PATTERN,
                        Some("order_id") => crate::domain::ORDER_ID_PATTERN,
                        _ => continue,
                    };
                    assert_eq!(p["schema"]["pattern"], want, "{p}");
                    seen += 1;
                }
            }
        }
        assert_eq!(seen, 13, "10 codes and 3 order ids in paths");
        let schemas = &doc["components"]["schemas"];
        assert_eq!(
            schemas["CreateBody"]["properties"]["code"]["pattern"],
            crate::domain::VoucherCode::PATTERN
        );
        assert_eq!(
            schemas["ReserveBody"]["properties"]["orderId"]["pattern"],
            crate::domain::ORDER_ID_PATTERN
        );
    }
}

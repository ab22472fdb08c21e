//! HTTP only: routes, request and response types, problem errors. No SQL and
//! no /proc here: handlers parse, call one function, and map the result.

pub mod auth;
pub mod error;
pub mod events;
pub mod extract;
pub mod leases;
pub mod owner;
mod paging;
pub mod ports;
pub mod processes;
mod service;
mod strict;
mod validate;

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::timeout::TimeoutLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;

use crate::leases::Leases;
use crate::metrics::Metrics;
use crate::store::Store;
use error::ApiError;

/// Request bodies over this are refused with 413.
pub const BODY_LIMIT: usize = 64 * 1024;
/// A request that takes longer is answered 408 (SSE streams are not cut).
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(660);
/// Request lines plus headers over this are refused with 431.
pub const HEAD_LIMIT: usize = 16 * 1024;

/// What every handler shares; cloned per request and middleware, hence one Arc.
pub type AppState = Arc<Services>;

pub struct Services {
    pub leases: Leases,
    pub processes: Arc<crate::processes::Processes>,
    pub ports: crate::ports::Ports,
    pub store: Store,
    pub hub: Arc<crate::waiters::Hub>,
    pub metrics: Arc<Metrics>,
    pub openapi: Arc<String>,
    pub access: Arc<auth::Access>,
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "holdfast",
        description = "Exclusive leases with fencing tokens, a registry of managed processes, and port reservations.",
        license(name = "MIT OR Apache-2.0", identifier = "MIT OR Apache-2.0")
    ),
    tags(
        (name = "leases", description = "Exclusive, fenced ownership of named resources"),
        (name = "processes", description = "Processes spawned or registered, watched and stopped safely"),
        (name = "ports", description = "Port reservations that do not collide"),
        (name = "events", description = "The ordered log of state changes"),
        (name = "service", description = "Health, readiness, metrics and this document"),
    ),
    // Query parameter types are referenced, not inlined: register them.
    components(schemas(crate::model::StateFilter, processes::Stream))
)]
struct ApiDoc;

/// Every operation can meet these refusals; document them once, here,
/// rather than on each path.
struct CommonErrors;

impl utoipa::Modify for CommonErrors {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
        let common: &[(&str, &str, bool)] = &[
            (
                "400",
                "`malformed_json`: the body is not a JSON object",
                true,
            ),
            (
                "401",
                "`unauthorized`: a token is configured and the bearer token is missing or wrong",
                false,
            ),
            (
                "403",
                "`forbidden`: the caller may not do this, or the Host / Origin is refused",
                false,
            ),
            ("405", "`method_not_allowed`", false),
            ("413", "`payload_too_large`: the body is over 64 KiB", true),
            (
                "415",
                "`unsupported_media_type`: the body is not sent as JSON",
                true,
            ),
            (
                "422",
                "`validation`: a member or parameter is missing, of the wrong type or out of range",
                false,
            ),
            (
                "431",
                "`headers_too_large`: the request headers are over 16 KiB",
                false,
            ),
            ("503", "`busy` (with Retry-After) or `unavailable`", false),
        ];
        for item in doc.paths.paths.values_mut() {
            let ops = [&mut item.get, &mut item.post];
            for op in ops.into_iter().flatten() {
                let has_body = op.request_body.is_some();
                for (code, what, body_only) in common {
                    if *body_only && !has_body {
                        continue;
                    }
                    let problem = ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name("Problem")))
                        .build();
                    op.responses
                        .responses
                        .entry((*code).to_owned())
                        .or_insert_with(|| {
                            ResponseBuilder::new()
                                .description(*what)
                                .content("application/problem+json", problem)
                                .into()
                        });
                }
            }
        }
    }
}

fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(leases::router())
        .merge(processes::router())
        .merge(ports::router())
        .merge(events::router())
        .merge(service::router())
}

/// The OpenAPI document, generated from the routes themselves.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut doc = routes().split_for_parts().1;
    utoipa::Modify::modify(&CommonErrors, &mut doc);
    doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
    doc
}

/// The OpenAPI document as served and checked in.
pub fn openapi_json() -> String {
    let mut text = openapi().to_pretty_json().unwrap_or_default();
    text.push('\n');
    text
}

pub fn router(state: AppState) -> Router {
    let (router, _) = routes().split_for_parts();
    router
        .fallback(|| async { ApiError::NotFound("no such path".into()) })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(middleware::from_fn_with_state(state.clone(), auth::guard))
        .layer(middleware::from_fn_with_state(state.clone(), track))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        // Longer than the longest wait (60 s) plus a stop's grace and kill.
        .layer(TimeoutLayer::with_status_code(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .layer(CatchPanicLayer::custom(|_| {
            ApiError::Internal("a request handler panicked".into()).into_response()
        }))
        .with_state(state)
}

/// Count and time every request by its route template (low cardinality).
async fn track(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().as_str().to_owned();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_owned();
    let res = next.run(req).await;
    let status = res.status().as_u16();
    state
        .metrics
        .request(&method, &route, status, started.elapsed().as_secs_f64());
    if res.status().is_server_error() {
        tracing::warn!(%method, %route, status, "request failed");
    }
    res
}

//! HTTP only: routes, request and response types, problem errors. No SQL and
//! no /proc here: handlers parse, call one function, and map the result.

pub mod auth;
pub mod error;
pub mod events;
pub mod extract;
pub mod idempotency;
pub mod leases;
mod openapi;
pub mod owner;
mod paging;
pub mod ports;
pub mod processes;
mod service;
mod strict;
pub mod unkept;
mod validate;

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::timeout::TimeoutLayer;
use utoipa_axum::router::OpenApiRouter;

use crate::leases::Leases;
use crate::metrics::Metrics;
use crate::store::Store;
use error::ApiError;
pub use openapi::{openapi, openapi_json};

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
    pub events: crate::events::EventLog,
    pub hub: Arc<crate::waiters::Hub>,
    pub metrics: Arc<Metrics>,
    pub openapi: Arc<String>,
    pub access: Arc<auth::Access>,
    /// Keyed answers the store has not kept yet.
    pub unkept: Arc<unkept::Unkept>,
    /// Keys of the keyed requests being answered.
    pub in_flight: Arc<idempotency::InFlight>,
}

fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(<openapi::ApiDoc as utoipa::OpenApi>::openapi())
        .merge(leases::router())
        .merge(processes::router())
        .merge(ports::router())
        .merge(events::router())
        .merge(service::router())
}

pub fn router(state: AppState) -> Router {
    let (router, _) = routes().split_for_parts();
    router
        .fallback(|| async { ApiError::NotFound("no such path".into()) })
        .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
        .layer(middleware::from_fn_with_state(
            state.clone(),
            idempotency::guard,
        ))
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

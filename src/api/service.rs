//! Health, readiness, metrics and the OpenAPI document.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::error::{ApiError, Problem};
use crate::metrics::format;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(get_health))
        .routes(routes!(get_readiness))
        .routes(routes!(get_metrics))
        .routes(routes!(get_openapi))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    #[schema(example = "ok")]
    pub status: &'static str,
}

/// 200 while the process serves.
#[utoipa::path(get, path = "/healthz", tag = "service", responses((status = 200, description = "The process serves", body = Health)))]
async fn get_health() -> Json<Health> {
    Json(Health { status: "ok" })
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    #[schema(example = "ok")]
    pub status: &'static str,
    /// The store this server uses: `sqlite` (embedded) or `postgres` (shared by a fleet).
    #[schema(example = "sqlite")]
    pub store: &'static str,
}

/// 200 when the store is open, migrated and writable (on PostgreSQL: the
/// database answers and this host can take the fleet's write lock); 503 otherwise.
#[utoipa::path(
    get, path = "/readyz", tag = "service",
    responses(
        (status = 200, description = "The store is open, migrated and writable", body = Readiness),
        (status = 503, description = "`unavailable` or `busy`", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn get_readiness(State(state): State<AppState>) -> Result<Json<Readiness>, ApiError> {
    let store = state.store.ready().await?;
    Ok(Json(Readiness {
        status: "ok",
        store,
    }))
}

/// Prometheus text format 0.0.4, or OpenMetrics 1.0 when `Accept` asks for
/// it (as Prometheus does).
#[utoipa::path(
    get, path = "/metrics", tag = "service",
    responses((status = 200, description = "Prometheus text exposition (0.0.4), or OpenMetrics text when `Accept` prefers `application/openmetrics-text` to `text/plain`", content(
        (String = "text/plain"),
        (String = "application/openmetrics-text"),
    )))
)]
async fn get_metrics(State(state): State<AppState>, headers: HeaderMap) -> impl IntoResponse {
    let counted = async {
        let leases = state.leases.count_current().await?;
        let processes = state.processes.count_current().await?;
        Ok::<_, crate::store::StoreError>((leases, processes))
    };
    let current = counted
        .await
        .inspect_err(|e| tracing::warn!(error = %e, "metrics: cannot count the current records"))
        .ok();
    let text = state.metrics.render(
        current,
        state.hub.waiters.waiting(),
        crate::waiters::MAX_WAITERS.saturating_sub(state.hub.waiting.available_permits()),
    );
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    // Which of the two the answer is depends on `Accept`: caches must know.
    let vary = (header::VARY, "accept");
    if format::wants_openmetrics(accept) {
        ([(header::CONTENT_TYPE, format::OPENMETRICS), vary], text)
    } else {
        (
            [(header::CONTENT_TYPE, format::CLASSIC), vary],
            format::classic(&text),
        )
    }
}

/// This document.
#[utoipa::path(
    get, path = "/openapi.json", tag = "service",
    responses((status = 200, description = "The OpenAPI 3.1 document", body = Object))
)]
async fn get_openapi(State(state): State<AppState>) -> impl IntoResponse {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        state.openapi.as_ref().clone(),
    )
}

//! Health, readiness, metrics and the OpenAPI document.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::error::{ApiError, Problem};

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

/// Prometheus text format.
#[utoipa::path(
    get, path = "/metrics", tag = "service",
    responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain"))
)]
async fn get_metrics(State(state): State<AppState>) -> impl IntoResponse {
    let counted = async {
        let leases = state.leases.count_current().await?;
        let processes = state.processes.count_current().await?;
        Ok::<_, crate::store::StoreError>((leases, processes))
    };
    let current = counted
        .await
        .inspect_err(|e| tracing::warn!(error = %e, "metrics: cannot count the current records"))
        .ok();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(
            current,
            state.hub.waiters.waiting(),
            crate::waiters::MAX_WAITERS.saturating_sub(state.hub.waiting.available_permits()),
        ),
    )
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

//! `/v1/events`: the ordered log of every state change.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::error::{ApiError, Problem};
use super::extract::Params;
use super::validate;
use crate::model::LeaseView;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list_events))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Return events with `seq` greater than this (default 0).
    #[param(minimum = 0)]
    pub after: Option<i64>,
    /// 1..=1000, default 100.
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// When there is no event yet, wait up to this long (0..=60000) for the
    /// first one; 200 with empty `items` when the wait runs out.
    #[param(minimum = 0, maximum = 60000)]
    pub wait_ms: Option<i64>,
}

/// One state change, with the whole record as it is after the change.
#[derive(Debug, ToSchema)]
#[allow(dead_code)] // documents the stored JSON; the server never builds one
pub struct Event {
    pub seq: i64,
    #[schema(format = DateTime)]
    pub at: String,
    /// `lease.acquired`, `lease.activated`, `lease.released`, `lease.expired`,
    /// `lease.reclaimed`, `lease.broken`, ...
    #[schema(rename = "type")]
    pub kind: String,
    pub lease: Option<LeaseView>,
    #[schema(value_type = Option<Object>)]
    pub process: Option<()>,
    #[schema(value_type = Option<Object>)]
    pub port: Option<()>,
    #[schema(value_type = Option<Object>)]
    pub detail: Option<()>,
}

#[derive(Debug, ToSchema)]
#[allow(dead_code)] // documents the response, which is assembled from stored JSON
pub struct EventList {
    pub items: Vec<Event>,
}

/// Events after `after`, oldest first; with `wait_ms`, a long poll.
#[utoipa::path(
    get, path = "/v1/events", tag = "events",
    params(EventsQuery),
    responses(
        (status = 200, description = "Events, oldest first", body = EventList),
        (status = 422, description = "A bad parameter", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn list_events(
    State(state): State<AppState>,
    Params(q): Params<EventsQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let after = q.after.unwrap_or(0);
    validate::in_range("after", after, 0..=i64::MAX)?;
    let limit = q.limit.unwrap_or(super::leases::DEFAULT_LIMIT);
    validate::in_range("limit", limit, 1..=super::leases::MAX_LIMIT)?;
    let wait_ms = q.wait_ms.unwrap_or(0);
    validate::in_range("wait_ms", wait_ms, validate::WAIT_MS)?;
    let limit = u32::try_from(limit).unwrap_or(1000);
    // Subscribe before reading, so an event committed in between still wakes us.
    let mut newest = state.hub.subscribe_events();
    let mut rows = state.store.backend().events(after, limit).await?;
    if rows.is_empty() && wait_ms > 0 {
        let wait = std::time::Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0));
        // The watch guard is not Send: keep only whether it fired.
        let woken = tokio::time::timeout(wait, newest.wait_for(|seq| *seq > after))
            .await
            .is_ok_and(|r| r.is_ok());
        if woken {
            rows = state.store.backend().events(after, limit).await?;
        }
    }
    // Stored bodies are JSON objects without their seq: splice it in rather
    // than parse and re-serialize every event.
    let mut out = String::from("{\"items\":[");
    for (i, row) in rows.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&format!("{{\"seq\":{},", row.seq));
        out.push_str(row.payload.get(1..).unwrap_or("}"));
    }
    out.push_str("]}");
    Ok(([(header::CONTENT_TYPE, "application/json")], out))
}

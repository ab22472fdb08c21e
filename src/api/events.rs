//! `/v1/events`: the ordered log of every state change.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::error::{ApiError, BUSY_DETAIL, Code, Problem, UNAVAILABLE_DETAIL, problem_body};
use super::extract::Params;
use super::validate;
use crate::events::ReadError;
use crate::model::{EventRow, EventType, LeaseView, PortRecord, ProcessView};
use crate::store::StoreError;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_events))
        .routes(routes!(stream_events))
}

#[derive(Debug, Serialize, Deserialize, IntoParams)]
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

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct StreamQuery {
    /// Stream events with `seq` greater than this (default 0); `Last-Event-ID` overrides it.
    #[param(minimum = 0)]
    pub after: Option<i64>,
}

/// One state change, with the whole record as it is after the change:
/// exactly one of `lease`, `process` and `port` is set.
#[derive(Debug, Serialize, ToSchema)]
#[allow(dead_code)] // documents the stored JSON; the server never builds one
pub struct Event {
    #[schema(minimum = 1, example = 981)]
    pub seq: i64,
    #[schema(format = DateTime)]
    pub at: String,
    #[schema(rename = "type")]
    pub kind: EventType,
    pub lease: Option<LeaseView>,
    pub process: Option<ProcessView>,
    pub port: Option<PortRecord>,
    /// What else is known about the change (`{"reason": ..., "by": ...}` for
    /// a break, `{"reclaimed": ...}` for a takeover, ...); null when nothing.
    #[schema(value_type = Option<HashMap<String, Value>>)]
    pub detail: Option<()>,
}

/// One Server-Sent Events message as it is framed: `data` is the JSON text
/// of an `SseData`.
// The stream's schema is the frame, as OpenAPI 3.2's `itemSchema` for
// `text/event-stream` describes one and schemathesis checks every message
// against (its ST108). `data` says what its text holds with
// `contentMediaType` and `contentSchema` (`openapi::describe_sse_data`).
// Some generators (@hey-api/openapi-ts) take a stream's schema for its
// data's instead; docs/clients.md says how to read the stream there.
#[derive(Debug, ToSchema)]
#[allow(dead_code)] // documents the stream, which axum's Sse writes
pub struct SseMessage {
    /// The event's `seq`; none on an `error` message.
    pub id: Option<String>,
    /// The event's `type`, or `error`.
    pub event: String,
    pub data: String,
}

/// The `data` of one Server-Sent Events message, as JSON: an Event (the
/// message's `id` is its `seq`, its `event` its `type`), or, in a message
/// whose `event` is `error`, the problem (`events_pruned`, `unavailable`)
/// that ends the stream.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code, clippy::large_enum_variant)] // documents the stream, which axum's Sse writes
pub enum SseData {
    Event(Event),
    Error(Problem),
}

#[derive(Debug, ToSchema)]
#[allow(dead_code)] // documents the response, which is assembled from stored JSON
pub struct EventList {
    pub items: Vec<Event>,
}

/// List events after `after`, oldest first; with `wait_ms`, a long poll.
///
/// The same path streams them as Server-Sent Events when the request has
/// `Accept: text/event-stream` (see `stream_events`, which always streams).
#[utoipa::path(
    get, path = "/v1/events", tag = "events",
    params(EventsQuery),
    responses(
        (status = 200, description = "Events, oldest first; empty `items` when a wait ran out", body = EventList),
        (status = 410, description = "`events_pruned`: `after` is older than what retention kept; body has `oldest_seq`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A bad parameter", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`busy`: too many waiting requests", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn list_events(
    State(state): State<AppState>,
    headers: HeaderMap,
    Params(q): Params<EventsQuery>,
) -> Result<Response, ApiError> {
    let after = q.after.unwrap_or(0);
    validate::in_range("after", after, 0..=i64::MAX)?;
    let limit = q.limit.unwrap_or(super::paging::DEFAULT_LIMIT);
    validate::in_range("limit", limit, 1..=super::paging::MAX_LIMIT)?;
    let wait_ms = q.wait_ms.unwrap_or(0);
    validate::in_range("wait_ms", wait_ms, validate::WAIT_MS)?;
    let limit = u32::try_from(limit).unwrap_or(1000);
    let sse = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    if sse {
        return open_stream(state, &headers, after).await;
    }
    state.events.check_not_pruned_now(after).await?;
    // Subscribe before reading, so an event committed in between still wakes us.
    let mut newest = state.events.subscribe();
    let mut rows = state.events.read(after, limit).await?;
    if rows.is_empty() && wait_ms > 0 {
        let _permit = state
            .hub
            .waiting
            .clone()
            .try_acquire_owned()
            .map_err(|_| ApiError::Busy)?;
        let wait = std::time::Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0));
        // At shutdown it answers what there is (nothing) at once.
        let woken = tokio::time::timeout(wait, newer_than(&mut newest, after, &state))
            .await
            .unwrap_or(false);
        if woken {
            rows = state.events.read(after, limit).await?;
        }
    }
    let mut out = String::from("{\"items\":[");
    for (i, row) in rows.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&with_seq(row));
    }
    out.push_str("]}");
    Ok(([(header::CONTENT_TYPE, "application/json")], out).into_response())
}

/// Stream events as Server-Sent Events, from `after` or `Last-Event-ID`.
///
/// Each message has `id: <seq>`, `event: <type>` and `data: <the Event JSON>`;
/// an idle stream gets a comment line at least every 15 s. A reader that
/// falls behind retention gets an `error` event (`events_pruned`) and the
/// stream ends. `GET /v1/events` with `Accept: text/event-stream` is the same stream.
#[utoipa::path(
    get, path = "/v1/events/stream", tag = "events",
    params(
        StreamQuery,
        ("Last-Event-ID" = Option<String>, Header, nullable = false, pattern = "^[0-9]{0,18}$", description = "Resume after this seq (the `id` of the last message read); overrides `after`"),
    ),
    responses(
        (status = 200, description = "A Server-Sent Events stream: each message has `id: <seq>`, `event: <type>` and `data: <the Event JSON>`, or `event: error` and a Problem as its data, which ends the stream", body = SseMessage, content_type = "text/event-stream"),
        (status = 410, description = "`events_pruned`: `after` is older than what retention kept; body has `oldest_seq`", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A bad parameter", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "`busy`: too many open streams and waiting requests", body = Problem, content_type = "application/problem+json"),
    )
)]
async fn stream_events(
    State(state): State<AppState>,
    headers: HeaderMap,
    Params(q): Params<StreamQuery>,
) -> Result<Response, ApiError> {
    let after = q.after.unwrap_or(0);
    validate::in_range("after", after, 0..=i64::MAX)?;
    open_stream(state, &headers, after).await
}

async fn open_stream(
    state: AppState,
    headers: &HeaderMap,
    mut after: i64,
) -> Result<Response, ApiError> {
    // An empty Last-Event-ID is none, as for a browser's EventSource.
    if let Some(last) = headers.get("last-event-id").filter(|v| !v.is_empty()) {
        after = last
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|seq| *seq >= 0)
            .ok_or_else(|| {
                ApiError::validation("Last-Event-ID", "Last-Event-ID must be an event seq")
            })?;
    }
    state.events.check_not_pruned_now(after).await?;
    let permit = state
        .hub
        .waiting
        .clone()
        .try_acquire_owned()
        .map_err(|_| ApiError::Busy)?;
    Ok(stream(state, after, permit).into_response())
}

/// Stored bodies are JSON objects without their seq: splice it in rather
/// than parse and re-serialize every event.
fn with_seq(row: &EventRow) -> String {
    format!(
        "{{\"seq\":{},{}",
        row.seq,
        row.payload.get(1..).unwrap_or("}")
    )
}

/// The event type, read back from the stored body for the SSE `event:` line.
fn kind(row: &EventRow) -> String {
    serde_json::from_str::<serde_json::Value>(&row.payload)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "message".into())
}

struct Cursor {
    state: AppState,
    after: i64,
    pending: std::collections::VecDeque<EventRow>,
    newest: tokio::sync::watch::Receiver<i64>,
    done: bool,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

/// Events as they commit. The stream is pulled: a client that reads slowly
/// holds no buffer on the server. One that falls so far behind that
/// retention removed what it has not read gets an `error` event and the
/// stream ends.
fn stream(
    state: AppState,
    after: i64,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> impl IntoResponse {
    let newest = state.events.subscribe();
    let cursor = Cursor {
        state,
        after,
        pending: Default::default(),
        newest,
        done: false,
        _permit: permit,
    };
    let events = futures_util::stream::unfold(cursor, |mut c| async move {
        loop {
            if c.done {
                return None;
            }
            if let Some(row) = c.pending.pop_front() {
                c.after = row.seq;
                let event = SseEvent::default()
                    .id(row.seq.to_string())
                    .event(kind(&row))
                    .data(with_seq(&row));
                return Some((Ok::<_, std::convert::Infallible>(event), c));
            }
            if c.state.events.check_not_pruned(c.after).is_err() {
                c.done = true;
                let data = pruned_error(c.state.events.oldest_kept());
                return Some((Ok(error_message(&data)), c));
            }
            match c.state.events.read(c.after, 500).await {
                Ok(rows) if !rows.is_empty() => c.pending.extend(rows),
                Err(ReadError::Pruned { .. }) => continue,
                Ok(_) => {
                    // At shutdown the stream ends, rather than being cut.
                    if !newer_than(&mut c.newest, c.after, &c.state).await {
                        return None;
                    }
                }
                Err(ReadError::Store(e)) => {
                    c.done = true;
                    return Some((Ok(error_message(&store_error(e))), c));
                }
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(std::time::Duration::from_secs(15)))
}

/// Waits until an event after `after` is committed: false when the server
/// shuts down first (or the log is gone). The watch guard is not Send, so
/// only whether it fired is kept.
async fn newer_than(
    newest: &mut tokio::sync::watch::Receiver<i64>,
    after: i64,
    state: &AppState,
) -> bool {
    tokio::select! {
        r = newest.wait_for(|seq| *seq > after) => r.is_ok(),
        () = state.hub.waiters.closing() => false,
    }
}

/// The message that ends a stream: `event: error`, a Problem as its data
/// (`SseData`), as an HTTP answer of the same code would carry it.
fn error_message(problem: &serde_json::Value) -> SseEvent {
    SseEvent::default().event("error").data(problem.to_string())
}

fn pruned_error(oldest_seq: i64) -> serde_json::Value {
    let mut ext = serde_json::Map::new();
    ext.insert("oldest_seq".into(), oldest_seq.into());
    problem_body(
        StatusCode::GONE,
        Code::EventsPruned,
        "Events pruned",
        "the client fell behind what retention keeps; reconnect from oldest_seq",
        ext,
    )
}

/// As a `503` answer says it: `busy`, or `unavailable` with the cause
/// logged, not sent.
fn store_error(e: StoreError) -> serde_json::Value {
    let (code, title, detail) = match e {
        StoreError::Busy | StoreError::Stale | StoreError::RequestInProgress => {
            (Code::Busy, "Busy", BUSY_DETAIL)
        }
        StoreError::Unavailable(d) | StoreError::OutcomeUnknown(d) => {
            crate::store::outage::OUTAGE.refused(&d);
            (Code::Unavailable, "Store unavailable", UNAVAILABLE_DETAIL)
        }
        StoreError::Other(d) => {
            tracing::error!(error = %d, "store error while streaming events");
            (Code::Unavailable, "Store unavailable", UNAVAILABLE_DETAIL)
        }
    };
    problem_body(
        StatusCode::SERVICE_UNAVAILABLE,
        code,
        title,
        detail,
        serde_json::Map::new(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a generated client checks an `error` message's data against.
    #[test]
    fn a_stream_s_errors_are_problems() {
        let pruned: Problem = serde_json::from_value(pruned_error(6)).expect("a Problem");
        assert_eq!((pruned.status, pruned.code), (410, Code::EventsPruned));
        assert_eq!(pruned.oldest_seq, Some(6));
        let down = store_error(StoreError::Unavailable("disk /x: EIO".into()));
        let down: Problem = serde_json::from_value(down).expect("a Problem");
        assert_eq!((down.status, down.code), (503, Code::Unavailable));
        assert_eq!(down.type_, "about:blank");
        assert!(
            !down.detail.contains("EIO"),
            "the cause is logged, not sent"
        );
        let busy: Problem =
            serde_json::from_value(store_error(StoreError::Busy)).expect("a Problem");
        assert_eq!((busy.status, busy.code), (503, Code::Busy));
    }
}

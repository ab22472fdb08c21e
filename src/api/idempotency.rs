//! `Idempotency-Key` on every POST (see `crate::idempotency`): a repeat of
//! a request answers the first one's answer again without doing anything;
//! the key with another request is refused; a repeat while the first is
//! still being answered is `409 request_in_progress`.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::response::Parts;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;

use super::error::ApiError;
use super::{AppState, BODY_LIMIT};
use crate::idempotency::{Answer, Claim};
use crate::model::IdempotentRequest;

pub const HEADER: &str = "idempotency-key";
/// Set on an answer given again for a repeated key.
pub const REPLAYED: &str = "idempotent-replayed";
const MAX_KEY: usize = 128;
/// Answers are small JSON documents; a larger one is not kept.
const MAX_ANSWER: usize = 1024 * 1024;

fn invalid(detail: &str) -> Response {
    ApiError::validation("Idempotency-Key", detail).into_response()
}

/// The key, if it is 1..=128 printable ASCII bytes.
fn valid_key(value: &HeaderValue) -> Result<String, &'static str> {
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_KEY {
        return Err("must be 1 to 128 printable ASCII characters");
    }
    if !bytes.iter().all(|b| (0x20..=0x7e).contains(b)) {
        return Err("must be printable ASCII");
    }
    Ok(String::from_utf8_lossy(bytes).into_owned())
}

pub async fn guard(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let Some(value) = req.headers().get(HEADER) else {
        return next.run(req).await;
    };
    let key = match valid_key(value) {
        Ok(k) => k,
        Err(why) => return invalid(why),
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if declared.is_some_and(|n| n > BODY_LIMIT) {
        // Refused for its size as it would be without a key.
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, BODY_LIMIT).await else {
        return ApiError::PayloadTooLarge.into_response();
    };
    let target = parts.uri.path_and_query().map_or("", |p| p.as_str());
    let request = format!("{} {target}\n{}", parts.method, canonical(&bytes));
    // Answered here, not kept by the store yet (see `super::unkept`).
    if let Some(first) = state.unkept.answer(&key) {
        return again(first, &request);
    }
    // A repeat while the first is answered on this host: it must not run
    // (nor wait in a queue, as the first may before its key is recorded).
    let Some(entered) = state.in_flight.enter(&key, &request) else {
        return in_flight_elsewhere(&state, &key, &request).await;
    };
    let run_id = state.store.backend().run_id().to_owned();
    // Answered to the end even if the client goes away: its retry gets
    // this answer.
    let task = tokio::spawn(async move {
        let _entered = entered;
        // The key is not read first: the request's first transaction
        // claims it, and only a claim that finds it held reads it
        // (`held`), to answer the repeat, or to take over the key of a
        // run that has ended (then the request runs again, once).
        let mut supersedes = None;
        loop {
            let claim = Claim::new(key.clone(), request.clone(), supersedes, run_id.clone());
            let req = Request::from_parts(parts.clone(), Body::from(bytes.clone()));
            let res = claim.clone().scope(next.clone().run(req)).await;
            match keep(&state, &claim, res).await {
                Kept::Answer(res) => return res,
                Kept::TakeOver(first) if claim.supersedes.is_none() => supersedes = Some(first),
                Kept::TakeOver(_) => return ApiError::RequestInProgress.into_response(),
            }
        }
    });
    task.await.unwrap_or_else(|_| {
        ApiError::Internal("a request with an idempotency key panicked".into()).into_response()
    })
}

/// A body as it is compared with the first request's: a JSON body in one
/// form whatever its spacing and the order of its members, as a client
/// that builds it again for a retry may not keep them; any other as sent.
fn canonical(bytes: &[u8]) -> String {
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(mut v) => {
            v.sort_all_objects();
            v.to_string()
        }
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    }
}

/// Whether `stored`, a request as a server recorded it, is `now`, as
/// `guard` gives it: a version before `canonical` recorded the body as
/// sent, and a retry across the upgrade is the same request still.
fn same_request(stored: &str, now: &str) -> bool {
    stored == now
        || stored.split_once('\n').is_some_and(|(head, body)| {
            now.strip_prefix(head)
                .and_then(|rest| rest.strip_prefix('\n'))
                .is_some_and(|now_body| canonical(body.as_bytes()) == now_body)
        })
}

/// The keys of the keyed requests this host is answering, with their
/// requests' text.
#[derive(Default)]
pub struct InFlight(Mutex<HashMap<String, String>>);

/// `key` in flight until dropped.
pub struct Entered {
    set: Arc<InFlight>,
    key: String,
}

impl InFlight {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, String>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Mark `key` in flight for `request`; None when it is already.
    pub fn enter(self: &Arc<Self>, key: &str, request: &str) -> Option<Entered> {
        let mut keys = self.lock();
        if keys.contains_key(key) {
            return None;
        }
        keys.insert(key.to_owned(), request.to_owned());
        Some(Entered {
            set: self.clone(),
            key: key.to_owned(),
        })
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        self.set.lock().remove(&self.key);
    }
}

/// The answer to `request` under `key` while another request with that
/// key is answered on this host: its answer if the store keeps it already,
/// else `422` for another request or `409 request_in_progress`.
async fn in_flight_elsewhere(state: &AppState, key: &str, request: &str) -> Response {
    if let Ok(Some(first)) = state.store.backend().idempotent_request(key).await
        && first.status.is_some()
        && first.kept_at(crate::time::now_ms())
    {
        return again(first, request);
    }
    let other = state
        .in_flight
        .lock()
        .get(key)
        .is_some_and(|r| !same_request(r, request));
    if other {
        return another_request();
    }
    ApiError::RequestInProgress.into_response()
}

/// What a keyed request's handler left to answer.
enum Kept {
    Answer(Response),
    /// The key is held by this same request (the id given), left in
    /// progress by a run that has ended: run it again, taking the key over.
    TakeOver(String),
}

/// Whether `first` is this same request, left in progress by a server run
/// that has ended (killed, restarted) before it created anything: then
/// this one takes its key over and is done afresh (see
/// `crate::idempotency`).
async fn abandoned(
    backend: &dyn crate::store::Backend,
    first: &IdempotentRequest,
    request: &str,
) -> Result<bool, crate::store::StoreError> {
    let Some(run_id) = first.run_id.as_deref() else {
        return Ok(false);
    };
    if first.status.is_some() || !same_request(&first.request, request) {
        return Ok(false);
    }
    Ok(!backend.run_alive(run_id).await?)
}

/// What to answer a request that did not record its key: its handler
/// answered `res` before reaching the store (a refusal of its body, say),
/// or, with `conflict`, its claim found the key held by another request
/// (`res` is then `409 request_in_progress`). A key recorded in the last
/// 24 hours answers for it: the first request's answer if it was given (a
/// repeat, or one that raced the first), or `request_in_progress`; but a
/// first request left in progress by a run that has ended lets this one
/// take its key over (on a conflict) or answer for itself.
async fn stored(state: &AppState, claim: &Claim, res: Response, conflict: bool) -> Kept {
    if let Some(first) = state.unkept.answer(&claim.key) {
        return Kept::Answer(again(first, &claim.request));
    }
    let backend = state.store.backend();
    let Ok(Some(first)) = backend.idempotent_request(&claim.key).await else {
        return Kept::Answer(res);
    };
    if !first.kept_at(crate::time::now_ms()) {
        return Kept::Answer(res);
    }
    if first.status.is_some() || !same_request(&first.request, &claim.request) {
        return Kept::Answer(again(first, &claim.request));
    }
    match (abandoned(backend, &first, &claim.request).await, conflict) {
        (Ok(true), true) => Kept::TakeOver(first.request_id),
        (Ok(true), false) | (Err(_), _) => Kept::Answer(res),
        (Ok(false), _) => Kept::Answer(again(first, &claim.request)),
    }
}

fn another_request() -> Response {
    invalid("was used for another request (method, path or body) in the last 24 hours")
}

/// The answer to a repeat of `first`'s key.
fn again(first: IdempotentRequest, request: &str) -> Response {
    if !same_request(&first.request, request) {
        return another_request();
    }
    let Some(status) = first.status.and_then(|s| StatusCode::from_u16(s).ok()) else {
        return ApiError::RequestInProgress.into_response();
    };
    let body = first.body.unwrap_or_default();
    let location = (status == StatusCode::CREATED)
        .then(|| created_at(request, &body))
        .flatten();
    let mut res = Response::new(Body::from(body));
    *res.status_mut() = status;
    if let Some(l) = location.and_then(|l| HeaderValue::from_str(&l).ok()) {
        res.headers_mut().insert(header::LOCATION, l);
    }
    if let Some(ct) = first
        .content_type
        .and_then(|c| HeaderValue::from_str(&c).ok())
    {
        res.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    res.headers_mut()
        .insert(REPLAYED, HeaderValue::from_static("true"));
    res
}

/// The `Location` of what a `201` answer to `request` created: the
/// collection's path and the new record's id. Not kept with the answer,
/// it follows from it.
fn created_at(request: &str, body: &str) -> Option<String> {
    let target = request.lines().next()?.strip_prefix("POST ")?;
    let path = target.split('?').next()?;
    if !matches!(path, "/v1/leases" | "/v1/processes") {
        return None;
    }
    let made: serde_json::Value = serde_json::from_str(body).ok()?;
    Some(format!("{path}/{}", made.get("id")?.as_str()?))
}

/// Let the transaction that makes this request's change keep its answer
/// too, in one commit (see `crate::idempotency::Render`): `render` gives
/// the response the handler will give for a transaction's output (to
/// downcast), or None when that output is not the request's last word. A
/// request without a key has nothing to keep.
pub fn answer_in_tx(render: impl Fn(&dyn Any) -> Option<Response> + Send + Sync + 'static) {
    let Some(claim) = Claim::current() else {
        return;
    };
    claim.answer_with(Box::new(move |out| {
        let (parts, body) = render(out)?.into_parts();
        if parts.status.is_server_error() {
            return None;
        }
        // A handler's answer is a whole body, ready at once.
        let bytes = axum::body::to_bytes(body, MAX_ANSWER)
            .now_or_never()?
            .ok()?;
        Some(answer_of(&parts, &bytes))
    }));
}

/// Store the answer of a request that recorded its key, or let the key go
/// when the answer is a failure of the server (the request may be retried).
async fn keep(state: &AppState, claim: &Arc<Claim>, res: Response) -> Kept {
    if claim.answered() {
        return Kept::Answer(res);
    }
    // Held elsewhere, this request's claim was not kept (a claim undone
    // with its transaction may still count as recorded).
    let conflict = claim.held_elsewhere() && res.status() == StatusCode::CONFLICT;
    if conflict || !claim.recorded() {
        return stored(state, claim, res, conflict).await;
    }
    Kept::Answer(keep_answer(state, claim, res).await)
}

/// Keep the answer `res` of a request that recorded its key (and not its
/// answer), or let the key go after a failure of the server.
async fn keep_answer(state: &AppState, claim: &Arc<Claim>, res: Response) -> Response {
    let settle = |answer| {
        state.unkept.settle(
            &state.store,
            claim.key.clone(),
            claim.request_id.clone(),
            answer,
            claim.created(),
        )
    };
    let (parts, body) = res.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_ANSWER).await else {
        settle(None).await;
        return ApiError::Internal("an answer too large to keep".into()).into_response();
    };
    if parts.status.is_server_error() {
        if claim.unsure() {
            // Its change may be kept: a retry must not make it again.
            tracing::warn!(key = %claim.key, "a keyed request's change may be kept without its answer: its key stays in progress");
        } else {
            settle(None).await;
        }
        return Response::from_parts(parts, Body::from(bytes));
    }
    let (status, content_type, body) = answer_of(&parts, &bytes);
    let answer = IdempotentRequest {
        request: claim.request.clone(),
        request_id: claim.request_id.clone(),
        status: Some(status),
        content_type: Some(content_type),
        body: Some(body),
        created_at: crate::time::now_ms(),
        run_id: None,
    };
    settle(Some(answer)).await;
    Response::from_parts(parts, Body::from(bytes))
}

/// An answer as kept: status, content type, body.
fn answer_of(parts: &Parts, body: &[u8]) -> Answer {
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_owned();
    let body = String::from_utf8_lossy(body).into_owned();
    (parts.status.as_u16(), content_type, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_recorded_as_sent_by_an_earlier_version_is_the_same_request() {
        let now = format!(
            "POST /v1/leases\n{}",
            canonical(br#"{"resource":"r","holder":"h"}"#)
        );
        assert!(same_request(&now, &now));
        assert!(same_request(
            "POST /v1/leases\n{ \"resource\": \"r\", \"holder\": \"h\" }",
            &now
        ));
        assert!(!same_request(
            "POST /v1/leases\n{\"resource\":\"r\",\"holder\":\"x\"}",
            &now
        ));
        assert!(!same_request(
            "POST /v1/leases?x=1\n{\"resource\":\"r\",\"holder\":\"h\"}",
            &now
        ));
    }
}

//! One error type for every failure the API reports, rendered as RFC 9457
//! problem JSON with a stable `code`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use crate::leases::{self, LeaseError};
pub use crate::model::Code;
use crate::model::{LeaseView, PortRecord, ProcessView};
use crate::ports::ops::PortError;
use crate::processes::{self, ops::ProcError};
use crate::store::StoreError;

/// The record a `fenced` (or similar) problem shows as it is now.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code, clippy::large_enum_variant)] // documents `Problem.current`, which is built as JSON
pub enum CurrentRecord {
    Lease(LeaseView),
    Process(ProcessView),
    PortReservation(PortRecord),
}

/// RFC 9457 problem details. Extensions depend on `code`: `field` for
/// `validation` and `process_not_found`, `holder` for `lease_held` /
/// `owner_remote` / `owner_unverifiable`, `current` for `fenced`,
/// `not_reserved`, `process_alive`, `remote_process`,
/// `process_tree_not_settled` and the `identity_mismatch` of a stop (that
/// of a confirm or an acquire, refused before anything is recorded, has
/// none), `parent` for `parent_fenced`, `process`
/// for `operation_in_progress`, `oldest_seq` for `events_pruned`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[allow(dead_code)] // documents the body, which `problem()` builds as JSON
pub struct Problem {
    #[serde(rename = "type")]
    #[schema(example = "about:blank")]
    pub type_: String,
    #[schema(example = "Lease is held")]
    pub title: String,
    #[schema(example = 409)]
    pub status: u16,
    pub code: Code,
    pub detail: String,
    /// Dotted path of the offending member or parameter (`validation`, `process_not_found`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    #[schema(example = "ttl_ms")]
    pub field: Option<String>,
    /// The current lease that refused the acquire.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub holder: Option<LeaseView>,
    /// The record as it is now: a Lease, a Process, or (for a port's owner) either.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub current: Option<CurrentRecord>,
    /// The parent (or owning) lease as it is now; null when it does not exist.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<LeaseView>,
    /// The oldest seq still kept (`events_pruned`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub oldest_seq: Option<i64>,
    /// The process that holds the operation id (`operation_in_progress`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub process: Option<ProcessView>,
}

#[derive(Debug)]
pub enum ApiError {
    MalformedJson(String),
    Unauthorized,
    Forbidden(String),
    NotFound(String),
    PayloadTooLarge,
    HeadersTooLarge,
    UnsupportedMediaType,
    MethodNotAllowed,
    Validation {
        field: String,
        detail: String,
    },
    ProcessNotFound {
        field: String,
        pid: i64,
    },
    IdentityMismatch(String),
    OwnerUnverifiable(String),
    Lease(LeaseError),
    Proc(ProcError),
    Port(PortError),
    EventsPruned {
        oldest_seq: i64,
    },
    /// A request with the same `Idempotency-Key` is still being answered.
    RequestInProgress,
    Busy,
    Unavailable(String),
    /// A wait cut by the server's shutdown: retried, it goes on.
    ShuttingDown,
    Internal(String),
}

impl ApiError {
    pub fn validation(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::Validation {
            field: field.into(),
            detail: detail.into(),
        }
    }
}

impl From<crate::events::ReadError> for ApiError {
    fn from(e: crate::events::ReadError) -> Self {
        match e {
            crate::events::ReadError::Pruned { oldest_seq } => Self::EventsPruned { oldest_seq },
            crate::events::ReadError::Store(s) => s.into(),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Busy | StoreError::Stale => Self::Busy,
            StoreError::Unavailable(m) | StoreError::OutcomeUnknown(m) => Self::Unavailable(m),
            StoreError::Other(m) => Self::Internal(m),
            StoreError::RequestInProgress => Self::RequestInProgress,
        }
    }
}

impl From<processes::Error> for ApiError {
    fn from(e: processes::Error) -> Self {
        match e {
            processes::Error::Store(s) => s.into(),
            processes::Error::Proc(p) => Self::Proc(p),
            processes::Error::Invalid { field, detail } => Self::validation(field, detail),
            processes::Error::ProcessNotFound(pid) => Self::ProcessNotFound {
                field: "pid".into(),
                pid: i64::from(pid),
            },
            processes::Error::Unverifiable(d) => Self::OwnerUnverifiable(d),
            processes::Error::Mismatch(d) => Self::IdentityMismatch(d),
        }
    }
}

fn json_of<T: Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

fn proc_problem(e: ProcError) -> Response {
    let code = e.code();
    let mut ext = Map::new();
    let (status, title, detail) = match e {
        ProcError::NotFound => {
            return ApiError::NotFound("no process with that id".into()).into_response();
        }
        ProcError::Forbidden(why) => return ApiError::Forbidden(why).into_response(),
        ProcError::PortsExhausted => (
            StatusCode::CONFLICT,
            "Ports exhausted",
            "no free port could be reserved in the range".to_owned(),
        ),
        ProcError::LeaseFenced(l) => {
            ext.insert("parent".into(), l.as_deref().map_or(Value::Null, json_of));
            (
                StatusCode::CONFLICT,
                "Owning lease is not current",
                "the lease has ended or its token is not the current one".to_owned(),
            )
        }
        ProcError::OperationInProgress(p) => {
            ext.insert("process".into(), json_of(&p));
            let op = p.operation_id.clone().unwrap_or_default();
            (
                StatusCode::CONFLICT,
                "Operation in progress",
                format!("process {} already runs operation {op:?}", p.id),
            )
        }
        ProcError::Fenced(p) => {
            ext.insert("current".into(), json_of(&p));
            (
                StatusCode::CONFLICT,
                "Fenced",
                "the token is not the current one for this process, or the process has ended"
                    .to_owned(),
            )
        }
        ProcError::ProcessAlive(p) => {
            ext.insert("current".into(), json_of(&p));
            (
                StatusCode::CONFLICT,
                "Process is alive",
                "the recorded process is still live: stop it instead".to_owned(),
            )
        }
        ProcError::RemoteProcess(p) => {
            ext.insert("current".into(), json_of(&p));
            (
                StatusCode::CONFLICT,
                "Remote process",
                "the process lives on another host; this server will not signal it".to_owned(),
            )
        }
        ProcError::IdentityMismatch(p) => {
            ext.insert("current".into(), json_of(&p));
            (
                StatusCode::CONFLICT,
                "Identity mismatch",
                "the pid now belongs to another process; nothing was signalled".to_owned(),
            )
        }
        ProcError::NotSettled(p) => {
            ext.insert("current".into(), json_of(&p));
            (
                StatusCode::CONFLICT,
                "Process tree not settled",
                "the process tree is still alive; the record and its ports are kept".to_owned(),
            )
        }
    };
    problem(status, code, title, &detail, ext)
}

fn port_problem(e: PortError) -> Response {
    match e {
        PortError::NotFound => {
            ApiError::NotFound("no current reservation of that port, or no such owner".into())
                .into_response()
        }
        PortError::Exhausted => problem(
            StatusCode::CONFLICT,
            Code::PortsExhausted,
            "Ports exhausted",
            "no free port could be reserved in the range",
            Map::new(),
        ),
        PortError::Fenced(current) => {
            let mut ext = Map::new();
            ext.insert("current".into(), *current);
            problem(
                StatusCode::CONFLICT,
                Code::Fenced,
                "Fenced",
                "the token is not the owner's current one",
                ext,
            )
        }
    }
}

impl From<crate::ports::Error> for ApiError {
    fn from(e: crate::ports::Error) -> Self {
        match e {
            crate::ports::Error::Store(s) => s.into(),
            crate::ports::Error::Port(p) => Self::Port(p),
        }
    }
}

impl From<leases::Error> for ApiError {
    fn from(e: leases::Error) -> Self {
        match e {
            leases::Error::Store(s) => s.into(),
            leases::Error::Lease(l) => Self::Lease(l),
            leases::Error::ShuttingDown => Self::ShuttingDown,
        }
    }
}

fn lease_json(l: &LeaseView) -> Value {
    serde_json::to_value(l).unwrap_or(Value::Null)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut ext = Map::new();
        let (status, code, title, detail) = match self {
            Self::MalformedJson(d) => (
                StatusCode::BAD_REQUEST,
                Code::MalformedJson,
                "Malformed JSON",
                d,
            ),
            Self::Unauthorized => return unauthorized(),
            Self::Forbidden(d) => (StatusCode::FORBIDDEN, Code::Forbidden, "Forbidden", d),
            Self::NotFound(d) => (StatusCode::NOT_FOUND, Code::NotFound, "Not found", d),
            Self::PayloadTooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                Code::PayloadTooLarge,
                "Payload too large",
                "the request body is over the limit".into(),
            ),
            Self::HeadersTooLarge => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                Code::HeadersTooLarge,
                "Request headers too large",
                "the request line and headers are over 16 KiB".into(),
            ),
            Self::UnsupportedMediaType => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                Code::UnsupportedMediaType,
                "Unsupported media type",
                "send the body as application/json".into(),
            ),
            Self::MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                Code::MethodNotAllowed,
                "Method not allowed",
                "this path does not take that method".into(),
            ),
            Self::Validation { field, detail } => {
                ext.insert("field".into(), json!(field));
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    Code::Validation,
                    "Invalid request",
                    detail,
                )
            }
            Self::ProcessNotFound { field, pid } => {
                ext.insert("field".into(), json!(field));
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    Code::ProcessNotFound,
                    "Process not found",
                    format!("no live process with pid {pid} on this host"),
                )
            }
            Self::IdentityMismatch(d) => (
                StatusCode::CONFLICT,
                Code::IdentityMismatch,
                "Identity mismatch",
                d,
            ),
            Self::OwnerUnverifiable(d) => (
                StatusCode::CONFLICT,
                Code::OwnerUnverifiable,
                "Owner cannot be verified",
                d,
            ),
            Self::Lease(e) => {
                let code = e.code();
                let (title, detail, key, lease): (&str, String, &str, Option<Box<LeaseView>>) = match e {
                    LeaseError::NotFound => {
                        return Self::NotFound("no lease with that id".into()).into_response();
                    }
                    LeaseError::Held(l) => ("Lease is held", format!("{} is held by {}", l.resource, l.holder), "holder", Some(l)),
                    LeaseError::OwnerRemote(l) => (
                        "Owner is remote",
                        format!("{} is held by a process on another host and has no TTL that could expire", l.resource),
                        "holder",
                        Some(l),
                    ),
                    LeaseError::OwnerUnverifiable(l) => (
                        "Owner cannot be verified",
                        format!("the liveness of the owner of {} cannot be established on this host", l.resource),
                        "holder",
                        Some(l),
                    ),
                    LeaseError::ParentFenced(l) => (
                        "Parent lease is not current",
                        "the parent lease has ended or its token is not the current one".into(),
                        "parent",
                        l,
                    ),
                    LeaseError::Fenced(l) => (
                        "Fenced",
                        "the token is not the current one for this lease, or the lease has ended".into(),
                        "current",
                        Some(l),
                    ),
                    LeaseError::NotReserved(l) => (
                        "Lease is not reserved",
                        format!("the lease is {}, not reserved", l.state.as_str()),
                        "current",
                        Some(l),
                    ),
                };
                ext.insert(key.into(), lease.as_deref().map_or(Value::Null, lease_json));
                (StatusCode::CONFLICT, code, title, detail)
            }
            Self::EventsPruned { oldest_seq } => {
                ext.insert("oldest_seq".into(), json!(oldest_seq));
                (
                    StatusCode::GONE,
                    Code::EventsPruned,
                    "Events pruned",
                    format!("events before seq {oldest_seq} were removed by retention"),
                )
            }
            Self::Proc(e) => return proc_problem(e),
            Self::Port(e) => return port_problem(e),
            Self::RequestInProgress => (
                StatusCode::CONFLICT,
                Code::RequestInProgress,
                "Request in progress",
                "a request with the same Idempotency-Key is still being answered".into(),
            ),
            Self::Busy => (
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Busy,
                "Busy",
                BUSY_DETAIL.into(),
            ),
            Self::Unavailable(d) => {
                crate::store::outage::OUTAGE.refused(&d);
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    Code::Unavailable,
                    "Store unavailable",
                    UNAVAILABLE_DETAIL.into(),
                )
            }
            // `unavailable`, as when the store cannot be written: to the
            // client it is the same, retry it (here once the server is
            // back, or on another host of the fleet); but nothing failed.
            Self::ShuttingDown => (
                StatusCode::SERVICE_UNAVAILABLE,
                Code::Unavailable,
                "Shutting down",
                "the server is shutting down; retry the request (with the same Idempotency-Key)"
                    .into(),
            ),
            Self::Internal(d) => {
                tracing::error!(error = %d, "internal error");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Code::Internal,
                    "Internal error",
                    "an internal error occurred; it has been logged".into(),
                )
            }
        };
        problem(status, code, title, &detail, ext)
    }
}

pub const BUSY_DETAIL: &str =
    "the server is busy (its store, or its caps on waiting requests); retry after the given delay";
pub const UNAVAILABLE_DETAIL: &str =
    "the store cannot be read or written now (database down, disk full or read-only); retry later";

/// A problem's JSON (`Problem`), for a response or an event stream's `error`.
pub fn problem_body(
    status: StatusCode,
    code: Code,
    title: &str,
    detail: &str,
    ext: Map<String, Value>,
) -> Value {
    let mut body = Map::new();
    body.insert("type".into(), json!("about:blank"));
    body.insert("title".into(), json!(title));
    body.insert("status".into(), json!(status.as_u16()));
    body.insert("code".into(), json!(code.as_str()));
    body.insert("detail".into(), json!(detail));
    body.extend(ext);
    Value::Object(body)
}

pub fn problem(
    status: StatusCode,
    code: Code,
    title: &str,
    detail: &str,
    ext: Map<String, Value>,
) -> Response {
    let body = problem_body(status, code, title, detail, ext);
    let mut res = (status, body.to_string()).into_response();
    let headers = res.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    if status == StatusCode::SERVICE_UNAVAILABLE {
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    res
}

/// 401 with the `WWW-Authenticate` challenge.
fn unauthorized() -> Response {
    let mut res = problem(
        StatusCode::UNAUTHORIZED,
        Code::Unauthorized,
        "Unauthorized",
        "send Authorization: Bearer <token>",
        serde_json::Map::new(),
    );
    res.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    res
}

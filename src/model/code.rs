//! The contract's problem codes: each refusal type names its own, and the
//! API maps them to HTTP statuses.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The stable, machine-readable `code` of a problem: clients switch on it,
/// never on `title` or `detail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
#[schema(as = ProblemCode)]
pub enum Code {
    MalformedJson,
    Unauthorized,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    EventsPruned,
    LeaseHeld,
    Fenced,
    OwnerRemote,
    OwnerUnverifiable,
    ParentFenced,
    NotReserved,
    OperationInProgress,
    ProcessAlive,
    IdentityMismatch,
    RemoteProcess,
    ProcessTreeNotSettled,
    PortsExhausted,
    RequestInProgress,
    PayloadTooLarge,
    HeadersTooLarge,
    UnsupportedMediaType,
    Validation,
    ProcessNotFound,
    Busy,
    Unavailable,
    Internal,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MalformedJson => "malformed_json",
            Self::Unauthorized => "unauthorized",
            Self::Forbidden => "forbidden",
            Self::NotFound => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::EventsPruned => "events_pruned",
            Self::LeaseHeld => "lease_held",
            Self::Fenced => "fenced",
            Self::OwnerRemote => "owner_remote",
            Self::OwnerUnverifiable => "owner_unverifiable",
            Self::ParentFenced => "parent_fenced",
            Self::NotReserved => "not_reserved",
            Self::OperationInProgress => "operation_in_progress",
            Self::ProcessAlive => "process_alive",
            Self::IdentityMismatch => "identity_mismatch",
            Self::RemoteProcess => "remote_process",
            Self::ProcessTreeNotSettled => "process_tree_not_settled",
            Self::PortsExhausted => "ports_exhausted",
            Self::RequestInProgress => "request_in_progress",
            Self::PayloadTooLarge => "payload_too_large",
            Self::HeadersTooLarge => "headers_too_large",
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::Validation => "validation",
            Self::ProcessNotFound => "process_not_found",
            Self::Busy => "busy",
            Self::Unavailable => "unavailable",
            Self::Internal => "internal",
        }
    }
}

//! Records as the API shows them and the store keeps them.

mod code;
mod event;
mod idempotency;
pub mod int;
mod port;
mod process;
mod shapes;

pub use code::*;
pub use event::*;
pub use idempotency::*;
pub use port::*;
pub use process::*;
pub use shapes::*;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::time::Millis;

/// What the server itself read about a process on its host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Identity {
    pub pid: i32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22), as a string.
    pub start_time: String,
    /// Inode of a pidfd for the process (pidfs); null where the kernel has no pidfs.
    pub pidfd_inode: Option<String>,
    pub boot_id: String,
    pub host_id: String,
    pub pid_ns: String,
    pub hostname: String,
    pub executable: Option<String>,
    pub uid: Option<u32>,
    pub pgid: Option<i32>,
    pub sid: Option<i32>,
    /// A kernel thread (PF_KTHREAD), read now; never stored or shown.
    #[serde(skip)]
    pub kernel_thread: bool,
}

impl Identity {
    /// Same physical process, as the contract defines it.
    pub fn same_process(&self, now: &Identity) -> bool {
        self.host_id == now.host_id
            && self.pid_ns == now.pid_ns
            && self.boot_id == now.boot_id
            && self.pid == now.pid
            && match (&self.pidfd_inode, &now.pidfd_inode) {
                (Some(a), Some(b)) => a == b,
                _ => self.start_time == now.start_time,
            }
    }

    /// Why this, read now, is not the process whose start time a client
    /// saw (`{pid, start_time}` of an owner or a confirm), if it is not.
    pub fn not_the_one_seen(&self, seen: Option<&str>) -> Option<String> {
        seen.filter(|seen| *seen != self.start_time).map(|seen| {
            format!(
                "pid {} now has start time {}, not {seen}: it is another process",
                self.pid, self.start_time
            )
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Liveness {
    Live,
    Dead,
    Remote,
    Unknown,
}

/// Why a recorded process is not `live`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LivenessReason {
    PidAbsent,
    PidReused,
    Rebooted,
    OtherHost,
    OtherPidNamespace,
    PermissionDenied,
    ProcUnreadable,
    /// Claimed before any process was confirmed for it: whether one runs is unknown.
    IdentityUnknown,
}

impl LivenessReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PidAbsent => "pid_absent",
            Self::PidReused => "pid_reused",
            Self::Rebooted => "rebooted",
            Self::OtherHost => "other_host",
            Self::OtherPidNamespace => "other_pid_namespace",
            Self::PermissionDenied => "permission_denied",
            Self::ProcUnreadable => "proc_unreadable",
            Self::IdentityUnknown => "identity_unknown",
        }
    }
}

/// A recorded identity judged at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Judgement {
    pub status: Liveness,
    pub reason: Option<LivenessReason>,
}

impl Judgement {
    pub const LIVE: Judgement = Judgement {
        status: Liveness::Live,
        reason: None,
    };

    pub fn dead(reason: LivenessReason) -> Self {
        Self {
            status: Liveness::Dead,
            reason: Some(reason),
        }
    }
    pub fn remote(reason: LivenessReason) -> Self {
        Self {
            status: Liveness::Remote,
            reason: Some(reason),
        }
    }
    pub fn unknown(reason: LivenessReason) -> Self {
        Self {
            status: Liveness::Unknown,
            reason: Some(reason),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    Reserved,
    Active,
    Released,
    Expired,
    Reclaimed,
    Broken,
}

impl LeaseState {
    pub fn is_current(self) -> bool {
        matches!(self, Self::Reserved | Self::Active)
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reserved => "reserved",
            Self::Active => "active",
            Self::Released => "released",
            Self::Expired => "expired",
            Self::Reclaimed => "reclaimed",
            Self::Broken => "broken",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "reserved" => Self::Reserved,
            "active" => Self::Active,
            "released" => Self::Released,
            "expired" => Self::Expired,
            "reclaimed" => Self::Reclaimed,
            "broken" => Self::Broken,
            _ => return None,
        })
    }
}

/// The parent lease a lease was acquired under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ParentRef {
    #[schema(format = "uuid")]
    pub id: String,
    pub resource: String,
    pub token: i64,
}

/// A lease as the store keeps it; `owner_status` is judged when it is shown.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseRecord {
    pub id: String,
    pub resource: String,
    pub token: i64,
    pub holder: String,
    pub state: LeaseState,
    pub owner: Option<Identity>,
    pub parent: Option<ParentRef>,
    pub ttl_ms: Option<i64>,
    pub expires_at: Option<Millis>,
    pub acquired_at: Millis,
    pub renewed_at: Option<Millis>,
    pub ended_at: Option<Millis>,
    pub end_reason: Option<String>,
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

impl LeaseRecord {
    pub fn ttl_passed(&self, now: Millis) -> bool {
        self.expires_at.is_some_and(|at| now >= at)
    }
}

/// Filters of a lease listing.
#[derive(Debug, Clone, Default)]
pub struct LeaseFilter {
    pub resource: Option<String>,
    pub prefix: Option<String>,
    pub holder: Option<String>,
    pub parent: Option<String>,
    pub state: StateFilter,
    pub limit: u32,
    /// Only ids strictly below this one (lists are newest first).
    pub before_id: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StateFilter {
    #[default]
    Current,
    Ended,
    All,
}

/// A stored event; `payload` is the JSON object the API returns, without `seq`.
#[derive(Debug, Clone)]
pub struct EventRow {
    pub seq: i64,
    pub payload: String,
}

/// A lease as the API shows it: the record plus its owner judged now.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(as = Lease)]
pub struct LeaseView {
    #[schema(format = "uuid", example = "01937b4e-5d2a-7c4e-9a1b-2f3c4d5e6f70")]
    pub id: String,
    #[schema(example = "workspace/alpha")]
    pub resource: String,
    /// Fencing token: strictly greater than every earlier token of this resource.
    #[schema(minimum = 1, example = 42)]
    pub token: i64,
    pub holder: String,
    pub state: LeaseState,
    pub owner: Option<Identity>,
    pub owner_status: Option<Liveness>,
    /// Why the owner is not live (`pid_absent`, `pid_reused`, `rebooted`, ...); null when live.
    pub owner_status_reason: Option<LivenessReason>,
    pub parent: Option<ParentRef>,
    pub ttl_ms: Option<i64>,
    #[serde(with = "crate::time::ser::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub expires_at: Option<Millis>,
    /// TTL passed while the bound owner is still live.
    pub stale: bool,
    #[serde(with = "crate::time::ser")]
    #[schema(value_type = String, format = DateTime)]
    pub acquired_at: Millis,
    #[serde(with = "crate::time::ser::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub renewed_at: Option<Millis>,
    #[serde(with = "crate::time::ser::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub ended_at: Option<Millis>,
    /// `released`, `ttl_expired`, `owner_dead:<reason>` or `broken:<reason>`.
    pub end_reason: Option<String>,
    #[schema(value_type = Metadata)]
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

impl LeaseView {
    /// Show `rec` with its owner judged as `owner` at `now`.
    pub fn new(rec: LeaseRecord, owner: Option<Judgement>, now: Millis) -> Self {
        let stale = rec.state.is_current()
            && rec.ttl_passed(now)
            && owner.is_some_and(|j| j.status == Liveness::Live);
        Self {
            id: rec.id,
            resource: rec.resource,
            token: rec.token,
            holder: rec.holder,
            state: rec.state,
            owner: rec.owner,
            owner_status: owner.map(|j| j.status),
            owner_status_reason: owner.and_then(|j| j.reason),
            parent: rec.parent,
            ttl_ms: rec.ttl_ms,
            expires_at: rec.expires_at,
            stale,
            acquired_at: rec.acquired_at,
            renewed_at: rec.renewed_at,
            ended_at: rec.ended_at,
            end_reason: rec.end_reason,
            metadata: rec.metadata,
        }
    }
}

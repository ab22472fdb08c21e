//! Managed processes.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Identity, Judgement, Liveness, LivenessReason};
use crate::time::Millis;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    /// Registered, no pid yet.
    Starting,
    Running,
    /// A stop is in progress.
    Stopping,
    /// Claimed by the reconciler because its owner went away; being stopped.
    Orphaned,
    /// It ended by itself.
    Exited,
    /// We stopped it.
    Stopped,
    Failed,
}

impl ProcessState {
    pub fn is_current(self) -> bool {
        matches!(
            self,
            Self::Starting | Self::Running | Self::Stopping | Self::Orphaned
        )
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Stopping => "stopping",
            Self::Orphaned => "orphaned",
            Self::Exited => "exited",
            Self::Stopped => "stopped",
            Self::Failed => "failed",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "starting" => Self::Starting,
            "running" => Self::Running,
            "stopping" => Self::Stopping,
            "orphaned" => Self::Orphaned,
            "exited" => Self::Exited,
            "stopped" => Self::Stopped,
            "failed" => Self::Failed,
            _ => return None,
        })
    }
}

/// A lease (or process) named by id and the token the caller holds for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenRef {
    #[schema(format = "uuid")]
    pub id: String,
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "crate::model::int::i64")]
    pub token: i64,
}

/// What a spawned process runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Command {
    /// Program and arguments; no shell is involved.
    pub argv: Vec<String>,
    /// Working directory; the server's own when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Added to the server's environment (without its `HOLDFAST_*` variables).
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Logs {
    pub stdout: String,
    pub stderr: String,
}

/// How a process ended, as far as it is known.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Exit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ProcessRecord {
    pub id: String,
    pub kind: String,
    pub state: ProcessState,
    pub token: i64,
    pub operation_id: Option<String>,
    pub lease: Option<TokenRef>,
    pub host_id: String,
    pub identity: Option<Identity>,
    /// Whether a stop signals the group the process leads: a spawned child's
    /// always, a confirmed process's only when confirmed with `process_group`.
    pub signal_group: bool,
    pub owner: Option<Identity>,
    pub spawned: bool,
    pub command: Option<Command>,
    pub logs: Option<Logs>,
    pub exit: Exit,
    pub ttl_ms: Option<i64>,
    pub expires_at: Option<Millis>,
    pub created_at: Millis,
    pub started_at: Option<Millis>,
    pub ended_at: Option<Millis>,
    pub end_reason: Option<String>,
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

impl ProcessRecord {
    pub fn pid(&self) -> Option<i32> {
        self.identity.as_ref().map(|i| i.pid)
    }
    /// The process group we may signal: its own, when it leads one and
    /// `signal_group` says so.
    pub fn pgid(&self) -> Option<i32> {
        self.identity
            .as_ref()
            .filter(|_| self.signal_group)
            .and_then(|i| i.pgid.filter(|g| *g == i.pid))
    }
}

/// A process as the API shows it: the record, its identity judged now, and
/// the ports it holds.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(as = Process)]
pub struct ProcessView {
    #[schema(format = "uuid")]
    pub id: String,
    #[schema(example = "dev-server")]
    pub kind: String,
    pub state: ProcessState,
    /// Fences every mutation; changes when the reconciler claims the record.
    pub token: i64,
    pub operation_id: Option<String>,
    pub lease: Option<TokenRef>,
    pub pid: Option<i32>,
    /// The process group a stop signals: a spawned child's own, a confirmed
    /// process's own only when it leads one and was confirmed with
    /// `process_group`; null otherwise. `identity.pgid` is the group it is in.
    pub pgid: Option<i32>,
    pub identity: Option<Identity>,
    pub status: Option<Liveness>,
    pub status_reason: Option<LivenessReason>,
    /// The process that keeps it alive by heartbeats, if any.
    pub owner: Option<Identity>,
    pub spawned: bool,
    pub command: Option<Command>,
    pub logs: Option<Logs>,
    pub exit: Exit,
    /// Port reservations held by this process, by name.
    #[schema(value_type = super::PortMap)]
    pub ports: std::collections::BTreeMap<String, u16>,
    pub ttl_ms: Option<i64>,
    #[serde(with = "crate::time::ser::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub expires_at: Option<Millis>,
    #[serde(with = "crate::time::ser")]
    #[schema(value_type = String, format = DateTime)]
    pub created_at: Millis,
    #[serde(with = "crate::time::ser::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub started_at: Option<Millis>,
    #[serde(with = "crate::time::ser::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub ended_at: Option<Millis>,
    pub end_reason: Option<String>,
    #[schema(value_type = super::Metadata)]
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

impl ProcessView {
    pub fn new(
        rec: ProcessRecord,
        judged: Option<Judgement>,
        ports: std::collections::BTreeMap<String, u16>,
    ) -> Self {
        let pgid = rec.pgid();
        let judged = judged.or_else(|| {
            (rec.state == ProcessState::Orphaned && rec.identity.is_none())
                .then(|| Judgement::unknown(LivenessReason::IdentityUnknown))
        });
        Self {
            pid: rec.pid(),
            pgid,
            status: judged.map(|j| j.status),
            status_reason: judged.and_then(|j| j.reason),
            id: rec.id,
            kind: rec.kind,
            state: rec.state,
            token: rec.token,
            operation_id: rec.operation_id,
            lease: rec.lease,
            identity: rec.identity,
            owner: rec.owner,
            spawned: rec.spawned,
            command: rec.command,
            logs: rec.logs,
            exit: rec.exit,
            ports,
            ttl_ms: rec.ttl_ms,
            expires_at: rec.expires_at,
            created_at: rec.created_at,
            started_at: rec.started_at,
            ended_at: rec.ended_at,
            end_reason: rec.end_reason,
            metadata: rec.metadata,
        }
    }
}

/// Filters of a process listing.
#[derive(Debug, Clone, Default)]
pub struct ProcessFilter {
    pub state: super::StateFilter,
    pub kind: Option<String>,
    pub operation_id: Option<String>,
    pub lease: Option<String>,
    pub limit: u32,
    pub before_id: Option<String>,
}

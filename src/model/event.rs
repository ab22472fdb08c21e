//! The kinds of state change the event log records.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{LeaseState, ProcessState};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub enum EventType {
    /// Also for a reserve.
    #[serde(rename = "lease.acquired")]
    LeaseAcquired,
    #[serde(rename = "lease.activated")]
    LeaseActivated,
    #[serde(rename = "lease.released")]
    LeaseReleased,
    #[serde(rename = "lease.expired")]
    LeaseExpired,
    #[serde(rename = "lease.reclaimed")]
    LeaseReclaimed,
    #[serde(rename = "lease.broken")]
    LeaseBroken,
    #[serde(rename = "process.registered")]
    ProcessRegistered,
    #[serde(rename = "process.running")]
    ProcessRunning,
    #[serde(rename = "process.exited")]
    ProcessExited,
    #[serde(rename = "process.stopped")]
    ProcessStopped,
    #[serde(rename = "process.failed")]
    ProcessFailed,
    #[serde(rename = "process.orphaned")]
    ProcessOrphaned,
    #[serde(rename = "process.kill_failed")]
    ProcessKillFailed,
    #[serde(rename = "port.reserved")]
    PortReserved,
    #[serde(rename = "port.released")]
    PortReleased,
}

impl EventType {
    pub const ALL: [EventType; 15] = [
        Self::LeaseAcquired,
        Self::LeaseActivated,
        Self::LeaseReleased,
        Self::LeaseExpired,
        Self::LeaseReclaimed,
        Self::LeaseBroken,
        Self::ProcessRegistered,
        Self::ProcessRunning,
        Self::ProcessExited,
        Self::ProcessStopped,
        Self::ProcessFailed,
        Self::ProcessOrphaned,
        Self::ProcessKillFailed,
        Self::PortReserved,
        Self::PortReleased,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::LeaseAcquired => "lease.acquired",
            Self::LeaseActivated => "lease.activated",
            Self::LeaseReleased => "lease.released",
            Self::LeaseExpired => "lease.expired",
            Self::LeaseReclaimed => "lease.reclaimed",
            Self::LeaseBroken => "lease.broken",
            Self::ProcessRegistered => "process.registered",
            Self::ProcessRunning => "process.running",
            Self::ProcessExited => "process.exited",
            Self::ProcessStopped => "process.stopped",
            Self::ProcessFailed => "process.failed",
            Self::ProcessOrphaned => "process.orphaned",
            Self::ProcessKillFailed => "process.kill_failed",
            Self::PortReserved => "port.reserved",
            Self::PortReleased => "port.released",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// The event that records a lease entering `state`.
    pub fn of_lease(state: LeaseState) -> Self {
        match state {
            LeaseState::Reserved | LeaseState::Active => Self::LeaseAcquired,
            LeaseState::Released => Self::LeaseReleased,
            LeaseState::Expired => Self::LeaseExpired,
            LeaseState::Reclaimed => Self::LeaseReclaimed,
            LeaseState::Broken => Self::LeaseBroken,
        }
    }

    /// The event that records a process entering `state`.
    pub fn of_process(state: ProcessState) -> Self {
        match state {
            ProcessState::Starting => Self::ProcessRegistered,
            ProcessState::Running | ProcessState::Stopping => Self::ProcessRunning,
            ProcessState::Orphaned => Self::ProcessOrphaned,
            ProcessState::Exited => Self::ProcessExited,
            ProcessState::Stopped => Self::ProcessStopped,
            ProcessState::Failed => Self::ProcessFailed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_serde_and_parse() {
        for t in EventType::ALL {
            let json = serde_json::to_value(t).expect("serialize");
            assert_eq!(json, serde_json::Value::String(t.as_str().to_owned()));
            assert_eq!(EventType::parse(t.as_str()), Some(t));
        }
        assert_eq!(EventType::parse("lease.renewed"), None);
    }
}

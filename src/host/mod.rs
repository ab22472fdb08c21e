//! The local machine as holdfast sees it: process identities read from /proc.
//! Behind the `Host` trait so that tests can stage reused pids, reboots,
//! remote owners and unreadable processes.

#[cfg(test)]
pub mod fake;
pub(crate) mod identity;
mod judge;
pub mod signal;
pub mod spawn;
pub mod watch;

pub use identity::{LocalFacts, ProcHost};
pub use judge::judge;

use crate::model::{Identity, Judgement};

#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// No such process, or only its zombie is left.
    #[error("no process with pid {0} on this host")]
    NotFound(i32),
    #[error("permission denied reading process {0}")]
    PermissionDenied(i32),
    #[error("cannot read /proc for process {pid}: {source}")]
    Unreadable { pid: i32, source: std::io::Error },
}

pub trait Host: Send + Sync + 'static {
    /// Facts about this host that every identity is compared against.
    fn local(&self) -> &LocalFacts;

    /// Read the identity of `pid` as it is now; a zombie counts as absent.
    fn observe(&self, pid: i32) -> Result<Identity, ObserveError>;

    /// Read the identity of a child that may already be a zombie (not yet reaped).
    fn observe_child(&self, pid: i32) -> Result<Identity, ObserveError> {
        self.observe(pid)
    }

    /// The live processes that hold one of `files` open for writing: how a
    /// child is found again whose pid was never recorded (it writes to its
    /// log files, through the descriptors it was started with). A reader
    /// (`tail -f`, a log shipper, a user allowed to read the files) is none
    /// of the spawn's, and is not among them.
    fn writers_of(&self, files: &[&std::path::Path]) -> Vec<i32>;

    /// Judge a recorded identity now.
    fn judge(&self, recorded: &Identity) -> Judgement {
        judge(self.local(), recorded, || self.observe(recorded.pid))
    }
}

//! Signals that reach only the process that was recorded: a pidfd is opened
//! first, the identity is checked through it, and the signal goes through
//! the same pidfd (or to the group that the verified leader leads).

use std::os::fd::OwnedFd;

use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};

use super::identity::Stat;
use super::{Host, ObserveError};
use crate::model::Identity;

/// The recorded process, checked now.
#[derive(Debug)]
pub enum Verified {
    /// The same process: signal it through this pidfd. With the process
    /// group it is in now, which need not be the one it was recorded in
    /// (`setpgid(2)`).
    Same(OwnedFd, Option<i32>),
    /// No process with that pid, or only its zombie.
    Absent,
    /// The pid now belongs to another process: signal nothing.
    Reused,
    /// Recorded on another boot, PID namespace or host: its pid and group
    /// numbers name nothing here, so nothing is signalled, group included.
    Foreign,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sig {
    Term,
    Kill,
}

impl Sig {
    fn raw(self) -> Signal {
        match self {
            Sig::Term => Signal::TERM,
            Sig::Kill => Signal::KILL,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Sig::Term => "SIGTERM",
            Sig::Kill => "SIGKILL",
        }
    }
}

/// Open a pidfd for `recorded.pid`, then decide whether it is the recorded
/// process. The check happens after the open, so a later signal through the
/// pidfd reaches the process that was checked, never a successor.
pub fn verify(host: &dyn Host, recorded: &Identity) -> Result<Verified, ObserveError> {
    let local = host.local();
    if recorded.boot_id != local.boot_id
        || recorded.pid_ns != local.pid_ns
        || recorded.host_id != local.host_id
    {
        return Ok(Verified::Foreign);
    }
    let Some(pid) = Pid::from_raw(recorded.pid) else {
        return Ok(Verified::Absent);
    };
    let fd = match pidfd_open(pid, PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::SRCH) => return Ok(Verified::Absent),
        Err(e) => {
            return Err(ObserveError::Unreadable {
                pid: recorded.pid,
                source: e.into(),
            });
        }
    };
    match host.observe(recorded.pid) {
        Ok(now) if recorded.same_process(&now) => Ok(Verified::Same(fd, now.pgid)),
        Ok(_) => Ok(Verified::Reused),
        Err(ObserveError::NotFound(_)) => Ok(Verified::Absent),
        Err(e) => Err(e),
    }
}

/// Signal the verified process itself.
pub fn signal_process(fd: &OwnedFd, sig: Sig) -> std::io::Result<()> {
    pidfd_send_signal(fd, sig.raw()).map_err(Into::into)
}

/// Signal a whole process group. Call only while its leader is verified, or
/// while the leader is gone and the group still exists: Linux does not give
/// a number still used by a live group to a new process.
pub fn signal_group(pgid: i32, sig: Sig) -> std::io::Result<()> {
    let pid = Pid::from_raw(pgid).ok_or_else(|| std::io::Error::other("invalid process group"))?;
    rustix::process::kill_process_group(pid, sig.raw()).map_err(Into::into)
}

/// Whether any process other than a zombie is left in group `pgid`.
/// Zombies count as gone: they run nothing, and whoever inherited them
/// (perhaps an init that never reaps) decides when they disappear.
pub fn group_alive(pgid: i32) -> bool {
    let exists =
        Pid::from_raw(pgid).is_some_and(|p| rustix::process::test_kill_process_group(p).is_ok());
    exists && live_member(pgid)
}

fn live_member(pgid: i32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return true;
    };
    dir.flatten().any(|entry| {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
        let Ok(text) = std::fs::read(entry.path().join("stat")) else {
            return false;
        };
        Stat::parse(&text).is_some_and(|st| !st.zombie && st.pgid == pgid)
    })
}

/// How a refusal names the server's group or session: `holdfast run` tells
/// such a refusal from the others by it.
pub const SERVERS_OWN: &str = "the server's own";

/// The server's own pid, process group and session, which it never signals.
#[derive(Debug, Clone, Copy)]
pub struct OwnIds {
    pub pid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub uid: u32,
}

impl OwnIds {
    /// Read from `/proc/self/stat`, not getpgrp(2)/getsid(2): those return 0
    /// when the group or session leader is outside our PID namespace (a
    /// container, `unshare -pf`), which rustix's typed pids cannot hold. 0
    /// here means "not visible", and no refusal is then made on it.
    pub fn read() -> Self {
        let stat = std::fs::read("/proc/self/stat")
            .ok()
            .and_then(|t| Stat::parse(&t));
        Self {
            pid: rustix::process::getpid().as_raw_nonzero().get(),
            pgid: stat.as_ref().map_or(0, |s| s.pgid),
            sid: stat.as_ref().map_or(0, |s| s.sid),
            uid: rustix::process::getuid().as_raw(),
        }
    }

    /// Why the server refuses to act on `ident`, if it does.
    pub fn refusal(&self, ident: &Identity) -> Option<String> {
        if ident.pid == 1 {
            return Some("pid 1 is never signalled".into());
        }
        if ident.kernel_thread {
            return Some("kernel threads are never signalled".into());
        }
        if ident.pid == self.pid {
            return Some("that is the holdfast server itself".into());
        }
        if ident.pgid == Some(self.pgid) && self.pgid != 0 {
            return Some(format!("that process is in {SERVERS_OWN} process group"));
        }
        if ident.sid == Some(self.sid) && self.sid != 0 {
            return Some(format!("that process is in {SERVERS_OWN} session"));
        }
        None
    }
}

//! A host staged by tests: a table of pids and what reading each one gives,
//! changed mid-test (a process dies, its pid is reused, /proc turns
//! unreadable). Judgement goes through `Host::judge`'s default, so the
//! production rules decide; nothing here reads /proc or signals anything.
//!
//! Staged pids start above the kernel's largest possible pid (4,194,304), so
//! no real process is ever named by them, should one reach a real syscall.

use std::collections::HashMap;
use std::sync::Mutex;

use super::{Host, LocalFacts, ObserveError};
use crate::model::Identity;

/// The first pid `FakeHost::spawn` hands out.
pub const FIRST_PID: i32 = 5_000_000;

/// What reading a staged pid gives.
#[derive(Debug, Clone)]
enum Slot {
    Running(Identity),
    PermissionDenied,
    Unreadable,
}

#[derive(Default)]
struct Table {
    slots: HashMap<i32, Slot>,
    /// Source of unique pids and start times.
    counter: i32,
    /// Every pid looked up, in order.
    lookups: Vec<i32>,
    /// Which pids hold a file open.
    writers: HashMap<std::path::PathBuf, Vec<i32>>,
}

pub struct FakeHost {
    facts: LocalFacts,
    table: Mutex<Table>,
}

impl Default for FakeHost {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeHost {
    pub fn new() -> Self {
        Self {
            facts: LocalFacts {
                host_id: "host-here".into(),
                boot_id: "boot-now".into(),
                pid_ns: "4026531836".into(),
                hostname: "here".into(),
            },
            table: Mutex::default(),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new local process at `pid` (a fresh one when None), with a start
    /// time and pidfd inode no other staged process has.
    fn start_at(&self, pid: Option<i32>) -> Identity {
        let mut t = self.table();
        let serial = t.counter;
        t.counter += 1;
        let pid = pid.unwrap_or(FIRST_PID + serial);
        let ident = Identity {
            pid,
            start_time: format!("{}", 1000 + serial),
            pidfd_inode: Some(format!("{}", 9000 + serial)),
            boot_id: self.facts.boot_id.clone(),
            host_id: self.facts.host_id.clone(),
            pid_ns: self.facts.pid_ns.clone(),
            hostname: self.facts.hostname.clone(),
            executable: Some("/usr/bin/fake".into()),
            uid: Some(rustix::process::getuid().as_raw()),
            pgid: Some(pid),
            sid: Some(pid),
            kernel_thread: false,
        };
        t.slots.insert(pid, Slot::Running(ident.clone()));
        ident
    }

    /// Start a live process on a fresh pid; its identity as it would be recorded.
    pub fn spawn(&self) -> Identity {
        self.start_at(None)
    }

    /// The process at `pid` is gone (no process, or only its zombie).
    pub fn kill(&self, pid: i32) {
        self.table().slots.remove(&pid);
    }

    /// The process at `pid` is gone and another one now has its pid.
    pub fn reuse(&self, pid: i32) -> Identity {
        self.start_at(Some(pid))
    }

    /// Reading `pid` is refused (EACCES): its liveness is `unknown`.
    pub fn deny(&self, pid: i32) {
        self.table().slots.insert(pid, Slot::PermissionDenied);
    }

    /// /proc for `pid` cannot be read (EIO and the like): `unknown`.
    pub fn unreadable(&self, pid: i32) {
        self.table().slots.insert(pid, Slot::Unreadable);
    }

    /// An identity recorded on another host: never looked up here.
    pub fn remote(&self) -> Identity {
        let mut i = self.foreign();
        i.host_id = "host-elsewhere".into();
        i.hostname = "elsewhere".into();
        i
    }

    /// An identity recorded on this host in another PID namespace.
    pub fn other_namespace(&self) -> Identity {
        let mut i = self.foreign();
        i.pid_ns = "4026532000".into();
        i
    }

    /// An identity recorded on this host before it rebooted.
    pub fn before_reboot(&self) -> Identity {
        let mut i = self.foreign();
        i.boot_id = "boot-before".into();
        i
    }

    /// A fresh identity that is not staged in the table.
    fn foreign(&self) -> Identity {
        let i = self.spawn();
        self.kill(i.pid);
        i
    }

    /// Which staged processes hold `file` open for writing.
    pub fn write_to(&self, file: &std::path::Path, pids: &[i32]) {
        self.table().writers.insert(file.to_owned(), pids.to_vec());
    }

    /// The pids looked up so far, in order.
    pub fn lookups(&self) -> Vec<i32> {
        self.table().lookups.clone()
    }
}

impl Host for FakeHost {
    fn writers_of(&self, files: &[&std::path::Path]) -> Vec<i32> {
        let t = self.table();
        files
            .iter()
            .filter_map(|f| t.writers.get(*f))
            .flatten()
            .copied()
            .filter(|pid| matches!(t.slots.get(pid), Some(Slot::Running(_))))
            .collect()
    }

    fn local(&self) -> &LocalFacts {
        &self.facts
    }

    fn observe(&self, pid: i32) -> Result<Identity, ObserveError> {
        let mut t = self.table();
        t.lookups.push(pid);
        match t.slots.get(&pid) {
            Some(Slot::Running(i)) => Ok(i.clone()),
            Some(Slot::PermissionDenied) => Err(ObserveError::PermissionDenied(pid)),
            Some(Slot::Unreadable) => Err(ObserveError::Unreadable {
                pid,
                source: std::io::Error::other("staged: unreadable"),
            }),
            None => Err(ObserveError::NotFound(pid)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Judgement, Liveness, LivenessReason as R};

    #[test]
    fn staged_processes_are_judged_by_the_production_rules() {
        let host = FakeHost::new();
        let a = host.spawn();
        let b = host.spawn();
        assert_ne!(a.pid, b.pid);
        assert_eq!(host.judge(&a), Judgement::LIVE);

        host.kill(a.pid);
        assert_eq!(host.judge(&a), Judgement::dead(R::PidAbsent));

        let successor = host.reuse(b.pid);
        assert_eq!(successor.pid, b.pid);
        assert_eq!(host.judge(&b), Judgement::dead(R::PidReused));
        assert_eq!(host.judge(&successor), Judgement::LIVE);

        host.deny(successor.pid);
        assert_eq!(
            host.judge(&successor),
            Judgement::unknown(R::PermissionDenied)
        );
        host.unreadable(successor.pid);
        assert_eq!(
            host.judge(&successor),
            Judgement::unknown(R::ProcUnreadable)
        );
    }

    #[test]
    fn remote_and_rebooted_identities_are_never_looked_up() {
        let host = FakeHost::new();
        let (remote, ns, old) = (host.remote(), host.other_namespace(), host.before_reboot());
        assert_eq!(host.judge(&remote), Judgement::remote(R::OtherHost));
        assert_eq!(host.judge(&ns), Judgement::remote(R::OtherPidNamespace));
        assert_eq!(host.judge(&old), Judgement::dead(R::Rebooted));
        assert_eq!(host.judge(&remote).status, Liveness::Remote);
        assert!(host.lookups().is_empty(), "{:?}", host.lookups());
    }

    #[test]
    fn staged_pids_are_beyond_any_real_pid() {
        let host = FakeHost::new();
        // PID_MAX_LIMIT on 64-bit Linux.
        assert!(host.spawn().pid > 4_194_304);
    }
}

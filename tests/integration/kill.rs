//! Killing what a test leaves behind, each process through a pidfd opened
//! before it is checked. Pids come round again within seconds here
//! (`pid_max` is 32768, and some tests steer pids through `ns_last_pid`):
//! a pid or a group id remembered from earlier may by now name another
//! test's server, which `setsid` makes the leader of a group of the same
//! id. That is how a test once SIGKILLed the server of the connection-cut
//! campaign running beside it.

use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};

/// SIGKILL `pid` if `is_it(pid)` holds once a pidfd of it is open. Should
/// the process end between the two and its pid go to another that passes
/// the check, the signal still goes to the ended one: to nobody.
pub fn kill_if(pid: i32, is_it: impl FnOnce(i32) -> bool) {
    let Some(p) = Pid::from_raw(pid) else {
        return;
    };
    let Ok(fd) = pidfd_open(p, PidfdFlags::empty()) else {
        return;
    };
    if is_it(pid) {
        let _ = pidfd_send_signal(&fd, Signal::KILL);
    }
}

/// What `/proc/<pid>/stat` says of a process's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub pgrp: i32,
    pub session: i32,
    /// Clock ticks after boot.
    pub start: u64,
    /// Ended, not reaped yet (state `Z` or `X`).
    pub zombie: bool,
}

pub fn stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command's closing parenthesis, from field 3 on.
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    Some(Stat {
        zombie: matches!(*fields.first()?, "Z" | "X"),
        pgrp: fields.get(2)?.parse().ok()?,
        session: fields.get(3)?.parse().ok()?,
        start: fields.get(19)?.parse().ok()?,
    })
}

/// Every pid in /proc now.
pub fn pids() -> Vec<i32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// SIGKILLs a process group when dropped: no command outlives a failed test.
/// Only the group this guard was made for. The kernel hands out no pid that
/// a process still uses as its group's id, so a process whose pid is the
/// group's id but which started at another time than the leader means the
/// group is gone, and its id taken by another. Otherwise its members are
/// those in the group and in the session its leader was in, started no
/// earlier.
pub struct Group {
    pgid: i32,
    /// The leader as it was when the guard was made; None if it had ended.
    leader: Option<Stat>,
}

impl Group {
    pub fn new(pgid: i32) -> Self {
        let leader = stat(pgid).filter(|s| s.pgrp == pgid);
        Self { pgid, leader }
    }

    /// Whether the id may still be this group's.
    fn still_ours(&self) -> bool {
        let Some(leader) = self.leader else {
            return false;
        };
        stat(self.pgid).is_none_or(|s| s.start == leader.start)
    }

    fn holds(&self, pid: i32) -> bool {
        let Some(leader) = self.leader else {
            return false;
        };
        stat(pid).is_some_and(|s| {
            s.pgrp == self.pgid
                && s.session == leader.session
                && s.start >= leader.start
                && (pid != self.pgid || s.start == leader.start)
        })
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if !self.still_ours() {
            return;
        }
        for pid in pids() {
            kill_if(pid, |pid| self.holds(pid));
        }
    }
}

#[tokio::test]
async fn a_group_guard_kills_its_group_and_not_a_later_one_of_its_id() {
    use std::os::unix::process::ExitStatusExt;
    use std::time::Duration;
    let (mut leader, pid, member) = crate::support::shell_with_a_member().await;
    let guard = Group::new(pid);
    // A guard made for an earlier group of the same id, in the same
    // session, whose leader ended and left the id to this one.
    let stale = Group {
        pgid: pid,
        leader: guard.leader.map(|s| Stat {
            start: s.start - 1,
            ..s
        }),
    };
    drop(stale);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), leader.wait())
            .await
            .is_err(),
        "a later group of the id is left alone"
    );
    assert!(member.runs(), "its member too");
    drop(guard);
    let status = tokio::time::timeout(Duration::from_secs(10), leader.wait())
        .await
        .expect("killed in time")
        .expect("reaped");
    assert_eq!(status.signal(), Some(9), "its own group is killed");
    assert!(
        crate::support::until(Duration::from_secs(10), || !member.runs()).await,
        "and its member"
    );
}

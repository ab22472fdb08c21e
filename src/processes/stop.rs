//! The stop procedure: verify, SIGTERM, wait up to the grace period, SIGKILL
//! when forced, and wait until the whole group is gone. Every signal is
//! sent only after the recorded identity was verified through a pidfd.

use std::os::fd::OwnedFd;
use std::time::Duration;

use tokio::time::Instant;

use super::ops::Stopped;
use crate::host::Host;
use crate::host::signal::{self, Sig, Verified};
use crate::model::{Exit, Identity, ProcessRecord};

/// How long a tree may take to go after SIGKILL before it counts as not settled.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// Group membership has no exit event: after the leader's exit (which its
/// pidfd announces) it is checked at growing intervals up to this.
const POLL_MAX: Duration = Duration::from_millis(10);

pub struct StopParams {
    pub grace: Duration,
    pub force: bool,
    /// Why, for the log line of every signal.
    pub reason: String,
}

enum Sent {
    /// With the verified leader's pidfd, to await its exit.
    Signalled(Option<OwnedFd>),
    /// The leader and its group are gone: nothing to signal.
    Gone,
    /// The pid is another process now.
    Reused,
    Failed,
}

fn send(host: &dyn Host, ident: &Identity, pgid: Option<i32>, sig: Sig, reason: &str) -> Sent {
    let log = |target: &str, result: &std::io::Result<()>| match result {
        Ok(()) => tracing::info!(
            pid = ident.pid, pgid, start_time = %ident.start_time, signal = sig.name(), target, reason,
            "signal sent"
        ),
        Err(e) => tracing::warn!(
            pid = ident.pid, pgid, start_time = %ident.start_time, signal = sig.name(), target, reason,
            error = %e, "signal failed"
        ),
    };
    match signal::verify(host, ident) {
        Ok(Verified::Same(fd, now)) => {
            let result = match pgid {
                Some(g) if now == Some(g) => {
                    let result = signal::signal_group(g, sig);
                    log("group", &result);
                    result
                }
                // It left the group it led (`setpgid(2)`): the signal goes
                // to it through its pidfd, and to what is left of its old
                // group, never to the group it is in now, which is not
                // the record's.
                Some(g) => {
                    let result = signal::signal_process(&fd, sig);
                    log("process (it left its group)", &result);
                    if signal::group_alive(g) {
                        log("group (its leader left)", &signal::signal_group(g, sig));
                    }
                    result
                }
                None => {
                    let result = signal::signal_process(&fd, sig);
                    log("process", &result);
                    result
                }
            };
            if result.is_ok() {
                Sent::Signalled(Some(fd))
            } else {
                Sent::Failed
            }
        }
        // The leader is gone; its group may live on, and while it does its
        // number cannot have been given to anyone else.
        Ok(Verified::Absent) => match pgid.filter(|g| signal::group_alive(*g)) {
            Some(g) => {
                let result = signal::signal_group(g, sig);
                log("group (leader gone)", &result);
                if result.is_ok() {
                    Sent::Signalled(None)
                } else {
                    Sent::Failed
                }
            }
            None => Sent::Gone,
        },
        Ok(Verified::Foreign) => {
            tracing::warn!(
                pid = ident.pid,
                reason,
                "process recorded on another boot or host: nothing signalled"
            );
            Sent::Gone
        }
        Ok(Verified::Reused) => {
            tracing::warn!(pid = ident.pid, start_time = %ident.start_time, reason, "pid reused by another process: nothing signalled");
            Sent::Reused
        }
        Err(e) => {
            tracing::warn!(pid = ident.pid, error = %e, "cannot verify the process; nothing signalled");
            Sent::Failed
        }
    }
}

fn gone(host: &dyn Host, ident: &Identity, pgid: Option<i32>) -> bool {
    // Only a definite answer counts: a verify that fails (EMFILE, EPERM)
    // leaves the leader possibly alive.
    let leader_gone = matches!(
        signal::verify(host, ident),
        Ok(Verified::Absent | Verified::Reused | Verified::Foreign)
    );
    leader_gone && !pgid.is_some_and(signal::group_alive)
}

/// Our own child's exit, once the reaper has collected it.
pub type Reaped = tokio::sync::watch::Receiver<Option<Exit>>;

async fn settled_within(
    host: &dyn Host,
    ident: &Identity,
    pgid: Option<i32>,
    within: Duration,
    leader: Option<OwnedFd>,
    reaped: Option<&mut Reaped>,
) -> bool {
    let deadline = Instant::now() + within;
    if let Some(fd) = leader {
        let _ = tokio::time::timeout_at(deadline, crate::host::watch::exited(fd)).await;
    }
    // Our child stays a zombie, and its group alive, until the reaper has
    // collected it: wait for that instead of polling for it.
    if let Some(r) = reaped {
        let _ = tokio::time::timeout_at(deadline, r.wait_for(Option::is_some)).await;
    }
    let mut pause = Duration::from_millis(1);
    loop {
        if gone(host, ident, pgid) {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(POLL_MAX);
    }
}

/// SIGKILL the verified process `ident` and the group `pgid` it leads, at
/// once and without waiting: whether it was signalled.
pub fn kill_tree(host: &dyn Host, ident: &Identity, pgid: Option<i32>, reason: &str) -> bool {
    matches!(
        send(host, ident, pgid, Sig::Kill, reason),
        Sent::Signalled(_)
    )
}

/// Stop the process of `rec` and, when it leads one, its process group;
/// `reaped`, when it is our own child.
pub async fn stop_tree(
    host: &dyn Host,
    rec: &ProcessRecord,
    p: &StopParams,
    mut reaped: Option<Reaped>,
) -> Stopped {
    let Some(ident) = &rec.identity else {
        return Stopped::Settled(Exit::default());
    };
    let pgid = rec.pgid();
    let leader = match send(host, ident, pgid, Sig::Term, &p.reason) {
        Sent::Reused => return Stopped::Reused,
        Sent::Gone => return Stopped::Settled(Exit::default()),
        Sent::Signalled(fd) => fd,
        Sent::Failed => None,
    };
    if settled_within(host, ident, pgid, p.grace, leader, reaped.as_mut()).await {
        return Stopped::Settled(Exit::default());
    }
    if !p.force {
        return Stopped::NotSettled;
    }
    let leader = match send(host, ident, pgid, Sig::Kill, &p.reason) {
        Sent::Gone => return Stopped::Settled(Exit::default()),
        Sent::Reused => return Stopped::Reused,
        Sent::Signalled(fd) => fd,
        Sent::Failed => None,
    };
    if settled_within(host, ident, pgid, KILL_WAIT, leader, reaped.as_mut()).await {
        Stopped::Settled(Exit::default())
    } else {
        Stopped::NotSettled
    }
}

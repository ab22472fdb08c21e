//! COMMAND as a child of `run`: started behind the gate in a process group
//! of its own, sent the signals `run` receives, stopped when the lease is
//! lost, and its end turned into an exit code.

use std::ffi::OsString;
use std::future::Future;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process_group};
use tokio::signal::unix::{SignalKind, signal};

use super::gate::GO;
use crate::cli::error::CliError;

pub struct Gated {
    child: tokio::process::Child,
    pid: i32,
    /// Write end of the gate pipe, until COMMAND is cleared to start.
    go: Option<std::io::PipeWriter>,
}

/// How supervision ended.
pub enum Ended {
    /// COMMAND ended by itself: its exit code, or 128 + N for signal N.
    Exited(u8),
    /// The lease was lost (why); COMMAND has been stopped.
    Lost(String),
}

/// Signals `run` passes on to COMMAND (CLI.md, step 6).
const FORWARDED: [(SignalKind, Signal); 4] = [
    (SignalKind::interrupt(), Signal::INT),
    (SignalKind::terminate(), Signal::TERM),
    (SignalKind::hangup(), Signal::HUP),
    (SignalKind::quit(), Signal::QUIT),
];

impl Gated {
    /// Start the gate for `argv` with `env` added and the API token taken
    /// out of the environment. Until `supervise`, signals keep their default
    /// action: one that ends `run` closes the gate, and COMMAND never starts.
    pub fn spawn(argv: &[OsString], env: &[(String, String)]) -> Result<Self, CliError> {
        let local = |what: &str, e: std::io::Error| CliError::local(format!("{what}: {e}"));
        let (reader, writer) = std::io::pipe().map_err(|e| local("creating the gate pipe", e))?;
        // The one descriptor the gate inherits; no other child is started
        // meanwhile, so it leaks nowhere else.
        rustix::io::fcntl_setfd(&reader, rustix::io::FdFlags::empty())
            .map_err(|e| local("preparing the gate pipe", e.into()))?;
        let mut cmd = tokio::process::Command::new("/proc/self/exe");
        cmd.arg0("holdfast")
            .arg("__exec")
            .arg(reader.as_raw_fd().to_string())
            .arg("--")
            .args(argv)
            .env_remove("HOLDFAST_TOKEN")
            .env_remove("HOLDFAST_TOKEN_FILE")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .process_group(0);
        let child = cmd.spawn().map_err(|e| local("starting the command", e))?;
        drop(reader);
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| CliError::local("the command ended at once"))?;
        Ok(Self {
            child,
            pid,
            go: Some(writer),
        })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Clear COMMAND to start.
    pub fn go(&mut self) -> Result<(), CliError> {
        let mut w = self
            .go
            .take()
            .ok_or_else(|| CliError::local("the command was started already"))?;
        w.write_all(&[GO])
            .map_err(|e| CliError::local(format!("starting the command: {e}")))
    }

    /// Never start COMMAND: close the gate and reap it.
    pub async fn abandon(mut self) {
        self.go = None;
        signal_group(self.pid, Signal::KILL);
        let _ = self.child.wait().await;
    }

    /// Clear COMMAND to start, then wait for it to end, passing on the
    /// signals `run` receives from now on, or stop it when `lost` resolves
    /// (SIGTERM, then SIGKILL after `grace`).
    pub async fn supervise(
        mut self,
        lost: impl Future<Output = String>,
        grace: Duration,
    ) -> Result<Ended, CliError> {
        let mut streams = Vec::new();
        for (kind, sig) in FORWARDED {
            let stream =
                signal(kind).map_err(|e| CliError::local(format!("cannot handle signals: {e}")))?;
            streams.push((stream, sig));
        }
        self.go()?;
        tokio::pin!(lost);
        loop {
            let received = futures_util::future::select_all(
                streams
                    .iter_mut()
                    .map(|(s, sig)| Box::pin(async move { s.recv().await.map(|()| *sig) })),
            );
            tokio::select! {
                status = self.child.wait() => {
                    let status = status.map_err(|e| CliError::local(format!("waiting for the command: {e}")))?;
                    return Ok(Ended::Exited(exit_code(status)));
                }
                (Some(sig), _, _) = received => signal_group(self.pid, sig),
                why = &mut lost => {
                    self.stop(grace).await;
                    return Ok(Ended::Lost(why));
                }
            }
        }
    }

    async fn stop(&mut self, grace: Duration) {
        signal_group(self.pid, Signal::TERM);
        if tokio::time::timeout(grace, self.child.wait())
            .await
            .is_err()
        {
            signal_group(self.pid, Signal::KILL);
            let _ = self.child.wait().await;
        }
    }
}

/// COMMAND leads its group, whose id is its pid; a group already gone is fine.
fn signal_group(pgid: i32, sig: Signal) {
    if let Some(pgid) = Pid::from_raw(pgid) {
        let _ = kill_process_group(pgid, sig);
    }
}

/// The exit code `run` ends with for COMMAND's end.
pub fn exit_code(status: std::process::ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(255),
        (None, None) => 1,
    }
}

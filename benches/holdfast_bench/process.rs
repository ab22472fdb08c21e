//! A server process the bench started (holdfast or an anchor): its temp dir and
//! log, readiness, CPU time, and its end, on every path out of the bench.

use std::fs::File;
use std::future::Future;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process, kill_process_group};
use tokio::process::{Child, Command};

use crate::ctx;

/// A server started by the bench, with its output in `<dir>/<log>`. `stop` ends it
/// with `stop_signal` (SIGTERM lets supervisord stop its programs first), SIGKILL if
/// it is still there after 10 s, then kills what it had spawned and left behind
/// (holdfast's managed processes live in process groups of their own and outlive
/// it). Dropped without `stop`, it and those get SIGKILL. The temp dir goes after it.
pub struct Started {
    name: String,
    stop_signal: Signal,
    child: Child,
    pid: Option<u32>,
    log: PathBuf,
    /// Removed after the process is gone (fields drop in order, after `drop`);
    /// None once `stop_keeping_dir` has handed it back.
    dir: Option<tempfile::TempDir>,
}

impl Started {
    /// Runs `cmd` with stdin closed and stdout+stderr to `dir/<log>`.
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        dir: tempfile::TempDir,
        log: &str,
        stop_signal: Signal,
    ) -> Result<Started, String> {
        let log = dir.path().join(log);
        let stdout = ctx(
            File::create(&log),
            format!("cannot create {}", log.display()),
        )?;
        let stderr = ctx(
            stdout.try_clone(),
            format!("cannot create {}", log.display()),
        )?;
        cmd.stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .kill_on_drop(true);
        let child = ctx(cmd.spawn(), format!("cannot start {name}"))?;
        Ok(Started {
            name: name.into(),
            stop_signal,
            pid: child.id(),
            child,
            log,
            dir: Some(dir),
        })
    }

    /// What follows `marker` on the first line of the log that has it, up to
    /// the next space, once the process has written it; fails after 20 s or
    /// at once if the process exits.
    pub async fn logged(&mut self, marker: &str) -> Result<String, String> {
        let give_up = Instant::now() + Duration::from_secs(20);
        loop {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let found = log.lines().find_map(|l| l.split_once(marker));
            if let Some((_, rest)) = found {
                return Ok(rest.split_whitespace().next().unwrap_or("").to_owned());
            }
            self.check_running()?;
            if Instant::now() > give_up {
                return Err(format!("{} did not log {marker:?} within 20 s", self.name));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// An error with the log when the process has exited.
    fn check_running(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                Err(format!(
                    "{} exited at startup ({status}):\n{log}",
                    self.name
                ))
            }
            Err(e) => Err(format!("cannot wait for {}: {e}", self.name)),
        }
    }

    /// Its CPU time so far (user + system), in seconds; None when unreadable.
    pub fn cpu_seconds(&self) -> Option<f64> {
        let fields = stat_fields(i32::try_from(self.pid?).ok()?)?;
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        Some((utime + stime) as f64 / clock_ticks())
    }

    /// Its temp dir (a holdfast's data dir).
    pub fn dir(&self) -> Option<&std::path::Path> {
        self.dir.as_ref().map(|d| d.path())
    }

    /// Its resident set now and at its peak (VmRSS, VmHWM from /proc/<pid>/status),
    /// in MiB; None when unreadable (it has exited).
    pub fn rss_mib(&self) -> Option<(f64, f64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid?)).ok()?;
        let kib = |key: &str| -> Option<f64> {
            let line = status.lines().find(|l| l.starts_with(key))?;
            line[key.len()..]
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()
        };
        Some((kib("VmRSS:")? / 1024.0, kib("VmHWM:")? / 1024.0))
    }

    /// Ends it: `stop_signal`, SIGKILL if it is still there after 10 s, then what it
    /// spawned and left behind.
    pub async fn stop(mut self) {
        let signal = self.stop_signal;
        self.end(signal).await;
    }

    /// Ends it with `signal` (as `stop` does) and hands back its dir, kept on disk
    /// (to start a server again on the same data).
    pub async fn stop_keeping_dir(mut self, signal: Signal) -> Option<tempfile::TempDir> {
        self.end(signal).await;
        self.dir.take()
    }

    async fn end(&mut self, signal: Signal) {
        let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) else {
            return; // already reaped
        };
        let left = children_of(pid);
        if let Some(p) = Pid::from_raw(pid) {
            let _ = kill_process(p, signal);
        }
        let waited = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
        if waited.is_err() {
            eprintln!(
                "holdfast-bench: {} did not stop in 10 s: killing it",
                self.name
            );
            let _ = self.child.kill().await;
        }
        kill_all(&left);
    }
}

/// Where `stop` was not awaited (a panic): SIGKILL to what it spawned and to itself,
/// without waiting (as kill_on_drop would).
impl Drop for Started {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            kill_all(&children_of(pid));
            let _ = self.child.start_kill();
        }
    }
}

/// SIGKILL to each of `pids`: to its process group when it leads one.
fn kill_all(pids: &[i32]) {
    for &pid in pids {
        let Some(p) = Pid::from_raw(pid) else {
            continue;
        };
        let _ = match process_group(pid) {
            Some(group) if group == pid => kill_process_group(p, Signal::KILL),
            Some(_) => kill_process(p, Signal::KILL),
            None => continue, // gone already
        };
    }
}

/// Polls `probe` until it succeeds; fails after 20 s, or at once if `server` (the
/// process behind it, when the bench started it) exits.
pub async fn wait_ready<F, Fut>(
    what: &str,
    mut server: Option<&mut Started>,
    mut probe: F,
) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = server.as_mut() {
            s.check_running()?;
        }
        match probe().await {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() > give_up => {
                return Err(format!("{what} was not ready within 20 s: {e}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// `n` distinct free loopback ports (all bound at once, then released for the server).
pub fn free_ports(n: usize) -> Result<Vec<u16>, String> {
    let listeners = (0..n)
        .map(|_| ctx(TcpListener::bind("127.0.0.1:0"), "no free port"))
        .collect::<Result<Vec<_>, _>>()?;
    listeners
        .iter()
        .map(|l| Ok(ctx(l.local_addr(), "no free port")?.port()))
        .collect()
}

/// `name` in a directory of `PATH`, or an error that says how to install the anchors.
pub fn find_anchor(name: &str, package: &str) -> Result<PathBuf, String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "{name} not found on PATH: run scripts/bench-anchors \
                 (installs Debian's {package}), then the bench again"
            )
        })
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 when that fails).
fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|&t| t > 0.0)
            .unwrap_or(100.0)
    })
}

/// The fields of /proc/<pid>/stat after "(comm)": [0] is field 3 (state), [1] the
/// parent, [2] the process group, [11] and [12] utime and stime in clock ticks.
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

fn process_group(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(2)?.parse().ok()
}

/// The pids whose parent is `parent`.
fn children_of(parent: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            let ppid = stat_fields(pid).and_then(|f| f.get(1)?.parse::<i32>().ok());
            ppid == Some(parent)
        })
        .collect()
}

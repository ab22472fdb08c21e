//! Starting child processes and reaping them. holdfast reaps every child
//! itself (`wait(-1)` on SIGCHLD): as a child subreaper it also inherits
//! the orphaned descendants of its children, which must not stay zombies.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};

use rustix::process::{WaitOptions, wait};
use tokio::sync::oneshot;

use crate::model::Exit;

/// What to start.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    pub argv: Vec<String>,
    pub cwd: Option<PathBuf>,
    /// Added to the server's environment, after its `HOLDFAST_*` variables are removed.
    pub env: BTreeMap<String, String>,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    /// Run as this uid and gid (supplementary groups dropped), with
    /// no_new_privs: for a non-root caller on the Unix socket.
    pub run_as: Option<(u32, u32)>,
}

/// Find the program `argv0` as `execvp` would and check that the kernel can
/// run it (an executable file that is ELF or a script whose interpreter
/// exists), so that a hopeless spawn is refused before anything is recorded.
pub fn check_program(argv0: &str, cwd: Option<&Path>) -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = if argv0.contains('/') {
        let p = PathBuf::from(argv0);
        vec![match cwd {
            Some(dir) if p.is_relative() => dir.join(p),
            _ => p,
        }]
    } else {
        let path =
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
        std::env::split_paths(&path)
            .map(|d| d.join(argv0))
            .collect()
    };
    let found = candidates.into_iter().find(|c| {
        std::fs::metadata(c).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    });
    let Some(program) = found else {
        let where_ = if argv0.contains('/') { "" } else { " on PATH" };
        return Err(format!("{argv0:?} is not an executable file{where_}"));
    };
    runnable(&program)?;
    Ok(program)
}

fn runnable(program: &Path) -> Result<(), String> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let n = File::open(program)
        .and_then(|mut f| f.read(&mut head))
        .map_err(|e| format!("cannot read {}: {e}", program.display()))?;
    let head = &head[..n];
    if head.starts_with(b"\x7fELF") {
        return Ok(());
    }
    if let Some(line) = head.strip_prefix(b"#!") {
        let line = line.split(|b| *b == b'\n').next().unwrap_or_default();
        let text = String::from_utf8_lossy(line);
        let interpreter = text.split_whitespace().next().unwrap_or_default();
        let ok = std::fs::metadata(interpreter)
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
        return if ok {
            Ok(())
        } else {
            Err(format!(
                "the interpreter {interpreter:?} of {} cannot be run",
                program.display()
            ))
        };
    }
    Err(format!(
        "{} is neither an ELF binary nor a script with #!",
        program.display()
    ))
}

/// A log file, new and empty, for the server's user alone (the API serves
/// it to callers that pass its token).
fn log_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

/// The child may never gain privileges (setuid binaries, file capabilities).
#[allow(unsafe_code)]
fn set_no_new_privs(cmd: &mut std::process::Command) {
    // SAFETY: the closure runs in the child between fork and exec, and only
    // makes one prctl system call, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| rustix::thread::set_no_new_privs(true).map_err(std::io::Error::from));
    }
}

/// Children holdfast started and waits for; exits of others (inherited
/// orphans) are reaped and dropped.
#[derive(Default)]
pub struct Reaper {
    waiting: Mutex<HashMap<i32, oneshot::Sender<Exit>>>,
}

impl Reaper {
    /// Become a child subreaper and start reaping on SIGCHLD.
    pub fn start() -> std::io::Result<Arc<Self>> {
        let pid = rustix::process::getpid();
        if let Err(e) = rustix::process::set_child_subreaper(Some(pid)) {
            tracing::warn!(error = %e, "cannot become a child subreaper: orphaned grandchildren will not be reaped by holdfast");
        }
        let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?;
        let me = Arc::new(Self::default());
        let reaper = me.clone();
        tokio::spawn(async move {
            loop {
                reaper.reap();
                if sigchld.recv().await.is_none() {
                    return;
                }
            }
        });
        Ok(me)
    }

    fn reap(&self) {
        // Held across waitpid, so that `spawn` can read a new child's
        // identity before its zombie can be reaped.
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match wait(WaitOptions::NOHANG) {
                Ok(Some((pid, status))) => {
                    let pid = pid.as_raw_nonzero().get();
                    let exit = Exit {
                        code: status.exit_status(),
                        signal: status.terminating_signal(),
                    };
                    if let Some(tx) = waiting.remove(&pid) {
                        let _ = tx.send(exit);
                    }
                }
                // No child has exited (Ok(None)) or there are none (ECHILD).
                Ok(None) | Err(_) => return,
            }
        }
    }

    /// Start `spec` in a new process group with output to its log files, and
    /// read its identity with `observe` while it cannot yet be reaped (the
    /// lock is held from the spawn on). Returns the identity and a receiver
    /// for the child's exit.
    pub fn spawn<T>(
        &self,
        spec: &SpawnSpec,
        observe: impl FnOnce(i32) -> T,
    ) -> std::io::Result<(T, oneshot::Receiver<Exit>)> {
        let (program, args) = spec
            .argv
            .split_first()
            .ok_or_else(|| std::io::Error::other("empty argv"))?;
        let stdout = log_file(&spec.stdout)?;
        let stderr = log_file(&spec.stderr)?;
        let mut cmd = std::process::Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("HOLDFAST_") {
                cmd.env_remove(key);
            }
        }
        cmd.envs(&spec.env);
        if let Some(dir) = &spec.cwd {
            cmd.current_dir(dir);
        }
        if let Some((uid, gid)) = spec.run_as {
            cmd.uid(uid).gid(gid);
            set_no_new_privs(&mut cmd);
        }
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        // The Child handle is dropped without waiting: the reaper collects it.
        let child = cmd.spawn()?;
        let pid =
            i32::try_from(child.id()).map_err(|_| std::io::Error::other("pid out of range"))?;
        let (tx, rx) = oneshot::channel();
        waiting.insert(pid, tx);
        Ok((observe(pid), rx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn script(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        p
    }

    #[test]
    fn programs_the_kernel_can_run_are_accepted() {
        assert!(check_program("sh", None).is_ok(), "found on PATH");
        assert!(check_program("/bin/sh", None).is_ok());
        let dir = tempfile::tempdir().expect("tempdir");
        script(dir.path(), "ok.sh", "#!/bin/sh\necho hi\n", 0o755);
        assert!(
            check_program("./ok.sh", Some(dir.path())).is_ok(),
            "relative to cwd"
        );
    }

    #[test]
    fn programs_that_cannot_run_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = script(dir.path(), "plain", "just text\n", 0o755);
        let no_x = script(dir.path(), "nox.sh", "#!/bin/sh\n", 0o644);
        let bad_interp = script(dir.path(), "bad.sh", "#!/no/such/shell\n", 0o755);
        for p in [plain, no_x, bad_interp] {
            assert!(
                check_program(&p.display().to_string(), None).is_err(),
                "{}",
                p.display()
            );
        }
        assert!(check_program("no-such-program-anywhere", None).is_err());
        assert!(check_program("/etc", None).is_err(), "a directory");
    }
}

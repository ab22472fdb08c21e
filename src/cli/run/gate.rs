//! The gate COMMAND starts behind. `holdfast run` spawns this binary
//! (`holdfast __exec FD -- COMMAND...`) in a new process group, registers
//! and confirms its pid with the server, and only then writes one byte to
//! the pipe FD: the gate then execs COMMAND in place, same pid and group.
//! If `run` dies or gives up first, the pipe closes and the gate exits
//! without running anything: COMMAND never runs unguarded, not even for
//! the moment between a spawn and its confirmation.

use std::ffi::OsString;
use std::fs::File;
use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::ExitCode;

use crate::cli::error::say;
use clap::Args;

/// The byte that clears COMMAND to start.
pub const GO: u8 = b'g';

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// The read end of the pipe `holdfast run` opened for this process
    fd: RawFd,
    #[arg(last = true, required = true)]
    argv: Vec<OsString>,
}

pub fn exec(a: ExecArgs) -> ExitCode {
    let mut gate = match inherited_pipe(a.fd) {
        Ok(f) => f,
        Err(e) => {
            say!("holdfast: local: the gate pipe {}: {e}", a.fd);
            return ExitCode::FAILURE;
        }
    };
    let mut byte = [0u8; 1];
    if !matches!(gate.read(&mut byte), Ok(1) if byte[0] == GO) {
        // `holdfast run` ended or gave up: COMMAND must not start.
        return ExitCode::FAILURE;
    }
    drop(gate);
    let program = &a.argv[0];
    let err = std::process::Command::new(program)
        .args(&a.argv[1..])
        .exec();
    say!(
        "holdfast: local: cannot run {}: {err}",
        program.to_string_lossy()
    );
    // As shells and env(1) say it: 127 not found, 126 found but not runnable.
    ExitCode::from(if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    })
}

/// The pipe `holdfast run` left open for this process, closed on exec so
/// COMMAND does not inherit it.
#[allow(unsafe_code)]
fn inherited_pipe(fd: RawFd) -> std::io::Result<File> {
    let target = std::fs::read_link(format!("/proc/self/fd/{fd}"))?;
    if !target.to_string_lossy().starts_with("pipe:") || fd <= 2 {
        return Err(std::io::Error::other("not an inherited pipe"));
    }
    // SAFETY: the descriptor is open (checked just above) and is a pipe
    // that `holdfast run` opened for this process alone; nothing else in
    // this process owns it, so it is taken over exactly once, here.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC)?;
    Ok(File::from(owned))
}

//! The terminal's foreground while COMMAND runs. COMMAND leads its own
//! process group (so the server can stop its whole tree), which on a
//! terminal makes it a background job: reading the terminal would stop it
//! (SIGTTIN) and Ctrl-C would reach `run` instead. So when `run` itself is
//! the terminal's foreground job, it hands the foreground to COMMAND's group
//! before COMMAND starts and takes it back when COMMAND has ended, as a
//! shell does for a job. Another member of a pipeline `run` is part of
//! then loses the terminal while COMMAND holds it.

use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
use rustix::process::Pid;
use rustix::termios::{tcgetpgrp, tcsetpgrp};

/// Held while COMMAND's group has the terminal; dropping it gives it back.
pub struct Foreground {
    ours: Pid,
}

impl Foreground {
    /// Give the terminal on stdin to `pgid`, if `run`'s group has it now.
    pub fn hand_to(pgid: i32) -> Option<Self> {
        let stdin = std::io::stdin();
        if !std::io::IsTerminal::is_terminal(&stdin) {
            return None;
        }
        // Not getpgrp(2): outside our PID namespace it reads 0, no valid Pid.
        let ours = Pid::from_raw(holdfast::host::signal::OwnIds::read().pgid)?;
        let theirs = Pid::from_raw(pgid)?;
        if tcgetpgrp(&stdin).ok()? != ours {
            return None;
        }
        tcsetpgrp(&stdin, theirs).ok()?;
        Some(Self { ours })
    }
}

impl Drop for Foreground {
    fn drop(&mut self) {
        // `run` is a background job by now, and a background job that sets
        // the foreground is sent SIGTTOU unless the calling thread blocks
        // it: do it on a thread of its own so no other thread's mask changes.
        let ours = self.ours;
        let _ = std::thread::spawn(move || {
            let mut ttou = SigSet::empty();
            ttou.add(Signal::SIGTTOU);
            if pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&ttou), None).is_ok() {
                let _ = tcsetpgrp(std::io::stdin(), ours);
            }
        })
        .join();
    }
}

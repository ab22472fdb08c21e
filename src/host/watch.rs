//! Waiting for a process that is not our child to exit: its pidfd becomes
//! readable when it does.

use std::os::fd::OwnedFd;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Resolves when the process of `fd` (a pidfd of a verified process) exits.
#[allow(unsafe_code)]
pub async fn exited(fd: OwnedFd) {
    // SAFETY: the AsyncFd takes ownership of the OwnedFd, so the descriptor
    // stays open, and is not reused, for as long as it is registered.
    let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
    match registered {
        Ok(afd) => {
            let _ = afd.readable().await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch a pidfd; the process will be checked by the reconciler");
            std::future::pending::<()>().await;
        }
    }
}

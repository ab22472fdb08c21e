//! What a follower (`events --follow`, `logs --follow`) does when the server
//! goes away. It streams "until interrupted" (CLI.md), so once it has
//! reached the server, a restart or an outage of any length is waited out,
//! not turned into exit 69. A server it never reached (a wrong `--url`, a
//! server not started) is exit 69 at once, as for any command, as `tail -f`
//! fails on a file that is not there. It ends as soon as nobody reads its
//! output.

use std::future::Future;
use std::time::Duration;

use super::error::say;
use super::error::{CliError, EXIT_UNREACHABLE};
use super::table::reader_gone;

/// The longest wait between two tries.
const MAX_PAUSE: Duration = Duration::from_secs(5);

pub struct Reconnect {
    failures: u32,
    /// The follower has reached the server before.
    reached: bool,
}

impl Reconnect {
    /// `reached`: whether the follower has had an answer from the server.
    pub fn new(reached: bool) -> Self {
        Self {
            failures: 0,
            reached,
        }
    }

    /// After a failed call: Ok once it is time to try again, when the
    /// server, reached before, could not be reached now (or stayed
    /// `busy`); any other error ends the follower. Says so on stderr once
    /// per outage.
    pub async fn after(&mut self, e: CliError) -> Result<(), CliError> {
        if e.exit != EXIT_UNREACHABLE || !self.reached {
            return Err(e);
        }
        if self.failures == 0 {
            say!(
                "holdfast: {}: {}; trying again until interrupted",
                e.code,
                e.detail
            );
        }
        self.failures += 1;
        let pause = Duration::from_millis(250).saturating_mul(self.failures);
        tokio::time::sleep(pause.min(MAX_PAUSE)).await;
        Ok(())
    }

    /// A call went through: the outage, if any, is over.
    pub fn connected(&mut self) {
        if self.failures > 0 {
            say!("holdfast: connected again");
        }
        self.failures = 0;
        self.reached = true;
    }
}

/// `follower`, ended early (exit 1, no message) once stdout's reader is gone.
pub async fn until_reader_gone(
    follower: impl Future<Output = Result<(), CliError>>,
) -> Result<(), CliError> {
    tokio::select! {
        done = follower => done,
        gone = reader_gone() => Err(gone),
    }
}

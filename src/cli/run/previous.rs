//! Before COMMAND starts: the previous holder's managed processes must be
//! gone. A takeover ends the old lease at once (its owner died), but the
//! server stops that lease's processes a reconciler pass later; starting
//! COMMAND in between would run two of them side by side.

use std::time::Duration;

use holdfast::api::leases::ListQuery as LeaseQuery;
use holdfast::api::processes::ListQuery as ProcessQuery;
use holdfast::model::{LeaseView, ProcessView, StateFilter};

use crate::cli::error::CliError;
use crate::cli::error::say;
use crate::cli::http::Client;
use crate::cli::list;

/// The server stops an orphan with SIGTERM, a 5 s grace and SIGKILL, one
/// reconciler pass after its lease ended: well within this.
const PATIENCE: Duration = Duration::from_secs(30);
const LOOK_EVERY: Duration = Duration::from_millis(100);

/// Wait until no process of the lease that `held` followed is current.
/// Still running after `PATIENCE`: the conflict code, COMMAND not started.
pub async fn wait_until_stopped(
    client: &Client,
    held: &LeaseView,
    conflict: u8,
) -> Result<(), CliError> {
    let query = LeaseQuery {
        resource: Some(held.resource.clone()),
        prefix: None,
        holder: None,
        parent: None,
        state: Some(StateFilter::Ended),
        limit: Some(1),
        cursor: None,
    };
    let ended = list::fetch::<LeaseView>(client, "/v1/leases", &query, false).await?;
    let Some(previous) = ended.items.into_iter().next() else {
        return Ok(());
    };
    let query = ProcessQuery {
        state: Some(StateFilter::Current),
        kind: None,
        operation_id: None,
        lease: Some(previous.id.clone()),
        limit: Some(1),
        cursor: None,
    };
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut said = false;
    loop {
        let running = list::fetch::<ProcessView>(client, "/v1/processes", &query, false).await?;
        let Some(p) = running.items.first() else {
            return Ok(());
        };
        let what = format!(
            "process {} (pid {}) of the previous lease {} on {}",
            p.id,
            p.pid.map_or_else(|| "-".into(), |pid| pid.to_string()),
            previous.id,
            previous.resource
        );
        if tokio::time::Instant::now() >= deadline {
            let detail = format!(
                "{what} is still {}; the command was not started",
                p.state.as_str()
            );
            return Err(CliError::new("previous_running", detail, conflict));
        }
        if !said {
            said = true;
            say!("holdfast: waiting for the server to stop {what}");
        }
        tokio::time::sleep(LOOK_EVERY).await;
    }
}

//! The background loop that applies the rules on its own: leases whose
//! owner died or whose TTL passed end within about one interval even when
//! nobody tries to acquire them, and processes whose owner went away are
//! claimed and stopped.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::Retention;
use crate::leases::Leases;
use crate::leases::rules::{Verdict, verdict};
use crate::processes::Processes;
use crate::store::{Store, StoreError};
use crate::time::now_ms;
use crate::waiters::Hub;

/// What the reconciler works on.
pub struct Parts {
    pub store: Store,
    pub leases: Leases,
    pub processes: Arc<Processes>,
    pub hub: Arc<Hub>,
    pub metrics: Arc<crate::metrics::Metrics>,
    pub retention: Retention,
    /// How long ended records are kept; None: for ever.
    pub record_retention: Option<Duration>,
}

/// Ended records deleted per table and pass: a pass holds the writer briefly
/// however much has piled up, and the next ones take the rest.
const PRUNE_BATCH: u32 = 5000;

/// Remove events past the retention, and tell readers where the log now
/// starts; idempotency keys past their 24 hours; ended records past theirs.
async fn prune(parts: &Parts) -> Result<(), StoreError> {
    let (keep, age) = match parts.retention {
        Retention::Count(n) => (Some(n), None),
        Retention::Age(d) => (
            None,
            Some(now_ms() - i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        ),
    };
    // Not durable: after a crash the same rows are simply pruned again.
    let stale = now_ms() - crate::idempotency::KEEP_MS;
    let ended_before = parts
        .record_retention
        .map(|d| now_ms() - i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    let host_id = parts.processes.host_id();
    let (through, logs) = parts
        .store
        .write(false, move |tx| {
            Box::pin(async move {
                tx.prune_keys(stale).await?;
                let logs = match ended_before {
                    Some(at) => tx.prune_records(at, &host_id, PRUNE_BATCH).await?,
                    None => Vec::new(),
                };
                // Their log files go once this commits: it must not come back.
                if !logs.is_empty() {
                    tx.require_durable();
                }
                Ok((tx.prune_events(keep, age).await?, logs))
            })
        })
        .await?;
    parts.processes.remove_logs(&logs);
    parts
        .hub
        .pruned_through
        .fetch_max(through, std::sync::atomic::Ordering::SeqCst);
    Ok(())
}

/// One pass over leases: judge every lease that could need ending, outside
/// any transaction, then end each one in its own transaction (which judges
/// it again, so a lease renewed in between is left alone).
pub async fn leases_pass(store: &Store, leases: &Leases) -> Result<usize, StoreError> {
    let now = now_ms();
    let mut ended = 0;
    for rec in store.backend().leases_to_reconcile(now).await? {
        let owner = rec.owner.as_ref().map(|o| leases.host().judge(o));
        if matches!(verdict(&rec, owner, now), Verdict::End { .. })
            && leases.reconcile(rec.id).await?.is_some()
        {
            ended += 1;
        }
    }
    Ok(ended)
}

/// A pass that failed: in an outage, one more sign of it (the outage has a
/// line of its own), otherwise a line of its own.
fn failed(e: &StoreError, what: &str) {
    match e {
        StoreError::Unavailable(d) | StoreError::OutcomeUnknown(d) => {
            crate::store::outage::OUTAGE.failed(d);
        }
        e => tracing::warn!(error = %e, "{what}"),
    }
}

/// Run a pass now, then every `interval` and whenever a lease ends (its
/// processes are to be claimed at once), until `shutdown` turns true.
pub async fn run(parts: Parts, interval: Duration, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Pruning is a write (on PostgreSQL, under the fleet's write lock):
        // on the timer only, not after every lease end.
        let timer = tokio::select! {
            _ = tick.tick() => true,
            () = parts.hub.reconcile_soon.notified() => false,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        // A lease's end concerns only the processes it owned: leases are
        // gone over on the timer, processes then only if this host may have
        // any (a pass reads them all, and churn ends leases by the thousand).
        if timer {
            match leases_pass(&parts.store, &parts.leases).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(ended = n, "reconciler ended leases"),
                Err(e) => failed(&e, "reconciler pass over leases failed"),
            }
            if let Err(e) = prune(&parts).await {
                failed(&e, "pruning events failed");
            }
        } else if !parts.processes.may_have_current() {
            continue;
        }
        match parts.processes.reconcile().await {
            Ok(pass) => {
                if pass.claimed > 0 {
                    tracing::info!(
                        claimed = pass.claimed,
                        "reconciler claimed orphaned processes"
                    );
                }
                parts.metrics.owner_unverifiable.set(pass.unverified as i64);
            }
            Err(e) => failed(&e, "reconciler pass over processes failed"),
        }
        parts.metrics.reconciler_passes.inc();
    }
}

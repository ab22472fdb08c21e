//! The background loop that applies the takeover table on its own: leases
//! whose owner died or whose TTL passed end within about one interval even
//! when nobody tries to acquire them.

use std::time::Duration;

use tokio::sync::watch;

use crate::leases::Leases;
use crate::leases::rules::{Verdict, verdict};
use crate::store::{Store, StoreError};
use crate::time::now_ms;

/// One pass: judge every lease that could need ending, outside any
/// transaction, then end each one in its own transaction (which judges it
/// again, so a lease renewed in between is left alone).
pub async fn pass(store: &Store, leases: &Leases) -> Result<usize, StoreError> {
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

/// Run `pass` now and then every `interval` until `shutdown` fires.
/// `shutdown` turns true when the server stops.
pub async fn run(
    store: Store,
    leases: Leases,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        match pass(&store, &leases).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(ended = n, "reconciler ended leases"),
            Err(e) => tracing::warn!(error = %e, "reconciler pass failed"),
        }
    }
}

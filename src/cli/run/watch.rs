//! Whether `run` still holds its lease: renewals every third of the TTL
//! (a `fenced` answer means it is gone), and a long poll on the event log
//! for the lease's end (broken, expired, reclaimed, released by another
//! caller with its token), so a loss is seen at once, without polling.

use std::time::Duration;

use holdfast::api::error::CurrentRecord;
use holdfast::api::leases::RenewRequest;
use holdfast::model::LeaseView;

use crate::cli::error::CliError;
use crate::cli::error::say;
use crate::cli::events::{self, newest_seq};
use crate::cli::http::Client;

const END_EVENTS: [&str; 4] = [
    "lease.released",
    "lease.expired",
    "lease.reclaimed",
    "lease.broken",
];
const LONG_POLL: Duration = Duration::from_secs(30);
/// Pause after a failed request before trying again.
const BACKOFF: Duration = Duration::from_secs(1);

/// Resolves with why the lease was lost; never while it is held.
pub async fn lost(client: Client, lease: LeaseView, ttl: Option<Duration>) -> String {
    let renewals = async {
        match ttl {
            Some(ttl) => renew_until_fenced(&client, &lease, ttl).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        why = renewals => why,
        why = watch_events(&client, &lease) => why,
    }
}

async fn renew_until_fenced(client: &Client, lease: &LeaseView, ttl: Duration) -> String {
    let path = format!("/v1/leases/{}/renew", lease.id);
    let body = RenewRequest {
        token: lease.token,
        ttl_ms: Some(crate::cli::duration::ms(ttl)),
    };
    let mut warned = false;
    loop {
        tokio::time::sleep(ttl / 3).await;
        match client.post(&path, &body).await {
            Ok(_) => warned = false,
            Err(e) if e.is("fenced") || e.is("parent_fenced") => {
                return current(&e).map_or_else(
                    || {
                        format!(
                            "renewing lease {} answered {}: {}",
                            lease.id, e.code, e.detail
                        )
                    },
                    ended,
                );
            }
            // The server is away or busy: the lease is bound to `run`, which
            // is alive, so it is not lost; keep renewing. Say so once.
            Err(e) if !warned => {
                warned = true;
                say!(
                    "holdfast: {}: renewing the lease: {} (still trying)",
                    e.code,
                    e.detail
                );
            }
            Err(_) => {}
        }
    }
}

async fn watch_events(client: &Client, lease: &LeaseView) -> String {
    let mut after = loop {
        match newest_seq(client).await {
            Ok(seq) => break seq,
            Err(_) => tokio::time::sleep(BACKOFF).await,
        }
    };
    // An end before `after` is not in what follows it: look at the lease once.
    let mut check = true;
    loop {
        if check {
            if let Some(why) = ended_now(client, lease).await {
                return why;
            }
            check = false;
        }
        match events::poll(client, after, LONG_POLL).await {
            Ok(items) => {
                for e in items {
                    after = e["seq"].as_i64().unwrap_or(after);
                    let ours = e["lease"]["id"].as_str() == Some(lease.id.as_str());
                    let kind = e["type"].as_str().unwrap_or_default().to_owned();
                    if ours && END_EVENTS.contains(&kind.as_str()) {
                        if let Ok(ev) = events::parse(e)
                            && let Some(l) = ev.lease
                        {
                            return ended(&l);
                        }
                        return format!("lease {} ended ({kind})", lease.id);
                    }
                }
            }
            Err(e) => {
                // Pruned past `after`, or the server was away: what was
                // missed is not known, so look at the lease again.
                if let Some(oldest) = e.problem.as_ref().and_then(|p| p.oldest_seq) {
                    after = oldest - 1;
                } else {
                    tokio::time::sleep(BACKOFF).await;
                }
                check = true;
            }
        }
    }
}

/// Why the lease has ended, if it has.
async fn ended_now(client: &Client, lease: &LeaseView) -> Option<String> {
    let now: LeaseView = client
        .get(&format!("/v1/leases/{}", lease.id))
        .await
        .and_then(|a| a.json())
        .ok()?;
    (!now.state.is_current() || now.token != lease.token).then(|| ended(&now))
}

fn ended(l: &LeaseView) -> String {
    let reason = l.end_reason.as_deref().unwrap_or(l.state.as_str());
    format!(
        "the lease on {} (lease {}, token {}) ended: {reason}",
        l.resource, l.id, l.token
    )
}

/// Whether an error from releasing says the lease had already ended.
pub fn lost_on_release(e: &CliError) -> Option<String> {
    if !e.is("fenced") {
        return None;
    }
    Some(current(e).map_or_else(|| e.detail.clone(), ended))
}

/// The lease as a `fenced` answer shows it now.
fn current(e: &CliError) -> Option<&LeaseView> {
    match e.problem.as_ref()?.current.as_ref()? {
        CurrentRecord::Lease(l) => Some(l),
        _ => None,
    }
}

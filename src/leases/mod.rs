//! Leases: the takeover rules (`rules`), the transaction scripts that apply
//! them (`ops`), and `Leases`, which runs those scripts against the store and
//! makes acquirers wait their turn.

mod handoff;
pub mod ops;
#[cfg(test)]
mod ops_tests;
pub mod rules;

use crate::tx::in_tx;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use utoipa::ToSchema;

use crate::host::Host;
use crate::metrics::Metrics;
use crate::model::{Identity, LeaseFilter, LeaseRecord, LeaseView, Liveness};
use crate::store::{Store, StoreError};
use crate::time::now_ms;
use crate::waiters::{Ticket, Waiters, remote};

/// What an acquirer asks for, validated.
#[derive(Debug, Clone)]
pub struct Acquire {
    pub resource: String,
    pub holder: String,
    pub ttl_ms: Option<i64>,
    pub owner: Option<Identity>,
    /// Parent lease id and the token the caller holds for it.
    pub parent: Option<(String, i64)>,
    pub reserve: bool,
    pub metadata: serde_json::Map<String, serde_json::Value>,
}

/// The lease an acquire ended to take over.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Reclaimed {
    pub id: String,
    pub token: i64,
    /// The old lease's `end_reason`.
    pub reason: String,
}

#[derive(Debug, Clone)]
pub struct Acquired {
    pub lease: LeaseView,
    pub reclaimed: Option<Reclaimed>,
}

/// What a release that may hand the lease over returns from its
/// transaction: the release's own outcome, and the waiter's lease.
pub struct Released {
    pub out: Outcome<LeaseView>,
    handed: Option<handoff::Handed>,
}

/// A refusal the contract names; the store's state is still committed.
#[derive(Debug, Clone)]
pub enum LeaseError {
    NotFound,
    Held(Box<LeaseView>),
    OwnerRemote(Box<LeaseView>),
    OwnerUnverifiable(Box<LeaseView>),
    ParentFenced(Option<Box<LeaseView>>),
    Fenced(Box<LeaseView>),
    NotReserved(Box<LeaseView>),
}

impl LeaseError {
    /// The contract's code for this refusal.
    pub fn code(&self) -> crate::model::Code {
        use crate::model::Code;
        match self {
            Self::NotFound => Code::NotFound,
            Self::Held(_) => Code::LeaseHeld,
            Self::OwnerRemote(_) => Code::OwnerRemote,
            Self::OwnerUnverifiable(_) => Code::OwnerUnverifiable,
            Self::ParentFenced(_) => Code::ParentFenced,
            Self::Fenced(_) => Code::Fenced,
            Self::NotReserved(_) => Code::NotReserved,
        }
    }
}

pub type Outcome<T> = Result<T, LeaseError>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("lease refused: {0:?}")]
    Lease(LeaseError),
    /// A wait cut short by the server's shutdown.
    #[error("the server is shutting down")]
    ShuttingDown,
}

impl From<LeaseError> for Error {
    fn from(e: LeaseError) -> Self {
        Self::Lease(e)
    }
}

/// Runs lease mutations: each one job in one write transaction.
#[derive(Clone)]
pub struct Leases {
    store: Store,
    host: Arc<dyn Host>,
    waiters: Arc<Waiters>,
    waiting: Arc<tokio::sync::Semaphore>,
    offers: Arc<handoff::Offers>,
    metrics: Arc<Metrics>,
}

impl Leases {
    pub fn new(
        store: Store,
        host: Arc<dyn Host>,
        hub: &crate::waiters::Hub,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            store,
            host,
            waiters: hub.waiters.clone(),
            waiting: hub.waiting.clone(),
            offers: Arc::default(),
            metrics,
        }
    }

    pub fn host(&self) -> &dyn Host {
        self.host.as_ref()
    }

    fn view(&self, rec: LeaseRecord) -> LeaseView {
        let owner = rec.owner.as_ref().map(|o| self.host.judge(o));
        LeaseView::new(rec, owner, now_ms())
    }

    /// One lease, current or ended, its owner judged now.
    pub async fn get(&self, id: &str) -> Result<Option<LeaseView>, StoreError> {
        let rec = self.store.backend().get_lease(id).await?;
        Ok(rec.map(|r| self.view(r)))
    }

    /// Leases that match `filter`, newest first, their owners judged now.
    pub async fn list(&self, filter: &LeaseFilter) -> Result<Vec<LeaseView>, StoreError> {
        let recs = self.store.backend().list_leases(filter).await?;
        Ok(recs.into_iter().map(|r| self.view(r)).collect())
    }

    pub async fn count_current(&self) -> Result<i64, StoreError> {
        self.store.backend().count_current_leases().await
    }

    async fn try_acquire(&self, cmd: Acquire) -> Result<Outcome<Acquired>, StoreError> {
        let out = in_tx!(self, true, |tx, cx| ops::acquire(tx, cx, cmd))?;
        match &out {
            Ok(a) => {
                self.metrics
                    .acquired(a.reclaimed.as_ref().map(|r| r.reason.as_str()));
            }
            Err(e) => self.metrics.lease_refused(e.code()),
        }
        Ok(out)
    }

    /// Acquire, waiting up to `wait` (first come, first served)
    /// while the answer is `lease_held`. Waiters are woken by the end of the lease itself,
    /// or at the holder's expiry when only its TTL can end it; a release
    /// hands the lease to the first waiter in its own transaction (`handoff`).
    /// On a fleet, waiters of other hosts that came first go first
    /// (`waiters::remote`).
    pub async fn acquire(&self, cmd: Acquire, wait: Duration) -> Result<Acquired, Error> {
        let deadline = Instant::now() + wait;
        let mut ticket = None;
        // Held while waiting: past the cap a waiter is told `busy` at once.
        let mut permit = None;
        // Whether a park before the first try has checked the key.
        let mut key_checked = false;
        if !wait.is_zero() && self.waiters.queued(&cmd.resource) > 0 {
            self.refuse_repeat(&mut key_checked).await?;
            // Others already wait for it: first come, first served, so take
            // a place behind them before trying at all.
            permit = Some(self.wait_permit()?);
            let t = ticket.insert(
                self.waiters
                    .enqueue(&cmd.resource, self.waiters.ends_seen()),
            );
            t.announce(deadline);
            if let Some(acquired) = self.park(t, &cmd, deadline).await {
                return Ok(self.handed(ticket, acquired));
            }
        }
        // Since when this waiter has let older waiters of other hosts take
        // the resource first, with nothing happening on it.
        let mut deferring: Option<Instant> = None;
        loop {
            if ticket.is_some() && self.waiters.is_closing() {
                return Err(Error::ShuttingDown);
            }
            let ahead = self.remote_ahead(&cmd, ticket.as_ref(), deadline);
            if !ahead.is_empty() {
                let since = *deferring.get_or_insert_with(Instant::now);
                let until = deadline.min(since + remote::DEFER);
                if Instant::now() < until {
                    if ticket.is_none() {
                        self.refuse_repeat(&mut key_checked).await?;
                    }
                    if permit.is_none() {
                        permit = Some(self.wait_permit()?);
                    }
                    let t = ticket.get_or_insert_with(|| {
                        self.waiters
                            .enqueue(&cmd.resource, self.waiters.ends_seen())
                    });
                    t.announce(deadline);
                    if let Some(acquired) = self.park(t, &cmd, until).await {
                        return Ok(self.handed(ticket, acquired));
                    }
                    if Instant::now() < until {
                        // Woken (a lease ended, one ahead left): the
                        // others get their time again.
                        deferring = None;
                    }
                    continue;
                }
            }
            deferring = None;
            let seen = self.waiters.ends_seen();
            let holder = match self.try_acquire(cmd.clone()).await? {
                Ok(acquired) => {
                    if let Some(t) = ticket {
                        crate::waiters::Ticket::acquired(t);
                    }
                    return Ok(acquired);
                }
                Err(LeaseError::Held(holder)) if Instant::now() < deadline => holder,
                Err(e) => return Err(e.into()),
            };
            if permit.is_none() {
                permit = Some(self.wait_permit()?);
            }
            let t = ticket.get_or_insert_with(|| self.waiters.enqueue(&cmd.resource, seen));
            t.announce(deadline);
            let mut until = deadline;
            if t.is_head()
                && let Some(at) = ttl_only_expiry(&holder)
            {
                let left = u64::try_from(at - now_ms() + 1).unwrap_or(0);
                until = until.min(Instant::now() + Duration::from_millis(left));
            }
            if let Some(acquired) = self.park(t, &cmd, until).await {
                return Ok(self.handed(ticket, acquired));
            }
        }
    }

    /// Before a keyed request queues without having tried (so without
    /// having recorded its key): a repeat takes no place in the queue, it
    /// is answered for its key, which another request holds. Checked once.
    async fn refuse_repeat(&self, checked: &mut bool) -> Result<(), Error> {
        if std::mem::replace(checked, true) {
            return Ok(());
        }
        if let Some(claim) = crate::idempotency::Claim::current()
            && self.key_held_elsewhere(&claim).await?
        {
            claim.mark_held_elsewhere();
            return Err(StoreError::RequestInProgress.into());
        }
        Ok(())
    }

    /// Whether `claim`'s key is recorded, in the last 24 hours, for a
    /// request other than its own and the one it takes over from.
    async fn key_held_elsewhere(
        &self,
        claim: &crate::idempotency::Claim,
    ) -> Result<bool, StoreError> {
        let Some(first) = self.store.backend().idempotent_request(&claim.key).await? else {
            return Ok(false);
        };
        let mine = first.request_id == claim.request_id
            || claim.supersedes.as_deref() == Some(first.request_id.as_str());
        Ok(!mine && first.kept_at(now_ms()))
    }

    /// The other hosts' waiters to let go first: those that came before
    /// `ticket` (or all, for one that has not queued yet), while the wait
    /// lasts. A waiter behind another of this host's leaves it to that one.
    fn remote_ahead(
        &self,
        cmd: &Acquire,
        ticket: Option<&Ticket>,
        deadline: Instant,
    ) -> Vec<remote::Place> {
        if Instant::now() >= deadline || ticket.is_some_and(|t| !t.is_head()) {
            return Vec::new();
        }
        self.waiters.remote_ahead(&cmd.resource, ticket.is_some())
    }

    fn wait_permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, StoreError> {
        self.waiting
            .clone()
            .try_acquire_owned()
            .map_err(|_| StoreError::Busy)
    }

    /// Wait in the queue until woken or `until`, offering to be handed the
    /// lease meanwhile; Some when a release handed it over. A request with
    /// an Idempotency-Key offers its key too: the releasing transaction
    /// records it with the lease it grants (`handoff::Offers::grant_head`).
    async fn park(&self, t: &Ticket, cmd: &Acquire, until: Instant) -> Option<Acquired> {
        let claim = crate::idempotency::Claim::current();
        let mut parked = self.offers.park(t.id(), cmd.clone(), claim);
        tokio::select! {
            // Taken, granted or not: nothing is left to withdraw.
            acquired = parked.handed() => return acquired,
            () = t.woken() => {}
            () = tokio::time::sleep_until(until) => {}
            () = self.waiters.closing() => {}
        }
        parked.withdraw().await
    }

    /// A waiter that was handed `acquired` leaves the queue.
    fn handed(&self, ticket: Option<Ticket>, acquired: Acquired) -> Acquired {
        if let Some(t) = ticket {
            t.acquired();
        }
        self.metrics
            .acquired(acquired.reclaimed.as_ref().map(|r| r.reason.as_str()));
        acquired
    }

    pub async fn renew(
        &self,
        id: String,
        token: i64,
        ttl_ms: Option<i64>,
    ) -> Result<LeaseView, Error> {
        // A lease with no owner and no parent needs nothing judged but its
        // TTL: where the store can, one statement renews it. A request with
        // an Idempotency-Key records it with its change, in a transaction.
        if crate::idempotency::Claim::current().is_none() {
            let now = crate::time::now_ms();
            let backend = self.store.backend();
            if let Some(rec) = backend.renew_unowned(&id, token, ttl_ms, now).await? {
                return Ok(LeaseView::new(rec, None, now));
            }
        }
        // Renewals need not reach the disk one by one (see store::sqlite).
        let durable = !self.store.backend().relaxed_renewals();
        let out = in_tx!(self, durable, |tx, cx| ops::renew(
            tx, cx, &id, token, ttl_ms
        ))?;
        self.finish(out)
    }

    pub async fn activate(
        &self,
        id: String,
        token: i64,
        owner: Option<Identity>,
    ) -> Result<LeaseView, Error> {
        let out = in_tx!(self, true, |tx, cx| ops::activate(
            tx, cx, &id, token, owner
        ))?;
        self.finish(out)
    }

    pub async fn release(&self, id: String, token: i64) -> Result<LeaseView, Error> {
        if !self.waiters.any() {
            let out = in_tx!(self, true, |tx, cx| ops::release(tx, cx, &id, token))?;
            return self.finish(out);
        }
        // A lease handed to a waiter must reach it even if this request
        // goes away before the commit: the release runs in a task of its own.
        let me = self.clone();
        let run = async move { me.release_handing_off(id, token).await };
        let task = match crate::idempotency::Claim::current() {
            Some(claim) => tokio::spawn(claim.scope(run)),
            None => tokio::spawn(run),
        };
        task.await
            .map_err(|e| StoreError::Other(format!("the release task failed: {e}")))?
    }

    /// Release, and grant the lease to the first parked waiter in the same
    /// transaction (see `handoff`).
    async fn release_handing_off(&self, id: String, token: i64) -> Result<LeaseView, Error> {
        let (waiters, offers) = (self.waiters.clone(), self.offers.clone());
        let Released { out, handed } = in_tx!(self, true, |tx, cx| async move {
            let out = ops::release_ending(tx, cx, &id, token).await?;
            let created = tx.created();
            let handed = match &out {
                Ok((lease, true)) => offers.grant_head(tx, cx, &waiters, &lease.resource).await?,
                _ => None,
            };
            // The lease handed over is its waiter's; this release created
            // nothing (see `crate::idempotency`).
            tx.set_created(created);
            let out = out.map(|(lease, _)| lease);
            Ok(Released { out, handed })
        })?;
        if let Some(h) = handed {
            h.deliver();
        }
        self.finish(out)
    }

    pub async fn break_lease(
        &self,
        id: String,
        reason: String,
        by: String,
    ) -> Result<LeaseView, Error> {
        let out = in_tx!(self, true, |tx, cx| ops::break_lease(
            tx, cx, &id, reason, by
        ))?;
        self.finish(out)
    }

    /// The reconciler's pass over one lease; Some when it ended it.
    pub async fn reconcile(&self, id: String) -> Result<Option<LeaseView>, StoreError> {
        let ended = in_tx!(self, true, |tx, cx| ops::reconcile(tx, cx, &id))?;
        if let Some(l) = &ended {
            self.metrics
                .ended_by_reconciler(l.end_reason.as_deref().unwrap_or(""));
        }
        Ok(ended)
    }

    fn finish<T>(&self, out: Outcome<T>) -> Result<T, Error> {
        out.map_err(|e| {
            self.metrics.lease_refused(e.code());
            e.into()
        })
    }
}

/// When only the TTL can end `holder` (no owner, or a remote one), its expiry.
fn ttl_only_expiry(holder: &LeaseView) -> Option<i64> {
    match holder.owner_status {
        None | Some(Liveness::Remote) => holder.expires_at,
        Some(_) => None,
    }
}

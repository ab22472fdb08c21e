//! Persistence behind one interface. Mutations run as jobs inside a write
//! transaction (`Store::write`); each job sees a `Tx` and nothing else, so
//! the rules in `leases` never know which database is behind them.

mod cache;
pub mod counters;
pub mod db;
mod group;
mod migrate;
pub mod outage;
pub mod postgres;
mod rows;
use crate::idempotency::Claim;
pub use crate::model::KeyClaim;
pub(crate) mod sql;
mod sql_store;
mod sql_tx;
pub mod sqlite;

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::model::{
    EventRow, IdempotentRequest, LeaseFilter, LeaseRecord, PortRecord, ProcessFilter, ProcessRecord,
};
use crate::time::Millis;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A storage failure, with the driver hidden.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Locked past the busy timeout, or no connection free: retry later.
    #[error("the store is busy")]
    Busy,
    /// The store cannot be written (disk full, read-only, database down).
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    #[error("store error: {0}")]
    Other(String),
    /// The connection broke as the change was being committed, and the
    /// database could not say in time whether it was kept.
    #[error("the store may or may not have kept the change: {0}")]
    OutcomeUnknown(String),
    /// The request's `Idempotency-Key` is held by another request: nothing
    /// of this one was kept.
    #[error("a request with the same idempotency key is in progress")]
    RequestInProgress,
    /// A row the writer answered from its memory had changed in the
    /// database (another host's write): nothing was kept, and the job is
    /// run again on what the database holds (`Store::write`).
    #[error("the store's memory of a row was out of date")]
    Stale,
}

/// Runs of one job that met `StoreError::Stale` before it is answered
/// `busy`. A run after a stale one reads what it uses from the database,
/// so a second rarely meets it; only other hosts changing the same rows
/// again and again can make it.
const STALE_RUNS: usize = 4;

tokio::task_local! {
    /// Set while a job that met `StoreError::Stale` is queued again: its
    /// batch reads from the database, not from the writer's memory.
    static FRESH: ();
}

/// Whether the job being queued must read fresh (see `FRESH`).
pub(crate) fn reads_fresh() -> bool {
    FRESH.try_with(|_| ()).is_ok()
}

/// What a committed transaction means for in-memory waiters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// A lease on this resource ended: wake those waiting to acquire it.
    LeaseEnded(String),
    /// An event with this seq was appended.
    Event(i64),
    /// Changes made elsewhere may have gone unannounced (another host's,
    /// while this one was not listening): every waiter should look again.
    Missed,
    /// Acquirers joined or left the queues of a host of the fleet.
    Waiters(crate::waiters::remote::WaitNews),
}

/// The operations a mutation may use inside its transaction.
pub trait Tx: Send {
    fn lease<'a>(&'a mut self, id: &'a str) -> BoxFuture<'a, Result<Option<LeaseRecord>>>;
    fn current_lease<'a>(
        &'a mut self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<LeaseRecord>>>;
    /// Allocate the next fencing token of `resource`; persisted with the transaction.
    fn next_token<'a>(&'a mut self, resource: &'a str) -> BoxFuture<'a, Result<i64>>;
    fn insert_lease<'a>(&'a mut self, lease: &'a LeaseRecord) -> BoxFuture<'a, Result<()>>;
    /// Overwrite the mutable fields of the lease with `lease.id`.
    fn update_lease<'a>(&'a mut self, lease: &'a LeaseRecord) -> BoxFuture<'a, Result<()>>;
    /// Append an event; `body` is its JSON object without `seq`, which the
    /// store gives it under the fleet's order at commit (PostgreSQL's
    /// writer learns the database's count only then; `Effect::Event`
    /// carries it to the listeners).
    fn append_event<'a>(&'a mut self, at: Millis, body: String) -> BoxFuture<'a, Result<()>>;
    fn set_meta<'a>(&'a mut self, key: &'a str, value: &'a str) -> BoxFuture<'a, Result<()>>;
    /// Delete events beyond the newest `keep_last` or older than `older_than`;
    /// returns the highest seq pruned so far (0 when none ever was).
    fn prune_events(
        &mut self,
        keep_last: Option<u64>,
        older_than: Option<Millis>,
    ) -> BoxFuture<'_, Result<i64>>;

    /// Record `claim.key` for its request unless another request did
    /// first: the id of the request that holds it.
    fn claim_key<'a>(&'a mut self, claim: &'a KeyClaim<'a>) -> BoxFuture<'a, Result<String>>;
    /// The request `request_id` that holds `key` created a record in this
    /// transaction: its key is never taken over (see `crate::idempotency`).
    fn key_created<'a>(
        &'a mut self,
        key: &'a str,
        request_id: &'a str,
    ) -> BoxFuture<'a, Result<()>>;
    /// Whether this transaction inserted a lease, a process or a port
    /// reservation so far, for its own request.
    fn created(&self) -> bool;
    /// Set what `created` answers: a record made for another request (a
    /// lease handed to a waiter) is not this request's.
    fn set_created(&mut self, created: bool);
    /// Store the answer (status, content type, body) of the request that holds `key`.
    fn answer_key<'a>(
        &'a mut self,
        key: &'a str,
        request_id: &'a str,
        answer: (u16, &'a str, &'a str),
    ) -> BoxFuture<'a, Result<()>>;
    /// Let `key` go if `request_id` holds it (its request failed: it may be retried).
    fn forget_key<'a>(&'a mut self, key: &'a str, request_id: &'a str)
    -> BoxFuture<'a, Result<()>>;
    /// Delete keys recorded before `before`.
    fn prune_keys(&mut self, before: Millis) -> BoxFuture<'_, Result<()>>;
    /// Delete up to `limit` each of the leases, the processes of `host_id`
    /// and the port reservations that ended before `before` (a lease bound
    /// to a current process stays); the log files of the processes deleted.
    fn prune_records<'a>(
        &'a mut self,
        before: Millis,
        host_id: &'a str,
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<String>>>;

    fn process<'a>(&'a mut self, id: &'a str) -> BoxFuture<'a, Result<Option<ProcessRecord>>>;
    /// The current process holding `operation_id`, if any.
    fn process_by_operation<'a>(
        &'a mut self,
        operation_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<ProcessRecord>>>;
    fn insert_process<'a>(&'a mut self, p: &'a ProcessRecord) -> BoxFuture<'a, Result<()>>;
    /// Overwrite the mutable fields of the process with `p.id`.
    fn update_process<'a>(&'a mut self, p: &'a ProcessRecord) -> BoxFuture<'a, Result<()>>;

    /// Ports held by current reservations on `host_id`.
    fn held_ports<'a>(&'a mut self, host_id: &'a str) -> BoxFuture<'a, Result<Vec<u16>>>;
    fn current_port<'a>(
        &'a mut self,
        host_id: &'a str,
        port: u16,
    ) -> BoxFuture<'a, Result<Option<PortRecord>>>;
    fn insert_port<'a>(&'a mut self, p: &'a PortRecord) -> BoxFuture<'a, Result<()>>;
    /// Current reservations of the lease or process `owner_id`.
    fn ports_of<'a>(&'a mut self, owner_id: &'a str) -> BoxFuture<'a, Result<Vec<PortRecord>>>;
    /// End the reservation `id` at `at`.
    fn release_port<'a>(&'a mut self, id: &'a str, at: Millis) -> BoxFuture<'a, Result<()>>;
    /// Run `effect` once the transaction has committed.
    fn after_commit(&mut self, effect: Effect);
    /// This transaction must reach stable storage before it is answered,
    /// even if it began as a non-durable one (a renewal that ends a lease).
    fn require_durable(&mut self);
}

pub type JobOutput = Box<dyn Any + Send>;
pub type JobFn = Box<dyn for<'t> FnOnce(&'t mut dyn Tx) -> BoxFuture<'t, Result<JobOutput>> + Send>;

/// Receives the effects of each committed transaction.
pub trait CommitListener: Send + Sync + 'static {
    fn committed(&self, effects: &[Effect]);
    /// A fleet's store tells the other hosts of this one's waiters through `a`.
    fn announce_with(&self, _a: Arc<dyn crate::waiters::remote::Announce>) {}
    /// Another host of the fleet (server instance `from`) sent a notification.
    fn peer_heard(&self, _from: &str) {}
    /// Whether another host was heard from lately (`peer_heard`).
    fn has_peers(&self) -> bool {
        false
    }
}

/// One storage backend.
pub trait Backend: Send + Sync + 'static {
    /// Run `job` in a write transaction. `durable`: the commit must reach
    /// stable storage before the answer (false only for renewals).
    fn write(&self, durable: bool, job: JobFn) -> BoxFuture<'_, Result<JobOutput>>;
    /// What the writer did so far, shared with /metrics.
    fn write_counters(&self) -> counters::WriteCounters;
    fn get_lease<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<LeaseRecord>>>;
    /// Renew the lease `id` with one statement outside any write transaction
    /// (which may carry other renewals too), if it needs nothing judged: current with `token`, no
    /// owner, no parent, its TTL not passed at `now`. Persisted before it
    /// returns. None when it is not such a lease, or when this store renews
    /// better inside its group commit (SQLite, whose renewals need not reach
    /// the disk one by one): then the caller runs the renewal script.
    fn renew_unowned<'a>(
        &'a self,
        id: &'a str,
        token: i64,
        ttl_ms: Option<i64>,
        now: Millis,
    ) -> BoxFuture<'a, Result<Option<LeaseRecord>>>;
    fn list_leases<'a>(
        &'a self,
        filter: &'a LeaseFilter,
    ) -> BoxFuture<'a, Result<Vec<LeaseRecord>>>;
    /// Current leases the reconciler must judge: owned ones, and those whose TTL passed.
    fn leases_to_reconcile(&self, now: Millis) -> BoxFuture<'_, Result<Vec<LeaseRecord>>>;
    fn count_current_leases(&self) -> BoxFuture<'_, Result<i64>>;
    fn get_process<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<ProcessRecord>>>;
    fn list_processes<'a>(
        &'a self,
        filter: &'a ProcessFilter,
    ) -> BoxFuture<'a, Result<Vec<ProcessRecord>>>;
    /// Current processes recorded on `host_id` (for the reconciler and re-adoption).
    fn current_processes<'a>(
        &'a self,
        host_id: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ProcessRecord>>>;
    fn count_current_processes(&self) -> BoxFuture<'_, Result<i64>>;
    /// Current reservations of `owner_id` (a lease or process id).
    /// The current reservations of all of `owner_ids` in one query, by owner then name.
    fn owner_ports<'a>(&'a self, owner_ids: &'a [String])
    -> BoxFuture<'a, Result<Vec<PortRecord>>>;
    /// Current reservations, newest first (by id), those before `before_id`.
    fn list_ports<'a>(
        &'a self,
        host_id: Option<&'a str>,
        before_id: Option<&'a str>,
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<PortRecord>>>;
    fn events(&self, after: i64, limit: u32) -> BoxFuture<'_, Result<Vec<EventRow>>>;
    /// The request recorded under an `Idempotency-Key`.
    fn idempotent_request<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<IdempotentRequest>>>;
    fn last_event_seq(&self) -> BoxFuture<'_, Result<i64>>;
    /// The highest seq retention has removed (0 when none).
    fn pruned_through(&self) -> BoxFuture<'_, Result<i64>>;
    fn close(&self) -> BoxFuture<'_, ()>;
    /// Which store this is, as `/readyz` names it: `sqlite` or `postgres`.
    fn kind(&self) -> &'static str;
    /// Keep the answer of the request `request_id` under `key` (with None:
    /// let the key go, if that request still holds it) in one statement of
    /// its own, where the store can: true then; false when the caller is
    /// to write it in a transaction. `durable`: kept on stable storage
    /// before it returns (else only safe from a crash of this server).
    fn settle_key<'a>(
        &'a self,
        key: &'a str,
        request_id: &'a str,
        answer: Option<(u16, &'a str, &'a str)>,
        durable: bool,
    ) -> BoxFuture<'a, Result<bool>>;
    /// This server run's id, new at every start, recorded with the keys of
    /// the requests it answers (`crate::idempotency`).
    fn run_id(&self) -> &str;
    /// Whether the server run `run_id` may still be answering requests:
    /// this one does; on a fleet's database, any whose server is still
    /// connected to it.
    fn run_alive<'a>(&'a self, run_id: &'a str) -> BoxFuture<'a, Result<bool>>;
    /// Whether renewals may be answered before they reach stable storage
    /// (a single-host store that extends TTLs after a crash instead).
    fn relaxed_renewals(&self) -> bool;
}

/// Record `claim`'s key in `tx`, for a transaction of its request: false
/// when another request holds it.
pub async fn record_claim(claim: &Claim, tx: &mut dyn Tx) -> Result<bool> {
    let at = crate::time::now_ms();
    let mine = KeyClaim {
        key: &claim.key,
        request: &claim.request,
        request_id: &claim.request_id,
        run_id: &claim.run_id,
        supersedes: claim.supersedes.as_deref(),
        at,
        stale: at - crate::idempotency::KEEP_MS,
    };
    if tx.claim_key(&mine).await? != claim.request_id {
        return Ok(false);
    }
    claim.mark_recorded();
    Ok(true)
}

/// `tx`, which recorded `claim`'s key, created a record for its request.
pub async fn claim_created(claim: &Claim, tx: &mut dyn Tx) -> Result<()> {
    tx.key_created(&claim.key, &claim.request_id).await?;
    claim.mark_created();
    Ok(())
}

/// Keep the answer of `claim`'s request in `tx`, which recorded its key,
/// if `out`, what `tx` returns to it, is the request's last word (see
/// `Claim::render`): true then, once `tx` commits.
pub fn answer_claim<'a>(
    claim: &'a Claim,
    out: &dyn Any,
    tx: &'a mut dyn Tx,
) -> BoxFuture<'a, Result<bool>> {
    // Rendered before the future, which `out` (not `Sync`) must not enter.
    let answer = claim.render(out);
    Box::pin(async move {
        let Some((status, content_type, body)) = answer else {
            return Ok(false);
        };
        let answer = (status, content_type.as_str(), body.as_str());
        tx.answer_key(&claim.key, &claim.request_id, answer).await?;
        Ok(true)
    })
}

/// The store the service uses: a backend plus typed helpers.
#[derive(Clone)]
pub struct Store {
    backend: std::sync::Arc<dyn Backend>,
}

impl Store {
    pub fn new(backend: std::sync::Arc<dyn Backend>) -> Self {
        Self { backend }
    }

    /// Run `f` in a write transaction and return what it returns, once
    /// committed. `f` may run more than once: a store that answers reads
    /// from memory undoes a run whose rows changed meanwhile and runs a
    /// copy of `f` again (`StoreError::Stale`); nothing a run did is kept
    /// but the last one's.
    pub async fn write<R, F>(&self, durable: bool, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: for<'t> FnOnce(&'t mut dyn Tx) -> BoxFuture<'t, Result<R>> + Send + Clone + 'static,
    {
        // A request with an Idempotency-Key records it in each of its
        // transactions, before its change (see `crate::idempotency`).
        let claim = crate::idempotency::Claim::current();
        let mut runs = 0;
        let out = loop {
            runs += 1;
            let (f, claim) = (f.clone(), claim.clone());
            let job: JobFn = Box::new(move |tx| {
                Box::pin(async move {
                    let Some(c) = claim else {
                        return f(tx).await.map(|r| Box::new((r, false)) as JobOutput);
                    };
                    if !record_claim(&c, tx).await? {
                        return Err(StoreError::RequestInProgress);
                    }
                    let out = f(tx).await?;
                    if tx.created() {
                        claim_created(&c, tx).await?;
                    }
                    let answered = answer_claim(&c, &out, tx).await?;
                    Ok(Box::new((out, answered)) as JobOutput)
                })
            });
            let written = match runs {
                1 => self.backend.write(durable, job).await,
                _ => FRESH.scope((), self.backend.write(durable, job)).await,
            };
            match written {
                Err(StoreError::Stale) if runs < STALE_RUNS => continue,
                Err(StoreError::Stale) => break Err(StoreError::Busy),
                out => break out,
            }
        };
        let out = out.inspect_err(|e| match (e, &claim) {
            (StoreError::OutcomeUnknown(_), Some(c)) => c.mark_unsure(),
            (StoreError::RequestInProgress, Some(c)) => c.mark_held_elsewhere(),
            _ => {}
        })?;
        let (out, answered) = out
            .downcast::<(R, bool)>()
            .map(|b| *b)
            .map_err(|_| StoreError::Other("job output of unexpected type".into()))?;
        if let (true, Some(c)) = (answered, &claim) {
            c.mark_answered();
        }
        outage::OUTAGE.answered();
        Ok(out)
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// The store's kind (`sqlite`, `postgres`) once a small write proves it
    /// open, migrated and writable (not full, not a read-only standby, the
    /// fleet's write lock obtainable). Through `write`, so that a probe
    /// that meets a connection cut since the last write runs again on a
    /// new one, as a request's write does, rather than failing readiness.
    pub async fn ready(&self) -> Result<&'static str> {
        let now = crate::time::now_ms().to_string();
        self.write(false, move |tx| {
            Box::pin(async move { tx.set_meta("probe", &now).await })
        })
        .await?;
        Ok(self.backend.kind())
    }
}

//! Safe retries: the `Idempotency-Key` a request carries, as its
//! transactions see it. The API layer (`api::idempotency`) sets it for the
//! request's handler; `Store::write` then records the key in each of the
//! request's transactions, the same transaction as its change, so that a
//! change is never kept without its key. A request that finds the key held
//! by another request makes no change (`StoreError::RequestInProgress`).
//! Where the handler can say what it will answer for what the transaction
//! returns (`Claim::answer_with`: all but an acquire whose wait runs out,
//! whose answer comes from no transaction), that transaction keeps the
//! answer too, and a change is never kept without its answer; the others
//! keep theirs after the change (`api::unkept`).
//!
//! A key is recorded with the server run that answers its request. If that
//! run ends (the server killed or restarted) before the answer is stored,
//! the key would stay in progress for a day, and the client's retry, which
//! is what the key is for, would be refused. So a retry of the same request
//! takes over the key of a run that has ended (`Backend::run_alive`) and is
//! done afresh, unless a transaction of the first request created a record
//! (a lease, a process, a port reservation; `Tx::key_created`): creating it
//! again would make the change twice, and that key stays held. What else a
//! request changes (a renewal, a release, a stop) is safe to do again.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// How long a key and its answer are kept.
pub const KEEP_MS: i64 = 24 * 60 * 60 * 1000;

/// An answer as it is kept: status, content type, body.
pub type Answer = (u16, String, String);

/// The answer a request gives for what one of its transactions returns
/// (`Store::write`'s job output), when that output is its last word: None
/// for any other output (of another type, or one after which the request
/// goes on, such as an acquire that will wait).
pub type Render = Box<dyn Fn(&dyn Any) -> Option<Answer> + Send + Sync>;

struct Renderer(Render);

impl std::fmt::Debug for Renderer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Renderer")
    }
}

/// The key of one request.
#[derive(Debug)]
pub struct Claim {
    pub key: String,
    /// Method, path and body: what a repeat must match.
    pub request: String,
    /// This request, among those that may send the key.
    pub request_id: String,
    /// The request this one takes the key over from: it was still in
    /// progress when its server run ended, and had created nothing.
    pub supersedes: Option<String>,
    /// The server run answering it (`Backend::run_id`).
    pub run_id: String,
    /// A transaction of this request recorded the key (it holds it if that
    /// transaction committed).
    recorded: AtomicBool,
    /// A transaction of this request that recorded the key may have
    /// committed, unbeknown to it: the key must not be let go.
    unsure: AtomicBool,
    /// A transaction of this request created a record (`Tx::key_created`).
    created: AtomicBool,
    /// A transaction of this request found the key held by another.
    held_elsewhere: AtomicBool,
    /// Set by the request's handler: its answer can be kept by the
    /// transaction that makes it, with the change.
    render: OnceLock<Renderer>,
    /// A committed transaction of this request kept its answer.
    answered: AtomicBool,
}

tokio::task_local! {
    static CLAIM: Arc<Claim>;
}

impl Claim {
    pub fn new(
        key: String,
        request: String,
        supersedes: Option<String>,
        run_id: String,
    ) -> Arc<Self> {
        Arc::new(Self {
            key,
            request,
            request_id: uuid::Uuid::now_v7().to_string(),
            supersedes,
            run_id,
            recorded: AtomicBool::new(false),
            unsure: AtomicBool::new(false),
            created: AtomicBool::new(false),
            held_elsewhere: AtomicBool::new(false),
            render: OnceLock::new(),
            answered: AtomicBool::new(false),
        })
    }

    /// Run `f` (the request's handler) with this key.
    pub async fn scope<F: std::future::Future>(self: Arc<Self>, f: F) -> F::Output {
        CLAIM.scope(self, f).await
    }

    /// The key of the request being handled by this task, if it has one.
    pub fn current() -> Option<Arc<Self>> {
        CLAIM.try_with(Arc::clone).ok()
    }

    pub fn mark_recorded(&self) {
        self.recorded.store(true, Ordering::SeqCst);
    }

    pub fn recorded(&self) -> bool {
        self.recorded.load(Ordering::SeqCst)
    }

    pub fn mark_created(&self) {
        self.created.store(true, Ordering::SeqCst);
    }

    /// Whether a transaction of this request created a record (perhaps
    /// in a run that was undone). Only then must its answer reach stable
    /// storage before it is given: a lost answer of a request that created
    /// nothing lets a retry do it afresh, which is safe, while a lost
    /// answer of one that created a record leaves its key held for a day.
    pub fn created(&self) -> bool {
        self.created.load(Ordering::SeqCst)
    }

    /// Let this request's transactions keep its answer with its change
    /// (see `Render`); the first call wins.
    pub fn answer_with(&self, render: Render) {
        let _ = self.render.set(Renderer(render));
    }

    /// The answer to keep with a transaction that returns `out`.
    pub fn render(&self, out: &dyn Any) -> Option<Answer> {
        self.render.get().and_then(|r| (r.0)(out))
    }

    pub fn mark_answered(&self) {
        self.answered.store(true, Ordering::SeqCst);
    }

    /// Whether the answer was kept with the change, in one transaction:
    /// nothing is left to write after it.
    pub fn answered(&self) -> bool {
        self.answered.load(Ordering::SeqCst)
    }

    pub fn mark_held_elsewhere(&self) {
        self.held_elsewhere.store(true, Ordering::SeqCst);
    }

    /// Whether the key was found held by another request (which may have
    /// been answered since).
    pub fn held_elsewhere(&self) -> bool {
        self.held_elsewhere.load(Ordering::SeqCst)
    }

    /// Called when a transaction that recorded the key ended with
    /// `StoreError::OutcomeUnknown`.
    pub fn mark_unsure(&self) {
        self.unsure.store(true, Ordering::SeqCst);
    }

    /// Whether a change of this request may have been kept without its
    /// answer: its key then stays held (`request_in_progress`) rather than
    /// let go for a retry that would make the change twice.
    pub fn unsure(&self) -> bool {
        self.recorded() && self.unsure.load(Ordering::SeqCst)
    }
}

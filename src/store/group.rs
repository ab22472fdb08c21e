//! Group commit, for both stores: a request queues its job, and one leader
//! task at a time takes every job queued so far and runs them as one batch
//! (one transaction, one commit, one fsync), then answers them. The batch
//! runs in a task of its own: a caller that goes away must not cancel a
//! transaction that carries other callers' jobs.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use super::counters::WriteCounters;
use super::sql_store::Writes;
use super::{BoxFuture, JobFn, JobOutput, Result, StoreError};

const MAX_BATCH: usize = 256;
const QUEUE_CAP: usize = 8192;

pub struct Job {
    /// The commit must reach stable storage before the answer.
    pub durable: bool,
    pub run: JobFn,
    pub reply: oneshot::Sender<Result<JobOutput>>,
}

/// How one store runs a batch.
pub trait Batches: Send + Sync + 'static {
    /// Run and answer `batch`; the jobs it did not run, to be queued again
    /// in front of the others.
    fn run(&self, batch: Vec<Job>) -> BoxFuture<'_, Vec<Job>>;
    /// Release what the batches use, once the last one has run.
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
    /// A leader task runs (or is about to): it takes what is queued
    /// before it stops, so no other is started.
    leading: bool,
}

pub struct GroupCommit<B> {
    queue: Mutex<Queue>,
    /// Held by the task running batches: one batch at a time.
    lead: Arc<tokio::sync::Mutex<()>>,
    pub batches: B,
    counters: WriteCounters,
}

/// Answer every job with `e`.
pub fn fail(replies: impl IntoIterator<Item = oneshot::Sender<Result<JobOutput>>>, e: &StoreError) {
    for r in replies {
        let _ = r.send(Err(e.clone()));
    }
}

impl<B: Batches> GroupCommit<B> {
    pub fn new(batches: B) -> Arc<Self> {
        Self::counting(batches, WriteCounters::default())
    }

    /// With `counters` that `batches` counts into as well.
    pub fn counting(batches: B, counters: WriteCounters) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::default(),
            lead: Arc::default(),
            batches,
            counters,
        })
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub async fn write(self: &Arc<Self>, durable: bool, run: JobFn) -> Result<JobOutput> {
        let (reply, rx) = oneshot::channel();
        let already_led = {
            let mut q = self.queue();
            if q.closed {
                return Err(StoreError::Unavailable("the store is closed".into()));
            }
            if q.jobs.len() >= QUEUE_CAP {
                return Err(StoreError::Busy);
            }
            q.jobs.push_back(Job {
                durable,
                run,
                reply,
            });
            std::mem::replace(&mut q.leading, true)
        };
        if !already_led {
            self.start_leader();
        }
        rx.await.map_err(|_| stopped())?
    }

    fn start_leader(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            let _lead = me.lead.clone().lock_owned().await;
            let unwinding = Unwinding(&me);
            me.drain().await;
            std::mem::forget(unwinding);
        });
    }

    /// Run batches until the queue is empty; the caller holds `lead`. The
    /// queue is found empty and `leading` cleared under one lock, so a job
    /// queued after that starts a leader of its own.
    async fn drain(&self) {
        loop {
            let batch = {
                let mut q = self.queue();
                let n = q.jobs.len().min(MAX_BATCH);
                if n == 0 {
                    q.leading = false;
                    return;
                }
                q.jobs.drain(..n).collect::<Vec<_>>()
            };
            let (n, durable) = (batch.len(), batch.iter().any(|j| j.durable));
            let left = self.batches.run(batch).await;
            if left.len() < n {
                self.counters.ran(durable, n - left.len());
            }
            let mut q = self.queue();
            for job in left.into_iter().rev() {
                q.jobs.push_front(job);
            }
        }
    }
}

/// Clears `leading` if a leader dies by a panic, so the next job starts one.
struct Unwinding<'a, B: Batches>(&'a GroupCommit<B>);

impl<B: Batches> Drop for Unwinding<'_, B> {
    fn drop(&mut self) {
        self.0.queue().leading = false;
    }
}

/// The job's reply was dropped: its batch was cut off (its time limit, a
/// panic) wherever it was, perhaps in its COMMIT.
fn stopped() -> StoreError {
    StoreError::OutcomeUnknown("the writer stopped".into())
}

impl<B: Batches> Writes for Arc<GroupCommit<B>> {
    fn write(&self, durable: bool, job: JobFn) -> BoxFuture<'_, Result<JobOutput>> {
        Box::pin(GroupCommit::write(self, durable, job))
    }

    fn counters(&self) -> WriteCounters {
        self.counters.clone()
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.queue().closed = true;
            let _lead = self.lead.lock().await;
            self.drain().await;
            self.batches.close().await;
        })
    }
}

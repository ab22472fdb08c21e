//! Group commit, for both stores: a request queues its job, and one leader
//! at a time takes every job queued so far and runs them as one batch (one
//! transaction, one commit, one fsync), then answers them. The caller that
//! finds no leader leads on its own task until its job is answered, so that
//! a lone request pays no hop to another task; what is left then (jobs
//! queued meanwhile) goes to a leader task. A caller that goes away must not
//! cancel a transaction that carries other callers' jobs: its batch under
//! way is finished on a task of its own (`Inline`'s drop).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::{OwnedMutexGuard, oneshot};

use super::counters::WriteCounters;
use super::sql_store::Writes;
use super::{BoxFuture, JobFn, JobOutput, Result, StoreError};

const MAX_BATCH: usize = 256;
const QUEUE_CAP: usize = 8192;

pub struct Job {
    /// The commit must reach stable storage before the answer.
    pub durable: bool,
    /// The job's reads go to the database, not to what the writer
    /// remembers (`store::reads_fresh`).
    pub fresh: bool,
    pub run: JobFn,
    pub reply: oneshot::Sender<Result<JobOutput>>,
}

/// How one store runs a batch.
pub trait Batches: Send + Sync + 'static {
    /// Run and answer `batch`; the jobs it did not run, to be queued again
    /// in front of the others.
    fn run(&self, batch: Vec<Job>) -> BoxFuture<'_, Vec<Job>>;
    /// A batch runs without waiting on anything (SQLite's, in place), so
    /// jobs cannot queue while one runs: when the last batch carried
    /// several, the leader lets the requests that are ready on its thread
    /// queue theirs before it takes the next. (Without that, renewals at
    /// C=64 went four times as many to a commit, 2 a piece instead of 8,
    /// and 15% fewer per second.)
    const GATHERS: bool = false;
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
    /// Jobs in the last batch run (see `Batches::GATHERS`).
    last_batch: AtomicUsize,
}

/// Answer every job with `e`.
pub fn fail(replies: impl IntoIterator<Item = oneshot::Sender<Result<JobOutput>>>, e: &StoreError) {
    for r in replies {
        let _ = r.send(Err(e.clone()));
    }
}

impl<B: Batches> GroupCommit<B> {
    /// With `counters` that `batches` counts into as well.
    pub fn new(batches: B, counters: WriteCounters) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::default(),
            lead: Arc::default(),
            batches,
            counters,
            last_batch: AtomicUsize::new(0),
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
                fresh: super::reads_fresh(),
                run,
                reply,
            });
            std::mem::replace(&mut q.leading, true)
        };
        if !already_led {
            let mut lead = Inline {
                me: self.clone(),
                step: None,
                idle: None,
                done: false,
            };
            lead.run_until_answered(&rx).await;
        }
        rx.await.map_err(|_| stopped())?
    }

    fn start_leader(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            let lead = me.lead.clone().lock_owned().await;
            me.drain_holding(lead).await;
        });
    }

    /// Run batches until the queue is empty, holding the leader's lock.
    async fn drain_holding(&self, _lead: OwnedMutexGuard<()>) {
        let unwinding = Unwinding(self);
        self.drain().await;
        std::mem::forget(unwinding);
    }

    /// Let the jobs of requests under way join the next batch (see
    /// `Batches::GATHERS`): those ready on this runtime thread, then, on a
    /// CPU that two runtime threads share, the other thread's. (Renewals at
    /// C=64 on one CPU: 2 jobs a commit without the thread's yield, 15%
    /// fewer per second than sqlx's writer thread; 5% fewer with it.)
    async fn gather(&self) {
        if B::GATHERS && self.last_batch.load(Ordering::Relaxed) > 1 {
            tokio::task::yield_now().await;
            std::thread::yield_now();
        }
    }

    /// Up to `MAX_BATCH` queued jobs; None, with `leading` cleared under
    /// the same lock, when there are none: a job queued after that starts
    /// a leader of its own.
    fn take_batch(&self) -> Option<Vec<Job>> {
        let mut q = self.queue();
        let n = q.jobs.len().min(MAX_BATCH);
        if n == 0 {
            q.leading = false;
            return None;
        }
        Some(q.jobs.drain(..n).collect())
    }

    /// Run `batch`, count it, and queue again in front what it did not run.
    async fn run_batch(&self, batch: Vec<Job>) {
        let (n, durable) = (batch.len(), batch.iter().any(|j| j.durable));
        self.last_batch.store(n, Ordering::Relaxed);
        let left = self.batches.run(batch).await;
        if left.len() < n {
            self.counters.ran(durable, n - left.len());
        }
        let mut q = self.queue();
        for job in left.into_iter().rev() {
            q.jobs.push_front(job);
        }
    }

    /// Run batches until the queue is empty; the caller holds `lead`.
    async fn drain(&self) {
        loop {
            self.gather().await;
            let Some(batch) = self.take_batch() else {
                break;
            };
            self.run_batch(batch).await;
        }
    }
}

/// One batch under way, owning the leader's lock, which it gives back.
type Step = BoxFuture<'static, OwnedMutexGuard<()>>;

/// The leader's role, held by the task of the caller that took it.
struct Inline<B: Batches> {
    me: Arc<GroupCommit<B>>,
    step: Option<Step>,
    /// The leader's lock, between batches.
    idle: Option<OwnedMutexGuard<()>>,
    /// The role is given up: nothing is left to hand on.
    done: bool,
}

impl<B: Batches> Inline<B> {
    async fn run_until_answered(&mut self, rx: &oneshot::Receiver<Result<JobOutput>>) {
        self.idle = Some(self.me.lead.clone().lock_owned().await);
        // A reply that was dropped (its batch was cut off) leaves `rx`
        // empty: this caller then leads until the queue is empty.
        while rx.is_empty() {
            let Some(guard) = self.idle.take() else {
                return;
            };
            self.me.gather().await;
            let Some(batch) = self.me.take_batch() else {
                self.done = true;
                return;
            };
            let me = self.me.clone();
            let step = self.step.insert(Box::pin(async move {
                me.run_batch(batch).await;
                guard
            }));
            let guard = step.await;
            self.step = None;
            self.idle = Some(guard);
        }
        // Answered: the leader task takes over only if jobs wait.
        let mut q = self.me.queue();
        if q.jobs.is_empty() {
            q.leading = false;
            self.done = true;
        }
    }
}

impl<B: Batches> Drop for Inline<B> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // A batch that panicked cannot be resumed: its jobs are lost (their
        // callers get `OutcomeUnknown`), the others go on.
        let step = self.step.take().filter(|_| !std::thread::panicking());
        let me = self.me.clone();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        match (step, self.idle.take()) {
            (Some(step), _) => {
                rt.spawn(async move { me.drain_holding(step.await).await });
            }
            (None, Some(guard)) => {
                rt.spawn(async move { me.drain_holding(guard).await });
            }
            (None, None) => me.start_leader(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::sync::Semaphore;

    /// Answers each job with the size of its batch once `gate` lets the
    /// batch through (one permit per batch), and notes the task each batch
    /// ran on and how many ran to the end.
    struct Gated {
        gate: Semaphore,
        tasks: Mutex<Vec<Option<tokio::task::Id>>>,
        finished: AtomicUsize,
    }

    impl Default for Gated {
        fn default() -> Self {
            Self {
                gate: Semaphore::new(0),
                tasks: Mutex::default(),
                finished: AtomicUsize::new(0),
            }
        }
    }

    impl Batches for Arc<Gated> {
        fn run(&self, batch: Vec<Job>) -> BoxFuture<'_, Vec<Job>> {
            Box::pin(async move {
                self.tasks
                    .lock()
                    .expect("tasks")
                    .push(tokio::task::try_id());
                self.gate.acquire().await.expect("gate").forget();
                let n = batch.len();
                for job in batch {
                    let _ = job.reply.send(Ok(Box::new(n) as JobOutput));
                }
                self.finished.fetch_add(1, Ordering::SeqCst);
                Vec::new()
            })
        }
    }

    fn job() -> JobFn {
        Box::new(|_| Box::pin(async { Ok(Box::new(()) as JobOutput) }))
    }

    async fn write(g: &Arc<GroupCommit<Arc<Gated>>>) -> Result<usize> {
        let out = g.write(true, job()).await?;
        Ok(*out.downcast::<usize>().expect("usize"))
    }

    type Writing = tokio::task::JoinHandle<(tokio::task::Id, Result<usize>)>;

    /// A write on a task of its own that leads, once its batch waits at the gate.
    async fn leading(g: &Arc<GroupCommit<Arc<Gated>>>, batches: &Gated) -> Writing {
        let g = g.clone();
        let first = tokio::spawn(async move { (tokio::task::id(), write(&g).await) });
        while batches.tasks.lock().expect("tasks").is_empty() {
            tokio::task::yield_now().await;
        }
        first
    }

    #[tokio::test]
    async fn a_lone_write_is_run_on_its_callers_task() {
        let batches = Arc::new(Gated::default());
        batches.gate.add_permits(10);
        let g = GroupCommit::new(batches.clone(), WriteCounters::default());
        let (id, n) = tokio::spawn({
            let g = g.clone();
            async move { (tokio::task::id(), write(&g).await) }
        })
        .await
        .expect("task");
        assert_eq!(n.expect("answered"), 1);
        assert_eq!(*batches.tasks.lock().expect("tasks"), [Some(id)]);
        assert!(!g.queue().leading, "the role was given up");
    }

    #[tokio::test]
    async fn a_caller_that_goes_away_mid_batch_cancels_nothing() {
        let batches = Arc::new(Gated::default());
        let g = GroupCommit::new(batches.clone(), WriteCounters::default());
        let first = leading(&g, &batches).await;
        // Two more queue behind it; then the leader's caller goes away.
        let later: Vec<_> = (0..2)
            .map(|_| {
                let g = g.clone();
                tokio::spawn(async move { write(&g).await })
            })
            .collect();
        while g.queue().jobs.len() < 2 {
            tokio::task::yield_now().await;
        }
        first.abort();
        assert!(first.await.expect_err("aborted").is_cancelled());
        batches.gate.add_permits(2);
        for w in later {
            let answered = tokio::time::timeout(std::time::Duration::from_secs(10), w)
                .await
                .expect("the jobs behind an abandoned leader were answered");
            assert_eq!(answered.expect("task").expect("answered"), 2, "one batch");
        }
        assert_eq!(
            batches.finished.load(Ordering::SeqCst),
            2,
            "the abandoned batch ran to its end, then the next"
        );
        assert!(!g.queue().leading);
    }

    #[tokio::test]
    async fn jobs_queued_behind_an_answered_leader_get_a_leader_task() {
        let batches = Arc::new(Gated::default());
        let g = GroupCommit::new(batches.clone(), WriteCounters::default());
        let first = leading(&g, &batches).await;
        let second = tokio::spawn({
            let g = g.clone();
            async move { (tokio::task::id(), write(&g).await) }
        });
        while g.queue().jobs.is_empty() {
            tokio::task::yield_now().await;
        }
        batches.gate.add_permits(2);
        let (first_id, first_n) = first.await.expect("task");
        let (second_id, second_n) = second.await.expect("task");
        assert_eq!((first_n.expect("ok"), second_n.expect("ok")), (1, 1));
        let tasks = batches.tasks.lock().expect("tasks").clone();
        assert_eq!(tasks[0], Some(first_id));
        assert!(
            tasks[1].is_some_and(|t| t != first_id && t != second_id),
            "the second batch ran on a leader task: {tasks:?}"
        );
    }

    /// `Gated` for a store whose batches run without waiting (`GATHERS`).
    struct Gathering(Arc<Gated>);

    impl Batches for Gathering {
        const GATHERS: bool = true;

        fn run(&self, batch: Vec<Job>) -> BoxFuture<'_, Vec<Job>> {
            self.0.run(batch)
        }
    }

    /// Two writes ready at once on one thread, after a batch of `last`
    /// jobs: the sizes of the batches they went in.
    async fn two_at_once(last: usize) -> (usize, usize) {
        let batches = Arc::new(Gated::default());
        batches.gate.add_permits(10);
        let g = GroupCommit::new(Gathering(batches), WriteCounters::default());
        g.last_batch.store(last, Ordering::Relaxed);
        let size = |g: Arc<GroupCommit<Gathering>>| async move {
            let out = g.write(true, job()).await.expect("answered");
            *out.downcast::<usize>().expect("usize")
        };
        let a = tokio::spawn(size(g.clone()));
        let b = tokio::spawn(size(g.clone()));
        (a.await.expect("a"), b.await.expect("b"))
    }

    #[tokio::test]
    async fn after_a_shared_batch_the_leader_lets_ready_requests_join_its_batch() {
        assert_eq!(two_at_once(2).await, (2, 2), "one batch");
        assert_eq!(two_at_once(1).await, (1, 1), "alone, it runs at once");
    }
}

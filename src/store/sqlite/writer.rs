//! The single writer. One read-write connection runs every mutation. A
//! request queues its job; whoever finds the connection free becomes the
//! leader and runs every job queued so far in one transaction (each inside a
//! savepoint, so a failing job does not undo the others), commits once, and
//! only then answers them: group commit, one fsync for many requests. The
//! leader runs statements on its own thread, so a lone request pays no
//! thread hop at all.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use rusqlite::Connection;
use tokio::sync::oneshot;

use super::{rows, rows_process as procs};
use crate::model::{LeaseRecord, PortRecord, ProcessRecord};
use crate::store::{BoxFuture, CommitListener, Effect, JobFn, JobOutput, Result, StoreError, Tx};
use crate::time::Millis;

const MAX_BATCH: usize = 256;
/// Batches one leader runs before handing the rest to a blocking thread, so
/// that its own request is not held up behind an endless stream of others.
const MAX_ROUNDS: usize = 4;
const QUEUE_CAP: usize = 8192;

pub struct Job {
    pub durable: bool,
    pub run: JobFn,
    pub reply: oneshot::Sender<Result<JobOutput>>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

pub struct Shared {
    queue: Mutex<Queue>,
    /// None once closed.
    writer: Mutex<Option<Writer>>,
    listener: Arc<dyn CommitListener>,
}

fn exec(conn: &Connection, sql: &str) -> Result<()> {
    conn.execute_batch(sql).map_err(super::map_err)
}

/// The lock if it is free; a poisoned lock is taken over, since every job
/// runs inside a transaction that a panic leaves unanswered, not half-done.
fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    pub fn new(conn: Connection, listener: Arc<dyn CommitListener>) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::default(),
            writer: Mutex::new(Some(Writer {
                conn,
                full_sync: true,
            })),
            listener,
        })
    }

    /// Queue `job`; `Busy` when the queue is full.
    pub fn submit(&self, job: Job) -> Result<()> {
        let mut q = lock(&self.queue);
        if q.closed {
            return Err(StoreError::Unavailable("the store is closed".into()));
        }
        if q.jobs.len() >= QUEUE_CAP {
            return Err(StoreError::Busy);
        }
        q.jobs.push_back(job);
        Ok(())
    }

    /// Run the queued jobs here if the connection is free. Returns at once
    /// when another thread leads: it will see the job, since it checks the
    /// queue again after it lets go of the connection.
    pub fn lead_from_async(self: &Arc<Self>) {
        let Some(guard) = try_lock(&self.writer) else {
            return;
        };
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi_thread {
            // Tell the runtime this worker blocks (on the fsync) for a while.
            tokio::task::block_in_place(|| self.lead(guard));
        } else {
            drop(guard);
            let me = self.clone();
            tokio::task::spawn_blocking(move || me.lead_blocking());
        }
    }

    fn lead_blocking(self: &Arc<Self>) {
        if let Some(guard) = try_lock(&self.writer) {
            self.lead(guard);
        }
    }

    fn lead<'s>(self: &'s Arc<Self>, mut guard: MutexGuard<'s, Option<Writer>>) {
        loop {
            let mut rounds = 0;
            while rounds < MAX_ROUNDS {
                let batch = self.take_batch();
                if batch.is_empty() {
                    break;
                }
                match guard.as_mut() {
                    Some(w) => w.run_batch(batch, self.listener.as_ref()),
                    None => fail(
                        batch,
                        &StoreError::Unavailable("the store is closed".into()),
                    ),
                }
                rounds += 1;
            }
            drop(guard);
            if lock(&self.queue).jobs.is_empty() {
                return;
            }
            if rounds == MAX_ROUNDS {
                let me = self.clone();
                tokio::task::spawn_blocking(move || me.lead_blocking());
                return;
            }
            // A job arrived after the last batch was taken: lead again
            // unless someone else already does.
            match try_lock(&self.writer) {
                Some(g) => guard = g,
                None => return,
            }
        }
    }

    fn take_batch(&self) -> Vec<Job> {
        let mut q = lock(&self.queue);
        let n = q.jobs.len().min(MAX_BATCH);
        q.jobs.drain(..n).collect()
    }

    /// Refuse new jobs, finish the queued ones, and close the connection.
    pub fn close(&self) {
        lock(&self.queue).closed = true;
        let mut guard = lock(&self.writer);
        loop {
            let batch = self.take_batch();
            if batch.is_empty() {
                break;
            }
            if let Some(w) = guard.as_mut() {
                w.run_batch(batch, self.listener.as_ref());
            }
        }
        if let Some(w) = guard.take()
            && let Err((_, e)) = w.conn.close()
        {
            tracing::warn!(error = %e, "closing the sqlite writer connection");
        }
    }
}

fn fail(batch: Vec<Job>, e: &StoreError) {
    for j in batch {
        let _ = j.reply.send(Err(e.clone()));
    }
}

/// Jobs are async only in signature: every Tx call of this store completes
/// at once, so one poll finishes a job.
fn run_now<T>(mut fut: BoxFuture<'_, Result<T>>) -> Result<T> {
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => Err(StoreError::Other("a store job waited on something".into())),
    }
}

struct Writer {
    conn: Connection,
    /// The connection's current `synchronous` level is FULL.
    full_sync: bool,
}

impl Writer {
    fn set_sync(&mut self, full: bool) -> Result<()> {
        if self.full_sync != full {
            exec(
                &self.conn,
                if full {
                    "PRAGMA synchronous = FULL"
                } else {
                    "PRAGMA synchronous = NORMAL"
                },
            )?;
            self.full_sync = full;
        }
        Ok(())
    }

    fn run_batch(&mut self, batch: Vec<Job>, listener: &dyn CommitListener) {
        // Renewals alone need not be fsynced; any durable job makes the
        // commit (and every earlier unsynced one in the WAL) durable.
        let durable = batch.iter().any(|j| j.durable);
        if !self.conn.is_autocommit() {
            // Left open by a leader that never finished: nothing of it was answered.
            let _ = exec(&self.conn, "ROLLBACK");
        }
        let begun = self
            .set_sync(durable)
            .and_then(|()| exec(&self.conn, "BEGIN IMMEDIATE"));
        if let Err(e) = begun {
            return fail(batch, &e);
        }
        let single = batch.len() == 1;
        let mut needs_sync = false;
        let mut done = Vec::with_capacity(batch.len());
        let mut effects = Vec::new();
        for job in batch {
            if !single && let Err(e) = exec(&self.conn, "SAVEPOINT job") {
                let _ = job.reply.send(Err(e));
                continue;
            }
            let mut tx = WriterTx {
                conn: &mut self.conn,
                effects: Vec::new(),
                durable: false,
            };
            // A job that panics fails alone; the writer and its lock live on.
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run_now((job.run)(&mut tx))
            }))
            .unwrap_or_else(|_| Err(StoreError::Other("a store job panicked".into())));
            let (job_effects, job_durable) = (tx.effects, tx.durable);
            let kept = match (&out, single) {
                (Ok(_), true) => true,
                (Ok(_), false) => exec(&self.conn, "RELEASE job").is_ok(),
                (Err(_), true) => false,
                (Err(_), false) => exec(&self.conn, "ROLLBACK TO job; RELEASE job").is_ok(),
            };
            let out = match out {
                Ok(_) if !kept => Err(StoreError::Other(
                    "the job's changes could not be kept".into(),
                )),
                other => other,
            };
            if out.is_ok() {
                effects.extend(job_effects);
                needs_sync |= job_durable;
            }
            done.push((job.reply, out));
            // SQLite rolls the whole transaction back on some errors (disk
            // full, I/O): then nothing of this batch may be answered as done.
            if self.conn.is_autocommit() && !(single && done.iter().all(|(_, o)| o.is_err())) {
                let e =
                    StoreError::Unavailable("the transaction was rolled back by the store".into());
                for (reply, _) in done {
                    let _ = reply.send(Err(e.clone()));
                }
                return;
            }
        }
        let outcome = if single && done.first().is_some_and(|(_, out)| out.is_err()) {
            exec(&self.conn, "ROLLBACK")
        } else if let Err(e) = exec(&self.conn, "COMMIT") {
            let _ = exec(&self.conn, "ROLLBACK");
            Err(e)
        } else if needs_sync && !self.full_sync {
            // A non-durable batch that ended a lease: make it durable before
            // answering. The sync level cannot change inside a transaction,
            // so commit one more small one at FULL, which syncs the whole WAL.
            let synced = self.sync_wal();
            if synced.is_err() {
                // Committed and visible, only not known to be on disk: wake
                // the waiters, but do not answer it as durable.
                listener.committed(&effects);
            }
            synced
        } else {
            Ok(())
        };
        if let Err(e) = outcome {
            for (reply, _) in done {
                let _ = reply.send(Err(e.clone()));
            }
            return;
        }
        if !effects.is_empty() {
            listener.committed(&effects);
        }
        for (reply, out) in done {
            let _ = reply.send(out);
        }
    }

    fn sync_wal(&mut self) -> Result<()> {
        self.set_sync(true)?;
        exec(&self.conn, "BEGIN IMMEDIATE")?;
        let now = crate::time::now_ms().to_string();
        if let Err(e) = rows::set_meta(&self.conn, "synced_at", &now) {
            let _ = exec(&self.conn, "ROLLBACK");
            return Err(e);
        }
        exec(&self.conn, "COMMIT")
    }
}

struct WriterTx<'c> {
    // `&mut` because a shared `&Connection` is not Send.
    conn: &'c mut Connection,
    effects: Vec<Effect>,
    durable: bool,
}

fn ready<'a, T: Send + 'a>(v: T) -> BoxFuture<'a, T> {
    Box::pin(std::future::ready(v))
}

impl Tx for WriterTx<'_> {
    fn lease<'a>(&'a mut self, id: &'a str) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        ready(rows::lease(&*self.conn, id))
    }

    fn current_lease<'a>(
        &'a mut self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        ready(rows::current_lease(&*self.conn, resource))
    }

    fn next_token<'a>(&'a mut self, resource: &'a str) -> BoxFuture<'a, Result<i64>> {
        ready(rows::next_token(&*self.conn, resource))
    }

    fn insert_lease<'a>(&'a mut self, lease: &'a LeaseRecord) -> BoxFuture<'a, Result<()>> {
        ready(rows::insert_lease(&*self.conn, lease))
    }

    fn update_lease<'a>(&'a mut self, lease: &'a LeaseRecord) -> BoxFuture<'a, Result<()>> {
        ready(rows::update_lease(&*self.conn, lease))
    }

    fn append_event<'a>(&'a mut self, at: Millis, body: String) -> BoxFuture<'a, Result<i64>> {
        let seq = rows::append_event(&*self.conn, at, &body);
        if let Ok(seq) = seq {
            self.effects.push(Effect::Event(seq));
        }
        ready(seq)
    }

    fn set_meta<'a>(&'a mut self, key: &'a str, value: &'a str) -> BoxFuture<'a, Result<()>> {
        ready(rows::set_meta(&*self.conn, key, value))
    }

    fn prune_events(
        &mut self,
        keep_last: Option<u64>,
        older_than: Option<Millis>,
    ) -> BoxFuture<'_, Result<i64>> {
        ready(rows::prune_events(&*self.conn, keep_last, older_than))
    }

    fn process<'a>(&'a mut self, id: &'a str) -> BoxFuture<'a, Result<Option<ProcessRecord>>> {
        ready(procs::process(&*self.conn, id))
    }

    fn process_by_operation<'a>(
        &'a mut self,
        op: &'a str,
    ) -> BoxFuture<'a, Result<Option<ProcessRecord>>> {
        ready(procs::process_by_operation(&*self.conn, op))
    }

    fn insert_process<'a>(&'a mut self, p: &'a ProcessRecord) -> BoxFuture<'a, Result<()>> {
        ready(procs::insert_process(&*self.conn, p))
    }

    fn update_process<'a>(&'a mut self, p: &'a ProcessRecord) -> BoxFuture<'a, Result<()>> {
        ready(procs::update_process(&*self.conn, p))
    }

    fn held_ports<'a>(&'a mut self, host_id: &'a str) -> BoxFuture<'a, Result<Vec<u16>>> {
        ready(procs::held_ports(&*self.conn, host_id))
    }

    fn current_port<'a>(
        &'a mut self,
        host_id: &'a str,
        port: u16,
    ) -> BoxFuture<'a, Result<Option<PortRecord>>> {
        ready(procs::current_port(&*self.conn, host_id, port))
    }

    fn insert_port<'a>(&'a mut self, p: &'a PortRecord) -> BoxFuture<'a, Result<()>> {
        ready(procs::insert_port(&*self.conn, p))
    }

    fn ports_of<'a>(&'a mut self, owner_id: &'a str) -> BoxFuture<'a, Result<Vec<PortRecord>>> {
        ready(procs::ports_of(&*self.conn, owner_id))
    }

    fn release_port<'a>(&'a mut self, id: &'a str, at: Millis) -> BoxFuture<'a, Result<()>> {
        ready(procs::release_port(&*self.conn, id, at))
    }

    fn after_commit(&mut self, effect: Effect) {
        self.effects.push(effect);
    }

    fn require_durable(&mut self) {
        self.durable = true;
    }
}

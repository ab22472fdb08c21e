//! Write transactions on PostgreSQL, with group commit as on SQLite: a
//! request queues its job, and a leader task runs every job queued so far in
//! one transaction and commits once. Unlike SQLite's, jobs get no savepoint
//! each: that would add two round trips to every job, and a job fails only
//! when the database or the code does (see `run_batch`).
//!
//! Every transaction first locks the one row of `event_seq`. That serializes
//! the writes of the whole fleet: each job re-checks its preconditions with
//! no other writer in between (the same guarantee SQLite's single writer
//! gives), no two transactions can deadlock, and event seqs become visible
//! in the order they were taken. The cost is one fleet-wide writer at a
//! time, which group commit spreads over many requests per round trip.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::FutureExt;
use sqlx::{PgConnection, PgPool};
use tokio::sync::oneshot;

use super::{map_conn_err, map_err, rows, rows_process as procs};
use crate::model::{LeaseRecord, PortRecord, ProcessRecord};
use crate::store::{BoxFuture, CommitListener, Effect, JobFn, JobOutput, Result, StoreError, Tx};
use crate::time::Millis;

const MAX_BATCH: usize = 256;
const QUEUE_CAP: usize = 8192;

struct Job {
    run: JobFn,
    reply: oneshot::Sender<Result<JobOutput>>,
}

pub struct Writer {
    pool: PgPool,
    queue: Mutex<VecDeque<Job>>,
    /// Held by the task running a batch: one batch of this host at a time.
    lead: Arc<tokio::sync::Mutex<()>>,
    listener: Arc<dyn CommitListener>,
    notify: super::notify::Notifier,
    batch_limit: std::time::Duration,
}

// Boxed, as every future of sqlx calls that a spawned task awaits: rustc
// cannot otherwise prove it `Send` for every lifetime (rust-lang/rust#102211).
fn exec<'c>(c: &'c mut PgConnection, sql: &'static str) -> BoxFuture<'c, Result<()>> {
    Box::pin(async move {
        sqlx::Executor::execute(c, sql).await.map_err(map_err)?;
        Ok(())
    })
}

fn fail(replies: impl IntoIterator<Item = oneshot::Sender<Result<JobOutput>>>, e: &StoreError) {
    for r in replies {
        let _ = r.send(Err(e.clone()));
    }
}

impl Writer {
    pub fn new(
        pool: PgPool,
        listener: Arc<dyn CommitListener>,
        notify: super::notify::Notifier,
        batch_limit: std::time::Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            pool,
            queue: Mutex::default(),
            lead: Arc::default(),
            listener,
            notify,
            batch_limit,
        })
    }

    pub async fn write(self: &Arc<Self>, run: JobFn) -> Result<JobOutput> {
        let (reply, rx) = oneshot::channel();
        {
            let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            if q.len() >= QUEUE_CAP {
                return Err(StoreError::Busy);
            }
            q.push_back(Job { run, reply });
        }
        // The batch runs in a task of its own: a caller that goes away must
        // not cancel a transaction that carries other callers' jobs.
        let me = self.clone();
        tokio::spawn(async move {
            let _lead = me.lead.clone().lock_owned().await;
            loop {
                let batch = me.take_batch();
                if batch.is_empty() {
                    return;
                }
                // A connection that hangs (a half-open socket after a
                // partition) must not hold every later write of this host:
                // past the limit the batch is dropped, its connection closed,
                // and its jobs answered `unavailable`.
                if tokio::time::timeout(me.batch_limit, me.run_batch(batch))
                    .await
                    .is_err()
                {
                    tracing::warn!(limit = ?me.batch_limit, "a write batch did not finish in time; dropped");
                    me.listener.committed(&[Effect::Missed]);
                }
            }
        });
        rx.await
            .map_err(|_| StoreError::Unavailable("the writer stopped".into()))?
    }

    fn take_batch(&self) -> Vec<Job> {
        let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let n = q.len().min(MAX_BATCH);
        q.drain(..n).collect()
    }

    async fn run_batch(&self, batch: Vec<Job>) {
        let mut conn = match self.pool.acquire().await {
            Ok(c) => c,
            Err(e) => {
                let e = map_conn_err(&self.pool, e);
                return fail(batch.into_iter().map(|j| j.reply), &e);
            }
        };
        // One round trip: a simple query may hold several statements.
        if let Err(e) = exec(&mut conn, "BEGIN; SELECT seq FROM event_seq FOR UPDATE").await {
            let _ = exec(&mut conn, "ROLLBACK").await;
            return fail(batch.into_iter().map(|j| j.reply), &e);
        }
        let mut done = Vec::with_capacity(batch.len());
        let mut effects = Vec::new();
        let mut jobs = batch.into_iter();
        while let Some(job) = jobs.next() {
            let mut tx = PgTx {
                conn: &mut conn,
                effects: Vec::new(),
            };
            let out = std::panic::AssertUnwindSafe((job.run)(&mut tx))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| Err(StoreError::Other("a store job panicked".into())));
            let job_effects = tx.effects;
            match out {
                Ok(v) => {
                    effects.extend(job_effects);
                    done.push((job.reply, v));
                }
                Err(e) => {
                    // No savepoint per job (two round trips each): the failed
                    // job's partial writes cannot be undone alone, so the
                    // batch is rolled back. Refusals are values, not errors:
                    // only a database or code failure gets here. The jobs
                    // that ran with it were not kept and may be retried; those
                    // that did not run yet go back to the queue.
                    let _ = exec(&mut conn, "ROLLBACK").await;
                    self.requeue(jobs.collect());
                    let _ = job.reply.send(Err(e));
                    return fail(done.into_iter().map(|(r, _)| r), &StoreError::Busy);
                }
            }
        }
        let committed = async {
            // Delivered to the other hosts only if this commits.
            self.notify.send(&mut conn, &effects).await?;
            exec(&mut conn, "COMMIT").await
        }
        .await;
        if let Err(e) = committed {
            let _ = exec(&mut conn, "ROLLBACK").await;
            conn.close_on_drop();
            // A COMMIT whose answer was lost may have committed: waiters
            // here look again (this host ignores its own notifications).
            self.listener.committed(&[Effect::Missed]);
            return fail(done.into_iter().map(|(r, _)| r), &e);
        }
        if !effects.is_empty() {
            self.listener.committed(&effects);
        }
        for (reply, out) in done {
            let _ = reply.send(Ok(out));
        }
    }

    /// Put jobs back at the head of the queue, in their order.
    fn requeue(&self, jobs: Vec<Job>) {
        let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        for job in jobs.into_iter().rev() {
            q.push_front(job);
        }
    }
}

struct PgTx<'c> {
    conn: &'c mut PgConnection,
    effects: Vec<Effect>,
}

impl Tx for PgTx<'_> {
    fn lease<'a>(&'a mut self, id: &'a str) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        Box::pin(rows::lease(self.conn, id))
    }

    fn current_lease<'a>(
        &'a mut self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        Box::pin(rows::current_lease(self.conn, resource))
    }

    fn next_token<'a>(&'a mut self, resource: &'a str) -> BoxFuture<'a, Result<i64>> {
        Box::pin(rows::next_token(self.conn, resource))
    }

    fn insert_lease<'a>(&'a mut self, lease: &'a LeaseRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(rows::insert_lease(self.conn, lease))
    }

    fn update_lease<'a>(&'a mut self, lease: &'a LeaseRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(rows::update_lease(self.conn, lease))
    }

    fn append_event<'a>(&'a mut self, at: Millis, body: String) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            let seq = rows::append_event(self.conn, at, &body).await?;
            self.effects.push(Effect::Event(seq));
            Ok(seq)
        })
    }

    fn set_meta<'a>(&'a mut self, key: &'a str, value: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(rows::set_meta(self.conn, key, value))
    }

    fn prune_events(
        &mut self,
        keep_last: Option<u64>,
        older_than: Option<Millis>,
    ) -> BoxFuture<'_, Result<i64>> {
        Box::pin(rows::prune_events(self.conn, keep_last, older_than))
    }

    fn process<'a>(&'a mut self, id: &'a str) -> BoxFuture<'a, Result<Option<ProcessRecord>>> {
        Box::pin(procs::process(self.conn, id))
    }

    fn process_by_operation<'a>(
        &'a mut self,
        op: &'a str,
    ) -> BoxFuture<'a, Result<Option<ProcessRecord>>> {
        Box::pin(procs::process_by_operation(self.conn, op))
    }

    fn insert_process<'a>(&'a mut self, p: &'a ProcessRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(procs::insert_process(self.conn, p))
    }

    fn update_process<'a>(&'a mut self, p: &'a ProcessRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(procs::update_process(self.conn, p))
    }

    fn held_ports<'a>(&'a mut self, host_id: &'a str) -> BoxFuture<'a, Result<Vec<u16>>> {
        Box::pin(procs::held_ports(self.conn, host_id))
    }

    fn current_port<'a>(
        &'a mut self,
        host_id: &'a str,
        port: u16,
    ) -> BoxFuture<'a, Result<Option<PortRecord>>> {
        Box::pin(procs::current_port(self.conn, host_id, port))
    }

    fn insert_port<'a>(&'a mut self, p: &'a PortRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(procs::insert_port(self.conn, p))
    }

    fn ports_of<'a>(&'a mut self, owner_id: &'a str) -> BoxFuture<'a, Result<Vec<PortRecord>>> {
        Box::pin(procs::ports_of(self.conn, owner_id))
    }

    fn release_port<'a>(&'a mut self, id: &'a str, at: Millis) -> BoxFuture<'a, Result<()>> {
        Box::pin(procs::release_port(self.conn, id, at))
    }

    fn after_commit(&mut self, effect: Effect) {
        self.effects.push(effect);
    }

    /// Every PostgreSQL commit is durable (synchronous_commit as the server has it).
    fn require_durable(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::postgres::{PgStore, PoolSettings};
    use sqlx::Connection;

    struct Nobody;
    impl CommitListener for Nobody {
        fn committed(&self, _: &[Effect]) {}
    }

    /// A store on a new database of the test PostgreSQL, or None when off,
    /// or when `HOLDFAST_TEST_POSTGRES` is unset and nothing answers at the
    /// default address (as in tests/integration/stores.rs).
    async fn store() -> Option<PgStore> {
        let (base, required) = match std::env::var("HOLDFAST_TEST_POSTGRES") {
            Ok(v) if v == "off" => {
                eprintln!("SKIPPED: HOLDFAST_TEST_POSTGRES=off");
                return None;
            }
            Ok(v) if !v.is_empty() => (v, true),
            _ => ("postgres://postgres@127.0.0.1:5432".into(), false),
        };
        let name = format!("hf_t_{}", uuid::Uuid::now_v7().simple());
        let mut admin = match sqlx::PgConnection::connect(&format!("{base}/postgres")).await {
            Ok(c) => c,
            Err(sqlx::Error::Io(e)) if !required => {
                eprintln!(
                    "SKIPPED: HOLDFAST_TEST_POSTGRES is unset and {base} does not answer: {e}"
                );
                return None;
            }
            Err(e) => panic!("cannot reach the test PostgreSQL at {base}: {e}"),
        };
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .expect("create");
        let settings = PoolSettings {
            max_connections: 4,
            timeout: std::time::Duration::from_secs(5),
        };
        let store = PgStore::connect(&format!("{base}/{name}"), &settings, Arc::new(Nobody))
            .await
            .expect("store");
        Some(store)
    }

    fn set(key: &'static str, fail: bool) -> (Job, oneshot::Receiver<Result<JobOutput>>) {
        let (reply, rx) = oneshot::channel();
        let run: JobFn = Box::new(move |tx| {
            Box::pin(async move {
                tx.set_meta(key, "x").await?;
                if fail {
                    return Err(StoreError::Other("the job failed".into()));
                }
                Ok(Box::new(()) as JobOutput)
            })
        });
        (Job { run, reply }, rx)
    }

    #[tokio::test]
    async fn a_failed_job_undoes_its_batch_and_the_jobs_after_it_run_again() {
        let Some(store) = store().await else {
            return;
        };
        let w = &store.writer;
        let (before, before_rx) = set("before", false);
        let (failing, failing_rx) = set("failing", true);
        let (after, after_rx) = set("after", false);
        w.run_batch(vec![before, failing, after]).await;
        assert!(matches!(before_rx.await, Ok(Err(StoreError::Busy))));
        assert!(matches!(failing_rx.await, Ok(Err(StoreError::Other(_)))));
        let requeued = w.take_batch();
        assert_eq!(requeued.len(), 1, "the job after the failure was not run");
        w.run_batch(requeued).await;
        assert!(after_rx.await.is_ok_and(|r| r.is_ok()));

        let mut c = store.conn().await.expect("conn");
        let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM meta ORDER BY key")
            .fetch_all(&mut *c)
            .await
            .expect("keys");
        assert_eq!(keys, ["after"], "nothing of the failed batch was kept");
    }
}

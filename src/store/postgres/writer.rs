//! Write transactions on PostgreSQL, with group commit as on SQLite: a
//! request queues its job, and a leader task runs every job queued so far in
//! one transaction (each in a savepoint, so a failing job undoes only its
//! own changes) and commits once.
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
    ) -> Arc<Self> {
        Arc::new(Self {
            pool,
            queue: Mutex::default(),
            lead: Arc::default(),
            listener,
            notify,
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
                me.run_batch(batch).await;
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
            Err(e) => return fail(batch.into_iter().map(|j| j.reply), &map_conn_err(e)),
        };
        let begun = async {
            exec(&mut conn, "BEGIN").await?;
            exec(&mut conn, "SELECT seq FROM event_seq FOR UPDATE").await
        }
        .await;
        if let Err(e) = begun {
            let _ = exec(&mut conn, "ROLLBACK").await;
            return fail(batch.into_iter().map(|j| j.reply), &e);
        }
        let single = batch.len() == 1;
        let mut done = Vec::with_capacity(batch.len());
        let mut effects = Vec::new();
        for job in batch {
            if !single && let Err(e) = exec(&mut conn, "SAVEPOINT job").await {
                let _ = job.reply.send(Err(e));
                continue;
            }
            let mut tx = PgTx {
                conn: &mut conn,
                effects: Vec::new(),
            };
            let out = std::panic::AssertUnwindSafe((job.run)(&mut tx))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| Err(StoreError::Other("a store job panicked".into())));
            let job_effects = tx.effects;
            let kept = match (&out, single) {
                (Ok(_), true) | (Err(_), true) => Ok(()),
                (Ok(_), false) => exec(&mut conn, "RELEASE SAVEPOINT job").await,
                (Err(_), false) => {
                    exec(
                        &mut conn,
                        "ROLLBACK TO SAVEPOINT job; RELEASE SAVEPOINT job",
                    )
                    .await
                }
            };
            if let Err(e) = kept {
                // The transaction is unusable: nothing of this batch is kept.
                let _ = exec(&mut conn, "ROLLBACK").await;
                conn.close_on_drop();
                let replies = done.into_iter().map(|(r, _)| r);
                return fail(replies.chain([job.reply]), &e);
            }
            if out.is_ok() {
                effects.extend(job_effects);
            }
            done.push((job.reply, out));
        }
        let all_failed = done.iter().all(|(_, out)| out.is_err());
        let outcome = if all_failed {
            exec(&mut conn, "ROLLBACK").await
        } else {
            let committed = async {
                // Delivered to the other hosts only if this commits.
                self.notify.send(&mut conn, &effects).await?;
                exec(&mut conn, "COMMIT").await
            }
            .await;
            if committed.is_err() {
                let _ = exec(&mut conn, "ROLLBACK").await;
            }
            committed
        };
        if let Err(e) = outcome {
            conn.close_on_drop();
            return fail(done.into_iter().map(|(r, _)| r), &e);
        }
        if !effects.is_empty() {
            self.listener.committed(&effects);
        }
        for (reply, out) in done {
            let _ = reply.send(out);
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

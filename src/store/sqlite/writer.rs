//! The single writer: a thread of its own that owns the one read-write
//! connection. It takes every job queued so far, runs them in one
//! transaction (each inside a savepoint, so a failing job does not undo the
//! others), commits once, and only then answers them: group commit, one
//! fsync for many requests. Statements run synchronously on this thread,
//! with no hop per statement.

use std::sync::Arc;

use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use super::rows;
use crate::model::LeaseRecord;
use crate::store::{BoxFuture, CommitListener, Effect, JobFn, JobOutput, Result, Tx};
use crate::time::Millis;

const MAX_BATCH: usize = 256;

pub struct Job {
    pub durable: bool,
    pub run: JobFn,
    pub reply: oneshot::Sender<Result<JobOutput>>,
}

pub enum Msg {
    Job(Job),
    Close(oneshot::Sender<()>),
}

fn exec(conn: &Connection, sql: &str) -> Result<()> {
    conn.execute_batch(sql).map_err(super::map_err)
}

pub fn run(conn: Connection, mut rx: mpsc::Receiver<Msg>, listener: Arc<dyn CommitListener>) {
    // Jobs are async only in signature: with this connection every Tx call
    // completes at once, so a current-thread runtime just drives them.
    let rt = match tokio::runtime::Builder::new_current_thread().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the sqlite writer");
            return;
        }
    };
    let mut w = Writer {
        conn,
        full_sync: true,
    };
    let mut batch: Vec<Job> = Vec::with_capacity(MAX_BATCH);
    let mut closing = None;
    while closing.is_none() {
        match rx.blocking_recv() {
            Some(Msg::Job(j)) => batch.push(j),
            Some(Msg::Close(done)) => closing = Some(done),
            None => break,
        }
        while closing.is_none() && batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(Msg::Job(j)) => batch.push(j),
                Ok(Msg::Close(done)) => closing = Some(done),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            rt.block_on(w.run_batch(std::mem::take(&mut batch), listener.as_ref()));
        }
    }
    if let Err((_, e)) = w.conn.close() {
        tracing::warn!(error = %e, "closing the sqlite writer connection");
    }
    if let Some(done) = closing {
        let _ = done.send(());
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

    async fn run_batch(&mut self, batch: Vec<Job>, listener: &dyn CommitListener) {
        // Renewals alone need not be fsynced; any durable job makes the
        // commit (and every earlier unsynced one in the WAL) durable.
        let durable = batch.iter().any(|j| j.durable);
        let begun = self
            .set_sync(durable)
            .and_then(|()| exec(&self.conn, "BEGIN IMMEDIATE"));
        if let Err(e) = begun {
            for j in batch {
                let _ = j.reply.send(Err(e.clone()));
            }
            return;
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
            let out = (job.run)(&mut tx).await;
            let (job_effects, job_durable) = (tx.effects, tx.durable);
            let kept = match (&out, single) {
                (Ok(_), true) => true,
                (Ok(_), false) => exec(&self.conn, "RELEASE job").is_ok(),
                (Err(_), true) => false,
                (Err(_), false) => exec(&self.conn, "ROLLBACK TO job; RELEASE job").is_ok(),
            };
            if out.is_ok() && kept {
                effects.extend(job_effects);
                needs_sync |= job_durable;
            }
            done.push((job.reply, out));
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
            self.sync_wal()
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

    fn after_commit(&mut self, effect: Effect) {
        self.effects.push(effect);
    }

    fn require_durable(&mut self) {
        self.durable = true;
    }
}

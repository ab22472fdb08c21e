//! The single writer: one read-write connection runs every batch of the
//! group commit (see `store::group`) in one transaction, each job of a
//! batch inside a savepoint so that a failing job does not undo the others.
//! Renewals alone are committed at `synchronous=NORMAL`; any durable job
//! makes the commit (and every earlier unsynced one in the WAL) durable.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::FutureExt;
use sqlx::{Sqlite, SqliteConnection};

use crate::store::group::{Batches, GroupCommit, Job, fail};
use crate::store::sql_store::Writes;
use crate::store::sql_tx::SqlTx;
use crate::store::{BoxFuture, CommitListener, Result, StoreError};

struct Conn {
    conn: SqliteConnection,
    /// The connection's `synchronous` level is FULL now.
    full_sync: bool,
    /// A transaction of ours may be open (one that never finished).
    open: bool,
}

struct Writer {
    /// None once closed. Only the group commit's leader locks it.
    conn: tokio::sync::Mutex<Option<Conn>>,
    /// Set by SQLite whenever a transaction is rolled back, including the
    /// rollbacks it makes by itself on some errors (disk full, I/O).
    rolled_back: Arc<AtomicBool>,
    listener: Arc<dyn CommitListener>,
}

pub(super) async fn start(
    mut conn: SqliteConnection,
    listener: Arc<dyn CommitListener>,
) -> Result<Arc<dyn Writes>> {
    {
        let rolled_back = Arc::new(AtomicBool::new(false));
        let flag = rolled_back.clone();
        conn.lock_handle()
            .await
            .map_err(super::map_err)?
            .set_rollback_hook(move || flag.store(true, Ordering::SeqCst));
        let writer = Writer {
            conn: tokio::sync::Mutex::new(Some(Conn {
                conn,
                full_sync: true,
                open: false,
            })),
            rolled_back,
            listener,
        };
        Ok(Arc::new(GroupCommit::new(writer)) as Arc<dyn Writes>)
    }
}

// Boxed, as every future of sqlx calls that a spawned task awaits: rustc
// cannot otherwise prove it `Send` for every lifetime (rust-lang/rust#102211).
fn exec<'c>(c: &'c mut SqliteConnection, sql: &'static str) -> BoxFuture<'c, Result<()>> {
    Box::pin(async move {
        sqlx::Executor::execute(c, sql)
            .await
            .map(|_| ())
            .map_err(super::map_err)
    })
}

impl Batches for Writer {
    fn run(&self, batch: Vec<Job>) -> BoxFuture<'_, Vec<Job>> {
        Box::pin(async move {
            let mut guard = self.conn.lock().await;
            match guard.as_mut() {
                Some(c) => self.run_batch(c, batch).await,
                None => fail(
                    batch.into_iter().map(|j| j.reply),
                    &StoreError::Unavailable("the store is closed".into()),
                ),
            }
            Vec::new()
        })
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some(c) = self.conn.lock().await.take()
                && let Err(e) = sqlx::Connection::close(c.conn).await
            {
                tracing::warn!(error = %e, "closing the sqlite writer connection");
            }
        })
    }
}

impl Writer {
    /// `BEGIN IMMEDIATE` at the sync level the batch needs, and the first
    /// job's savepoint when there are several, in one round trip.
    async fn begin(&self, c: &mut Conn, durable: bool, savepoint: bool) -> Result<()> {
        if c.open {
            // Left open by a batch that never finished: nothing of it was answered.
            let _ = exec(&mut c.conn, "ROLLBACK").await;
            c.open = false;
        }
        let sql = match (c.full_sync == durable, durable, savepoint) {
            (true, _, false) => "BEGIN IMMEDIATE",
            (true, _, true) => "BEGIN IMMEDIATE; SAVEPOINT job",
            (false, true, false) => "PRAGMA synchronous = FULL; BEGIN IMMEDIATE",
            (false, true, true) => "PRAGMA synchronous = FULL; BEGIN IMMEDIATE; SAVEPOINT job",
            (false, false, false) => "PRAGMA synchronous = NORMAL; BEGIN IMMEDIATE",
            (false, false, true) => "PRAGMA synchronous = NORMAL; BEGIN IMMEDIATE; SAVEPOINT job",
        };
        exec(&mut c.conn, sql).await?;
        c.full_sync = durable;
        c.open = true;
        self.rolled_back.store(false, Ordering::SeqCst);
        Ok(())
    }

    async fn end(&self, c: &mut Conn, sql: &'static str) -> Result<()> {
        let out = exec(&mut c.conn, sql).await;
        if out.is_ok() {
            c.open = false;
        }
        out
    }

    async fn run_batch(&self, c: &mut Conn, batch: Vec<Job>) {
        let durable = batch.iter().any(|j| j.durable);
        let single = batch.len() == 1;
        if let Err(e) = self.begin(c, durable, !single).await {
            return fail(batch.into_iter().map(|j| j.reply), &e);
        }
        let mut needs_sync = false;
        let mut done = Vec::with_capacity(batch.len());
        let mut effects = Vec::new();
        let mut jobs = batch.into_iter();
        while let Some(job) = jobs.next() {
            // Each job of several gets a savepoint (the first one's came with
            // BEGIN). They are never released, which would cost a round trip
            // each: `ROLLBACK TO` undoes the newest of that name, and COMMIT
            // keeps them all.
            if !single
                && !done.is_empty()
                && let Err(e) = exec(&mut c.conn, "SAVEPOINT job").await
            {
                let _ = job.reply.send(Err(e));
                continue;
            }
            let mut tx = SqlTx::<Sqlite>::new(&mut c.conn);
            // A job that panics fails alone; the writer lives on.
            let out = std::panic::AssertUnwindSafe((job.run)(&mut tx))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| Err(StoreError::Other("a store job panicked".into())));
            let (job_effects, job_durable) = (tx.effects, tx.durable);
            let out = match out {
                Err(e) if !single => match exec(&mut c.conn, "ROLLBACK TO job").await {
                    Ok(()) => Err(e),
                    Err(undo) => Err(undo),
                },
                out => out,
            };
            if out.is_ok() {
                effects.extend(job_effects);
                needs_sync |= job_durable;
            }
            done.push((job.reply, out));
            // SQLite rolls the whole transaction back on some errors (disk
            // full, I/O): then nothing of this batch may be answered as done.
            let lone_failure = single && done.iter().all(|(_, o)| o.is_err());
            if self.rolled_back.load(Ordering::SeqCst) && !lone_failure {
                c.open = false;
                let e =
                    StoreError::Unavailable("the transaction was rolled back by the store".into());
                let rest = jobs.map(|j| j.reply);
                return fail(done.into_iter().map(|(r, _)| r).chain(rest), &e);
            }
        }
        let outcome = if single && done.first().is_some_and(|(_, out)| out.is_err()) {
            // The job's own error is the answer, whether this works or
            // SQLite already rolled back (then the next batch tries again).
            let _ = self.end(c, "ROLLBACK").await;
            Ok(())
        } else if let Err(e) = self.end(c, "COMMIT").await {
            let _ = self.end(c, "ROLLBACK").await;
            Err(e)
        } else if needs_sync && !c.full_sync {
            // A non-durable batch that ended a lease: make it durable before
            // answering. The sync level cannot change inside a transaction,
            // so commit one more small one at FULL, which syncs the whole WAL.
            let synced = self.sync_wal(c).await;
            if synced.is_err() {
                // Committed and visible, only not known to be on disk: wake
                // the waiters, but do not answer it as durable.
                self.listener.committed(&effects);
            }
            synced
        } else {
            Ok(())
        };
        if let Err(e) = outcome {
            return fail(done.into_iter().map(|(r, _)| r), &e);
        }
        if !effects.is_empty() {
            self.listener.committed(&effects);
        }
        for (reply, out) in done {
            let _ = reply.send(out);
        }
    }

    async fn sync_wal(&self, c: &mut Conn) -> Result<()> {
        self.begin(c, true, false).await?;
        let now = crate::time::now_ms().to_string();
        let set = crate::store::rows::set_meta::<Sqlite>(&mut c.conn, "synced_at", &now).await;
        match set {
            Ok(()) => self.end(c, "COMMIT").await,
            Err(e) => {
                let _ = self.end(c, "ROLLBACK").await;
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Effect, JobFn, JobOutput};
    use sqlx::Connection;
    use tokio::sync::oneshot;

    struct Nobody;
    impl CommitListener for Nobody {
        fn committed(&self, _: &[Effect]) {}
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
        let job = Job {
            durable: true,
            run,
            reply,
        };
        (job, rx)
    }

    #[tokio::test]
    async fn a_failed_job_is_undone_alone_and_the_others_of_its_batch_are_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("t.db").display());
        let mut conn = SqliteConnection::connect(&url).await.expect("open");
        sqlx::raw_sql("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            .execute(&mut conn)
            .await
            .expect("schema");
        let writer = Writer {
            conn: tokio::sync::Mutex::new(None),
            rolled_back: Arc::new(AtomicBool::new(false)),
            listener: Arc::new(Nobody),
        };
        let mut c = Conn {
            conn,
            full_sync: true,
            open: false,
        };
        let (a, a_rx) = set("a", false);
        let (b, b_rx) = set("b", true);
        let (d, d_rx) = set("d", false);
        writer.run_batch(&mut c, vec![a, b, d]).await;
        assert!(matches!(a_rx.await, Ok(Ok(_))));
        assert!(matches!(b_rx.await, Ok(Err(StoreError::Other(_)))));
        assert!(matches!(d_rx.await, Ok(Ok(_))));
        let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM meta ORDER BY key")
            .fetch_all(&mut c.conn)
            .await
            .expect("keys");
        assert_eq!(keys, ["a", "d"]);
        assert!(!c.open, "the transaction ended");
    }
}

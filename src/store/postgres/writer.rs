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

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use sqlx::{PgConnection, PgPool};

use super::map_err;
use crate::store::db::{Exec, Stmt, conn_err};
use crate::store::group::{Batches, GroupCommit, Job, fail};
use crate::store::sql_store::Writes;
use crate::store::sql_tx::SqlTx;
use crate::store::{BoxFuture, CommitListener, Effect, Result, StoreError};
use crate::time::Millis;
use sqlx::postgres::PgRow;

struct Writer {
    pool: PgPool,
    listener: Arc<dyn CommitListener>,
    notify: super::notify::Notifier,
    batch_limit: Duration,
}

pub(super) fn start(
    pool: PgPool,
    listener: Arc<dyn CommitListener>,
    notify: super::notify::Notifier,
    batch_limit: Duration,
) -> Arc<dyn Writes> {
    Arc::new(GroupCommit::new(Writer {
        pool,
        listener,
        notify,
        batch_limit,
    }))
}

// Boxed, as every future of sqlx calls that a spawned task awaits: rustc
// cannot otherwise prove it `Send` for every lifetime (rust-lang/rust#102211).
fn exec<'c>(c: &'c mut PgConnection, sql: &'static str) -> BoxFuture<'c, Result<()>> {
    Box::pin(async move {
        sqlx::Executor::execute(c, sql).await.map_err(map_err)?;
        Ok(())
    })
}

impl Batches for Writer {
    /// A connection that hangs (a half-open socket after a partition) must
    /// not hold every later write of this host: past the limit the batch is
    /// dropped, its connection closed, and its jobs answered `unavailable`.
    fn run(&self, batch: Vec<Job>) -> BoxFuture<'_, Vec<Job>> {
        Box::pin(async move {
            match tokio::time::timeout(self.batch_limit, self.run_batch(batch)).await {
                Ok(left) => left,
                Err(_) => {
                    tracing::warn!(limit = ?self.batch_limit, "a write batch did not finish in time; dropped");
                    self.listener.committed(&[Effect::Missed]);
                    Vec::new()
                }
            }
        })
    }
}

/// A connection that notes whether any statement on it failed.
struct Tracked<'c> {
    conn: &'c mut PgConnection,
    failed: bool,
}

impl Tracked<'_> {
    fn note<T>(&mut self, out: Result<T>) -> Result<T> {
        self.failed |= out.is_err();
        out
    }
}

impl Exec for Tracked<'_> {
    type Row = PgRow;

    fn fetch<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<Vec<PgRow>>> {
        Box::pin(async move {
            let out = self.conn.fetch(s).await;
            self.note(out)
        })
    }

    fn execute<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let out = self.conn.execute(s).await;
            self.note(out)
        })
    }

    fn execute_one<'a>(&'a mut self, s: Stmt<'a>, what: String) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let out = self.conn.execute_one(s, what).await;
            self.note(out)
        })
    }

    fn append_event<'a>(&'a mut self, at: Millis, body: &'a str) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            let out = self.conn.append_event(at, body).await;
            self.note(out)
        })
    }

    fn last_event_seq(&mut self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move {
            let out = self.conn.last_event_seq().await;
            self.note(out)
        })
    }

    fn locks_rows(&self) -> bool {
        true
    }
}

/// BEGIN and take the fleet's write lock; the transaction's id.
fn begin(c: &mut PgConnection) -> BoxFuture<'_, Result<i64>> {
    Box::pin(async move {
        let rows =
            sqlx::Executor::fetch_all(c, "BEGIN; SELECT txid_current() FROM event_seq FOR UPDATE")
                .await
                .map_err(map_err)?;
        let row = rows
            .first()
            .ok_or_else(|| StoreError::Other("event_seq has no row".into()))?;
        sqlx::Row::try_get::<i64, _>(row, 0).map_err(map_err)
    })
}

/// How long a lost COMMIT's outcome is looked for before the batch counts
/// as failed (its requests answered `unavailable`, as before).
const RESOLVE_FOR: Duration = Duration::from_secs(5);

impl Writer {
    /// Whether transaction `txid` committed, asked on a new connection
    /// (`txid_status`, made for a COMMIT whose answer was lost). False when
    /// it aborted or the database cannot tell in time.
    async fn committed(&self, txid: i64) -> bool {
        let deadline = tokio::time::Instant::now() + RESOLVE_FOR;
        while tokio::time::Instant::now() < deadline {
            let status: std::result::Result<Option<String>, sqlx::Error> = async {
                let mut conn = self.pool.acquire().await?;
                let fut: BoxFuture<'_, std::result::Result<Option<String>, sqlx::Error>> = Box::pin(
                    sqlx::query_scalar("SELECT txid_status($1)")
                        .bind(txid)
                        .fetch_one(&mut *conn),
                );
                fut.await
            }
            .await;
            match status.as_ref().map(Option::as_deref) {
                Ok(Some("committed")) => return true,
                Ok(Some("aborted") | None) => return false,
                // Still in progress (its backend has not seen the cut yet),
                // or the database is not back yet.
                Ok(Some(_)) | Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        tracing::warn!(
            txid,
            "cannot tell whether a COMMIT whose answer was lost committed"
        );
        false
    }

    /// Run `batch`; the jobs that did not run, to be queued again.
    async fn run_batch(&self, batch: Vec<Job>) -> Vec<Job> {
        let mut conn = match self.pool.acquire().await {
            Ok(c) => c,
            Err(e) => {
                let e = conn_err(&self.pool, e);
                fail(batch.into_iter().map(|j| j.reply), &e);
                return Vec::new();
            }
        };
        // One round trip: a simple query may hold several statements. The
        // transaction's id tells, should the COMMIT's answer be lost,
        // whether it committed.
        let txid = match begin(&mut conn).await {
            Ok(txid) => txid,
            Err(e) => {
                let _ = exec(&mut conn, "ROLLBACK").await;
                fail(batch.into_iter().map(|j| j.reply), &e);
                return Vec::new();
            }
        };
        let mut done = Vec::with_capacity(batch.len());
        let mut effects = Vec::new();
        let mut jobs = batch.into_iter();
        while let Some(job) = jobs.next() {
            let mut tracked = Tracked {
                conn: &mut conn,
                failed: false,
            };
            let mut tx = SqlTx::new(&mut tracked, None);
            let out = std::panic::AssertUnwindSafe((job.run)(&mut tx))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| Err(StoreError::Other("a store job panicked".into())));
            let job_effects = tx.effects;
            // A failed statement aborts the whole PostgreSQL transaction: a
            // job that went on and answered Ok lost its writes all the same.
            let out = match out {
                Ok(_) if tracked.failed => Err(StoreError::Other(
                    "a statement of the job failed; nothing of it is kept".into(),
                )),
                out => out,
            };
            match out {
                Ok(v) => {
                    effects.extend(job_effects);
                    done.push((job.reply, v));
                }
                // Found its idempotency key held by an earlier request, before
                // it changed anything (the claim rewrote that row as it was):
                // the batch goes on without it.
                Err(StoreError::RequestInProgress) => {
                    let _ = job.reply.send(Err(StoreError::RequestInProgress));
                }
                Err(e) => {
                    // No savepoint per job (two round trips each): the failed
                    // job's partial writes cannot be undone alone, so the
                    // batch is rolled back. Refusals are values, not errors:
                    // only a database or code failure gets here. The jobs
                    // that ran with it were not kept and may be retried; those
                    // that did not run yet go back to the queue.
                    let _ = exec(&mut conn, "ROLLBACK").await;
                    let _ = job.reply.send(Err(e));
                    fail(done.into_iter().map(|(r, _)| r), &StoreError::Busy);
                    return jobs.collect();
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
            // Closed now: the question goes on a connection of its own, and
            // a full pool must not wait for this one.
            drop(conn);
            // A COMMIT whose answer was lost may have committed: waiters
            // here look again (this host ignores its own notifications).
            self.listener.committed(&[Effect::Missed]);
            // Answered as it went: a request whose change was kept is
            // answered so, and its retry meets its own answer, not its own
            // lease as another's.
            if !self.committed(txid).await {
                fail(done.into_iter().map(|(r, _)| r), &e);
                return Vec::new();
            }
            tracing::info!(txid, "a COMMIT whose answer was lost had committed");
        }
        if !effects.is_empty() {
            self.listener.committed(&effects);
        }
        for (reply, out) in done {
            let _ = reply.send(Ok(out));
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::postgres::{PgStore, PoolSettings};
    use crate::store::{JobFn, JobOutput};
    use sqlx::Connection;
    use tokio::sync::oneshot;

    struct Nobody;
    impl CommitListener for Nobody {
        fn committed(&self, _: &[Effect]) {}
    }

    /// A store on a new database of the test PostgreSQL, or None when off,
    /// or when `HOLDFAST_TEST_POSTGRES` is unset and nothing answers at the
    /// default address (as in tests/integration/stores.rs).
    async fn store() -> Option<Writer> {
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
        let url = format!("{base}/{name}");
        let store = PgStore::connect(&url, &settings, Arc::new(Nobody))
            .await
            .expect("store");
        crate::store::Backend::close(&store).await;
        Some(Writer {
            pool: PgPool::connect(&url).await.expect("pool"),
            listener: Arc::new(Nobody),
            notify: super::super::notify::Notifier::new(),
            batch_limit: Duration::from_secs(30),
        })
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
        (
            Job {
                durable: true,
                run,
                reply,
            },
            rx,
        )
    }

    #[tokio::test]
    async fn a_failed_job_undoes_its_batch_and_the_jobs_after_it_run_again() {
        let Some(w) = store().await else {
            return;
        };
        let (before, before_rx) = set("before", false);
        let (failing, failing_rx) = set("failing", true);
        let (after, after_rx) = set("after", false);
        let requeued = w.run_batch(vec![before, failing, after]).await;
        assert!(matches!(before_rx.await, Ok(Err(StoreError::Busy))));
        assert!(matches!(failing_rx.await, Ok(Err(StoreError::Other(_)))));
        assert_eq!(requeued.len(), 1, "the job after the failure was not run");
        w.run_batch(requeued).await;
        assert!(after_rx.await.is_ok_and(|r| r.is_ok()));

        let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM meta ORDER BY key")
            .fetch_all(&w.pool)
            .await
            .expect("keys");
        assert_eq!(keys, ["after"], "nothing of the failed batch was kept");
    }
}

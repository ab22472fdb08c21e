//! The single writer: one read-write connection runs every batch of the
//! group commit (see `store::group`) in one transaction, each job of a
//! batch inside a savepoint so that a failing job does not undo the others.
//! Renewals alone are committed at `synchronous=NORMAL`; any durable job
//! makes the commit (and every earlier unsynced one in the WAL) durable.
//! Statements go through the `Pipeline`: a lone renewal is two round trips
//! to SQLite's thread (BEGIN with its read, its update with the COMMIT).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::FutureExt;
use sqlx::SqliteConnection;

use super::pipeline::{BATCH, BEGIN, Pipeline};
use prometheus_client::metrics::counter::Counter;

use crate::store::cache::Cache;
use crate::store::counters::WriteCounters;
use crate::store::group::{Batches, GroupCommit, Job, fail};
use crate::store::sql_store::Writes;
use crate::store::sql_tx::SqlTx;
use crate::store::{BoxFuture, CommitListener, JobOutput, Result, StoreError};

struct Conn {
    conn: SqliteConnection,
    /// The connection's `synchronous` level is FULL (Some(true)), NORMAL,
    /// or not known after a failure.
    full_sync: Option<bool>,
    /// A transaction of ours may be open (one that never finished).
    open: bool,
    /// The last event seq committed.
    seq: i64,
    /// What this writer wrote and read, for the next transactions.
    cache: Cache,
}

struct Writer {
    /// None once closed. Only the group commit's leader locks it.
    conn: tokio::sync::Mutex<Option<Conn>>,
    /// Set by SQLite whenever a transaction is rolled back, including the
    /// rollbacks it makes by itself on some errors (disk full, I/O).
    rolled_back: Arc<AtomicBool>,
    listener: Arc<dyn CommitListener>,
    /// Sends to SQLite's thread, each a round trip.
    round_trips: Counter,
}

pub(super) async fn start(
    mut conn: SqliteConnection,
    listener: Arc<dyn CommitListener>,
) -> Result<Arc<dyn Writes>> {
    let seq = super::last_event_seq(&mut conn).await?;
    super::hot::install(&mut conn).await?;
    let rolled_back = Arc::new(AtomicBool::new(false));
    let flag = rolled_back.clone();
    conn.lock_handle()
        .await
        .map_err(super::map_err)?
        .set_rollback_hook(move || flag.store(true, Ordering::SeqCst));
    let counters = WriteCounters::default();
    let writer = Writer {
        round_trips: counters.round_trips.clone(),
        conn: tokio::sync::Mutex::new(Some(Conn {
            conn,
            full_sync: Some(true),
            open: false,
            seq,
            cache: Cache::default(),
        })),
        rolled_back,
        listener,
    };
    Ok(Arc::new(GroupCommit::new(writer, counters)) as Arc<dyn Writes>)
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

fn sync_pragma(full: bool) -> &'static str {
    if full {
        "PRAGMA synchronous = FULL"
    } else {
        "PRAGMA synchronous = NORMAL"
    }
}

impl Batches for Writer {
    fn run(&self, batch: Vec<Job>) -> BoxFuture<'_, Vec<Job>> {
        Box::pin(async move {
            let mut guard = self.conn.lock().await;
            match guard.as_mut() {
                Some(c) => self.run_batch(c, batch).await,
                None => {
                    let e = StoreError::Unavailable("the store is closed".into());
                    fail(batch.into_iter().map(|j| j.reply), &e);
                    Vec::new()
                }
            }
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

type Reply = tokio::sync::oneshot::Sender<Result<JobOutput>>;

impl Writer {
    /// Run and answer `batch`; the jobs that did not run, to be queued again.
    async fn run_batch(&self, c: &mut Conn, batch: Vec<Job>) -> Vec<Job> {
        if c.open {
            // Left open by a batch that never finished: nothing of it was answered.
            let _ = exec(&mut c.conn, "ROLLBACK").await;
            c.open = false;
        }
        let durable = batch.iter().any(|j| j.durable);
        let single = batch.len() == 1;
        let mut p = Pipeline::new(&mut c.conn, c.seq).counted(&self.round_trips);
        p.owner = BATCH;
        if c.full_sync != Some(durable) {
            p.queue_raw(sync_pragma(durable));
        }
        p.queue_raw(BEGIN);
        // Sent with the first job's first statement; assumed until then.
        c.full_sync = None;
        c.open = true;
        self.rolled_back.store(false, Ordering::SeqCst);

        let mut done: Vec<(Reply, Result<JobOutput>)> = Vec::with_capacity(batch.len());
        let mut effects = Vec::new();
        let mut needs_sync = false;
        let mut committed = false;
        let mut jobs = batch.into_iter().enumerate().peekable();
        while let Some((k, job)) = jobs.next() {
            let before = p.begin_job(k, !single);
            let mut tx = SqlTx::new(&mut p, Some(&mut c.cache));
            // A job that panics fails alone; the writer lives on.
            let out = std::panic::AssertUnwindSafe((job.run)(&mut tx))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| Err(StoreError::Other("a store job panicked".into())));
            let (job_effects, job_durable) = (tx.effects, tx.durable);
            let last = jobs.peek().is_none();
            let mut fatal = None;
            let out = match (out, p.failed_owner.take()) {
                // A statement an earlier job queued failed in a send made for
                // this job's read: that job cannot be undone alone any more.
                (out, Some(j)) if j != k => {
                    let e = out.err().unwrap_or(StoreError::Busy);
                    fatal = Some((Some(j), e.clone()));
                    Err(e)
                }
                // Its own statement failed, and it answered Ok all the same:
                // what it queued after that statement never ran.
                (Ok(_), Some(_)) => Err(StoreError::Other(
                    "a statement of the job failed; nothing of it is kept".into(),
                )),
                // The COMMIT goes with the last job's statements (and the
                // others', still queued).
                (Ok(v), None) if last => match p.finish("COMMIT").await {
                    Ok(_) => {
                        committed = true;
                        Ok(v)
                    }
                    Err(f) if f.owner == k => Err(f.error),
                    Err(f) => {
                        let culprit = (f.owner != BATCH).then_some(f.owner);
                        fatal = Some((culprit, f.error));
                        Ok(v)
                    }
                },
                (Ok(v), None) => Ok(v),
                (Err(e), _) => Err(e),
            };
            if fatal.is_none() {
                if out.is_ok() {
                    effects.extend(job_effects);
                    needs_sync |= job_durable;
                } else {
                    // The job's writes are undone: forget what it taught the cache.
                    c.cache.clear();
                    if p.undo_to(before) {
                        // Nothing of the job reached SQLite: what was queued
                        // before it (BEGIN, earlier jobs) stays.
                        if single {
                            c.open = false;
                            let _ = job.reply.send(out);
                            return Vec::new();
                        }
                    } else if single {
                        // The job's own error is the answer, whether this
                        // works or SQLite already rolled back.
                        p.rollback().await;
                        c.open = false;
                        let _ = job.reply.send(out);
                        return Vec::new();
                    } else {
                        p.queue_raw("ROLLBACK TO job");
                        if let Err(f) = p.send().await {
                            fatal = Some((None, f.error));
                        }
                    }
                }
            }
            done.push((job.reply, out));
            // SQLite rolls the whole transaction back on some errors (disk
            // full, I/O): then nothing of this batch may be answered as done.
            if self.rolled_back.load(Ordering::SeqCst) && fatal.is_none() {
                let e =
                    StoreError::Unavailable("the transaction was rolled back by the store".into());
                fatal = Some((None, e));
            }
            if let Some((culprit, e)) = fatal {
                c.cache.clear();
                p.rollback().await;
                c.open = false;
                // A queued statement of one job failed after others had run
                // with it: that job gets its error, the others, undone with
                // it, `busy` (they may be retried), and those that did not
                // run yet go back to the queue.
                for (i, (reply, _)) in done.into_iter().enumerate() {
                    let answer = match culprit {
                        Some(j) if j != i => StoreError::Busy,
                        _ => e.clone(),
                    };
                    let _ = reply.send(Err(answer));
                }
                return jobs.map(|(_, j)| j).collect();
            }
        }
        if !committed {
            // The last job failed and was undone: commit the others.
            if let Err(f) = p.finish("COMMIT").await {
                c.cache.clear();
                p.rollback().await;
                c.open = false;
                fail(done.into_iter().map(|(r, _)| r), &f.error);
                return Vec::new();
            }
        }
        let seq = p.seq;
        c.open = false;
        c.seq = seq;
        c.full_sync = Some(durable);
        if needs_sync && !durable {
            // A non-durable batch that ended a lease: make it durable before
            // answering. The sync level cannot change inside a transaction,
            // so commit one more small one at FULL, which syncs the whole WAL.
            if let Err(e) = self.sync_wal(c).await {
                // Committed and visible, only not known to be on disk: wake
                // the waiters, but do not answer it as durable.
                self.listener.committed(&effects);
                fail(done.into_iter().map(|(r, _)| r), &e);
                return Vec::new();
            }
        }
        if !effects.is_empty() {
            self.listener.committed(&effects);
        }
        for (reply, out) in done {
            let _ = reply.send(out);
        }
        Vec::new()
    }

    async fn sync_wal(&self, c: &mut Conn) -> Result<()> {
        let mut p = Pipeline::new(&mut c.conn, c.seq).counted(&self.round_trips);
        p.queue_raw(sync_pragma(true));
        p.queue_raw(BEGIN);
        let now = crate::time::now_ms().to_string();
        crate::store::rows::set_meta(&mut p, "synced_at", &now).await?;
        match p.finish("COMMIT").await {
            Ok(_) => {
                c.full_sync = Some(true);
                Ok(())
            }
            Err(f) => {
                p.rollback().await;
                c.full_sync = None;
                Err(f.error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Effect, JobFn, Tx};
    use sqlx::Connection;
    use tokio::sync::oneshot;

    struct Nobody;
    impl CommitListener for Nobody {
        fn committed(&self, _: &[Effect]) {}
    }

    /// What a test job does: sets meta `key`, appends an event, then fails
    /// (or not) in one of these ways.
    #[derive(Clone, Copy)]
    enum Then {
        Succeed,
        /// Fails in Rust, after its statements were queued, before any was sent.
        FailUnsent,
        /// Reads (sending what it queued), then fails in Rust.
        FailSent,
        /// Queues a statement that SQLite refuses (a duplicate key), and
        /// succeeds in Rust: the refusal comes when it is sent.
        Refused,
    }

    type Answer = oneshot::Receiver<Result<JobOutput>>;

    fn job(key: &'static str, then: Then) -> (Job, Answer) {
        let (reply, rx) = oneshot::channel();
        let run: JobFn = Box::new(move |tx: &mut dyn Tx| {
            Box::pin(async move {
                tx.set_meta(key, "x").await?;
                let seq = tx.append_event(1, format!(r#"{{"key":"{key}"}}"#)).await?;
                match then {
                    Then::Succeed => {}
                    Then::FailUnsent => return Err(StoreError::Other("failed".into())),
                    Then::FailSent => {
                        tx.lease("none").await?;
                        return Err(StoreError::Other("failed".into()));
                    }
                    Then::Refused => {
                        let dup = crate::model::PortRecord {
                            id: "dup".into(),
                            host_id: "h".into(),
                            port: 1,
                            name: "n".into(),
                            owner: crate::model::PortOwner {
                                process: None,
                                lease: Some(crate::model::TokenRef {
                                    id: "l".into(),
                                    token: 1,
                                }),
                            },
                            reserved_at: 1,
                            released_at: Some(1),
                        };
                        tx.insert_port(&dup).await?;
                        tx.insert_port(&dup).await?;
                    }
                }
                Ok(Box::new(seq) as JobOutput)
            })
        });
        let job = Job {
            durable: true,
            run,
            reply,
        };
        (job, rx)
    }

    async fn writer() -> (Writer, Conn, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("t.db").display());
        let mut conn = SqliteConnection::connect(&url).await.expect("open");
        super::super::schema::migrate(&mut conn)
            .await
            .expect("schema");
        super::super::hot::install(&mut conn)
            .await
            .expect("hot writes");
        let writer = Writer {
            round_trips: Counter::default(),
            conn: tokio::sync::Mutex::new(None),
            rolled_back: Arc::new(AtomicBool::new(false)),
            listener: Arc::new(Nobody),
        };
        let c = Conn {
            conn,
            full_sync: Some(true),
            open: false,
            seq: 0,
            cache: Cache::default(),
        };
        (writer, c, dir)
    }

    async fn seq_of(rx: Answer) -> Result<i64> {
        let out = rx.await.expect("answered")?;
        Ok(*out.downcast::<i64>().expect("a seq"))
    }

    /// Meta keys and event seqs in the database.
    async fn kept(c: &mut Conn) -> (Vec<String>, Vec<i64>) {
        let keys = sqlx::query_scalar("SELECT key FROM meta ORDER BY key")
            .fetch_all(&mut c.conn)
            .await
            .expect("keys");
        let seqs = sqlx::query_scalar("SELECT seq FROM events ORDER BY seq")
            .fetch_all(&mut c.conn)
            .await
            .expect("seqs");
        (keys, seqs)
    }

    #[tokio::test]
    async fn a_job_that_fails_in_rust_is_undone_alone_and_seqs_stay_gap_free() {
        for then in [Then::FailUnsent, Then::FailSent] {
            let (w, mut c, _dir) = writer().await;
            let (a, a_rx) = job("a", Then::Succeed);
            let (b, b_rx) = job("b", then);
            let (d, d_rx) = job("d", Then::Succeed);
            w.run_batch(&mut c, vec![a, b, d]).await;
            assert_eq!(seq_of(a_rx).await.expect("a"), 1);
            assert!(seq_of(b_rx).await.is_err());
            assert_eq!(seq_of(d_rx).await.expect("d"), 2, "b's seq is taken again");
            assert_eq!(
                kept(&mut c).await,
                (vec!["a".into(), "d".into()], vec![1, 2])
            );
            assert!(!c.open, "the transaction ended");
            assert_eq!(c.seq, 2);
        }
    }

    /// A queued statement that SQLite refuses is found when it is sent,
    /// after later jobs ran on top of it: the batch is undone, its job gets
    /// the refusal, the others `busy`.
    #[tokio::test]
    async fn a_refused_statement_undoes_its_batch_and_only_its_job_gets_the_error() {
        let (w, mut c, _dir) = writer().await;
        let (a, a_rx) = job("a", Then::Succeed);
        let (b, b_rx) = job("b", Then::Refused);
        let (d, d_rx) = job("d", Then::Succeed);
        let left = w.run_batch(&mut c, vec![a, b, d]).await;
        assert!(left.is_empty());
        assert!(matches!(seq_of(a_rx).await, Err(StoreError::Busy)));
        assert!(matches!(seq_of(b_rx).await, Err(StoreError::Other(e)) if e.contains("UNIQUE")));
        assert!(matches!(seq_of(d_rx).await, Err(StoreError::Busy)));
        assert_eq!(kept(&mut c).await, (vec![], vec![]));
        assert!(!c.open);
        assert_eq!(c.seq, 0);
        let (e, e_rx) = job("e", Then::Succeed);
        w.run_batch(&mut c, vec![e]).await;
        assert_eq!(seq_of(e_rx).await.expect("e"), 1);
    }

    #[tokio::test]
    async fn a_lone_job_that_fails_keeps_nothing_and_the_next_batch_goes_on() {
        for then in [Then::FailUnsent, Then::FailSent, Then::Refused] {
            let (w, mut c, _dir) = writer().await;
            let (b, b_rx) = job("b", then);
            w.run_batch(&mut c, vec![b]).await;
            assert!(seq_of(b_rx).await.is_err());
            let (a, a_rx) = job("a", Then::Succeed);
            w.run_batch(&mut c, vec![a]).await;
            assert_eq!(seq_of(a_rx).await.expect("a"), 1);
            assert_eq!(kept(&mut c).await, (vec!["a".into()], vec![1]));
        }
    }

    #[tokio::test]
    async fn the_last_job_of_a_batch_failing_still_commits_the_others() {
        for then in [Then::FailUnsent, Then::FailSent, Then::Refused] {
            let (w, mut c, _dir) = writer().await;
            let (a, a_rx) = job("a", Then::Succeed);
            let (b, b_rx) = job("b", then);
            w.run_batch(&mut c, vec![a, b]).await;
            assert_eq!(seq_of(a_rx).await.expect("a"), 1);
            assert!(seq_of(b_rx).await.is_err());
            assert_eq!(kept(&mut c).await, (vec!["a".into()], vec![1]));
        }
    }

    fn acquire(resource: &'static str, fail: bool) -> (Job, Answer) {
        let (reply, rx) = oneshot::channel();
        let run: JobFn = Box::new(move |tx: &mut dyn Tx| {
            Box::pin(async move {
                if let Some(held) = tx.current_lease(resource).await? {
                    return Ok(Box::new(-held.token) as JobOutput);
                }
                let token = tx.next_token(resource).await?;
                let id = format!("{resource}-{token}");
                let l = crate::model::LeaseRecord {
                    token,
                    ..lease(&id, resource, crate::model::LeaseState::Active)
                };
                tx.insert_lease(&l).await?;
                if fail {
                    tx.lease("none").await?;
                    return Err(StoreError::Other("failed".into()));
                }
                Ok(Box::new(token) as JobOutput)
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
    async fn what_a_failed_job_wrote_is_not_remembered() {
        let (w, mut c, _dir) = writer().await;
        let (a, a_rx) = acquire("r", true);
        w.run_batch(&mut c, vec![a]).await;
        assert!(seq_of(a_rx).await.is_err());
        let (b, b_rx) = acquire("r", false);
        let (d, d_rx) = acquire("r", false);
        w.run_batch(&mut c, vec![b, d]).await;
        assert_eq!(
            seq_of(b_rx).await.expect("b"),
            1,
            "the failed job's lease and token are gone"
        );
        assert_eq!(
            seq_of(d_rx).await.expect("d"),
            -1,
            "the lease b took is seen as held"
        );
        let (e, e_rx) = acquire("s", false);
        w.run_batch(&mut c, vec![e]).await;
        assert_eq!(seq_of(e_rx).await.expect("e"), 1);
        let current: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM leases WHERE state IN ('reserved', 'active') ORDER BY id",
        )
        .fetch_all(&mut c.conn)
        .await
        .expect("leases");
        assert_eq!(current, ["r-1", "s-1"]);
    }

    use crate::tx::fixture::lease_record as lease;

    /// A job that writes `leases` (inserting those marked new), then reads
    /// (so that it sends) and fails, when `fail`.
    fn writes(leases: Vec<(crate::model::LeaseRecord, bool)>, fail: bool) -> (Job, Answer) {
        let (reply, rx) = oneshot::channel();
        let run: JobFn = Box::new(move |tx: &mut dyn Tx| {
            Box::pin(async move {
                for (l, new) in &leases {
                    if *new {
                        tx.insert_lease(l).await?;
                    } else {
                        tx.update_lease(l).await?;
                    }
                }
                if fail {
                    tx.process("none").await?;
                    return Err(StoreError::Other("failed".into()));
                }
                Ok(Box::new(0_i64) as JobOutput)
            })
        });
        let job = Job {
            durable: true,
            run,
            reply,
        };
        (job, rx)
    }

    async fn states(c: &mut Conn) -> Vec<(String, String, Option<i64>)> {
        sqlx::query_as("SELECT id, state, expires_at FROM leases ORDER BY id")
            .fetch_all(&mut c.conn)
            .await
            .expect("leases")
    }

    #[tokio::test]
    async fn grouped_lease_writes_keep_their_meaning_in_one_batch() {
        use crate::model::LeaseState::{Active, Released};
        let (w, mut c, _dir) = writer().await;
        let (a, a_rx) = writes(vec![(lease("l1", "r", Active), true)], false);
        w.run_batch(&mut c, vec![a]).await;
        seq_of(a_rx).await.expect("a");

        let mut renewed = lease("l1", "r", Active);
        renewed.expires_at = Some(2000);
        let mut twice = lease("l3", "q", Active);
        let inserted = twice.clone();
        twice.expires_at = Some(3000);
        // l1 renewed, then released by another job, and r taken by a third;
        // l3 inserted and updated by one job; a failing job in between.
        let (b, b_rx) = writes(vec![(renewed, false)], false);
        let (d, d_rx) = writes(vec![(lease("l1", "r", Released), false)], false);
        let (e, e_rx) = writes(vec![(lease("x", "x", Active), true)], true);
        let (f, f_rx) = writes(vec![(lease("l2", "r", Active), true)], false);
        let (g, g_rx) = writes(vec![(inserted, true), (twice, false)], false);
        w.run_batch(&mut c, vec![b, d, e, f, g]).await;
        for rx in [b_rx, d_rx, f_rx, g_rx] {
            seq_of(rx).await.expect("kept");
        }
        assert!(seq_of(e_rx).await.is_err());
        assert_eq!(
            states(&mut c).await,
            [
                ("l1".into(), "released".into(), Some(1000)),
                ("l2".into(), "active".into(), Some(1000)),
                ("l3".into(), "active".into(), Some(3000)),
            ]
        );
    }

    #[tokio::test]
    async fn a_lone_one_row_write_is_its_own_transaction_and_a_vanished_row_keeps_nothing() {
        use crate::model::LeaseState::Active;
        let (w, mut c, _dir) = writer().await;
        let (a, a_rx) = writes(vec![(lease("l1", "r", Active), true)], false);
        w.run_batch(&mut c, vec![a]).await;
        seq_of(a_rx).await.expect("inserted alone");
        let mut renewed = lease("l1", "r", Active);
        renewed.expires_at = Some(2000);
        let (b, b_rx) = writes(vec![(renewed, false)], false);
        w.run_batch(&mut c, vec![b]).await;
        seq_of(b_rx).await.expect("renewed alone");
        let (ghost, ghost_rx) = writes(vec![(lease("ghost", "g", Active), false)], false);
        w.run_batch(&mut c, vec![ghost]).await;
        assert!(seq_of(ghost_rx).await.is_err(), "updated no row: failed");
        let (d, d_rx) = writes(vec![(lease("l2", "s", Active), true)], false);
        w.run_batch(&mut c, vec![d]).await;
        seq_of(d_rx).await.expect("the next batch goes on");
        assert_eq!(
            states(&mut c).await,
            [
                ("l1".into(), "active".into(), Some(2000)),
                ("l2".into(), "active".into(), Some(1000)),
            ]
        );
        sqlx::raw_sql("BEGIN; ROLLBACK")
            .execute(&mut c.conn)
            .await
            .expect("no transaction was left open");
    }
}

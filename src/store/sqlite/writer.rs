//! The single writer: one read-write connection runs every batch of the
//! group commit (see `store::group`) in one transaction, each job of a
//! batch inside a savepoint so that a failing job does not undo the others.
//! Renewals alone are committed at `synchronous=NORMAL`; any durable job
//! makes the commit (and every earlier unsynced one in the WAL) durable.
//! Statements run on the batch's own task (see `direct`).

use std::sync::Arc;

use futures_util::FutureExt;

use super::direct::Direct;
use crate::store::cache::Cache;
use crate::store::counters::WriteCounters;
use crate::store::group::{Batches, GroupCommit, Job, fail};
use crate::store::sql_store::Writes;
use crate::store::sql_tx::SqlTx;
use crate::store::{BoxFuture, CommitListener, Effect, JobFn, JobOutput, Result, StoreError};

/// How the writer opens every transaction: it takes the write lock at once.
const BEGIN: &str = "BEGIN IMMEDIATE";

struct Conn {
    db: Direct,
    /// The connection's `synchronous` level is FULL (Some(true)), NORMAL,
    /// or not known after a failure.
    full_sync: Option<bool>,
    /// What this writer wrote and read, for the next transactions.
    cache: Cache,
}

struct Writer {
    /// None once closed. Only the group commit's leader locks it.
    conn: tokio::sync::Mutex<Option<Conn>>,
    listener: Arc<dyn CommitListener>,
}

pub(super) fn start(db: Direct, listener: Arc<dyn CommitListener>) -> Arc<dyn Writes> {
    let writer = Writer {
        conn: tokio::sync::Mutex::new(Some(Conn {
            db,
            full_sync: Some(true),
            cache: Cache::default(),
        })),
        listener,
    };
    Arc::new(GroupCommit::new(writer, WriteCounters::default())) as Arc<dyn Writes>
}

fn sync_pragma(full: bool) -> &'static str {
    if full {
        "PRAGMA synchronous = FULL"
    } else {
        "PRAGMA synchronous = NORMAL"
    }
}

impl Batches for Writer {
    const GATHERS: bool = true;

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
            // Dropping the connection closes it (and checkpoints the WAL).
            self.conn.lock().await.take();
        })
    }
}

type Reply = tokio::sync::oneshot::Sender<Result<JobOutput>>;

impl Conn {
    /// Set the connection's `synchronous` level to FULL (`full`) or
    /// NORMAL, unless it is known to be so already.
    fn sync_level(&mut self, full: bool) -> Result<()> {
        if self.full_sync != Some(full) {
            self.full_sync = None;
            self.db.batch(sync_pragma(full))?;
            self.full_sync = Some(full);
        }
        Ok(())
    }

    /// Undo the open transaction (if SQLite has not already) and what it
    /// taught the cache; `seq` is the last event seq kept.
    fn abandon(&mut self, seq: i64) {
        self.cache.clear();
        self.db.seq = seq;
        if self.db.in_transaction() {
            let _ = self.db.batch("ROLLBACK");
        }
    }
}

/// SQLite rolled the whole transaction back on an error (disk full, I/O).
fn rolled_back() -> StoreError {
    StoreError::Unavailable("the transaction was rolled back by the store".into())
}

impl Writer {
    /// Run and answer `batch`; the jobs that did not run, to be queued again.
    async fn run_batch(&self, c: &mut Conn, batch: Vec<Job>) -> Vec<Job> {
        // Left open by a batch that never finished (a panic): nothing of it
        // was answered.
        let start = c.db.seq;
        if c.db.in_transaction() {
            c.abandon(start);
        }
        let durable = batch.iter().any(|j| j.durable);
        if let Err(e) = c.sync_level(durable).and_then(|()| c.db.batch(BEGIN)) {
            fail(batch.into_iter().map(|j| j.reply), &e);
            return Vec::new();
        }
        let single = batch.len() == 1;
        let mut done: Vec<(Reply, Result<JobOutput>)> = Vec::with_capacity(batch.len());
        let mut effects = Vec::new();
        let mut needs_sync = false;
        let mut jobs = batch.into_iter();
        while let Some(job) = jobs.next() {
            match run_job(c, job.run, single).await {
                Ok(ran) => {
                    if ran.out.is_ok() {
                        effects.extend(ran.effects);
                        needs_sync |= ran.durable;
                    } else if single {
                        // The job's own error is the answer.
                        c.abandon(start);
                        let _ = job.reply.send(ran.out);
                        return Vec::new();
                    }
                    done.push((job.reply, ran.out));
                }
                Err(e) => {
                    // The transaction cannot go on: the job that met it gets
                    // the error, those that ran before it `busy` (they are
                    // undone and may be retried), and those that did not run
                    // yet go back to the queue.
                    c.abandon(start);
                    let _ = job.reply.send(Err(e));
                    fail(done.into_iter().map(|(r, _)| r), &StoreError::Busy);
                    return jobs.collect();
                }
            }
        }
        if let Err(e) = c.db.batch("COMMIT") {
            c.abandon(start);
            fail(done.into_iter().map(|(r, _)| r), &e);
            return Vec::new();
        }
        if needs_sync && !durable {
            // A non-durable batch that ended a lease: make it durable before
            // answering. The sync level cannot change inside a transaction,
            // so commit one more small one at FULL, which syncs the whole WAL.
            if let Err(e) = sync_wal(c).await {
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
}

/// What one job of a batch did.
struct Ran {
    out: Result<JobOutput>,
    effects: Vec<Effect>,
    durable: bool,
}

/// Run one job of a batch, in a savepoint of its own unless it is alone
/// (then the caller undoes a failed one): what it did, or the error that
/// ends the whole transaction.
async fn run_job(c: &mut Conn, run: JobFn, single: bool) -> Result<Ran> {
    let before = c.db.seq;
    if !single {
        c.db.batch("SAVEPOINT job")?;
    }
    let mut tx = SqlTx::new(&mut c.db, Some(&mut c.cache));
    // A job that panics fails alone; the writer lives on.
    let out = std::panic::AssertUnwindSafe(run(&mut tx))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| Err(StoreError::Other("a store job panicked".into())));
    let (effects, durable) = (tx.effects, tx.durable);
    if !c.db.in_transaction() {
        return Err(out.err().unwrap_or_else(rolled_back));
    }
    match (&out, single) {
        (Ok(_), false) => c.db.batch("RELEASE job")?,
        (Err(_), false) => {
            // The job's writes are undone: forget what it taught the cache.
            c.cache.clear();
            c.db.seq = before;
            c.db.batch("ROLLBACK TO job")?;
            c.db.batch("RELEASE job")?;
        }
        (_, true) => {}
    }
    Ok(Ran {
        out,
        effects,
        durable,
    })
}

async fn sync_wal(c: &mut Conn) -> Result<()> {
    c.sync_level(true)?;
    let now = crate::time::now_ms().to_string();
    let seq = c.db.seq;
    let done = match c.db.batch(BEGIN) {
        Ok(()) => crate::store::rows::set_meta(&mut c.db, "synced_at", &now).await,
        Err(e) => Err(e),
    };
    let done = done.and_then(|()| c.db.batch("COMMIT"));
    if done.is_err() {
        c.abandon(seq);
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::db::{Cols, Stmt};
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
                tx.append_event(1, format!(r#"{{"key":"{key}"}}"#)).await?;
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
                Ok(Box::new(0_i64) as JobOutput)
            })
        });
        let job = Job {
            durable: true,
            fresh: false,
            run,
            reply,
        };
        (job, rx)
    }

    async fn writer() -> (Writer, Conn, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.db");
        let url = format!("sqlite://{}?mode=rwc", path.display());
        let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("open");
        super::super::schema::migrate(&mut conn)
            .await
            .expect("schema");
        conn.close().await.expect("closed");
        let db = Direct::open(&path, std::time::Duration::from_secs(1), 0).expect("direct");
        let writer = Writer {
            conn: tokio::sync::Mutex::new(None),
            listener: Arc::new(Nobody),
        };
        let c = Conn {
            db,
            full_sync: Some(true),
            cache: Cache::default(),
        };
        (writer, c, dir)
    }

    fn texts(c: &mut Conn, sql: &'static str) -> Vec<String> {
        let (rows, _) = c.db.run(Stmt::new(sql)).expect("read");
        rows.iter().map(|r| r.text(0).expect("text")).collect()
    }

    async fn seq_of(rx: Answer) -> Result<i64> {
        let out = rx.await.expect("answered")?;
        Ok(*out.downcast::<i64>().expect("a seq"))
    }

    /// Meta keys, and the seq of each job's event (by its key), in the
    /// database.
    async fn kept(c: &mut Conn) -> (Vec<String>, Vec<(i64, String)>) {
        let keys = texts(c, "SELECT key FROM meta ORDER BY key");
        let (rows, _) =
            c.db.run(Stmt::new(
                "SELECT seq, body ->> '$.key' FROM events ORDER BY seq",
            ))
            .expect("seqs");
        let seqs = rows
            .iter()
            .map(|r| (r.int(0).expect("seq"), r.text(1).expect("key")))
            .collect();
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
            seq_of(a_rx).await.expect("a");
            assert!(seq_of(b_rx).await.is_err());
            seq_of(d_rx).await.expect("d");
            assert_eq!(
                kept(&mut c).await,
                (
                    vec!["a".into(), "d".into()],
                    vec![(1, "a".into()), (2, "d".into())]
                ),
                "b's seq is taken again"
            );
            assert!(!c.db.in_transaction(), "the transaction ended");
            assert_eq!(c.db.seq, 2);
        }
    }

    /// A statement that SQLite refuses fails its job there and then: the
    /// job is undone alone, the others of its batch are kept.
    #[tokio::test]
    async fn a_refused_statement_fails_its_job_alone() {
        let (w, mut c, _dir) = writer().await;
        let (a, a_rx) = job("a", Then::Succeed);
        let (b, b_rx) = job("b", Then::Refused);
        let (d, d_rx) = job("d", Then::Succeed);
        let left = w.run_batch(&mut c, vec![a, b, d]).await;
        assert!(left.is_empty());
        seq_of(a_rx).await.expect("a");
        assert!(matches!(seq_of(b_rx).await, Err(StoreError::Other(e)) if e.contains("UNIQUE")));
        seq_of(d_rx).await.expect("d");
        assert_eq!(
            kept(&mut c).await,
            (
                vec!["a".into(), "d".into()],
                vec![(1, "a".into()), (2, "d".into())]
            )
        );
        assert!(!c.db.in_transaction());
        assert_eq!(c.db.seq, 2);
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
            seq_of(a_rx).await.expect("a");
            assert_eq!(
                kept(&mut c).await,
                (vec!["a".into()], vec![(1, "a".into())])
            );
        }
    }

    #[tokio::test]
    async fn the_last_job_of_a_batch_failing_still_commits_the_others() {
        for then in [Then::FailUnsent, Then::FailSent, Then::Refused] {
            let (w, mut c, _dir) = writer().await;
            let (a, a_rx) = job("a", Then::Succeed);
            let (b, b_rx) = job("b", then);
            w.run_batch(&mut c, vec![a, b]).await;
            seq_of(a_rx).await.expect("a");
            assert!(seq_of(b_rx).await.is_err());
            assert_eq!(
                kept(&mut c).await,
                (vec!["a".into()], vec![(1, "a".into())])
            );
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
            fresh: false,
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
        let current = texts(
            &mut c,
            "SELECT id FROM leases WHERE state IN ('reserved', 'active') ORDER BY id",
        );
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
            fresh: false,
            run,
            reply,
        };
        (job, rx)
    }

    async fn states(c: &mut Conn) -> Vec<(String, String, Option<i64>)> {
        let (rows, _) =
            c.db.run(Stmt::new(
                "SELECT id, state, expires_at FROM leases ORDER BY id",
            ))
            .expect("leases");
        rows.iter()
            .map(|r| {
                let v = (r.text(0), r.text(1), r.opt_int(2));
                (v.0.expect("id"), v.1.expect("state"), v.2.expect("expiry"))
            })
            .collect()
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
        assert!(!c.db.in_transaction(), "no transaction was left open");
    }

    /// A new store file with the schema made, and a connection to it.
    async fn migrated() -> (tempfile::TempDir, sqlx::SqliteConnection) {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("t.db").display());
        let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("open");
        super::super::schema::migrate(&mut conn)
            .await
            .expect("schema");
        (dir, conn)
    }

    /// A renewal sets these columns: no index of leases may hold them, or
    /// every renewal, acquire and release writes one more page (see
    /// migrations/sqlite/0005).
    #[tokio::test]
    async fn no_index_of_leases_holds_what_a_renewal_sets() {
        let (_dir, mut conn) = migrated().await;
        let defs: Vec<String> = sqlx::query_scalar(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'leases' \
             AND sql IS NOT NULL",
        )
        .fetch_all(&mut conn)
        .await
        .expect("indexes");
        crate::store::sql::assert_no_index_holds_renewal_columns(&defs);
    }

    /// The reconciler's pass reads the current leases only, through the
    /// partial indexes that hold them, with many ended leases stored,
    /// analyzed or not: with `leases_current_expiry` gone (migration 5),
    /// its expired half goes through `leases_one_current`.
    #[tokio::test]
    async fn the_reconcilers_pass_reads_only_the_partial_indexes_of_current_leases() {
        use crate::store::sql::{CURRENT_LEASES, ENDED_LEASES};
        let (dir, mut conn) = migrated().await;
        for sql in [ENDED_LEASES, CURRENT_LEASES] {
            sqlx::query(sql).execute(&mut conn).await.expect(sql);
        }
        drop(conn);
        let db = rusqlite::Connection::open(dir.path().join("t.db")).expect("open");
        let sql = crate::store::rows::TO_RECONCILE;
        for analyzed in [false, true] {
            if analyzed {
                db.execute_batch("ANALYZE").expect("analyze");
            }
            let mut plan = db
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .expect("explain");
            let plan: Vec<String> = plan
                .query_map([6000], |r| r.get::<_, String>(3))
                .expect("plan")
                .collect::<Result<_, _>>()
                .expect("plan rows");
            let scans: Vec<&String> = plan.iter().filter(|l| l.contains("leases")).collect();
            assert!(
                scans.len() == 2
                    && scans.iter().all(|l| {
                        l.contains("INDEX leases_one_current")
                            || l.contains("INDEX leases_current_owned")
                    }),
                "analyzed {analyzed}: both halves through the partial indexes: {plan:?}"
            );
            let ids = |now: i64| {
                let mut q = db.prepare(&format!("SELECT id FROM ({sql})")).expect("q");
                let mut ids = q
                    .query_map([now], |r| r.get::<_, String>(0))
                    .expect("ids")
                    .collect::<Result<Vec<_>, _>>()
                    .expect("ids");
                ids.sort();
                ids
            };
            assert_eq!(ids(4000), ["owned"], "analyzed {analyzed}");
            assert_eq!(ids(6000), ["current", "owned"], "analyzed {analyzed}");
        }
    }
}

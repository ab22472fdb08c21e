//! Write transactions on PostgreSQL, with group commit as on SQLite: a
//! request queues its job, and a leader task runs every job queued so far in
//! one transaction and commits once. Unlike SQLite's, jobs get no savepoint
//! each: that would add two round trips to every job, and a job fails only
//! when the database or the code does (see `run_batch`).
//!
//! Every transaction locks the one row of `event_seq`. That serializes the
//! writes of the whole fleet: each job re-checks its preconditions with no
//! other writer in between (the same guarantee SQLite's single writer
//! gives), no two transactions can deadlock, and event seqs become visible
//! in the order they were taken. The cost is one fleet-wide writer at a
//! time, which group commit spreads over many requests per round trip, and
//! `pipeline` keeps to few round trips per request. Renewals of plain
//! leases do without it (one statement each, `SqlStore::renew_unowned`):
//! that is why these transactions read the leases they may change with a
//! row lock.
//!
//! The writer remembers the rows it read and wrote between its
//! transactions (a guarded `Cache`), so that a batch whose reads it answers
//! from memory sends BEGIN, the lock, the checks of what it took from
//! memory, its writes and COMMIT as one round trip. Should a check fail
//! (another host or a renewal changed the row), nothing is kept, the cache
//! is cleared, and the jobs run again on fresh reads (`StoreError::Stale`,
//! `Store::write`). Its transactions go on a connection of its own, kept
//! between batches (`Line`).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use sqlx::{Connection, PgConnection, PgPool};

use super::learned::Learned;
use super::pipeline::{Pipeline, exec};
use crate::store::cache::Cache;
use crate::store::counters::WriteCounters;
use crate::store::db::conn_err;
use crate::store::group::{Batches, GroupCommit, Job, fail};
use crate::store::sql_store::Writes;
use crate::store::sql_tx::SqlTx;
use crate::store::{BoxFuture, CommitListener, Effect, JobOutput, Result, StoreError};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::oneshot;

/// The writer's connection, kept from one batch to the next (the pool's
/// are checked by sqlx with a round trip when handed out and another when
/// given back), and its server process, which the lost-answer check waits
/// out (`settle`).
struct Line {
    conn: PgConnection,
    pid: i32,
    /// The process's `backend_start`, as text: a pid is used again.
    started: String,
    idle_since: Instant,
    /// Connected or pinged for this batch: a failure on it is not the
    /// idle cut of a connection reused unchecked.
    checked: bool,
    /// Connected for this batch: what the cache holds was read on another
    /// connection, perhaps from a server since replaced (a failover to a
    /// standby that had not all of it, where transaction ids, and so row
    /// versions, are handed out again), and is forgotten.
    opened: bool,
}

/// A line used again within this time of its last batch is not checked
/// first; one that failed is dropped, and the next batch opens another.
const IDLE_PING: Duration = Duration::from_secs(1);

struct Writer {
    pool: PgPool,
    listener: Arc<dyn CommitListener>,
    notify: super::notify::Notifier,
    batch_limit: Duration,
    round_trips: Counter,
    line: Mutex<Option<Line>>,
    cache: Mutex<Cache>,
    learned: Arc<Learned>,
    /// This server's marker key (`marker`).
    marker_key: String,
    /// Batches that began with their commit, for their markers.
    marked: std::sync::atomic::AtomicU64,
    /// The settling of a lost commit's answer (`settle`), for `run` to
    /// await before the next batch.
    settling: Mutex<Option<BoxFuture<'static, ()>>>,
    /// When a check last failed, and until when batches start from an
    /// empty cache, after two failed within `COLD_FOR`.
    cold: Mutex<Cold>,
}

/// How long after a second failed check within this time the writer
/// reads what it uses from the database, as it did before it remembered
/// anything: where other hosts change the same rows (clients spread over
/// hosts by a load balancer) and their commits' hints (`learned`) do not
/// keep its memory up to date (hosts of an older holdfast send none), a
/// failed check costs the whole batch a second run. So it is at most two
/// such runs a second. One failure alone is a hint that came late.
const COLD_FOR: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Cold {
    failed: Option<Instant>,
    until: Option<Instant>,
}

impl Cold {
    fn failed(&mut self, now: Instant) {
        if self
            .failed
            .is_some_and(|at| now.saturating_duration_since(at) < COLD_FOR)
        {
            self.until = Some(now + COLD_FOR);
        }
        self.failed = Some(now);
    }

    fn is_cold(&self, now: Instant) -> bool {
        self.until.is_some_and(|until| now < until)
    }
}

pub(super) fn start(
    pool: PgPool,
    listener: Arc<dyn CommitListener>,
    notify: super::notify::Notifier,
    batch_limit: Duration,
    learned: Arc<Learned>,
) -> Arc<dyn Writes> {
    let counters = WriteCounters::default();
    let writer = Writer::new(pool, listener, notify, batch_limit, learned);
    let writer = Writer {
        round_trips: counters.round_trips.clone(),
        ..writer
    };
    Arc::new(GroupCommit::new(writer, counters))
}

impl Batches for Writer {
    /// A connection that hangs (a half-open socket after a partition) must
    /// not hold every later write of this host: past the limit the batch is
    /// dropped, its connection closed, and its jobs answered `unavailable`.
    fn run(&self, batch: Vec<Job>) -> BoxFuture<'_, Vec<Job>> {
        Box::pin(async move {
            let left = match tokio::time::timeout(self.batch_limit, self.run_batch(batch)).await {
                Ok(left) => left,
                Err(_) => {
                    tracing::warn!(limit = ?self.batch_limit, "a write batch did not finish in time; dropped");
                    self.listener.committed(&[Effect::Missed]);
                    Vec::new()
                }
            };
            // Outside the batch's time limit: it has its own (`RESOLVE_FOR`).
            let settling = self
                .settling
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(settling) = settling {
                settling.await;
            }
            left
        })
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        let line = self.take_line();
        Box::pin(async move {
            if let Some(line) = line {
                let _ = line.conn.close().await;
            }
        })
    }
}

/// How long a lost COMMIT's outcome is looked for before its requests are
/// answered `unavailable` with their keys held: long enough for a database
/// that restarts or a connection storm to pass, and the writer does not
/// wait for it (`resolve`).
const RESOLVE_FOR: Duration = Duration::from_secs(60);
const FIRST_ASK_PAUSE: Duration = Duration::from_millis(20);
const LONGEST_ASK_PAUSE: Duration = Duration::from_secs(1);
const ASK_LIMIT: Duration = Duration::from_secs(5);

/// Ask `ask` on a connection until it answers Some, or `RESOLVE_FOR`
/// passes (None then): on an idle connection of the pool, or else on a
/// plain one of its own (without the pool's setup, `pipeline::install`,
/// each try is one connect and one statement, and does not wait for a full
/// pool).
async fn keep_asking<T, F>(pool: &PgPool, what: &str, ask: F) -> Option<T>
where
    F: for<'c> Fn(
        &'c mut PgConnection,
    ) -> BoxFuture<'c, std::result::Result<Option<T>, sqlx::Error>>,
{
    let deadline = tokio::time::Instant::now() + RESOLVE_FOR;
    let mut pause = FIRST_ASK_PAUSE;
    while tokio::time::Instant::now() < deadline {
        // A try that hangs (a half-open socket) gives way to the next.
        if let Ok(Ok(Some(answer))) =
            tokio::time::timeout(ASK_LIMIT, on_a_connection(pool, &ask)).await
        {
            return Some(answer);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(LONGEST_ASK_PAUSE);
    }
    tracing::warn!("cannot tell whether {what} committed");
    None
}

async fn on_a_connection<T, F>(
    pool: &PgPool,
    ask: &F,
) -> std::result::Result<Option<T>, sqlx::Error>
where
    F: for<'c> Fn(
        &'c mut PgConnection,
    ) -> BoxFuture<'c, std::result::Result<Option<T>, sqlx::Error>>,
{
    if let Some(mut conn) = pool.try_acquire() {
        let answer = ask(&mut conn).await;
        if answer.is_ok() {
            return answer;
        }
        // Cut with the COMMIT's, most likely: not to be handed out again.
        conn.close_on_drop();
    }
    let opts = pool.connect_options();
    let fut: BoxFuture<'_, _> = Box::pin(PgConnection::connect_with(&opts));
    let mut conn = fut.await?;
    let answer = ask(&mut conn).await;
    let _ = conn.close().await;
    answer
}

/// Whether transaction `txid` committed (`txid_status`, made for a COMMIT
/// whose answer was lost); None while it is still in progress (its backend
/// has not seen the cut yet).
fn txid_status(
    conn: &mut PgConnection,
    txid: i64,
) -> BoxFuture<'_, std::result::Result<Option<bool>, sqlx::Error>> {
    Box::pin(async move {
        let status: Option<String> = sqlx::query_scalar("SELECT txid_status($1)")
            .bind(txid)
            .fetch_one(conn)
            .await?;
        Ok(match status.as_deref() {
            Some("committed") => Some(true),
            Some("aborted") | None => Some(false),
            Some(_) => None,
        })
    })
}

/// Whether the commit that recorded `marker` under `key` did, once the
/// server process `pid` that ran it (started at `started`) is gone; None
/// while it is not. That process serves no one since its connection broke:
/// it is ended, should it still be waiting on its socket.
fn marker_status(
    conn: &mut PgConnection,
    (pid, started, key, marker): (i32, String, String, String),
) -> BoxFuture<'_, std::result::Result<Option<bool>, sqlx::Error>> {
    Box::pin(async move {
        let alive: Option<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE pid = $1 AND backend_start::text = $2",
        )
        .bind(pid)
        .bind(&started)
        .fetch_optional(&mut *conn)
        .await?;
        if alive.is_some() {
            return Ok(None);
        }
        let value: Option<String> = sqlx::query_scalar("SELECT value FROM meta WHERE key = $1")
            .bind(&key)
            .fetch_optional(conn)
            .await?;
        Ok(Some(value == Some(marker)))
    })
}

impl Writer {
    fn new(
        pool: PgPool,
        listener: Arc<dyn CommitListener>,
        notify: super::notify::Notifier,
        batch_limit: Duration,
        learned: Arc<Learned>,
    ) -> Self {
        let marker_key = format!("writer:{}", notify.instance());
        Self {
            pool,
            listener,
            notify,
            batch_limit,
            round_trips: Counter::default(),
            line: Mutex::new(None),
            cache: Mutex::new(Cache::guarded()),
            learned,
            marker_key,
            marked: std::sync::atomic::AtomicU64::new(0),
            settling: Mutex::new(None),
            cold: Mutex::default(),
        }
    }

    fn take_line(&self) -> Option<Line> {
        self.line
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// The kept line if it was used within `IDLE_PING` or answers a ping,
    /// else a new one.
    async fn line(&self) -> Result<Line> {
        if let Some(mut line) = self.take_line() {
            line.checked = line.idle_since.elapsed() >= IDLE_PING;
            if !line.checked {
                return Ok(line);
            }
            let ping: BoxFuture<'_, _> = Box::pin(line.conn.ping());
            if let Ok(Ok(())) = tokio::time::timeout(ASK_LIMIT, ping).await {
                return Ok(line);
            }
        }
        let connect: BoxFuture<'_, std::result::Result<Line, sqlx::Error>> = Box::pin(async {
            let opts = self.pool.connect_options();
            let mut conn = PgConnection::connect_with(&opts).await?;
            super::pipeline::install(&mut conn).await?;
            let (pid, started): (i32, String) = sqlx::query_as(
                "SELECT pid, backend_start::text FROM pg_stat_activity WHERE pid = pg_backend_pid()",
            )
            .fetch_one(&mut conn)
            .await?;
            // Markers of servers gone for a day (see `marker`).
            sqlx::query(
                "DELETE FROM meta WHERE key LIKE 'writer:%' \
                 AND split_part(value, ' ', 1)::bigint < $1",
            )
            .bind(crate::time::now_ms() - 86_400_000)
            .execute(&mut conn)
            .await?;
            Ok(Line {
                conn,
                pid,
                started,
                idle_since: Instant::now(),
                checked: true,
                opened: true,
            })
        });
        match tokio::time::timeout(self.batch_limit, connect).await {
            Ok(line) => line.map_err(|e| conn_err(&self.pool, e)),
            Err(_) => Err(StoreError::Unavailable(format!(
                "could not connect to PostgreSQL within {:?}",
                self.batch_limit
            ))),
        }
    }

    /// The cache, with what renewals taught since the last batch, for a
    /// new transaction. Taken out while the batch runs: a batch dropped
    /// mid-way (`run`) leaves an empty one.
    fn take_cache(&self) -> Cache {
        let mut cache = std::mem::replace(
            &mut *self.cache.lock().unwrap_or_else(PoisonError::into_inner),
            Cache::guarded(),
        );
        self.learned.teach(&mut cache);
        cache.begin();
        cache
    }

    /// A check failed: other writers change what the cache holds.
    fn cool(&self) {
        let mut cold = self.cold.lock().unwrap_or_else(PoisonError::into_inner);
        cold.failed(Instant::now());
    }

    fn cold(&self) -> bool {
        let cold = self.cold.lock().unwrap_or_else(PoisonError::into_inner);
        cold.is_cold(Instant::now())
    }

    fn keep(&self, line: Line, cache: Cache) {
        *self.line.lock().unwrap_or_else(PoisonError::into_inner) = Some(Line {
            idle_since: Instant::now(),
            opened: false,
            ..line
        });
        *self.cache.lock().unwrap_or_else(PoisonError::into_inner) = cache;
    }

    /// A value no other batch of this server records under its key
    /// (`marker_key`): the instant (for the removal of old keys), and a
    /// count.
    fn marker(&self) -> String {
        let n = self
            .marked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{} {n}", crate::time::now_ms())
    }

    /// Answer the jobs of a batch whose COMMIT (transaction `txid`) failed
    /// with `e`, once the database tells whether it committed. On a task
    /// of its own: the next batches need not wait for the answer, since
    /// they take the fleet's lock, which that transaction holds until its
    /// backend has ended it one way or the other.
    fn resolve(&self, txid: i64, e: StoreError, done: Done, effects: Vec<Effect>) {
        let (pool, listener) = (self.pool.clone(), self.listener.clone());
        tokio::spawn(async move {
            let status = keep_asking(&pool, "a COMMIT whose answer was lost", |c| {
                txid_status(c, txid)
            })
            .await;
            settled(listener.as_ref(), status, e, done, &effects);
        });
    }

    /// As `resolve`, for a commit that began the transaction, so that its
    /// id never came back: its marker tells, once its server process is
    /// gone. Waited for before the next batch (`run`, outside the batch's
    /// time limit): that one records its marker under the same key.
    fn settle(
        &self,
        line: &Line,
        marker: (String, String),
        e: StoreError,
        done: Done,
        effects: Vec<Effect>,
    ) {
        let (pool, listener) = (self.pool.clone(), self.listener.clone());
        let (pid, started) = (line.pid, line.started.clone());
        let settling = async move {
            let (key, value) = marker;
            let status = keep_asking(&pool, "a commit whose answer was lost", |c| {
                marker_status(c, (pid, started.clone(), key.clone(), value.clone()))
            })
            .await;
            // Not kept, for certain, and no other transaction of this
            // batch's is left: its jobs run again.
            let e = match status {
                Some(false) => StoreError::Stale,
                _ => e,
            };
            settled(listener.as_ref(), status, e, done, &effects);
        };
        *self.settling.lock().unwrap_or_else(PoisonError::into_inner) = Some(Box::pin(settling));
    }

    /// Run `batch`; the jobs that did not run, to be queued again.
    async fn run_batch(&self, batch: Vec<Job>) -> Vec<Job> {
        let mut line = match self.line().await {
            Ok(line) => line,
            Err(e) => {
                fail(batch.into_iter().map(|j| j.reply), &e);
                return Vec::new();
            }
        };
        let mut cache = self.take_cache();
        if line.opened || self.cold() || batch.iter().any(|j| j.fresh) {
            cache.clear();
        }
        let (left, kept) = self.run_on(&mut line, &mut cache, batch).await;
        if kept {
            self.keep(line, cache);
        }
        left
    }

    /// Run `batch` on `line` with `cache`; the jobs left to queue again,
    /// and whether the line (with no transaction open) and the cache may
    /// serve the next batch.
    async fn run_on(
        &self,
        line: &mut Line,
        cache: &mut Cache,
        batch: Vec<Job>,
    ) -> (Vec<Job>, bool) {
        let checked = line.checked;
        // BEGIN and the fleet's lock go with the first job's first read,
        // or with the commit.
        let mut pipe = Pipeline::new(&mut line.conn);
        pipe.claim_at_once = batch.iter().any(|j| j.fresh);
        let mut done = Vec::with_capacity(batch.len());
        let mut effects = Vec::new();
        let mut jobs = batch.into_iter();
        while let Some(job) = jobs.next() {
            pipe.failed = false;
            let mut tx = SqlTx::new(&mut pipe, Some(&mut *cache));
            let out = std::panic::AssertUnwindSafe((job.run)(&mut tx))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| Err(StoreError::Other("a store job panicked".into())));
            let job_effects = tx.effects;
            // A failed statement aborts the whole PostgreSQL transaction: a
            // job that went on and answered Ok lost its writes all the same.
            let out = match out {
                Ok(_) if pipe.failed => Err(StoreError::Other(
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
                    // that ran with it were not kept and run again; those
                    // that did not run yet go back to the queue.
                    cache.clear();
                    let begun = pipe.txid().is_some();
                    let rolled_back = exec(pipe.conn(), "ROLLBACK").await.is_ok();
                    if matches!(e, StoreError::Stale) {
                        self.cool();
                    }
                    // A kept line cut while it was idle (a database restart,
                    // a proxy's idle timeout): no COMMIT went out, and the job
                    // runs again on a new one.
                    let e = match e {
                        StoreError::Unavailable(_) if !checked => StoreError::Stale,
                        e => e,
                    };
                    // The transaction did not begin (its lock not taken in
                    // time, the database gone): every job fails alike, and
                    // none waits for that again.
                    let left = match begun || !pipe.failed || matches!(e, StoreError::Stale) {
                        true => jobs.collect(),
                        false => {
                            fail(jobs.map(|j| j.reply), &e);
                            Vec::new()
                        }
                    };
                    let _ = job.reply.send(Err(e));
                    fail_done(done, &StoreError::Stale);
                    return (left, rolled_back);
                }
            }
        }
        // The checks, the queued writes, the notifications (delivered to
        // the other hosts only if this commits) and COMMIT, in one round
        // trip.
        // A host alone on its database has nobody to tell.
        let hints = match self.listener.has_peers() {
            true => hints(cache),
            false => Vec::new(),
        };
        let notices = self.notify.payloads(&effects, hints);
        let marker = self.marker();
        let committed = pipe
            .commit(
                super::notify::CHANNEL,
                &notices,
                (&self.marker_key, &marker),
            )
            .await;
        let (txid, marked, lost) = (pipe.txid(), pipe.marked, pipe.lost);
        self.round_trips.inc_by(pipe.round_trips);
        let shift = match committed {
            Ok(shift) => shift,
            Err(e) => {
                cache.clear();
                // A batch that only read checked in autocommit: nothing is open.
                let rolled_back = match txid.is_some() || marked {
                    true => exec(&mut line.conn, "ROLLBACK").await.is_ok(),
                    false => true,
                };
                if matches!(e, StoreError::Stale) {
                    self.cool();
                }
                if matches!(e, StoreError::Stale) || !lost {
                    // Refused by the database: nothing was kept. Stale jobs
                    // run again at once on what the database holds.
                    fail_done(done, &e);
                    return (Vec::new(), rolled_back);
                }
                // A COMMIT whose answer was lost may have committed: waiters
                // here look again (this host ignores its own notifications).
                self.listener.committed(&[Effect::Missed]);
                // Answered as it went: a request whose change was kept is
                // answered so, and its retry meets its own answer, not its
                // own lease as another's.
                match (txid, marked) {
                    (Some(txid), false) => self.resolve(txid, e, done, effects),
                    (_, true) => {
                        let marker = (self.marker_key.clone(), marker);
                        self.settle(line, marker, e, done, effects);
                    }
                    // It only checked what it read: nothing to keep, and it
                    // runs again.
                    (None, false) => fail_done(done, &StoreError::Stale),
                }
                return (Vec::new(), false);
            }
        };
        match txid {
            Some(txid) => cache.committed(txid & 0xFFFF_FFFF),
            // Its id not read back (it cannot be, short of a bug): what it
            // wrote has no version to check against.
            None => cache.forget_unversioned(),
        }
        match shift {
            Some(shift) => {
                for e in &mut effects {
                    if let Effect::Event(seq) = e {
                        *seq += shift;
                    }
                }
            }
            // The seqs are not known: every reader looks again.
            None => {
                effects.retain(|e| !matches!(e, Effect::Event(_)));
                effects.push(Effect::Missed);
            }
        }
        answer(self.listener.as_ref(), done, &effects);
        (Vec::new(), true)
    }
}

/// What the batch leaves on the resources it touched, for the other hosts.
fn hints(cache: &Cache) -> Vec<super::learned::Hint> {
    let hints = cache.hints().into_iter();
    hints
        .map(|(r, last, free)| super::learned::Hint(r, last, free))
        .collect()
}

/// Answer the jobs of a batch whose commit's answer was lost, by `status`:
/// Some(whether it committed), or None when the database could not tell.
fn settled(
    listener: &dyn CommitListener,
    status: Option<bool>,
    e: StoreError,
    done: Done,
    effects: &[Effect],
) {
    match status {
        Some(true) => {
            tracing::info!("a commit whose answer was lost had committed");
            answer(listener, done, effects);
        }
        Some(false) => {
            tracing::warn!(error = %e, "a commit whose answer was lost had not committed");
            fail_done(done, &e);
        }
        None => fail_done(done, &StoreError::OutcomeUnknown(e.to_string())),
    }
}

/// The jobs of a batch that ran, with what each answers.
type Done = Vec<(oneshot::Sender<Result<JobOutput>>, JobOutput)>;

/// Answer every job of a batch that was not kept with `e`.
fn fail_done(done: Done, e: &StoreError) {
    fail(done.into_iter().map(|(r, _)| r), e);
}

/// Announce a committed batch's `effects` and answer its jobs.
fn answer(listener: &dyn CommitListener, done: Done, effects: &[Effect]) {
    if !effects.is_empty() {
        listener.committed(effects);
    }
    for (reply, out) in done {
        let _ = reply.send(Ok(out));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::model::LeaseState;
    use crate::store::{JobFn, JobOutput, Result};
    use crate::tx::fixture::lease_record;
    use sqlx::Connection;
    use tokio::sync::oneshot;

    #[test]
    fn one_failed_check_is_forgiven_and_a_second_within_a_second_goes_cold() {
        let t0 = Instant::now();
        let mut c = Cold::default();
        c.failed(t0);
        assert!(!c.is_cold(t0), "one failure: a hint that came late");
        c.failed(t0 + COLD_FOR);
        assert!(!c.is_cold(t0 + COLD_FOR), "a second apart: still forgiven");
        let again = t0 + COLD_FOR + Duration::from_millis(300);
        c.failed(again);
        assert!(c.is_cold(again) && c.is_cold(again + Duration::from_millis(999)));
        assert!(!c.is_cold(again + COLD_FOR));
    }

    use super::super::scratch::Nobody;

    /// A writer on a new database of the test PostgreSQL, or None when off
    /// (`scratch::database`).
    async fn store() -> Option<Writer> {
        let url = super::super::scratch::database().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .after_connect(|c, _| super::super::pipeline::install(c))
            .connect(&url)
            .await
            .expect("pool");
        Some(Writer::new(
            pool,
            Arc::new(Nobody),
            super::super::notify::Notifier::new(),
            Duration::from_secs(30),
            Arc::default(),
        ))
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
                fresh: false,
                run,
                reply,
            },
            rx,
        )
    }

    /// A job of `f`, and where its answer arrives.
    fn job<F>(f: F) -> (Job, oneshot::Receiver<Result<JobOutput>>)
    where
        F: for<'t> FnOnce(&'t mut dyn crate::store::Tx) -> BoxFuture<'t, Result<()>>
            + Send
            + 'static,
    {
        let (reply, rx) = oneshot::channel();
        let run: JobFn = Box::new(move |tx| {
            Box::pin(async move { f(tx).await.map(|()| Box::new(()) as JobOutput) })
        });
        let job = Job {
            durable: true,
            fresh: false,
            run,
            reply,
        };
        (job, rx)
    }

    /// Acquire `resource` for lease `id` as the lease script does: none
    /// current, the next token, the insert and its event.
    fn acquire(id: &'static str, resource: &'static str, token: i64) -> (Job, Rx) {
        job(move |tx| {
            Box::pin(async move {
                assert_eq!(tx.current_lease(resource).await?, None, "{id}: free");
                assert_eq!(tx.next_token(resource).await?, token);
                let mut rec = lease_record(id, resource, LeaseState::Active);
                rec.token = token;
                tx.insert_lease(&rec).await?;
                tx.append_event(1, format!(r#"{{"acquired":"{id}"}}"#))
                    .await?;
                Ok(())
            })
        })
    }

    fn release(id: &'static str) -> (Job, Rx) {
        job(move |tx| {
            Box::pin(async move {
                let mut rec = tx.lease(id).await?.expect("the lease");
                assert_eq!(rec.state, LeaseState::Active, "{id} read as written");
                rec.state = LeaseState::Released;
                rec.ended_at = Some(2);
                tx.update_lease(&rec).await?;
                tx.append_event(2, format!(r#"{{"released":"{id}"}}"#))
                    .await?;
                Ok(())
            })
        })
    }

    type Rx = oneshot::Receiver<Result<JobOutput>>;

    async fn answered(rxs: Vec<Rx>) {
        let mut outs = Vec::new();
        for rx in rxs {
            outs.push(rx.await.map(|o| o.map(|_| ())));
        }
        assert!(
            outs.iter().all(|o| matches!(o, Ok(Ok(())))),
            "every job succeeded: {outs:?}"
        );
    }

    /// The queued writes (see `pipeline`): jobs of one batch read what the
    /// jobs before them wrote though it was not sent yet, a statement the
    /// queue could change sends it first, and the queue's rows land in an
    /// order the one-current-lease index accepts.
    #[tokio::test]
    async fn jobs_of_one_batch_see_the_queued_writes_of_the_jobs_before_them() {
        let Some(w) = store().await else {
            return;
        };
        let (mut jobs, mut rxs) = (Vec::new(), Vec::new());
        let steps = [
            acquire("a", "r", 1),
            release("a"),
            // An ended lease is read from the database (the cache keeps
            // current ones): its queued update goes out first.
            job(|tx| {
                Box::pin(async move {
                    let a = tx.lease("a").await?.map(|l| l.state);
                    assert_eq!(a, Some(LeaseState::Released));
                    Ok(())
                })
            }),
            acquire("b", "r", 2),
            // Not queued: the queue goes out before it.
            set("between", false),
            release("b"),
            acquire("c", "r", 3),
            job(|tx| {
                Box::pin(async move {
                    assert_eq!(tx.current_lease("r").await?.map(|l| l.id), Some("c".into()));
                    Ok(())
                })
            }),
        ];
        for (j, rx) in steps {
            jobs.push(j);
            rxs.push(rx);
        }
        let left = w.run_batch(jobs).await.len();
        answered(rxs).await;
        assert_eq!(left, 0);
        // The next batch starts from the database: c is current, and its
        // end and d's start land in one send.
        let (end_c, c_rx) = release("c");
        let (start_d, d_rx) = acquire("d", "r", 4);
        assert!(w.run_batch(vec![end_c, start_d]).await.is_empty());
        answered(vec![c_rx, d_rx]).await;

        let states: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT id, state, token FROM leases WHERE resource = 'r' ORDER BY id")
                .fetch_all(&w.pool)
                .await
                .expect("leases");
        let released = |id: &str, token| (id.to_owned(), "released".to_owned(), token);
        assert_eq!(
            states,
            [
                released("a", 1),
                released("b", 2),
                released("c", 3),
                ("d".into(), "active".into(), 4)
            ]
        );
        // Whatever the values hold, the commit's literals carry them as they are.
        let odd = "it's $hf$ \\ \"q\" $$ \u{e9}";
        let (holder, holder_rx) = job(move |tx| {
            Box::pin(async move {
                let mut rec = lease_record("odd", "r2", LeaseState::Active);
                rec.holder = odd.into();
                tx.insert_lease(&rec).await?;
                tx.append_event(3, serde_json::json!({ "holder": odd }).to_string())
                    .await?;
                Ok(())
            })
        });
        assert!(w.run_batch(vec![holder]).await.is_empty());
        answered(vec![holder_rx]).await;
        let stored: String = sqlx::query_scalar("SELECT holder FROM leases WHERE id = 'odd'")
            .fetch_one(&w.pool)
            .await
            .expect("holder");
        assert_eq!(stored, odd);
        let body: String = sqlx::query_scalar("SELECT body FROM events WHERE seq = 8")
            .fetch_one(&w.pool)
            .await
            .expect("event");
        assert_eq!(body, serde_json::json!({ "holder": odd }).to_string());

        // A batch that reads a free resource learns its last token with it
        // (`rows::CURRENT_LOCKED`) and counts on from there.
        let (end_d, d_rx) = release("d");
        assert!(w.run_batch(vec![end_d]).await.is_empty());
        w.cache.lock().expect("cache").clear();
        let (start_e, e_rx) = acquire("e", "r", 5);
        let before = w.round_trips.get();
        assert!(w.run_batch(vec![start_e]).await.is_empty());
        // BEGIN with the read of the resource, and the commit with the
        // writes.
        assert_eq!(
            w.round_trips.get() - before,
            2,
            "no round trip for the token"
        );
        answered(vec![d_rx, e_rx]).await;
        // What that batch read and wrote, the next ones know: BEGIN, the
        // checks, the writes and COMMIT go as one.
        for (i, step) in [release("e"), acquire("f", "r", 6)].into_iter().enumerate() {
            let (job, rx) = step;
            let before = w.round_trips.get();
            assert!(w.run_batch(vec![job]).await.is_empty());
            answered(vec![rx]).await;
            assert_eq!(w.round_trips.get() - before, 1, "step {i}");
        }
        let (end_f, f_rx) = release("f");
        assert!(w.run_batch(vec![end_f]).await.is_empty());
        answered(vec![f_rx]).await;

        let token: i64 =
            sqlx::query_scalar("SELECT last_token FROM resources WHERE resource = 'r'")
                .fetch_one(&w.pool)
                .await
                .expect("token");
        assert_eq!(token, 6);
        let seqs: Vec<i64> = sqlx::query_scalar("SELECT seq FROM events ORDER BY seq")
            .fetch_all(&w.pool)
            .await
            .expect("events");
        assert_eq!(
            seqs,
            (1..=13).collect::<Vec<_>>(),
            "one per lease change, in order"
        );
        let last: i64 = sqlx::query_scalar("SELECT seq FROM event_seq")
            .fetch_one(&w.pool)
            .await
            .expect("event_seq");
        assert_eq!(last, 13);
    }

    #[tokio::test]
    async fn a_queued_update_of_a_lease_that_is_not_there_fails_its_batch() {
        let Some(w) = store().await else {
            return;
        };
        let (ghost, ghost_rx) = job(|tx| {
            Box::pin(async move {
                tx.update_lease(&lease_record("ghost", "r", LeaseState::Released))
                    .await
            })
        });
        let (kept, kept_rx) = set("kept", false);
        assert!(w.run_batch(vec![kept, ghost]).await.is_empty());
        assert!(matches!(kept_rx.await, Ok(Err(_))), "not kept");
        let ghost = ghost_rx.await.map(|o| o.map(|_| ()));
        assert!(
            matches!(&ghost, Ok(Err(StoreError::Other(m))) if m.contains("vanished")),
            "{ghost:?}"
        );
        let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM meta WHERE key = 'kept'")
            .fetch_one(&w.pool)
            .await
            .expect("meta");
        assert_eq!(keys, 0, "the batch was rolled back");
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
        // Not kept, to run again (`Store::write`).
        assert!(matches!(before_rx.await, Ok(Err(StoreError::Stale))));
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

    #[tokio::test]
    async fn a_batch_that_cannot_take_the_fleet_lock_fails_all_its_jobs_at_once() {
        let Some(w) = store().await else {
            return;
        };
        let opts = (*w.pool.connect_options())
            .clone()
            .options([("lock_timeout", "200ms")]);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .after_connect(|c, _| super::super::pipeline::install(c))
            .connect_with(opts)
            .await
            .expect("pool");
        let w = Writer { pool, ..w };
        let mut holder = w.pool.acquire().await.expect("connection");
        exec(&mut holder, "BEGIN; SELECT seq FROM event_seq FOR UPDATE")
            .await
            .expect("the fleet lock");
        let (a, a_rx) = acquire("a", "r", 1);
        let (b, b_rx) = acquire("b", "s", 1);
        let left = w.run_batch(vec![a, b]).await;
        // BEGIN goes with the first job's read: the second job must not be
        // queued again, to wait out the lock once more.
        assert!(left.is_empty(), "{} jobs queued again", left.len());
        for rx in [a_rx, b_rx] {
            let out = rx.await.map(|o| o.map(|_| ()));
            assert!(matches!(out, Ok(Err(StoreError::Busy))), "{out:?}");
        }
        exec(&mut holder, "ROLLBACK").await.expect("unlock");
        let (a, a_rx) = acquire("a", "r", 1);
        assert!(w.run_batch(vec![a]).await.is_empty());
        answered(vec![a_rx]).await;
    }

    /// The writer's server process, once it waits on a lock.
    async fn waiting_writer(pool: &PgPool) -> i32 {
        for _ in 0..500 {
            let pid: Option<i32> = sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock'",
            )
            .fetch_optional(pool)
            .await
            .expect("activity");
            if let Some(pid) = pid {
                return pid;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the writer never waited on the lock");
    }

    /// A commit that begins its transaction (the writer knew every row it
    /// read) has no id to ask about: cut while it waits for the fleet's
    /// lock, it is found not kept (its marker is not there once its server
    /// process is gone), and its jobs are answered to run again.
    #[tokio::test]
    async fn a_one_round_trip_commit_cut_on_its_way_is_found_not_kept_and_runs_again() {
        let Some(w) = store().await else {
            return;
        };
        let (a, a_rx) = acquire("a", "r", 1);
        assert!(w.run_batch(vec![a]).await.is_empty());
        answered(vec![a_rx]).await;
        let mut holder = w.pool.acquire().await.expect("connection");
        exec(&mut holder, "BEGIN; SELECT seq FROM event_seq FOR UPDATE")
            .await
            .expect("the fleet lock");
        let w = Arc::new(w);
        let (end_a, end_rx) = release("a");
        let running = tokio::spawn({
            let w = w.clone();
            async move { w.run(vec![end_a]).await.len() }
        });
        let pid = waiting_writer(&w.pool).await;
        sqlx::query("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .execute(&w.pool)
            .await
            .expect("cut");
        exec(&mut holder, "ROLLBACK").await.expect("unlock");
        assert_eq!(running.await.expect("batch"), 0);
        let out = end_rx.await.map(|o| o.map(|_| ()));
        assert!(matches!(out, Ok(Err(StoreError::Stale))), "{out:?}");
        let state: String = sqlx::query_scalar("SELECT state FROM leases WHERE id = 'a'")
            .fetch_one(&w.pool)
            .await
            .expect("lease");
        assert_eq!(state, "active", "nothing of it was kept");
        // The next batch opens a new connection and goes on.
        let (end_a, end_rx) = release("a");
        assert!(w.run_batch(vec![end_a]).await.is_empty());
        answered(vec![end_rx]).await;
    }

    /// The marker tells only once the process that ran the commit is gone,
    /// which it ends if it is still there.
    #[tokio::test]
    async fn a_marker_answers_once_the_commits_process_is_gone() {
        let Some(w) = store().await else {
            return;
        };
        sqlx::query("INSERT INTO meta (key, value) VALUES ('writer:x', '1 7')")
            .execute(&w.pool)
            .await
            .expect("marker");
        let mut other = PgConnection::connect_with(&w.pool.connect_options())
            .await
            .expect("connection");
        let (pid, started): (i32, String) = sqlx::query_as(
            "SELECT pid, backend_start::text FROM pg_stat_activity WHERE pid = pg_backend_pid()",
        )
        .fetch_one(&mut other)
        .await
        .expect("its process");
        let mut conn = w.pool.acquire().await.expect("connection");
        let ask = |value: &str| {
            (
                pid,
                started.clone(),
                "writer:x".to_owned(),
                value.to_owned(),
            )
        };
        assert_eq!(
            marker_status(&mut conn, ask("1 7")).await.expect("asked"),
            None
        );
        for _ in 0..500 {
            if marker_status(&mut conn, ask("1 7")).await.expect("asked") == Some(true) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            marker_status(&mut conn, ask("1 7")).await.expect("asked"),
            Some(true)
        );
        assert_eq!(
            marker_status(&mut conn, ask("1 8")).await.expect("asked"),
            Some(false)
        );
        assert!(other.ping().await.is_err(), "the process was ended");
    }
}

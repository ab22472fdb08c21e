//! Renewals of plain leases, grouped (see `Backend::renew_unowned`): those
//! that arrive while a statement is out go together in the next, one call
//! of a function in autocommit (see `FUNCTION`), so that under load
//! many share one round trip and one commit. One statement is out at a
//! time: with up to four out at once (each on a connection of its own, the
//! WAL flushes of coinciding commits merged by PostgreSQL), 8 clients
//! renewed 28% less per second than with one (bench, churn then renew, C=8:
//! 1,558 against 2,176 per second; C=1 and C=64 alike; medians of 3 runs):
//! each statement costs the database a commit's work, which two cores
//! cannot afford to spend on small groups.
//! None of it takes the fleet lock: the statement re-checks in its `WHERE`
//! all a plain renewal relies on, write transactions lock the leases they
//! read (`Exec::locks_rows`), and the statement skips those (see `FUNCTION`).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::oneshot;

use super::learned::Learned;
use super::map_err;
use crate::model::LeaseRecord;
use crate::store::counters::WriteCounters;
use crate::store::db::Cols;
use crate::store::db::conn_err;
use crate::store::rows::lease_row;
use crate::store::sql::lease_cols;
use crate::store::sql_store::RenewsPlain;
use crate::store::{BoxFuture, Result, StoreError};
use crate::time::Millis;

/// Renewals in one statement.
const MAX_GROUP: usize = 256;

/// The renewals' connection, used again within this time of its last
/// statement, is not checked first (the pool's are, at every use, by sqlx):
/// a renewal that finds it cut is sent again on a new one (`send`).
const IDLE_PING: Duration = Duration::from_secs(1);

/// What a plain renewal re-checks of the row, given its token and instant.
/// The state (that of `lease_current!`) is tested as `state || ''`, which
/// the planner cannot prove to match the predicate of the partial indexes
/// of current leases: with the plain test it took one of those
/// (`leases_current_expiry`, estimated at a row or two where a million
/// ended leases are stored) over the primary key, and each renewal read
/// every current lease's entries, live and dead, in it (`EXPLAIN` on a
/// prefilled store; renew at C=64 ran at half the empty store's rate).
/// That index is gone since (migration 5), the other partial ones remain.
macro_rules! renewable {
    ($token:literal, $now:literal) => {
        concat!(
            "token = ",
            $token,
            " AND state || '' IN ('reserved', 'active')",
            " AND owner IS NULL AND parent_id IS NULL AND (expires_at IS NULL OR expires_at > ",
            $now,
            ")"
        )
    };
}

/// Renews each lease of its arrays (ids, tokens, TTLs, null to keep the
/// lease's, instants) in turn, by its primary key, and returns those it
/// renewed. A lease whose row a write transaction holds is skipped, not
/// waited for: that transaction may wait in turn for another row this one
/// locked (a deadlock, broken only after a second, with the fleet lock
/// held meanwhile). Its renewal is then None, and the caller renews it in
/// a transaction, after that one. A temporary function, created on the
/// renewals' own connection (`Renewals::connect`), the only one to call it.
///
/// One statement per lease, because PostgreSQL keeps its plan: the
/// statement over the arrays (`UPDATE … FROM unnest($1, …)`) was planned
/// anew at every execution, its plan for a given number of ids costing far
/// less than its plan for any number: 0.22 to 0.4 ms of planning per
/// statement, most of a lone renewal's 0.85 ms (`log_min_duration_statement`,
/// bench renew after churn). Its locking read ran as a MATERIALIZED CTE:
/// as a subquery on a young table whose statistics still said it was small,
/// it had been run once per renewal of the group (40 renewals, 190 ms).
const FUNCTION: &str = concat!(
    "CREATE OR REPLACE FUNCTION pg_temp.holdfast_renew(
        ids text[], tokens bigint[], ttls bigint[], nows bigint[])
        RETURNS SETOF leases LANGUAGE plpgsql AS $fn$
    DECLARE
        l leases;
    BEGIN
        FOR i IN 1 .. coalesce(array_length(ids, 1), 0) LOOP
            UPDATE leases SET ttl_ms = COALESCE(ttls[i], ttl_ms),
                expires_at = nows[i] + COALESCE(ttls[i], ttl_ms), renewed_at = nows[i]
                WHERE id = (SELECT id FROM leases WHERE id = ids[i] FOR UPDATE SKIP LOCKED)
                AND ",
    renewable!("tokens[i]", "nows[i]"),
    "
                RETURNING * INTO l;
            IF FOUND THEN
                RETURN NEXT l;
            END IF;
        END LOOP;
    END
    $fn$"
);

/// A lone renewal (`$1`.. its lease id, token, TTL and instant): the same
/// statement as the function's, without the function's call, 10% more
/// renewals per second at C=1 (`scripts/bench-compare`, 3 runs). Column 16
/// is the statement's transaction, which is the renewed row's version
/// (`cache::Version`), for the writer's cache.
pub(super) const RENEW_ONE: &str = concat!(
    "UPDATE leases SET ttl_ms = COALESCE($3, ttl_ms), \
     expires_at = $4 + COALESCE($3, ttl_ms), renewed_at = $4 \
     WHERE id = (SELECT id FROM leases WHERE id = $1 FOR UPDATE SKIP LOCKED) AND ",
    renewable!("$2", "$4"),
    " RETURNING ",
    lease_cols!(),
    ", txid_current() % 4294967296"
);

/// A group's renewals, in autocommit: one round trip and one commit.
const RENEW: &str = concat!(
    "SELECT ",
    lease_cols!(),
    ", txid_current() % 4294967296 \
     FROM pg_temp.holdfast_renew($1::text[], $2::bigint[], $3::bigint[], $4::bigint[])"
);

struct Renewal {
    id: String,
    token: i64,
    ttl_ms: Option<i64>,
    now: Millis,
    reply: oneshot::Sender<Result<Option<LeaseRecord>>>,
}

#[derive(Default)]
struct State {
    waiting: Vec<Renewal>,
    /// A task is sending groups (one statement out at a time).
    sending: bool,
}

/// The connection of the statements, kept from one to the next, with when
/// its last one finished.
type Line = (PgConnection, Instant);

pub struct Renewals {
    pool: PgPool,
    counters: WriteCounters,
    state: Mutex<State>,
    /// A connection of its own, outside the pool, opened at the first
    /// renewal and again after a failure: a pooled one is checked by sqlx
    /// with a round trip each time it goes back to the pool, which took a
    /// fifth of a lone client's renewals per second (C=1: 1,720 against
    /// 2,146 on a kept connection, `scripts/bench-compare`, 3 runs). Locked
    /// for the whole of a send, so that `close` waits for the statement out.
    line: tokio::sync::Mutex<Option<Line>>,
    /// Where the writer's cache learns what was renewed.
    learned: Arc<Learned>,
    /// How long connecting, or checking an idle line, may take
    /// (`--database-timeout-ms`); a statement may take three times that,
    /// as a write batch may: past it, the line is dropped and the group
    /// answered `unavailable`.
    timeout: Duration,
}

impl Renewals {
    pub fn new(
        pool: PgPool,
        counters: WriteCounters,
        timeout: Duration,
        learned: Arc<Learned>,
    ) -> Arc<Self> {
        Arc::new(Self {
            pool,
            counters,
            learned,
            state: Mutex::default(),
            line: tokio::sync::Mutex::default(),
            timeout,
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `kept` if it was used within `IDLE_PING` (true: not checked) or
    /// answers a ping in time, else a new connection.
    async fn line(&self, kept: Option<Line>) -> Result<(PgConnection, bool)> {
        if let Some((mut conn, idle_since)) = kept {
            if idle_since.elapsed() < IDLE_PING {
                return Ok((conn, true));
            }
            let ping: BoxFuture<'_, _> = Box::pin(conn.ping());
            if let Ok(Ok(())) = tokio::time::timeout(self.timeout, ping).await {
                return Ok((conn, false));
            }
        }
        Ok((self.connect().await?, false))
    }

    /// A new line, with the pool's settings and this module's function (not
    /// the pool's setup, which only write transactions use), named apart
    /// from the pool's connections in `pg_stat_activity`.
    async fn connect(&self) -> Result<PgConnection> {
        let opts = self
            .pool
            .connect_options()
            .as_ref()
            .clone()
            .application_name("holdfast-renewals");
        let connect: BoxFuture<'_, _> = Box::pin(async move {
            let mut conn = PgConnection::connect_with(&opts).await?;
            sqlx::Executor::execute(&mut conn, FUNCTION).await?;
            Ok(conn)
        });
        match tokio::time::timeout(self.timeout, connect).await {
            Ok(connected) => connected.map_err(|e| conn_err(&self.pool, e)),
            Err(_) => Err(StoreError::Unavailable(format!(
                "could not connect to PostgreSQL within {:?}",
                self.timeout
            ))),
        }
    }

    /// The next group: at most one renewal per lease (a statement applies
    /// only one of two to the same row); the others are left waiting for
    /// the next. None, and no task sending, when none is left to send.
    fn next_group(&self) -> Option<Vec<Renewal>> {
        let mut s = self.state();
        let mut ids = HashSet::new();
        let (group, left): (Vec<_>, Vec<_>) = std::mem::take(&mut s.waiting)
            .into_iter()
            .partition(|r| ids.len() < MAX_GROUP && ids.insert(r.id.clone()));
        s.waiting = left;
        s.sending = !group.is_empty();
        (!group.is_empty()).then_some(group)
    }

    async fn send_groups(self: Arc<Self>) {
        while let Some(group) = self.next_group() {
            match self.send(&group).await {
                Ok(renewed) => {
                    for r in group {
                        let found = renewed.iter().find(|l| l.id == r.id).cloned();
                        let _ = r.reply.send(Ok(found));
                    }
                }
                Err(e) => {
                    for r in group {
                        let _ = r.reply.send(Err(e.clone()));
                    }
                }
            }
        }
    }

    /// One statement for `group`; the leases it renewed. A line reused
    /// unchecked that fails (cut since its last statement, or hung) gets
    /// one more try on a new one: a renewal applied twice at the same
    /// instant with the same TTL leaves the lease as once.
    async fn send(&self, group: &[Renewal]) -> Result<Vec<LeaseRecord>> {
        let mut line = self.line.lock().await;
        if self.pool.is_closed() {
            return Err(conn_err(&self.pool, sqlx::Error::PoolClosed));
        }
        let (mut conn, unchecked) = self.line(line.take()).await?;
        let rows = match self.statement(&mut conn, group).await {
            Err(StoreError::Unavailable(e)) if unchecked => {
                tracing::info!(error = %e, "the renewals' connection failed; renewing on a new one");
                conn = self.connect().await?;
                self.statement(&mut conn, group).await?
            }
            rows => rows?,
        };
        *line = Some((conn, Instant::now()));
        drop(line);
        let renewed = rows
            .iter()
            .map(|r| Ok((lease_row(r)?, r.int(16)?)))
            .collect::<Result<Vec<_>>>()?;
        if !renewed.is_empty() {
            self.counters.ran(true, renewed.len());
        }
        self.learned.renewed(renewed.iter().cloned());
        Ok(renewed.into_iter().map(|(l, _)| l).collect())
    }

    /// The statement of `group` on `conn`, in at most three times the
    /// timeout. A connection that failed is not to be kept (a statement
    /// error leaves it usable, but it is rare enough not to tell apart).
    async fn statement(
        &self,
        conn: &mut PgConnection,
        group: &[Renewal],
    ) -> Result<Vec<sqlx::postgres::PgRow>> {
        let statement = match group {
            [r] => sqlx::query(RENEW_ONE)
                .bind(r.id.as_str())
                .bind(r.token)
                .bind(r.ttl_ms)
                .bind(r.now),
            _ => sqlx::query(RENEW)
                .bind(group.iter().map(|r| r.id.as_str()).collect::<Vec<_>>())
                .bind(group.iter().map(|r| r.token).collect::<Vec<_>>())
                .bind(group.iter().map(|r| r.ttl_ms).collect::<Vec<_>>())
                .bind(group.iter().map(|r| r.now).collect::<Vec<_>>()),
        };
        // Boxed, as `pipeline::exec` says.
        let rows: BoxFuture<'_, std::result::Result<Vec<sqlx::postgres::PgRow>, sqlx::Error>> =
            Box::pin(statement.fetch_all(conn));
        let limit = self.timeout.saturating_mul(3);
        let rows = match tokio::time::timeout(limit, rows).await {
            Ok(rows) => rows.map_err(map_err)?,
            Err(_) => {
                return Err(StoreError::Unavailable(format!(
                    "a renewal statement did not finish within {limit:?}"
                )));
            }
        };
        self.counters.round_trips.inc();
        Ok(rows)
    }
}

/// The sending of groups, run on the task of the renewal that started it
/// until that renewal is answered: a lone renewal goes from its request to
/// its statement and back with no task between (PostgreSQL renew at C=1:
/// see docs/development.md). Dropped before it is done (its caller went
/// away, or was answered while others wait), it goes on in a task of its
/// own: a statement out carries others' renewals and must not be cut.
struct Sending {
    rest: Option<BoxFuture<'static, ()>>,
    renewals: Arc<Renewals>,
    /// Where the rest goes on, taken while the caller runs: the caller may
    /// be dropped where no runtime is current.
    rt: tokio::runtime::Handle,
}

impl Sending {
    fn start(renewals: &Arc<Renewals>) -> Self {
        Self {
            rest: Some(Box::pin(renewals.clone().send_groups())),
            renewals: renewals.clone(),
            rt: tokio::runtime::Handle::current(),
        }
    }

    /// Drives the sending until `answer` holds a reply or nothing is left
    /// to send. Only this sending answers renewals meanwhile, and only
    /// while it is polled, so `answer` is looked at after each poll rather
    /// than waited on: a reply sent to a receiver this task waits on would
    /// wake the task while it runs, which tokio takes for a yield and
    /// answers by waking an idle runtime thread.
    async fn until_sent(&mut self, answer: &oneshot::Receiver<Result<Option<LeaseRecord>>>) {
        std::future::poll_fn(|cx| {
            let Some(sending) = self.rest.as_mut() else {
                return std::task::Poll::Ready(());
            };
            if sending.as_mut().poll(cx).is_ready() {
                self.rest = None;
                return std::task::Poll::Ready(());
            }
            match answer.is_empty() {
                true => std::task::Poll::Pending,
                false => std::task::Poll::Ready(()),
            }
        })
        .await;
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        let Some(rest) = self.rest.take() else {
            return;
        };
        if !std::thread::panicking() {
            self.rt.spawn(rest);
            return;
        }
        // It panicked and cannot be resumed: the callers of its group get
        // `dropped`; those still waiting get a sender of their own.
        drop(rest);
        let start = {
            let mut s = self.renewals.state();
            s.sending = !s.waiting.is_empty();
            s.sending
        };
        if start {
            self.rt.spawn(self.renewals.clone().send_groups());
        }
    }
}

impl RenewsPlain for Arc<Renewals> {
    fn renew<'a>(
        &'a self,
        id: &'a str,
        token: i64,
        ttl_ms: Option<i64>,
        now: Millis,
    ) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        Box::pin(async move {
            let (reply, answer) = oneshot::channel();
            let start = {
                let mut s = self.state();
                s.waiting.push(Renewal {
                    id: id.to_owned(),
                    token,
                    ttl_ms,
                    now,
                    reply,
                });
                !std::mem::replace(&mut s.sending, true)
            };
            if start {
                let mut sending = Sending::start(self);
                sending.until_sent(&answer).await;
            }
            answer
                .await
                .map_err(|_| StoreError::Other("the renewal was dropped".into()))?
        })
    }

    /// After the pool (`SqlStore::close`), so that no renewal opens a new
    /// line once this one is closed; waits for a statement out.
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if let Some((conn, _)) = self.line.lock().await.take() {
                let closing: BoxFuture<'_, _> = Box::pin(conn.close());
                let _ = tokio::time::timeout(self.timeout, closing).await;
            }
        })
    }
}

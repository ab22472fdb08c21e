//! Renewals of plain leases, grouped (see `Backend::renew_unowned`): those
//! that arrive while a statement is out go together in the next, one
//! `UPDATE … FROM unnest(…) RETURNING` in autocommit, so that under load
//! many share one round trip and one commit. One statement is out at a
//! time: with up to four out at once (each on a connection of its own, the
//! WAL flushes of coinciding commits merged by PostgreSQL), 8 clients
//! renewed 28% less per second than with one (bench, churn then renew, C=8:
//! 1,558 against 2,176 per second; C=1 and C=64 alike; medians of 3 runs):
//! each statement costs the database a commit's work, which two cores
//! cannot afford to spend on small groups.
//! None of it takes the fleet lock: the statement re-checks in its `WHERE`
//! all a plain renewal relies on, write transactions lock the leases they
//! read (`Exec::locks_rows`), and the statement skips those (see `RENEW`).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use sqlx::PgPool;
use tokio::sync::oneshot;

use super::map_err;
use crate::model::LeaseRecord;
use crate::store::counters::WriteCounters;
use crate::store::db::conn_err;
use crate::store::rows::lease_row;
use crate::store::sql::{lease_cols, lease_current};
use crate::store::sql_store::RenewsPlain;
use crate::store::{BoxFuture, Result, StoreError};
use crate::time::Millis;

/// Renewals in one statement.
const MAX_GROUP: usize = 256;

/// What a plain renewal re-checks of the row, given its token and instant.
macro_rules! renewable {
    ($token:literal, $now:literal) => {
        concat!(
            "token = ",
            $token,
            " AND ",
            lease_current!(),
            " AND owner IS NULL AND parent_id IS NULL AND (expires_at IS NULL OR expires_at > ",
            $now,
            ")"
        )
    };
}

/// `$1`.. the renewals' lease ids, tokens, TTLs (null: keep the lease's)
/// and instants. `id = ANY($1)` lets the planner walk the primary key
/// whatever it guesses of the arrays' length. A lease whose row a write
/// transaction holds is skipped, not waited for: that transaction may wait
/// in turn for another row this statement locked (a deadlock, broken only
/// after a second, with the fleet lock held meanwhile). Its renewal is then
/// None, and the caller renews it in a transaction, after that one.
///
/// The locking read is a MATERIALIZED CTE, run once. As a subquery of the
/// `WHERE`, on a young table whose statistics still said it was small,
/// PostgreSQL ran it (a scan of the table and its row locks) once per
/// renewal of the group: 40 renewals took 190 ms (auto_explain, bench
/// renew at C=64 after churn).
const RENEW: &str = concat!(
    "WITH locked AS MATERIALIZED \
     (SELECT id FROM leases WHERE id = ANY($1::text[]) FOR UPDATE SKIP LOCKED) \
     UPDATE leases SET ttl_ms = COALESCE(r.r_ttl, ttl_ms), \
     expires_at = r.r_now + COALESCE(r.r_ttl, ttl_ms), renewed_at = r.r_now \
     FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[]) \
     AS r(r_id, r_token, r_ttl, r_now) \
     WHERE id IN (SELECT id FROM locked) AND id = r.r_id AND ",
    renewable!("r.r_token", "r.r_now"),
    " RETURNING ",
    lease_cols!()
);

/// `RENEW` for a group of one (a lone client's renewals): `$1`.. its lease
/// id, token, TTL and instant. PostgreSQL plans the array form anew at
/// every execution (its plan for one id costs far less than its plan for
/// any number), 0.22 to 0.3 ms of the 0.85 ms a lone renewal took
/// (`log_min_duration_statement`, bench renew at C=1 after churn); this
/// one's generic plan is its custom plan, kept after the fifth execution.
const RENEW_ONE: &str = concat!(
    "WITH locked AS MATERIALIZED \
     (SELECT id FROM leases WHERE id = $1 FOR UPDATE SKIP LOCKED) \
     UPDATE leases SET ttl_ms = COALESCE($3, ttl_ms), \
     expires_at = $4 + COALESCE($3, ttl_ms), renewed_at = $4 \
     WHERE id IN (SELECT id FROM locked) AND id = $1 AND ",
    renewable!("$2", "$4"),
    " RETURNING ",
    lease_cols!()
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

pub struct Renewals {
    pool: PgPool,
    counters: WriteCounters,
    state: Mutex<State>,
}

impl Renewals {
    pub fn new(pool: PgPool, counters: WriteCounters) -> Arc<Self> {
        Arc::new(Self {
            pool,
            counters,
            state: Mutex::default(),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
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

    /// One statement for `group`; the leases it renewed.
    async fn send(&self, group: &[Renewal]) -> Result<Vec<LeaseRecord>> {
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
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| conn_err(&self.pool, e))?;
        // Boxed, as `pipeline::exec` says.
        let rows: BoxFuture<'_, std::result::Result<Vec<sqlx::postgres::PgRow>, sqlx::Error>> =
            Box::pin(statement.fetch_all(&mut *conn));
        let rows = rows.await.map_err(map_err)?;
        self.counters.round_trips.inc();
        let renewed = rows.iter().map(lease_row).collect::<Result<Vec<_>>>()?;
        if !renewed.is_empty() {
            self.counters.ran(true, renewed.len());
        }
        Ok(renewed)
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
            // In a task of its own: a caller that goes away must not cancel
            // a statement that carries others' renewals.
            if start {
                tokio::spawn(self.clone().send_groups());
            }
            answer
                .await
                .map_err(|_| StoreError::Other("the renewal was dropped".into()))?
        })
    }
}

//! The `Backend` of both stores: reads on a pool of their own, which never
//! wait behind writes, and writes through the store's group commit.

use std::sync::Arc;

use sqlx::Pool;
use sqlx::pool::PoolConnection;

use super::db::{Db, Exec, conn_err};
use super::{Backend, BoxFuture, JobFn, JobOutput, Result, StoreError, rows};
use crate::model::{
    EventRow, IdempotentRequest, LeaseFilter, LeaseRecord, PortRecord, ProcessFilter, ProcessRecord,
};
use crate::time::Millis;

/// How a store runs its write transactions.
pub trait Writes: Send + Sync + 'static {
    fn write(&self, durable: bool, job: JobFn) -> BoxFuture<'_, Result<JobOutput>>;
    fn counters(&self) -> super::counters::WriteCounters;
    /// Refuse new writes, finish the queued ones, and close.
    fn close(&self) -> BoxFuture<'_, ()>;
}

/// How a store renews plain leases outside its write transactions
/// (`Backend::renew_unowned`).
pub trait RenewsPlain: Send + Sync + 'static {
    fn renew<'a>(
        &'a self,
        id: &'a str,
        token: i64,
        ttl_ms: Option<i64>,
        now: Millis,
    ) -> BoxFuture<'a, Result<Option<LeaseRecord>>>;

    /// Close what it holds open; later renewals fail.
    fn close(&self) -> BoxFuture<'_, ()>;
}

pub struct SqlStore<D: Db> {
    reads: Pool<D>,
    writes: Arc<dyn Writes>,
    renewals: Option<Arc<dyn RenewsPlain>>,
    /// This server run's id (`Backend::run_id`).
    run_id: String,
}

impl<D: Db> SqlStore<D> {
    pub fn new(reads: Pool<D>, writes: Arc<dyn Writes>, run_id: String) -> Self {
        Self {
            reads,
            writes,
            renewals: None,
            run_id,
        }
    }

    /// Renewing plain leases with `renewals`, outside the write transactions.
    pub fn with_renewals(self, renewals: Arc<dyn RenewsPlain>) -> Self {
        Self {
            renewals: Some(renewals),
            ..self
        }
    }

    async fn conn(&self) -> Result<PoolConnection<D>> {
        let pool = &self.reads;
        pool.acquire().await.map_err(|e| conn_err(pool, e))
    }
}

/// How long a server run must stay without a session on a shared database
/// before it counts as ended: a live one that lost its connections has
/// none until it reconnects (its listener tries again after 1 s).
const RUN_GONE_FOR: std::time::Duration = std::time::Duration::from_secs(2);

/// How many times a read is run again after its connection was found cut.
const READ_RETRIES: u32 = 2;

/// `$f` on a read connection of `$s`, as a boxed future. A pooled
/// connection can be cut while idle (the database restarted, an
/// administrator ended the session) after the pool last checked it: such a
/// read is run again on another connection, since reads change nothing. A
/// pool that cannot hand out a connection at all is not retried here.
macro_rules! read {
    ($s:ident, |$c:ident| $f:expr) => {
        Box::pin(async move {
            let mut retries = 0;
            loop {
                let mut conn = $s.conn().await?;
                let $c = &mut *conn;
                match $f.await {
                    Err(StoreError::Unavailable(e)) if retries < READ_RETRIES => {
                        retries += 1;
                        tracing::debug!(error = %e, "a read's connection was cut; reading again");
                        conn.close_on_drop();
                    }
                    done => return done,
                }
            }
        })
    };
}

impl<D: Db> Backend for SqlStore<D> {
    fn write(&self, durable: bool, job: JobFn) -> BoxFuture<'_, Result<JobOutput>> {
        self.writes.write(durable, job)
    }

    fn write_counters(&self) -> super::counters::WriteCounters {
        self.writes.counters()
    }

    fn get_lease<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        read!(self, |c| rows::lease(c, id))
    }

    fn renew_unowned<'a>(
        &'a self,
        id: &'a str,
        token: i64,
        ttl_ms: Option<i64>,
        now: Millis,
    ) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        // SQLite has none: its renewals go in its group commit, unsynced.
        match &self.renewals {
            Some(r) => r.renew(id, token, ttl_ms, now),
            None => Box::pin(async { Ok(None) }),
        }
    }

    fn list_leases<'a>(
        &'a self,
        filter: &'a LeaseFilter,
    ) -> BoxFuture<'a, Result<Vec<LeaseRecord>>> {
        read!(self, |c| rows::list_leases(c, filter))
    }

    fn leases_to_reconcile(&self, now: Millis) -> BoxFuture<'_, Result<Vec<LeaseRecord>>> {
        read!(self, |c| rows::leases_to_reconcile(c, now))
    }

    fn count_current_leases(&self) -> BoxFuture<'_, Result<i64>> {
        read!(self, |c| rows::count_current_leases(c))
    }

    fn get_process<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<ProcessRecord>>> {
        read!(self, |c| rows::process(c, id))
    }

    fn list_processes<'a>(
        &'a self,
        filter: &'a ProcessFilter,
    ) -> BoxFuture<'a, Result<Vec<ProcessRecord>>> {
        read!(self, |c| rows::list_processes(c, filter))
    }

    fn current_processes<'a>(
        &'a self,
        host_id: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ProcessRecord>>> {
        read!(self, |c| rows::current_processes(c, host_id))
    }

    fn count_current_processes(&self) -> BoxFuture<'_, Result<i64>> {
        read!(self, |c| rows::count_current_processes(c))
    }

    fn owner_ports<'a>(
        &'a self,
        owner_ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<PortRecord>>> {
        read!(self, |c| rows::ports_of_owners(c, owner_ids))
    }

    fn list_ports<'a>(
        &'a self,
        host_id: Option<&'a str>,
        before_id: Option<&'a str>,
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<PortRecord>>> {
        read!(self, |c| rows::list_ports(c, host_id, before_id, limit))
    }

    fn events(&self, after: i64, limit: u32) -> BoxFuture<'_, Result<Vec<EventRow>>> {
        read!(self, |c| rows::events(c, after, limit))
    }

    fn idempotent_request<'a>(
        &'a self,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<IdempotentRequest>>> {
        read!(self, |c| rows::idempotent_request(c, key))
    }

    fn last_event_seq(&self) -> BoxFuture<'_, Result<i64>> {
        read!(self, |c| c.last_event_seq())
    }

    fn pruned_through(&self) -> BoxFuture<'_, Result<i64>> {
        read!(self, |c| rows::pruned_through(c))
    }

    fn kind(&self) -> &'static str {
        D::KIND
    }

    fn settle_key<'a>(
        &'a self,
        key: &'a str,
        request_id: &'a str,
        answer: Option<(u16, &'a str, &'a str)>,
        durable: bool,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            if !D::KEYS_SETTLED_ALONE {
                return Ok(false);
            }
            let mut conn = self.conn().await?;
            let c = &mut *conn;
            let counters = self.writes.counters();
            counters.round_trips.inc();
            rows::settle_key(c, key, request_id, answer, durable).await?;
            counters.ran(durable, 1);
            Ok(true)
        })
    }

    fn run_id(&self) -> &str {
        &self.run_id
    }

    fn run_alive<'a>(&'a self, run_id: &'a str) -> BoxFuture<'a, Result<bool>> {
        if run_id == self.run_id || !D::SHARED {
            let mine = run_id == self.run_id;
            return Box::pin(async move { Ok(mine) });
        }
        Box::pin(async move {
            for look in 0..2 {
                if look > 0 {
                    tokio::time::sleep(RUN_GONE_FOR).await;
                }
                let connected: Result<bool> = read!(self, |c| rows::run_connected(c, run_id)).await;
                if connected? {
                    return Ok(true);
                }
            }
            Ok(false)
        })
    }

    fn relaxed_renewals(&self) -> bool {
        D::RELAXED_RENEWALS
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.writes.close().await;
            self.reads.close().await;
            if let Some(r) = &self.renewals {
                r.close().await;
            }
        })
    }
}

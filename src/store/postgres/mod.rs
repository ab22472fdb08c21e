//! The shared PostgreSQL store: one database for a fleet of hosts, each
//! running its own holdfast. Writes are serialized fleet-wide and grouped
//! per host (see `writer`); reads use the pool directly and never wait
//! behind writes; commits on other hosts arrive through `notify`.

mod notify;
mod rows;
mod rows_process;
mod schema;
mod writer;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

use super::{Backend, BoxFuture, CommitListener, JobFn, JobOutput, Result, StoreError};
use crate::model::{EventRow, LeaseFilter, LeaseRecord, PortRecord, ProcessFilter, ProcessRecord};
use crate::time::Millis;
use writer::Writer;

pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::PoolTimedOut => StoreError::Busy,
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(e.to_string()),
        sqlx::Error::Database(db) => match db.code().as_deref().unwrap_or("") {
            // Serialization failure, deadlock, lock timeout, statement cancelled.
            "40001" | "40P01" | "55P03" | "57014" => StoreError::Busy,
            // Read-only transaction (a standby), a session ended for idling
            // in a transaction; connection, authorization, missing database,
            // resource and system (I/O) classes; shutdown.
            c if c == "25006"
                || c == "25P03"
                || ["08", "28", "3D", "53", "57P", "58"]
                    .iter()
                    .any(|class| c.starts_with(class)) =>
            {
                StoreError::Unavailable(e.to_string())
            }
            _ => StoreError::Other(e.to_string()),
        },
        _ => StoreError::Other(e.to_string()),
    }
}

/// For a failure to get a connection from `pool`: the database cannot be
/// reached, unless every connection is merely in use. (sqlx answers a
/// refused connect it kept retrying with the same timeout as a full pool.)
pub(crate) fn map_conn_err(pool: &PgPool, e: sqlx::Error) -> StoreError {
    match e {
        sqlx::Error::PoolTimedOut if pool.size() >= pool.options().get_max_connections() => {
            StoreError::Busy
        }
        e => StoreError::Unavailable(format!("cannot reach the database: {e}")),
    }
}

/// How the server uses its database connections.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub max_connections: u32,
    /// For connecting, for a free connection, and for the fleet-wide write
    /// lock; past it a request answers `busy`.
    pub timeout: Duration,
}

pub struct PgStore {
    pool: PgPool,
    writer: Arc<Writer>,
}

/// `postgres://host:port/db`, without user or password, for messages.
fn describe(opts: &PgConnectOptions) -> String {
    format!(
        "postgres://{}:{}/{}",
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or("")
    )
}

impl PgStore {
    /// Connect, migrate, and start listening for the other hosts' commits.
    pub async fn connect(
        url: &str,
        settings: &PoolSettings,
        listener: Arc<dyn CommitListener>,
    ) -> Result<Self> {
        let timeout_ms = settings.timeout.as_millis();
        let opts = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::Unavailable(format!("the database URL is not valid: {e}")))?
            .application_name("holdfast")
            .options([
                ("lock_timeout", format!("{timeout_ms}ms")),
                // A host frozen inside a transaction holds the fleet's write
                // lock; the server ends its session rather than wait forever.
                (
                    "idle_in_transaction_session_timeout",
                    format!("{}ms", timeout_ms.saturating_mul(2)),
                ),
            ]);
        let place = describe(&opts);
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections.max(2))
            .acquire_timeout(settings.timeout)
            .connect_with(opts)
            .await
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot reach PostgreSQL at {place}: {e}"))
            })?;
        schema::migrate(&pool).await?;
        let notifier = notify::Notifier::new();
        notifier.spawn_listener(url.to_owned(), pool.clone(), listener.clone());
        let writer = Writer::new(
            pool.clone(),
            listener,
            notifier,
            settings.timeout.saturating_mul(3),
        );
        tracing::info!(database = %place, "using PostgreSQL");
        Ok(Self { pool, writer })
    }

    async fn conn(&self) -> Result<PoolConnection<Postgres>> {
        let pool = &self.pool;
        pool.acquire().await.map_err(|e| map_conn_err(pool, e))
    }
}

impl Backend for PgStore {
    fn write(&self, _durable: bool, job: JobFn) -> BoxFuture<'_, Result<JobOutput>> {
        Box::pin(self.writer.write(job))
    }

    fn get_lease<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        Box::pin(async move { rows::lease(&mut *self.conn().await?, id).await })
    }

    fn list_leases<'a>(
        &'a self,
        filter: &'a LeaseFilter,
    ) -> BoxFuture<'a, Result<Vec<LeaseRecord>>> {
        Box::pin(async move { rows::list_leases(&mut *self.conn().await?, filter).await })
    }

    fn leases_to_reconcile(&self, now: Millis) -> BoxFuture<'_, Result<Vec<LeaseRecord>>> {
        Box::pin(async move { rows::leases_to_reconcile(&mut *self.conn().await?, now).await })
    }

    fn count_current_leases(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move { rows::count_current_leases(&mut *self.conn().await?).await })
    }

    fn get_process<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<ProcessRecord>>> {
        Box::pin(async move { rows_process::process(&mut *self.conn().await?, id).await })
    }

    fn list_processes<'a>(
        &'a self,
        filter: &'a ProcessFilter,
    ) -> BoxFuture<'a, Result<Vec<ProcessRecord>>> {
        Box::pin(
            async move { rows_process::list_processes(&mut *self.conn().await?, filter).await },
        )
    }

    fn current_processes<'a>(
        &'a self,
        host_id: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ProcessRecord>>> {
        Box::pin(
            async move { rows_process::current_processes(&mut *self.conn().await?, host_id).await },
        )
    }

    fn count_current_processes(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(
            async move { rows_process::count_current_processes(&mut *self.conn().await?).await },
        )
    }

    fn owner_ports<'a>(
        &'a self,
        owner_ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<PortRecord>>> {
        Box::pin(
            async move { rows_process::ports_of_owners(&mut *self.conn().await?, owner_ids).await },
        )
    }

    fn list_ports<'a>(
        &'a self,
        host_id: Option<&'a str>,
        after_port: u16,
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<PortRecord>>> {
        Box::pin(async move {
            rows_process::list_ports(&mut *self.conn().await?, host_id, after_port, limit).await
        })
    }

    fn events(&self, after: i64, limit: u32) -> BoxFuture<'_, Result<Vec<EventRow>>> {
        Box::pin(async move { rows::events(&mut *self.conn().await?, after, limit).await })
    }

    fn last_event_seq(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move { rows::last_event_seq(&mut *self.conn().await?).await })
    }

    fn pruned_through(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move { rows::pruned_through(&mut *self.conn().await?).await })
    }

    /// A write through the fleet-wide lock, so a host that cannot take it
    /// (another host stuck holding it, the database read-only) is not ready.
    fn check_writable(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let job: JobFn = Box::new(|_tx| Box::pin(async { Ok(Box::new(()) as JobOutput) }));
            self.writer.write(job).await.map(|_| ())
        })
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn relaxed_renewals(&self) -> bool {
        // Other hosts judge expiry from the table: a renewal is written first.
        false
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.pool.close())
    }
}

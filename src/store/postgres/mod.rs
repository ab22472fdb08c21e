//! The shared PostgreSQL store: one database for a fleet of hosts, each
//! running its own holdfast. Writes are serialized fleet-wide and grouped
//! per host (see `writer`); reads use the pool directly and never wait
//! behind writes; commits on other hosts arrive through `notify`.

mod announce;
mod learned;
mod literal;
mod notify;
mod pipeline;
#[cfg(test)]
mod plans;
mod renewals;
mod schema;
#[cfg(test)]
mod scratch;
mod writer;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{Column, PgConnection, Postgres, Row, TypeInfo};

use super::db::{Cols, Db, Exec, Stmt, query, scalar, vanished};
use super::sql_store::SqlStore;
use super::{BoxFuture, CommitListener, Result, StoreError};
use crate::time::Millis;

pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::PoolTimedOut => StoreError::Busy,
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => StoreError::Unavailable(e.to_string()),
        sqlx::Error::Database(db) => match db.code().as_deref().unwrap_or("") {
            // A check of the writer's cache failed (`pipeline::FUNCTION`).
            "HF001" => StoreError::Stale,
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

/// How the server uses its database connections.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub max_connections: u32,
    /// For connecting, for a free connection, and for the fleet-wide write
    /// lock; past it a request answers `busy`.
    pub timeout: Duration,
}

pub type PgStore = SqlStore<Postgres>;

/// `postgres://host:port/db`, without user or password, for messages.
fn describe(opts: &PgConnectOptions) -> String {
    format!(
        "postgres://{}:{}/{}",
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or("")
    )
}

impl Cols for PgRow {
    fn opt_text(&self, i: usize) -> Result<Option<String>> {
        self.try_get(i).map_err(map_err)
    }

    /// The schema has INTEGER columns (ports, exit statuses) besides BIGINT
    /// ones, and PostgreSQL decodes each only as its own width.
    fn opt_int(&self, i: usize) -> Result<Option<i64>> {
        match self.column(i).type_info().name() {
            "INT4" => Ok(self
                .try_get::<Option<i32>, _>(i)
                .map_err(map_err)?
                .map(i64::from)),
            "INT2" => Ok(self
                .try_get::<Option<i16>, _>(i)
                .map_err(map_err)?
                .map(i64::from)),
            _ => self.try_get(i).map_err(map_err),
        }
    }

    fn flag(&self, i: usize) -> Result<bool> {
        self.try_get(i).map_err(map_err)
    }
}

impl Db for Postgres {
    const KIND: &'static str = "postgres";
    // Other hosts judge expiry from the table: a renewal is written first.
    const RELAXED_RENEWALS: bool = false;
    // The statement touches only the key's row, which the request holds
    // (its request id is in the `WHERE`): it needs no fleet lock, and a
    // transaction of its own under that lock cost the writer a second
    // batch per keyed request.
    const KEYS_SETTLED_ALONE: bool = true;
    const SHARED: bool = true;
}

impl Exec for PgConnection {
    type Row = PgRow;

    fn fetch<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<Vec<PgRow>>> {
        Box::pin(async move {
            query::<Postgres>(s.sql, s.args)
                .fetch_all(self)
                .await
                .map_err(map_err)
        })
    }

    fn execute<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.changed(s).await.map(|_| ()) })
    }

    fn execute_one<'a>(&'a mut self, s: Stmt<'a>, what: String) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { vanished(&what, self.changed(s).await?, 1) })
    }

    /// Take the next seq from the counter row (which the transaction already
    /// holds locked, see `writer`) and append the event under it.
    fn append_event<'a>(&'a mut self, at: Millis, body: &'a str) -> BoxFuture<'a, Result<i64>> {
        let s = Stmt::new(
            "WITH s AS (UPDATE event_seq SET seq = seq + 1 RETURNING seq) \
             INSERT INTO events (seq, at, body) SELECT seq, $1, $2 FROM s RETURNING seq",
        );
        Box::pin(async move {
            scalar(self, s.int(at).text(body))
                .await?
                .ok_or_else(|| StoreError::Other("no seq was returned".into()))
        })
    }

    /// Every event up to it is committed, since seqs are taken under the
    /// counter's row lock and become visible in order.
    fn last_event_seq(&mut self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move {
            Ok(scalar(self, Stmt::new("SELECT seq FROM event_seq"))
                .await?
                .unwrap_or(0))
        })
    }
}

trait Changed {
    fn changed<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<u64>>;
}

impl Changed for PgConnection {
    fn changed<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<u64>> {
        Box::pin(async move {
            let done = query::<Postgres>(s.sql, s.args)
                .execute(self)
                .await
                .map_err(map_err)?;
            Ok(done.rows_affected())
        })
    }
}

impl SqlStore<Postgres> {
    /// Connect, migrate, and start listening for the other hosts' commits.
    pub async fn connect(
        url: &str,
        settings: &PoolSettings,
        listener: Arc<dyn CommitListener>,
    ) -> Result<Self> {
        let timeout_ms = settings.timeout.as_millis();
        let notifier = notify::Notifier::new();
        // Every session of this run says which run it is: another host then
        // knows whether the run answering a keyed request is still alive.
        let opts = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::Unavailable(format!("the database URL is not valid: {e}")))?
            .application_name(&super::rows::run_application_name(notifier.instance()))
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
        let unreachable =
            |e| StoreError::Unavailable(format!("cannot reach PostgreSQL at {place}: {e}"));
        // Migrated through a pool of its own, with the same patience for a
        // database that is still starting: every connection of the server's
        // pool prepares statements on the tables (`pipeline::install`).
        let migrating = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(settings.timeout)
            .connect_with(opts.clone())
            .await
            .map_err(unreachable)?;
        let migrated = schema::migrate(&migrating).await;
        migrating.close().await;
        migrated?;
        let pool = PgPoolOptions::new()
            .after_connect(|conn, _| pipeline::install(conn))
            .max_connections(settings.max_connections.max(2))
            .acquire_timeout(settings.timeout)
            .connect_with(opts.clone())
            .await
            .map_err(unreachable)?;
        let learned = Arc::new(learned::Learned::default());
        notifier.spawn_listener(
            opts.clone(),
            pool.clone(),
            listener.clone(),
            learned.clone(),
        );
        listener.announce_with(Arc::new(announce::Announcer::start(
            pool.clone(),
            notifier.instance().to_owned(),
        )));
        let run_id = notifier.instance().to_owned();
        let writer = writer::start(
            pool.clone(),
            listener,
            notifier,
            settings.timeout.saturating_mul(3),
            learned.clone(),
        );
        tracing::info!(database = %place, "using PostgreSQL");
        let store = SqlStore::new(pool.clone(), writer, run_id);
        let renewals = renewals::Renewals::new(
            pool,
            super::Backend::write_counters(&store),
            settings.timeout,
            learned,
        );
        Ok(store.with_renewals(Arc::new(renewals)))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use sqlx::Connection;
    use sqlx::postgres::PgPoolOptions;

    use super::super::counters::WriteCounters;
    use super::super::sql_store::{SqlStore, Writes};
    use super::super::{Backend, BoxFuture, JobFn, JobOutput, Result, StoreError};

    /// Reads only.
    struct NoWrites;
    impl Writes for NoWrites {
        fn write(&self, _: bool, _: JobFn) -> BoxFuture<'_, Result<JobOutput>> {
            Box::pin(async { Err(StoreError::Other("this store reads only".into())) })
        }
        fn counters(&self) -> WriteCounters {
            WriteCounters::default()
        }
        fn close(&self) -> BoxFuture<'_, ()> {
            Box::pin(async {})
        }
    }

    /// The pool's only connection is ended by the database while idle, and
    /// handed out unchecked: the read that meets the cut runs again on a
    /// new connection instead of failing.
    #[tokio::test]
    async fn a_read_on_a_pooled_connection_cut_while_idle_is_read_again() {
        let Some(url) = super::scratch::database().await else {
            return;
        };
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect(&url)
            .await
            .expect("pool");
        let store = SqlStore::new(pool.clone(), Arc::new(NoWrites), "test".into());
        let mut conn = pool.acquire().await.expect("connection");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *conn)
            .await
            .expect("pid");
        conn.return_to_pool().await;
        let mut admin = sqlx::PgConnection::connect(&url).await.expect("admin");
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
            .bind(pid)
            .fetch_one(&mut admin)
            .await
            .expect("terminate");
        assert!(ended, "the pooled connection's server process did not end");
        assert_eq!(pool.num_idle(), 1, "the cut connection is still pooled");
        let read = store.get_lease("nothing-here").await;
        assert!(matches!(read, Ok(None)), "{read:?}");
        let now: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .expect("pid");
        assert_ne!(now, pid, "the read went to the cut connection and back");
    }
}

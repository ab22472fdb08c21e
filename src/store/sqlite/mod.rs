//! The embedded SQLite store (WAL, `synchronous=FULL`). One connection runs
//! every mutation with group commit (see `writer`); reads use a pool of
//! read-only WAL connections on blocking threads and never wait behind writes.

mod rows;
mod rows_process;
mod schema;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rusqlite::{Connection, ErrorCode, OpenFlags};
use tokio::sync::{Semaphore, oneshot};

use super::{Backend, BoxFuture, CommitListener, JobFn, JobOutput, Result, StoreError};
use crate::model::{EventRow, LeaseFilter, LeaseRecord, PortRecord, ProcessFilter, ProcessRecord};
use crate::time::Millis;
use writer::{Job, Shared};

const READERS: usize = 4;
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) fn map_err(e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => StoreError::Busy,
        Some(
            ErrorCode::ReadOnly
            | ErrorCode::SystemIoFailure
            | ErrorCode::DatabaseCorrupt
            | ErrorCode::DiskFull
            | ErrorCode::CannotOpen
            | ErrorCode::PermissionDenied
            | ErrorCode::NotADatabase,
        ) => StoreError::Unavailable(e.to_string()),
        _ => StoreError::Other(e.to_string()),
    }
}

fn open(path: &Path, flags: OpenFlags) -> Result<Connection> {
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| StoreError::Unavailable(format!("opening {}: {e}", path.display())))?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(map_err)?;
    Ok(conn)
}

/// Read-only connections, opened as needed, used on blocking threads.
struct ReadPool {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
    permits: Semaphore,
}

impl ReadPool {
    async fn with<T, F>(self: &Arc<Self>, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T> + Send + 'static,
    {
        let _permit = self.permits.acquire().await.map_err(|_| StoreError::Busy)?;
        let pool = self.clone();
        tokio::task::spawn_blocking(move || {
            let idle = pool
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            let conn = match idle {
                Some(c) => c,
                None => open(
                    &pool.path,
                    OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?,
            };
            let out = f(&conn);
            pool.idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(conn);
            out
        })
        .await
        .map_err(|e| StoreError::Other(format!("read task failed: {e}")))?
    }
}

pub struct SqliteStore {
    writer: Arc<Shared>,
    reads: Arc<ReadPool>,
}

impl SqliteStore {
    /// Open (creating if needed) and migrate the database at `path`, then
    /// start the writer. `boot_id` is this boot's: if the last run was on
    /// another boot, renewals that were never fsynced may be lost, so every
    /// current lease's expiry is first pushed out by its TTL (never earlier
    /// than promised, possibly later).
    pub fn open(
        path: &Path,
        boot_id: &str,
        now: Millis,
        listener: Arc<dyn CommitListener>,
    ) -> Result<Self> {
        let mut conn = open(path, OpenFlags::default())?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA temp_store = MEMORY;",
        )
        .map_err(map_err)?;
        schema::migrate(&mut conn)?;
        recover(&mut conn, boot_id, now)?;
        let writer = Shared::new(conn, listener);
        let reads = Arc::new(ReadPool {
            path: path.to_path_buf(),
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(READERS),
        });
        Ok(Self { writer, reads })
    }
}

fn recover(conn: &mut Connection, boot_id: &str, now: Millis) -> Result<()> {
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(map_err)?;
    if rows::meta(&tx, "boot_id")?.is_some_and(|b| b != boot_id) {
        let n = rows::extend_current_ttls(&tx, now)?;
        tracing::info!(
            leases = n,
            "host rebooted since the last run: current leases get their full TTL again"
        );
    }
    rows::set_meta(&tx, "boot_id", boot_id)?;
    tx.commit().map_err(map_err)
}

impl Backend for SqliteStore {
    fn write(&self, durable: bool, run: JobFn) -> BoxFuture<'_, Result<JobOutput>> {
        Box::pin(async move {
            let (reply, rx) = oneshot::channel();
            self.writer.submit(Job {
                durable,
                run,
                reply,
            })?;
            self.writer.lead_from_async();
            rx.await
                .map_err(|_| StoreError::Unavailable("the writer stopped".into()))?
        })
    }

    fn get_lease<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        let id = id.to_owned();
        Box::pin(self.reads.with(move |c| rows::lease(c, &id)))
    }

    fn list_leases<'a>(
        &'a self,
        filter: &'a LeaseFilter,
    ) -> BoxFuture<'a, Result<Vec<LeaseRecord>>> {
        let filter = filter.clone();
        Box::pin(self.reads.with(move |c| rows::list_leases(c, &filter)))
    }

    fn leases_to_reconcile(&self, now: Millis) -> BoxFuture<'_, Result<Vec<LeaseRecord>>> {
        Box::pin(self.reads.with(move |c| rows::leases_to_reconcile(c, now)))
    }

    fn count_current_leases(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(self.reads.with(rows::count_current_leases))
    }

    fn get_process<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<ProcessRecord>>> {
        let id = id.to_owned();
        Box::pin(self.reads.with(move |c| rows_process::process(c, &id)))
    }

    fn list_processes<'a>(
        &'a self,
        filter: &'a ProcessFilter,
    ) -> BoxFuture<'a, Result<Vec<ProcessRecord>>> {
        let filter = filter.clone();
        Box::pin(
            self.reads
                .with(move |c| rows_process::list_processes(c, &filter)),
        )
    }

    fn current_processes<'a>(
        &'a self,
        host_id: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ProcessRecord>>> {
        let host_id = host_id.to_owned();
        Box::pin(
            self.reads
                .with(move |c| rows_process::current_processes(c, &host_id)),
        )
    }

    fn count_current_processes(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(self.reads.with(rows_process::count_current_processes))
    }

    fn owner_ports<'a>(
        &'a self,
        owner_ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<PortRecord>>> {
        let owner_ids = owner_ids.to_vec();
        Box::pin(
            self.reads
                .with(move |c| rows_process::ports_of_owners(c, &owner_ids)),
        )
    }

    fn list_ports<'a>(
        &'a self,
        host_id: Option<&'a str>,
        after_port: u16,
        limit: u32,
    ) -> BoxFuture<'a, Result<Vec<PortRecord>>> {
        let host_id = host_id.map(str::to_owned);
        Box::pin(
            self.reads
                .with(move |c| rows_process::list_ports(c, host_id.as_deref(), after_port, limit)),
        )
    }

    fn events(&self, after: i64, limit: u32) -> BoxFuture<'_, Result<Vec<EventRow>>> {
        Box::pin(self.reads.with(move |c| rows::events(c, after, limit)))
    }

    fn last_event_seq(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(self.reads.with(rows::last_event_seq))
    }

    fn pruned_through(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(self.reads.with(rows::pruned_through))
    }

    fn check_writable(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let now = crate::time::now_ms().to_string();
            let job: JobFn = Box::new(move |tx| {
                Box::pin(async move {
                    tx.set_meta("probe", &now).await?;
                    Ok(Box::new(()) as JobOutput)
                })
            });
            self.write(false, job).await.map(|_| ())
        })
    }

    fn kind(&self) -> &'static str {
        "sqlite"
    }

    fn relaxed_renewals(&self) -> bool {
        true
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let writer = self.writer.clone();
            if tokio::task::spawn_blocking(move || writer.close())
                .await
                .is_err()
            {
                tracing::warn!("closing the sqlite store failed");
            }
        })
    }
}

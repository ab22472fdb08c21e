//! The embedded SQLite store (WAL, `synchronous=FULL`), through sqlx with
//! the bundled SQLite. One connection runs every mutation with group commit
//! (see `writer`), through rusqlite (see `direct`); reads use a pool of
//! read-only WAL connections and never wait behind writes.

mod direct;
mod schema;
mod writer;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection, Row, Sqlite, SqliteConnection};

use super::db::{Cols, Db, Exec, Stmt, query, scalar, vanished};
use super::sql_store::SqlStore;
use super::{BoxFuture, CommitListener, Result, StoreError};
use crate::time::Millis;

const READERS: u32 = 4;
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

pub type SqliteStore = SqlStore<Sqlite>;

/// An error SQLite answered with result `code`, by its primary code (the
/// low byte of an extended one), for sqlx's connections and the writer's.
fn by_code(code: i32, e: &dyn std::fmt::Display) -> StoreError {
    match code & 0xff {
        // BUSY, LOCKED
        5 | 6 => StoreError::Busy,
        // PERM, READONLY, IOERR, CORRUPT, FULL, CANTOPEN, NOTADB
        3 | 8 | 10 | 11 | 13 | 14 | 26 => StoreError::Unavailable(e.to_string()),
        _ => StoreError::Other(e.to_string()),
    }
}

fn map_err(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::Database(db) => {
            let code: i32 = db.code().and_then(|c| c.parse().ok()).unwrap_or(0);
            by_code(code, &e)
        }
        sqlx::Error::PoolTimedOut => StoreError::Busy,
        sqlx::Error::Io(_) | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => {
            StoreError::Unavailable(e.to_string())
        }
        _ => StoreError::Other(e.to_string()),
    }
}

impl Cols for SqliteRow {
    fn opt_text(&self, i: usize) -> Result<Option<String>> {
        self.try_get(i).map_err(map_err)
    }

    fn opt_int(&self, i: usize) -> Result<Option<i64>> {
        self.try_get(i).map_err(map_err)
    }

    fn flag(&self, i: usize) -> Result<bool> {
        self.try_get(i).map_err(map_err)
    }
}

impl Db for Sqlite {
    const KIND: &'static str = "sqlite";
    const RELAXED_RENEWALS: bool = true;
    // Its one writer's group commit is the cheapest way to the disk.
    const KEYS_SETTLED_ALONE: bool = false;
    // One server per file: the writer keeps the rows in memory.
    const SHARED: bool = false;
}

/// Run `s` now; the rows it changed.
fn changed<'a>(c: &'a mut SqliteConnection, s: Stmt<'a>) -> BoxFuture<'a, Result<u64>> {
    Box::pin(async move {
        let done = query::<Sqlite>(s.sql, s.args)
            .execute(c)
            .await
            .map_err(map_err)?;
        Ok(done.rows_affected())
    })
}

impl Exec for SqliteConnection {
    type Row = SqliteRow;

    fn fetch<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<Vec<SqliteRow>>> {
        Box::pin(async move {
            query::<Sqlite>(s.sql, s.args)
                .fetch_all(self)
                .await
                .map_err(map_err)
        })
    }

    fn execute<'a>(&'a mut self, s: Stmt<'a>) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { changed(self, s).await.map(|_| ()) })
    }

    fn execute_one<'a>(&'a mut self, s: Stmt<'a>, what: String) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { vanished(&what, changed(self, s).await?, 1) })
    }

    /// Outside the writer (which counts seqs itself, see `direct`).
    fn append_event<'a>(&'a mut self, at: Millis, body: &'a str) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            let seq = last_event_seq(self).await? + 1;
            self.execute(super::rows::insert_event(seq, at, body))
                .await?;
            Ok(seq)
        })
    }

    fn last_event_seq(&mut self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(last_event_seq(self))
    }
}

/// Kept by AUTOINCREMENT in `sqlite_sequence`, so it holds when retention
/// has removed every event (where `max(seq)` would go back).
pub(super) async fn last_event_seq<E: Exec + ?Sized>(c: &mut E) -> Result<i64> {
    let s =
        Stmt::new("SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)");
    Ok(scalar(c, s).await?.unwrap_or(0))
}

/// Create the database file, empty (SQLite's empty database), for the
/// server's user alone: SQLite makes its `-wal` and `-shm` files with the
/// same mode. A file that exists keeps its mode.
fn create_private_file(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

fn options(path: &Path) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .busy_timeout(BUSY_TIMEOUT)
        .pragma("temp_store", "MEMORY")
}

impl SqlStore<Sqlite> {
    /// Open (creating if needed) and migrate the database at `path`, then
    /// start the writer. `boot_id` is this boot's: if the last run was on
    /// another boot, renewals that were never fsynced may be lost, so every
    /// current lease's expiry is first pushed out by its TTL (never earlier
    /// than promised, possibly later).
    pub async fn open(
        path: &Path,
        boot_id: &str,
        now: Millis,
        listener: Arc<dyn CommitListener>,
    ) -> Result<Self> {
        create_private_file(path)
            .map_err(|e| StoreError::Unavailable(format!("creating {}: {e}", path.display())))?;
        let setup_opts = options(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full);
        let mut conn = SqliteConnection::connect_with(&setup_opts)
            .await
            .map_err(|e| StoreError::Unavailable(format!("opening {}: {e}", path.display())))?;
        schema::migrate(&mut conn).await?;
        recover(&mut conn, boot_id, now).await?;
        let seq = last_event_seq(&mut conn).await?;
        conn.close().await.map_err(map_err)?;
        let writer = direct::Direct::open(path, BUSY_TIMEOUT, seq)?;
        // A connection to a file cannot be cut: sqlx's check of each one
        // before use would only cost a hop to its thread and back.
        let reads = SqlitePoolOptions::new()
            .test_before_acquire(false)
            .max_connections(READERS)
            .min_connections(0)
            .acquire_timeout(BUSY_TIMEOUT)
            .connect_lazy_with(options(path).read_only(true));
        Ok(SqlStore::new(
            reads,
            writer::start(writer, listener),
            uuid::Uuid::now_v7().to_string(),
        ))
    }
}

async fn recover(conn: &mut SqliteConnection, boot_id: &str, now: Millis) -> Result<()> {
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map_err)?;
    if super::rows::meta(&mut *tx, "boot_id")
        .await?
        .is_some_and(|b| b != boot_id)
    {
        let s = Stmt::new(concat!(
            "UPDATE leases SET expires_at = max(expires_at, $1 + ttl_ms) WHERE ",
            super::sql::lease_current!(),
            " AND ttl_ms IS NOT NULL"
        ));
        let n = changed(&mut tx, s.int(now)).await?;
        tracing::info!(
            leases = n,
            "host rebooted since the last run: current leases get their full TTL again"
        );
    }
    super::rows::set_meta(&mut *tx, "boot_id", boot_id).await?;
    tx.commit().await.map_err(map_err)
}

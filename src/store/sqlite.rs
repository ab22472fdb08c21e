//! The embedded SQLite store. One writer connection runs every mutation;
//! jobs that arrive while a commit is in flight are grouped into the next
//! transaction so that they share one fsync (group commit). Reads use a
//! separate pool of read-only WAL connections and never wait behind writes.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection, QueryBuilder, Row, SqlSafeStr, Sqlite};
use tokio::sync::{mpsc, oneshot};

use super::{Backend, BoxFuture, CommitListener, Effect, JobFn, JobOutput, Result, StoreError, Tx};
use crate::model::{EventRow, LeaseFilter, LeaseRecord, LeaseState, ParentRef, StateFilter};
use crate::time::Millis;

const MAX_BATCH: usize = 256;
const QUEUE: usize = 8192;
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

const LEASE_COLS: &str = "id, resource, token, holder, state, owner, parent_id, parent_resource, \
     parent_token, ttl_ms, expires_at, acquired_at, renewed_at, ended_at, end_reason, metadata";
const CURRENT: &str = "state IN ('reserved', 'active')";

fn migrator() -> Migrator {
    let m = |version, name: &'static str, sql: &'static str| {
        Migration::new(
            version,
            name.into(),
            MigrationType::Simple,
            sql.into_sql_str(),
            false,
        )
    };
    Migrator::with_migrations(vec![m(
        1,
        "leases",
        include_str!("../../migrations/sqlite/0001_leases.sql"),
    )])
}

pub(crate) fn map_err(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::Database(db) => {
            let code = db.code().and_then(|c| c.parse::<i32>().ok()).unwrap_or(0) & 0xff;
            match code {
                // SQLITE_BUSY, SQLITE_LOCKED
                5 | 6 => StoreError::Busy,
                // SQLITE_READONLY, SQLITE_IOERR, SQLITE_CORRUPT, SQLITE_FULL, SQLITE_CANTOPEN
                8 | 10 | 11 | 13 | 14 => StoreError::Unavailable(e.to_string()),
                _ => StoreError::Other(e.to_string()),
            }
        }
        sqlx::Error::PoolTimedOut => StoreError::Busy,
        sqlx::Error::Io(_) | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => {
            StoreError::Unavailable(e.to_string())
        }
        _ => StoreError::Other(e.to_string()),
    }
}

fn decode_err(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Other(format!("stored {what} does not decode: {e}"))
}

fn lease_from_row(r: &SqliteRow) -> Result<LeaseRecord> {
    let get = |e: sqlx::Error| decode_err("lease", e);
    let state: String = r.try_get("state").map_err(get)?;
    let owner: Option<String> = r.try_get("owner").map_err(get)?;
    let parent_id: Option<String> = r.try_get("parent_id").map_err(get)?;
    let metadata: String = r.try_get("metadata").map_err(get)?;
    let parent = match parent_id {
        Some(id) => Some(ParentRef {
            id,
            resource: r
                .try_get::<Option<String>, _>("parent_resource")
                .map_err(get)?
                .unwrap_or_default(),
            token: r
                .try_get::<Option<i64>, _>("parent_token")
                .map_err(get)?
                .unwrap_or_default(),
        }),
        None => None,
    };
    Ok(LeaseRecord {
        id: r.try_get("id").map_err(get)?,
        resource: r.try_get("resource").map_err(get)?,
        token: r.try_get("token").map_err(get)?,
        holder: r.try_get("holder").map_err(get)?,
        state: LeaseState::parse(&state).ok_or_else(|| decode_err("lease state", &state))?,
        owner: owner
            .map(|o| serde_json::from_str(&o))
            .transpose()
            .map_err(|e| decode_err("owner", e))?,
        parent,
        ttl_ms: r.try_get("ttl_ms").map_err(get)?,
        expires_at: r.try_get("expires_at").map_err(get)?,
        acquired_at: r.try_get("acquired_at").map_err(get)?,
        renewed_at: r.try_get("renewed_at").map_err(get)?,
        ended_at: r.try_get("ended_at").map_err(get)?,
        end_reason: r.try_get("end_reason").map_err(get)?,
        metadata: serde_json::from_str(&metadata).map_err(|e| decode_err("metadata", e))?,
    })
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| StoreError::Other(e.to_string()))
}

struct Job {
    durable: bool,
    run: JobFn,
    reply: oneshot::Sender<Result<JobOutput>>,
}

enum Msg {
    Job(Job),
    Close(oneshot::Sender<()>),
}

pub struct SqliteStore {
    jobs: mpsc::Sender<Msg>,
    read: SqlitePool,
}

impl SqliteStore {
    /// Open (creating if needed) and migrate the database at `path`, then
    /// start the writer. `boot_id` is this boot's: if the last run was on
    /// another boot, renewals that were never fsynced may be lost, so every
    /// current lease's expiry is first pushed out by its TTL.
    pub async fn open(
        path: &Path,
        boot_id: &str,
        now: Millis,
        listener: Arc<dyn CommitListener>,
    ) -> Result<Self> {
        let base = SqliteConnectOptions::new()
            .filename(path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(BUSY_TIMEOUT)
            .pragma("temp_store", "memory");
        let mut conn = SqliteConnection::connect_with(&base.clone().create_if_missing(true))
            .await
            .map_err(map_err)?;
        migrator()
            .run(&mut conn)
            .await
            .map_err(|e| StoreError::Unavailable(format!("migrating {}: {e}", path.display())))?;
        recover(&mut conn, boot_id, now).await?;
        let read = SqlitePoolOptions::new()
            .max_connections(4)
            .min_connections(1)
            .connect_with(base.read_only(true))
            .await
            .map_err(map_err)?;
        let (jobs, rx) = mpsc::channel(QUEUE);
        tokio::spawn(writer(conn, rx, listener));
        Ok(Self { jobs, read })
    }
}

async fn recover(conn: &mut SqliteConnection, boot_id: &str, now: Millis) -> Result<()> {
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.map_err(map_err)?;
    let last: Option<String> = sqlx::query_scalar("SELECT value FROM meta WHERE key = 'boot_id'")
        .fetch_optional(&mut *tx)
        .await
        .map_err(map_err)?;
    if last.as_deref().is_some_and(|b| b != boot_id) {
        let sql = format!(
            "UPDATE leases SET expires_at = MAX(expires_at, ? + ttl_ms) \
             WHERE {CURRENT} AND ttl_ms IS NOT NULL"
        );
        let done = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        tracing::info!(
            leases = done.rows_affected(),
            "host rebooted since the last run: current leases get their full TTL again"
        );
    }
    set_meta(&mut tx, "boot_id", boot_id).await?;
    tx.commit().await.map_err(map_err)
}

async fn set_meta(conn: &mut SqliteConnection, key: &str, value: &str) -> Result<()> {
    sqlx::query(
        "INSERT INTO meta (key, value) VALUES (?, ?) \
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
    )
    .bind(key)
    .bind(value)
    .execute(conn)
    .await
    .map_err(map_err)?;
    Ok(())
}

async fn exec(conn: &mut SqliteConnection, sql: &'static str) -> Result<()> {
    sqlx::raw_sql(sql)
        .execute(conn)
        .await
        .map_err(map_err)
        .map(|_| ())
}

/// The single writer: takes every job queued so far, runs them in one
/// transaction (each inside a savepoint, so one failing job does not undo the
/// others), commits once, and only then answers them.
async fn writer(
    mut conn: SqliteConnection,
    mut rx: mpsc::Receiver<Msg>,
    listener: Arc<dyn CommitListener>,
) {
    let mut full_sync = true;
    let mut batch: Vec<Job> = Vec::with_capacity(MAX_BATCH);
    let mut closing = None;
    while closing.is_none() {
        let Some(first) = rx.recv().await else { break };
        match first {
            Msg::Job(j) => batch.push(j),
            Msg::Close(done) => {
                closing = Some(done);
                break;
            }
        }
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(Msg::Job(j)) => batch.push(j),
                Ok(Msg::Close(done)) => {
                    closing = Some(done);
                    break;
                }
                Err(_) => break,
            }
        }
        // Renewals alone need not be fsynced; any durable job makes the
        // commit (and every earlier unsynced one in the WAL) durable.
        let durable = batch.iter().any(|j| j.durable);
        if durable != full_sync {
            let sql = if durable {
                "PRAGMA synchronous = FULL"
            } else {
                "PRAGMA synchronous = NORMAL"
            };
            if exec(&mut conn, sql).await.is_ok() {
                full_sync = durable;
            }
        }
        run_batch(
            &mut conn,
            std::mem::take(&mut batch),
            &mut full_sync,
            listener.as_ref(),
        )
        .await;
    }
    if let Err(e) = conn.close().await {
        tracing::warn!(error = %e, "closing the sqlite writer connection");
    }
    if let Some(done) = closing {
        let _ = done.send(());
    }
}

async fn run_batch(
    conn: &mut SqliteConnection,
    batch: Vec<Job>,
    full_sync: &mut bool,
    listener: &dyn CommitListener,
) {
    let fail_all = |batch: Vec<Job>, e: StoreError| {
        for j in batch {
            let _ = j.reply.send(Err(e.clone()));
        }
    };
    if let Err(e) = exec(conn, "BEGIN IMMEDIATE").await {
        return fail_all(batch, e);
    }
    let single = batch.len() == 1;
    let mut needs_sync = false;
    let mut done = Vec::with_capacity(batch.len());
    let mut effects = Vec::new();
    for job in batch {
        if !single && let Err(e) = exec(conn, "SAVEPOINT job").await {
            let _ = job.reply.send(Err(e));
            continue;
        }
        let mut tx = SqliteTx {
            conn: &mut *conn,
            effects: Vec::new(),
            durable: false,
        };
        let out = (job.run)(&mut tx).await;
        let job_effects = std::mem::take(&mut tx.effects);
        needs_sync |= tx.durable && out.is_ok();
        let kept = match (&out, single) {
            (Ok(_), true) => true,
            (Ok(_), false) => exec(conn, "RELEASE job").await.is_ok(),
            (Err(_), true) => false,
            (Err(_), false) => {
                exec(conn, "ROLLBACK TO job").await.is_ok()
                    && exec(conn, "RELEASE job").await.is_ok()
            }
        };
        if out.is_ok() && kept {
            effects.extend(job_effects);
        }
        done.push((job.reply, out));
    }
    let outcome = if single && done.first().is_some_and(|(_, out)| out.is_err()) {
        exec(conn, "ROLLBACK").await
    } else if let Err(e) = exec(conn, "COMMIT").await {
        let _ = exec(conn, "ROLLBACK").await;
        Err(e)
    } else if needs_sync && !*full_sync {
        // A non-durable batch that ended a lease: make it durable before
        // answering. The sync level cannot change inside a transaction, so
        // commit one more small one at FULL, which syncs the whole WAL.
        sync_wal(conn, full_sync).await
    } else {
        Ok(())
    };
    if let Err(e) = outcome {
        for (reply, _) in done {
            let _ = reply.send(Err(e.clone()));
        }
        return;
    }
    if !effects.is_empty() {
        listener.committed(&effects);
    }
    for (reply, out) in done {
        let _ = reply.send(out);
    }
}

async fn sync_wal(conn: &mut SqliteConnection, full_sync: &mut bool) -> Result<()> {
    exec(conn, "PRAGMA synchronous = FULL").await?;
    *full_sync = true;
    exec(conn, "BEGIN IMMEDIATE").await?;
    let now = crate::time::now_ms().to_string();
    if let Err(e) = set_meta(conn, "synced_at", &now).await {
        let _ = exec(conn, "ROLLBACK").await;
        return Err(e);
    }
    exec(conn, "COMMIT").await
}

struct SqliteTx<'c> {
    conn: &'c mut SqliteConnection,
    effects: Vec<Effect>,
    durable: bool,
}

impl Tx for SqliteTx<'_> {
    fn lease<'a>(&'a mut self, id: &'a str) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        Box::pin(async move {
            let sql = format!("SELECT {LEASE_COLS} FROM leases WHERE id = ?");
            let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .fetch_optional(&mut *self.conn)
                .await
                .map_err(map_err)?;
            row.as_ref().map(lease_from_row).transpose()
        })
    }

    fn current_lease<'a>(
        &'a mut self,
        resource: &'a str,
    ) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        Box::pin(async move {
            let sql = format!("SELECT {LEASE_COLS} FROM leases WHERE resource = ? AND {CURRENT}");
            let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(resource)
                .fetch_optional(&mut *self.conn)
                .await
                .map_err(map_err)?;
            row.as_ref().map(lease_from_row).transpose()
        })
    }

    fn next_token<'a>(&'a mut self, resource: &'a str) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            sqlx::query_scalar(
                "INSERT INTO resources (resource, last_token) VALUES (?, 1) \
                 ON CONFLICT (resource) DO UPDATE SET last_token = last_token + 1 \
                 RETURNING last_token",
            )
            .bind(resource)
            .fetch_one(&mut *self.conn)
            .await
            .map_err(map_err)
        })
    }

    fn insert_lease<'a>(&'a mut self, l: &'a LeaseRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let owner = l.owner.as_ref().map(to_json).transpose()?;
            let sql = format!(
                "INSERT INTO leases ({LEASE_COLS}) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            );
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(&l.id)
                .bind(&l.resource)
                .bind(l.token)
                .bind(&l.holder)
                .bind(l.state.as_str())
                .bind(owner)
                .bind(l.parent.as_ref().map(|p| p.id.as_str()))
                .bind(l.parent.as_ref().map(|p| p.resource.as_str()))
                .bind(l.parent.as_ref().map(|p| p.token))
                .bind(l.ttl_ms)
                .bind(l.expires_at)
                .bind(l.acquired_at)
                .bind(l.renewed_at)
                .bind(l.ended_at)
                .bind(&l.end_reason)
                .bind(to_json(&l.metadata)?)
                .execute(&mut *self.conn)
                .await
                .map_err(map_err)?;
            Ok(())
        })
    }

    fn update_lease<'a>(&'a mut self, l: &'a LeaseRecord) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let owner = l.owner.as_ref().map(to_json).transpose()?;
            let done = sqlx::query(
                "UPDATE leases SET state = ?, owner = ?, ttl_ms = ?, expires_at = ?, \
                 renewed_at = ?, ended_at = ?, end_reason = ? WHERE id = ?",
            )
            .bind(l.state.as_str())
            .bind(owner)
            .bind(l.ttl_ms)
            .bind(l.expires_at)
            .bind(l.renewed_at)
            .bind(l.ended_at)
            .bind(&l.end_reason)
            .bind(&l.id)
            .execute(&mut *self.conn)
            .await
            .map_err(map_err)?;
            if done.rows_affected() != 1 {
                return Err(StoreError::Other(format!(
                    "lease {} vanished during update",
                    l.id
                )));
            }
            Ok(())
        })
    }

    fn append_event<'a>(&'a mut self, at: Millis, body: String) -> BoxFuture<'a, Result<i64>> {
        Box::pin(async move {
            let seq: i64 =
                sqlx::query_scalar("INSERT INTO events (at, body) VALUES (?, ?) RETURNING seq")
                    .bind(at)
                    .bind(body)
                    .fetch_one(&mut *self.conn)
                    .await
                    .map_err(map_err)?;
            self.effects.push(Effect::Event(seq));
            Ok(seq)
        })
    }

    fn set_meta<'a>(&'a mut self, key: &'a str, value: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(set_meta(self.conn, key, value))
    }

    fn after_commit(&mut self, effect: Effect) {
        self.effects.push(effect);
    }

    fn require_durable(&mut self) {
        self.durable = true;
    }
}

impl Backend for SqliteStore {
    fn write(&self, durable: bool, run: JobFn) -> BoxFuture<'_, Result<JobOutput>> {
        Box::pin(async move {
            let (reply, rx) = oneshot::channel();
            self.jobs
                .try_send(Msg::Job(Job {
                    durable,
                    run,
                    reply,
                }))
                .map_err(|e| match e {
                    mpsc::error::TrySendError::Full(_) => StoreError::Busy,
                    mpsc::error::TrySendError::Closed(_) => {
                        StoreError::Unavailable("the store is closed".into())
                    }
                })?;
            rx.await
                .map_err(|_| StoreError::Unavailable("the writer stopped".into()))?
        })
    }

    fn get_lease<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<LeaseRecord>>> {
        Box::pin(async move {
            let sql = format!("SELECT {LEASE_COLS} FROM leases WHERE id = ?");
            let row = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .fetch_optional(&self.read)
                .await
                .map_err(map_err)?;
            row.as_ref().map(lease_from_row).transpose()
        })
    }

    fn list_leases<'a>(&'a self, f: &'a LeaseFilter) -> BoxFuture<'a, Result<Vec<LeaseRecord>>> {
        Box::pin(async move {
            let mut q =
                QueryBuilder::<Sqlite>::new(format!("SELECT {LEASE_COLS} FROM leases WHERE 1 = 1"));
            match f.state {
                StateFilter::Current => {
                    q.push(format!(" AND {CURRENT}"));
                }
                StateFilter::Ended => {
                    q.push(format!(" AND NOT {CURRENT}"));
                }
                StateFilter::All => {}
            }
            if let Some(r) = &f.resource {
                q.push(" AND resource = ").push_bind(r.clone());
            }
            if let Some(p) = &f.prefix {
                // substr, not LIKE: the prefix matches literally, `%` and `_` included.
                q.push(" AND substr(resource, 1, length(")
                    .push_bind(p.clone())
                    .push(")) = ")
                    .push_bind(p.clone());
            }
            if let Some(h) = &f.holder {
                q.push(" AND holder = ").push_bind(h.clone());
            }
            if let Some(p) = &f.parent {
                q.push(" AND parent_id = ").push_bind(p.clone());
            }
            if let Some(b) = &f.before_id {
                q.push(" AND id < ").push_bind(b.clone());
            }
            q.push(" ORDER BY id DESC LIMIT ")
                .push_bind(i64::from(f.limit));
            let rows = q.build().fetch_all(&self.read).await.map_err(map_err)?;
            rows.iter().map(lease_from_row).collect()
        })
    }

    fn leases_to_reconcile(&self, now: Millis) -> BoxFuture<'_, Result<Vec<LeaseRecord>>> {
        Box::pin(async move {
            let sql = format!(
                "SELECT {LEASE_COLS} FROM leases WHERE {CURRENT} AND owner IS NOT NULL \
                 UNION SELECT {LEASE_COLS} FROM leases WHERE {CURRENT} AND expires_at <= ?"
            );
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(now)
                .fetch_all(&self.read)
                .await
                .map_err(map_err)?;
            rows.iter().map(lease_from_row).collect()
        })
    }

    fn count_current_leases(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move {
            let sql = format!("SELECT count(*) FROM leases WHERE {CURRENT}");
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(&self.read)
                .await
                .map_err(map_err)
        })
    }

    fn events(&self, after: i64, limit: u32) -> BoxFuture<'_, Result<Vec<EventRow>>> {
        Box::pin(async move {
            let rows =
                sqlx::query("SELECT seq, body FROM events WHERE seq > ? ORDER BY seq LIMIT ?")
                    .bind(after)
                    .bind(i64::from(limit))
                    .fetch_all(&self.read)
                    .await
                    .map_err(map_err)?;
            rows.iter()
                .map(|r| {
                    Ok(EventRow {
                        seq: r.try_get("seq").map_err(|e| decode_err("event", e))?,
                        payload: r.try_get("body").map_err(|e| decode_err("event", e))?,
                    })
                })
                .collect()
        })
    }

    fn last_event_seq(&self) -> BoxFuture<'_, Result<i64>> {
        Box::pin(async move {
            sqlx::query_scalar("SELECT COALESCE(MAX(seq), 0) FROM events")
                .fetch_one(&self.read)
                .await
                .map_err(map_err)
        })
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

    fn relaxed_renewals(&self) -> bool {
        true
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let (done, rx) = oneshot::channel();
            if self.jobs.send(Msg::Close(done)).await.is_ok() {
                let _ = rx.await;
            }
            self.read.close().await;
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_migration_file_is_embedded() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/sqlite");
        let files = std::fs::read_dir(dir).expect("migrations dir").count();
        assert_eq!(files, super::migrator().iter().count());
    }
}

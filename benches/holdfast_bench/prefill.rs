//! `--prefill`: a store that already holds many ended records, written straight
//! into the server's SQLite file (not through the API) while the server is stopped.
//!
//! The rows have the shape the server writes itself (see `src/store/rows/`, and a
//! lease acquired, renewed and released and a process spawned that exited, read
//! back from a scratch server): UUIDv7-like ids whose time part is the record's
//! start, times in ms since the epoch, JSON where a column holds JSON. They are
//! ended in the past, 10 ms apart, leases first, all within the last hours (well
//! inside the default record retention of 7 days, so the server keeps them):
//! - lease `i` (0-based): resource `prefill/<i mod R>` (R = `resources`, default
//!   one resource per lease), token `i div R + 1`, holder `worker-<i mod 100>`,
//!   acquired, renewed 3 ms later with a TTL of 30 s and released 5 ms after it
//!   was acquired (`released`), metadata `{"job": ..., "attempt": ...}`;
//! - the token counter of each resource (`resources.last_token`) is its highest
//!   token, so that the server's next token on it is higher;
//! - process `j`: spawned by holdfast on this host (kind `worker`, `batch` or
//!   `cron`), `/bin/sh -c "exit <j mod 3>"`, identity JSON of a pid on this boot,
//!   log paths in the data dir's `logs/`, exited with code `j mod 3` 5 ms after
//!   it was created (`exited`);
//! - `events` (default 0): the end event (`lease.released`, `process.exited`,
//!   body as the server writes it) of the newest `events` records, with the
//!   seqs they would have had (one per record, in order of ending); the older
//!   ones count as pruned (`meta.pruned_through`), as retention leaves them.
//!
//! The schema has no other table that ties the records together (events are
//! snapshots; ports and idempotency keys are for current owners and requests).

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{Connection, SqliteConnection};

use crate::ctx;

/// What `--prefill leases=N,processes=M[,resources=R][,events=K]` asks for.
#[derive(Clone, Copy, Debug, Default)]
pub struct Prefill {
    pub leases: i64,
    pub processes: i64,
    /// Distinct resources of the leases (0: one per lease).
    pub resources: i64,
    pub events: i64,
}

impl Prefill {
    pub fn parse(v: &str) -> Result<Prefill, String> {
        let mut p = Prefill::default();
        for item in v.split(',') {
            let (key, n) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?} is not key=count"))?;
            let n: i64 = n
                .trim()
                .replace('_', "")
                .parse()
                .ok()
                .filter(|&n| n >= 0)
                .ok_or_else(|| format!("{item:?}: not a count"))?;
            match key.trim() {
                "leases" => p.leases = n,
                "processes" => p.processes = n,
                "resources" => p.resources = n,
                "events" => p.events = n,
                other => {
                    return Err(format!(
                        "unknown key {other:?} (leases, processes, resources, events)"
                    ));
                }
            }
        }
        Ok(p)
    }

    /// `1000000 leases (1000000 resources), 100000 processes, 0 events`.
    pub fn describe(&self) -> String {
        let resources = self.resources_or_default();
        format!(
            "{} leases ({resources} resources), {} processes, {} events",
            self.leases,
            self.processes,
            self.events.min(self.leases + self.processes)
        )
    }

    fn resources_or_default(&self) -> i64 {
        match self.resources {
            0 => self.leases,
            r => r.min(self.leases),
        }
    }
}

/// Lease `i` at `t` (`$1` the first time, i = 0): id, resource, token and the rest.
/// `$2` N, `$3` R.
const INSERT_LEASES: &str = "\
WITH RECURSIVE n(i) AS (SELECT 0 WHERE $2 > 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < $2),
  l(i, t) AS (SELECT i, $1 + i * 10 FROM n)
INSERT INTO leases (id, resource, token, holder, state, owner, parent_id, parent_resource,
    parent_token, ttl_ms, expires_at, acquired_at, renewed_at, ended_at, end_reason, metadata)
SELECT printf('%08x-%04x-7%03x-%04x-%012x', t >> 16, t & 65535, i & 4095,
           32768 | ((i >> 12) & 16383), i),
       printf('prefill/%08d', i % $3), i / $3 + 1, printf('worker-%03d', i % 100),
       'released', NULL, NULL, NULL, NULL,
       30000, t + 3 + 30000, t, t + 3, t + 5, 'released',
       json_object('job', printf('prefill-%d', i), 'attempt', 1 + i % 3)
FROM l";

/// The last token of each resource `r`: its leases are i = r, r + R, ... < N.
/// `$1` N, `$2` R.
const INSERT_TOKENS: &str = "\
WITH RECURSIVE n(r) AS (SELECT 0 WHERE $2 > 0 UNION ALL SELECT r + 1 FROM n WHERE r + 1 < $2)
INSERT INTO resources (resource, last_token)
SELECT printf('prefill/%08d', r), ($1 - 1 - r) / $2 + 1 FROM n";

/// Process `j` at `t` (`$1` the first time): `$2` M, `$3` host id, `$4` boot id,
/// `$5` hostname, `$6` the data dir.
const INSERT_PROCESSES: &str = "\
WITH RECURSIVE n(j) AS (SELECT 0 WHERE $2 > 0 UNION ALL SELECT j + 1 FROM n WHERE j + 1 < $2),
  p(j, t, id, pid, kind) AS (
    SELECT j, t, printf('%08x-%04x-7%03x-%04x-%012x', t >> 16, t & 65535, j & 4095,
                        32768 | ((j >> 12) & 16383), 1099511627776 + j),
           1000 + j % 4000000, CASE j % 3 WHEN 0 THEN 'worker' WHEN 1 THEN 'batch' ELSE 'cron' END
    FROM (SELECT j, $1 + j * 10 AS t FROM n))
INSERT INTO processes (id, kind, state, token, operation_id, lease_id, lease_token, host_id,
    identity, owner, spawned, command, stdout_path, stderr_path, exit_code, exit_signal,
    ttl_ms, expires_at, created_at, started_at, ended_at, end_reason, metadata)
SELECT id, kind, 'exited', 1, NULL, NULL, NULL, $3,
       json_object('pid', pid, 'start_time', CAST(100000 + j * 7 AS TEXT),
                   'pidfd_inode', CAST(200000 + j AS TEXT), 'boot_id', $4, 'host_id', $3,
                   'pid_ns', '4026531836', 'hostname', $5, 'executable', '/usr/bin/dash',
                   'uid', 1000, 'pgid', pid, 'sid', 1),
       NULL, 1,
       json_object('argv', json_array('/bin/sh', '-c', printf('exit %d', j % 3)),
                   'cwd', NULL, 'env', json_object()),
       $6 || '/logs/' || id || '.out', $6 || '/logs/' || id || '.err', j % 3, NULL,
       NULL, NULL, t, t + 2, t + 5, 'exited',
       json_object('job', printf('prefill-%d', j))
FROM p";

/// ISO 8601 in UTC with ms, as the API writes times.
macro_rules! iso {
    ($ms:literal) => {
        concat!(
            "strftime('%Y-%m-%dT%H:%M:%fZ', ",
            $ms,
            " / 1000.0, 'unixepoch')"
        )
    };
}

/// The `lease.released` event of the leases with rowid > `$1` + `$2` (the first
/// rowid of the prefill is `$1` + 1, the events skipped `$2`), seq `$3` + i + 1.
const INSERT_LEASE_EVENTS: &str = concat!(
    "INSERT INTO events (seq, at, body) SELECT $3 + (rowid - $1), ended_at, json_object(",
    "'at', ",
    iso!("ended_at"),
    ", 'type', 'lease.released', 'lease', json_object(",
    "'id', id, 'resource', resource, 'token', token, 'holder', holder, 'state', state, ",
    "'owner', NULL, 'owner_status', NULL, 'owner_status_reason', NULL, 'parent', NULL, ",
    "'ttl_ms', ttl_ms, 'expires_at', ",
    iso!("expires_at"),
    ", 'stale', json('false'), 'acquired_at', ",
    iso!("acquired_at"),
    ", 'renewed_at', ",
    iso!("renewed_at"),
    ", 'ended_at', ",
    iso!("ended_at"),
    ", 'end_reason', end_reason, 'metadata', json(metadata)), ",
    "'process', NULL, 'port', NULL, 'detail', NULL) ",
    "FROM leases WHERE rowid > $1 + $2 ORDER BY rowid"
);

/// The `process.exited` event of the processes with rowid > `$1` + `$2`, seq
/// `$3` + j + 1.
const INSERT_PROCESS_EVENTS: &str = concat!(
    "INSERT INTO events (seq, at, body) SELECT $3 + (rowid - $1), ended_at, json_object(",
    "'at', ",
    iso!("ended_at"),
    ", 'type', 'process.exited', 'lease', NULL, 'process', json_object(",
    "'id', id, 'kind', kind, 'state', state, 'token', token, 'operation_id', NULL, ",
    "'lease', NULL, 'pid', identity->>'pid', 'pgid', identity->>'pgid', ",
    "'identity', json(identity), 'status', 'dead', 'status_reason', 'pid_absent', ",
    "'owner', NULL, 'spawned', json('true'), 'command', json(command), ",
    "'logs', json_object('stdout', stdout_path, 'stderr', stderr_path), ",
    "'exit', json_object('code', exit_code, 'signal', NULL), 'ports', json_object(), ",
    "'ttl_ms', NULL, 'expires_at', NULL, 'created_at', ",
    iso!("created_at"),
    ", 'started_at', ",
    iso!("started_at"),
    ", 'ended_at', ",
    iso!("ended_at"),
    ", 'end_reason', end_reason, 'metadata', json(metadata)), ",
    "'port', NULL, 'detail', NULL) ",
    "FROM processes WHERE rowid > $1 + $2 ORDER BY rowid"
);

/// A line of /proc or /etc, trimmed; `default` when unreadable.
fn system_fact(path: &str, default: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

async fn scalar(c: &mut SqliteConnection, sql: &str) -> Result<i64, String> {
    let v: (i64,) = ctx(sqlx::query_as(sql).fetch_one(&mut *c).await, sql)?;
    Ok(v.0)
}

/// What every row of a prefill is made of, on either store.
pub struct Facts {
    /// The first lease's start, in ms: all end 10 ms apart, the last a minute ago.
    pub t0: i64,
    pub n: i64,
    pub m: i64,
    pub r: i64,
    /// The records that keep their end event.
    pub k: i64,
    pub host: String,
    pub boot: String,
    pub hostname: String,
    /// The data dir, for the processes' log paths.
    pub dir: String,
}

impl Facts {
    pub fn of(p: &Prefill, data_dir: &Path) -> Facts {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let (n, m) = (p.leases, p.processes);
        Facts {
            t0: now - (n + m) * 10 - 60_000,
            n,
            m,
            r: p.resources_or_default(),
            k: p.events.min(n + m),
            host: system_fact("/etc/machine-id", "bench-host"),
            boot: system_fact(
                "/proc/sys/kernel/random/boot_id",
                "00000000-0000-0000-0000-000000000000",
            ),
            hostname: system_fact("/proc/sys/kernel/hostname", "localhost"),
            dir: data_dir.display().to_string(),
        }
    }
}

/// Writes `p` into `<data_dir>/holdfast.db` (made by a server that has stopped) in
/// one transaction; returns how long the writing took.
pub async fn sqlite(data_dir: &Path, p: &Prefill) -> Result<Duration, String> {
    let started = Instant::now();
    let db = data_dir.join("holdfast.db");
    if !db.is_file() {
        return Err(format!("{}: no such file", db.display()));
    }
    // The server sets WAL again when it opens it; a rollback journal spares the
    // bulk insert a WAL as large as the data and its checkpoint.
    let opts = SqliteConnectOptions::new()
        .filename(&db)
        .journal_mode(SqliteJournalMode::Delete)
        .synchronous(SqliteSynchronous::Normal)
        .pragma("cache_size", "-262144")
        .pragma("temp_store", "MEMORY");
    let what = format!("cannot open {}", db.display());
    let mut c = ctx(SqliteConnection::connect_with(&opts).await, what)?;

    let Facts {
        t0,
        n,
        m,
        r,
        k,
        host,
        boot,
        hostname,
        dir,
    } = Facts::of(p, data_dir);

    let mut tx = ctx(c.begin().await, "cannot begin the prefill")?;
    let lease_rowid = scalar(&mut tx, "SELECT COALESCE(max(rowid), 0) FROM leases").await?;
    let process_rowid = scalar(&mut tx, "SELECT COALESCE(max(rowid), 0) FROM processes").await?;
    let seq = scalar(
        &mut tx,
        "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)",
    )
    .await?;
    let leases = sqlx::query(INSERT_LEASES)
        .bind(t0)
        .bind(n)
        .bind(r.max(1))
        .execute(&mut *tx)
        .await;
    ctx(leases, "prefill: leases")?;
    let tokens = sqlx::query(INSERT_TOKENS)
        .bind(n)
        .bind(r)
        .execute(&mut *tx)
        .await;
    ctx(tokens, "prefill: resources")?;
    let processes = sqlx::query(INSERT_PROCESSES)
        .bind(t0 + n * 10)
        .bind(m)
        .bind(&host)
        .bind(&boot)
        .bind(&hostname)
        .bind(&dir)
        .execute(&mut *tx)
        .await;
    ctx(processes, "prefill: processes")?;
    if k > 0 {
        // Records 1..=n+m in order of ending; the newest k keep their event.
        let skipped = n + m - k;
        let lease_events = sqlx::query(INSERT_LEASE_EVENTS)
            .bind(lease_rowid)
            .bind(skipped.min(n))
            .bind(seq)
            .execute(&mut *tx)
            .await;
        ctx(lease_events, "prefill: lease events")?;
        let process_events = sqlx::query(INSERT_PROCESS_EVENTS)
            .bind(process_rowid)
            .bind((skipped - n).max(0))
            .bind(seq + n)
            .execute(&mut *tx)
            .await;
        ctx(process_events, "prefill: process events")?;
        if skipped > 0 {
            let pruned = sqlx::query(PRUNED_THROUGH)
                .bind((seq + skipped).to_string())
                .execute(&mut *tx)
                .await;
            ctx(pruned, "prefill: meta")?;
        }
    }
    ctx(tx.commit().await, "cannot commit the prefill")?;
    ctx(c.close().await, "cannot close the prefilled store")?;
    Ok(started.elapsed())
}

/// Records the seqs below `$1` as pruned, as retention does (the same text for both stores).
pub const PRUNED_THROUGH: &str = "INSERT INTO meta (key, value) VALUES ('pruned_through', $1) \
     ON CONFLICT (key) DO UPDATE SET value = excluded.value";

/// The size of the SQLite store in `data_dir` (the file, its WAL and shm), in MiB;
/// None when there is none (PostgreSQL).
pub fn store_mib(data_dir: &Path) -> Option<f64> {
    std::fs::metadata(data_dir.join("holdfast.db")).ok()?;
    let total = ["holdfast.db", "holdfast.db-wal", "holdfast.db-shm"]
        .iter()
        .filter_map(|f| std::fs::metadata(data_dir.join(f)).ok())
        .map(|m| m.len() as f64 / (1024.0 * 1024.0))
        .sum();
    Some(total)
}

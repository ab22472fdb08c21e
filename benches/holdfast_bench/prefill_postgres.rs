//! `--prefill` on PostgreSQL: the rows of `prefill.rs`, the same ids, values and
//! times, written into the database of a bench server that has made its schema and
//! stopped. `generate_series` stands for SQLite's recursive counter, `format` and
//! `lpad(to_hex())` for `printf`; JSON is built as text in the member order the
//! server writes (`json_build_object` puts `" : "` between key and value, which the
//! server's serde_json does not; both are the same JSON to a reader). Records are
//! numbered in order of ending, leases first, which is what the SQLite version reads
//! from rowids.

use std::path::Path;
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::ctx;
use crate::prefill::{Facts, PRUNED_THROUGH, Prefill};

/// The UUIDv7-like id of record `i` ended at `t` (`printf('%08x-%04x-7%03x-%04x-%012x', ...)`
/// in `prefill.rs`), with `off` added to its last part.
macro_rules! id {
    ($i:literal, $t:literal, $off:literal) => {
        concat!(
            "lpad(to_hex(",
            $t,
            " >> 16), 8, '0') || '-' || lpad(to_hex(",
            $t,
            " & 65535), 4, '0') || '-7' || lpad(to_hex(",
            $i,
            " & 4095), 3, '0') || '-' || lpad(to_hex(32768 | ((",
            $i,
            " >> 12) & 16383)), 4, '0') || '-' || lpad(to_hex(",
            $i,
            " + ",
            $off,
            "), 12, '0')"
        )
    };
}

/// Lease `i` (0-based) at `$1` + 10 i; `$2` N, `$3` R.
const INSERT_LEASES: &str = concat!(
    "INSERT INTO leases (id, resource, token, holder, state, owner, parent_id, parent_resource,
    parent_token, ttl_ms, expires_at, acquired_at, renewed_at, ended_at, end_reason, metadata)
SELECT ",
    id!("i", "t", "0"),
    ", 'prefill/' || lpad((i % $3)::text, 8, '0'), i / $3 + 1, 'worker-' || lpad((i % 100)::text, 3, '0'),
       'released', NULL, NULL, NULL, NULL,
       30000, t + 3 + 30000, t, t + 3, t + 5, 'released',
       '{\"job\":\"prefill-' || i || '\",\"attempt\":' || (1 + i % 3) || '}'
FROM (SELECT i, $1::bigint + i * 10 AS t FROM generate_series(0::bigint, $2::bigint - 1) AS i) l"
);

/// The last token of each resource `r`; `$1` N, `$2` R.
const INSERT_TOKENS: &str = "\
INSERT INTO resources (resource, last_token)
SELECT 'prefill/' || lpad(r::text, 8, '0'), ($1::bigint - 1 - r) / $2::bigint + 1
FROM generate_series(0::bigint, $2::bigint - 1) AS r";

/// Process `j` at `$1` + 10 j: `$2` M, `$3` host id, `$4` boot id, `$5` hostname,
/// `$6` the data dir.
const INSERT_PROCESSES: &str = concat!(
    "INSERT INTO processes (id, kind, state, token, operation_id, lease_id, lease_token, host_id,
    identity, owner, spawned, command, stdout_path, stderr_path, exit_code, exit_signal,
    ttl_ms, expires_at, created_at, started_at, ended_at, end_reason, metadata)
SELECT id, kind, 'exited', 1, NULL, NULL, NULL, $3,
       json_build_object('pid', pid, 'start_time', (100000 + j * 7)::text,
                   'pidfd_inode', (200000 + j)::text, 'boot_id', $4::text, 'host_id', $3::text,
                   'pid_ns', '4026531836', 'hostname', $5::text, 'executable', '/usr/bin/dash',
                   'uid', 1000, 'pgid', pid, 'sid', 1)::text,
       NULL, true,
       json_build_object('argv', json_build_array('/bin/sh', '-c', 'exit ' || j % 3),
                   'cwd', NULL, 'env', json_build_object())::text,
       $6 || '/logs/' || id || '.out', $6 || '/logs/' || id || '.err', j % 3, NULL,
       NULL, NULL, t, t + 2, t + 5, 'exited',
       '{\"job\":\"prefill-' || j || '\"}'
FROM (SELECT j, t, ",
    id!("j", "t", "1099511627776"),
    " AS id, 1000 + j % 4000000 AS pid,
             CASE j % 3 WHEN 0 THEN 'worker' WHEN 1 THEN 'batch' ELSE 'cron' END AS kind
      FROM (SELECT j, $1::bigint + j * 10 AS t FROM generate_series(0::bigint, $2::bigint - 1) AS j) n) p"
);

/// ISO 8601 in UTC with ms, as the API writes times.
macro_rules! iso {
    ($ms:literal) => {
        concat!(
            "to_char(to_timestamp(",
            $ms,
            " / 1000.0) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
        )
    };
}

/// The `lease.released` event of the leases prefilled after the first `$1` (the
/// lease of number `k`, counted from 1 in order of ending, gets seq `$2` + k).
/// `$3` the first lease's acquisition (its id's time part, in ms).
const INSERT_LEASE_EVENTS: &str = concat!(
    "INSERT INTO events (seq, at, body) SELECT $2::bigint + ((acquired_at - $3::bigint) / 10) + 1, ended_at, \
    json_build_object('at', ",
    iso!("ended_at"),
    ", 'type', 'lease.released', 'lease', json_build_object(",
    "'id', id, 'resource', resource, 'token', token, 'holder', holder, 'state', state, ",
    "'owner', NULL, 'owner_status', NULL, 'owner_status_reason', NULL, 'parent', NULL, ",
    "'ttl_ms', ttl_ms, 'expires_at', ",
    iso!("expires_at"),
    ", 'stale', false, 'acquired_at', ",
    iso!("acquired_at"),
    ", 'renewed_at', ",
    iso!("renewed_at"),
    ", 'ended_at', ",
    iso!("ended_at"),
    ", 'end_reason', end_reason, 'metadata', metadata::json), ",
    "'process', NULL, 'port', NULL, 'detail', NULL)::text ",
    "FROM leases WHERE resource LIKE 'prefill/%' AND acquired_at >= $3::bigint + 10 * $1::bigint"
);

/// The `process.exited` event of the processes prefilled after the first `$1`
/// (process `j` gets seq `$2` + j + 1); `$3` the first one's creation.
const INSERT_PROCESS_EVENTS: &str = concat!(
    "INSERT INTO events (seq, at, body) SELECT $2::bigint + ((created_at - $3::bigint) / 10) + 1, ended_at, \
    json_build_object('at', ",
    iso!("ended_at"),
    ", 'type', 'process.exited', 'lease', NULL, 'process', json_build_object(",
    "'id', id, 'kind', kind, 'state', state, 'token', token, 'operation_id', NULL, ",
    "'lease', NULL, 'pid', (identity::json->>'pid')::bigint, 'pgid', (identity::json->>'pgid')::bigint, ",
    "'identity', identity::json, 'status', 'dead', 'status_reason', 'pid_absent', ",
    "'owner', NULL, 'spawned', true, 'command', command::json, ",
    "'logs', json_build_object('stdout', stdout_path, 'stderr', stderr_path), ",
    "'exit', json_build_object('code', exit_code, 'signal', NULL), 'ports', json_build_object(), ",
    "'ttl_ms', NULL, 'expires_at', NULL, 'created_at', ",
    iso!("created_at"),
    ", 'started_at', ",
    iso!("started_at"),
    ", 'ended_at', ",
    iso!("ended_at"),
    ", 'end_reason', end_reason, 'metadata', metadata::json), ",
    "'port', NULL, 'detail', NULL)::text ",
    "FROM processes WHERE created_at >= $3::bigint + 10 * $1::bigint"
);

/// Writes `p` into the database at `url` (made by a bench server that has
/// stopped; `data_dir` is that server's, for the log paths) in one transaction,
/// then ANALYZE, as autovacuum would soon after such a load; returns how long it
/// all took.
pub async fn postgres(url: &str, data_dir: &Path, p: &Prefill) -> Result<Duration, String> {
    let started = Instant::now();
    let mut c = ctx(
        PgConnection::connect(url).await,
        format!("cannot reach {url}"),
    )?;
    let f = Facts::of(p, data_dir);
    let mut tx = ctx(c.begin().await, "cannot begin the prefill")?;
    let seq: (i64,) = ctx(
        sqlx::query_as("SELECT seq FROM event_seq")
            .fetch_one(&mut *tx)
            .await,
        "prefill: event_seq",
    )?;
    let seq = seq.0;
    let leases = sqlx::query(INSERT_LEASES)
        .bind(f.t0)
        .bind(f.n)
        .bind(f.r.max(1))
        .execute(&mut *tx)
        .await;
    ctx(leases, "prefill: leases")?;
    let tokens = sqlx::query(INSERT_TOKENS)
        .bind(f.n)
        .bind(f.r)
        .execute(&mut *tx)
        .await;
    ctx(tokens, "prefill: resources")?;
    let processes = sqlx::query(INSERT_PROCESSES)
        .bind(f.t0 + f.n * 10)
        .bind(f.m)
        .bind(&f.host)
        .bind(&f.boot)
        .bind(&f.hostname)
        .bind(&f.dir)
        .execute(&mut *tx)
        .await;
    ctx(processes, "prefill: processes")?;
    if f.k > 0 {
        let skipped = f.n + f.m - f.k;
        let lease_events = sqlx::query(INSERT_LEASE_EVENTS)
            .bind(skipped.min(f.n))
            .bind(seq)
            .bind(f.t0)
            .execute(&mut *tx)
            .await;
        ctx(lease_events, "prefill: lease events")?;
        let process_events = sqlx::query(INSERT_PROCESS_EVENTS)
            .bind((skipped - f.n).max(0))
            .bind(seq + f.n)
            .bind(f.t0 + f.n * 10)
            .execute(&mut *tx)
            .await;
        ctx(process_events, "prefill: process events")?;
        let last = sqlx::query("UPDATE event_seq SET seq = $1")
            .bind(seq + f.n + f.m)
            .execute(&mut *tx)
            .await;
        ctx(last, "prefill: event_seq")?;
        if skipped > 0 {
            let pruned = sqlx::query(PRUNED_THROUGH)
                .bind((seq + skipped).to_string())
                .execute(&mut *tx)
                .await;
            ctx(pruned, "prefill: meta")?;
        }
    }
    ctx(tx.commit().await, "cannot commit the prefill")?;
    let analyze = sqlx::query("ANALYZE").execute(&mut c).await;
    ctx(analyze, "prefill: ANALYZE")?;
    ctx(c.close().await, "cannot close the prefilled store")?;
    Ok(started.elapsed())
}

/// The size of the database at `url` in MiB.
pub async fn database_mib(url: &str) -> Option<f64> {
    let mut c = PgConnection::connect(url).await.ok()?;
    let size: (i64,) = sqlx::query_as("SELECT pg_database_size(current_database())")
        .fetch_one(&mut c)
        .await
        .ok()?;
    let _ = c.close().await;
    Some(size.0 as f64 / (1024.0 * 1024.0))
}

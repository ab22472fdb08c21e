//! `--floors yes`: what this machine allows a point at best, measured in the same
//! run just before it. A lone client's cycle (and a hand-off at any C: each one
//! waits for the one before) is a sequence of steps that no server can skip: the
//! durable commits the contract requires, one after another, and one HTTP request
//! per call. Each step is timed on its own here:
//!
//! - `floor-request`: GET /healthz on the holdfast server, one client: an HTTP
//!   round trip through holdfast's own stack with nothing behind it;
//! - `floor-commit/sqlite`: a one-row UPDATE in its own transaction on a SQLite
//!   file in WAL mode with `synchronous=FULL`, in a temp dir beside the servers'
//!   data dirs (same file system, `TMPDIR`);
//! - `floor-commit/postgres`: a one-row UPDATE in autocommit on the `--postgres`
//!   server (one round trip and one WAL flush), in a database of its own;
//! - a spawn also waits for `spawn-ref` at C=1 (fork+exec+wait of `/bin/true`).
//!
//! The bound of a point is one over the sum of its steps' medians (`bound_ms`); the
//! line after the point gives it, the measured rate as a share of it, and the bound
//! as a multiple of the anchor's rate measured in the same run: a goal above that
//! multiple cannot be met on this machine by any server that keeps the contract.

use std::time::{Duration, Instant};

use crate::holdfast::Api;
use crate::process::Started;
use crate::stats::Stats;
use crate::{Workload, ctx, report};

/// Medians, in ms, of the steps measured before one point.
pub struct Floors {
    pub request: f64,
    pub sqlite_commit: f64,
    /// None without a PostgreSQL store in the run.
    pub pg_commit: Option<f64>,
}

/// A point has a bound when its operations run one after another: every workload at
/// C=1, and hand-offs at every C.
pub fn applies(workload: Workload, c: usize) -> bool {
    match workload {
        Workload::Contended => true,
        Workload::Churn | Workload::Renew | Workload::Spawn => c == 1,
        Workload::Stop50 => false,
    }
}

/// Measures each step for `seconds`, one client, and prints its line.
/// `server`, when the bench started it, adds the server's CPU per request to the
/// `floor-request` line.
pub async fn measure(
    api: &Api,
    server: Option<&Started>,
    pg: Option<&str>,
    seconds: f64,
) -> Result<Floors, String> {
    let cpu_before = server.and_then(Started::cpu_seconds);
    let (stats, elapsed) = requests(api, seconds).await;
    let cpu = match (cpu_before, server.and_then(Started::cpu_seconds)) {
        (Some(before), Some(after)) => report::cpu(after - before, stats.ops),
        _ => String::new(),
    };
    let request = line(("floor-request", "requests/s"), stats, elapsed, &cpu);
    let sqlite_commit = sqlite_commits(seconds).await?;
    let pg_commit = match pg {
        Some(url) => Some(pg_commits(url, seconds).await?),
        None => None,
    };
    Ok(Floors {
        request,
        sqlite_commit,
        pg_commit,
    })
}

/// The milliseconds an operation of `workload` takes at best on `store`, and what
/// they are made of; None where no bound applies.
pub fn bound_ms(
    f: &Floors,
    workload: Workload,
    c: usize,
    store: &str,
    spawn_ref_rate: f64,
) -> Option<(f64, &'static str)> {
    if !applies(workload, c) {
        return None;
    }
    let postgres = store == "postgres";
    let commit = if postgres {
        f.pg_commit?
    } else {
        f.sqlite_commit
    };
    let req = f.request;
    Some(match (workload, postgres) {
        // A renewal is durable on PostgreSQL only (API.md).
        (Workload::Churn, false) => (2.0 * commit + 3.0 * req, "2 durable commits + 3 requests"),
        (Workload::Churn, true) => (3.0 * commit + 3.0 * req, "3 durable commits + 3 requests"),
        (Workload::Renew, false) => (req, "1 request"),
        (Workload::Renew, true) => (commit + req, "1 durable commit + 1 request"),
        (Workload::Contended, _) if c == 1 => {
            (2.0 * commit + 2.0 * req, "2 durable commits + 2 requests")
        }
        // The release and the waiter's grant share one commit; the next holder's
        // release can only follow its grant.
        (Workload::Contended, _) => (commit + req, "1 durable commit + 1 request"),
        (Workload::Spawn, _) => (
            2.0 * commit + 2.0 * req + 1000.0 / spawn_ref_rate,
            "2 durable commits + 2 requests + fork+exec+wait",
        ),
        (Workload::Stop50, _) => return None,
    })
}

/// `bound <workload> C=<c> holdfast/<store> = X/s (...): measured Y% of it; the
/// bound is Z.ZZx <anchor>`.
pub fn print_bound(
    (workload, c): (&str, usize),
    store: &str,
    (bound_ms, made_of): (f64, &str),
    measured: f64,
    anchor: Option<(&str, f64)>,
) {
    let bound = 1000.0 / bound_ms;
    let share = 100.0 * measured / bound;
    let against = anchor.map_or(String::new(), |(name, rate)| {
        format!("; the bound is {:.2}x {name}", bound / rate)
    });
    println!(
        "bound {workload} C={c} holdfast/{store} = {bound:.1}/s ({made_of}): \
         measured {share:.0}% of it{against}"
    );
}

/// Prints a floor's line; the median of its steps in ms.
fn line(label: (&str, &str), mut stats: Stats, elapsed: Duration, extra: &str) -> f64 {
    let rate = stats.ops as f64 / elapsed.as_secs_f64();
    report::run_line(&mut stats, label, 1, rate, extra);
    stats.percentile_ms(50.0)
}

async fn requests(api: &Api, seconds: f64) -> (Stats, Duration) {
    let url = format!("{}/healthz", api.base);
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let mut stats = Stats::default();
    while Instant::now() < deadline {
        let t = Instant::now();
        let answer = api.client.get(&url).send().await;
        let ok = match answer {
            Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
            _ => false,
        };
        if ok {
            stats.record(t.elapsed());
        } else {
            stats.fail().await;
        }
    }
    (stats, started.elapsed())
}

async fn sqlite_commits(seconds: f64) -> Result<f64, String> {
    let run = move || -> Result<(Stats, Duration), String> {
        let dir = ctx(
            tempfile::TempDir::new(),
            "floor-commit: cannot create a temp dir",
        )?;
        let db = dir.path().join("floor.db");
        let c = ctx(rusqlite::Connection::open(&db), "floor-commit: cannot open")?;
        let mode: String = ctx(
            c.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0)),
            "floor-commit: journal_mode",
        )?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(format!("floor-commit: journal_mode is {mode}, not wal"));
        }
        let setup = "PRAGMA synchronous = FULL; \
                     CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER NOT NULL); \
                     INSERT INTO t VALUES (1, 0);";
        ctx(c.execute_batch(setup), "floor-commit: setup")?;
        let mut update = ctx(
            c.prepare("UPDATE t SET v = v + 1 WHERE id = 1"),
            "floor-commit: prepare",
        )?;
        let started = Instant::now();
        let deadline = started + Duration::from_secs_f64(seconds);
        let mut stats = Stats::default();
        while Instant::now() < deadline {
            let t = Instant::now();
            ctx(update.execute([]), "floor-commit: update")?;
            stats.record(t.elapsed());
        }
        Ok((stats, started.elapsed()))
    };
    let (stats, elapsed) = ctx(tokio::task::spawn_blocking(run).await, "floor-commit")??;
    Ok(line(
        ("floor-commit/sqlite", "commits/s"),
        stats,
        elapsed,
        "",
    ))
}

async fn pg_commits(url: &str, seconds: f64) -> Result<f64, String> {
    use sqlx::Connection;
    let mut c = ctx(
        sqlx::PgConnection::connect(url).await,
        "floor-commit/postgres: cannot connect",
    )?;
    let setup = "CREATE TABLE IF NOT EXISTS t (id integer PRIMARY KEY, v bigint NOT NULL); \
                 INSERT INTO t VALUES (1, 0) ON CONFLICT DO NOTHING";
    ctx(
        sqlx::raw_sql(setup).execute(&mut c).await,
        "floor-commit/postgres: setup",
    )?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let mut stats = Stats::default();
    while Instant::now() < deadline {
        let t = Instant::now();
        let update = sqlx::query("UPDATE t SET v = v + 1 WHERE id = $1").bind(1_i32);
        ctx(
            update.execute(&mut c).await,
            "floor-commit/postgres: update",
        )?;
        stats.record(t.elapsed());
    }
    let _ = c.close().await;
    let label = ("floor-commit/postgres", "commits/s");
    Ok(line(label, stats, started.elapsed(), ""))
}

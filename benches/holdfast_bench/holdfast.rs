//! holdfast: its workload clients, the server the bench starts, its PostgreSQL
//! database, and its durable-commit counter.

use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::{Client, StatusCode};
use rustix::process::Signal;
use serde_json::{Value, json};
use tokio::process::Command;
use tokio::task::JoinSet;

use crate::ctx;
use crate::process::{self, Started};
use crate::stats::Stats;

/// The lease and process endpoints of one server, over the shared client.
#[derive(Clone)]
pub struct Api {
    pub client: Client,
    pub base: String,
    /// With `--hosts N`, the other servers on the same database: client `i`
    /// of a run talks to host `i % N` (`host`).
    pub others: Vec<String>,
    /// `--keyed yes`: every POST carries an `Idempotency-Key` of its own.
    pub keyed: bool,
}

impl Api {
    /// One server's API, with no other hosts.
    pub fn new(client: &Client, base: String) -> Self {
        Self {
            client: client.clone(),
            base,
            others: Vec::new(),
            keyed: false,
        }
    }

    /// The API as client `i` of a run uses it: on host `i % N`.
    pub fn host(&self, i: usize) -> Api {
        let n = self.others.len() + 1;
        let base = match i % n {
            0 => self.base.clone(),
            k => self.others[k - 1].clone(),
        };
        Api {
            keyed: self.keyed,
            ..Api::new(&self.client, base)
        }
    }

    /// Every host's API.
    fn hosts(&self) -> impl Iterator<Item = Api> + '_ {
        (0..=self.others.len()).map(|i| self.host(i))
    }

    /// POSTs JSON; the status and the JSON body (Null when not JSON) of the answer.
    async fn post(&self, path: &str, body: Value) -> Result<(StatusCode, Value), reqwest::Error> {
        let url = format!("{}{path}", self.base);
        let mut req = self.client.post(url).json(&body);
        if self.keyed {
            req = req.header("Idempotency-Key", uuid::Uuid::now_v7().to_string());
        }
        let resp = req.send().await?;
        let status = resp.status();
        let bytes = resp.bytes().await?; // read it all so the connection is reused
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok((status, json))
    }

    /// Creates a lease or process: Some((id, token)) on 201, None on anything else.
    async fn create(&self, path: &str, body: &Value) -> Option<(String, i64)> {
        match self.post(path, body.clone()).await {
            Ok((StatusCode::CREATED, v)) => Some((v["id"].as_str()?.into(), v["token"].as_i64()?)),
            _ => None,
        }
    }

    /// True on 200.
    async fn renew(&self, id: &str, token: i64, ttl_ms: u64) -> bool {
        let body = json!({"token": token, "ttl_ms": ttl_ms});
        let answer = self.post(&format!("/v1/leases/{id}/renew"), body).await;
        matches!(answer, Ok((StatusCode::OK, _)))
    }

    /// True on 200.
    async fn release(&self, id: &str, token: i64) -> bool {
        let body = json!({"token": token});
        let answer = self.post(&format!("/v1/leases/{id}/release"), body).await;
        matches!(answer, Ok((StatusCode::OK, _)))
    }

    /// True on 200 with the process `stopped`.
    async fn stop(&self, id: &str, token: i64) -> bool {
        let body = json!({"token": token, "grace_ms": 5000});
        let answer = self.post(&format!("/v1/processes/{id}/stop"), body).await;
        matches!(answer, Ok((StatusCode::OK, v)) if v["state"] == "stopped")
    }

    async fn metrics(&self) -> Option<String> {
        let resp = self.client.get(format!("{}/metrics", self.base)).send();
        resp.await.ok()?.error_for_status().ok()?.text().await.ok()
    }

    /// `holdfast_store_round_trips_total` (statements sent to PostgreSQL for
    /// writes) in GET /metrics, summed over the hosts; None when a server
    /// does not export it.
    pub async fn round_trips(&self) -> Option<f64> {
        let mut sum = 0.0;
        for host in self.hosts() {
            sum += host.round_trips_here().await?;
        }
        Some(sum)
    }

    async fn round_trips_here(&self) -> Option<f64> {
        let text = self.metrics().await?;
        text.lines().find_map(|l| {
            let value = l.strip_prefix("holdfast_store_round_trips_total ")?;
            value.trim().parse().ok()
        })
    }

    /// The durable commits so far: the samples with `sync="full"` of the counter
    /// `holdfast_store_transactions_total` (the group commit's write transactions; the
    /// name `holdfast_store_commits_total` is read too) in GET /metrics. 0 while the
    /// family is there without such a sample; None when the server does not export it.
    /// Summed over the hosts.
    pub async fn durable_commits(&self) -> Option<f64> {
        let mut sum = 0.0;
        for host in self.hosts() {
            sum += host.durable_commits_here().await?;
        }
        Some(sum)
    }

    async fn durable_commits_here(&self) -> Option<f64> {
        const FAMILIES: [&str; 2] = ["holdfast_store_transactions", "holdfast_store_commits"];
        let text = self.metrics().await?;
        let mut found = None;
        for line in text.lines() {
            if let Some(family) = line.strip_prefix("# TYPE ")
                && FAMILIES.iter().any(|f| {
                    // Named by the family in OpenMetrics, by its samples in text 0.0.4.
                    let name = family.split_whitespace().next();
                    name == Some(f) || name.and_then(|n| n.strip_suffix("_total")) == Some(f)
                })
            {
                found = found.or(Some(0.0));
            }
            let sample = FAMILIES.iter().find_map(|f| {
                let labels = line.strip_prefix(f)?.strip_prefix("_total{")?;
                labels.split_once('}')
            });
            if let Some((labels, value)) = sample
                && labels.split(',').any(|l| l.trim() == "sync=\"full\"")
                && let Ok(n) = value.trim().parse::<f64>()
            {
                found = Some(found.unwrap_or(0.0) + n);
            }
        }
        found
    }
}

pub async fn churn_client(api: Api, resource: String, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    let body = json!({"resource": resource, "holder": "bench-churn", "ttl_ms": 30000});
    while Instant::now() < deadline {
        let started = Instant::now();
        let ok = match api.create("/v1/leases", &body).await {
            Some((id, token)) => {
                let renewed = api.renew(&id, token, 30000).await;
                api.release(&id, token).await && renewed // release even if renew failed
            }
            None => false,
        };
        if ok {
            stats.record(started.elapsed());
        } else {
            stats.fail().await;
        }
    }
    stats
}

pub async fn renew_client(api: Api, resource: String, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    let body = json!({"resource": resource, "holder": "bench-renew", "ttl_ms": 60000});
    let Some((id, token)) = api.create("/v1/leases", &body).await else {
        stats.errors += 1;
        return stats;
    };
    while Instant::now() < deadline {
        let started = Instant::now();
        if api.renew(&id, token, 60000).await {
            stats.record(started.elapsed());
        } else {
            stats.fail().await;
        }
    }
    if !api.release(&id, token).await {
        stats.errors += 1;
    }
    stats
}

pub async fn contended_client(api: Api, resource: String, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    let body = json!({"resource": resource, "holder": "bench-contended",
                      "ttl_ms": 30000, "wait_ms": 60000});
    while Instant::now() < deadline {
        let started = Instant::now();
        let Some((id, token)) = api.create("/v1/leases", &body).await else {
            stats.lose().await;
            continue;
        };
        let waited = started.elapsed();
        if api.release(&id, token).await {
            stats.record(waited);
        } else {
            stats.fail().await;
        }
    }
    stats
}

pub async fn spawn_client(api: Api, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    let body = json!({"kind": "bench", "command": {"argv": ["/bin/sleep", "600"]}});
    while Instant::now() < deadline {
        let started = Instant::now();
        let ok = match api.create("/v1/processes", &body).await {
            Some((id, token)) => api.stop(&id, token).await,
            None => false,
        };
        if ok {
            stats.record(started.elapsed());
        } else {
            stats.fail().await;
        }
    }
    stats
}

/// One round of `stop50`: spawns `n` processes, then sends their `n` stops at once.
/// The time from the first stop sent to the last answer when every spawn and stop
/// answered as it must (else None), and the number of those that did not.
pub async fn stop_round(api: &Api, n: usize) -> (Option<Duration>, u64) {
    let body = json!({"kind": "bench", "command": {"argv": ["/bin/sleep", "600"]}});
    let mut spawns = JoinSet::new();
    for _ in 0..n {
        let (api, body) = (api.clone(), body.clone());
        spawns.spawn(async move { api.create("/v1/processes", &body).await });
    }
    let mut running = Vec::with_capacity(n);
    let mut errors = 0;
    while let Some(spawned) = spawns.join_next().await {
        match spawned {
            Ok(Some(p)) => running.push(p),
            _ => errors += 1,
        }
    }
    let started = Instant::now();
    let mut stops = JoinSet::new();
    for (id, token) in running {
        let api = api.clone();
        stops.spawn(async move { api.stop(&id, token).await });
    }
    while let Some(stopped) = stops.join_next().await {
        if !matches!(stopped, Ok(true)) {
            errors += 1;
        }
    }
    let elapsed = started.elapsed();
    ((errors == 0).then_some(elapsed), errors)
}

/// Starts the release binary on a free port with a fresh temp data dir (or `dir`,
/// one a server of the bench used before) and no `HOLDFAST_*` variables; returns it
/// and its base URL.
pub async fn start_server(
    database: Option<&str>,
    dir: Option<tempfile::TempDir>,
) -> Result<(Started, String), String> {
    // Another build (an older commit's, to compare with) when named.
    let bin = match std::env::var_os("HOLDFAST_BENCH_BINARY") {
        Some(b) => std::path::PathBuf::from(b),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/holdfast"),
    };
    if !bin.is_file() {
        let shown = bin.display();
        return Err(format!(
            "{shown} not found: run `cargo build --release` first"
        ));
    }
    let data_dir = match dir {
        Some(dir) => dir,
        None => ctx(tempfile::TempDir::new(), "cannot create a temp dir")?,
    };
    let mut cmd = Command::new(&bin);
    // A port of the kernel's choosing, read back from the server's log: a
    // free port picked here first could be taken by another before it binds.
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir.path());
    if let Some(url) = database {
        cmd.args(["--database", url]);
    }
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("HOLDFAST_") {
            cmd.env_remove(key);
        }
    }
    let mut server = Started::spawn("holdfast", cmd, data_dir, "server.log", Signal::KILL)?;
    let addr = server.logged("holdfast listening addr=").await?;
    Ok((server, format!("http://{addr}")))
}

/// Polls GET /readyz until it answers 200 (see `process::wait_ready`).
pub async fn wait_ready(api: &Api, server: Option<&mut Started>) -> Result<(), String> {
    let url = format!("{}/readyz", api.base);
    process::wait_ready(&url, server, || async {
        let answer = api.client.get(&url).send().await;
        match answer {
            Ok(r) if r.status() == StatusCode::OK => Ok(()),
            Ok(r) => Err(format!("it answered {}", r.status())),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
}

/// A fresh database for a bench server on the PostgreSQL server `base`.
pub async fn create_database(base: &str, name: &str) -> Result<String, String> {
    use sqlx::Connection;
    let admin = format!("{base}/postgres");
    let mut c = ctx(
        sqlx::PgConnection::connect(&admin).await,
        format!("cannot reach {base}"),
    )?;
    let create = sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut c)
        .await;
    ctx(create, "cannot create the bench database")?;
    Ok(format!("{base}/{name}"))
}

pub async fn drop_database(base: &str, name: &str) {
    use sqlx::Connection;
    if let Ok(mut c) = sqlx::PgConnection::connect(&format!("{base}/postgres")).await {
        let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
        if let Err(e) = sqlx::query(&sql).execute(&mut c).await {
            eprintln!("holdfast-bench: could not drop {name}: {e}");
        }
    }
}

/// Requests a successful operation of `workload` made (for requests per commit).
pub fn requests_per_op(workload: crate::Workload) -> u64 {
    match workload {
        crate::Workload::Churn => 3,     // acquire, renew, release
        crate::Workload::Renew => 1,     // renew
        crate::Workload::Contended => 2, // acquire (waiting), release
        crate::Workload::Spawn => 2,     // spawn, stop
        crate::Workload::Stop50 => 2 * crate::STOP50_CHILDREN as u64, // per round
    }
}

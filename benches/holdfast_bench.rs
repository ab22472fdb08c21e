//! Load benchmark for the holdfast lease and process API (a program, not a timed test).
//!
//! Run it with:
//!
//! ```text
//! cargo build --release
//! cargo bench --bench holdfast-bench -- [--url http://127.0.0.1:7427] \
//!     [--concurrency 1,8,64] [--seconds 5] [--workload churn,renew,contended,spawn] \
//!     [--stores sqlite,postgres] [--postgres postgres://postgres@127.0.0.1:5432]
//! ```
//!
//! `--stores` (without `--url`) starts one server per store and runs every
//! workload and C on each in turn, so the stores are compared in the same run
//! under the same machine load. For `postgres` the bench creates a database
//! `holdfast_bench_<run id>` on the `--postgres` server and drops it at the end.
//!
//! Without `--url` the bench builds nothing: it starts `target/release/holdfast serve`
//! (run `cargo build --release` first) on a free loopback port with a fresh temporary
//! data dir and no `HOLDFAST_*` variables, waits for `/readyz`, and kills it at the end;
//! the server's output goes to `server.log` in that dir. With `--url` it uses that
//! server; resource names carry a run id, so reruns against it do not collide.
//!
//! Each workload runs for `--seconds` with C concurrent client tasks, for each C:
//! - `churn`: each client loops acquire (201), renew (200), release (200) on its own
//!   resource; reports cycles/s and p50/p99 latency of a whole 3-request cycle.
//! - `renew`: each client acquires its own lease once, then renews it back to back;
//!   reports renewals/s and p50/p99 per renewal; releases it at the end.
//! - `contended`: all C clients acquire ONE resource with `wait_ms` 60000 and release
//!   it at once on 201; reports handoffs/s, p50/p99 of the acquire latency (waiting
//!   included) and `lost`, the acquires that did not answer 201 (target: zero). After
//!   `--seconds` no new acquire starts; those in flight finish.
//! - `spawn`: each client loops spawn (`POST /v1/processes` with argv
//!   `/bin/sleep 600`, 201) and stop (`grace_ms` 5000, 200 and `stopped`); reports
//!   cycles/s and p50/p99 of a whole spawn+stop cycle. Right before it, for the same C
//!   and duration, `spawn-ref` measures the bench's own fork+exec+wait of `/bin/true`
//!   in C blocking threads; the spawn line gives its rate as a ratio of that one.
//!
//! `errors` counts unexpected statuses and failed requests (the bench never panics on
//! one). Rates divide by the wall time until the last client finished. When the bench
//! starts the server, both share the CPUs that `nproc` reports in the header.

use std::fmt::Display;
use std::fs::File;
use std::net::TcpListener;
use std::path::Path;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

const USAGE: &str = "usage: cargo bench --bench holdfast-bench -- [--url URL] \
    [--concurrency 1,8,64] [--seconds 5] [--workload churn,renew,contended,spawn] \
    [--stores sqlite,postgres] [--postgres URL]";

#[derive(Clone, Copy)]
enum Workload {
    Churn,
    Renew,
    Contended,
    Spawn,
}

impl Workload {
    const ALL: [Workload; 4] = [
        Workload::Churn,
        Workload::Renew,
        Workload::Contended,
        Workload::Spawn,
    ];

    /// Its name and the unit of its rate.
    fn labels(self) -> (&'static str, &'static str) {
        match self {
            Workload::Churn => ("churn", "cycles/s"),
            Workload::Renew => ("renew", "renewals/s"),
            Workload::Contended => ("contended", "handoffs/s"),
            Workload::Spawn => ("spawn", "cycles/s"),
        }
    }
}

struct Args {
    url: Option<String>,
    stores: Vec<String>,
    postgres: String,
    concurrency: Vec<usize>,
    seconds: f64,
    workloads: Vec<Workload>,
}

/// Adds what failed to an error, for `?` on setup steps.
fn ctx<T, E: Display>(r: Result<T, E>, what: impl Display) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

fn parse_list<T>(v: &str, item: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, String> {
    let bad = |s: &str| format!("bad list item {s:?}");
    v.split(',')
        .map(|s| item(s.trim()).ok_or_else(|| bad(s)))
        .collect()
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        url: None,
        stores: vec!["sqlite".into()],
        postgres: "postgres://postgres@127.0.0.1:5432".into(),
        concurrency: vec![1, 8, 64],
        seconds: 5.0,
        workloads: Workload::ALL.to_vec(),
    };
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench"); // added by cargo bench
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--url" => args.url = Some(value.trim_end_matches('/').to_string()),
            "--postgres" => args.postgres = value.trim_end_matches('/').to_string(),
            "--stores" => {
                let known = |s: &str| ["sqlite", "postgres"].contains(&s).then(|| s.to_owned());
                args.stores = ctx(parse_list(&value, known), "--stores")?;
            }
            "--seconds" => match value.parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 => args.seconds = s,
                _ => return Err(format!("--seconds: {value:?} is not a positive number")),
            },
            "--concurrency" => {
                let positive = |s: &str| s.parse::<usize>().ok().filter(|&n| n > 0);
                args.concurrency = ctx(parse_list(&value, positive), "--concurrency")?;
            }
            "--workload" => {
                let known = |s: &str| Workload::ALL.into_iter().find(|w| w.labels().0 == s);
                args.workloads = ctx(parse_list(&value, known), "--workload")?;
            }
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    if args.url.is_some() && args.stores.len() > 1 {
        return Err("--url measures one server: give --stores only without it".into());
    }
    Ok(args)
}

/// What one client task (or, merged, all of them) measured.
#[derive(Default)]
struct Stats {
    ops: u64,
    errors: u64,
    lost: u64,
    /// Microseconds per measured operation.
    latencies_us: Vec<u64>,
}

impl Stats {
    fn record(&mut self, latency: Duration) {
        self.ops += 1;
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.latencies_us.push(us);
    }

    /// Counts an error and backs off a little, so that a dead server does not spin the CPU.
    async fn fail(&mut self) {
        self.errors += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    fn add(&mut self, other: Stats) {
        self.ops += other.ops;
        self.errors += other.errors;
        self.lost += other.lost;
        self.latencies_us.extend(other.latencies_us);
    }

    /// Nearest-rank percentile in milliseconds (of sorted latencies); NaN when empty.
    fn percentile_ms(&self, p: f64) -> f64 {
        let n = self.latencies_us.len();
        let rank = ((p / 100.0) * n as f64).ceil() as usize;
        let us = self.latencies_us.get(rank.clamp(1, n.max(1)) - 1);
        us.map_or(f64::NAN, |&us| us as f64 / 1000.0)
    }

    /// Prints one result line for `rate` ops/s, ending with `extra`.
    fn report(&mut self, (name, unit): (&str, &str), c: usize, rate: f64, extra: &str) {
        self.latencies_us.sort_unstable();
        let (p50, p99) = (self.percentile_ms(50.0), self.percentile_ms(99.0));
        print!("{name:<19} C={c:>3} {rate:>9.1} {unit:<16}  p50 {p50:>7.2} ms   ");
        println!("p99 {p99:>7.2} ms   errors {}{extra}", self.errors);
    }
}

/// Awaits the client tasks (or threads) of one run and merges what they measured.
async fn merge(tasks: Vec<JoinHandle<Stats>>, name: &str) -> Stats {
    let mut total = Stats::default();
    for task in tasks {
        match task.await {
            Ok(stats) => total.add(stats),
            Err(e) => eprintln!("a {name} client task failed: {e}"),
        }
    }
    total
}

/// The lease and process endpoints of one server, over the shared client.
#[derive(Clone)]
struct Api {
    client: Client,
    base: String,
}

impl Api {
    /// POSTs JSON; the status and the JSON body (Null when not JSON) of the answer.
    async fn post(&self, path: &str, body: Value) -> Result<(StatusCode, Value), reqwest::Error> {
        let url = format!("{}{path}", self.base);
        let resp = self.client.post(url).json(&body).send().await?;
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
}

async fn churn_client(api: Api, resource: String, deadline: Instant) -> Stats {
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

async fn renew_client(api: Api, resource: String, deadline: Instant) -> Stats {
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

async fn contended_client(api: Api, resource: String, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    let body = json!({"resource": resource, "holder": "bench-contended",
                      "ttl_ms": 30000, "wait_ms": 60000});
    while Instant::now() < deadline {
        let started = Instant::now();
        let Some((id, token)) = api.create("/v1/leases", &body).await else {
            stats.lost += 1;
            tokio::time::sleep(Duration::from_millis(5)).await; // a quick 503 must not spin
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

async fn spawn_client(api: Api, deadline: Instant) -> Stats {
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

/// The reference for `spawn`: fork+exec+wait of `/bin/true` by the bench itself, in
/// `c` blocking threads for `seconds`. Prints the `spawn-ref` line; returns its rate.
/// A thread stops at its first failure, which it counts (no sleeping in a thread).
async fn spawn_reference(c: usize, seconds: f64) -> f64 {
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let run = move || {
        let mut stats = Stats::default();
        while Instant::now() < deadline {
            let started = Instant::now();
            match std::process::Command::new("/bin/true").status() {
                Ok(status) if status.success() => stats.record(started.elapsed()),
                _ => {
                    stats.errors += 1;
                    break;
                }
            }
        }
        stats
    };
    let threads = (0..c).map(|_| tokio::task::spawn_blocking(run)).collect();
    let mut total = merge(threads, "spawn-ref").await;
    let rate = total.ops as f64 / started.elapsed().as_secs_f64();
    total.report(("spawn-ref", "fork+exec+wait/s"), c, rate, "");
    rate
}

/// Runs one workload with `c` client tasks and prints its line (for `spawn`, after
/// the line of its reference).
async fn run_workload(
    api: &Api,
    store: &str,
    workload: Workload,
    c: usize,
    seconds: f64,
    run_id: &str,
) {
    let reference = match workload {
        Workload::Spawn => spawn_reference(c, seconds).await,
        _ => f64::NAN,
    };
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let (name, unit) = workload.labels();
    let prefix = format!("bench/{name}/{run_id}/{store}/{c}");
    let tasks: Vec<_> = (0..c)
        .map(|i| {
            let (api, own) = (api.clone(), format!("{prefix}/{i}"));
            match workload {
                Workload::Churn => tokio::spawn(churn_client(api, own, deadline)),
                Workload::Renew => tokio::spawn(renew_client(api, own, deadline)),
                Workload::Contended => {
                    tokio::spawn(contended_client(api, prefix.clone(), deadline))
                }
                Workload::Spawn => tokio::spawn(spawn_client(api, deadline)),
            }
        })
        .collect();
    let mut total = merge(tasks, name).await;
    let rate = total.ops as f64 / started.elapsed().as_secs_f64();
    let extra = match workload {
        Workload::Contended => format!("   lost {}", total.lost),
        Workload::Spawn => format!("   ratio {:.2} of raw fork+exec+wait", rate / reference),
        _ => String::new(),
    };
    total.report((&format!("{name}/{store}"), unit), c, rate, &extra);
}

/// A server started by the bench: killed on drop, then its temp data dir is removed.
struct LocalServer {
    child: Child,
    data_dir: tempfile::TempDir,
}

/// Starts the release binary on a free port; returns it and its base URL.
fn start_server(database: Option<&str>) -> Result<(LocalServer, String), String> {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/holdfast");
    if !bin.is_file() {
        let shown = bin.display();
        return Err(format!(
            "{shown} not found: run `cargo build --release` first"
        ));
    }
    let free = ctx(TcpListener::bind("127.0.0.1:0"), "no free port")?;
    let port = ctx(free.local_addr(), "no free port")?.port();
    drop(free); // the server binds it
    let data_dir = ctx(tempfile::TempDir::new(), "cannot create a temp dir")?;
    let log = data_dir.path().join("server.log");
    let stdout = ctx(File::create(&log), "cannot create the server log")?;
    let stderr = ctx(stdout.try_clone(), "cannot create the server log")?;
    let mut cmd = Command::new(&bin);
    let listen = format!("127.0.0.1:{port}");
    cmd.args(["serve", "--listen", &listen, "--data-dir"])
        .arg(data_dir.path());
    if let Some(url) = database {
        cmd.args(["--database", url]);
    }
    cmd.stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .kill_on_drop(true);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("HOLDFAST_") {
            cmd.env_remove(key);
        }
    }
    let child = ctx(cmd.spawn(), format!("cannot start {}", bin.display()))?;
    Ok((LocalServer { child, data_dir }, format!("http://{listen}")))
}

/// Polls GET /readyz until it answers 200; fails after 15 s or if our server exits.
async fn wait_ready(api: &Api, mut server: Option<&mut LocalServer>) -> Result<(), String> {
    let give_up = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(s) = server.as_mut()
            && let Ok(Some(status)) = s.child.try_wait()
        {
            let log = std::fs::read_to_string(s.data_dir.path().join("server.log"));
            let log = log.unwrap_or_default();
            return Err(format!("the server exited at startup ({status}):\n{log}"));
        }
        let answer = api.client.get(format!("{}/readyz", api.base)).send().await;
        match answer {
            Ok(r) if r.status() == StatusCode::OK => return Ok(()),
            _ if Instant::now() > give_up => {
                let url = format!("{}/readyz", api.base);
                return Err(format!("{url} did not answer 200 within 15 s: {answer:?}"));
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A fresh database for a bench server on the PostgreSQL server `base`.
async fn create_database(base: &str, name: &str) -> Result<String, String> {
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

async fn drop_database(base: &str, name: &str) {
    use sqlx::Connection;
    if let Ok(mut c) = sqlx::PgConnection::connect(&format!("{base}/postgres")).await {
        let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
        if let Err(e) = sqlx::query(&sql).execute(&mut c).await {
            eprintln!("holdfast-bench: could not drop {name}: {e}");
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let client = Client::builder()
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(90)) // longer than the 60 s contended wait
        .build();
    let client = ctx(client, "cannot build the HTTP client")?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let run_id = format!("{nanos:x}");
    let bench_db = format!("holdfast_bench_{run_id}");

    // (store, API, the server when the bench started it)
    let mut targets = Vec::new();
    if let Some(url) = &args.url {
        let store = args.stores.first().cloned().unwrap_or_default();
        targets.push((store, url.clone(), None));
    } else {
        for store in &args.stores {
            let database = match store.as_str() {
                "postgres" => Some(create_database(&args.postgres, &bench_db).await?),
                _ => None,
            };
            let (server, url) = start_server(database.as_deref())?;
            targets.push((store.clone(), url, Some(server)));
        }
    }
    let mut apis = Vec::new();
    for (store, base, server) in &mut targets {
        let api = Api {
            client: client.clone(),
            base: base.clone(),
        };
        wait_ready(&api, server.as_mut()).await?;
        apis.push((store.clone(), api));
    }

    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let secs = args.seconds;
    let ours = if args.url.is_some() { "no" } else { "yes" };
    for (store, api) in &apis {
        println!(
            "holdfast-bench: {store} server {}, started by bench: {ours}",
            api.base
        );
    }
    let shared = if args.url.is_none() {
        " (shared by bench and server)"
    } else {
        ""
    };
    println!("nproc {nproc}{shared}, run id {run_id}, {secs} s per run\n");
    for &workload in &args.workloads {
        for &c in &args.concurrency {
            for (store, api) in &apis {
                run_workload(api, store, workload, c, args.seconds, &run_id).await;
            }
        }
    }

    for (store, _, server) in targets {
        if let Some(mut s) = server {
            ctx(s.child.kill().await, "cannot kill the server")?;
            if store == "postgres" {
                drop_database(&args.postgres, &bench_db).await;
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let result = parse_args()
        .map_err(|e| format!("{e}\n{USAGE}"))
        .and_then(|args| {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build();
            ctx(runtime, "cannot start the tokio runtime")?.block_on(run(args))
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("holdfast-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

//! Load benchmark for the holdfast lease and process API (a program, not a timed test),
//! optionally side by side with an anchor service (etcd, supervisord).
//!
//! Run it with:
//!
//! ```text
//! cargo build --release
//! cargo bench --bench holdfast-bench -- [--url http://127.0.0.1:7427] \
//!     [--concurrency 1,8,64] [--seconds 5] [--workload churn,renew,contended,spawn,stop50] \
//!     [--stores sqlite,postgres] [--postgres postgres://postgres@127.0.0.1:5432] \
//!     [--against etcd,supervisord] [--prefill leases=N,processes=M[,resources=R][,events=K]] \
//!     [--floors yes] [--hosts N] [--keyed yes]
//! ```
//!
//! `--stores` (without `--url`) starts one server per store and runs every
//! workload and C on each in turn, so the stores are compared in the same run
//! under the same machine load. For `postgres` the bench creates a database
//! `holdfast_bench_<run id>` on the `--postgres` server and drops it at the end.
//!
//! Without `--url` the bench builds nothing: it starts `target/release/holdfast serve`
//! (run `cargo build --release` first; `HOLDFAST_BENCH_BINARY` names another build) on a free loopback port with a fresh temporary
//! data dir and no `HOLDFAST_*` variables, waits for `/readyz`, and kills it at the end
//! (and what it spawned); the server's output goes to `server.log` in that dir. With
//! `--url` it uses that server; resource names carry a run id, so reruns against it do
//! not collide.
//!
//! `--against etcd,supervisord` (either or both) also starts each anchor the same
//! way (free loopback ports, fresh temp dir; `scripts/bench-anchors` installs them)
//! and runs each point (workload and C) on every holdfast store and then on the
//! anchors of that workload, in turn; after each point it prints one line per store
//! and anchor: `ratio <workload> C=<c> holdfast/<store> / <anchor> = X.XXx`. etcd
//! (`etcd.rs`, v3 JSON gateway, fsync on) is the anchor of churn, renew and
//! contended; supervisord (`supervisord.rs`, XML-RPC) of spawn and stop50.
//!
//! `--prefill leases=N,processes=M` (without `--url`) starts two servers per
//! store: one on an empty store and one, `prefilled/<store>` (on a database of
//! its own for `postgres`), on a store that holds N ended leases and M ended
//! processes (optionally on R resources and with the end events of the newest K
//! records; `prefill.rs` says what the rows are). That one is started once so that
//! it creates its schema, stopped with SIGTERM, the rows are written straight into
//! its `holdfast.db` in one transaction, and it is started again on the same data
//! dir (PostgreSQL: into its database, then ANALYZE, `prefill_postgres.rs`); the
//! bench prints how long that took and the store's size. Each point runs on both
//! in turn and is followed by `ratio <workload> C=<c> prefilled/<store> / empty =
//! X.XXx`.
//!
//! `--hosts N` (with the `postgres` store, without `--url`) also starts N servers
//! on one database of their own (`holdfast_bench_<run id>_fleet`), as the hosts of
//! a fleet share one: the target `fleet<N>/postgres`, whose client `i` talks to
//! host `i % N` (in `contended`, waiters on one host are handed the lease by
//! releases on another). Its `cpu` is that of all N servers, `ops/commit` and
//! `rt/op` are summed over them, and each point is followed by `ratio <workload>
//! C=<c> fleet<N>/postgres / postgres = X.XXx`.
//!
//! `--keyed yes` sends every holdfast POST with an `Idempotency-Key` of its own,
//! as a client does that may retry it (the anchors' requests are unchanged).
//!
//! `--floors yes` precedes every point whose operations run one after another (C=1,
//! and hand-offs at every C) with the steps no server can skip, each timed alone
//! (`floor-request`, `floor-commit/sqlite`, `floor-commit/postgres`; `floors.rs`),
//! and follows it with one line per store: `bound <workload> C=<c> holdfast/<store> =
//! X/s (...): measured Y% of it; the bound is Z.ZZx <anchor>`.
//!
//! For every holdfast server it started, the bench prints `holdfast/<store> rss
//! idle X MiB` once all are ready and before any load, and `rss after X MiB` at the
//! end (VmRSS from /proc/<pid>/status, with the peak VmHWM and, for SQLite, the
//! size of the store's files).
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
//!   in C blocking threads; each spawn line gives its rate as a ratio of that one.
//! - `stop50` (issue 12: stopping 50 running children should take under 100 ms),
//!   always at C=50, `--concurrency` ignored: a round spawns 50 processes as `spawn`
//!   does, then sends their 50 stops at once (each 200 and `stopped`) and times from
//!   the first stop sent to the last answer; rounds repeat for `--seconds` (at least
//!   3). p50/p99 are those of the round times (the line repeats the median as
//!   `median X ms`), the rate is 50 / median in stops/s, `cpu` and `ops/commit` are
//!   per round (100 requests). A round with a failed spawn or stop counts its
//!   failures as errors and is not timed.
//!
//! `errors` counts unexpected statuses and failed requests (the bench never panics on
//! one). Rates divide by the wall time until the last client finished. When the bench
//! started the server, the line ends with `cpu X.XX ms/op`: the server's CPU time
//! (user + system, from /proc/<pid>/stat) over the run per operation. A holdfast line
//! ends with `ops/commit X.X`: requests answered (3 per churn cycle, 2 per hand-off or
//! spawn cycle, 1 per renewal) per durable commit, from the change of
//! `holdfast_store_commits_total{sync="full"}` in GET /metrics over the run (`-` when
//! the server does not export it), then `rt/op X.X`: the sends of write statements
//! to PostgreSQL per request (`holdfast_store_round_trips_total`; 0 on SQLite).
//! When the bench starts the servers, they share with it the CPUs that `nproc` reports in the header. Ctrl-C or SIGTERM stops the run and
//! everything the bench started.

mod etcd;
mod floors;
mod holdfast;
mod prefill;
mod prefill_postgres;
mod process;
mod reference;
mod report;
mod stats;
mod supervisord;
mod target;

use std::fmt::Display;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::Client;

use crate::prefill::Prefill;
use crate::target::{Endpoint, Target};

const USAGE: &str = "usage: cargo bench --bench holdfast-bench -- [--url URL] \
    [--concurrency 1,8,64] [--seconds 5] [--workload churn,renew,contended,spawn,stop50] \
    [--stores sqlite,postgres] [--postgres URL] [--against etcd,supervisord] \
    [--prefill leases=N,processes=M[,resources=R][,events=K]] [--floors yes|no] [--hosts N]";

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    Churn,
    Renew,
    Contended,
    Spawn,
    Stop50,
}

/// The children `stop50` starts and then stops at once.
pub const STOP50_CHILDREN: usize = 50;

impl Workload {
    const ALL: [Workload; 5] = [
        Workload::Churn,
        Workload::Renew,
        Workload::Contended,
        Workload::Spawn,
        Workload::Stop50,
    ];

    /// Its name and the unit of its rate.
    pub fn labels(self) -> (&'static str, &'static str) {
        match self {
            Workload::Churn => ("churn", "cycles/s"),
            Workload::Renew => ("renew", "renewals/s"),
            Workload::Contended => ("contended", "handoffs/s"),
            Workload::Spawn => ("spawn", "cycles/s"),
            Workload::Stop50 => ("stop50", "stops/s"),
        }
    }
}

/// A service that holdfast is measured against.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Anchor {
    Etcd,
    Supervisord,
}

impl Anchor {
    const ALL: [Anchor; 2] = [Anchor::Etcd, Anchor::Supervisord];

    /// Its name, its binary and the Debian package that has it.
    fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Anchor::Etcd => ("etcd", "etcd", "etcd-server"),
            Anchor::Supervisord => ("supervisord", "supervisord", "supervisor"),
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
    against: Vec<Anchor>,
    prefill: Option<Prefill>,
    /// `--floors yes`: each point with a bound is preceded by its floors (`floors.rs`).
    floors: bool,
    /// `--hosts N`: the `postgres` store also runs as N servers on one database.
    hosts: usize,
    /// `--keyed yes`: holdfast's requests carry an `Idempotency-Key` each.
    keyed: bool,
}

/// Adds what failed to an error, for `?` on setup steps.
pub fn ctx<T, E: Display>(r: Result<T, E>, what: impl Display) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

fn parse_list<T>(v: &str, item: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, String> {
    let bad = |s: &str| format!("bad list item {s:?}");
    v.split(',')
        .map(|s| item(s.trim()).ok_or_else(|| bad(s)))
        .collect()
}

fn yes_or_no(flag: &str, value: &str) -> Result<bool, String> {
    match value {
        "yes" => Ok(true),
        "no" => Ok(false),
        _ => Err(format!("{flag}: {value:?} is neither yes nor no")),
    }
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        url: None,
        stores: vec!["sqlite".into()],
        postgres: "postgres://postgres@127.0.0.1:5432".into(),
        concurrency: vec![1, 8, 64],
        seconds: 5.0,
        workloads: Workload::ALL.to_vec(),
        against: Vec::new(),
        prefill: None,
        floors: false,
        hosts: 1,
        keyed: false,
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
            "--against" => {
                let known = |s: &str| Anchor::ALL.into_iter().find(|a| a.names().0 == s);
                let mut against = ctx(parse_list(&value, known), "--against")?;
                against.sort_by_key(|&a| a as u8);
                against.dedup();
                args.against = against;
            }
            "--prefill" => args.prefill = Some(ctx(Prefill::parse(&value), "--prefill")?),
            "--hosts" => match value.parse::<usize>() {
                Ok(n) if n > 0 => args.hosts = n,
                _ => return Err(format!("--hosts: {value:?} is not a positive number")),
            },
            "--floors" => args.floors = yes_or_no("--floors", &value)?,
            "--keyed" => args.keyed = yes_or_no("--keyed", &value)?,
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    if args.url.is_some() && args.stores.len() > 1 {
        return Err("--url measures one server: give --stores only without it".into());
    }
    if args.hosts > 1 && (args.url.is_some() || !args.stores.iter().any(|s| s == "postgres")) {
        return Err("--hosts runs servers the bench starts on PostgreSQL: give --stores postgres, not --url".into());
    }
    if args.url.is_some() && args.prefill.is_some() {
        return Err("--prefill writes into the stores the bench starts: not with --url".into());
    }
    Ok(args)
}

/// The servers of one run, and the databases made for them: what the end removes,
/// however the run ends.
#[derive(Default)]
struct Bench {
    targets: Vec<Target>,
    databases: Vec<String>,
    /// The database of `floor-commit/postgres`, with `--floors yes` and a
    /// PostgreSQL store.
    floor_database: Option<String>,
}

impl Bench {
    /// Starts (or, with `--url`, reaches) every server and waits until each is ready.
    async fn setup(&mut self, args: &Args, client: &Client, run_id: &str) -> Result<(), String> {
        let mut anchors = Vec::new();
        for &anchor in &args.against {
            let (_, bin, package) = anchor.names();
            anchors.push((anchor, process::find_anchor(bin, package)?));
        }
        if let Some(url) = &args.url {
            let store = args.stores.first().cloned().unwrap_or_default();
            self.targets.push(Target {
                label: store,
                url: url.clone(),
                version: None,
                endpoint: Endpoint::Holdfast(holdfast::Api::new(client, url.clone())),
                server: None,
                others: Vec::new(),
                prefilled: false,
            });
        } else {
            for store in &args.stores {
                let database = match store.as_str() {
                    "postgres" => {
                        let name = format!("holdfast_bench_{run_id}");
                        let url = holdfast::create_database(&args.postgres, &name).await?;
                        self.databases.push(name);
                        Some(url)
                    }
                    _ => None,
                };
                let (server, url) = holdfast::start_server(database.as_deref(), None).await?;
                self.targets.push(Target {
                    label: store.clone(),
                    url: url.clone(),
                    version: None,
                    endpoint: Endpoint::Holdfast(holdfast::Api::new(client, url)),
                    server: Some(server),
                    others: Vec::new(),
                    prefilled: false,
                });
                if store == "postgres" && args.hosts > 1 {
                    let name = format!("holdfast_bench_{run_id}_fleet");
                    let url = holdfast::create_database(&args.postgres, &name).await?;
                    self.databases.push(name);
                    self.targets
                        .push(start_fleet(client, &url, args.hosts).await?);
                }
                if let Some(p) = &args.prefill {
                    let database = match store.as_str() {
                        "postgres" => {
                            let name = format!("holdfast_bench_{run_id}_prefilled");
                            let url = holdfast::create_database(&args.postgres, &name).await?;
                            self.databases.push(name);
                            Some(url)
                        }
                        _ => None,
                    };
                    let target = start_prefilled(client, p, store, database.as_deref()).await?;
                    self.targets.push(target);
                }
            }
        }
        if args.floors && args.stores.iter().any(|s| s == "postgres") {
            let name = format!("holdfast_bench_{run_id}_floor");
            let url = holdfast::create_database(&args.postgres, &name).await?;
            self.databases.push(name);
            self.floor_database = Some(url);
        }
        for (anchor, bin) in anchors {
            let max_c = args.concurrency.iter().copied().max().unwrap_or(1);
            let (server, url, endpoint) = match anchor {
                Anchor::Etcd => {
                    let (server, url) = etcd::start(&bin)?;
                    let etcd = etcd::Etcd {
                        client: client.clone(),
                        base: url.clone(),
                    };
                    (server, url, Endpoint::Etcd(etcd))
                }
                Anchor::Supervisord => {
                    let programs = match args.workloads.contains(&Workload::Stop50) {
                        true => max_c.max(STOP50_CHILDREN),
                        false => max_c,
                    };
                    let (server, url) = supervisord::start(&bin, programs)?;
                    let rpc = supervisord::Rpc {
                        client: client.clone(),
                        url: url.clone(),
                    };
                    (server, url, Endpoint::Supervisord(rpc))
                }
            };
            self.targets.push(Target {
                label: anchor.names().0.into(),
                url,
                version: None,
                endpoint,
                server: Some(server),
                others: Vec::new(),
                prefilled: false,
            });
        }
        for t in &mut self.targets {
            t.version = match &mut t.endpoint {
                Endpoint::Holdfast(api) => {
                    api.keyed = args.keyed;
                    holdfast::wait_ready(api, t.server.as_mut()).await?;
                    None
                }
                Endpoint::Etcd(etcd) => {
                    let server = t.server.as_mut().ok_or("etcd: not started")?;
                    Some(etcd::wait_ready(etcd, server).await?)
                }
                Endpoint::Supervisord(rpc) => {
                    let server = t.server.as_mut().ok_or("supervisord: not started")?;
                    Some(supervisord::wait_ready(rpc, server).await?)
                }
            };
        }
        Ok(())
    }

    /// Every point in turn on every target that runs its workload, with the ratios.
    async fn measure(&self, args: &Args, run_id: &str) {
        for t in &self.targets {
            let ours = if t.server.is_some() { "yes" } else { "no" };
            let (name, url) = (&t.label, &t.url);
            match &t.version {
                None => println!("holdfast-bench: {name} server {url}, started by bench: {ours}"),
                Some(v) => {
                    let runs: Vec<_> = (Workload::ALL.into_iter())
                        .filter(|&w| t.supports(w))
                        .map(|w| w.labels().0)
                        .collect();
                    let runs = runs.join(", ");
                    println!(
                        "holdfast-bench: {name} {v} server {url}, started by bench: {ours} \
                         (anchor of {runs})"
                    );
                }
            }
        }
        let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
        let secs = args.seconds;
        let shared = if args.url.is_none() || !args.against.is_empty() {
            " (shared by bench and servers)"
        } else {
            ""
        };
        for t in &self.targets {
            if let (Endpoint::Holdfast(_), Some(server)) = (&t.endpoint, &t.server) {
                let store = server.dir().and_then(prefill::store_mib);
                report::rss(&t.label, "idle", server.rss_mib(), store);
            }
        }
        println!("nproc {nproc}{shared}, run id {run_id}, {secs} s per run\n");
        for &workload in &args.workloads {
            let concurrency = match workload {
                Workload::Stop50 => vec![STOP50_CHILDREN], // ignores --concurrency
                _ => args.concurrency.clone(),
            };
            for c in concurrency {
                let reference = match workload {
                    Workload::Spawn => reference::spawn_reference(c, secs).await,
                    _ => f64::NAN,
                };
                let floors = match args.floors && floors::applies(workload, c) {
                    true => self.floors(secs).await,
                    false => None,
                };
                let mut rates = Vec::new();
                for t in self.targets.iter().filter(|t| t.supports(workload)) {
                    let rate = t.measure(workload, c, secs, run_id, reference).await;
                    rates.push((t, rate));
                }
                let name = workload.labels().0;
                let mut ratios = false;
                for (anchor, theirs) in rates.iter().filter(|(t, _)| t.is_anchor()) {
                    for (store, ours) in rates.iter().filter(|(t, _)| !t.is_anchor()) {
                        report::ratio(name, c, &store.label, *ours, &anchor.label, *theirs);
                        ratios = true;
                    }
                }
                if let Some(f) = &floors {
                    let anchor = rates.iter().find(|(t, _)| t.is_anchor());
                    let anchor = anchor.map(|(t, rate)| (t.label.as_str(), *rate));
                    for (t, ours) in rates.iter().filter(|(t, _)| !t.is_anchor()) {
                        let store = t.baseline().map_or(t.label.as_str(), |(s, _)| s);
                        if let Some(b) = floors::bound_ms(f, workload, c, store, reference) {
                            floors::print_bound((name, c), &t.label, b, *ours, anchor);
                            ratios = true;
                        }
                    }
                }
                for (t, ours) in &rates {
                    let Some((base, shown)) = t.baseline() else {
                        continue;
                    };
                    let theirs = rates.iter().find(|(b, _)| b.label == base && !b.prefilled);
                    if let Some((_, theirs)) = theirs {
                        report::baseline_ratio((name, c), &t.label, *ours, shown, *theirs);
                        ratios = true;
                    }
                }
                if ratios {
                    println!();
                }
            }
        }
    }

    /// The floors before a point (`floors.rs`), on the first holdfast server; None,
    /// with the reason on stderr, when one cannot be measured.
    async fn floors(&self, secs: f64) -> Option<floors::Floors> {
        let (api, server) = self.targets.iter().find_map(|t| match &t.endpoint {
            Endpoint::Holdfast(api) => Some((api, t.server.as_ref())),
            _ => None,
        })?;
        let pg = self.floor_database.as_deref();
        match floors::measure(api, server, pg, secs.min(2.0)).await {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!("holdfast-bench: floors: {e}");
                None
            }
        }
    }

    /// Stops every server the bench started, then drops its databases.
    async fn teardown(self, args: &Args) {
        for t in &self.targets {
            if let (Endpoint::Holdfast(_), Some(server)) = (&t.endpoint, &t.server) {
                let store = server.dir().and_then(prefill::store_mib);
                report::rss(&t.label, "after", server.rss_mib(), store);
            }
        }
        for t in self.targets {
            for server in t.server.into_iter().chain(t.others) {
                server.stop().await;
            }
        }
        for name in self.databases {
            holdfast::drop_database(&args.postgres, &name).await;
        }
    }
}

/// Starts a holdfast on `store` (SQLite, or PostgreSQL on `database`), stops it
/// once it has made its schema, writes `p` into its store and starts it again on
/// it (see `prefill.rs`); prints how long that took.
async fn start_prefilled(
    client: &Client,
    p: &Prefill,
    store: &str,
    database: Option<&str>,
) -> Result<Target, String> {
    let started = std::time::Instant::now();
    let (mut server, url) = holdfast::start_server(database, None).await?;
    let api = holdfast::Api::new(client, url);
    holdfast::wait_ready(&api, Some(&mut server)).await?;
    let dir = server
        .stop_keeping_dir(rustix::process::Signal::TERM)
        .await
        .ok_or("prefill: the server's data dir is gone")?;
    let (written, mib) = match database {
        Some(db) => {
            let written = prefill_postgres::postgres(db, dir.path(), p).await?;
            (written, prefill_postgres::database_mib(db).await)
        }
        None => (
            prefill::sqlite(dir.path(), p).await?,
            prefill::store_mib(dir.path()),
        ),
    };
    let mib = mib.unwrap_or(0.0);
    let (mut server, url) = holdfast::start_server(database, Some(dir)).await?;
    let api = holdfast::Api::new(client, url.clone());
    let restarted = std::time::Instant::now();
    holdfast::wait_ready(&api, Some(&mut server)).await?;
    println!(
        "holdfast-bench: prefilled/{store}: {} written in {:.1} s, store {mib:.1} MiB, \
         ready again in {:.2} s, {:.1} s in all",
        p.describe(),
        written.as_secs_f64(),
        restarted.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    Ok(Target {
        label: format!("prefilled/{store}"),
        url,
        version: None,
        endpoint: Endpoint::Holdfast(api),
        server: Some(server),
        others: Vec::new(),
        prefilled: true,
    })
}

/// Starts `hosts` holdfast servers on the one PostgreSQL database `url`, as
/// hosts of a fleet are (`--hosts N`): one target, `fleet<N>/postgres`, whose
/// clients are spread over them.
async fn start_fleet(client: &Client, url: &str, hosts: usize) -> Result<Target, String> {
    let mut servers = Vec::with_capacity(hosts);
    let mut bases = Vec::with_capacity(hosts);
    for _ in 0..hosts {
        let (server, base) = holdfast::start_server(Some(url), None).await?;
        servers.push(server);
        bases.push(base);
    }
    let server = servers.remove(0);
    let base = bases.remove(0);
    let api = holdfast::Api {
        others: bases,
        ..holdfast::Api::new(client, base.clone())
    };
    for host in 1..hosts {
        holdfast::wait_ready(&api.host(host), servers.get_mut(host - 1)).await?;
    }
    Ok(Target {
        label: format!("fleet{hosts}/postgres"),
        url: base,
        version: None,
        endpoint: Endpoint::Holdfast(api),
        server: Some(server),
        others: servers,
        prefilled: false,
    })
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM, with the signal's name.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        return std::future::pending().await;
    };
    let Ok(mut int) = signal(SignalKind::interrupt()) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
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

    let mut bench = Bench::default();
    let result = tokio::select! {
        r = async {
            bench.setup(&args, &client, &run_id).await?;
            bench.measure(&args, &run_id).await;
            Ok(())
        } => r,
        signal = interrupted() => Err(format!("stopped by {signal}")),
    };
    bench.teardown(&args).await;
    result
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

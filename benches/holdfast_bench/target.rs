//! One server under load (a holdfast store or an anchor) and one measured run on it.

use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use crate::process::Started;
use crate::stats::{Stats, merge};
use crate::{STOP50_CHILDREN, Workload, etcd, holdfast, report, supervisord};

/// How the bench talks to a server.
pub enum Endpoint {
    Holdfast(holdfast::Api),
    Etcd(etcd::Etcd),
    Supervisord(supervisord::Rpc),
}

pub struct Target {
    /// The store (`sqlite`, `postgres`) of a holdfast, else the anchor's name.
    pub label: String,
    /// Where it answers (shown in the header).
    pub url: String,
    /// An anchor's version, once it is ready.
    pub version: Option<String>,
    pub endpoint: Endpoint,
    /// The process, when the bench started it.
    pub server: Option<Started>,
    /// With `--hosts N`, the servers of the other hosts, on the same database.
    pub others: Vec<Started>,
    /// A holdfast on a store the bench prefilled (`--prefill`), labelled
    /// `prefilled/<store>`.
    pub prefilled: bool,
}

impl Target {
    pub fn is_anchor(&self) -> bool {
        !matches!(self.endpoint, Endpoint::Holdfast(_))
    }

    /// What a holdfast is compared with besides the anchors: the label of the
    /// target on one server and an empty store, and its name in the ratio line.
    /// A prefilled store (`--prefill`) is compared with the empty one (`empty`),
    /// a fleet (`--hosts N`) with its store on one server.
    pub fn baseline(&self) -> Option<(&str, &str)> {
        if self.prefilled {
            let store = self.label.strip_prefix("prefilled/")?;
            return Some((store, "empty"));
        }
        if self.others.is_empty() {
            return None;
        }
        let (_, store) = self.label.split_once('/')?;
        Some((store, store))
    }

    /// The CPU time of its servers so far, in seconds.
    fn cpu_seconds(&self) -> Option<f64> {
        let mut sum = self.server.as_ref()?.cpu_seconds()?;
        for other in &self.others {
            sum += other.cpu_seconds()?;
        }
        Some(sum)
    }

    pub fn supports(&self, workload: Workload) -> bool {
        match self.endpoint {
            Endpoint::Holdfast(_) => true,
            Endpoint::Etcd(_) => !matches!(workload, Workload::Spawn | Workload::Stop50),
            Endpoint::Supervisord(_) => matches!(workload, Workload::Spawn | Workload::Stop50),
        }
    }

    /// Client task `i` of `workload`; `prefix` names this run's resources.
    fn client(
        &self,
        workload: Workload,
        i: usize,
        prefix: &str,
        until: Instant,
    ) -> JoinHandle<Stats> {
        let own = format!("{prefix}/{i}");
        match (&self.endpoint, workload) {
            (Endpoint::Holdfast(api), w) => {
                let api = api.host(i);
                match w {
                    Workload::Churn => tokio::spawn(holdfast::churn_client(api, own, until)),
                    Workload::Renew => tokio::spawn(holdfast::renew_client(api, own, until)),
                    Workload::Contended => {
                        tokio::spawn(holdfast::contended_client(api, prefix.into(), until))
                    }
                    Workload::Spawn => tokio::spawn(holdfast::spawn_client(api, until)),
                    Workload::Stop50 => unsupported(), // `stop_rounds` runs it
                }
            }
            (Endpoint::Etcd(etcd), w) => {
                let etcd = etcd.clone();
                match w {
                    Workload::Churn => tokio::spawn(etcd::churn_client(etcd, own, until)),
                    Workload::Renew => tokio::spawn(etcd::renew_client(etcd, until)),
                    Workload::Contended => {
                        tokio::spawn(etcd::contended_client(etcd, prefix.into(), until))
                    }
                    Workload::Spawn | Workload::Stop50 => unsupported(),
                }
            }
            (Endpoint::Supervisord(rpc), Workload::Spawn) => {
                let program = supervisord::program(i);
                tokio::spawn(supervisord::spawn_client(rpc.clone(), program, until))
            }
            (Endpoint::Supervisord(_), _) => unsupported(),
        }
    }

    /// Runs `workload` with `c` client tasks for `seconds` and prints its line (`spawn`
    /// gives its rate as a ratio of `reference`); returns the rate.
    pub async fn measure(
        &self,
        workload: Workload,
        c: usize,
        seconds: f64,
        run_id: &str,
        reference: f64,
    ) -> f64 {
        let (name, unit) = workload.labels();
        let cpu_before = self.cpu_seconds();
        let (commits_before, trips_before) = match &self.endpoint {
            Endpoint::Holdfast(api) => (api.durable_commits().await, api.round_trips().await),
            _ => (None, None),
        };
        let started = Instant::now();
        let deadline = started + Duration::from_secs_f64(seconds);
        let prefix = format!("bench/{name}/{run_id}/{}/{c}", self.label);
        let (mut total, rate) = match workload {
            Workload::Stop50 => {
                let mut total = self.stop_rounds(deadline).await;
                total.latencies_us.sort_unstable();
                let rate = STOP50_CHILDREN as f64 * 1000.0 / total.percentile_ms(50.0);
                (total, rate)
            }
            _ => {
                let tasks = (0..c)
                    .map(|i| self.client(workload, i, &prefix, deadline))
                    .collect();
                let total = merge(tasks, name).await;
                let rate = total.ops as f64 / started.elapsed().as_secs_f64();
                (total, rate)
            }
        };

        let mut extra = match workload {
            Workload::Contended => format!("   lost {}", total.lost),
            Workload::Stop50 => format!(
                "   median {:.2} ms   rounds {}",
                total.percentile_ms(50.0),
                total.ops
            ),
            Workload::Spawn => format!("   ratio {:.2} of raw fork+exec+wait", rate / reference),
            _ => String::new(),
        };
        let cpu_after = self.cpu_seconds();
        if let (Some(before), Some(after)) = (cpu_before, cpu_after) {
            extra += &report::cpu(after - before, total.ops);
        }
        if let Endpoint::Holdfast(api) = &self.endpoint {
            let commits = match (commits_before, api.durable_commits().await) {
                (Some(before), Some(after)) => Some(after - before),
                _ => None,
            };
            let requests = total.ops * holdfast::requests_per_op(workload);
            extra += &report::ops_per_commit(requests, commits);
            if let (Some(before), Some(after)) = (trips_before, api.round_trips().await) {
                extra += &report::round_trips(requests, after - before);
            }
        }
        let label = format!("{name}/{}", self.label);
        report::run_line(&mut total, (&label, unit), c, rate, &extra);
        rate
    }
}

impl Target {
    /// The rounds of `stop50` (see `holdfast::stop_round`, `supervisord::stop_round`)
    /// until `deadline`, at least 3; one latency per round timed.
    async fn stop_rounds(&self, deadline: Instant) -> Stats {
        let mut stats = Stats::default();
        let mut rounds = 0;
        while rounds < 3 || Instant::now() < deadline {
            rounds += 1;
            let (time, errors) = match &self.endpoint {
                Endpoint::Holdfast(api) => holdfast::stop_round(api, STOP50_CHILDREN).await,
                Endpoint::Supervisord(rpc) => supervisord::stop_round(rpc, STOP50_CHILDREN).await,
                Endpoint::Etcd(_) => (None, 1),
            };
            stats.errors += errors;
            match time {
                Some(t) => stats.record(t),
                None => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
        stats
    }
}

/// The client of a workload a target does not run (`supports` keeps it from being
/// asked for): one error.
fn unsupported() -> JoinHandle<Stats> {
    tokio::spawn(async {
        Stats {
            errors: 1,
            ..Stats::default()
        }
    })
}

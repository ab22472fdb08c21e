//! Prometheus metrics, kept apart from the code they count.

pub mod format;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Code {
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Request {
    method: String,
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Route {
    method: String,
    route: String,
}

type Histo = Family<Route, Histogram, fn() -> Histogram>;

/// Acquirers waiting: on this host, and on the fleet's others.
pub struct Waiting {
    pub here: usize,
    pub elsewhere: usize,
}

pub struct Metrics {
    registry: Registry,
    current_leases: Gauge,
    current_processes: Gauge,
    store_up: Gauge,
    waiting_requests: Gauge,
    lease_waiters: Gauge,
    remote_waiters: Gauge,
    acquisitions: Counter,
    takeovers: Family<Reason, Counter>,
    conflicts: Family<Code, Counter>,
    requests: Family<Request, Counter>,
    latency: Histo,
    /// Current processes kept past their heartbeat TTL because their
    /// owner's liveness cannot be checked, as of the last pass.
    pub owner_unverifiable: Gauge,
    /// Passes of the reconciler: that it runs, and a point to wait for.
    pub reconciler_passes: Counter,
}

fn latency_histogram() -> Histogram {
    // 50 µs .. ~1.6 s
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

impl Metrics {
    /// The metrics of a server whose store counts its writes in `writes`.
    pub fn new(writes: crate::store::counters::WriteCounters) -> Self {
        let mut registry = Registry::with_prefix("holdfast");
        let m = Self {
            current_leases: Gauge::default(),
            current_processes: Gauge::default(),
            store_up: Gauge::default(),
            waiting_requests: Gauge::default(),
            lease_waiters: Gauge::default(),
            remote_waiters: Gauge::default(),
            acquisitions: Counter::default(),
            takeovers: Family::default(),
            conflicts: Family::default(),
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            reconciler_passes: Counter::default(),
            owner_unverifiable: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register(
            "leases_current",
            "Current (reserved or active) leases",
            m.current_leases.clone(),
        );
        registry.register(
            "store_up",
            "1 when this scrape read the current counts from the store; 0 when it could not (they keep their last values)",
            m.store_up.clone(),
        );
        registry.register(
            "waiting_requests",
            "Requests waiting now: acquires with wait_ms, long polls, SSE streams (past 2048, 503 busy)",
            m.waiting_requests.clone(),
        );
        registry.register(
            "lease_waiters",
            "Acquire requests waiting for a held lease (wait_ms)",
            m.lease_waiters.clone(),
        );
        registry.register(
            "lease_waiters_remote",
            "Acquire requests waiting on the other hosts of the fleet, as they announced them",
            m.remote_waiters.clone(),
        );
        registry.register(
            "processes_current",
            "Current (starting, running, stopping or orphaned) processes",
            m.current_processes.clone(),
        );
        registry.register(
            "lease_acquisitions",
            "Leases acquired",
            m.acquisitions.clone(),
        );
        registry.register(
            "lease_takeovers",
            "Leases ended so that another could take over, or by the reconciler, by end reason",
            m.takeovers.clone(),
        );
        registry.register(
            "lease_conflicts",
            "Lease requests refused, by error code",
            m.conflicts.clone(),
        );
        registry.register(
            "http_requests",
            "HTTP requests by route and status",
            m.requests.clone(),
        );
        registry.register(
            "http_request_duration_seconds",
            "HTTP request latency by route",
            m.latency.clone(),
        );
        registry.register(
            "reconciler_passes",
            "Passes of the reconciler over leases and processes",
            m.reconciler_passes.clone(),
        );
        registry.register(
            "processes_owner_unverifiable",
            "Processes kept past their heartbeat TTL because their owner cannot be verified",
            m.owner_unverifiable.clone(),
        );
        registry.register(
            "store_transactions",
            "Write transactions run by the group commit, one batch of mutations each, by sync level (full: synced to stable storage before any answer, one fdatasync of the WAL on SQLite)",
            writes.commits,
        );
        registry.register(
            "store_transaction_jobs",
            "Mutations run by those transactions (mutations per transaction = this / store_transactions)",
            writes.jobs,
        );
        registry.register(
            "store_round_trips",
            "Sends of write statements, each a round trip: to the PostgreSQL server (transactions and one-statement renewals), or to the thread of SQLite's writer connection (round trips per mutation = this / store_transaction_jobs)",
            writes.round_trips,
        );
        Self { registry, ..m }
    }
}

/// Collapse `owner_dead:pid_absent` and `broken:<free text>` into bounded labels.
fn reason_label(reason: &str) -> String {
    if reason.starts_with("broken:") {
        "broken".into()
    } else {
        reason.to_owned()
    }
}

impl Metrics {
    pub fn acquired(&self, took_over: Option<&str>) {
        self.acquisitions.inc();
        if let Some(reason) = took_over {
            self.takeovers
                .get_or_create(&Reason {
                    reason: reason_label(reason),
                })
                .inc();
        }
    }

    pub fn ended_by_reconciler(&self, reason: &str) {
        self.takeovers
            .get_or_create(&Reason {
                reason: reason_label(reason),
            })
            .inc();
    }

    /// A lease request refused with the contract's `code`.
    pub fn lease_refused(&self, code: crate::model::Code) {
        let code = code.as_str();
        self.conflicts.get_or_create(&Code { code }).inc();
    }

    pub fn request(&self, method: &str, route: &str, status: u16, seconds: f64) {
        let (method, route) = (method.to_owned(), route.to_owned());
        self.latency
            .get_or_create(&Route {
                method: method.clone(),
                route: route.clone(),
            })
            .observe(seconds);
        self.requests
            .get_or_create(&Request {
                method,
                route,
                status,
            })
            .inc();
    }

    /// The OpenMetrics exposition, with the current leases and processes as
    /// counted just now; None when the store could not count them (a
    /// scrape during an outage still answers, `store_up` 0).
    pub fn render(&self, current: Option<(i64, i64)>, waiters: Waiting, waiting: usize) -> String {
        self.store_up.set(i64::from(current.is_some()));
        self.waiting_requests
            .set(i64::try_from(waiting).unwrap_or(i64::MAX));
        if let Some((leases, processes)) = current {
            self.current_leases.set(leases);
            self.current_processes.set(processes);
        }
        self.lease_waiters
            .set(i64::try_from(waiters.here).unwrap_or(i64::MAX));
        self.remote_waiters
            .set(i64::try_from(waiters.elsewhere).unwrap_or(i64::MAX));
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

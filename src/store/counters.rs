//! What the group commit did, for /metrics. Kept apart from the writers
//! that count it and the store interface that hands it out, so that
//! neither imports the other for it.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SyncLabel {
    sync: &'static str,
}

/// What the group commit did, for /metrics: the transactions it ran by sync
/// level (`full`: synced to stable storage before the answer, one fdatasync on
/// SQLite) and the jobs they ran, so that jobs per commit can be read.
#[derive(Clone)]
pub struct WriteCounters {
    pub commits: Family<SyncLabel, Counter>,
    pub jobs: Counter,
    /// Sends of write statements to PostgreSQL's server, each a round
    /// trip (SQLite's writer runs in the server's own thread: none).
    pub round_trips: Counter,
    full: Counter,
    normal: Counter,
}

impl Default for WriteCounters {
    fn default() -> Self {
        let commits = Family::<SyncLabel, Counter>::default();
        let full = commits.get_or_create(&SyncLabel { sync: "full" }).clone();
        let normal = commits.get_or_create(&SyncLabel { sync: "normal" }).clone();
        Self {
            commits,
            jobs: Counter::default(),
            round_trips: Counter::default(),
            full,
            normal,
        }
    }
}

impl WriteCounters {
    /// A transaction ran `jobs` jobs, synced to stable storage if `durable`.
    pub fn ran(&self, durable: bool, jobs: usize) {
        if durable { &self.full } else { &self.normal }.inc();
        self.jobs.inc_by(jobs as u64);
    }
}

//! What the client tasks of one run measured, and how they are merged.

use std::time::Duration;

use tokio::task::{AbortHandle, JoinHandle};

/// What one client task (or, merged, all of them) measured.
#[derive(Default)]
pub struct Stats {
    pub ops: u64,
    pub errors: u64,
    pub lost: u64,
    /// Microseconds per measured operation.
    pub latencies_us: Vec<u64>,
}

impl Stats {
    pub fn record(&mut self, latency: Duration) {
        self.ops += 1;
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.latencies_us.push(us);
    }

    /// Counts an error and backs off a little, so that a dead server does not spin the CPU.
    pub async fn fail(&mut self) {
        self.errors += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    /// Counts an attempt that did not get the lock (contended), with the same back-off.
    pub async fn lose(&mut self) {
        self.lost += 1;
        tokio::time::sleep(Duration::from_millis(5)).await; // a quick 503 must not spin
    }

    fn add(&mut self, other: Stats) {
        self.ops += other.ops;
        self.errors += other.errors;
        self.lost += other.lost;
        self.latencies_us.extend(other.latencies_us);
    }

    /// Nearest-rank percentile in milliseconds (of sorted latencies); NaN when empty.
    pub fn percentile_ms(&self, p: f64) -> f64 {
        let n = self.latencies_us.len();
        let rank = ((p / 100.0) * n as f64).ceil() as usize;
        let us = self.latencies_us.get(rank.clamp(1, n.max(1)) - 1);
        us.map_or(f64::NAN, |&us| us as f64 / 1000.0)
    }
}

/// Aborts the tasks it holds when dropped: when the run that awaits them is dropped
/// (Ctrl-C), its clients stop too (blocking threads end at their deadline).
struct AbortOnDrop(Vec<AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.iter().for_each(AbortHandle::abort);
    }
}

/// Awaits the client tasks (or threads) of one run and merges what they measured.
pub async fn merge(tasks: Vec<JoinHandle<Stats>>, name: &str) -> Stats {
    let _abort = AbortOnDrop(tasks.iter().map(JoinHandle::abort_handle).collect());
    let mut total = Stats::default();
    for task in tasks {
        match task.await {
            Ok(stats) => total.add(stats),
            Err(e) => eprintln!("a {name} client task failed: {e}"),
        }
    }
    total
}

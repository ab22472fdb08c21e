//! `spawn-ref`: the bench's own fork+exec+wait of `/bin/true`, the yardstick of `spawn`.

use std::time::{Duration, Instant};

use crate::report;
use crate::stats::{Stats, merge};

/// fork+exec+wait of `/bin/true` in `c` blocking threads for `seconds`. Prints the
/// `spawn-ref` line; returns its rate. A thread stops at its first failure, which it
/// counts (no sleeping in a thread).
pub async fn spawn_reference(c: usize, seconds: f64) -> f64 {
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
    report::run_line(&mut total, ("spawn-ref", "fork+exec+wait/s"), c, rate, "");
    rate
}

//! The lines the bench prints: one per run (the shape `scripts/bench-compare`
//! parses: `<name> C=<c> <rate> <unit> ...`), the server-side figures appended to
//! it, and one `ratio` line per holdfast store and anchor after each point.

use crate::stats::Stats;

/// Prints one result line for `rate` ops/s, ending with `extra`.
pub fn run_line(stats: &mut Stats, (name, unit): (&str, &str), c: usize, rate: f64, extra: &str) {
    stats.latencies_us.sort_unstable();
    let (p50, p99) = (stats.percentile_ms(50.0), stats.percentile_ms(99.0));
    print!("{name:<19} C={c:>3} {rate:>9.1} {unit:<16}  p50 {p50:>7.2} ms   ");
    println!("p99 {p99:>7.2} ms   errors {}{extra}", stats.errors);
}

/// `   cpu X.XX ms/op`: the server's CPU time (user + system) per measured operation.
pub fn cpu(seconds: f64, ops: u64) -> String {
    if ops == 0 {
        return "   cpu - ms/op".into();
    }
    format!("   cpu {:.2} ms/op", seconds * 1000.0 / ops as f64)
}

/// `   ops/commit X.X`: requests answered per durable commit; `-` without the metric.
pub fn ops_per_commit(requests: u64, commits: Option<f64>) -> String {
    match commits {
        Some(n) if n > 0.0 => format!("   ops/commit {:.1}", requests as f64 / n),
        _ => "   ops/commit -".into(),
    }
}

/// `   rt/op X.X`: sends of write statements per request answered; nothing
/// when none was counted (a build that does not count SQLite's).
pub fn round_trips(requests: u64, trips: f64) -> String {
    if trips <= 0.0 || requests == 0 {
        return String::new();
    }
    format!("   rt/op {:.1}", trips / requests as f64)
}

/// `ratio <workload> C=<c> holdfast/<store> / <anchor> = X.XXx`.
pub fn ratio(workload: &str, c: usize, store: &str, ours: f64, anchor: &str, theirs: f64) {
    let x = ours / theirs;
    println!("ratio {workload} C={c} holdfast/{store} / {anchor} = {x:.2}x");
}

/// `ratio <workload> C=<c> <label> / <baseline> = X.XXx`: a prefilled store
/// against the empty one (`prefilled/<store> / empty`), a fleet against one
/// server (`fleet<N>/<store> / <store>`).
pub fn baseline_ratio(
    (workload, c): (&str, usize),
    label: &str,
    ours: f64,
    base: &str,
    theirs: f64,
) {
    let x = ours / theirs;
    println!("ratio {workload} C={c} {label} / {base} = {x:.2}x");
}

/// `holdfast/<label> rss <when> X MiB`, with its peak and the store's size when known.
pub fn rss(label: &str, when: &str, rss: Option<(f64, f64)>, store_mib: Option<f64>) {
    let Some((now, peak)) = rss else {
        println!("holdfast/{label} rss {when} - MiB (unreadable)");
        return;
    };
    let store = store_mib.map_or(String::new(), |s| format!(", store {s:.1} MiB"));
    println!("holdfast/{label} rss {when} {now:.1} MiB (peak {peak:.1} MiB{store})");
}

//! The two text formats a scrape may ask for. prometheus-client writes
//! OpenMetrics 1.0; a scraper that does not ask for it (curl, an older
//! Prometheus, a parser of the classic format) gets Prometheus text 0.0.4,
//! in which a counter's family is named by its samples (`x_total`), there
//! are no `# UNIT` lines and no `# EOF`.

/// `Content-Type` of each format.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether the scraper's `Accept` asks for OpenMetrics, as Prometheus's
/// does (first, with its highest q), unless it refuses it with `q=0`.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|accept| {
        accept.split(',').any(|range| {
            let mut parts = range.split(';').map(str::trim);
            let is_openmetrics = parts
                .next()
                .is_some_and(|t| t.eq_ignore_ascii_case("application/openmetrics-text"));
            let refused = parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            is_openmetrics && !refused
        })
    })
}

/// OpenMetrics text as Prometheus text 0.0.4.
pub fn classic(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 8 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        match renamed {
            Some(line) => out.push_str(&line),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: &str = "# HELP a_requests Requests.\n# TYPE a_requests counter\n# UNIT a_requests requests\n\
        a_requests_total{code=\"x\"} 3\n# HELP a_up Up.\n# TYPE a_up gauge\na_up 1\n\
        # HELP a_seconds Latency.\n# TYPE a_seconds histogram\na_seconds_sum 0.5\na_seconds_count 1\n\
        a_seconds_bucket{le=\"+Inf\"} 1\n# EOF\n";

    #[test]
    fn counters_are_named_by_their_samples_and_openmetrics_only_lines_go() {
        assert_eq!(
            classic(OPEN),
            "# HELP a_requests_total Requests.\n# TYPE a_requests_total counter\n\
             a_requests_total{code=\"x\"} 3\n# HELP a_up Up.\n# TYPE a_up gauge\na_up 1\n\
             # HELP a_seconds Latency.\n# TYPE a_seconds histogram\na_seconds_sum 0.5\n\
             a_seconds_count 1\na_seconds_bucket{le=\"+Inf\"} 1\n"
        );
    }

    #[test]
    fn openmetrics_is_served_when_asked_for_and_not_refused() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
            version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(wants_openmetrics(Some("Application/OpenMetrics-Text")));
        for classic in [
            None,
            Some("*/*"),
            Some("text/plain"),
            Some("text/plain;version=0.0.4, application/openmetrics-text;q=0"),
        ] {
            assert!(!wants_openmetrics(classic), "{classic:?}");
        }
    }
}

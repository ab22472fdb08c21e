//! The two text formats a scrape may ask for. prometheus-client writes
//! OpenMetrics 1.0; a scraper that does not ask for it (curl, an older
//! Prometheus, a parser of the classic format) gets Prometheus text 0.0.4,
//! in which a counter's family is named by its samples (`x_total`), there
//! are no `# UNIT` lines and no `# EOF`.

/// `Content-Type` of each format.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether the scraper's `Accept` prefers OpenMetrics, as Prometheus's
/// does: named, with a q above 0 and no lower than the classic text's
/// (`text/plain`, `text/*` or `*/*`). A wildcard alone gets the classic text.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    let (mut openmetrics, mut classic) = (0.0_f32, 0.0_f32);
    for range in accept.unwrap_or_default().split(',') {
        let mut parts = range.split(';').map(str::trim);
        let kind = parts.next().unwrap_or_default().to_ascii_lowercase();
        let q = parts
            .find_map(|p| p.strip_prefix("q=")?.parse::<f32>().ok())
            .unwrap_or(1.0);
        match kind.as_str() {
            "application/openmetrics-text" => openmetrics = openmetrics.max(q),
            "text/plain" | "text/*" | "*/*" => classic = classic.max(q),
            _ => {}
        }
    }
    openmetrics > 0.0 && openmetrics >= classic
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
    fn openmetrics_is_served_when_preferred_to_the_classic_text() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
            version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(wants_openmetrics(Some("Application/OpenMetrics-Text")));
        assert!(wants_openmetrics(Some("application/openmetrics-text, */*")));
        for classic in [
            None,
            Some("*/*"),
            Some("text/plain"),
            Some("text/plain;version=0.0.4, application/openmetrics-text;q=0"),
            Some("text/plain;q=1, application/openmetrics-text;q=0.1"),
            Some("application/openmetrics-text;q=0.5, */*"),
        ] {
            assert!(!wants_openmetrics(classic), "{classic:?}");
        }
    }
}

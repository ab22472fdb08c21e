//! Durations on the command line: `250ms`, `30s`, `5m`, `1h`, or a bare
//! integer of milliseconds. Used as a clap value parser, so a bad one is a
//! usage error (exit 2).

use std::time::Duration;

/// A value that begins with `-` reaches this parser (`allow_hyphen_values`)
/// so that `--ttl -5s` is refused as a duration, not as an unknown flag.
pub fn parse(s: &str) -> Result<Duration, String> {
    if s.starts_with("--") {
        return Err(format!(
            "{s:?} is not a duration: give the flag a value first"
        ));
    }
    if s.starts_with('-') {
        return Err(format!(
            "{s:?} is not a duration: a duration cannot be negative"
        ));
    }
    let bad = || format!("{s:?} is not a duration: write 250ms, 30s, 5m, 1h or milliseconds");
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let ms_per_unit = match unit {
        "" | "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(bad()),
    };
    n.checked_mul(ms_per_unit)
        .map(Duration::from_millis)
        .ok_or_else(bad)
}

/// Whole milliseconds, as the API's `*_ms` members take them.
pub fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("1500"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("0"), Ok(Duration::ZERO));
    }

    #[test]
    fn refusals() {
        for bad in [
            "",
            "s",
            "1.5s",
            "-1s",
            "10 s",
            "3d",
            "5sec",
            "99999999999999999999h",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was accepted");
        }
    }
}

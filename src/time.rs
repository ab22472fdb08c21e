//! Wall-clock times are kept as integer milliseconds since the Unix epoch and
//! shown as RFC 3339 UTC strings with millisecond precision.

use chrono::{DateTime, SecondsFormat, Utc};

pub type Millis = i64;

pub fn now_ms() -> Millis {
    Utc::now().timestamp_millis()
}

pub fn rfc3339(ms: Millis) -> String {
    DateTime::<Utc>::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Parse an RFC 3339 time back to milliseconds since the epoch.
pub fn parse_rfc3339(s: &str) -> Option<Millis> {
    DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.timestamp_millis())
}

/// serde adapter for `Millis` fields shown as RFC 3339 strings (the
/// command-line client reads records back with it).
pub mod ser {
    use super::{Millis, parse_rfc3339, rfc3339};
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(ms: &Millis, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&rfc3339(*ms))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Millis, D::Error> {
        let s = String::deserialize(d)?;
        parse_rfc3339(&s).ok_or_else(|| D::Error::custom(format!("{s:?} is not an RFC 3339 time")))
    }

    pub mod option {
        use super::{Millis, rfc3339};
        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(ms: &Option<Millis>, s: S) -> Result<S::Ok, S::Error> {
            match ms {
                Some(ms) => s.serialize_str(&rfc3339(*ms)),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Millis>, D::Error> {
            #[derive(Deserialize)]
            struct Time(#[serde(with = "super")] Millis);
            Ok(Option::<Time>::deserialize(d)?.map(|Time(ms)| ms))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_with_millis() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_000_000_123), "2026-11-30T00:53:20.123Z");
    }

    #[test]
    fn parses_what_it_formats() {
        assert_eq!(
            parse_rfc3339("2026-11-30T00:53:20.123Z"),
            Some(1_796_000_000_123)
        );
        assert_eq!(parse_rfc3339("yesterday"), None);
    }
}

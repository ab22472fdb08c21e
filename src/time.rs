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

/// serde adapter for `Millis` fields shown as RFC 3339 strings.
pub mod ser {
    use super::{Millis, rfc3339};
    use serde::Serializer;

    pub fn serialize<S: Serializer>(ms: &Millis, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&rfc3339(*ms))
    }

    pub mod option {
        use super::{Millis, rfc3339};
        use serde::Serializer;

        pub fn serialize<S: Serializer>(ms: &Option<Millis>, s: S) -> Result<S::Ok, S::Error> {
            match ms {
                Some(ms) => s.serialize_str(&rfc3339(*ms)),
                None => s.serialize_none(),
            }
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
}

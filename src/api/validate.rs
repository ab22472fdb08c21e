//! Bounds on request members, each failure naming the member.

use serde_json::{Map, Value};

use super::error::ApiError;

pub const RESOURCE_MAX: usize = 512;
pub const NAME_MAX: usize = 256;
pub const METADATA_MAX: usize = 16 * 1024;
pub const TTL_MS: std::ops::RangeInclusive<i64> = 1_000..=86_400_000;
pub const WAIT_MS: std::ops::RangeInclusive<i64> = 0..=crate::waiters::MAX_WAIT_MS as i64;

/// A UTF-8 string of 1..=max bytes without control characters.
pub fn text(field: &str, value: &str, max: usize) -> Result<(), ApiError> {
    if value.is_empty() || value.len() > max {
        return Err(ApiError::validation(
            field,
            format!("{field} must be 1 to {max} bytes"),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(ApiError::validation(
            field,
            format!("{field} must not contain control characters"),
        ));
    }
    Ok(())
}

pub fn in_range(
    field: &str,
    value: i64,
    range: std::ops::RangeInclusive<i64>,
) -> Result<(), ApiError> {
    if range.contains(&value) {
        Ok(())
    } else {
        Err(ApiError::validation(
            field,
            format!(
                "{field} must be between {} and {}",
                range.start(),
                range.end()
            ),
        ))
    }
}

pub fn token(field: &str, value: i64) -> Result<(), ApiError> {
    if value < 1 {
        return Err(ApiError::validation(
            field,
            format!("{field} must be a positive integer"),
        ));
    }
    Ok(())
}

pub fn metadata(value: Option<Map<String, Value>>) -> Result<Map<String, Value>, ApiError> {
    let map = value.unwrap_or_default();
    let size = serde_json::to_vec(&map)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if size > METADATA_MAX {
        return Err(ApiError::validation(
            "metadata",
            format!("metadata must be at most {METADATA_MAX} bytes serialized"),
        ));
    }
    Ok(map)
}

/// A lease or process id: ids are UUIDs, anything else names nothing.
pub fn id(kind: &str, value: &str) -> Result<String, ApiError> {
    uuid(value).ok_or_else(|| ApiError::NotFound(format!("no {kind} with id {value:?}")))
}

/// A list filter on an id: as ids are stored, or `422` on `field` when it
/// is no id at all (a filter that could match nothing is a mistake).
pub fn id_filter(field: &str, value: Option<String>) -> Result<Option<String>, ApiError> {
    value
        .map(|v| {
            uuid(&v).ok_or_else(|| {
                ApiError::validation(field, format!("{field} must be an id (a UUID), not {v:?}"))
            })
        })
        .transpose()
}

/// `value` as ids are stored (a hyphenated UUID), if it is a UUID.
pub fn uuid(value: &str) -> Option<String> {
    uuid::Uuid::parse_str(value)
        .ok()
        .map(|u| u.hyphenated().to_string())
}

pub const ARGV_MAX: usize = 256;
pub const ENV_MAX: usize = 256;
pub const ARG_BYTES: usize = 4096;

/// `command.argv`, `command.env` and `command.cwd` of a spawn.
pub fn command(cmd: &crate::model::Command) -> Result<(), ApiError> {
    if cmd.argv.is_empty() || cmd.argv.len() > ARGV_MAX {
        return Err(ApiError::validation(
            "command.argv",
            format!("argv must have 1 to {ARGV_MAX} entries"),
        ));
    }
    for (i, arg) in cmd.argv.iter().enumerate() {
        let field = format!("command.argv.{i}");
        // Only the program must be non-empty; an argument may be "".
        if i == 0 || !arg.is_empty() {
            text(&field, arg, ARG_BYTES)?;
        }
    }
    if cmd.env.len() > ENV_MAX {
        return Err(ApiError::validation(
            "command.env",
            format!("env must have at most {ENV_MAX} entries"),
        ));
    }
    for (key, value) in &cmd.env {
        let field = format!("command.env.{key}");
        text(&field, key, ARG_BYTES)?;
        if key.contains('=') {
            return Err(ApiError::validation(
                field,
                "an environment variable name must not contain '='",
            ));
        }
        if !value.is_empty() {
            text(&field, value, ARG_BYTES)?;
        }
    }
    if let Some(cwd) = &cmd.cwd {
        text("command.cwd", cwd, ARG_BYTES)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_bounds_are_bytes_and_control_characters_are_refused() {
        assert!(text("resource", "a", RESOURCE_MAX).is_ok());
        assert!(text("resource", &"é".repeat(256), RESOURCE_MAX).is_ok());
        assert!(text("resource", &"é".repeat(257), RESOURCE_MAX).is_err());
        assert!(text("resource", "", RESOURCE_MAX).is_err());
        assert!(text("holder", "a\u{7f}", NAME_MAX).is_err());
        assert!(text("holder", "a\nb", NAME_MAX).is_err());
        assert!(text("holder", "run/7", NAME_MAX).is_ok());
    }

    #[test]
    fn ttl_range_is_inclusive() {
        assert!(in_range("ttl_ms", 1_000, TTL_MS).is_ok());
        assert!(in_range("ttl_ms", 86_400_000, TTL_MS).is_ok());
        assert!(in_range("ttl_ms", 999, TTL_MS).is_err());
        assert!(in_range("ttl_ms", 86_400_001, TTL_MS).is_err());
    }
}

//! Value parsers for arguments (a bad value is a usage error, exit 2) and
//! the small conversions the commands share.

use holdfast::model::StateFilter;
use serde::Serialize;
use serde_json::{Map, Value};

use super::error::CliError;

/// `ID:TOKEN`, as `--parent` and `--lease` take a lease.
pub fn id_token(s: &str) -> Result<(String, i64), String> {
    let bad = || format!("{s:?} is not ID:TOKEN (a lease id and its fencing token)");
    let (id, token) = s.rsplit_once(':').ok_or_else(bad)?;
    let token = token.parse().map_err(|_| bad())?;
    if id.is_empty() {
        return Err(bad());
    }
    Ok((id.to_owned(), token))
}

pub fn json_object(s: &str) -> Result<Map<String, Value>, String> {
    match serde_json::from_str(s) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("metadata must be a JSON object, like '{\"ticket\": 7}'".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

/// `current`, `ended` or `all`, named as the API names them.
pub fn state(s: &str) -> Result<StateFilter, String> {
    serde_json::from_value(Value::String(s.to_owned()))
        .map_err(|_| format!("{s:?} is not one of current, ended, all"))
}

/// `K=V`, for `--env`.
pub fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not NAME=VALUE")),
    }
}

/// The name serde gives a unit enum variant (`live`, `pid_absent`).
pub fn name<T: Serialize>(v: T) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        _ => String::new(),
    }
}

/// An id as one path segment: ids are UUIDs, so anything that could step
/// out of the segment is refused rather than escaped.
pub fn path_segment(id: &str) -> Result<&str, CliError> {
    if !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        Ok(id)
    } else {
        Err(CliError::usage(format!("{id:?} is not an id")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values() {
        assert_eq!(id_token("0193-ab:42"), Ok(("0193-ab".into(), 42)));
        assert!(id_token("0193").is_err());
        assert!(id_token(":4").is_err());
        assert!(id_token("a:b").is_err());
        assert!(json_object("[1]").is_err());
        assert!(json_object("{").is_err());
        assert_eq!(json_object("{\"a\":1}").map(|m| m.len()), Ok(1));
        assert_eq!(state("ended"), Ok(StateFilter::Ended));
        assert!(state("gone").is_err());
        assert_eq!(key_value("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert!(key_value("=x").is_err());
        assert!(path_segment("../metrics").is_err());
        assert!(path_segment("").is_err());
    }
}

//! JSON parsed strictly: a member given twice is refused instead of the
//! last one silently winning.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// A JSON value whose objects have no duplicate member names.
pub struct Strict(pub Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate member `{key}`")));
            }
            let Strict(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

/// `path` as the contract spells a member: dotted, an array's element by
/// its index (`command.argv.0`, not serde's `command.argv[0]`); "" for the
/// body itself.
pub fn dotted(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let parts: Vec<String> = path
        .iter()
        .map(|s| match s {
            Segment::Seq { index } => index.to_string(),
            Segment::Map { key } => key.clone(),
            Segment::Enum { variant } => variant.clone(),
            Segment::Unknown => "?".to_owned(),
        })
        .collect();
    parts.join(".")
}

/// Parse `bytes` strictly. Err(None) for bad syntax, Err(Some(path)) for a
/// duplicate member at that path.
pub fn parse(bytes: &[u8]) -> Result<Value, (Option<String>, String)> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize::<_, Strict>(&mut de).map_err(|e| {
        let parent = dotted(e.path());
        let inner = e.into_inner();
        let message = inner.to_string();
        let dup = inner.classify() == serde_json::error::Category::Data;
        // The error is raised at the object holding the duplicate: name the member.
        let name = message.split('`').nth(1).unwrap_or_default();
        let path = if parent.is_empty() {
            name.to_owned()
        } else {
            format!("{parent}.{name}")
        };
        (dup.then_some(path), message)
    })?;
    de.end().map_err(|e| (None, e.to_string()))?;
    Ok(value.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_are_found_at_any_depth() {
        assert!(parse(br#"{"a":1,"b":{"c":2}}"#).is_ok());
        let (path, msg) = parse(br#"{"a":1,"a":2}"#).expect_err("dup");
        assert_eq!(path.as_deref(), Some("a"), "{msg}");
        let (path, _) = parse(br#"{"o":{"x":1,"x":1}}"#).expect_err("dup");
        assert_eq!(path.as_deref(), Some("o.x"));
        let (path, _) = parse(br#"{"a":"#).expect_err("syntax");
        assert_eq!(path, None);
        assert!(parse(b"[1] x").is_err(), "trailing data");
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(parse(deep.as_bytes()).is_err(), "nesting is bounded");
    }
}

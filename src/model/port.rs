//! Port reservations.

use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::TokenRef;
use crate::time::Millis;

/// Who holds a port: exactly one of `process` or `lease`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PortOwner {
    pub process: Option<TokenRef>,
    pub lease: Option<TokenRef>,
}

impl PortOwner {
    pub fn kind(&self) -> &'static str {
        if self.process.is_some() {
            "process"
        } else {
            "lease"
        }
    }
    pub fn target(&self) -> Option<&TokenRef> {
        self.process.as_ref().or(self.lease.as_ref())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[schema(as = PortReservation)]
pub struct PortRecord {
    #[schema(format = "uuid")]
    pub id: String,
    #[schema(example = 23817)]
    pub port: u16,
    #[schema(example = "http")]
    pub name: String,
    pub owner: PortOwner,
    pub host_id: String,
    #[serde(with = "crate::time::ser")]
    #[schema(value_type = String, format = DateTime)]
    pub reserved_at: Millis,
    #[serde(with = "crate::time::ser::option")]
    #[schema(value_type = Option<String>, format = DateTime)]
    pub released_at: Option<Millis>,
}

/// Where ports are looked for when the caller gives no range.
pub const DEFAULT_PORT_RANGE: RangeInclusive<u16> = 20000..=29999;
/// The bounds a requested range must stay within.
pub const PORTS_ALLOWED: RangeInclusive<u16> = 1024..=65535;

/// `[a-z][a-z0-9_]{0,31}`: it becomes `PORT_<NAME>` in a child's environment.
pub fn valid_port_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && name.len() <= 32
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// The environment variable that carries the port named `name`.
pub fn port_env_var(name: &str) -> String {
    format!("PORT_{}", name.to_ascii_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["http", "a", "debug_2", &"x".repeat(32)] {
            assert!(valid_port_name(ok), "{ok}");
        }
        for bad in ["", "Http", "2x", "a-b", "a b", &"x".repeat(33), "é"] {
            assert!(!valid_port_name(bad), "{bad}");
        }
        assert_eq!(port_env_var("debug_2"), "PORT_DEBUG_2");
    }
}

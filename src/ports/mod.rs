//! Port reservations: names mapped to ports that no other current
//! reservation on this host holds and that bind on 127.0.0.1 when reserved.

pub mod ops;

use crate::store::in_tx;
use std::ops::RangeInclusive;

/// Where ports are looked for when the caller gives no range.
pub const DEFAULT_RANGE: RangeInclusive<u16> = 20000..=29999;
/// The bounds a requested range must stay within.
pub const ALLOWED: RangeInclusive<u16> = 1024..=65535;

/// `[a-z][a-z0-9_]{0,31}`: it becomes `PORT_<NAME>` in a child's environment.
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && name.len() <= 32
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// The environment variable that carries the port named `name`.
pub fn env_var(name: &str) -> String {
    format!("PORT_{}", name.to_ascii_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for ok in ["http", "a", "debug_2", &"x".repeat(32)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "Http", "2x", "a-b", "a b", &"x".repeat(33), "é"] {
            assert!(!valid_name(bad), "{bad}");
        }
        assert_eq!(env_var("debug_2"), "PORT_DEBUG_2");
    }
}

/// Runs port mutations for this host.
#[derive(Clone)]
pub struct Ports {
    store: crate::store::Store,
    host: std::sync::Arc<dyn crate::host::Host>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("port request refused: {0:?}")]
    Port(ops::PortError),
}

impl Ports {
    pub fn new(store: crate::store::Store, host: std::sync::Arc<dyn crate::host::Host>) -> Self {
        Self { store, host }
    }

    pub fn host_id(&self) -> String {
        self.host.local().host_id.clone()
    }

    pub async fn reserve(
        &self,
        owner: crate::model::PortOwner,
        names: Vec<String>,
        range: RangeInclusive<u16>,
    ) -> Result<Vec<crate::model::PortRecord>, Error> {
        let host_id = self.host_id();
        in_tx!(self, true, |tx, cx| ops::reserve(
            tx, cx, &host_id, owner, names, range
        ))?
        .map_err(Error::Port)
    }

    pub async fn release(&self, port: u16, token: i64) -> Result<crate::model::PortRecord, Error> {
        let host_id = self.host_id();
        in_tx!(self, true, |tx, cx| ops::release(
            tx, cx, &host_id, port, token
        ))?
        .map_err(Error::Port)
    }
}

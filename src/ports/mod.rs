//! Port reservations: names mapped to ports that no other current
//! reservation on this host holds and that bind on 127.0.0.1 when reserved.

pub mod ops;

use crate::tx::in_tx;
use std::ops::RangeInclusive;

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

    pub async fn release(
        &self,
        port: u16,
        token: i64,
        owner_id: Option<String>,
    ) -> Result<crate::model::PortRecord, Error> {
        let host_id = self.host_id();
        in_tx!(self, true, |tx, cx| ops::release(
            tx,
            cx,
            &host_id,
            port,
            token,
            owner_id.as_deref()
        ))?
        .map_err(Error::Port)
    }
}

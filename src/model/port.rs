//! Port reservations.

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
